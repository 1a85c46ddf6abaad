"""The one interface through which integrations hear from the guard.

A loop integration (Megatron-LM's session, its rollback), a recovery executor or a user's own
code subclasses :class:`Callback`, overrides the events it needs and adds itself with
``monitor.add_callback(callback)``. The guard calls every callback in the order added, on every
rank, at the same points of the same step. Nothing else on the monitor is written from outside:
what a callback wants from the run it answers from these methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypeVar

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only
    from .decisions import Decision
    from .incidents import Incident


class Callback:
    """Events of one run; each default does nothing."""

    def after_check(self, step: int, flagged: bool) -> None:
        """After each checked step, on every rank, with its verdict (the same on every rank)."""

    def on_decision(self, decision: "Decision", incident: Optional["Incident"]) -> None:
        """After each incident's decision, on every rank (``incident`` on rank 0 only), before
        the guard acts on it."""

    def wants_replay(self, decision: "Decision") -> bool:
        """True to hold the incident's record until this integration hands the guard the outcome
        of a replay it runs after the step (``monitor.resolve``)."""
        return False

    def before_rerun(self, step: int) -> None:
        """Megatron's rerun machine is about to rerun the checked ``step`` in place (its
        ``--rerun-mode validate_results`` after a rejected NaN/Inf), on every rank."""

    def after_rerun(self, step: int, verdict: Optional[str]) -> None:
        """That rerun ended, on every rank, before the guard checks the step; ``verdict``: Megatron's
        on what this rank rejected (``transient``: finite on rerunning, ``reproducible``), None if
        this rank rejected nothing."""

    def after_rollback(self, rollbacks: int) -> None:
        """After an in-process rollback put back a certified state, on every rank: what the run
        did since that state is undone (``rollbacks``: the job's count so far)."""

    def before_exit(self, decision: "Decision") -> None:
        """Before the guard ends the process for ``decision``, on every rank: finish what must
        outlive it (pending checkpoint saves). The exit code is not this callback's to change."""


C = TypeVar("C", bound=Callback)


def attached(monitor: Any, kind: "type[C]") -> C:
    """The monitor's callback of ``kind``, made (``kind(monitor)``) and added at the first call: one
    per monitor, and a new monitor gets a new one."""
    found = next((callback for callback in monitor.state.callbacks if isinstance(callback, kind)), None)
    if found is None:
        found = kind(monitor)
        monitor.add_callback(found)
    return found
