"""A rollback in Megatron-LM's loop without leaving the processes (``recovery.mode: in_process``).

Megatron's ``train()`` keeps its iteration count and data iterator in local variables, so the loop
itself cannot be moved back. The rollback happens inside the ``train_step`` call that brought the
decision instead: every rank restores the newest certified in-memory snapshot (:mod:`megatron_patches.snapshots`),
runs Megatron's own ``train_step`` again for each iteration since, on the very batches those iterations
read (:class:`BatchTape`), and hands ``train()`` the last one's result; ``train()`` goes on from its own
iterator, which stands where an uninterrupted run's would. Protocol, per rank::

    every iteration        tape the batches the iteration reads; after it, a snapshot every
                           recovery.snapshot_interval iterations; each check certifies or drops
    rollback decision      the ranks agree on the newest snapshot all of them hold certified
      none newer than the newest healthy checkpoint, a feature that cannot switch off in place,
      a loop whose iterator is not taped  -> one line, then exit 84 and restart (as mode restart)
    restore                parameters, optimizer state, scheduler, loss scaler, RNG, rerun
                           machine, the guard's baselines (copied back in place)
    the recovery steps     blacklist, a rollback that would redo the last unchanged -> a critical
                           stop, cut the LR, safe mode (dropout), ledger event, record
    redo                   iterations snapshot+1 .. decision, each from its taped batches
                           (blacklisted ones left out); a new rollback or stop there -> restart

Only this module knows Megatron-LM's arguments and classes; the chain's steps are :mod:`megatron_patches.recovery`'s.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import sys
import time
from dataclasses import replace
from typing import Any, Callable, NoReturn, Optional

import torch

from ... import collectives, recovery, safe_mode, snapshots
from ...callbacks import Callback
from ...cause_response import blames_samples, classify_step, count_device
from ...decisions import Action, Decision
from ...detectors import target_taken
from ...incidents import IN_MEMORY, Incident, Outcome
from ...ledger import Ledger
from ...protocols import Guard
from ...recovery import Episode
from .. import start_line
from .checkpoints import DIVERGED, diverged_since, newest_healthy_iteration, warn0
from .poison import reading
from .rollback import Rollback, scale_group_bounds, scale_scheduler_bounds
from .state import after_restore, install_tapes, live_tensors, restore_values, small_values, snapshot_bytes

log = logging.getLogger("megatron_patches")

IN_PLACE_FEATURES = ("dropout",)
"""Safe-mode features switched off in the live model; any other one needs a rebuilt model (restart)."""

# --- the loop's counters ---------------------------------------------------------------------------


class LoopCounters:
    """Where a loop keeps the counters a redo moves back and restores, and its ``train_step``'s argument
    names: Megatron-LM's (its args) here; Megatron-Bridge's loop subclasses it (:mod:`..megatron_bridge`)."""

    scheduler_argument = "opt_param_scheduler"
    """The name of ``train_step``'s learning-rate scheduler argument."""

    def get(self) -> tuple[int, int]:
        """(iterations done before the one running, consumed training samples)."""
        from megatron.training import get_args

        args = get_args()
        return int(args.curr_iteration), int(args.consumed_train_samples)

    def set(self, done: int, consumed: int) -> None:
        from megatron.training import get_args

        args = get_args()
        args.curr_iteration, args.consumed_train_samples = done, consumed

    def total(self) -> int:
        """The iterations the run trains (for the redo's log lines)."""
        from megatron.training import get_args

        return int(get_args().train_iters)


# --- the executor ----------------------------------------------------------------------------------


