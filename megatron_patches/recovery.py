"""The rollback protocol: replay, then roll back to the newest healthy target with a lower
learning rate and the offending samples blacklisted, within a retry budget.

Two executors share the :class:`~megatron_patches.ledger.Ledger` kept next to the checkpoints:

* in-process (:class:`InProcessRecovery`): loops handing over their state through the small
  :class:`TrainingLoop` protocol (the tiny-GPT harness) roll back to in-memory snapshots
  (:class:`~megatron_patches.snapshots.LoopSnapshots`, as Megatron-LM's loop does) or a newer
  checkpoint; one incident runs as a chain of small steps, each mapping a frozen :class:`Episode`;
* exit-and-restart (:class:`ExitAndRestart`): every rank exits with ``response.exit_codes.rollback``
  (84) after rank 0 wrote the ledger; the next start reads it (``Ledger.load``) and resumes.

The in-process chain (:data:`IN_PROCESS_STEPS`), as pseudocode::

    episode = Episode(step, decision, samples)      # decision: the same on every rank
    replay          # decision.replay: deterministic (samples that reproduced it) | transient
    classify        # the cause: data | hardware | numerics | software | unknown (cause.classify)
    follow_cause    # software -> a stop with the evidence; hardware, held state corrupt -> roll back now
    blacklist       # data, unknown: what reproduced it; on a rollback with blacklist: always, the episode's samples
    count_device    # hardware: the device counted in the ledger; response.hardware_repeat of them -> fence
    refuse_repeat   # rollback: one that would redo the last to no purpose (same step, nothing cut) -> critical
    restore_target  # rollback: the newest certified snapshot or healthy checkpoint not disqualified; none -> critical
    cut_lr          # rollback: ledger count + 1, lr_scale = max(lr_scale * lr_factor, lr_floor)
    safe_mode       # rollback: switch off recovery.disable_features (and the later stages')
    record_rollback # rollback: the ledger's event, saved; grading starts afresh
    publish         # the incident's record, with the outcome, written once (rank 0)
    stop            # a stop or fence decision (or one the chain escalated): every rank exits

A loop that restores from somewhere else composes its own chain from the same steps. Both
executors end the process through ``monitor.exit(decision)``, which takes the exit code from
:func:`megatron_patches.decisions.exit_code`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Callable, Optional, Protocol

from . import collectives, forward_origin, safe_mode
from .callbacks import Callback
from .cause import Cause
from .cause_response import blames_samples, cause_of, classify_step, count_device, follow_cause, restore_target, settle_cause
from .decisions import Action, Decision, exit_code
from .incidents import IN_MEMORY, Incident, Outcome
from .ledger import Ledger
from .protocols import Guard
from .snapshots import LoopSnapshots

log = logging.getLogger("megatron_patches")


class TrainingLoop(Protocol):
    """What a custom megatron-core loop hands to :class:`InProcessRecovery`."""

    checkpoint_root: str

    def load_checkpoint(self, path: str) -> int:
        """Restore model, optimizer, scheduler, RNG and data position; return the saved step."""

    def replay_step(self, step: int) -> dict:
        """Re-run ``step``'s forward/backward (same micro-batches and RNG) and its check, no update:
        ``{"flagged": bool, "first": name or None, "bad_samples": [...]}`` (same on all ranks)."""

    def set_lr_scale(self, scale: float) -> None:
        """Scale the learning-rate schedule by ``scale`` of its original values."""

    def set_blacklist(self, samples: list) -> None:
        """Never feed these sample indices again."""

    def disable_feature(self, name: str) -> None:
        """Switch off a feature named in ``recovery.disable_features``."""

    def live_tensors(self) -> list:
        """Every tensor of this rank's training state, in a fixed order (what a snapshot copies)."""

    def state_values(self) -> dict:
        """Copies of the rest (scheduler, RNG, data position, guard baselines), for ``restore_values``."""

    def restore_values(self, values: dict) -> None: ...


