"""Cross-replica consistency: data-parallel replicas that should agree bit for bit, don't.

After the data-parallel reduction every replica holds the same gradients (without the
distributed optimizer), and after the parameter all-gather every replica holds the same
parameters (with or without it). A card that silently corrupts a value breaks that. Each
rank writes a fingerprint of what it holds into its own ``k`` floats of the monitor's
all-reduced vector (zeros elsewhere), so the SUM all-reduce acts as an all-gather:

- the key of its data-parallel group (lowest global rank in it, plus one: 0 means absent),
- the sum of squared per-tensor L2 norms (fp32; the distance used to break a 1:1 tie),
- an exact 48-bit checksum of the raw bits: each tensor's bits summed as 32-bit integers
  (modulo 2**32), weighted by an odd number per tensor, summed and folded into two 24-bit
  halves (each exact in fp32). Integer addition is order-independent, so the checksum is the
  same on every replica whatever the reduction order or the hardware, and any single flipped
  bit changes it (an odd weight is invertible modulo 2**32).

On the host every rank splits the reduced vector by group and finds the ranks that differ
from the majority. With two replicas (no majority) the replica whose squared norm is farther
from the group's last accepted value is suspected, and the record says so
(``decided_by``). Only then, on the slow path, the ranks of each group exchange per-tensor
fingerprints to name the parameters that differ, and the world exchanges host names.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections import Counter
from typing import Any, Optional

import torch

from . import CheckContext, Detector

log = logging.getLogger("megatron_patches")

_K = 4  # floats per rank: group key + 1, sum of squared norms, checksum low 24 bits, high 24 bits
_MASK24 = (1 << 24) - 1


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` read as 32-bit integers and summed modulo 2**32 (0-d int32).

    The result is the exact sum modulo 2**32 whatever the kernel accumulates in, so it does not
    depend on the order of addition, and it runs at the speed of a norm (an int64 sum of the
    same words is several times slower on CPUs). Two-byte tensors are read
    in pairs of elements where aligned (the odd last one alone), eight-byte ones as two halves.
    """
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    if size in (4, 8):  # eight-byte elements: both 32-bit halves
        return flat.view(torch.int32).sum(dtype=torch.int32)
    if size == 2 and flat.storage_offset() % 2 == 0:  # pairs of elements as 32-bit words
        even = flat.numel() - flat.numel() % 2
        total = flat[:even].view(torch.int32).sum(dtype=torch.int32)
        return total + flat[even:].view(torch.int16).sum(dtype=torch.int32) if even < flat.numel() else total
    if size == 2:  # at an odd offset in a shared buffer: element by element (slower)
        return flat.view(torch.int16).sum(dtype=torch.int32)
    return flat.view(torch.uint8).sum(dtype=torch.int32)


def _tensor_sums(tensors: list) -> torch.Tensor:
    """Per tensor: :func:`_bits_sum`, as int64 (for the weighted sum that follows)."""
    return torch.stack([_bits_sum(t) for t in tensors]).to(torch.int64)


def _parallel_state():
    from .. import locate

    return locate._parallel_state()