class InProcessRollback(Callback):
    """The executor of Megatron-LM's loop under ``recovery.mode: in_process``: snapshots, and a
    rollback made in the same processes (the module's protocol). What it cannot do in process it
    hands to the exit-and-restart executor beside it (``restart``), which keeps the ledger."""

    in_process = True
    replays = False

    def __init__(self, monitor: Guard, rollback: Rollback, before_step: Callable[[Any, Any], None],
                 counters: Optional[LoopCounters] = None, restartable: bool = True,
                 after_step: Callable[[dict], None] = lambda arguments: None):
        """``rollback``: the ledger's side of this process (its exit-and-restart executor, and the episode's
        iterations and samples it collects); ``before_step(optimizer, scheduler)`` and ``after_step(arguments)``:
        what the loop integration does before and after each ``train_step`` (tell the guard the iteration and
        batch; a skipped step's replay), again for each redone one; ``counters``: the loop's (Megatron-LM's
        by default); ``restartable``: False without a checkpoint directory (no fall-back to a restart then)."""
        self.monitor = monitor
        self.counters = counters or LoopCounters()
        self.rollback = rollback
        self.restart = rollback.restart
        self.before_step, self.after_step = before_step, after_step
        self.restartable = restartable
        self.config = monitor.state.config.recovery
        self.ledger_path = self.restart.ledger_path
        """Named in the records: a rollback that falls back to a restart has its outcome there."""
        self.store = snapshots.SnapshotStore(self.config.snapshot_interval, self.config.snapshots_kept,
                                             self.config.certify_steps)
        self.loop = LiveLoop(self)
        self._tapes: Optional[list] = None
        self._consumed: dict[int, int] = {}  # consumed_train_samples at the start of each taped iteration
        self._call: Optional[tuple] = None  # (train_step, its bound arguments) of the call that brought the decision
        self._result: Any = None
        self._iterations = 0  # train_step calls seen (for the snapshots' cost line at exit)
        self.applied_scale = self.restart.ledger.lr_scale
        """The learning-rate scale the live param groups and scheduler carry."""
        self._expected_bytes: Optional[int] = None  # this rank's snapshot size reckoned at start (memory_bound)
        self._suspect_since: Optional[int] = None
        """Rank 0: the earliest step this episode's replica divergence may date from (no target after it)."""
        monitor.add_callback(self)
        monitor.attach(self, self.restart.ledger.rollbacks)

    @property
    def ledger(self) -> Ledger:
        return self.restart.ledger

    @property
    def episode_samples(self) -> list:
        """Rank 0: the episode's samples, one list with the restart executor's (it ends for a restart too)."""
        return self.restart.episode_samples

    @episode_samples.setter
    def episode_samples(self, samples: list) -> None:
        self.restart.episode_samples = samples

    def save_ledger(self) -> None:
        recovery.save_in_process(self.ledger, self.restart.checkpoint_root, collectives.rank())

    def settle_exit(self, decision: Decision) -> Decision:
        """A stop, or a rollback made by a restart: the exit-and-restart executor writes the ledger."""
        return self.restart.settle_exit(decision)

    # -- the monitor's events ----------------------------------------------------------------------

    def after_check(self, step: int, flagged: bool) -> None:
        self.store.note_check(step, flagged)

    def on_decision(self, decision: Decision, incident: Optional[Incident]) -> None:
        """Rank 0 dates a replica divergence (``rollback`` and its executor collect the episode)."""
        if incident is not None and DIVERGED in incident.kinds:  # when could it have begun?
            since = diverged_since(self.monitor.state.config, int(decision.step))
            self._suspect_since = since if self._suspect_since is None else min(self._suspect_since, since)

    def wants_replay(self, decision: Decision) -> bool:
        """A rollback's record waits for its outcome (target, LR, iterations left out)."""
        return decision.action == Action.ROLLBACK

    # -- around each train_step ----------------------------------------------------------------------

    def before_iteration(self, iteration: int, data_iterator: Any, consumed: int) -> None:
        """Tape what ``iteration`` (as Megatron logs it) reads; its writes wait for a snapshot's copies."""
        self.store.fence()
        if self._tapes is None:
            self._tapes = install_tapes(data_iterator)
        for tape in self._tapes or ():
            tape.iteration = iteration
        self._consumed[iteration] = consumed

    def after_iteration(self, iteration: int, wrapped: Callable, bound: inspect.BoundArguments, result: Any) -> Any:
        """After Megatron's ``train_step`` for ``iteration``: a snapshot when one is due, or the
        decision acted on (a rollback returns the redone iteration's result for ``train()``)."""
        for tape in self._tapes or ():
            tape.iteration = None
        self._iterations += 1
        decision = self.monitor.take_decision()
        if decision is None or decision.action not in (Action.ROLLBACK, Action.STOP):
            if not _skipped(result):
                self._snapshot(iteration, bound)
            return result
        self._call, self._result = (wrapped, bound), result
        episode = Episode(decision.step, decision)
        for step in IN_PROCESS_CHAIN:
            episode = step(self, episode)
        self.rollback.episode_steps, self.episode_samples, self._suspect_since = [], [], None  # the episode is over
        return self._result

    def memory_bound(self, optimizer: Any) -> str:
        """For the start line (collective: every rank calls it once, before the first step): how
        often snapshots are taken and the host memory they may hold on the rank holding most."""
        chunks = self.monitor.state.model_chunks.chunks_for(optimizer) or []
        self._expected_bytes = snapshot_bytes(chunks, optimizer)
        largest = max(row[0] for row in collectives.all_gather_floats([float(self._expected_bytes)]))
        return start_line.memory_text(self.store.interval, self.store.kept, largest)

    def _snapshot(self, iteration: int, bound: inspect.BoundArguments) -> None:
        if not self.store.due(iteration):
            return
        model, optimizer, scheduler = self.state_of(bound)
        first = not self.store.snapshots and not self.store.skipped
        taken = self.store.take(iteration, live_tensors(model, optimizer),
                                small_values(optimizer, scheduler, self.monitor, self.ledger.lr_scale))
        target_taken(self.monitor.state.detectors)  # the check that certifies it reads all of the held state
        if taken is not None and first:
            if collectives.rank() == 0:  # rank 0 says what the copies cost, at exit
                atexit.register(lambda: print(f"[megatron_patches] {self.store.cost_line(self._iterations, 0)}",
                                              file=sys.stderr, flush=True))
            log.debug("in-memory snapshot of step %d: %.3f MiB on this rank", iteration, taken.nbytes / 2**20)
            if self._expected_bytes is not None and taken.nbytes > self._expected_bytes:
                log.warning("in-memory snapshot of step %d: %.1f MiB on rank %d, more than the %.1f MiB reckoned "
                            "at start (an optimizer state this guard does not know); %d are kept",
                            iteration, taken.nbytes / 2**20, collectives.rank(), self._expected_bytes / 2**20,
                            self.store.kept)
        oldest = min((s.step for s in self.store.snapshots), default=iteration)
        for tape in self._tapes or ():
            tape.forget_through(oldest)
        for old in [i for i in self._consumed if i <= oldest]:
            del self._consumed[old]

    def state_of(self, bound: inspect.BoundArguments) -> tuple:
        """(model, optimizer, scheduler) of a ``train_step`` call."""
        arguments = bound.arguments
        return arguments["model"], arguments["optimizer"], arguments[self.counters.scheduler_argument]

    def fall_back(self, decision: Decision, why: str) -> NoReturn:
        """This rollback by a restart instead (exit 84, the ledger's request), after one line; a
        critical stop where there is no checkpoint to restart from."""
        if not self.restartable:
            stop = decision.escalated(f"the rollback cannot be made in process ({why}) and there is no checkpoint "
                                      "to restart from (neither --save nor --load)")
            self.monitor.resolve(Outcome(decision=stop))
            self.monitor.exit(stop)
        warn0("rollback at iteration %d made by a restart, not in process: %s", decision.step, why)
        self.monitor.exit(decision)


