"""The moving statistics the history and peak detectors keep per series, and the per-parameter
series of the history detector: its statistics on the host, its judgement on the device in a few
fused operations over all tensors at once (issue 59).

How a checked step's per-parameter z-score costs a handful of device calls whatever the number of
tensors: the statistics (mean, variance, count of the log-share of each tensor) live on the host
in float32 numpy, updated there op for op as the device would (IEEE float32 adds, multiplies,
divisions and square roots round alike everywhere). Before each check the host turns them into one
exact threshold per tensor (:func:`thresholds`): the smallest float32 log-share the z-score rule
flags, found on the float32 lattice, so ``log-share >= threshold`` on the device is the rule itself,
bit for bit, not an approximation of it. The device computes each tensor's share and log-share (the
log stays the device's own), compares and counts, and writes share and log-share into the check's
read buffer beside the all-reduced vector: they come back with the check's one host read, and the
host updates the statistics from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .base import CheckContext

_CLIP = 2.0
"""Once warm, an accepted sample moves the statistics as if it were at most this many
standard deviations from the mean (a Huber-style winsorized update)."""
_MIN_SD = 1e-3
"""Floor on the standard deviation in log space (a perfectly steady series is not infinitely sure)."""


@dataclass
class Judged:
    """One level's view of one checked step, kept until ``commit``."""

    logn: Any
    valid: Any
    z: Any
    zflag: Any
    dflag: Any  # None, as run, for per-tensor series (no growth rule: their run stays 0)
    run: Any
    dev: Any = None  # logn - mean, the floored sd, warm: what update() would compute again
    sd: Any = None
    warmed: Any = None


class _Stats:
    """Moving statistics of log-norms for a vector of series: torch tensors on the device (the peak
    detector's crest factors), numpy arrays on the host (the history's parameters in float32, its
    layers and total in float64: no tensor, no sync).
    Both run the same code (ops torch and numpy spell alike), each op once over the whole vector."""

    FIELDS = ("mean", "var", "count", "last", "run")

    def __init__(self, size: int, device: Optional[torch.device] = None, dtype: type = np.float64):
        """On ``device`` (float32 tensors), else numpy arrays of ``dtype`` on the host (float32: the
        device's arithmetic, op for op, :class:`HostParamSeries`)."""
        self.xp = torch if device is not None else np
        for name in self.FIELDS:
            setattr(self, name, torch.zeros(size, dtype=torch.float32, device=device) if device is not None
                    else np.zeros(size, dtype=dtype))

    @classmethod
    def from_lists(cls, lists: dict, device: Optional[torch.device] = None, dtype: type = np.float64) -> "_Stats":
        stats = cls(len(lists["mean"]), device, dtype)
        for name in cls.FIELDS:
            setattr(stats, name, torch.tensor(lists[name], dtype=torch.float32, device=device) if device is not None
                    else np.array(lists[name], dtype=dtype))
        return stats

    def to_lists(self) -> dict:
        return {name: getattr(self, name).tolist() for name in self.FIELDS}

    def take(self, index: list[int], device: Optional[torch.device] = None, dtype: type = np.float64) -> "_Stats":
        """Rows ``index`` (-1: a fresh row) as a new _Stats on ``device``, else on the host in ``dtype``."""
        out = _Stats(len(index), device, dtype)
        keep = [(new, old) for new, old in enumerate(index) if old >= 0]
        if keep and device is None:
            new_rows, old_rows = np.array([n for n, _ in keep]), np.array([o for _, o in keep])
            for name in self.FIELDS:
                getattr(out, name)[new_rows] = getattr(self, name)[old_rows]
        elif keep:
            new_rows = torch.tensor([n for n, _ in keep], device=device)
            old_rows = torch.tensor([o for _, o in keep], device=self.mean.device)
            for name in self.FIELDS:
                getattr(out, name)[new_rows] = getattr(self, name)[old_rows].to(device)
        return out

    def judge(self, values: Any, valid: Any, cfg: Any, drift: bool = True, min_ratio: Optional[float] = None) -> Judged:
        xp = self.xp
        logn = xp.log(xp.clip(values, 1e-30, None))
        valid = valid & xp.isfinite(values) & (values > 0)
        warmed = self.count >= cfg.warmup_steps
        dev = logn - self.mean
        sd = xp.clip(xp.sqrt(self.var), _MIN_SD, None)
        z = dev / sd
        floor = math.log(cfg.min_ratio if min_ratio is None else min_ratio)
        zflag = valid & warmed & (z > cfg.zscore) & (dev > floor)
        if drift:
            grow = valid & (self.count > 0) & (logn - self.last > math.log(cfg.drift_ratio))
            run = xp.where(grow, self.run + 1, xp.zeros_like(self.run))
            dflag = valid & warmed & (run >= cfg.drift_steps)
        else:  # per-tensor series: no growth rule (see the module docstring)
            run, dflag = None, None
        return Judged(logn, valid, z, zflag, dflag, run, dev, sd, warmed)

    def update(self, j: Judged, cfg: Any) -> None:
        xp = self.xp
        alpha = xp.clip(1.0 / (counted := self.count + 1), 1.0 - cfg.ema_beta, None)
        limit = _CLIP * j.sd  # > 0: once warm, the deviation is held within +-limit
        dev = xp.where(j.warmed, xp.clip(j.dev, -limit, limit), j.dev)
        step = alpha * dev  # (alpha * dev) * dev below is the variance's alpha * dev * dev, op for op
        self.mean = xp.where(j.valid, self.mean + step, self.mean)
        self.var = xp.where(j.valid, (1.0 - alpha) * (self.var + step * dev), self.var)
        self.count = xp.where(j.valid, counted, self.count)
        self.last = xp.where(j.valid, j.logn, self.last)
        self.run = xp.where(j.valid, 0.0 if j.run is None else j.run, self.run)


