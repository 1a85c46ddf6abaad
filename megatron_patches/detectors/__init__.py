"""Pluggable detectors that ride on the monitor's one collective per checked step.

The monitor always runs the NaN/Inf, saturation and magnitude checks. A :class:`Detector`
adds its own numbers to the same all-reduced vector (``width`` floats, summed over the whole
job), decides from the reduced values, which are identical on every rank, and names
suspects on the slow path. Detectors keep bounded state that checkpoints carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class CheckContext:
    """What a detector sees on one checked step (this rank's view)."""

    step: int
    entries: list
    """The monitor's ``Entry`` objects (megatron_patches.optimizer_params) whose gradients are present (same order as grads)."""
    grads: list
    norms: Optional[torch.Tensor]
    """L2 norm of each gradient in ``grads`` on the device (fp32), None on a rank without any."""
    device: torch.device
    total_norm: float = float("nan")
    """World-wide total gradient norm; set once the reduced vector has been read."""
    layer_norms: Optional[list] = None
    """World-wide per-layer norms (layers..., embedding, output); set with total_norm."""


class Detector:
    """Base class: override what you need. Every method runs on every rank."""

    name = "detector"

    def width(self) -> int:
        """Floats this detector adds to the reduced vector; fixed for the run, equal on all ranks."""
        return 0

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        """Fill ``out`` (``width`` floats, zeros on entry) with device ops only: no host reads."""

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        """Kinds flagged this step (e.g. ``["zscore"]``) from the world-wide sums in ``reduced``."""
        return []

    def suspects(self, ctx: CheckContext, norm_list: list) -> dict:
        """Slow path: ``{index into ctx.entries: [reasons]}`` for this rank's parameters."""
        return {}

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        """Slow path: fields this detector adds to the incident record (rank 0's view)."""
        return {}

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        """After the decision: ``accepted`` is False when the step was skipped or rolled back."""

    def before_reduction(self, model_chunks: list, step: int) -> None:
        """Right before the data-parallel gradient reduction of a step."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def build(config: Any) -> list:
    """The detectors ``config`` switches on, in a fixed order (the vector layout depends on it)."""
    from .consistency import ConsistencyDetector
    from .history import HistoryDetector
    from .peers import PeersDetector

    settings = config.detectors
    detectors: list = []
    if settings.history.enabled:
        detectors.append(HistoryDetector(settings.history))
    if settings.consistency.enabled:
        detectors.append(ConsistencyDetector(settings.consistency))
    if settings.peers.enabled:
        detectors.append(PeersDetector(settings.peers))
    return detectors
