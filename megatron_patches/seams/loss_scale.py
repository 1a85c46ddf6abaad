"""fp16: when a step the loss scaler skipped is the scaler's business, and when it is an incident.

A dynamic scaler (Megatron's ``DynamicGradScaler``, the default with ``--fp16``) skips a step
whose unscaled gradients hold Inf/NaN and lowers its scale. That is routine, and the guard
defers to it. The rule (the defaults are :class:`~megatron_patches.config.LossScaleConfig`'s):

- **Calibration.** Until a step has succeeded in this process, the scale is still coming down
  from where it started (2^32 by Megatron's default, or what a checkpoint restored): those skips
  are not counted.
- **A run of skips.** Once a step has succeeded, ``max_consecutive_skips`` skipped steps in a row
  (default 10) are an incident: each skip halves the scale, so a healthy scaler never needs that many.
- **A collapse.** A skip with the scale at or below ``min_scale`` (default 1.0) or at the
  scaler's own floor (``--min-loss-scale``) is an incident, calibrating or not.

With a constant scale (``--loss-scale N``) nothing adapts: every overflow is an incident.

An incident goes through the guard's full pipeline (named parameters, origin ranks, grading);
its record's ``loss_scale`` field carries the scale history of the run of skips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .optimizer_params import leaves

HISTORY_LIMIT = 64
"""Scales kept per run of skips (the latest ones)."""


@dataclass(frozen=True)
class ScalerEvent:
    """A skipped step that is an incident: why, and the scaler's state."""

    why: str
    scale: Optional[float]
    dynamic: bool
    history: tuple
    """The scale after each skip of the current run, oldest first (at most ``HISTORY_LIMIT``)."""

    kind = "loss_scale"

    def record_field(self) -> dict:
        return {"scale": self.scale, "dynamic": self.dynamic, "skips": len(self.history),
                "history": list(self.history)}


def grad_scaler(optimizer: Any) -> Optional[Any]:
    """The first leaf's grad scaler (every leaf of one model shares the same kind), or None."""
    return next((s for leaf in leaves(optimizer) if (s := getattr(leaf, "grad_scaler", None)) is not None), None)


def _value(number: Any) -> Optional[float]:
    try:
        return float(number)
    except (TypeError, ValueError, RuntimeError):
        return None


def _shown(scale: Optional[float]) -> str:
    return "unknown" if scale is None else f"{scale:g}"


class LossScaleWatch:
    """Follows one process's skipped steps and tells the routine ones from the incidents."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.settled = False
        """A step has succeeded in this process: the scale has come down to where it holds."""
        self.consecutive = 0
        self._history: list[float] = []

    def clear(self) -> None:
        """A step the scaler let through: the run of skips ends, calibration is over."""
        self.settled = True
        self.consecutive = 0
        self._history = []

    def overflow(self, optimizer: Any) -> Optional[ScalerEvent]:
        """One more skipped step: the incident it makes, or None when it is the scaler's business."""
        scaler = grad_scaler(optimizer)
        scale = _value(scaler.scale) if scaler is not None else None
        dynamic = scaler is None or hasattr(scaler, "backoff_factor")
        if scale is not None:
            self._history = (self._history + [scale])[-HISTORY_LIMIT:]
        if not dynamic:
            return ScalerEvent(f"overflow with a constant loss scale ({_shown(scale)})", scale, False,
                               tuple(self._history))
        floor = max(self.settings.min_scale, _value(getattr(scaler, "min_scale", None)) or 0.0)
        collapsed = scale is not None and scale <= floor
        if self.settled:
            self.consecutive += 1
        if not self.settings.enabled or not (collapsed or self.consecutive >= self.settings.max_consecutive_skips):
            return None
        skips = len(self._history)
        why = (f"loss scale collapsed to {_shown(scale)} after {skips} overflow skip(s) in a row" if collapsed else
               f"{self.consecutive} consecutive overflow skips (loss scale {_shown(scale)})")
        self.consecutive = 0
        return ScalerEvent(why, scale, True, tuple(self._history))