class LiveLoop:
    """What the recovery steps ask of the loop (:class:`~megatron_patches.recovery.TrainingLoop`), on the live objects."""

    def __init__(self, run: InProcessRollback):
        self.run = run

    def set_lr_scale(self, scale: float) -> None:
        """The param groups' and the scheduler's bounds times ``scale`` / the scale they carry."""
        factor = scale / self.run.applied_scale
        if factor != 1.0:
            _, optimizer, scheduler = self.run.state_of(self.run._call[1])
            scale_scheduler_bounds(scheduler, factor)
            scale_group_bounds(optimizer, factor)
            scheduler.step(increment=0)
        self.run.applied_scale = scale

    def set_blacklist(self, samples: list) -> None:
        """Megatron-LM skips iterations, not samples: the redo leaves the episode's out (the ledger
        keeps them for a later restart)."""

    def disable_feature(self, name: str) -> None:
        """Dropout off in the live model (the only feature that changes in place, checked first)."""
        model, _, _ = self.run.state_of(self.run._call[1])
        safe_mode.dropout_off(module for chunk in model for module in chunk.modules())


def _skipped(result: Any) -> bool:
    """Whether Megatron's ``train_step`` left the update out (its second value, every release)."""
    return isinstance(result, tuple) and len(result) > 1 and bool(result[1])


