"""Uneven list collectives on gloo, for expert tensor parallelism on CPU ranks.

With experts split over expert-tensor-parallel ranks (``--expert-tensor-parallel-size`` > 1) and
the all-to-all token dispatcher, megatron-core gathers the tokens each expert-TP rank received over
the expert-TP group and gives each rank its own count back (``gather_from_sequence_parallel_region``
and ``reduce_scatter_to_sequence_parallel_region`` with split sizes): ``torch.distributed.all_gather``
with a list of tensors of different lengths, and ``torch.distributed.reduce_scatter`` with a list.
NCCL takes both; gloo refuses the first ("invalid tensor size") and has no list reduce-scatter.

:func:`redirects` gives the CPU runtime (:mod:`megatron_patches.testing.cpu`) a stand-in for each
on a gloo group: the pieces padded to the longest along the first dimension, one even collective,
the padding dropped. Calls the backend takes as they are (even sizes, another backend, an async
call) go to torch's own function unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist


def _on_gloo(group: Any) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):  # no default group yet: not ours to change
        return False


def _padded(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` with zero rows appended along dim 0 up to ``length`` rows."""
    if tensor.shape[0] == length:
        return tensor.contiguous()
    pad = tensor.new_zeros((length - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


def _uneven_all_gather(original: Callable) -> Callable:
    """``all_gather(tensor_list, tensor)`` that takes pieces of different first-dimension lengths
    on gloo."""

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        lengths = [t.shape[0] if t.dim() else 1 for t in tensor_list]
        if async_op or len(set(lengths)) <= 1 or not _on_gloo(group):
            return original(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(lengths)
        gathered = [tensor.new_empty((longest, *tensor.shape[1:])) for _ in tensor_list]
        original(gathered, _padded(tensor, longest), group=group)
        for out, piece, length in zip(tensor_list, gathered, lengths):
            out.copy_(piece[:length])
        return None

    return all_gather


def _list_reduce_scatter(original: Callable) -> Callable:
    """``reduce_scatter(output, input_list)`` (sum) on gloo: the pieces padded to one length and
    stacked, all-reduced, and this rank's piece kept."""

    @functools.wraps(original)
    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or op != dist.ReduceOp.SUM or not _on_gloo(group):
            return original(output, input_list, op=op, group=group, async_op=async_op)
        longest = max(t.shape[0] for t in input_list)
        stacked = torch.stack([_padded(t, longest) for t in input_list])
        dist.all_reduce(stacked, group=group)
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        output.copy_(stacked[me, :output.shape[0]])
        return None

    return reduce_scatter


def redirects() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for the CPU runtime's install."""
    return [(dist, "all_gather", _uneven_all_gather(dist.__dict__["all_gather"])),
            (dist, "reduce_scatter", _list_reduce_scatter(dist.__dict__["reduce_scatter"]))]
