"""The rollback protocol: replay, then roll back to the newest healthy checkpoint with a lower
learning rate and the offending samples blacklisted, within a retry budget.

Two executors share the :class:`Ledger` kept next to the checkpoints:

* in-process (:class:`InProcessRecovery`): for loops that hand over their state through the
  small :class:`TrainingLoop` protocol (the tiny-GPT harness does);
* exit-and-restart: with no executor attached the monitor writes the ledger and every rank
  exits with ``response.exit_codes.rollback`` (84); the next start reads the ledger (``Ledger.load``) and resumes.

Pseudocode of one incident, as the in-process executor runs it::

    decision = monitor.take_decision()          # same on every rank
    verdict  = replay(step) if decision.replay   # deterministic | transient
    if verdict == deterministic: blacklist(samples that reproduced it)
    if decision.action == rollback:
        ckpt = newest healthy checkpoint        # none -> critical stop
        load(ckpt); lr_scale = max(lr_scale * lr_factor, lr_floor)
        blacklist(incident batches); disable(features); rollbacks += 1; ledger.save()
        continue from ckpt.step + 1
    if decision.action == stop: exit(EXIT_STOP or EXIT_CRITICAL)
    monitor.resolve(outcome)                    # the incident's record, published once

Both executors end the process through ``monitor.exit(decision)``, which takes the exit code from
:func:`megatron_patches.decisions.exit_code`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Optional, Protocol

from . import checkpoint, forward_origin, safe_mode
from .errors import UserError
from .incidents import Incident, Outcome
from .protocols import Guard
from .decisions import Action, Decision, exit_code

log = logging.getLogger("megatron_patches")

LEDGER_FILE = "megatron_patches_ledger.json"
LEDGER_SCHEMA = "megatron_patches.ledger/1"


@dataclass
class Ledger:
    """What survives restarts: blacklisted samples, rollbacks done, learning-rate scale."""

    blacklist: list = field(default_factory=list)
    rollbacks: int = 0
    lr_scale: float = 1.0
    disabled_features: list = field(default_factory=list)
    spent_injections: list = field(default_factory=list)
    """Drill specs that already fired: a restarted job does not inject them again."""
    rollback_requested: Optional[dict] = None
    """Set by the exit-and-restart path: {"from_step", "reason"}; cleared once resumed."""
    events: list = field(default_factory=list)

    @staticmethod
    def path(checkpoint_root: str) -> str:
        return os.path.join(checkpoint_root, LEDGER_FILE)

    @classmethod
    def load(cls, checkpoint_root: str) -> "Ledger":
        """The ledger under ``checkpoint_root`` (a fresh one when there is none). A ledger that is
        not JSON, or whose fields have the wrong type or range, raises UserError with one line
        naming the file, the field and the fix: it is never applied."""
        path = cls.path(checkpoint_root)
        if not os.path.exists(path):
            return cls()
        fix = "repair it, or move it away to start a fresh ledger (its blacklist and rollback count are lost)"
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or (str(exc).splitlines() or ["empty"])[0]
            raise UserError(f"ledger {path} cannot be read as JSON ({why}); {fix}") from None
        if not isinstance(data, dict) or data.get("schema") != LEDGER_SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise UserError(f"ledger {path} is not a megatron_patches ledger (schema {found!r}, "
                            f"expected {LEDGER_SCHEMA!r}); {fix}")
        data = dict(data)
        data.pop("schema")
        problem = _ledger_problem(data)
        if problem:
            raise UserError(f"ledger {path}: {problem}; {fix}")
        return cls(**data)

    def record_rollback(self, recovery: Any, samples: list) -> list:
        """One more rollback under ``recovery`` (the config section): blacklist ``samples``, lower
        the learning-rate scale (never under the floor), switch off the configured features
        (``disable_features``, and the lists of ``disable_on_further_rollbacks`` this rollback has
        reached). Returns the features switched off now for the first time."""
        self.blacklist = sorted(set(self.blacklist) | set(samples))
        self.rollbacks += 1
        self.lr_scale = max(self.lr_scale * recovery.lr_factor, recovery.lr_floor)
        stages = recovery.disable_on_further_rollbacks[:self.rollbacks - 1]
        wanted = list(recovery.disable_features) + [name for stage in stages for name in stage]
        new = [name for name in dict.fromkeys(wanted) if name not in self.disabled_features]
        self.disabled_features += new
        return new

    def save(self, checkpoint_root: str) -> None:
        """Durable and atomic (:func:`checkpoint.write_json_atomic`): a crash or power loss
        leaves the previous ledger or the new one, never half of one."""
        os.makedirs(checkpoint_root, exist_ok=True)
        checkpoint.write_json_atomic(self.path(checkpoint_root), {"schema": LEDGER_SCHEMA, **asdict(self)}, indent=1)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ledger_problem(data: dict) -> Optional[str]:
    """What is wrong with a ledger's fields (schema already removed), or None."""
    known = {f.name for f in fields(Ledger)}
    unknown = sorted(set(data) - known)
    if unknown:
        return f"unknown field `{unknown[0]}` (valid: {', '.join(sorted(known))})"
    checks = {
        "blacklist": (lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
                      "a list of non-negative integers (sample indices)"),
        "rollbacks": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
        "lr_scale": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                     and 0 < v <= 1, "a finite number in (0, 1]"),
        "disabled_features": (lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
                              "a list of strings"),
        "spent_injections": (lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
                             "a list of strings"),
        "rollback_requested": (lambda v: v is None or isinstance(v, dict), "an object or null"),
        "events": (lambda v: isinstance(v, list) and all(isinstance(i, dict) for i in v), "a list of objects"),
    }
    for name, value in data.items():
        ok, expected = checks[name]
        if not ok(value):
            return f"`{name}` must be {expected}, got {json.dumps(value)[:80]}"
    for name in ("events", "rollback_requested"):
        where = _non_finite(data.get(name), name)
        if where:
            return f"`{where[0]}` must be a finite number, got {where[1]}"
    return None


