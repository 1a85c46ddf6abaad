"""Which gradients an optimizer is about to apply, and whose they are.

megatron-core's leaf optimizers keep their parameters differently: the FP32 optimizer steps the
model parameters themselves, the Float16 optimizer steps fp32 copies (``main_param``), and the
distributed optimizer steps fp32 shards of them (the precision-aware one: the model's own
bf16/fp16 shards, with fp32 gradients in ``decoupled_grad``). :func:`build_entries` pairs every parameter the
optimizer steps with the model parameter it belongs to and that parameter's global name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import naming
from ..collectives import local_shard
from .parallel import parallel_state


@dataclass
class Entry:
    """One optimizer parameter this rank holds, with where it comes from."""

    main: torch.Tensor
    model: torch.Tensor
    info: naming.ParamInfo
    shard: bool
    weight: float
    """Factor on its squared norm so that the world-wide sum counts each element once."""
    slot: int
    """Index into the per-layer sums: layer i -> i, embedding -> L, output side -> L + 1."""


def leaves(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def param_pairs(leaf: Any):
    """(main param the optimizer steps, model param it belongs to, is_shard) of one leaf."""
    if getattr(leaf, "is_stub_optimizer", False) or getattr(leaf, "optimizer", None) is None:
        return
    if hasattr(leaf, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        # The precision-aware optimizer steps the low-precision shards themselves (their fp32
        # gradient in ``decoupled_grad``, the fp32 master weights inside the optimizer) and
        # keeps None where the fp32 shards would be.
        shards = leaf.shard_float16_groups if uses_decoupled_grad(leaf) else leaf.shard_fp32_from_float16_groups
        for models, mains in zip(leaf.model_float16_groups, shards):
            yield from ((s, m, True) for m, s in zip(models, mains))
        for models, mains in zip(leaf.model_fp32_groups, leaf.shard_fp32_groups):
            yield from ((s, m, True) for m, s in zip(models, mains))
    elif hasattr(leaf, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        for models, mains in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
            yield from ((s, m, False) for m, s in zip(models, mains))
        for group in leaf.fp32_from_fp32_groups:
            yield from ((p, p, False) for p in group)
    else:  # FP32Optimizer, and Megatron-FSDP's distributed optimizer: the model parameters themselves
        for group in leaf.optimizer.param_groups:
            # Fully sharded (torch FSDP2, Megatron-FSDP): DTensors, each rank stepping its own shard.
            yield from ((p, p, local_shard(p) is not p) for p in group["params"])


def uses_decoupled_grad(leaf: Any) -> bool:
    """Whether ``leaf`` applies ``decoupled_grad`` (megatron-core's precision-aware optimizer
    without FP8 parameters) rather than ``.grad``."""
    return bool(getattr(leaf.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


def build_entries(optimizer: Any, model_chunks: list) -> tuple[list[Entry], int]:
    """Entries of every parameter ``optimizer`` steps on this rank, and the number of per-layer
    slots (transformer layers, embedding, output side)."""
    infos = naming.name_parameters(model_chunks, parallel_state())
    num_layers = max((naming.num_layers(c) for c in model_chunks), default=0)
    ps = parallel_state()
    dense_dp = ps.get_data_parallel_world_size(with_context_parallel=True) if ps else 1
    expert_dp = ps.get_expert_data_parallel_world_size() if ps and hasattr(ps, "get_expert_data_parallel_world_size") else 1
    entries = []
    for leaf in leaves(optimizer):
        # Distributed-optimizer shards are held once per optimizer instance (usually one).
        instances = int(getattr(getattr(leaf, "ddp_config", None), "num_distributed_optimizer_instances", 1) or 1)
        for index, (main, model, shard) in enumerate(param_pairs(leaf)):
            info = infos.get(id(model)) or naming.ParamInfo(
                name=f"unnamed[{index}] {tuple(model.shape)}", layer=None, order=index, counts_in_norm=True)
            if getattr(model, "grad_norm_group", None) is not None:
                # 0.19+: clipped with a norm of its own (MTP), left out of the main norm Megatron
                # reports; still checked for NaN/Inf and by the detectors.
                info = dataclasses.replace(info, counts_in_norm=False)
            replicas = instances if shard else (dense_dp if getattr(model, "allreduce", True) else expert_dp)
            weight = (1.0 / replicas) if info.counts_in_norm else 0.0
            entries.append(Entry(main, model, info, shard, weight, naming.slot_index(info, num_layers)))
    return entries, num_layers + 2


def model_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient a model parameter has gathered in backward, before the optimizer sees it:
    its view into Megatron DDP's gradient buffer (``main_grad``) where it has one, else
    ``.grad`` (a module outside DDP; this rank's shard under FSDP). None when backward left it none."""
    grad = getattr(param, "main_grad", None)
    return local_shard(grad if grad is not None else param.grad)


def optimizer_grad(main: torch.Tensor, decoupled: bool) -> Optional[torch.Tensor]:
    """The gradient the optimizer applies to ``main`` (a parameter it steps, see
    :func:`param_pairs`): ``decoupled_grad`` under the precision-aware optimizer (``decoupled``:
    :func:`uses_decoupled_grad` of a leaf), else ``.grad``; this rank's shard of a DTensor."""
    return local_shard(getattr(main, "decoupled_grad", None) if decoupled else main.grad)


def current_grads(optimizer: Any, entries: list[Entry]):
    """(entry, the gradient the optimizer will apply now, or None) for each entry."""
    decoupled = any(uses_decoupled_grad(leaf) for leaf in leaves(optimizer))
    for e in entries:
        yield e, optimizer_grad(e.main, decoupled)


def audit_refusal(optimizer: Any) -> Optional[str]:
    """Why the state audit (``detectors.audit``) cannot run on ``optimizer``, or None: it has run
    with megatron-core's FP32, Float16 and distributed optimizers, which change the weights they step
    and their moments in ``step_with_ready_grads`` alone."""
    for leaf in leaves(optimizer):
        config, ddp = getattr(leaf, "config", None), getattr(leaf, "ddp_config", None)
        if getattr(config, "reuse_fp32_param", False):
            return "MindSpeed's --reuse-fp32-param rewrites the weights in prepare_grads, before every update"
        if getattr(config, "optimizer_cpu_offload", False):
            return "--optimizer-cpu-offload keeps the weights and moments on the host, where it has not run"
        if getattr(config, "use_precision_aware_optimizer", False):
            return "the precision-aware optimizer keeps its weights and moments in forms it has not run on"
        if getattr(ddp, "use_megatron_fsdp", False) or getattr(ddp, "use_custom_fsdp", False):
            return "Megatron-FSDP has not run with it"
        if any(type(p).__name__ == "DTensor" for group in getattr(leaf, "param_groups", []) for p in group["params"]):
            return "fully sharded data parallel (DTensor weights) has not run with it"
    return None
