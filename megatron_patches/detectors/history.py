"""Gradient-norm history: outliers and sustained growth that are still finite.

Three levels are watched: every parameter (this rank's, judged on the device against exact
thresholds, its statistics kept on the host: :mod:`.series`), every layer and the
whole model (world-wide norms the monitor has already reduced, so judged on the host with
no extra collective). A parameter and a layer are judged by their *share*: the norm over the
norm of the rest (this rank's other parameters; the other layers), so that a natural loss
spike, which lifts the whole model at once, does not look like a fault in each tensor; the
whole model is judged by its norm. Each series keeps, in log space, an exponential moving
mean and variance, a count of accepted samples, the last accepted value and a growth run length:

- ``zscore``: the log-value is more than ``zscore`` standard deviations above the moving
  mean *and* more than ``min_ratio`` times the baseline ``exp(mean)`` (``total_min_ratio``
  for the whole model's norm).
- ``drift`` (layers and total only): the value grew by more than ``drift_ratio`` on each of
  ``drift_steps`` consecutive checked steps. Single tensors are too noisy for a per-step rule
  (a layer-norm bias grows 20% five times in a row in clean runs); a tensor that keeps
  growing trips its own z-score within a few steps, and a growth that matters shows in its layer.

No verdict before ``warmup_steps`` accepted samples. Only accepted steps update the
statistics (``commit(accepted=False)`` leaves them alone), and once warm each update is
winsorized to +-2 standard deviations, so neither a skipped bad step nor an accepted
near-miss can drag the baseline. Memory: five floats per parameter tensor and per layer.
``state_dict`` carries all of it, so a restart keeps its baseline and checks its first step.
See docs/detectors.md for why EMA rather than median/MAD, and what the defaults are based on.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Optional

import numpy as np
import torch

from .. import collectives, naming
from .base import CheckContext, Detector, Rotation
from .series import _CLIP, _MIN_SD, HostParamSeries, Judged, ParamSeries, _Stats, is_vocabulary, judge_on_device

__all__ = ["HistoryDetector", "Judged", "ParamSeries", "is_vocabulary", "judged_slots", "shares", "_CLIP", "_MIN_SD",
           "_Stats"]

log = logging.getLogger(__name__)

_Z = 0  # slot of this detector's piece of the reduced vector: parameters over their z-score
_STATE_VERSION = 2
"""Version 2 keeps shares for parameters and layers; a version-1 baseline (raw norms) is not
comparable with them and is dropped at load (the detector warms up again)."""
_TRACE = "MEGATRON_PATCHES_HISTORY_TRACE"
"""Measurement aid: a file rank 0 appends each judged step's log-norms to (JSON lines), the
input of scripts/history_replay.py."""


class HistoryDetector(Detector):
    """z-score outliers (kind ``zscore``) and sustained growth (kind ``drift``) of gradient norms."""

    name = "history"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._rotation = Rotation(cfg.interval, cfg.sample_fraction)
        self._checks = 0
        self._active = False
        self._series = HostParamSeries()
        self._total: Optional[_Stats] = None
        self._layers: Optional[_Stats] = None
        self._judged: dict[str, Optional[Judged]] = {}
        self._param_flags = 0.0
        self._mask: Optional[np.ndarray] = None  # the parameters judged this check (judged and sampled)
        self._tail: Optional[tuple] = None  # (the check's tail for this detector, its share and log-share halves)

    # --- fast path -------------------------------------------------------------------

    def width(self) -> int:
        return 1 if self.cfg.per_param else 0

    def tail_width(self, count: int) -> int:
        """Each tensor's share and log-share, read back with the check's vector (series.py)."""
        return 2 * count if self.cfg.per_param else 0

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        self._checks += 1
        self._active = self._rotation.due(self._checks)
        self._judged, self._mask = {}, None
        if not self._active or not self.cfg.per_param or ctx.norms is None:
            return
        self._series.rows(ctx)
        # Parameters are judged by z-score only: per-tensor norms (biases, norms) are too noisy
        # for a per-step growth rule; a growth that matters shows in its layer's norm.
        mask, turn = self._series.judged, None
        if self._rotation.period > 1:
            turn = self._rotation.turn(self._checks)
            mask = (np.arange(len(mask)) % self._rotation.period == turn) & mask
        self._mask = mask
        tail = ctx.tails[self.name]
        if self._tail is None or self._tail[0] is not tail:  # the check's buffer is kept: so are its halves
            self._tail = (tail, tail[:len(mask)], tail[len(mask):])
        limits = self._series.device_thresholds(mask, turn, self.cfg, ctx.device)
        judge_on_device(ctx.norms, self._tail[1], self._tail[2], limits, self._series.positive_needed, out)

    def _params_judged(self, ctx: CheckContext) -> None:
        """The parameters' judgement on the host, from the shares and log-shares read back."""
        values = ctx.tail_values.get(self.name) if self._mask is not None else None
        if values is not None:
            count = len(self._mask)
            share = np.array(values[:count], dtype=np.float32)
            logn = np.array(values[count:2 * count], dtype=np.float32)
            self._judged["params"] = self._series.judge_host(logn, share, self._mask, self.cfg, ctx.device)

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        if not self._active:
            return []
        self._param_flags = reduced[_Z] if self.cfg.per_param else 0.0
        self._params_judged(ctx)
        layers = ctx.layer_norms or []
        if self._total is None or self._layers is None or len(self._layers.mean) != len(layers):
            self._total, self._layers = _Stats(1), _Stats(len(layers))
        for level, stats, values, floor in (("total", self._total, np.array([ctx.total_norm]), self.cfg.total_min_ratio),
                                            ("layers", self._layers, shares(np.array(layers, dtype=float)), None)):
            self._judged[level] = stats.judge(values, judged_slots(len(values)) if level == "layers" else
                                              np.ones(1, dtype=bool), self.cfg, min_ratio=floor)
        if os.environ.get(_TRACE) and collectives.rank() == 0:
            self._trace(ctx)
        kinds = []
        if self._param_flags > 0 or any(bool(j.zflag.any()) for k, j in self._judged.items() if k != "params"):
            kinds.append("zscore")
        if any(bool(j.dflag.any()) for k, j in self._judged.items() if j.dflag is not None):
            kinds.append("drift")
        return kinds

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        if self._active and accepted:
            if self._judged.get("params") is not None and self._series.stats is not None:
                self._series.update(self._judged["params"], self.cfg)
            for level, stats in (("total", self._total), ("layers", self._layers)):
                if self._judged.get(level) is not None and stats is not None:
                    stats.update(self._judged[level], self.cfg)
        self._judged = {}

    # --- slow path -------------------------------------------------------------------

    def suspects(self, ctx: CheckContext, norm_list: list) -> dict:
        if not self._judged:
            return {}
        params = self._judged.get("params")
        if params is not None and self._param_flags > 0:
            # Some parameter tripped its own statistics somewhere: name those, nothing else.
            return {i: ["zscore"] for i, z in enumerate(params.zflag.tolist()) if z}
        reasons, slots, whole = [], set(), False
        for level in ("total", "layers"):
            j = self._judged.get(level)
            if j is None:
                continue
            for kind, flags in (("zscore", j.zflag.tolist()), ("drift", j.dflag.tolist())):
                hit = [i for i, f in enumerate(flags) if f]
                if hit:
                    reasons.append(f"{kind}_{'total' if level == 'total' else 'layer'}")
                    whole = whole or level == "total"
                    slots.update(hit if level == "layers" else ())
        if not reasons:
            return {}
        # Only the total or a layer tripped: name the largest contributor (of that layer).
        best = self._largest_contributor(ctx, norm_list, None if whole else slots)
        return {best: reasons} if best is not None else {}

    def _largest_contributor(self, ctx: CheckContext, norm_list: list, slots: Optional[set]) -> Optional[int]:
        """The parameter whose squared norm rose most above its own baseline (its baseline share
        of the rest of this rank's gradient, at this step's rest)."""
        params = self._series.stats
        baseline = torch.from_numpy(params.mean).exp().tolist() if params is not None and self.cfg.per_param else None
        finite = [n if math.isfinite(n) else 0.0 for n in norm_list]
        whole = sum(n * n for n in finite)
        best, best_rise = None, 0.0
        for i, (entry, norm) in enumerate(zip(ctx.entries, norm_list)):
            if slots is not None and entry.slot not in slots or not math.isfinite(norm):
                continue
            rest = max(whole - norm * norm, 0.0)
            base = baseline[i] * math.sqrt(rest) if baseline is not None and baseline[i] > 1e-30 else 0.0
            rise = norm * norm - base * base
            if rise > best_rise:
                best, best_rise = i, rise
        return best

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        if not self._judged:
            return {}
        tripped = []
        for level, stats in (("total", self._total), ("layers", self._layers)):
            j = self._judged.get(level)
            if j is None or stats is None:
                continue
            rows = zip(j.z.tolist(), j.zflag.tolist(), j.dflag.tolist(), j.run.tolist(), j.logn.tolist(),
                       stats.mean.tolist())
            for i, (z, zf, df, run, logn, mean) in enumerate(rows):
                if zf or df:
                    tripped.append({
                        "level": "total" if level == "total" else naming.slot_name(i, len(j.z), layer_prefix="layer "),
                        "kinds": (["zscore"] if zf else []) + (["drift"] if df else []),
                        "z": round(z, 2), "ratio_to_baseline": round(math.exp(logn - mean), 3),
                        "growth_steps": int(run)})
        if self._param_flags:
            tripped.append({"level": "parameters", "kinds": ["zscore"], "count": int(self._param_flags)})
        if not tripped:
            return {}
        cfg = self.cfg
        return {"history": {"tripped": tripped, "zscore": cfg.zscore, "min_ratio": cfg.min_ratio,
                            "total_min_ratio": cfg.total_min_ratio,
                            "drift_ratio": cfg.drift_ratio, "drift_steps": cfg.drift_steps,
                            "baseline_steps": int(self._total.count[0]) if self._total is not None else 0}}

    # --- state -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        state: dict[str, Any] = {"version": _STATE_VERSION, "checks": self._checks}
        params = self._series.state()
        if params is not None:
            state["params"] = params
        for level in ("total", "layers"):
            stats = getattr(self, f"_{level}")
            if stats is not None:
                state[level] = stats.to_lists()
        return state

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self._checks = int(state.get("checks", 0))
        if state.get("version", 1) != _STATE_VERSION:
            log.warning("history: the saved baseline is of an older kind (raw norms, not shares); warming up again")
            self._total = self._layers = None
            self._series.load(None)
            return
        for level in ("total", "layers"):
            lists = state.get(level)
            setattr(self, f"_{level}", _Stats.from_lists(lists) if lists else None)
        # Per-parameter rows are matched by (name, shape) at the next check, on the device.
        self._series.load(state.get("params"))

    # --- helpers ---------------------------------------------------------------------

    def _trace(self, ctx: CheckContext) -> None:
        line: dict[str, Any] = {"step": ctx.step, **{level: self._judged[level].logn.tolist()
                                                     for level in ("total", "layers")}}
        params = self._judged.get("params")
        if params is not None:
            line["params"] = params.logn.tolist()
            if not os.path.exists(os.environ[_TRACE]):
                line["names"] = [k[0] for k in self._series.keys or ()]
        with open(os.environ[_TRACE], "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")


