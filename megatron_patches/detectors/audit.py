"""The state audit: the weights the optimizer steps and their Adam moments may change only in the
optimizer's update. Anything else that changes them (a card's memory flipping a bit, a stray
kernel writing out of bounds) is corruption, whatever its size.

Right after each update (``after_update``) every rank fingerprints, per tensor, what its optimizer
holds: each weight it steps (the fp32 main copy under mixed precision, its shard under the
distributed optimizer) and each floating state tensor (``exp_avg``, ``exp_avg_sq``). At the next
check, after the step's gradients are made and before they are applied, it fingerprints them again:
a tensor whose fingerprint differs was altered between two updates. No threshold, no history: a
flipped low mantissa bit is found like a NaN.

A fingerprint is one sum over the tensor's 32-bit words, each first put through a fixed bijective
mix (xor-shift, multiply by an odd constant, xor-shift), modulo 2**32: any one changed word changes
it, and changes to several words cancel only by chance, about once in 2**32. (A plain sum of the
words misses two sign flips, or as many lowest bits set as cleared; a sum of the values misses
what rounding swallows: the campaign met both.) Read on the device; the check adds one float to the
guard's one all-reduce (tensors altered, summed over the job).

Cost, and why it is off by default: every weight and moment the rank steps is read twice per
checked step (six gradient read passes: the weight and each moment are as large as the fp32
gradient), and each read mixes the words in chunks, a few element-wise operations on two buffers
the audit keeps (a chunk each, at most 4 MiB), against the default's limit of 0.1 read passes. ``make bench`` times it (variant C):
meant for fire drills, for a card under suspicion, and for runs where silent corruption must be
caught at any cost (``docs/detectors.md``).

Where it cannot hold, the guard refuses the run at the first step (one line, exit 2;
``Seams.audit_refusal``): an optimizer that rewrites the weights outside the update (MindSpeed's
``--reuse-fp32-param``), the CPU offload, the precision-aware optimizer and fully sharded data
parallel (torch FSDP2, Megatron-FSDP), where it has not run.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch

from .. import naming
from ..errors import exit_refused
from ..collectives import local_shard
from ..faults import held_tensors, optimizer_states
from ..incidents import ParamFinding
from .base import CheckContext, Detector

log = logging.getLogger("megatron_patches")

ALTERED = "state_altered"
"""The kind flagged when a held weight or moment changed between two updates."""


_CHUNK = 1 << 20
"""Words mixed at a time: the temporaries of :func:`_mixed_sum` stay at two such chunks."""
_MUL = 0x45D9F3B  # an odd multiplier: multiplying by it modulo 2**32 is a bijection
_LOW16 = 0xFFFF


class _Workspace:
    """Two word buffers per device, as long as the largest chunk met so far, kept across chunks,
    tensors and checks: the mix allocates nothing per chunk."""

    def __init__(self) -> None:
        self._buffers: dict = {}

    def take(self, words: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._buffers.get(device)
        if held is None or held[0].numel() < words:
            held = self._buffers[device] = tuple(torch.empty(words, dtype=torch.int32, device=device)
                                                 for _ in range(2))
        return held[0][:words], held[1][:words]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s 32-bit words, flat: 8-byte elements two words each; 2- and 1-byte elements are
    read as integers of their size (each widened to a word when copied into the workspace)."""
    flat = tensor.detach().reshape(-1)
    if flat.element_size() in (4, 8):
        return flat.view(torch.int32)
    return flat.view(torch.int16 if flat.element_size() == 2 else torch.uint8)


def _mixed_sum(tensor: torch.Tensor, work: _Workspace) -> torch.Tensor:
    """The sum modulo 2**32 of every 32-bit word of ``tensor``, each first put through the same
    bijective mix (xor-shift, multiply, xor-shift): one changed word changes the sum, and several
    changed words cancel only by chance (about one in 2**32), whatever their pattern (two sign
    flips, as many low bits set as cleared). A plain sum of the words misses both. 0-d int64."""
    flat = _words(tensor)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK]
        x, shifted = work.take(chunk.numel(), flat.device)
        x.copy_(chunk)  # widens 2- and 1-byte integers as .to(torch.int32) does
        torch.bitwise_right_shift(x, 16, out=shifted)
        shifted &= _LOW16  # a logical shift: the mix stays a bijection
        x ^= shifted
        x *= _MUL  # wraps modulo 2**32
        torch.bitwise_right_shift(x, 16, out=shifted)
        shifted &= _LOW16
        x ^= shifted
        total += x.sum(dtype=torch.int32)  # wraps modulo 2**32 as the result does; a wider sum copies x
    return total & 0xFFFFFFFF


