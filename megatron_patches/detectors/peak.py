"""Gradient peaks: a few elements far off while the tensor's norm barely moves.

A norm is dominated by the bulk of a tensor: one gradient element multiplied by 1,000 in a
16k-element weight lifts its norm about 8x, inside the spread the history detector must allow
(16x). The element itself stands out in the tensor's *crest factor*, its largest magnitude over
its RMS (``max|g| * sqrt(n) / ||g||``): about 5 to 10 for a clean gradient, about 125 with that
element. The crest factor is scale-free, so a loss spike that lifts the whole gradient leaves it
alone, and bounded by ``sqrt(n)``, so small tensors (biases, norms) cannot flag on their own noise.

Each tensor's log crest factor keeps a moving mean and variance (the history detector's
statistics, :class:`~megatron_patches.detectors.series.ParamSeries`): flagged (kind ``peak``)
when it is more than ``zscore`` standard deviations above its mean and more than ``min_ratio``
times the baseline. Vocabulary tensors are not judged (their rows burst with rare tokens).

Cost: the largest magnitude of each gradient is one more read pass per checked step (the norms
come with the check); on Ascend parts in saturation mode the guard takes it anyway. Off by
default for that read (the default's limit is 0.1 passes).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import CheckContext, Detector
from .series import Judged, ParamSeries

PEAK = "peak"
"""The kind flagged, and the reason a named tensor carries."""


def crest_factors(maxabs: torch.Tensor, norms: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Each tensor's largest magnitude over its RMS (0 where the norm is 0 or not finite)."""
    rms = norms / sizes.sqrt()
    ok = torch.isfinite(rms) & torch.isfinite(maxabs) & (rms > 0)
    return torch.where(ok, maxabs / rms.clamp_min(torch.finfo(rms.dtype).tiny), torch.zeros_like(rms))


class PeakDetector(Detector):
    """Crest factors of the gradients against their own history (kind ``peak``)."""

    name = "peak"
    wants_maxabs = True

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._series = ParamSeries()
        self._sizes: Optional[tuple] = None  # (entries' ids, their element counts on the device)
        self._judged: Optional[Judged] = None
        self._flags = 0

    def width(self) -> int:
        return 1

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        self._judged = None
        if ctx.maxabs is None or ctx.norms is None:
            return
        stats = self._series.rows(ctx)
        crest = crest_factors(ctx.maxabs, ctx.norms, self._numels(ctx))
        self._judged = stats.judge(crest, self._series.judged, self.cfg, drift=False)
        out[0] = self._judged.zflag.sum()

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        self._flags = int(reduced[0]) if reduced else 0
        return [PEAK] if self._flags > 0 else []

    def suspects(self, ctx: CheckContext, norm_list: list) -> dict:
        if self._judged is None or not self._flags:
            return {}
        return {i: [PEAK] for i, flagged in enumerate(self._judged.zflag.tolist()) if flagged}

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        if not self._flags:
            return {}
        return {"peak": {"tensors": self._flags, "zscore": self.cfg.zscore, "min_ratio": self.cfg.min_ratio}}

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        if accepted and self._judged is not None and self._series.stats is not None:
            self._series.stats.update(self._judged, self.cfg)
        self._judged = None

    def state_dict(self) -> dict:
        params = self._series.state()
        return {"params": params} if params is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self._series.load(state.get("params"))

    def _numels(self, ctx: CheckContext) -> torch.Tensor:
        layout = tuple(map(id, ctx.entries))
        if self._sizes is None or self._sizes[0] != layout:
            counts = torch.tensor([float(g.numel()) for g in ctx.grads], dtype=torch.float32, device=ctx.device)
            self._sizes = (layout, counts)
        return self._sizes[1]