def judged_slots(count: int) -> np.ndarray:
    """Layer slots judged on their own: the transformer layers, not the embedding and output
    slots (the last two), whose gradients are the vocabulary tensors' (see is_vocabulary)."""
    mask = np.ones(count, dtype=bool)
    mask[max(0, count - 2):] = False
    return mask


def shares(norms: Any) -> Any:
    """Each norm over the norm of all the others in the same vector (torch or numpy): the
    common mode removed. In float64, with the rest floored at 1e-16 of the value's own square,
    so a series holding almost all of the sum reads as a share of 1e8, not of 0/0. Non-finite
    norms count in no one's rest; a zero norm gives a zero share (judged invalid)."""
    if isinstance(norms, torch.Tensor):
        wide = norms.double()
        # A float32 norm squares to a finite double: NaN and +inf squares are the non-finite norms.
        squares = torch.nan_to_num(wide.square(), nan=0.0, posinf=0.0)
        rest = torch.maximum(squares.sum() - squares, 1e-16 * squares)
        return torch.where(rest > 0, wide / rest.sqrt(), 0.0).float()
    wide = np.asarray(norms, dtype=np.float64)
    squares = np.where(np.isfinite(wide), wide * wide, 0.0)
    rest = np.maximum(squares.sum() - squares, 1e-16 * squares)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(rest > 0, wide / np.sqrt(rest), 0.0)
