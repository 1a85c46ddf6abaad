"""MindSpeed (Ascend's Megatron adaptor): undo ``--reuse-fp32-param`` on a step the guard skips.

With ``--reuse-fp32-param`` MindSpeed keeps one buffer per parameter that holds either the
bf16 model weights plus a 16-bit residual, or the fp32 master weights. Its replacement of
``MixedPrecisionOptimizer.prepare_grads`` converts that buffer to fp32 in place
(``self.fp16_tensor_convert_to_fp32_tensor()``), and only its ``step_with_ready_grads``
converts it back after the update (``self.fp32_tensor_convert_to_fp16_tensor()``). When our
``prepare_grads`` wrapper returns True, Megatron's ``step()`` returns before
``step_with_ready_grads``: without :func:`undo_prepare_on_skip` the next forward would read the
fp32 bit patterns as bf16 weights.

MindSpeed installs both conversion methods on the optimizer instance (Float16OptimizerWithFloat16Params
and DistributedOptimizer init wrappers) and sets ``config.reuse_fp32_param`` (OptimizerConfig init
wrapper); its ``prepare_grads`` converts exactly when that flag is set (the low-precision variant
also leaves stub optimizers alone). Those are what we test for, so nothing is imported from MindSpeed
and nothing happens without it.
"""

from __future__ import annotations

from typing import Any


def converted_by_prepare(optimizer: Any) -> bool:
    """Whether MindSpeed's ``prepare_grads`` left this (leaf) optimizer's parameters in fp32 form."""
    return (bool(getattr(getattr(optimizer, "config", None), "reuse_fp32_param", False))
            and not getattr(optimizer, "is_stub_optimizer", False)
            and callable(getattr(optimizer, "fp32_tensor_convert_to_fp16_tensor", None)))


def undo_prepare_on_skip(optimizer: Any) -> bool:
    """Put back the bf16 weights MindSpeed's ``prepare_grads`` converted, as its
    ``step_with_ready_grads`` would, without the update; returns whether anything was done.

    The fp32 -> bf16 conversion is the exact inverse of the bf16 -> fp32 one (an integer add and
    subtract of half a bf16 unit plus a byte transpose), so the bf16 weights and residuals come
    back bit for bit. A DistributedOptimizer's conversion also overwrites the neighbouring
    data-parallel shards of the parameter buffer, which ``step_with_ready_grads`` refreshes with
    the parameter all-gather; that is done here the same way (with ``overlap_param_gather`` the
    next forward's pre-hooks gather). Call on every rank: the skip decision is the same on all.
    """
    leaves = [leaf for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]
              if converted_by_prepare(leaf)]
    for leaf in leaves:
        leaf.fp32_tensor_convert_to_fp16_tensor()
    chunks: dict[int, Any] = {}
    for leaf in leaves:
        ddp_config = getattr(leaf, "ddp_config", None)  # set on DistributedOptimizer only
        if ddp_config is not None and not ddp_config.overlap_param_gather:
            chunks.update((id(chunk), chunk) for chunk in leaf.model_chunks)
    for chunk in chunks.values():
        chunk.start_param_sync()
    return bool(leaves)