# --- the chain's own steps (the others are megatron_patches.recovery's) -------------------------------


def choose_target(run: InProcessRollback, episode: Episode) -> Episode:
    """Every rank: the newest snapshot all ranks hold certified, if a rollback can be made in
    process at all; otherwise the rollback goes to a restart (:meth:`InProcessRollback.fall_back`)."""
    if not episode.rolls_back:
        return episode
    wanted = run.ledger.features_off_after_next(run.config)
    already = safe_mode.expand(run.ledger.disabled_features)  # off since the job started
    rebuilt = [name for name in safe_mode.expand(wanted) if name not in already and name not in IN_PLACE_FEATURES]
    held = collectives.gather_to_zero((run.store.certified(), run._tapes is not None), run.monitor.state.peers)
    since = run._suspect_since  # rank 0: a diverged replica disqualifies every target it may be in
    candidates = [[step for step in steps if since is None or step < since] for steps, _ in held]
    agreed = collectives.broadcast_from_zero(
        (snapshots.common_newest(candidates), all(taped for _, taped in held), since) if held else None,
        run.monitor.state.peers)
    target, taped, since = agreed
    why = _why_not_in_process(rebuilt, taped, target, since, newest_healthy_iteration(run.restart.checkpoint_root))
    if why is not None:
        run.fall_back(episode.decision, why)
    return replace(episode, resume_at=target + 1)


def _why_not_in_process(rebuilt: list, taped: bool, target: Optional[int], since: Optional[int],
                        disk: Optional[int]) -> Optional[str]:
    """Why this rollback must be made by a restart (None: it can be made in process)."""
    if rebuilt:
        return f"recovery switches off {', '.join(rebuilt)}, which needs the model built again"
    if not taped:
        return "the loop's data iterator is not Megatron's RerunDataIterator, so its batches are not taped"
    if target is None and since is not None:
        return f"no certified in-memory snapshot predates iteration {since}, from which a diverged replica may date"
    if target is None:
        return "no in-memory snapshot is certified on every rank yet"
    if disk is not None and disk > target:
        return f"the healthy checkpoint of iteration {disk} is newer than the newest certified snapshot ({target})"
    return None


def skip_iterations(run: InProcessRollback, episode: Episode) -> Episode:
    """The redo leaves out each iteration that read a blacklisted sample and, under ``blacklist: always``, each
    of the episode where its cause is data or unknown (hardware, numerics or software leave the samples in)."""
    if not episode.rolls_back:
        return episode
    skipped = set(reading(run._consumed, run.ledger.blacklist, range(episode.resume_at, episode.step + 1)))
    if run.config.blacklist == "always" and blames_samples(episode):
        skipped |= set(run.rollback.episode_steps)
    return replace(episode, outcome=replace(episode.outcome, iterations_skipped=tuple(sorted(skipped))))