class ParamSeries:
    """One :class:`_Stats` row per parameter tensor of this rank, on the device (the peak detector's),
    kept in the order of the check's entries: rows follow a parameter by (name, shape) when the
    entries change (a restart, a new optimizer) and start fresh for a new one. Vocabulary tensors are never judged
    (:func:`is_vocabulary`): ``judged`` is False for them."""

    HOST = False
    """The rows on the host (numpy of :attr:`DTYPE`, ``judged`` a numpy mask) instead of the check's device."""
    DTYPE: type = np.float64

    def __init__(self) -> None:
        self.stats: Optional[_Stats] = None
        self.keys: Optional[tuple] = None  # (name, shape) per row
        self.judged: Optional[torch.Tensor] = None
        self._layout: Optional[tuple] = None
        self._loaded: Optional[dict] = None

    def rows(self, ctx: CheckContext) -> _Stats:
        """The statistics for ``ctx.entries``, in their order."""
        layout = tuple(map(id, ctx.entries))
        if layout == self._layout and self.stats is not None:
            return self.stats
        keys = tuple((e.info.name, tuple(e.model.shape)) for e in ctx.entries)
        device = None if self.HOST else ctx.device
        source, old_keys = self._previous()
        where = {k: i for i, k in enumerate(old_keys)}
        index = [where.get(k, -1) for k in keys]
        self.stats = (source.take(index, device, self.DTYPE) if source is not None
                      else _Stats(len(keys), device, self.DTYPE))
        self.keys, self._layout = keys, layout
        judged = [not is_vocabulary(k[0]) for k in keys]
        self.judged = (np.array(judged, dtype=bool) if self.HOST
                       else torch.tensor(judged, dtype=torch.bool, device=ctx.device))
        self._rows_changed()
        return self.stats

    def _rows_changed(self) -> None:
        """Called when :meth:`rows` made new rows."""

    def _previous(self) -> tuple:
        """The statistics a new layout of rows carries over and their keys: those kept, else those
        a checkpoint loaded (made into statistics once), else none."""
        if self.stats is not None and self.keys is not None:
            return self.stats, self.keys
        if self._loaded is None:
            return None, ()
        loaded, self._loaded = self._loaded, None
        made = _Stats.from_lists(loaded, None if self.HOST else torch.device("cpu"), self.DTYPE)
        return made, tuple((n, tuple(s)) for n, s in zip(loaded["names"], loaded["shapes"]))

    def state(self) -> Optional[dict]:
        """Names, shapes and statistics (lists), or None with none kept."""
        if self.stats is not None and self.keys is not None:
            return {"names": [k[0] for k in self.keys], "shapes": [list(k[1]) for k in self.keys],
                    **self.stats.to_lists()}
        return self._loaded  # loaded, no step checked since

    def load(self, lists: Optional[dict]) -> None:
        """Keep ``lists`` (from :meth:`state`) until the next check matches them to its entries."""
        self.stats, self.keys, self.judged, self._layout, self._loaded = None, None, None, None, lists


