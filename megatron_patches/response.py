"""Graded response: warning (log, skip), error (save, roll back or stop), critical (stop all).

Decided on rank 0 from what every rank reported, then broadcast, so all ranks act alike.
Exit codes are part of the contract with launchers (``scripts/`` restarts on ROLLBACK).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .config import Config

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


@dataclass
class Decision:
    """What every rank does about one incident (identical on all ranks)."""

    severity: str
    action: str
    """skip_step | rollback | stop"""
    reason: str
    step: int
    replay: bool = False
    """Whether the loop should replay the step before acting."""
    origins: list = field(default_factory=list)
    """Global ranks whose gradients were non-finite before the data-parallel reduction."""


class GradePolicy:
    """Turns a stream of incidents into severities (state lives on rank 0 only)."""

    def __init__(self, config: Config):
        self.response = config.response
        self.recovery = config.recovery
        self.check_interval = config.check_interval
        self._recent: deque[int] = deque()
        self._last_step: Optional[int] = None
        self._consecutive = 0

    def grade(self, step: int, origin_replicas: int, rollbacks_done: int, can_replay: bool) -> Decision:
        window = self.response.recur_window
        self._recent.append(step)
        while self._recent and self._recent[0] <= step - window:
            self._recent.popleft()
        follows = self._last_step is not None and step - self._last_step <= self.check_interval
        self._consecutive = self._consecutive + 1 if follows else 1
        self._last_step = step

        if origin_replicas >= self.response.critical_origins:
            return Decision("critical", "stop", f"anomalies entered on {origin_replicas} data-parallel replicas "
                            "at once", step)
        persistent = self._consecutive >= self.response.persist_steps
        recurring = len(self._recent) >= self.response.recur_count
        if not (persistent or recurring):
            return Decision("warning", "skip_step", "single anomaly", step, replay=can_replay and self.response.replay)
        why = (f"anomaly on {self._consecutive} consecutive checked steps" if persistent
               else f"{len(self._recent)} incidents within {window} steps")
        if self.response.on_error == "rollback" and rollbacks_done >= self.recovery.max_rollbacks:
            return Decision("critical", "stop", f"{why}; retry budget of {self.recovery.max_rollbacks} "
                            "rollbacks spent", step)
        return Decision("error", self.response.on_error, why, step, replay=can_replay and self.response.replay)

    def reset(self) -> None:
        """After a rollback the episode is over: start counting afresh."""
        self._recent.clear()
        self._last_step = None
        self._consecutive = 0

    def state_dict(self) -> dict:
        return {"recent": list(self._recent), "last": self._last_step, "consecutive": self._consecutive}

    def load_state_dict(self, state: dict) -> None:
        self._recent = deque(state.get("recent", []))
        self._last_step = state.get("last")
        self._consecutive = int(state.get("consecutive", 0))