@dataclass(frozen=True)
class Episode:
    """One incident on its way through the recovery steps (the same on every rank)."""

    step: int
    decision: Decision
    """The guard's decision; a step may escalate it (no target to roll back to: a critical stop)."""
    samples: tuple = ()
    """The samples this rank fed in the incident's step."""
    outcome: Outcome = Outcome()
    """What the steps made of the incident so far, published with its record."""
    reproduced: tuple = ()
    """Samples the replay reproduced the fault with."""
    switched_off: tuple = ()
    """Features this rollback switches off for the first time."""
    resume_at: Optional[int] = None
    """After a rollback: the step the loop goes on from."""
    cause: Optional[Cause] = None
    """The incident's cause (:func:`~megatron_patches.cause_response.classify_step`)."""

    @property
    def rolls_back(self) -> bool:
        return self.decision.action == Action.ROLLBACK


RecoveryStep = Callable[["InProcessRecovery", Episode], Episode]
"""One step of the chain: what it may touch is the executor (its loop, ledger and monitor)."""


def replay(run: "InProcessRecovery", episode: Episode) -> Episode:
    """Replay the step with every module's output and gradient watched: deterministic (the
    samples that reproduced it) or transient (the ranks suspected), and where the forward pass,
    else the backward pass, first went non-finite."""
    if not episode.decision.replay:
        return episode
    monitor = run.monitor
    monitor.set_step(episode.step)  # the replayed forward is this step again (forward drills)
    with forward_origin.ForwardTrace(monitor.state.model_chunks.modules(), monitor.state.seams.parallel_state()) as trace:
        again = run.loop.replay_step(episode.step)
    origin, backward = forward_origin.gather_origin(trace, monitor.state.peers)
    incident = monitor.state.last_incident
    if again["flagged"]:
        first = incident.first_name if incident is not None else None
        bad = set(again["bad_samples"])
        verdict = {"verdict": "deterministic", "same_parameter": again["first"] == first, "first": again["first"],
                   "narrowed": bool(bad) and len(bad) < len(set(episode.samples))}
        reproduced = tuple(again["bad_samples"] or episode.samples)
    else:
        ranks = sorted(set(incident.ranks_affected)) if incident is not None else []
        verdict = {"verdict": "transient", "suspected_ranks": list(episode.decision.origins) or ranks}
        reproduced = ()
    outcome = replace(episode.outcome, replay=verdict, forward_origin=origin, backward_origin=backward)
    return replace(episode, outcome=outcome, reproduced=reproduced)


def blacklist(run: "InProcessRecovery", episode: Episode) -> Episode:
    """The samples never to feed again where the cause is data or unknown: those the replay
    reproduced the fault with, and on a rollback under ``blacklist: always`` every sample of the
    episode (no sample of a hardware, numerics or software cause: they are innocent). Outside a
    rollback they go into the ledger now (a rollback records them with its own count)."""
    samples = set()
    if blames_samples(episode):
        samples = set(episode.reproduced)
        if episode.rolls_back and run.config.blacklist == "always":
            samples |= set(run.episode_samples)
    episode = replace(episode, outcome=replace(episode.outcome, blacklisted=tuple(sorted(samples))))
    if samples and not episode.rolls_back:
        run.ledger.blacklist = sorted(set(run.ledger.blacklist) | samples)
        run.loop.set_blacklist(run.ledger.blacklist)
        run.save_ledger()
    return episode


def refuse_repeat(run: "InProcessRecovery", episode: Episode) -> Episode:
    """A rollback that would redo the last one to no purpose becomes a critical stop: the anomaly
    came back at the same step after it, and this one would change nothing that could help (the
    same learning-rate scale, no feature switched off: ``lr_factor`` 1 or the floor reached; other
    samples only where the last redo did not already feed other samples and meet it anyway), so
    its redo would meet it again, rollback after rollback until the retry budget ran out."""
    outcome, ledger = episode.outcome, run.ledger
    if not episode.rolls_back or not ledger.would_repeat(run.config, episode.step, outcome.blacklisted,
                                                         outcome.iterations_skipped):
        return episode
    last = ledger.events[-1]
    data = ("though its redo fed other samples, so the data is not the cause" if last.get("blacklisted")
            else "and no sample would be left out")
    stop = episode.decision.escalated(
        f"rollback {ledger.rollbacks + 1} would redo rollback {ledger.rollbacks} to no purpose: the anomaly came back "
        f"at step {episode.step} after it, {data}, and the learning-rate scale ({ledger.lr_scale:.3g}) and the "
        f"features would stay as they are; the state at step {last['rolled_back_to']} may carry it "
        "(recovery.lr_factor below 1 gives the redo a lower learning rate)")
    return replace(episode, decision=stop, outcome=replace(outcome, decision=stop))


