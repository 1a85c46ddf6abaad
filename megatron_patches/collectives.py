"""The few collectives the guard uses beyond its one all-reduce, all on the slow path.

Tensors sent are float32 or integer, never float64: MindSpeed's float64 ``all_reduce`` shim
reduces a float32 copy and does not write the result back (docs/ascend.md)."""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    """Processes in the job (1 without torch.distributed)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def local_shard(tensor: Any) -> Any:
    """This rank's shard of a DTensor (its ``_local_tensor``, a view: writes reach the DTensor; a
    torch FSDP2 or Megatron-FSDP parameter or gradient), anything else (None included) as it is."""
    shard = getattr(tensor, "_local_tensor", None)
    return tensor if shard is None else shard


def fully_sharded(tensors: Any) -> bool:
    """Whether any of ``tensors`` is a DTensor (torch FSDP2, Megatron-FSDP parameters): each rank
    holds its own shard, no rank a replica of the whole."""
    return any(local_shard(t) is not t for t in tensors)


def collective_device() -> torch.device:
    """Where tensors for this job's collectives live: the accelerator under nccl/hccl, else CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() != "gloo":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if hasattr(torch, "npu"):
            return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


class PeerLost(RuntimeError):
    """A bounded collective failed: a peer died, or did not answer within the timeout."""


class BoundedGroup:
    """The guard's own gloo group for the slow path, bounded by ``timeout_s`` (one per run, held by
    its monitor). :meth:`prepare` makes it while every rank is known to be alive (every rank at the
    same point: the first checked step); made later, in an incident a peer never reaches, it would
    wait on the rendezvous store without a bound. The timeout bounds each wait, and gloo answers at
    once when a peer's process is gone. Object collectives travel through the CPU, so the
    accelerator's queues play no part."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._group: Any = None

    def prepare(self) -> None:
        if self._group is None and not _single():
            self._group = torch.distributed.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))

    @property
    def group(self) -> Any:
        if self._group is None:
            raise PeerLost("the guard's bounded group was not prepared at the first check (BoundedGroup.prepare)")
        return self._group


def _single() -> bool:
    return world_size() == 1


def gather_to_zero(obj: Any, bounded: Optional[BoundedGroup] = None) -> list:
    """Every rank's ``obj`` on rank 0 (a list by rank); an empty list elsewhere. Over ``bounded``,
    no rank waits longer than its timeout: :class:`PeerLost` instead."""
    if _single():
        return [obj]
    out = [None] * world_size() if rank() == 0 else None
    try:
        torch.distributed.gather_object(obj, out, dst=0, group=None if bounded is None else bounded.group)
    except (RuntimeError, ValueError) as error:  # gloo: "Connection closed by peer", "Timed out"
        if bounded is None:
            raise
        raise PeerLost(f"gathering from every rank failed: {error}") from error
    return out or []


def gather_reports(obj: Any, reports: bool, bounded: BoundedGroup, tally: int = 0) -> tuple[list, int]:
    """Rank 0: ``obj`` of each rank that ``reports``, in rank order (every rank's when none does),
    and ``tally`` summed over every rank; ``([], total)`` elsewhere. One all-gather of two integers
    per rank tells every rank who sends; then only those ranks send their object to rank 0, one
    message each. What rank 0 takes in grows with the ranks an incident touched, not with the job
    (:func:`gather_to_zero` takes an object from every rank). Bounded like :func:`gather_to_zero`."""
    if _single():
        return [obj], tally
    try:
        mine = torch.tensor([1 if reports else 0, tally], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(world_size())]
        torch.distributed.all_gather(every, mine, group=bounded.group)
        total = sum(int(t[1]) for t in every)
        senders = [r for r, t in enumerate(every) if int(t[0])] or list(range(world_size()))
        if rank() != 0:
            if rank() in senders:
                torch.distributed.send_object_list([obj], dst=0, group=bounded.group)
            return [], total
        out = []
        for sender in senders:
            box = [obj]
            if sender != 0:
                torch.distributed.recv_object_list(box, src=sender, group=bounded.group)
            out.append(box[0])
        return out, total
    except (RuntimeError, ValueError) as error:  # gloo: "Connection closed by peer", "Timed out"
        raise PeerLost(f"gathering the reports of an incident failed: {error}") from error


def broadcast_from_zero(obj: Any, bounded: Optional[BoundedGroup] = None) -> Any:
    """Rank 0's ``obj`` on every rank, bounded like :func:`gather_to_zero`."""
    if _single():
        return obj
    box = [obj]
    try:
        torch.distributed.broadcast_object_list(box, src=0, group=None if bounded is None else bounded.group)
    except (RuntimeError, ValueError) as error:
        if bounded is None:
            raise
        raise PeerLost(f"the broadcast from rank 0 failed: {error}") from error
    return box[0]


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (one all-reduce of one value; every rank calls it)."""
    if _single():
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def all_gather_floats(values: list[float], device: Optional[torch.device] = None) -> list[list[float]]:
    """Every rank's ``values`` (the same length on all), as a list by rank, at float64 precision
    to about 2**-48 relative: each value travels as two float32s, its float32 rounding and the
    remainder, in one ``all_gather`` (no float64 tensor)."""
    high = torch.tensor(values, dtype=torch.float32)
    low = (torch.tensor(values, dtype=torch.float64) - high.double()).float()
    mine = torch.stack([high, low]).to(device or collective_device())
    if _single():
        every = [mine]
    else:
        every = [torch.empty_like(mine) for _ in range(world_size())]
        torch.distributed.all_gather(every, mine)
    return [[h + l for h, l in zip(*t.double().tolist())] for t in every]
