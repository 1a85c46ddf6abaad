"""fp16: the loss scaler skipped a step. One skip is routine; a collapsing scale or a run of skips
is an incident of its own (``detectors.loss_scale``)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from . import locate
from .incidents import make_record
from .optimizer_params import leaves
from .response import Action, Severity

log = logging.getLogger("megatron_patches")


class LossScaleWatch:
    """Counts consecutive overflow skips and reads the scaler's scale after each."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.consecutive = 0

    def clear(self) -> None:
        """A step without overflow ends the run of skips."""
        self.consecutive = 0

    def overflow(self, optimizer: Any) -> Optional[tuple[str, Optional[float]]]:
        """One more overflow skip: (why it is an incident, the scale) when it is one, else None."""
        self.consecutive += 1
        scaler = next((getattr(leaf, "grad_scaler", None) for leaf in leaves(optimizer)
                       if getattr(leaf, "grad_scaler", None) is not None), None)
        scale = float(scaler.scale) if scaler is not None else None
        collapsed = scale is not None and scale <= self.settings.min_scale
        if not (self.settings.enabled and (collapsed or self.consecutive >= self.settings.max_consecutive_skips)):
            return None
        why = (f"loss scale collapsed to {scale:g}" if collapsed else
               f"{self.consecutive} consecutive overflow skips (loss scale {scale:g})")
        self.consecutive = 0
        return why, scale

    @staticmethod
    def record(step: int, why: str, scale: Optional[float], batch_info: dict, samples: list) -> dict:
        """The incident record of a loss-scale incident (rank 0 writes it; the step was skipped)."""
        log.warning("step %d: %s", step, why)
        return make_record(step=step, severity=Severity.WARNING, kind="loss_scale", kinds=["loss_scale"],
                           action=Action.SKIP_STEP, message=why, params=[], ranks_affected=[],
                           world=locate.world_layout(), loss_scale=scale, batch={**batch_info, "samples": samples})
