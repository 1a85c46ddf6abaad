"""The check stage: the gradients' norms (read once with Megatron's own clipping norm where the
seams can, else one fused pass), one small all-reduce, one host read.

Each rank fills a float32 vector: counts of checked and of finite, too large and saturated
gradients, the count of ranks that were an origin before the reduction, the total and per-layer
sums of squares, then each detector's own slots. One all-reduce sums it over the job, so every rank
reads the same numbers and reaches the same :class:`Verdict` without a further collective.

Per checked step that is a fixed handful of device calls whatever the number of tensors (issue 59):
the vector's constants (the count of tensors checked, detectors' fixed slots) are copied in from a
template in one op, the per-layer sums and every detector's per-tensor sums of squares are added by
one ``index_put_`` over a stacked index, the detectors' per-tensor values read back unreduced
(:meth:`~megatron_patches.detectors.Detector.tail_width`) share the vector's buffer and its one
host read, and a world of one rank skips the all-reduce (a sum over one rank is itself).
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .collectives import BoundedGroup, collective_device
from .detectors import CheckContext
from .naming import slot_names
from .protocols import Seams

log = logging.getLogger("megatron_patches")

# Slots of the reduced vector ahead of the per-layer sums of squares. _ORIGINS counts the ranks
# whose own gradients were non-finite before the data-parallel reduction: which ranks they were is
# gathered on the slow path, so the vector's size does not grow with the world.
_NONFINITE, _OVER_PARAM, _SATURATED, _TOTAL_SQ, _ORIGINS, _FINITE, _HEAD = 0, 1, 2, 3, 4, 5, 6
"""_NONFINITE holds the count of gradients checked on the device (the template's), the count of
non-finite ones once the host has taken away the finite ones' (_FINITE)."""


@dataclass
class Verdict:
    """One check's result, identical on every rank (the detectors' context is this rank's)."""

    ctx: CheckContext
    maxabs: Optional[torch.Tensor]
    """Per-gradient largest magnitude on the device (saturation mode only)."""
    total_over: bool
    """The total norm is over ``magnitude.total_norm_max`` (and finite)."""
    kinds: list
    """What the detectors flagged."""
    reduced: dict
    """Each detector's world-wide slots, by name."""
    layer_sq: list
    """World-wide per-layer sums of squares (slot order, :func:`~megatron_patches.naming.slot_names`)."""
    flagged: bool

    @property
    def layer_norms(self) -> dict[str, float]:
        return dict(zip(slot_names(len(self.layer_sq)), self.ctx.layer_norms or []))


class CheckStage:
    """Builds and reduces the vector for the optimizers it is given; caches per optimizer."""

    def __init__(self, config: Any, detectors: list, peers: BoundedGroup, model_chunks: Any, seams: Seams):
        """``peers``: the guard's bounded group, made at the first check; ``model_chunks``: the
        run's :class:`~megatron_patches.seams.model_chunks.ModelChunks` (parameter names);
        ``seams``: how gradients pair with parameters (``build_entries``, ``current_grads``)."""
        self.config = config
        self.detectors = detectors
        self._maxabs_wanted = any(d.wants_maxabs for d in detectors)  # the list is fixed for the run
        self.peers = peers
        self.model_chunks = model_chunks
        self.seams = seams
        self._detector_width: Optional[int] = None  # known once the detectors are sized (first check)
        self._entries: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()
        self._num_slots: dict[int, int] = {}
        self._static: dict[tuple, tuple] = {}
        self._vectors: dict[tuple, tuple] = {}

    def entries_for(self, optimizer: Any) -> list:
        entries = self._entries.get(optimizer)
        if entries is None:
            entries, self._num_slots[id(optimizer)] = self.seams.build_entries(optimizer, self.model_chunks.chunks_for(optimizer) or [])
            self._entries[optimizer] = entries
        return entries

    def first_optimizer(self) -> Optional[Any]:
        """An optimizer checked so far (for the scene's optimizer metadata), or None."""
        return next(iter(self._entries.keys()), None)

    def run(self, optimizer: Any, entries: list, step: int, origin_flag: Optional[torch.Tensor],
            saturation: bool, replay: bool = False) -> Verdict:
        """Check ``optimizer``'s gradients of ``step`` on every rank; ``origin_flag``: this rank's
        pre-reduction flag (:mod:`~megatron_patches.seams.origin`); ``replay``: gradients recomputed
        for a step already checked."""
        if self._detector_width is None:
            self._size_detectors(entries)
        ctx, maxabs, held = self._local(optimizer, entries, step, origin_flag, saturation, replay)
        self.peers.prepare()  # once, while every rank is here
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(held.vec)  # every rank joins, stub optimizers included
        values = held.buffer.tolist()  # the one host read of a checked step
        ctx.tail_values = {name: values[start:end] for name, (start, end) in held.tail_spans.items()}
        del values[held.vec_size:]
        values[_NONFINITE] -= values[_FINITE]  # checked minus finite: exact integers in float32
        num_slots = self._num_slots[id(optimizer)]
        ctx.total_norm = math.sqrt(values[_TOTAL_SQ]) if values[_TOTAL_SQ] >= 0 else float("nan")
        layer_sq = values[_HEAD:_HEAD + num_slots]
        ctx.layer_norms = [math.sqrt(v) if v >= 0 else float("nan") for v in layer_sq]
        magnitude = self.config.detectors.magnitude
        total_over = (magnitude.enabled and magnitude.total_norm_max is not None
                      and not ctx.total_norm <= magnitude.total_norm_max and values[_NONFINITE] == 0)
        kinds, reduced, offset = [], {}, _HEAD + num_slots
        for detector in self.detectors:
            width = detector.width()
            reduced[detector.name] = values[offset:offset + width]
            kinds += detector.verdict(ctx, reduced[detector.name])
            offset += width
        # A rank whose own gradients were non-finite before the reduction flags the step even where
        # the reduced gradients escape this check (Megatron's bucket check was left to us).
        flagged = bool(values[_NONFINITE] or values[_OVER_PARAM] or values[_SATURATED] or total_over
                       or kinds or values[_ORIGINS])
        return Verdict(ctx, maxabs, total_over, kinds, reduced, layer_sq, flagged)

    def _size_detectors(self, entries: list) -> None:
        """Detectors whose width depends on the model agree on it: each rank's sizes, their
        maximum over the world (one all-reduce of a few integers, at the first check only)."""
        wanted = [detector.sizes(entries) for detector in self.detectors]
        flat = [n for sizes in wanted for n in sizes]
        if flat and torch.distributed.is_initialized():
            agreed = torch.tensor(flat, dtype=torch.float64, device=collective_device())
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
            flat = [int(n) for n in agreed.tolist()]
        for detector, sizes in zip(self.detectors, wanted):
            if sizes:
                detector.size(flat[:len(sizes)])
                flat = flat[len(sizes):]
        self._detector_width = sum(d.width() for d in self.detectors)

    def commit(self, verdict: Verdict, accepted: bool) -> None:
        """Tell the detectors whether the step's gradients were applied (their baselines move)."""
        for detector in self.detectors:
            detector.commit(verdict.ctx, accepted=accepted)

    def _static_tensors(self, optimizer: Any, live: list, device: torch.device):
        key = (id(optimizer), len(live), device)
        cached = self._static.get(key)
        if cached is None:
            unit = all(e.weight == 1.0 for e in live)  # x * 1.0 is x: no multiply
            weights = None if unit else torch.tensor([e.weight for e in live], dtype=torch.float32, device=device)
            limits = torch.tensor([torch.finfo(e.model.dtype).max if e.model.dtype.is_floating_point else math.inf
                                   for e in live], dtype=torch.float32, device=device)
            cached = self._static[key] = (weights, [_HEAD + e.slot for e in live], limits)
        return cached

    def _local(self, optimizer: Any, entries: list, step: int, origin_flag: Optional[torch.Tensor],
               saturation: bool, replay: bool):
        """Per-parameter norms on the device and this rank's vector to all-reduce: a few vector ops
        over all tensors at once, whatever their number (no torch call per tensor)."""
        pairs = [(e, g) for e, g in self.seams.current_grads(optimizer, entries) if g is not None and 0 not in g.shape]
        live = [e for e, _ in pairs]
        grads = [g for _, g in pairs]
        device = grads[0].device if grads else collective_device()
        ctx = CheckContext(step=step, entries=live, grads=grads, norms=None, device=device, replay=replay)
        maxabs, weights, slots, limits = None, None, [], None
        if grads:
            weights, slots, limits = self._static_tensors(optimizer, live, device)
            ctx.norms = self._norms(optimizer, grads)
        plans = [detector.plan(ctx) for detector in self.detectors]
        held = self._held(optimizer, device, len(live) if grads else 0)
        views, vec = held.views, held.vec
        template, index = held.planned(self, slots, plans)
        if grads:
            norms = ctx.norms
            squares = ctx.squares = norms.square() if weights is None else norms.square() * weights
            # One op: the vector's start (zeros, the count checked, the detectors' constants), plus
            # each tensor's weighted square into its layer's sum and the detectors' planned slots.
            torch.ops.aten.index_put.out(template, (index,), squares, True, out=vec)
            torch.sum(squares, dim=0, out=views[_TOTAL_SQ])
            detectors = self.config.detectors
            if detectors.nonfinite.enabled:
                torch.sum(torch.isfinite(norms), dim=0, dtype=torch.float32, out=views[_FINITE])
            if detectors.magnitude.enabled and detectors.magnitude.param_norm_max is not None:
                vec[_OVER_PARAM] = (norms > detectors.magnitude.param_norm_max).sum()
            if saturation or self._maxabs_wanted:
                ctx.maxabs = torch.stack(torch._foreach_norm(grads, float("inf"))).float()
            if saturation:  # the findings' overflow counts come with the saturation check only
                maxabs = ctx.maxabs
                vec[_SATURATED] = (maxabs >= limits).sum()
        else:
            vec.copy_(template)
        if origin_flag is not None:
            views[_ORIGINS].copy_(origin_flag)
        ctx.tails = held.tails
        for detector, out in zip(self.detectors, views[_HEAD:]):
            detector.local(ctx, out)
        return ctx, maxabs, held

    def _held(self, optimizer: Any, device: torch.device, count: int) -> "_Held":
        """The buffers of this optimizer's check (made once per optimizer, device and number of
        tensors checked, and kept: the check reads them back before it returns)."""
        key = (id(optimizer), device, count)
        held = self._vectors.get(key)
        if held is None:
            held = self._vectors[key] = _Held(self, device, count, self._num_slots[id(optimizer)])
        return held

    def _norms(self, optimizer: Any, grads: list) -> torch.Tensor:
        """Each gradient's L2 norm (float32, on the device): from the kernel call of Megatron's
        clipping norm where the seams can make it for Megatron (read once for both,
        :mod:`megatron_patches.seams.megatron_norm`), a fused pass of our own for the rest.
        Usually Megatron's list is the check's, tensor for tensor: its vector is the answer."""
        known = self.seams.megatron_norms(optimizer)
        if not known:
            return torch.stack(torch._foreach_norm(grads)).float()
        if len(known) == 1 and len(known[0][0]) == len(grads) and all(a is b for a, b in zip(known[0][0], grads)):
            norms = known[0][1]
            return norms if norms.dtype == torch.float32 else norms.float()
        return placed_norms(known, grads)


class _Held:
    """One check's buffers: ``buffer`` = the vector to all-reduce (``vec``, its first ``vec_size``
    floats) then the detectors' tails (this rank's values, not reduced: ``tails`` by detector name,
    ``tail_spans`` their places), ``views`` (the head's scalar slots, then each detector's piece);
    per set of the detectors' plans (:meth:`planned`) the vector's start and the squares' index."""

    def __init__(self, stage: "CheckStage", device: torch.device, count: int, num_slots: int):
        self.device, self.count, self.num_slots = device, count, num_slots
        self.vec_size = _HEAD + num_slots + stage._detector_width
        widths = [d.tail_width(count) for d in stage.detectors]
        self.buffer = torch.zeros(self.vec_size + sum(widths), dtype=torch.float32, device=device)
        self.vec = self.buffer[:self.vec_size]
        self.views, offset = [self.vec[i] for i in range(_HEAD)], _HEAD + num_slots
        for detector in stage.detectors:
            self.views.append(self.vec[offset:offset + detector.width()])
            offset += detector.width()
        self.tails, self.tail_spans, start = {}, {}, self.vec_size
        for detector, width in zip(stage.detectors, widths):
            if width:
                self.tails[detector.name] = self.buffer[start:start + width]
                self.tail_spans[detector.name] = (start, start + width)
                start += width
        self._planned: dict = {}

    def planned(self, stage: "CheckStage", slots: list, plans: list) -> tuple:
        """``(template, index)`` for the detectors' ``plans`` (made once per set of plan objects):
        the vector's start (zeros, the count of tensors checked, the planned constants) and, per
        tensor, the slots its weighted squared norm is added to (its layer's sum, then each planned
        detector's; one row each)."""
        key = tuple((id(p[0]), id(p[1])) if p else None for p in plans)
        made = self._planned.get(key)
        if made is None:
            template = torch.zeros(self.vec_size, dtype=torch.float32, device=self.device)
            if stage.config.detectors.nonfinite.enabled:
                template[_NONFINITE] = float(self.count)
            offset, rows = _HEAD + self.num_slots, [slots]
            for detector, plan in zip(stage.detectors, plans):
                width = detector.width()
                if plan is not None and plan[0] is not None:
                    template[offset:offset + width] = plan[0].to(self.device)
                if plan is not None and plan[1] is not None:
                    rows.append([offset + int(i) for i in plan[1].tolist()])
                offset += width
            index = torch.tensor(rows if self.count else [[]], dtype=torch.long, device=self.device)
            made = self._planned[key] = (template, index, plans)  # the plans kept: their ids stay theirs
        return made[0], made[1]


def placed_norms(known: list, grads: list) -> torch.Tensor:
    """``grads``' norms from the kernel's vectors ``known`` (``[(gradients, norms)]``), matched by
    object, else by the memory they view; a fused pass of our own for those not in them. Where
    Megatron's lists are not the check's (tensor-parallel duplicates left out of its norm, a chain of
    optimizers): a few calls, plus one key per tensor matched by memory."""
    where = {id(g): i for i, g in enumerate(grads)}
    source: list = [None] * len(grads)  # index into the concatenated vectors
    offset, others = 0, []
    for listed, _ in known:
        for j, g in enumerate(listed):
            i = where.get(id(g))
            if i is not None:
                source[i] = offset + j
            else:
                others.append((g, offset + j))
        offset += len(listed)
    missing = [i for i, n in enumerate(source) if n is None]
    if missing and others:
        by_key = {_memory(g): n for g, n in others}
        for i in missing:
            source[i] = by_key.get(_memory(grads[i]))
        missing = [i for i, n in enumerate(source) if n is None]
    vectors = [norms for _, norms in known]
    if missing:
        vectors.append(torch.stack(torch._foreach_norm([grads[i] for i in missing])))
        for k, i in enumerate(missing):
            source[i] = offset + k
    flat = torch.cat(vectors) if len(vectors) > 1 else vectors[0]
    return flat[torch.tensor(source, dtype=torch.long, device=flat.device)].float()


def _memory(tensor: torch.Tensor) -> tuple:
    """Which memory a gradient is (two view objects of the same bytes share it)."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype


def resolve_overflow_mode(mode: str) -> str:
    """'auto' -> what the device does: saturation on Ascend parts that saturate, else ieee.

    torch_npu's ``is_support_inf_nan()`` initialises the current device, so this is asked lazily
    (:attr:`GradMonitor.overflow_mode`, at the first check, after Megatron's set_device), and only
    when torch_npu is already imported (MindSpeed imports it; without it the answer is ieee)."""
    if mode != "auto":
        return mode
    torch_npu = sys.modules.get("torch_npu")
    try:
        supports = getattr(getattr(getattr(torch_npu, "npu", None), "utils", None), "is_support_inf_nan", None)
        if supports is not None and not supports():
            return "saturation"
    except Exception as exc:
        log.warning("overflow_mode auto: torch_npu's is_support_inf_nan failed (%s); checking as ieee, "
                    "set overflow_mode explicitly", exc)
    return "ieee"
