"""The held-state check: each rank's stepped weights and Adam moments, a rotating slice per check,
judged for what a lasting fault leaves in them (on by default).

A value that goes non-finite or far off in what a rank holds (an Adam first moment x1000, a second
moment set to Inf, which freezes its weight for good, a weight element x1000 or NaN, a flipped
exponent bit) stays there: unlike a gradient it is not made afresh each step, and a finite one never
shows in the gradients the guard checks. So each tensor the rank's optimizer steps on (the weight,
its fp32 main copy under mixed precision or its shard under the distributed optimizer, and each
floating state tensor: ``exp_avg``, ``exp_avg_sq``) is cut into ``period`` equal slices, and each
check reads one slice of every tensor (the same slice index throughout): its largest magnitude,
one ``_foreach_norm`` over the slices (one fused read of 1/period of the held state; NaN and Inf
propagate into it). A slice is flagged when that is non-finite, or when it stands more than
``ratio`` times above the same slice's at the check a period ago (``ratio`` squared for
``exp_avg_sq``, which holds squares; ``weight_ratio`` for a weight, which moves far less). One
float joins the guard's one all-reduce (slices flagged, summed over the job); the flagged
tensors are named on the slow path by the rank holding them, with reasons ``held:<what>``
(non-finite) or ``off:<what>`` (far above). So every held element is read once in ``period``
checks, and a lasting fault is found within ``period`` checked steps.
A whole read (below) is every turn's baseline. The checks counted and the baselines travel in the
guard's checkpoint state, so a resumed job or a branch from a checkpoint judges ratios from its
first check instead of warming up again (and taking its first baselines from a state that may
already be corrupted).

Certification follows: when the loop takes a rollback target (an in-memory snapshot, a
checkpoint: :meth:`HeldStateCheck.target_taken`), the next check reads every slice at once, and a
target is certified only by clean checks after it (``recovery.certify_steps``, the first of them
that one), so what it holds has been read in full before anything rolls back to it. That whole read
costs one pass over the held state per target taken (per checkpoint, or per in-memory snapshot:
with Megatron-LM's in-process recovery every ``recovery.snapshot_interval`` steps).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from .. import collectives, naming
from ..collectives import local_shard
from ..faults import held_tensors, optimizer_states
from ..incidents import ParamFinding
from .base import CheckContext, Detector

OFF = "state_off"
"""The kind flagged when a held slice is non-finite or far above its previous check."""


_FLT_MAX = torch.finfo(torch.float32).max


def bound_of(previous: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """Each slice's bound from its accepted ``previous`` largest magnitude: ``previous * limits``
    (float32), or the largest finite float where ``previous`` is 0 (a non-finite value only is
    flagged after a zero) or the product overflows (nothing finite is above an infinite bound)."""
    return torch.where(previous > 0, (previous * limits).clamp_(max=_FLT_MAX), _FLT_MAX)


def period_of(cfg: Any) -> int:
    """Checks that cover every held element once: 1 / ``fraction``, rounded."""
    return max(1, round(1.0 / cfg.fraction))


class _Slices:
    """The held tensors of one optimizer, each cut into ``period`` slices, kept between checks
    (built with per-tensor calls once, not per check) with the identities they were cut from."""

    def __init__(self, optimizer: Any, entries: list, period: int, key: tuple, cfg: Any):
        self.key = key
        self.owners: list = []  # (entry index, what) per held tensor
        ratios: list = []  # the ratio limit per held tensor
        limit = {"weight": cfg.weight_ratio, "exp_avg_sq": cfg.ratio ** 2}
        self.turns: list = [[] for _ in range(period)]
        self.used: list = [[] for _ in range(period)]  # indices into owners of each turn's slices
        states = optimizer_states(optimizer)
        for i, entry in enumerate(entries):
            if entry.main is None:
                continue
            for what, tensor in held_tensors(entry.main, states).items():
                flat = local_shard(tensor).detach().reshape(-1)
                if not flat.numel():
                    continue
                index = len(self.owners)
                self.owners.append((i, what))
                ratios.append(limit.get(what, cfg.ratio))
                n = flat.numel()
                for turn in range(period):
                    piece = flat[turn * n // period:(turn + 1) * n // period]
                    if piece.numel():
                        self.turns[turn].append(piece)
                        self.used[turn].append(index)
        self.every = [piece for turn in self.turns for piece in turn]
        self.every_used = [index for used in self.used for index in used]
        self.limits = [torch.tensor([ratios[i] for i in used], device=turn[0].device) if turn else None
                       for turn, used in zip(self.turns, self.used)]
        """Per turn, each slice's ratio limit; beside it the baselines start at +Inf (nothing is far
        above them: until the warm-up is over, only a non-finite value is flagged)."""
        self.counts = [torch.tensor([float(len(turn)), 0.0]) for turn in self.turns] + [
            torch.tensor([float(len(self.every)), 0.0])]
        """Per turn, then for a whole read: the start of the check's two floats (slices read, and 0 where
        the slices at or under their bound are counted), the same objects each time (:meth:`HeldStateCheck.plan`)."""
        self.bounds = [torch.full_like(limits, _FLT_MAX) if limits is not None else None for limits in self.limits]
        """Per turn, the largest magnitude each slice may hold and pass: its magnitude at the turn's
        last accepted check times its limit, or the largest finite float (a non-finite value only
        is flagged) before the warm-up is over, after a zero, or where the product overflows."""
        self.previous: list = [None] * period
        """Per turn, each slice's largest magnitude at the turn's last accepted check (None before
        one): what a checkpoint carries, the bounds being made from it."""

    def accept(self, turn: int, largest: torch.Tensor) -> None:
        """``largest`` (the turn's slices, accepted) becomes the turn's baseline and bounds."""
        self.previous[turn] = largest
        self.bounds[turn] = bound_of(largest, self.limits[turn])


def _identity(optimizer: Any, entries: list) -> tuple:
    """What the slices were cut from, in plain Python (no torch call): the optimizer, each stepped
    weight and the objects of its state. A load that replaced any of them makes new slices."""
    states = optimizer_states(optimizer)
    return (id(optimizer),) + tuple((id(e.main), tuple(map(id, states.get(id(e.main), {}).values())))
                                    for e in entries if e.main is not None)


class HeldStateCheck(Detector):
    """A rotating slice of each rank's held weights and Adam moments: non-finite or far off (kind ``state_off``)."""

    name = "state"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.period = period_of(cfg)
        self._optimizer: Optional[weakref.ref] = None
        self._entries: list = []
        self._slices: Optional[_Slices] = None
        self._checks = 0
        self._pending: Optional[tuple] = None  # (turn or None: all, largest magnitudes, at or under the bound)
        self._planned: Optional[tuple] = None  # (turn or None: all, the slices to read) of this check
        self._ok_out: Optional[tuple] = None  # (the check's piece, its second float)
        self._whole = False  # a rollback target was taken: the next check reads every slice
        self._loaded: Optional[list] = None  # baselines from a checkpoint, for the next slices cut

    def width(self) -> int:
        return 2  # slices read (the check's template), slices at or under their bound: flagged = the difference

    def after_update(self, optimizer: Any, entries: list, next_checked: bool) -> None:
        """Learn which optimizer and entries hold the state (the first update creates Adam's)."""
        if self._optimizer is None or self._optimizer() is not optimizer or entries is not self._entries:
            self._optimizer, self._entries = weakref.ref(optimizer), entries

    def forget(self) -> None:
        """The state was put back (a rollback): the next check of each slice compares with what
        it held at its last accepted check, which the restored state predates or equals."""
        self._pending = None

    def target_taken(self) -> None:
        """The next check reads every slice (one read of the whole held state), so the target it
        certifies has been read in full, not a fifth of it."""
        self._whole = True

    def _current(self) -> Optional[_Slices]:
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is None:
            return None
        key = _identity(optimizer, self._entries)
        if self._slices is None or self._slices.key != key:
            self._slices = _Slices(optimizer, self._entries, self.period, key, self.cfg)
            self._restore(self._slices)
        return self._slices

    def plan(self, ctx: CheckContext) -> Optional[tuple]:
        """Which slices this check reads; the count read is a constant of the check's vector."""
        self._planned = None
        if ctx.replay:  # the state is the one already judged at this step's check: its verdict stands
            return None
        self._pending = None
        self._checks += 1
        slices = self._current()
        if slices is None:
            return None
        turn = (self._checks - 1) % self.period
        pieces = slices.turns[turn]
        if self._whole:  # every slice, against its own turn's baseline
            turn, pieces, self._whole = None, slices.every, False
        if not pieces:
            return None
        self._planned = (turn, pieces)
        return slices.counts[turn if turn is not None else -1], None

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        if self._planned is None:
            return
        (turn, pieces), slices = self._planned, self._slices
        largest = torch.stack(torch._foreach_norm(pieces, float("inf"), dtype=torch.float32))
        bounds = slices.bounds[turn] if turn is not None else torch.cat([b for b in slices.bounds if b is not None])
        # At or under its bound: finite (NaN fails every comparison, Inf every finite bound) and not
        # more than its limit times the previous (the rule non-finite | (x > prev * limit & prev > 0)).
        ok = largest <= bounds
        self._pending = (turn, largest, ok)
        if self._ok_out is None or self._ok_out[0] is not out:
            self._ok_out = (out, out[1:])
        if ok.device == out.device:
            torch.sum(ok, dim=0, keepdim=True, dtype=torch.float32, out=self._ok_out[1])
        else:
            out[1] = ok.sum().to(out.device)

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        return [OFF] if _flagged(reduced) > 0 else []

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        """An accepted step's magnitudes become the next comparison's baseline once the warm-up is
        over (Adam's moments grow from zero over the first steps); a flagged one's never."""
        if accepted and self._pending is not None and not ctx.replay and self._checks > self.cfg.warmup_steps:
            turn, largest, _ = self._pending
            if turn is not None:
                self._slices.accept(turn, largest)
            else:  # a whole read is every turn's baseline (else a turn it always lands on has none)
                lengths = [len(used) for used in self._slices.used]
                for k, part in enumerate(torch.split(largest, lengths)):
                    if lengths[k]:
                        self._slices.accept(k, part)
        if not ctx.replay:
            self._pending = None

    def held(self, ctx: CheckContext, ranks: dict[str, int]) -> list[ParamFinding]:
        """Slow path: this rank's parameters with a flagged slice, reasons ``off:<what>`` (finite, far
        above the previous check's) or ``held:<what>`` (NaN or Inf; only where the check had no
        gradients to name: otherwise :func:`~megatron_patches.findings.held_findings` reads the whole
        held state on the slow path and names those)."""
        if self._pending is None or self._slices is None:
            return []
        turn, _, ok = self._pending
        bad = ~ok
        if not bool(bad.any()):
            return []
        found: dict[int, dict] = {}
        pieces, used = ((self._slices.turns[turn], self._slices.used[turn]) if turn is not None
                        else (self._slices.every, self._slices.every_used))
        for k, (index, flagged) in enumerate(zip(used, bad.tolist())):
            if not flagged:
                continue
            entry_index, what = self._slices.owners[index]
            nan, inf = int(torch.isnan(pieces[k]).sum()), int(torch.isinf(pieces[k]).sum())
            if (nan or inf) and ctx.entries:  # the slow path's own read of the held state names these
                continue
            slot = found.setdefault(entry_index, {"reasons": [], "nan": 0, "inf": 0})
            reason = f"{'held' if nan or inf else 'off'}:{what}"
            if reason not in slot["reasons"]:  # a whole read flags each slice of one tensor
                slot["reasons"].append(reason)
            slot["nan"], slot["inf"] = slot["nan"] + nan, slot["inf"] + inf
        host, device = naming.host(), naming.device_name()
        return [ParamFinding.located(self._entries[i].info, ranks, shape=list(self._entries[i].model.shape),
                                     nan=f["nan"], inf=f["inf"], overflow=0, norm=None, host=host, device=device,
                                     shard=self._entries[i].shard, reasons=f["reasons"])
                for i, f in sorted(found.items())]

    def state_dict(self) -> dict:
        """The checks counted and each turn's baselines (None where not yet taken), so a restart or
        a branch from a checkpoint judges ratios at once instead of warming up again; read on the
        host when a checkpoint is written, never on a checked step."""
        previous = self._slices.previous if self._slices is not None else self._loaded or []
        return {"checks": self._checks, "rank": collectives.rank(),
                "previous": [p.tolist() if torch.is_tensor(p) and bool(torch.isfinite(p).all()) else
                             p if isinstance(p, list) else None for p in previous]}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        # A rollback in this process keeps its count (the rotation goes on); a fresh process takes the saved one.
        self._checks = max(self._checks, int(state.get("checks", 0)))
        # Baselines are this rank's own slices: a loop that stores one rank's guard state for all
        # (the harness's common checkpoint part) must not give them to another rank's shards.
        mine = state.get("rank", collectives.rank()) == collectives.rank()
        self._loaded, self._slices, self._pending = (state.get("previous") if mine else None) or None, None, None

    def _restore(self, slices: _Slices) -> None:
        """Loaded baselines onto freshly cut slices, turn by turn where the counts match (the same
        tensors cut alike); any other turn has none yet (its bounds the largest finite float)."""
        loaded, self._loaded = self._loaded, None
        if not loaded or len(loaded) != len(slices.previous):
            return
        for k, values in enumerate(loaded):
            if values is not None and slices.limits[k] is not None and len(values) == slices.limits[k].numel():
                slices.accept(k, torch.tensor(values, dtype=torch.float32, device=slices.limits[k].device))

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        return {"state_off_slices": int(_flagged(reduced))} if _flagged(reduced) > 0 else {}


def _flagged(reduced: list) -> float:
    """Slices flagged over the job: read minus at or under their bound (exact integers in float32)."""
    return reduced[0] - reduced[1] if reduced else 0.0
