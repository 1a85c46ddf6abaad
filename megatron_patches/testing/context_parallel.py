"""A CPU stand-in for context-parallel attention, so that ``--context-parallel-size 2`` trains on CPU.

Under context parallelism (CP) each rank of a CP group holds two of the ``2 * cp`` equal chunks
of every sequence (rank r: chunks r and ``2cp - 1 - r``, megatron-core's load-balanced split,
``get_batch_on_this_cp_rank``); attention must still see the whole sequence. megatron-core does
that only in Transformer Engine's attention (ring or all-to-all exchanges of K and V); its local
``DotProductAttention`` asserts CP is 1. Transformer Engine needs CUDA and cannot run here.

:func:`redirects` lets ``DotProductAttention`` take CP > 1 on the CPU: each attention call gathers
K and V from the CP group (an all-gather whose backward all-reduces the gradient and keeps this
rank's part, so the weights' gradients are what the full attention gives) and masks each query
chunk causally against the keys' true positions. Same numbers as attention over the whole
sequence, computed on every CP rank for its own queries: a test stand-in, not an exchange
schedule, and not Transformer Engine's kernel. Used only by the CPU test runtime
(:mod:`megatron_patches.testing.cpu`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


class _GatherSequence(torch.autograd.Function):
    """``[s, ...]`` on each rank -> ``[group_size * s, ...]`` in rank order; the gradient of the
    gathered tensor is summed over the group and this rank's slice returned."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        ctx.group, ctx.size, ctx.rank = group, size, rank
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=0)[ctx.rank], None


def chunk_positions(local_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Sequence positions of the ``local_length`` tokens CP rank ``cp_rank`` holds, in its order."""
    chunk = local_length // 2
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)])


def load_balanced_causal_mask(local_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[1, 1, local_length, cp_size * local_length]``, True where a query of this rank must not
    see a key of the gathered sequence (the key comes later in the sequence)."""
    queries = chunk_positions(local_length, cp_size, cp_rank)
    keys = torch.cat([chunk_positions(local_length, cp_size, r) for r in range(cp_size)])
    return (keys[None, :] > queries[:, None])[None, None]


class _ContextParallelOff:
    """A view of a TransformerConfig that reads ``context_parallel_size`` as 1 (for the local
    attention's own assertion) and everything else as the config says."""

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return 1 if name == "context_parallel_size" else getattr(self._config, name)


def _init_under_context_parallel(original: Callable) -> Callable:
    @functools.wraps(original)
    def init(self, config, *args, **kwargs):
        if getattr(config, "context_parallel_size", 1) <= 1:
            return original(self, config, *args, **kwargs)
        original(self, _ContextParallelOff(config), *args, **kwargs)
        self.config = config
        return None

    return init


def _forward_under_context_parallel(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if getattr(self.config, "context_parallel_size", 1) <= 1:
            return original(self, query, key, value, attention_mask, *args, **kwargs)
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        key, value = _GatherSequence.apply(key, group), _GatherSequence.apply(value, group)
        mask = load_balanced_causal_mask(query.size(0), size, rank).to(query.device)
        return original(self, query, key, value, mask, *args, **kwargs)

    return forward


def redirects() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for the CPU runtime: ``DotProductAttention.__init__`` and
    ``forward``, where this megatron-core has the local attention's CP assertion."""
    try:
        from megatron.core.transformer.dot_product_attention import DotProductAttention
    except ImportError:  # pragma: no cover - a build without it
        return []
    return [(DotProductAttention, "__init__", _init_under_context_parallel(DotProductAttention.__dict__["__init__"])),
            (DotProductAttention, "forward", _forward_under_context_parallel(DotProductAttention.__dict__["forward"]))]