def restore_snapshot(run: InProcessRollback, episode: Episode) -> Episode:
    """The target's tensors and values back in place on this rank."""
    if not episode.rolls_back:
        return episode
    target = episode.resume_at - 1
    snapshot = run.store.get(target)
    model, optimizer, scheduler = run.state_of(run._call[1])
    try:
        snapshots.restore(snapshot, live_tensors(model, optimizer))
    except RuntimeError as error:  # the state's layout changed since the snapshot: nothing was copied
        run.fall_back(episode.decision, str(error))
    after_restore(model, optimizer)
    restore_values(snapshot.values, optimizer, scheduler, run.monitor)
    run.applied_scale = snapshot.values["lr_scale"]
    run.store.drop_after(target)
    return replace(episode, outcome=replace(episode.outcome, rolled_back_to=target, checkpoint=IN_MEMORY,
                                            certified_at=snapshot.certified_at))


def redo(run: InProcessRollback, episode: Episode) -> Episode:
    """Megatron's own ``train_step`` again for each iteration since the target, on its taped
    batches; ``train()`` gets the last one's result. A rollback or stop decided during the redo
    is made by a restart."""
    if not episode.rolls_back:
        return episode
    counters, (wrapped, bound) = run.counters, run._call
    _, optimizer, scheduler = run.state_of(bound)
    entry, started, redone = counters.get(), time.perf_counter(), 0
    left_out = set(episode.outcome.iterations_skipped)
    faulty = run._result  # what train() gets when the decision's own iteration is left out: its skip
    try:
        for iteration in range(episode.resume_at, episode.step + 1):
            if iteration in left_out:  # its batches stay unread, as Megatron's --iterations-to-skip leaves them
                continue
            for tape in run._tapes:
                tape.replay(iteration)
            counters.set(iteration - 1, run._consumed[iteration])
            run.before_step(optimizer, scheduler)
            arguments = dict(bound.arguments)
            if "iteration" in arguments:
                arguments["iteration"] = iteration - 1
            run._result = wrapped(**arguments)
            run.after_step(arguments)  # before the decision is taken, as after a live train_step
            redone += 1
            _log_redone(iteration, counters.total(), run._result)
            again = run.monitor.take_decision()
            if again is not None and again.ends_run:
                run.fall_back(again, f"iteration {iteration} of the redo after the rollback was {again.action} too")
            if not _skipped(run._result):
                run._snapshot(iteration, bound)
    finally:
        counters.set(*entry)
        for tape in run._tapes:
            tape.live()  # train() reads its next iteration from the loader, where it stands
    if episode.step in left_out:
        run._result = faulty
    warn0("rolled back in process to the snapshot of iteration %d and redid %d iteration(s) in %.2f s",
          episode.resume_at - 1, redone, time.perf_counter() - started)
    return episode


def _log_redone(iteration: int, total: int, result: Any) -> None:
    """Each redone iteration's losses in Megatron's log format, on its printing rank (the last): ``train()`` logged the faulty first run."""
    if collectives.rank() != collectives.world_size() - 1 or not isinstance(result, tuple) or not result:
        return
    losses = result[0] if isinstance(result[0], dict) else {}
    values = " |".join(f" {key}: {float(value):.6E}" for key, value in losses.items() if torch.is_tensor(value)
                       and value.numel() == 1 or isinstance(value, float))
    print(f"[megatron_patches] redone iteration {iteration:8d}/{total:8d} |{values} |", flush=True)


IN_PROCESS_CHAIN = (choose_target, classify_step, recovery.blacklist, count_device, skip_iterations,
                    recovery.refuse_repeat, restore_snapshot, recovery.cut_lr, recovery.safe_mode_step, recovery.record_rollback, recovery.publish,
                    recovery.stop, redo)
"""One decision in Megatron-LM's loop, in process (the module's protocol)."""
