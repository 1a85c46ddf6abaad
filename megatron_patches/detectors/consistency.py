"""Cross-replica consistency: data-parallel replicas that should agree bit for bit, don't.

After the data-parallel reduction every replica holds the same gradients (without the
distributed optimizer), and after the parameter all-gather every replica holds the same
parameters (with or without it). A card that silently corrupts a value breaks that. Each
rank takes a fingerprint of what it holds, on the device:

- the sum of squared per-tensor L2 norms (fp32; the distance used to break a 1:1 tie): its
  32 bits,
- an exact 48-bit checksum of the raw bits: each tensor's bits summed as 32-bit integers
  (modulo 2**32), weighted by an odd number per tensor, summed: 48 bits. Integer addition is
  order-independent, so the checksum is the same on every replica whatever the reduction order
  or the hardware, and any single flipped bit changes it (an odd weight is invertible modulo
  2**32).

The 80 bits travel as twenty 4-bit pieces in the monitor's one SUM all-reduce, with no
collective of their own: in a data-parallel group of ``n`` ranks the lowest adds ``n - 1`` times
its pieces and each other rank subtracts its own, times a sign drawn from the group and the
check (so mirrored differences in two groups cannot cancel check after check). A group's sums
are 0 when its replicas agree; every float is an exact integer (the sum of sizes stays below
``2**24`` up to half a million ranks), so the twenty are all 0 exactly when every group agrees.

Only when one is not 0, on the slow path (``suspects``), the world exchanges
fingerprints, every rank finds the ranks that differ from their group's majority; with two
replicas (no majority) the replica whose squared norm is farther from the group's last
accepted value is suspected, and the record says so (``decided_by``). The ranks of each group
then exchange per-tensor fingerprints to name the parameters that differ, and the world
exchanges host names.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import Counter
from typing import Any, Callable, Optional

import torch

from .. import collectives, naming
from .base import CheckContext, Detector, Rotation
from .fingerprint import _MASK24, _PIECES, _pieces, _tensor_sums

log = logging.getLogger("megatron_patches")

class ConsistencyDetector(Detector):
    """Data-parallel replicas compared bit-exactly each checked step (kind ``rank_mismatch``)."""

    name = "consistency"

    def __init__(self, cfg: Any, parallel_state: Callable[[], Any]):
        """``parallel_state``: megatron-core's, where the data-parallel group is read (``Seams.parallel_state``)."""
        self.cfg = cfg
        self.parallel_state = parallel_state
        self._rotation = Rotation(cfg.interval, cfg.sample_fraction)
        self._checks = 0
        self._active = False
        self._group: Optional[tuple] = None  # (key, ranks, process group)
        self._chunks: list = []
        self._listed: Optional[tuple] = None  # (ids of the chunks, their compared parameters)
        self._mode = "grads"
        self._weights: dict = {}
        self._fp: Optional[torch.Tensor] = None  # this check's [sum of squares, checksum low, high]
        self._square = self._total = None  # its parts (Optional[torch.Tensor]), made each check
        self._count = 0  # tensors fingerprinted (before sampling)
        # Sum of squares at the last accepted check, per share of the tensors it covered (with
        # params sampled, checks of different shares are not comparable): kept on the device.
        self._last_good: dict[int, torch.Tensor] = {}
        self._found: Optional[dict] = None
        self._to_exchange = False  # a group disagreed this check: suspects() exchanges fingerprints
        self._mine: dict[int, list[str]] = {}
        self._who: dict[int, dict] = {}
        self._warned = False
        self._sharded: Optional[bool] = None  # fully sharded data parallel (FSDP): decided at the first check

    # --- layout ----------------------------------------------------------------------

    def width(self) -> int:
        return _PIECES  # each group's zero-sum terms, summed over the job: the same at any world size

    def _dp_group(self) -> tuple:
        if self._group is None:
            ps = self.parallel_state()
            group = ps.get_data_parallel_group(with_context_parallel=True) if ps is not None else None
            ranks = (torch.distributed.get_process_group_ranks(group) if group is not None
                     else list(range(collectives.world_size())))
            self._group = (min(ranks), sorted(ranks), group)
        return self._group

    def before_reduction(self, model_chunks: list, step: int) -> None:
        self._chunks = [weakref.ref(c) for c in model_chunks]

    # --- fast path -------------------------------------------------------------------

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        self._checks += 1
        self._active = self._rotation.due(self._checks) and collectives.world_size() > 1
        self._found, self._mine, self._fp, self._square, self._total = None, {}, None, None, None
        self._to_exchange = False
        if not self._active:
            return
        key, ranks, _ = self._dp_group()
        if len(ranks) < 2 or self._fully_sharded(ctx):
            self._active = False
            return
        tensors, norms = self._fingerprinted(ctx)
        sample = self._sample(len(tensors)) if tensors else None
        if sample is not None:
            tensors = [tensors[i] for i in sample]
            if self._mode == "params":  # the norms were not read: take them over the share only
                norms = torch.stack(torch._foreach_norm([t.detach() for t in tensors]))
        square = (norms if norms.dtype == torch.float32 else norms.float()).square().sum() if tensors \
            else torch.zeros((), device=ctx.device)
        # One bit pattern for NaN: a group's pieces then sum to 0 exactly when the fingerprints
        # compare equal (_comparable), so the verdict can rest on the reduced vector alone.
        square = torch.where(square.isnan(), math.nan, square)
        total = ((_tensor_sums(tensors) * self._odd_weights(self._count, sample, ctx.device)).sum() if tensors  # int64
                 else torch.zeros((), dtype=torch.int64, device=ctx.device))
        bits = square.view(torch.int32).to(torch.int64)
        self._square, self._total = square, total
        torch.mul(_pieces(bits, total), self._weight(key, ranks), out=out)

    def fingerprint(self) -> torch.Tensor:
        """[sum of squares, checksum's low 24 bits, high 24] on the device, made when first read (slow path)."""
        if self._fp is None and self._square is not None:
            self._fp = torch.stack([self._square, *((self._total >> s) & _MASK24 for s in (0, 24))]).float()
        return self._fp

    def _weight(self, key: int, ranks: list) -> float:
        """This rank's factor in its group's zero-sum: ``n - 1`` for the lowest rank, -1 for the
        others, times the group's sign for this check."""
        sign = -1.0 if ((key * 2654435761 + self._checks * 40503) >> 7) & 1 else 1.0
        return sign * (len(ranks) - 1 if collectives.rank() == key else -1)

    def _fully_sharded(self, ctx: CheckContext) -> bool:
        """Torch FSDP2 and Megatron-FSDP (DTensor parameters): each data-parallel rank holds its own
        shard of the parameters and of the gradients, no replicas to compare. Read off the model
        (every rank of the job answers alike, also one whose shards hold no gradient this step),
        else off the checked entries; decided once, logged once."""
        if self._sharded is None:
            tensors = [p for chunk in self._live_chunks() for p in chunk.parameters()] or [e.model for e in ctx.entries]
            if not tensors:
                return False
            self._sharded = collectives.fully_sharded(tensors)
            if self._sharded:
                log.info("consistency check off: fully sharded data parallel keeps no replicas to compare")
        return self._sharded

    def _fingerprinted(self, ctx: CheckContext) -> tuple[list, Optional[torch.Tensor]]:
        """What the replicas must agree on: dense gradients with their norms (already read by the
        guard), or parameters (distributed optimizer) with None: their norms are taken over the
        share that :meth:`local` samples."""
        self._mode = self._target(ctx)
        if self._mode == "grads":
            if ctx.norms is None:
                return [], None
            keep = [i for i, e in enumerate(ctx.entries) if getattr(e.model, "allreduce", True)]
            self._count = len(keep)
            if len(keep) == len(ctx.entries):
                return list(ctx.grads), ctx.norms
            return [ctx.grads[i] for i in keep], ctx.norms[torch.tensor(keep, device=ctx.norms.device)]
        params = self._params()
        if not params and not self._chunks and not self._warned:
            log.warning("consistency check (params) idle: no model seen before the gradient reduction "
                        "(finalize_model_grads is not patched or not called)")
            self._warned = True
        self._count = len(params)
        if not params:
            return [], None
        if self._sample(len(params)) is None:
            return params, torch.stack(torch._foreach_norm([p.detach() for p in params]))
        return params, None

    def _target(self, ctx: CheckContext) -> str:
        if self.cfg.target != "auto":
            return self.cfg.target
        sharded = any(e.shard for e in ctx.entries) or any(
            getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False) for c in self._live_chunks())
        return "params" if sharded else "grads"

    def _live_chunks(self) -> list:
        return [c for c in (ref() for ref in self._chunks) if c is not None]

    def _params(self) -> list:  # the dense parameters compared, listed once per set of chunks
        chunks = self._live_chunks()
        if self._listed is None or self._listed[0] != [id(c) for c in chunks]:
            self._listed = ([id(c) for c in chunks], [p for c in chunks for p in c.parameters()
                            if p.requires_grad and getattr(p, "allreduce", True) and p.numel() > 0])
        return self._listed[1]

    def _share(self) -> int:
        """Which rotating share of the tensors this check's sum of squares covers (0: all of
        them, or with grads, whose norms always cover all)."""
        if self._rotation.period == 1 or self._mode == "grads":
            return 0
        return self._rotation.turn(self._checks)

    def _sample(self, size: int) -> Optional[list[int]]:
        """Tensors whose bits are checksummed this time: all (None), or a rotating 1/m of them."""
        if self._rotation.period == 1:
            return None
        return [i for i in range(size) if self._rotation.covers(i, self._checks)] or [0]

    def _odd_weights(self, size: int, sample: Optional[list], device: torch.device) -> torch.Tensor:
        """The odd weight of each tensor checksummed (of ``sample``, else all ``size``), made once per share."""
        key = (size, tuple(sample) if sample is not None else None, device)
        if key not in self._weights:
            rows = torch.tensor(sample if sample is not None else range(size), dtype=torch.int64, device=device)
            self._weights[key] = rows * 2 + 1
        return self._weights[key]

    # --- host ------------------------------------------------------------------------

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        """A group disagrees somewhere: a summed piece is not 0 (identical on every rank).
        Which ranks and tensors differ is found in :meth:`suspects`."""
        self._to_exchange = self._active and any(value != 0 for value in reduced)
        return ["rank_mismatch"] if self._to_exchange else []

    def _exchange(self, ctx: CheckContext) -> None:
        """Slow path, on every rank: every rank learns every rank's fingerprint, then each
        disagreeing group's suspects and the tensors that differ."""
        self._to_exchange = False
        key, _, _ = self._dp_group()
        mine = {"rank": collectives.rank(), "key": key, "fp": tuple(self.fingerprint().tolist()),
                "last_good": _finite_or_none(self._last_good.get(self._share()))}
        world = [None] * collectives.world_size()
        torch.distributed.all_gather_object(world, mine)
        groups: dict[int, dict[int, tuple]] = {}
        refs: dict[int, Optional[float]] = {}
        for part in world:
            groups.setdefault(part["key"], {})[part["rank"]] = part["fp"]
            if part["rank"] == part["key"]:  # the group's lowest rank keeps its reference
                refs[part["key"]] = part["last_good"]
        found = {}
        for group_key, members in groups.items():
            if len(set(map(_comparable, members.values()))) > 1:
                found[group_key] = self._deviants(members, refs.get(group_key))
        if found:
            self._found = found
            self._localize(ctx, found)

    def _deviants(self, members: dict, ref: Optional[float]) -> dict:
        """Which ranks of one group differ, and how that was decided."""
        clusters: dict[tuple, list[int]] = {}
        for rank, fp in sorted(members.items()):
            clusters.setdefault(_comparable(fp), []).append(rank)
        ordered = sorted(clusters.values(), key=len, reverse=True)
        if len(ordered[0]) * 2 > len(members):
            good, how = ordered[0], "majority"
        else:
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
        key, ranks, group = self._dp_group()
        names, tensors = self._named_tensors(ctx)
        sums = _tensor_sums(tensors).tolist() if tensors else []
        norms = [float(n) for n in torch.stack(torch._foreach_norm(tensors)).tolist()] if tensors else []
        mine = {n: (s, _comparable((q,))) for n, s, q in zip(names, sums, norms)}
        everyone = [None] * len(ranks)
        torch.distributed.all_gather_object(everyone, mine, group=group)
        me = collectives.rank()
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
        who = {"rank": me, **{k: v for k, v in naming.rank_info(self.parallel_state()).items() if k != "global"},
               "host": naming.host(), "device": naming.device_name(), "params": differing}
        world = [None] * collectives.world_size()
        torch.distributed.all_gather_object(world, who)
        self._who = {w["rank"]: w for w in world}

    def _named_tensors(self, ctx: CheckContext) -> tuple[list[str], list]:
        if self._mode == "grads":
            pairs = [(e.info.name, g) for e, g in zip(ctx.entries, ctx.grads) if getattr(e.model, "allreduce", True)]
        else:
            infos = naming.name_parameters(self._live_chunks(), self.parallel_state())
            pairs = [(infos[id(p)].name if id(p) in infos else f"param[{i}]", p.detach())
                     for i, p in enumerate(p for c in self._live_chunks() for p in c.parameters())
                     if p.requires_grad and getattr(p, "allreduce", True) and p.numel() > 0]
        return [n for n, _ in pairs], [t for _, t in pairs]

    def suspects(self, ctx: CheckContext, norm_list: list) -> dict:
        if self._to_exchange:
            self._exchange(ctx)
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
        """An accepted check's sum of squares becomes the group's reference (kept on the device:
        a quiet check reads nothing)."""
        if not (self._active and accepted and self._square is not None):
            return
        current = self._square
        if self._found is not None:  # slow path: a suspected replica keeps the old reference
            if collectives.rank() in {r for g in self._found.values() for r in g["suspected"]}:
                return
        share = self._share()
        previous = self._last_good.get(share, current)  # on the device the check ran on
        self._last_good[share] = torch.where(torch.isfinite(current), current, previous)

    # --- state -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Read at checkpoint time only (one host read then)."""
        return {"version": 2, "checks": self._checks,
                "last_good": {str(k): _finite_or_none(v) for k, v in self._last_good.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self._checks = int(state.get("checks", 0))
        values = state.get("last_good") or {}
        if state.get("version", 1) == 1:  # keyed by data-parallel group then, every tensor covered
            key = self._dp_group()[0] if torch.distributed.is_initialized() else 0
            values = {"0": values.get(str(key))}
        self._last_good = {int(k): torch.tensor(float(v)) for k, v in values.items() if isinstance(v, (int, float))}


def _finite_or_none(value: Optional[torch.Tensor]) -> Optional[float]:
    number = float(value) if value is not None else None
    return number if number is not None and math.isfinite(number) else None


def _comparable(fp: tuple) -> tuple:
    """Exact comparison key: NaN equals NaN (a NaN spread to every replica is still agreement)."""
    return tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in fp)


def _distance(value: float, ref: Optional[float]) -> float:
    if ref is None or not math.isfinite(value):
        return math.inf
    return abs(value - ref)


def _plain(fp: tuple) -> list:
    return [v if math.isfinite(v) else str(v) for v in fp]
