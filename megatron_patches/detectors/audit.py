"""The state audit: the weights the optimizer steps and their Adam moments may change only in the
optimizer's update. Anything else that changes them (a card's memory flipping a bit, a stray
kernel writing out of bounds) is corruption, whatever its size.

Right after each update (``after_update``) every rank fingerprints, per tensor, what its optimizer
holds: each weight it steps (the fp32 main copy under mixed precision, its shard under the
distributed optimizer) and each floating state tensor (``exp_avg``, ``exp_avg_sq``). At the next
check, after the step's gradients are made and before they are applied, it fingerprints them again:
a tensor whose fingerprint differs was altered between two updates. No threshold, no history: a
flipped low mantissa bit is found like a NaN.

A fingerprint is two sums over the tensor: its raw bits as 32-bit integers modulo 2**32 (any single
changed word changes it) and its values summed in their own dtype, compared as bits (a sign flipped on
an even number of elements moves the integer sum by a multiple of 2**32 and leaves it equal; the
value sum moves by twice what was flipped). Both are read on the device; the check adds one float to
the guard's one all-reduce (tensors altered, summed over the job).

Cost, and why it is off by default: two reads of every weight and moment the rank steps per checked
step, each read taking two reductions: about twelve gradient read passes (the weight and each moment
are as large as the fp32 gradient), against the default's limit of 0.1. On an accelerator a read pass
of a rank's shard takes a millisecond or two, so the audit costs tens of milliseconds per step:
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
from ..faults import optimizer_states
from ..incidents import ParamFinding
from .base import CheckContext, Detector
from .consistency import _bits_sum

log = logging.getLogger("megatron_patches")

ALTERED = "state_altered"
"""The kind flagged when a held weight or moment changed between two updates."""


def _fingerprints(tensors: list) -> torch.Tensor:
    """Per tensor: [bit sum modulo 2**32, value sum as bits], int64, shape (n, 2). The value sum is
    taken in the tensor's own dtype (float32 for the main weights and Adam's moments: no converted
    copy) and compared as bits, so NaN equals NaN; one kernel over the same tensor of the same
    shape adds in the same order every time."""
    words = torch.stack([_bits_sum(t) for t in tensors]).to(torch.int64)
    values = torch.stack([t.detach().sum().float() for t in tensors]).view(torch.int32).to(torch.int64)
    return torch.stack([words, values.to(words.device)], dim=1)


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

    def width(self) -> int:
        return 1

    def _held(self, optimizer: Any, entries: list) -> tuple[tuple, list]:
        """(keys, tensors): each entry's stepped weight and floating state tensors, this rank's part."""
        states = optimizer_states(optimizer)
        keys, tensors = [], []
        for i, entry in enumerate(entries):
            if entry.main is None:
                continue
            held = {"weight": entry.main, **{key: value for key, value in sorted(states.get(id(entry.main), {}).items())
                                             if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0}}
            for what, tensor in held.items():
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
            self._keys, self._baseline = keys, _fingerprints(tensors)

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
        self._changed = (_fingerprints(tensors) != self._baseline).any(dim=1)
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