def _fingerprints(tensors: list, work: Optional[_Workspace] = None) -> torch.Tensor:
    """Per tensor: :func:`_mixed_sum` of its words, int64, shape (n,)."""
    work = work or _Workspace()
    return torch.stack([_mixed_sum(t, work) for t in tensors])


def refuse(why: Optional[str], rank: int) -> None:
    """At the first step, on every rank: ``why`` the audit cannot hold here (``Seams.audit_refusal``,
    the same on every rank) stops the run with exit 2 and one line from rank 0; None passes."""
    if why is not None:
        if rank == 0:
            log.error("detectors.audit cannot run here: %s; set detectors.audit.enabled: false", why)
        exit_refused(rank)


class StateAudit(Detector):
    """Weights and optimizer state compared across the time between two updates (kind ``state_altered``)."""

    name = "audit"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self._optimizer: Optional[weakref.ref] = None
        self._entries: list = []  # every entry of that optimizer, as fingerprinted
        self._keys: Optional[tuple] = None  # (entry index, what, data_ptr) per fingerprinted tensor
        self._baseline: Optional[torch.Tensor] = None  # fingerprints right after the last update
        self._changed: Optional[torch.Tensor] = None  # this check's per-tensor mismatch (device)
        self._work = _Workspace()

    def width(self) -> int:
        return 1

    def _held(self, optimizer: Any, entries: list) -> tuple[tuple, list]:
        """(keys, tensors): each entry's stepped weight and floating state tensors, this rank's part."""
        states = optimizer_states(optimizer)
        keys, tensors = [], []
        for i, entry in enumerate(entries):
            if entry.main is None:
                continue
            for what, tensor in held_tensors(entry.main, states).items():
                local = local_shard(tensor).detach()
                if local.numel():
                    keys.append((i, what, local.data_ptr()))
                    tensors.append(local)
        return tuple(keys), tensors

    def after_update(self, optimizer: Any, entries: list, next_checked: bool) -> None:
        """Right after ``optimizer`` applied an update: fingerprint what it holds, if the next step
        is checked (else nothing is compared before the next update changes it anyway)."""
        self._baseline = self._keys = None
        if not next_checked:
            return
        keys, tensors = self._held(optimizer, entries)
        if tensors:
            self._optimizer, self._entries = weakref.ref(optimizer), entries
            self._keys, self._baseline = keys, _fingerprints(tensors, self._work)

    def forget(self) -> None:
        """The weights and state were put back (a rollback): nothing to compare until the next update."""
        self._baseline = self._keys = None

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        self._changed = None
        optimizer = self._optimizer() if self._optimizer is not None else None
        if self._baseline is None or optimizer is None or ctx.replay:
            return
        keys, tensors = self._held(optimizer, self._entries)
        if keys != self._keys:  # other tensors than fingerprinted (a load replaced them): no comparison
            self.forget()
            return
        self._changed = _fingerprints(tensors, self._work) != self._baseline
        out[0] = self._changed.sum().to(out.device)

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        return [ALTERED] if reduced and reduced[0] > 0 else []

    def held(self, ctx: CheckContext, ranks: dict[str, int]) -> list[ParamFinding]:
        """Slow path: this rank's parameters whose weight or state was altered, with reasons
        ``altered:<what>`` (``altered:weight``, ``altered:exp_avg``...)."""
        if self._changed is None or not bool(self._changed.any()):
            return []
        reasons: dict[int, list[str]] = {}
        for (i, what, _), changed in zip(self._keys, self._changed.tolist()):
            if changed:
                reasons.setdefault(i, []).append(f"altered:{what}")
        host, device, entries = naming.host(), naming.device_name(), self._entries
        return [ParamFinding.located(entries[i].info, ranks, shape=list(entries[i].model.shape), nan=0, inf=0,
                                     overflow=0, norm=None, host=host, device=device, shard=entries[i].shard,
                                     reasons=why)
                for i, why in sorted(reasons.items())]

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        return {"state_altered_tensors": int(reduced[0])} if reduced and reduced[0] > 0 else {}
