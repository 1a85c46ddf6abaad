"""The typed seams between the guard and what drives it.

:class:`Guard` is what recovery executors and integrations may use on the guard
(:class:`~megatron_patches.monitor.GradMonitor` implements it); :class:`Executor` is what the guard
calls on the recovery executor attached to it (:mod:`megatron_patches.recovery`). Anything else
on the monitor is its own business and may change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only
    from .config import Config
    from .incidents import Incident, Outcome
    from .response import Decision


class Executor(Protocol):
    """Acts on the guard's decisions."""

    in_process: bool
    """True: it replays and rolls back inside the loop, and calls :meth:`Guard.exit` itself on a
    stop. False: the guard ends the process on every stop and rollback decision."""

    def settle_exit(self, decision: "Decision") -> "Decision":
        """Last work before the process ends for ``decision`` (write the ledger); returns the
        decision the exit code is taken from (a critical stop when that work failed)."""


class Guard(Protocol):
    """What executors, integrations, training loops and the hook-side modules (bucket_check,
    served_norm, forward_origin) use on the guard."""

    config: "Config"
    counters: dict
    """Totals over the job: checked_steps, skipped_steps, incidents, scaler_overflows, injected, served_norms."""
    last_total_norm: Optional[float]
    last_layer_norms: dict
    last_incident: Optional["Incident"]
    """The last incident as rank 0 assembled it (None on the other ranks)."""
    executor: Optional[Executor]
    rollbacks: int
    listeners: list
    """``fn(decision, incident)`` called on every rank after each decision."""
    before_exit: list
    """``fn(decision)`` called on every rank before the guard ends the process."""

    checked_norm: Any
    """The last check's total norm until Megatron's get_grad_norm takes it (:mod:`~megatron_patches.served_norm`)."""
    routing: Any
    """Tokens per expert and router finiteness of the step being made (:mod:`~megatron_patches.moe_routing`)."""

    # The run's state beside the pipeline (what the hooks and seams keep between calls).
    drills: Any
    """The run's fault drills (:class:`~megatron_patches.inject.Injector`)."""
    model_chunks: Any
    """Optimizer -> model chunks, bucket group -> parameters (:class:`~megatron_patches.model_chunks.ModelChunks`)."""
    rerun: Any
    """Megatron's rerun of a checked step in place (:class:`~megatron_patches.megatron_rerun.RerunWatch`)."""
    peers: Any
    """The guard's bounded gloo group for the slow path (:class:`~megatron_patches.collectives.BoundedGroup`)."""
    loop_session: Any
    """The training-loop integration's own state for the run (Megatron-LM's session), or None."""

    @property
    def rank(self) -> int: ...

    def upcoming_step(self) -> int:
        """The step whose gradients are being made now (drills, the bucket check)."""

    def note_bucket_check(self) -> None: ...

    def note_pre_reduction(self, findings: list) -> None: ...

    @property
    def step(self) -> int: ...

    def set_step(self, step: int) -> None: ...

    def set_batch(self, sample_indices: list, tokens: Optional[list] = None, **info: Any) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def attach(self, executor: Executor, rollbacks: int) -> None:
        """Make ``executor`` act on the guard's decisions; ``rollbacks`` so far (the ledger's)."""

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to ``counters[counter]``."""

    def take_decision(self) -> Optional["Decision"]:
        """The last incident's decision (identical on every rank), once."""

    def replay_check(self, optimizer: Any, step: int) -> dict:
        """The check on gradients recomputed for ``step``: ``{"flagged", "first"}`` on every rank."""

    def resolve(self, outcome: "Outcome") -> None:
        """The executor's outcome for the incident held for it; rank 0 publishes the record."""

    def new_episode(self, rollbacks: int) -> None:
        """After an in-process rollback."""

    def exit(self, decision: "Decision") -> None:
        """End the process for ``decision`` on every rank (SystemExit with its exit code)."""

    def close(self) -> None: ...

