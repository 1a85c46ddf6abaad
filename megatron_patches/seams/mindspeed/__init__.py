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

Beside the undo, this module holds what the patch layer needs to know about MindSpeed: the import
order it must come after (:func:`order_problem`), a hook on its patch manager so that ``repatch()``
does not silently drop the guard (:func:`watch_patch_manager`), the modules where MindSpeed-LLM
binds Megatron functions by name (:data:`BINDING_MODULES`), and the flags whose optimizer path never
reaches the guard (:func:`refuse_unchecked_paths`). See docs/ascend.md.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable, Optional

ORDER_HINT = "import mindspeed.megatron_adaptor before megatron_patches.apply (docs/ascend.md)"

BINDING_MODULES: tuple[str, ...] = (
    "mindspeed_llm.training.training",
)
"""Modules that bind Megatron functions by name at their import (``from megatron.training.training
import train_step``): MindSpeed-LLM's training loop binds ``train_step``, ``finalize_model_grads``
and ``save_checkpoint``. When one of them is already imported at install, its copies of a target
are found by identity and wrapped too; one imported later binds the wrapper itself."""


def order_problem() -> Optional[str]:
    """One line when MindSpeed is importable here but has patched nothing yet (its adaptor would
    then replace some of the guard's wrappers after us); None otherwise."""
    if "mindspeed.megatron_adaptor" in sys.modules:
        return None
    manager = getattr(sys.modules.get("mindspeed.patch_utils"), "MindSpeedPatchesManager", None)
    if manager is not None and getattr(manager, "patches_info", None):
        return None  # MindSpeed's features were applied without the adaptor module (tests, RL stacks)
    try:
        if importlib.util.find_spec("mindspeed") is None:
            return None
    except (ImportError, ValueError):
        return None
    return ("MindSpeed is installed but has not patched Megatron yet: " + ORDER_HINT
            + "; wrappers it replaces later are wrapped again at the guard's first call")


def watch_patch_manager(after: Callable[[], None]) -> Optional[Callable[[], None]]:
    """Run ``after`` each time MindSpeed's ``MindSpeedPatchesManager.apply_patches`` has run (its
    ``repatch()`` removes every patch, ours included where it captured them, and applies them
    again). Only when ``mindspeed.patch_utils`` is already imported; returns the undo, or None."""
    module = sys.modules.get("mindspeed.patch_utils")
    manager = getattr(module, "MindSpeedPatchesManager", None)
    if manager is None:
        return None
    import wrapt

    current = manager.__dict__.get("apply_patches")
    if isinstance(current, wrapt.FunctionWrapper) and getattr(current, "_self_megatron_patches", False):
        return None  # already watched

    def apply_patches_then_check(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        after()
        return result

    watched = wrapt.FunctionWrapper(current, apply_patches_then_check)
    watched._self_megatron_patches = True
    setattr(manager, "apply_patches", watched)

    def undo() -> None:
        if manager.__dict__.get("apply_patches") is watched:
            setattr(manager, "apply_patches", current)

    return undo


UNCHECKED_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("use_quant_optimizer", "--quant-states/--quant-grads",
     "MindSpeed's quantized optimizer replaces MixedPrecisionOptimizer.step with one that unscales "
     "inline and never calls prepare_grads"),
    ("quant_states", "--quant-states", "the quantized optimizer's step never calls prepare_grads"),
    ("quant_grads", "--quant-grads", "the quantized optimizer's step never calls prepare_grads"),
    ("layerzero", "--layerzero",
     "LayerZero builds its own model and optimizer (setup_model_and_optimizer replaced) and its "
     "step never calls prepare_grads"),
)
"""(argument, flag, why): MindSpeed options under which the guard never sees the gradients."""


def refuse_unchecked_paths(args: Any) -> None:
    """Raise naming the flag when ``args`` (Megatron-LM's parsed arguments, MindSpeed's added)
    selects an optimizer path the guard cannot check; nothing when none is set."""
    for name, flag, why in UNCHECKED_FLAGS:
        if getattr(args, name, None):
            from ...errors import UnsupportedConfig

            raise UnsupportedConfig(
                f"megatron_patches cannot check gradients with MindSpeed's {flag} ({name}="
                f"{getattr(args, name)!r}): {why}. Run without {flag}, or without the guard "
                f"(enabled: false); see docs/ascend.md")


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
