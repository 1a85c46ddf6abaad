"""What every detector is made of: the context of a checked step, the rotation that spreads a
detector's work over checks, and the :class:`Detector` base class (see the package's docstring
for where collectives may go)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class CheckContext:
    """What a detector sees on one checked step (this rank's view)."""

    step: int
    entries: list
    """The monitor's ``Entry`` objects (megatron_patches.seams.optimizer_params) whose gradients are present (same order as grads)."""
    grads: list
    norms: Optional[torch.Tensor]
    """L2 norm of each gradient in ``grads`` on the device (fp32), None on a rank without any."""
    device: torch.device
    total_norm: float = float("nan")
    """World-wide total gradient norm; set once the reduced vector has been read."""
    layer_norms: Optional[list] = None
    """World-wide per-layer norms (layers..., embedding, output); set with total_norm."""
    replay: bool = False
    """The check of a replay: gradients recomputed for a step already checked, no update follows."""
    squares: Optional[torch.Tensor] = None
    """Each gradient's squared norm times its entry's ``weight`` (fp32, on the device; what the
    per-layer sums add up), None on a rank without any."""
    maxabs: Optional[torch.Tensor] = None
    """Each gradient's largest magnitude on the device (fp32), taken where the saturation check or a
    detector with :attr:`Detector.wants_maxabs` needs it (one fused pass); None otherwise."""
    tails: dict = field(default_factory=dict)
    """Per detector with a :meth:`Detector.tail_width`: its device view of the check's read buffer
    past the reduced vector (this rank's own values, not reduced), to fill in ``local``."""
    tail_values: dict = field(default_factory=dict)
    """The same, as read back on the host with the reduced vector (set before ``verdict``)."""


@dataclass(frozen=True)
class Rotation:
    """Which checks a detector judges (every ``interval``-th) and which share of the tensors it
    covers on each: with ``fraction`` 1/m, tensor ``i`` on the judged checks whose turn is
    ``i % m``, so every tensor once in m judged checks. Checks count from 1."""

    interval: int = 1
    fraction: float = 1.0

    @property
    def period(self) -> int:
        """m: judged checks that it takes to cover every tensor once (1: all on each)."""
        return max(1, round(1.0 / self.fraction))

    def due(self, check: int) -> bool:
        """Whether the ``check``-th check is judged."""
        return (check - 1) % self.interval == 0

    def turn(self, check: int) -> int:
        """Which share the ``check``-th check covers, in ``range(period)``."""
        return ((check - 1) // self.interval) % self.period

    def covers(self, index: int, check: int) -> bool:
        """Whether tensor ``index`` is in the share of the ``check``-th check."""
        return index % self.period == self.turn(check)


class Detector:
    """Base class: override what you need. Every method runs on every rank."""

    name = "detector"
    wants_maxabs = False
    """Whether :meth:`local` reads ``ctx.maxabs`` (the check then takes it: one more read pass,
    shared with the saturation check where that runs)."""

    def width(self) -> int:
        """Floats this detector adds to the reduced vector; fixed for the run (after
        :meth:`size`, when it has sizes), equal on all ranks."""
        return 0

    def sizes(self, entries: list) -> list:
        """Integers this detector's width depends on, from this rank's view (its checked
        ``entries``). At the first check every rank's are all-reduced (maximum) in one small
        collective and handed to :meth:`size`; none (the default) costs nothing."""
        return []

    def size(self, agreed: list) -> None:
        """Fix :meth:`width` from the ranks' largest :meth:`sizes`."""

    def tail_width(self, count: int) -> int:
        """Floats of this rank's own that the check reads back with its vector, past the reduced
        part (``count``: the tensors checked): ``ctx.tails[name]`` in :meth:`local`,
        ``ctx.tail_values[name]`` in :meth:`verdict`. None (the default) costs nothing."""
        return 0

    def plan(self, ctx: CheckContext) -> Optional[tuple]:
        """Called before :meth:`local`: ``(values, index)`` the check itself writes into this
        detector's piece, or None. ``values`` (a float32 tensor of ``width`` floats, or None: zeros)
        is the piece's start, copied with the rest of the vector's constants in one op; ``index``
        (long, one per tensor, into the piece, or None) places each tensor's weighted squared norm
        (``ctx.squares``), added by the same op as the per-layer sums. Return the same objects
        while they do not change: the check caches its buffers by their identity."""
        return None

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        """Fill ``out`` (``width`` floats, holding what :meth:`plan` asked for on entry, else zeros)
        with device ops only: no host reads."""

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        """Kinds flagged this step (e.g. ``["zscore"]``) from the world-wide sums in ``reduced``
        alone: no collective, so every rank decides alike without talking."""
        return []

    def suspects(self, ctx: CheckContext, norm_list: list) -> dict:
        """Slow path: ``{index into ctx.entries: [reasons]}`` for this rank's parameters. Runs
        on every rank of a flagged step (in an incident and in its replay), so this is where a
        detector may run the collectives that name its suspects."""
        return {}

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        """Slow path: fields this detector adds to the incident record (rank 0's view)."""
        return {}

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        """After the decision: ``accepted`` is False when the step was skipped or rolled back."""

    def attach(self, model_chunks: list, ps: Any) -> int:
        """A model was registered with the guard (``ps``: megatron-core's parallel state): hook what
        the detector watches in the forward pass; returns how many modules were hooked. Called once
        per model registration, so a module already hooked must be skipped."""
        return 0

    def before_reduction(self, model_chunks: list, step: int) -> None:
        """Right before the data-parallel gradient reduction of a step."""

    def after_update(self, optimizer: Any, entries: list, next_checked: bool) -> None:
        """Right after ``optimizer`` applied an update (``entries``: all it steps); ``next_checked``:
        whether the next step is checked."""

    def forget(self) -> None:
        """The weights and optimizer state were put back (a rollback in process)."""

    def target_taken(self) -> None:
        """A rollback target (an in-memory snapshot, a checkpoint) was just taken of this rank's
        state; it is certified by the clean checks that follow."""

    def held(self, ctx: CheckContext, ranks: dict) -> list:
        """Slow path: this rank's parameters whose held weight or optimizer state the detector found
        corrupted (``ParamFinding``s; ``ranks``: this rank's). The ranks holding such a corruption
        are where the fault entered (:func:`megatron_patches.decide.origins_of`)."""
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