def _non_finite(value: Any, where: str) -> Optional[tuple[str, float]]:
    """(path, value) of the first NaN or infinite number inside ``value``, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}")
        if found:
            return found
    return None


class TrainingLoop(Protocol):
    """What a custom megatron-core loop hands to :class:`InProcessRecovery`."""

    checkpoint_root: str

    def load_checkpoint(self, path: str) -> int:
        """Restore model, optimizer, scheduler, RNG and data position; return the saved step."""

    def replay_step(self, step: int) -> dict:
        """Re-run forward/backward of ``step`` on the same micro-batches from the same RNG state
        and run the check again (``monitor.replay_check``); no update. Returns
        ``{"flagged": bool, "first": name or None, "bad_samples": [...]}`` (same on all ranks)."""

    def set_lr_scale(self, scale: float) -> None:
        """Scale the learning-rate schedule by ``scale`` of its original values."""

    def set_blacklist(self, samples: list) -> None:
        """Never feed these sample indices again."""

    def disable_feature(self, name: str) -> None:
        """Switch off a feature named in ``recovery.disable_features``."""


class InProcessRecovery:
    """Acts on the monitor's decisions inside the training loop, one incident at a time, as the
    small steps below: replay, blacklist, roll back (load healthy, scale the LR, disable features,
    save the ledger), stop. Each step reads and returns the incident's :class:`Outcome`."""

    in_process = True

    def __init__(self, monitor: Guard, loop: TrainingLoop):
        self.monitor = monitor
        self.loop = loop
        self.config = monitor.config.recovery
        self.ledger = Ledger.load(loop.checkpoint_root)
        self._episode_samples: list = []
        monitor.attach(self, self.ledger.rollbacks)
        loop.set_blacklist(self.ledger.blacklist)
        loop.set_lr_scale(self.ledger.lr_scale)

    def after_step(self, step: int, batch_samples: list) -> Optional[int]:
        """Call on every rank after each optimizer step. Returns the step to continue from
        after a rollback, else None."""
        decision = self.monitor.take_decision()
        if decision is None:
            return None
        self._episode_samples += batch_samples
        outcome, reproduced = Outcome(), []
        if decision.replay:
            outcome, reproduced = self._replay(step, decision, batch_samples)
        if decision.action == Action.ROLLBACK:
            blacklisted = set(reproduced)
            if self.config.blacklist == "always":
                blacklisted |= set(self._episode_samples)
            return self._rollback(step, decision, replace(outcome, blacklisted=tuple(sorted(blacklisted))))
        outcome = replace(outcome, blacklisted=tuple(sorted(set(reproduced))))
        if outcome.blacklisted:
            self._add_blacklist(list(outcome.blacklisted))
            self._save_ledger()
        self.monitor.resolve(outcome)
        if decision.action == Action.STOP:
            self.monitor.exit(decision)
        return None

    def _replay(self, step: int, decision: Decision, batch_samples: list) -> tuple[Outcome, list]:
        """Replay ``step``: deterministic (the samples that reproduced it) or transient."""
        replay, (origin, backward) = self._traced_replay(step)
        incident = self.monitor.last_incident
        if replay["flagged"]:
            first = incident.first_name if incident is not None else None
            verdict = {"verdict": "deterministic", "same_parameter": replay["first"] == first,
                       "first": replay["first"]}
            reproduced = replay["bad_samples"] or batch_samples
        else:
            ranks = sorted(set(incident.ranks_affected)) if incident is not None else []
            verdict = {"verdict": "transient", "suspected_ranks": list(decision.origins) or ranks}
            reproduced = []
        return Outcome(replay=verdict, forward_origin=origin, backward_origin=backward), reproduced

    def _traced_replay(self, step: int) -> tuple[dict, tuple[Optional[dict], Optional[dict]]]:
        """Replay ``step`` with every module's output and its gradient watched: the replay's
        verdict, and where the forward pass, else the backward pass, first went non-finite (rank 0;
        None elsewhere or when it stayed finite)."""
        chunks = self.monitor.model_chunks.modules()
        self.monitor.set_step(step)  # the replayed forward is step ``step`` again (forward drills)
        with forward_origin.ForwardTrace(chunks) as trace:
            replay = self.loop.replay_step(step)
        return replay, forward_origin.gather_origin(trace, self.monitor.peers)

    def _rollback(self, step: int, decision: Decision, outcome: Outcome) -> int:
        target = checkpoint.newest_healthy(self.loop.checkpoint_root)
        if target is None:
            stop = decision.escalated("no healthy checkpoint to roll back to")
            self.monitor.resolve(replace(outcome, decision=stop))
            self.monitor.exit(stop)
        healthy_step, path = target
        resumed = self.loop.load_checkpoint(path)
        for name in safe_mode.expand(self.ledger.record_rollback(self.config, list(outcome.blacklisted))):
            self.loop.disable_feature(name)
        self.loop.set_blacklist(self.ledger.blacklist)
        self.loop.set_lr_scale(self.ledger.lr_scale)
        self.ledger.events.append({"step": step, "rolled_back_to": healthy_step, "lr_scale": self.ledger.lr_scale,
                                   "blacklisted": len(outcome.blacklisted), "reason": decision.reason})
        self._save_ledger()
        self.monitor.new_episode(self.ledger.rollbacks)
        self._episode_samples = []
        self.monitor.resolve(replace(outcome, rolled_back_to=healthy_step, checkpoint=path,
                                     lr_scale=self.ledger.lr_scale))
        log.warning("rolled back from step %d to healthy checkpoint %s (step %d); lr scale %.3g; "
                    "%d samples blacklisted; rollback %d of %d", step, path, healthy_step, self.ledger.lr_scale,
                    len(outcome.blacklisted), self.ledger.rollbacks, self.config.max_rollbacks)
        return resumed + 1

    def _add_blacklist(self, samples: list) -> None:
        merged = sorted(set(self.ledger.blacklist) | set(samples))
        self.ledger.blacklist = merged
        self.loop.set_blacklist(merged)

    def _save_ledger(self) -> None:
        """Rank 0 only, so a failure must not raise (the others go on to the next collective).
        This process holds the ledger in memory and goes on with it; a later restart would not
        know this rollback (its blacklist, LR scale and count)."""
        if self.monitor.rank == 0:
            try:
                self.ledger.save(self.loop.checkpoint_root)
            except OSError as error:
                log.warning("the ledger could not be written (%s): training goes on with it in memory, but "
                            "a restart would not know this rollback, its blacklist or LR scale", error)

    def settle_exit(self, decision: Decision) -> Decision:
        """Nothing to write before an exit: the ledger was saved at each rollback."""
        return decision