def cut_lr(run: "InProcessRecovery", episode: Episode) -> Episode:
    """One more rollback in the ledger: its count, the blacklist, the learning-rate scale
    (``lr_factor``, never under ``lr_floor``), and the features it switches off."""
    if not episode.rolls_back:
        return episode
    new = run.ledger.record_rollback(run.config, list(episode.outcome.blacklisted))
    run.loop.set_blacklist(run.ledger.blacklist)
    run.loop.set_lr_scale(run.ledger.lr_scale)
    return replace(episode, outcome=replace(episode.outcome, lr_scale=run.ledger.lr_scale), switched_off=tuple(new))


def safe_mode_step(run: "InProcessRecovery", episode: Episode) -> Episode:
    """Switch off, in the loop, the features this rollback turned off (:mod:`~megatron_patches.safe_mode`)."""
    for name in safe_mode.expand(list(episode.switched_off)):
        run.loop.disable_feature(name)
    return episode


def record_rollback(run: "InProcessRecovery", episode: Episode) -> Episode:
    """The rollback's event in the ledger, saved; the guard's grading starts a new episode."""
    if not episode.rolls_back:
        return episode
    ledger, outcome = run.ledger, episode.outcome
    extra = {"skip_iterations": list(outcome.iterations_skipped)} if outcome.iterations_skipped else {}
    if outcome.certified_at is not None:  # an in-memory target: when it became one
        extra["target_certified_at"] = outcome.certified_at
    ledger.events.append({"step": episode.step, "rolled_back_to": outcome.rolled_back_to,
                          "lr_scale": ledger.lr_scale, "blacklisted": len(outcome.blacklisted),
                          "reason": episode.decision.reason, "cause": cause_of(episode), **extra})
    run.save_ledger()
    run.monitor.new_episode(ledger.rollbacks)
    run.episode_samples = []
    target = "in-memory snapshot" if outcome.checkpoint == IN_MEMORY else f"healthy checkpoint {outcome.checkpoint}"
    left_out = f", iterations {list(outcome.iterations_skipped)} skipped" if outcome.iterations_skipped else ""
    if collectives.rank() == 0:  # the blacklist is rank 0's (it gathers the episode's samples)
        log.warning("rolled back from step %d to %s (step %d); lr scale %.3g; %d samples blacklisted%s; "
                    "rollback %d of %d", episode.step, target, outcome.rolled_back_to, ledger.lr_scale,
                    len(outcome.blacklisted), left_out, ledger.rollbacks, run.config.max_rollbacks)
    return episode


def publish(run: "InProcessRecovery", episode: Episode) -> Episode:
    """Hand the outcome to the guard: rank 0 writes the incident's record with it, once."""
    run.monitor.resolve(episode.outcome)
    return episode


def stop(run: "InProcessRecovery", episode: Episode) -> Episode:
    """A stop or fence decision, or one a step escalated: every rank ends here (``monitor.exit``)."""
    if episode.decision.action in (Action.STOP, Action.FENCE):
        run.monitor.exit(episode.decision)
    return episode


IN_PROCESS_STEPS: tuple[RecoveryStep, ...] = (
    replay, classify_step, follow_cause, blacklist, count_device, refuse_repeat, restore_target, cut_lr,
    safe_mode_step, record_rollback, publish, stop)
"""The in-process chain, in order (the module's pseudocode)."""