def is_vocabulary(name: str) -> bool:
    """Tensors indexed by token (word embeddings, the output layer): their gradient lives in
    the rows of the tokens a batch holds, so it bursts whenever rare tokens come by (with
    byte tokens and TP 2, the output layer's shard of bytes 128-255 on every non-ASCII
    passage). Their history is not a baseline; ``peers`` judges them by their share of the
    model, from the first step."""
    return name.endswith(("word_embeddings.weight", "output_layer.weight"))


# --- the history's per-parameter series: host statistics, device judgement ------------------

_F32 = np.float32
_POSITIVE_ABOVE = -69.0
"""log(1e-30), the log-share of a clipped zero share, is -69.08: thresholds above this make the
zero shares (judged invalid) unable to reach them, so the device needs no ``share > 0`` test."""
_STEPS = 8
"""Steps along the float32 lattice from the estimate to the exact threshold (one or two suffice);
rows still off after these are found by bisection."""


class HostParamSeries(ParamSeries):
    """The history's per-parameter series: float32 :class:`_Stats` on the host, rows kept in the
    order of the check's entries as :class:`ParamSeries` keeps them; ``judged`` a numpy mask. Holds
    the thresholds the device compares with (:meth:`device_thresholds`)."""

    HOST = True
    DTYPE = np.float32

    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        """Bumped whenever the statistics or the rows change: the thresholds are made again."""
        self._made: Optional[tuple] = None  # (version, sample key) of the thresholds held
        self._host: Optional[torch.Tensor] = None  # the thresholds (CPU float32) and their numpy view
        self._host_np: Optional[np.ndarray] = None
        self._device: Optional[torch.Tensor] = None
        self.positive_needed = False
        """A threshold at or below :data:`_POSITIVE_ABOVE`: the device must test ``share > 0`` too."""
        self._sd: Optional[tuple] = None  # (version, the floored standard deviations: float32 numpy)
        self._root: Optional[tuple] = None  # where a CPU run takes its square roots: (variances, roots)
        self._root_np: Optional[tuple] = None  # their numpy views

    def _rows_changed(self) -> None:
        self._host = self._host_np = self._device = self._root = self._root_np = None
        self.version += 1

    def sd(self, device: torch.device) -> np.ndarray:
        """``clip(sqrt(var), _MIN_SD)`` in float32, with the square root of the device the rule ran on
        before: torch's vectorized one on a CPU run (it is not IEEE's to the last bit: one device
        call), IEEE's on an accelerator (numpy's, as CUDA's ``sqrtf``; not run here)."""
        if self._sd is None or self._sd[0] != self.version:
            var = self.stats.var
            if device.type == "cpu":
                if self._root is None or len(self._root_np[1]) != len(var):  # (variances, roots), numpy views
                    self._root = (torch.empty(len(var), dtype=torch.float32), torch.empty(len(var), dtype=torch.float32))
                    self._root_np = (self._root[0].numpy(), self._root[1].numpy())
                self._root_np[0][:] = var
                torch.sqrt(self._root[0], out=self._root[1])
                root = self._root_np[1]
            else:
                root = np.sqrt(var)
            self._sd = (self.version, np.clip(root, _F32(_MIN_SD), None))
        return self._sd[1]

    def load(self, lists: Optional[dict]) -> None:
        super().load(lists)
        self.version += 1

    def device_thresholds(self, mask: np.ndarray, sample_key: Any, cfg: Any, device: torch.device) -> torch.Tensor:
        """Each row's exact threshold on the device, ``+inf`` where ``mask`` (judged and sampled) is
        off or the row is not warm; made again only when the statistics or the sample changed. On
        a CPU run the host's tensor is the device's: no copy."""
        if self._made != (self.version, sample_key) or self._host is None:
            if self._host is None:
                self._host = torch.empty(len(mask), dtype=torch.float32)
                self._host_np = self._host.numpy()
                self._device = self._host if device.type == "cpu" else torch.empty_like(self._host, device=device)
            ready = mask & (self.stats.count >= cfg.warmup_steps)
            self._host_np[:] = thresholds(self.stats, ready, cfg, self.sd(device))
            self.positive_needed = bool((self._host_np <= _POSITIVE_ABOVE).any())
            if self._device is not self._host:
                self._device.copy_(self._host)
            self._made = (self.version, sample_key)
        return self._device

    def judge_host(self, logn: np.ndarray, share: np.ndarray, mask: np.ndarray, cfg: Any,
                   device: torch.device) -> Judged:
        """The z-score rule on the host over the device's log-shares (float32, op for op the
        device's :meth:`_Stats.judge`): what the update and the slow path read."""
        stats = self.stats
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            valid = mask & np.isfinite(share) & (share > 0)
            warmed = stats.count >= cfg.warmup_steps
            dev = logn - stats.mean
            sd = self.sd(device)
            z = dev / sd
            zflag = valid & warmed & (z > _F32(cfg.zscore)) & (dev > _F32(math.log(cfg.min_ratio)))
        return Judged(logn, valid, z, zflag, None, None, dev, sd, warmed)

    def update(self, judged: Judged, cfg: Any) -> None:
        with np.errstate(invalid="ignore", over="ignore"):
            self.stats.update(judged, cfg)
        self.version += 1