class ConsistencyDetector(Detector):
    """Data-parallel replicas compared bit-exactly each checked step (kind ``rank_mismatch``)."""

    name = "consistency"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._width: Optional[int] = None
        self._checks = 0
        self._active = False
        self._group: Optional[tuple] = None  # (key, ranks, process group)
        self._chunks: list = []
        self._mode = "grads"
        self._weights: dict = {}
        self._last_good: dict[int, float] = {}
        self._groups: dict[int, dict[int, tuple]] = {}
        self._found: Optional[dict] = None
        self._mine: dict[int, list[str]] = {}
        self._who: dict[int, dict] = {}
        self._warned = False

    # --- layout ----------------------------------------------------------------------

    def width(self) -> int:
        # Fixed on first use. The monitor may be built before torch.distributed starts (at the
        # top of pretrain_gpt.py); then the launcher's WORLD_SIZE says how many ranks will join.
        if self._width is None:
            world = (torch.distributed.get_world_size() if torch.distributed.is_initialized()
                     else int(os.environ.get("WORLD_SIZE", "1")))
            self._width = _K * world if world > 1 else 0
        return self._width

    def _world_ok(self) -> bool:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if self.width() == _K * world and world > 1:
            return True
        if not self._warned and world > 1:
            log.warning("consistency check off: the monitor was built for %d rank(s) but the job has %d; "
                        "set WORLD_SIZE before importing megatron_patches.apply", self.width() // _K, world)
            self._warned = True
        return False

    def _dp_group(self) -> tuple:
        if self._group is None:
            ps = _parallel_state()
            group = ps.get_data_parallel_group(with_context_parallel=True) if ps is not None else None
            ranks = (torch.distributed.get_process_group_ranks(group) if group is not None
                     else list(range(torch.distributed.get_world_size())))
            self._group = (min(ranks), sorted(ranks), group)
        return self._group

    def before_reduction(self, model_chunks: list, step: int) -> None:
        self._chunks = [weakref.ref(c) for c in model_chunks]

    # --- fast path -------------------------------------------------------------------

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        self._checks += 1
        self._active = (self._checks - 1) % self.cfg.interval == 0 and self._world_ok()
        self._found, self._mine, self._groups = None, {}, {}
        if not self._active:
            return
        key, ranks, _ = self._dp_group()
        if len(ranks) < 2:
            self._active = False
            return
        base = torch.distributed.get_rank() * _K
        out[base] = key + 1
        tensors, norms = self._fingerprinted(ctx)
        if not tensors:
            return
        out[base + 1] = norms.float().square().sum()
        sample = self._sample(len(tensors))
        if sample is None:
            sums, weights = _tensor_sums(tensors), self._odd_weights(len(tensors), ctx.device)
        else:
            sums = _tensor_sums([tensors[i] for i in sample])
            weights = self._odd_weights(len(tensors), ctx.device)[torch.tensor(sample, device=ctx.device)]
        total = (sums * weights.to(sums.device)).sum()  # exact in int64
        out[base + 2] = (total & _MASK24).float()
        out[base + 3] = ((total >> 24) & _MASK24).float()

    def _fingerprinted(self, ctx: CheckContext) -> tuple[list, Optional[torch.Tensor]]:
        """What the replicas must agree on: dense gradients, or parameters (distributed optimizer)."""
        self._mode = self._target(ctx)
        if self._mode == "grads":
            if ctx.norms is None:
                return [], None
            keep = [i for i, e in enumerate(ctx.entries) if getattr(e.model, "allreduce", True)]
            if len(keep) == len(ctx.entries):
                return list(ctx.grads), ctx.norms
            return [ctx.grads[i] for i in keep], ctx.norms[torch.tensor(keep, device=ctx.norms.device)]
        params = self._params()
        if not params and not self._chunks and not self._warned:
            log.warning("consistency check (params) idle: no model seen before the gradient reduction "
                        "(finalize_model_grads is not patched or not called)")
            self._warned = True
        if not params:
            return [], None
        return params, torch.stack(torch._foreach_norm(params))

    def _target(self, ctx: CheckContext) -> str:
        if self.cfg.target != "auto":
            return self.cfg.target
        sharded = any(e.shard for e in ctx.entries) or any(
            getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in self._live_chunks())
        return "params" if sharded else "grads"

    def _live_chunks(self) -> list:
        return [c for c in (ref() for ref in self._chunks) if c is not None]

    def _params(self) -> list:
        return [p.detach() for c in self._live_chunks() for p in c.parameters()
                if p.requires_grad and getattr(p, "allreduce", True) and p.numel() > 0]

    def _sample(self, size: int) -> Optional[list[int]]:
        """Tensors whose bits are checksummed this time: all (None), or a rotating 1/m of them."""
        period = max(1, round(1.0 / self.cfg.sample_fraction))
        if period == 1:
            return None
        turn = ((self._checks - 1) // self.cfg.interval) % period
        return [i for i in range(size) if i % period == turn] or [0]

    def _odd_weights(self, size: int, device: torch.device) -> torch.Tensor:
        if (size, device) not in self._weights:
            self._weights[(size, device)] = torch.arange(size, dtype=torch.int64, device=device) * 2 + 1
        return self._weights[(size, device)]

    # --- host ------------------------------------------------------------------------

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        if not self._active:
            return []
        groups: dict[int, dict[int, tuple]] = {}
        for rank in range(len(reduced) // _K):
            key = reduced[rank * _K]
            if key > 0:
                groups.setdefault(int(key) - 1, {})[rank] = tuple(reduced[rank * _K + 1:rank * _K + _K])
        found = {}
        for key, members in groups.items():
            if len(set(map(_comparable, members.values()))) > 1:
                found[key] = self._deviants(key, members)
        self._groups = groups
        if not found:
            return []
        self._found = found
        self._localize(ctx, found)
        return ["rank_mismatch"]

    def _deviants(self, key: int, members: dict) -> dict:
        """Which ranks of one group differ, and how that was decided."""
        clusters: dict[tuple, list[int]] = {}
        for rank, fp in sorted(members.items()):
            clusters.setdefault(_comparable(fp), []).append(rank)
        ordered = sorted(clusters.values(), key=len, reverse=True)
        if len(ordered[0]) * 2 > len(members):
            good, how = ordered[0], "majority"
        else:
            ref = self._last_good.get(key)
            distance = {tuple(c): _distance(members[c[0]][0], ref) for c in ordered}
            ranked = sorted(ordered, key=lambda c: distance[tuple(c)])
            if ref is None or distance[tuple(ranked[0])] == distance[tuple(ranked[1])]:
                good, how = [], "undecided"
            else:
                good, how = ranked[0], "distance_to_last_accepted"
        return {"ranks": sorted(members), "suspected": sorted(r for r in members if r not in good),
                "decided_by": how, "fingerprints": {str(r): _plain(fp) for r, fp in sorted(members.items())}}

    def _localize(self, ctx: CheckContext, found: dict) -> None:
        """Slow path, on every rank: name the tensors that differ, and where the suspects run."""
        from .. import locate

        key, ranks, group = self._dp_group()
        names, tensors = self._named_tensors(ctx)
        sums = _tensor_sums(tensors).tolist() if tensors else []
        norms = [float(n) for n in torch.stack(torch._foreach_norm(tensors)).tolist()] if tensors else []
        mine = {n: (s, _comparable((q,))) for n, s, q in zip(names, sums, norms)}
        everyone = [None] * len(ranks)
        torch.distributed.all_gather_object(everyone, mine, group=group)
        me = torch.distributed.get_rank()
        differing: list[str] = []
        suspected = found.get(key, {}).get("suspected", [])
        if me in suspected:
            for name, value in mine.items():
                values = Counter(part.get(name) for part in everyone)
                if len(values) > 1 and (values[value] * 2 <= len(ranks)):
                    differing.append(name)
        # Name them where this rank's optimizer holds them (with the distributed optimizer only
        # the shards it owns); the record lists every differing name under suspected_hardware.
        by_name = {e.info.name: i for i, e in enumerate(ctx.entries)}
        self._mine = {by_name[n]: ["rank_mismatch"] for n in differing if n in by_name}
        who = {"rank": me, **{k: v for k, v in locate.rank_info().items() if k != "global"},
               "host": locate.host(), "device": locate.device_name(), "params": differing}
        world = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(world, who)
        self._who = {w["rank"]: w for w in world}

    def _named_tensors(self, ctx: CheckContext) -> tuple[list[str], list]:
        if self._mode == "grads":
            pairs = [(e.info.name, g) for e, g in zip(ctx.entries, ctx.grads) if getattr(e.model, "allreduce", True)]
        else:
            from .. import locate

            infos = locate.name_parameters(self._live_chunks())
            pairs = [(infos[id(p)].name if id(p) in infos else f"param[{i}]", p.detach())
                     for i, p in enumerate(p for c in self._live_chunks() for p in c.parameters())
                     if p.requires_grad and getattr(p, "allreduce", True) and p.numel() > 0]
        return [n for n, _ in pairs], [t for _, t in pairs]

    def suspects(self, ctx: CheckContext, norm_list: list) -> dict:
        return dict(self._mine)

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        if not self._found:
            return {}
        suspected = sorted({r for g in self._found.values() for r in g["suspected"]})
        who = self._who
        return {
            "suspected_ranks": suspected,
            "rank_mismatch": {
                "compared": self._mode,
                "groups": list(self._found.values()),
                "suspected_hardware": [who[r] for r in suspected if r in who],
            },
        }

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        if self._active and accepted:
            for key, members in self._groups.items():
                found = (self._found or {}).get(key)
                good = [r for r in members if found is None or r not in found["suspected"]]
                if good and math.isfinite(members[good[0]][0]):
                    self._last_good[key] = members[good[0]][0]

    # --- state -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"version": 1, "checks": self._checks, "last_good": {str(k): v for k, v in self._last_good.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self._checks = int(state.get("checks", 0))
        self._last_good = {int(k): float(v) for k, v in state.get("last_good", {}).items()}


def _comparable(fp: tuple) -> tuple:
    """Exact comparison key: NaN equals NaN (a NaN spread to every replica is still agreement)."""
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in fp)


def _distance(value: float, ref: Optional[float]) -> float:
    if ref is None or not math.isfinite(value):
        return math.inf
    return abs(value - ref)


def _plain(fp: tuple) -> list:
    return [v if math.isfinite(v) else str(v) for v in fp]
