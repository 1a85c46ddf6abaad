"""Graded response: warning (log, skip), error (save, roll back or stop), critical (stop all).

Decided on rank 0 from what every rank reported, then broadcast, so all ranks act alike.
Exit codes are part of the contract with launchers (``scripts/`` restarts on ROLLBACK);
:func:`exit_code` is the one place that maps a decision to one. The constants below are the
defaults of ``response.exit_codes``, which a job may change.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .cause import Signs
from .config import Config, ExitCodesConfig

EXIT_ROLLBACK = 84
"""Every rank exits with this after writing the ledger: restart me, I will resume from the
newest healthy checkpoint (exit-and-restart executor)."""
EXIT_STOP = 85
"""An *error* with ``response.on_error: stop``: stopped cleanly for a person to look."""
EXIT_CRITICAL = 86
"""A *critical* incident: anomalies from several replicas at once, or the retry budget spent."""
EXIT_PEER_LOST = 87
"""A peer died or stopped answering while the ranks were agreeing on an incident's decision
(``response.peer_timeout_s``): nothing was decided, no ledger written. The job is broken, not
the model: a launcher restarts it like any lost node (``scripts/restart_on_rollback.py`` does
not; torchrun's elastic agent with ``--max-restarts`` does)."""
EXIT_FENCE = 88
"""A device had ``response.hardware_repeat`` hardware-class incidents in one job: every rank exits
with this after one line names the host and device to exclude (the ledger's ``fenced``); restart
the job without that node (``scripts/slurm/guarded.sbatch`` requeues excluding it)."""


class Severity(enum.StrEnum):
    """How bad an incident is; members are listed in rising order, which is the one order."""

    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return list(Severity).index(self)

    def at_least(self, floor: str) -> bool:
        return self.rank >= Severity(floor).rank


class Action(enum.StrEnum):
    """What every rank does about an incident (the record's ``action``)."""

    SKIP_STEP = "skip_step"
    """Leave the update out: the step's gradients are not applied."""
    ZERO_GRADS = "zero_grads"
    """A ``clip_grad_norm`` call without ``prepare_grads``: its gradients are zeroed."""
    ROLLBACK = "rollback"
    STOP = "stop"
    FENCE = "fence"
    """Stop every rank with ``response.exit_codes.fence``: a device to exclude (:data:`EXIT_FENCE`)."""


@dataclass(frozen=True)
class Decision:
    """What every rank does about one incident (identical on all ranks)."""

    severity: Severity
    action: Action
    reason: str
    step: int
    replay: bool = False
    """Whether the loop should replay the step before acting."""
    origins: tuple = ()
    """Global ranks whose gradients were non-finite before the data-parallel reduction."""
    signs: Optional[Signs] = None
    """What rank 0 observed of the incident, for its cause (:func:`megatron_patches.cause.classify`)."""

    @property
    def ends_run(self) -> bool:
        """Whether this process cannot go on training after it (stop, fence or roll back)."""
        return self.action in (Action.STOP, Action.ROLLBACK, Action.FENCE)

    def escalated(self, reason: str, action: Action = Action.STOP) -> "Decision":
        """The same incident as a critical stop (or fence), ``reason`` added to why."""
        return Decision(Severity.CRITICAL, action, f"{self.reason}; {reason}", self.step,
                        origins=self.origins, signs=self.signs)


def exit_code(decision: Decision, codes: ExitCodesConfig = ExitCodesConfig()) -> int:
    """The process exit code that carries ``decision`` to the launcher (``response.exit_codes``)."""
    if decision.action == Action.FENCE:
        return codes.fence
    if decision.severity == Severity.CRITICAL:
        return codes.critical
    return codes.rollback if decision.action == Action.ROLLBACK else codes.stop


class GradePolicy:
    """Turns a stream of incidents into severities (state lives on rank 0 only)."""

    def __init__(self, config: Config):
        self.response = config.response
        self.recovery = config.recovery
        self.check_interval = config.check_interval
        self._recent: deque[int] = deque()
        self._last_step: Optional[int] = None
        self._consecutive = 0

    def grade(self, step: int, origin_replicas: int, rollbacks_done: int, can_replay: bool,
              origins: tuple = ()) -> Decision:
        window = self.response.recur_window
        self._recent.append(step)
        while self._recent and self._recent[0] <= step - window:
            self._recent.popleft()
        follows = self._last_step is not None and step - self._last_step <= self.check_interval
        self._consecutive = self._consecutive + 1 if follows else 1
        self._last_step = step
        replay = can_replay and self.response.replay

        if origin_replicas >= self.response.critical_origins:
            return Decision(Severity.CRITICAL, Action.STOP, f"anomalies entered on {origin_replicas} "
                            "data-parallel replicas at once", step, origins=origins)
        persistent = self._consecutive >= self.response.persist_steps
        recurring = len(self._recent) >= self.response.recur_count
        if not (persistent or recurring):
            return Decision(Severity.WARNING, Action.SKIP_STEP, "single anomaly", step, replay, origins)
        why = (f"anomaly on {self._consecutive} consecutive checked steps" if persistent
               else f"{len(self._recent)} incidents within {window} steps")
        if self.response.on_error == "rollback" and rollbacks_done >= self.recovery.max_rollbacks:
            return Decision(Severity.CRITICAL, Action.STOP, f"{why}; retry budget of "
                            f"{self.recovery.max_rollbacks} rollbacks spent", step, origins=origins)
        return Decision(Severity.ERROR, Action(self.response.on_error), why, step, replay, origins)

    def reset(self) -> None:
        """After a rollback the episode is over: start counting afresh."""
        self._recent.clear()
        self._last_step = None
        self._consecutive = 0
