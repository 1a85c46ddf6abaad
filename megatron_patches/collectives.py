"""The few collectives the guard uses beyond its one all-reduce, all on the slow path.

Tensors sent are float32 or integer, never float64: MindSpeed's float64 ``all_reduce`` shim
reduces a float32 copy and does not write the result back (docs/ascend.md)."""

from __future__ import annotations

from typing import Any, Optional

import torch


def collective_device() -> torch.device:
    """Where tensors for this job's collectives live: the accelerator under nccl/hccl, else CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() != "gloo":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if hasattr(torch, "npu"):
            return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def gather_to_zero(obj: Any) -> list:
    """Every rank's ``obj`` on rank 0 (a list by rank); an empty list elsewhere."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(obj, out, dst=0)
    return out or []


def broadcast_from_zero(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_floats(values: list[float], device: Optional[torch.device] = None) -> list[list[float]]:
    """Every rank's ``values`` (the same length on all), as a list by rank, at float64 precision
    to about 2**-48 relative: each value travels as two float32s, its float32 rounding and the
    remainder, in one ``all_gather`` (no float64 tensor)."""
    high = torch.tensor(values, dtype=torch.float32)
    low = (torch.tensor(values, dtype=torch.float64) - high.double()).float()
    mine = torch.stack([high, low]).to(device or collective_device())
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        every = [mine]
    else:
        every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(every, mine)
    return [[h + l for h, l in zip(*t.double().tolist())] for t in every]