class ExitAndRestart:
    """For loops that cannot be re-entered (Megatron-LM's ``pretrain_gpt.py``): on a rollback
    decision rank 0 writes the ledger and every rank exits with ``response.exit_codes.rollback``; the launcher
    restarts the job, which loads the newest healthy checkpoint and applies the ledger. The one
    writer of that ledger; ``request_fields`` (the integration's) adds to its rollback request."""

    in_process = False

    def __init__(self, monitor: Guard, checkpoint_root: str,
                 request_fields: Optional[Callable[[], dict]] = None):
        self.monitor = monitor
        self.checkpoint_root = checkpoint_root
        self.ledger_path = os.path.abspath(Ledger.path(checkpoint_root))
        """Named in each rollback's record, so that ``report`` finds the restart's outcome."""
        self.config = monitor.config.recovery
        self.ledger = Ledger.load(checkpoint_root)
        self._request_fields = request_fields
        self._episode_samples: list = []
        monitor.drills.spend(self.ledger.spent_injections)
        monitor.listeners.append(self._on_decision)
        monitor.attach(self, self.ledger.rollbacks)

    def _on_decision(self, decision: Decision, incident: Optional[Incident]) -> None:
        if incident is not None and incident.batch is not None:  # rank 0, with every rank's samples
            self._episode_samples += incident.batch.get("samples", [])

    def settle_exit(self, decision: Decision) -> Decision:
        """Rank 0 writes the ledger for the restart. Where it cannot, a restart would resume
        without knowing why (no LR scale, no blacklist, no count against the budget): rank 0
        then stops critically instead, which no launcher takes for a rollback."""
        codes = self.monitor.config.response.exit_codes
        if exit_code(decision, codes) != codes.rollback or self.monitor.rank != 0:
            return decision
        # The loop that reads the ledger at start-up switches the features off.
        self.ledger.record_rollback(self.config, self._episode_samples if self.config.blacklist == "always" else [])
        fields = self._request_fields() if self._request_fields is not None else {}
        self.ledger.rollback_requested = {"from_step": self.monitor.step, **fields}
        self.ledger.spent_injections = sorted(set(self.ledger.spent_injections) | set(self.monitor.drills.fired_specs()))
        self.ledger.events.append({"step": self.monitor.step, "exit": codes.rollback, "lr_scale": self.ledger.lr_scale,
                                   "blacklisted": len(self._episode_samples),
                                   **({"skip_iterations": fields["skip_iterations"]} if "skip_iterations" in fields else {})})
        try:
            self.ledger.save(self.checkpoint_root)
        except OSError as error:
            log.error("the ledger could not be written (%s): a restart would not know this rollback; "
                      "stopping with %d instead of asking for one", error, codes.critical)
            return decision.escalated("the ledger could not be written")
        return decision

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
        if self.monitor.rank == 0:
            try:
                self.ledger.save(self.checkpoint_root)
            except OSError as error:
                log.warning("the ledger could not record %s (%s)", what, error)

    def resumed(self, event: dict) -> None:
        """The restart resumed as the ledger asked: the request is done (rank 0 writes it)."""
        self.ledger.rollback_requested = None
        self.ledger.events.append(event)
        if self.monitor.rank == 0:
            self.ledger.save(self.checkpoint_root)
