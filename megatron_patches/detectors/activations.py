"""Activations: a layer's output gone far off its own history while staying finite.

A corrupted activation that stays finite (a kernel scaling its output, a flipped high exponent bit
of one element) often reaches no gradient check: the next layer norm divides most of it out, so the
gradients behind it move less than their natural spread and the loss barely changes. The output
itself shows it plainly: its RMS jumps (x1,000 for a scaled output), or one element dwarfs the rest
(the crest factor, largest magnitude over RMS, as for gradient peaks).

A forward hook on each watched module (``modules``: fnmatch patterns on the global dotted names,
default every layer's ``self_attention`` and ``mlp``) adds, on checked steps only, the output's
squared L2 norm, element count and largest magnitude to per-step sums on the device (two fused
reads of the output, no copy; a recomputed forward adds the same values again, which leaves RMS and
crest factor alone). At the check each module's log RMS and log crest factor are judged like the
history detector's statistics: flagged (kind ``activation``) when more than ``zscore`` standard
deviations and ``min_ratio`` times above its moving mean, after ``warmup_steps`` accepted steps;
an output whose squares overflow float32 (an element of about 2^64 or more) is flagged at once.

Each rank that flagged a module reports the first of them in its forward order (a finding named by
the module, reason ``activation:rms`` or ``activation:crest``): the rank whose module went off first is
the origin. Under tensor parallelism a layer's output is the same on its TP ranks after the reduction,
so a rank that alone shows it is where it happened.

Off by default: it reads every watched output once more per micro-batch of a checked step (an
activation read, not a gradient one), and a few element-wise ops per module at the check.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Callable, Optional

import torch

from .. import naming
from ..incidents import ParamFinding
from .base import CheckContext, Detector

ACTIVATION = "activation"
"""The kind flagged."""


def _first_floating(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() and value.numel() else None
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_floating(item)
            if found is not None:
                return found
    return None


class ActivationRange(Detector):
    """Per watched module, the output's RMS and crest factor against their own history (kind ``activation``)."""

    name = "activations"

    def __init__(self, cfg: Any, step_of: Callable[[], int], checked: Callable[[int], bool]):
        """``step_of``: the step being made now; ``checked``: whether the guard checks a step."""
        self.cfg = cfg
        self._step_of, self._checked = step_of, checked
        self._names: list[str] = []  # watched modules of this rank, in the order they were hooked
        self._index: dict[str, int] = {}
        self._hooked: set[int] = set()
        self._step: Optional[int] = None
        self._sums: dict[int, list] = {}  # module index -> [squared norm, elements, largest magnitude]
        self._mean: Optional[torch.Tensor] = None  # (2, modules): log RMS, log crest factor
        self._var: Optional[torch.Tensor] = None
        self._seen: Optional[torch.Tensor] = None  # accepted samples per module
        self._judged: Optional[tuple] = None  # (values, modules in call order, flags) of the check
        self._present: Optional[torch.Tensor] = None  # modules with a finite output at the check
        self._flags = 0
        self._restored: Optional[dict] = None

    def attach(self, model_chunks: list, ps: Any) -> int:
        hooked = 0
        for name, _, module in naming.name_modules(model_chunks, ps):
            if id(module) in self._hooked or not any(fnmatch.fnmatchcase(name, p) for p in self.cfg.modules):
                continue
            self._hooked.add(id(module))
            self._index[name] = len(self._names)
            self._names.append(name)
            module.register_forward_hook(self._hook(self._index[name]))
            hooked += 1
        return hooked

    def _hook(self, index: int):
        def hook(module, args, output):
            step = self._step_of()
            if not self._checked(step):
                return None
            out = _first_floating(output)
            if out is None:
                return None
            if step != self._step:
                self._step, self._sums = step, {}
            with torch.no_grad():
                norm = torch.linalg.vector_norm(out, dtype=torch.float32)
                peak = torch.linalg.vector_norm(out, ord=math.inf).float()
            held = self._sums.get(index)
            if held is None:
                self._sums[index] = [norm.square(), out.numel(), peak]
            else:
                held[0], held[1], held[2] = held[0] + norm.square(), held[1] + out.numel(), torch.maximum(held[2], peak)
            return None
        return hook

    def width(self) -> int:
        return 1

    def _stats(self, device: torch.device) -> None:
        count = len(self._names)
        if self._mean is None or self._mean.shape[1] != count or self._mean.device != device:
            self._mean = torch.zeros(2, count, device=device)
            self._var = torch.zeros(2, count, device=device)
            self._seen = torch.zeros(count, device=device)
            if self._restored is not None:
                self._load(self._restored, device)

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        self._judged = None
        sums = self._sums if self._step == ctx.step else {}
        if not sums:
            return
        device = out.device
        self._stats(device)
        present = torch.zeros(len(self._names), dtype=torch.bool, device=device)
        values = torch.zeros(2, len(self._names), device=device)
        index = torch.tensor(sorted(sums), dtype=torch.long, device=device)
        square = torch.stack([sums[i][0] for i in sorted(sums)]).to(device)
        counts = torch.tensor([float(sums[i][1]) for i in sorted(sums)], device=device)
        peak = torch.stack([sums[i][2] for i in sorted(sums)]).to(device)
        rms = (square / counts).sqrt()
        ok = torch.isfinite(rms) & torch.isfinite(peak) & (rms > 0)
        tiny = torch.finfo(torch.float32).tiny
        values[0, index] = torch.where(ok, rms.clamp_min(tiny).log(), torch.zeros_like(rms))
        values[1, index] = torch.where(ok, (peak / rms.clamp_min(tiny)).clamp_min(1.0).log(), torch.zeros_like(rms))
        present[index] = ok
        # Squares past float32's range (an element of about 2^64 or more: a flipped exponent bit) are
        # an overflowing crest whatever the history says, as the forward trace's FORWARD_EXTREME.
        overflow = torch.zeros_like(present)
        overflow[index] = ~torch.isfinite(rms) & torch.isfinite(peak)
        std = self._var.clamp_min(1e-12).sqrt()
        above = values - self._mean
        flags = ((above > self.cfg.zscore * std) & (above > math.log(self.cfg.min_ratio))
                 & (self._seen >= self.cfg.warmup_steps) & present)
        flags[1] |= overflow
        self._judged = (values, list(sums), flags)  # the sums' keys are in the order of the step's first calls
        self._present = present
        out[0] = flags.any(dim=0).sum()

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        self._flags = int(reduced[0]) if reduced else 0
        return [ACTIVATION] if self._flags > 0 else []

    def held(self, ctx: CheckContext, ranks: dict) -> list:
        if not self._flags or self._judged is None:
            return []
        values, called, flags = self._judged
        rows = flags.any(dim=0).tolist()
        flagged = [index for index in called if rows[index]]
        if not flagged:
            return []
        first = flagged[0]  # this rank's first flagged module in forward order
        what = [kind for kind, hit in zip(("rms", "crest"), flags[:, first].tolist()) if hit]
        name = self._names[first]
        return [ParamFinding(name=name, layer=naming.layer_of(name), shape=[], nan=0, inf=0, overflow=0, norm=None,
                             ranks=ranks, host=naming.host(), device=naming.device_name(), order=-1,
                             reasons=[f"activation:{kind}" for kind in what])]

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        if not self._flags:
            return {}
        return {"activations": {"modules": self._flags, "zscore": self.cfg.zscore, "min_ratio": self.cfg.min_ratio}}

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        judged, self._judged = self._judged, None
        if self._step == ctx.step:
            self._step, self._sums = None, {}
        if not accepted or judged is None or ctx.replay:
            return
        values, present = judged[0], self._present
        beta = self.cfg.ema_beta
        first = present & (self._seen == 0)
        delta = values - self._mean
        mean = torch.where(first, values, self._mean + (1 - beta) * delta)
        var = torch.where(first, torch.zeros_like(self._var), beta * (self._var + (1 - beta) * delta.square()))
        self._mean = torch.where(present, mean, self._mean)
        self._var = torch.where(present, var, self._var)
        self._seen = self._seen + present.float()

    def forget(self) -> None:
        self._step, self._sums, self._judged = None, {}, None

    def state_dict(self) -> dict:
        if self._mean is None:
            return {}
        return {"names": list(self._names), "mean": self._mean.tolist(), "var": self._var.tolist(),
                "seen": self._seen.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._restored = state or None
        if self._restored is not None and self._mean is not None:
            self._load(self._restored, self._mean.device)

    def _load(self, state: dict, device: torch.device) -> None:
        """Restore the statistics of the modules this rank watches under the same names."""
        names = state.get("names", [])
        for position, name in enumerate(names):
            index = self._index.get(name)
            if index is None:
                continue
            self._mean[:, index] = torch.tensor([row[position] for row in state["mean"]], device=device)
            self._var[:, index] = torch.tensor([row[position] for row in state["var"]], device=device)
            self._seen[index] = float(state["seen"][position])