def save_in_process(ledger: Ledger, root: str, rank: int) -> None:
    """An in-process executor's ledger write: rank 0 only, so a failure must not raise (the
    others go on to the next collective). The process holds the ledger in memory and goes on
    with it; a later restart would not know this rollback (its blacklist, LR scale and count)."""
    if rank == 0:
        try:
            ledger.save(root)
        except OSError as error:
            log.warning("the ledger could not be written (%s): training goes on with it in memory, but "
                        "a restart would not know this rollback, its blacklist or LR scale", error)


class InProcessRecovery:
    """Acts on the monitor's decisions inside the training loop, one incident at a time, through
    ``steps`` (default :data:`IN_PROCESS_STEPS`)."""

    in_process = True
    replays = True
    ledger_path: Optional[str] = None  # records name no ledger: an in-process rollback is in its outcome

    def __init__(self, monitor: Guard, loop: TrainingLoop, steps: tuple[RecoveryStep, ...] = IN_PROCESS_STEPS):
        self.monitor = monitor
        self.loop = loop
        self.steps = steps
        self.config = monitor.state.config.recovery
        self.ledger = Ledger.load(loop.checkpoint_root)
        self.episode_samples: list = []
        """Every sample fed since the last rollback's incident (``blacklist: always``)."""
        self.snapshots = LoopSnapshots(monitor, loop)  # rollback targets; a checkpoint where newer
        monitor.attach(self, self.ledger.rollbacks)
        loop.set_blacklist(self.ledger.blacklist)
        loop.set_lr_scale(self.ledger.lr_scale)

    def after_step(self, step: int, batch_samples: list) -> Optional[int]:
        """Every rank, after each optimizer step: the step to continue from after a rollback, else None."""
        decision = self.monitor.take_decision()
        if decision is not None:
            self.episode_samples += batch_samples
            episode = Episode(step, decision, tuple(batch_samples))
            for run_step in self.steps:
                episode = run_step(self, episode)
            if episode.resume_at is not None:
                return episode.resume_at
        self.snapshots.after_step(step)
        return None

    def save_ledger(self) -> None:
        save_in_process(self.ledger, self.loop.checkpoint_root, collectives.rank())

    def settle_exit(self, decision: Decision) -> Decision:
        return decision  # nothing to write before an exit: the ledger was saved at each rollback


