"""The few collectives the guard uses beyond its one all-reduce, all on the slow path."""

from __future__ import annotations

from typing import Any

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