def thresholds(stats: _Stats, ready: np.ndarray, cfg: Any, sd: np.ndarray) -> np.ndarray:
    """Per row of float32 host ``stats``: the smallest float32 log-share ``x`` that the z-score rule
    flags, ``fl(fl(x - mean) / sd) > zscore`` and ``fl(x - mean) > log(min_ratio)`` in float32 as the
    device evaluates it; ``+inf`` where ``ready`` is off. Both roundings are monotone in ``x``, so the
    flagged log-shares are exactly those ``>=`` the threshold. Found from the real-number estimate by
    steps along the float32 lattice (bisection for any row still off). ``sd``: the rows' floored
    standard deviations (:meth:`HostParamSeries.sd`)."""
    mean = stats.mean
    zscore, floor = _F32(cfg.zscore), _F32(math.log(cfg.min_ratio))

    def hit(x: np.ndarray) -> np.ndarray:
        dev = x - mean
        return (dev / sd > zscore) & (dev > floor)

    inf = np.full(mean.shape, np.inf, dtype=_F32)
    with np.errstate(over="ignore", invalid="ignore"):
        x = (mean.astype(np.float64) + np.maximum(zscore * sd, floor).astype(np.float64)).astype(_F32)
        for _ in range(_STEPS):
            low = ready & ~hit(x)
            if not low.any():
                break
            x = np.where(low, np.nextafter(x, inf), x)
        for _ in range(_STEPS):
            below = np.nextafter(x, -inf)
            lower = ready & hit(below)
            if not lower.any():
                break
            x = np.where(lower, below, x)
        off = ready & (~hit(x) | hit(np.nextafter(x, -inf)))
        if off.any():
            x = np.where(off, _bisect(hit, mean.shape), x)
    return np.where(ready, x, inf)


def _bisect(hit: Any, shape: tuple) -> np.ndarray:
    """The smallest finite float32 where ``hit`` turns true, per row, by bisection over the float32
    lattice in order (+inf where it never does)."""
    def value(key: np.ndarray) -> np.ndarray:
        bits = np.where(key < 0, (-key) | 0x80000000, key).astype(np.uint32)
        return bits.view(_F32)

    lo = np.full(shape, -0x7F7FFFFF, dtype=np.int64)  # -FLT_MAX
    hi = np.full(shape, 0x7F7FFFFF, dtype=np.int64)  # FLT_MAX
    never = ~hit(value(hi))
    for _ in range(33):
        mid = (lo + hi) // 2
        up = hit(value(mid))
        hi, lo = np.where(up, mid, hi), np.where(up, lo, mid)
    return np.where(never, np.inf, np.where(hit(value(lo)), value(lo), value(hi))).astype(_F32)


def judge_on_device(norms: torch.Tensor, share: torch.Tensor, logn: torch.Tensor, limits: torch.Tensor,
                    positive: bool, out: torch.Tensor) -> None:
    """Each tensor's share of this rank's gradient (norm over the norm of the rest, in float64 as
    ``history.shares`` takes it) into ``share``, its log (clipped at 1e-30) into ``logn`` (both in
    the check's read buffer), and the count of log-shares at or above ``limits`` into ``out``: 13
    device calls over all tensors at once. A non-finite norm's share is NaN here (its rest is
    non-finite), which no threshold reaches and the host judges invalid, as ``shares`` judged its 0
    or Inf; every finite share equals ``shares``' bit for bit."""
    wide = norms.double()
    squares = wide.square()
    rest = torch.maximum(torch.nan_to_num(squares, nan=0.0, posinf=0.0).sum() - squares, squares * 1e-16)
    torch.div(wide, rest.sqrt_(), out=share)
    torch.log(torch.clamp(share, min=1e-30), out=logn)
    flagged = logn >= limits
    if positive:
        flagged &= share > 0
    torch.sum(flagged, dim=0, keepdim=True, dtype=torch.float32, out=out)