class ExitAndRestart(Callback):
    """For loops that cannot be re-entered (Megatron-LM's ``pretrain_gpt.py``): on a rollback
    decision rank 0 writes the ledger and every rank exits with ``response.exit_codes.rollback``; the launcher
    restarts the job, which loads the newest healthy checkpoint and applies the ledger. The one
    writer of that ledger; ``request_fields`` (the integration's) adds to its rollback request,
    told whether the incident's cause blacklists its samples (data or unknown)."""

    in_process = False
    replays = False

    def __init__(self, monitor: Guard, checkpoint_root: str,
                 request_fields: Optional[Callable[[bool], dict]] = None):
        self.monitor = monitor
        self.checkpoint_root = checkpoint_root
        self.ledger_path = os.path.abspath(Ledger.path(checkpoint_root))
        """Named in each rollback's record, so that ``report`` finds the restart's outcome."""
        self.config = monitor.state.config.recovery
        self.ledger = Ledger.load(checkpoint_root)
        self._request_fields = request_fields
        self.episode_samples: list = []
        """Rank 0: every rank's samples of this episode's incidents (``blacklist: always``)."""
        monitor.state.drills.spend(self.ledger.spent_injections)
        monitor.add_callback(self)
        monitor.attach(self, self.ledger.rollbacks)

    def wants_replay(self, decision: Decision) -> bool:
        """A rollback's record waits for :meth:`settle_exit`: its cause may make it a fence."""
        return decision.action == Action.ROLLBACK

    def on_decision(self, decision: Decision, incident: Optional[Incident]) -> None:
        """Rank 0 collects the episode's samples from the incident (every rank's)."""
        if incident is not None and incident.batch is not None:  # rank 0, with every rank's samples
            self.episode_samples += incident.batch.get("samples", [])

    def settle_exit(self, decision: Decision) -> Decision:
        """Rank 0 writes the ledger for the restart. Where it cannot, a restart would resume
        without knowing why (no LR scale, no blacklist, no count against the budget): rank 0
        then stops critically instead, which no launcher takes for a rollback."""
        codes = self.monitor.state.config.response.exit_codes
        if exit_code(decision, codes) != codes.rollback:
            return decision
        fired = self._fired_anywhere()  # every rank: the drills a restart must not rehearse again
        # Every rank: the cause from the signs (no replay here), the device counted, a fence where due.
        decision, cause, blacklisting = settle_cause(self.ledger, decision, self.monitor.state.config, collectives.rank())
        if collectives.rank() != 0:
            return decision
        self.ledger.spent_injections = sorted(set(self.ledger.spent_injections) | fired)
        if decision.action == Action.FENCE:
            self._save_event(f"the fence of host {self.ledger.fenced['host']} device {self.ledger.fenced['device']}")
            self.monitor.resolve(Outcome(cause=cause, decision=decision))  # the held record, now a fence
            return decision
        samples = self.episode_samples if self.config.blacklist == "always" and blacklisting else []
        self.monitor.resolve(Outcome(cause=cause, blacklisted=tuple(samples)))
        # The loop that reads the ledger at start-up switches the features off.
        self.ledger.record_rollback(self.config, samples)
        fields = self._request_fields(blacklisting) if self._request_fields is not None else {}
        self.ledger.rollback_requested = {"from_step": self.monitor.state.clock.step, **fields}
        self.ledger.events.append({"step": self.monitor.state.clock.step, "exit": codes.rollback, "lr_scale": self.ledger.lr_scale,
                                   "blacklisted": len(samples), "cause": cause.klass,
                                   **({"skip_iterations": fields["skip_iterations"]} if "skip_iterations" in fields else {})})
        try:
            self.ledger.save(self.checkpoint_root)
        except OSError as error:
            log.error("the ledger could not be written (%s): a restart would not know this rollback; "
                      "stopping with %d instead of asking for one", error, codes.critical)
            return decision.escalated("the ledger could not be written")
        return decision

    def _fired_anywhere(self) -> set:
        """The drills that fired on any rank (a drill bound to rank 1 fired there only), gathered to
        rank 0 over the guard's bounded group; a peer that does not answer leaves this rank's own."""
        mine = self.monitor.state.drills.fired_specs()
        try:
            every = collectives.gather_to_zero(mine, self.monitor.state.peers)
        except collectives.PeerLost:
            every = [mine]
        return {spec for specs in every for spec in specs}

    def megatron_exit(self, step: int, code: int, state: str, fired: list[str]) -> None:
        """Megatron ends the job itself (its rerun machine's exit ``code`` from ``state``) at
        ``step``: an event of its own in the ledger (``megatron_exit``, not ``exit``: it is no
        rollback and counts against no budget), and the drills that fired on any rank
        (``fired``) are spent, as at a rollback, so the restart Megatron asks for does not
        rehearse them again. A ledger that cannot be written costs only the event: Megatron's
        exit goes ahead."""
        self.ledger.events.append({"step": step, "megatron_exit": code, "state": state})
        self.ledger.spent_injections = sorted(set(self.ledger.spent_injections) | set(fired))
        self._save_event(f"Megatron's exit {code}")

    def megatron_rerun_left(self, step: int) -> None:
        """Megatron's rerun of ``step`` from its checkpoint is left undone (it would repeat on the
        same node and device): an event that also skips ``step`` at this and every later restart."""
        self.ledger.events.append({"step": step, "megatron_rerun": "left: same node and device",
                                   "skip_iterations": [step]})
        self._save_event(f"the skip of iteration {step}")

    def _save_event(self, what: str) -> None:
        """Rank 0 writes the ledger with an event the job goes on without when it cannot be written."""
        if collectives.rank() == 0:
            try:
                self.ledger.save(self.checkpoint_root)
            except OSError as error:
                log.warning("the ledger could not record %s (%s)", what, error)

    def resumed(self, event: dict) -> None:
        """The restart resumed as the ledger asked: the request is done (rank 0 writes it)."""
        self.ledger.rollback_requested = None
        self.ledger.events.append(event)
        if collectives.rank() == 0:
            self.ledger.save(self.checkpoint_root)
