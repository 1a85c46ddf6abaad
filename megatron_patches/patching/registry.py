"""Every Megatron target this package patches, declared once: where, which versions, why.

A target names the module that defines the object and its qualified name there. Re-exports
(``from .x import f`` in a package ``__init__``) are listed as aliases so that code importing
the name after installation sees the wrapper too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import hooks

MEGATRON_CORE_SUPPORTED = ">=0.12,<0.17"
"""megatron-core releases the runtime patches support; 0.16.1 is what CI trains with."""


@dataclass(frozen=True)
class PatchTarget:
    module: str
    """Module that defines the object, e.g. ``megatron.core.optimizer.optimizer``."""
    qualname: str
    """Attribute path inside the module, e.g. ``FP32Optimizer.prepare_grads``."""
    wrapper: Callable
    """A wrapt-style wrapper ``(wrapped, instance, args, kwargs)`` from :mod:`megatron_patches.hooks`."""
    why: str
    versions: str = MEGATRON_CORE_SUPPORTED
    aliases: tuple[str, ...] = ()
    """Other modules that re-export the same object under the same name."""

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"


_OPT = "megatron.core.optimizer.optimizer"

TARGETS: tuple[PatchTarget, ...] = (
    PatchTarget(
        _OPT,
        "ChainedOptimizer.prepare_grads",
        hooks.prepare_grads_wrapper,
        "get_megatron_optimizer returns a ChainedOptimizer; checking once over all its leaves "
        "costs one collective per step instead of one per leaf. Returning True skips the step.",
    ),
    PatchTarget(
        _OPT,
        "MixedPrecisionOptimizer.prepare_grads",
        hooks.prepare_grads_wrapper,
        "Last point before clipping for Float16 and distributed optimizers used without a chain; "
        "in bf16 nothing else checks these gradients.",
    ),
    PatchTarget(
        _OPT,
        "FP32Optimizer.prepare_grads",
        hooks.prepare_grads_wrapper,
        "Last point before clipping for fp32 training; never checks for NaN upstream.",
    ),
    PatchTarget(
        _OPT,
        "MegatronOptimizer.clip_grad_norm",
        hooks.clip_grad_norm_wrapper,
        "Callers that clip through clip_grad_norm without prepare_grads still get a check.",
    ),
    PatchTarget(
        "megatron.core.optimizer",
        "get_megatron_optimizer",
        hooks.get_optimizer_wrapper,
        "The one call that sees both the model chunks and the optimizer: parameter names come from here.",
    ),
    PatchTarget(
        "megatron.core.distributed.finalize_model_grads",
        "finalize_model_grads",
        hooks.finalize_model_grads_wrapper,
        "Runs right before the data-parallel gradient reduction: drills with phase=local inject here.",
        aliases=("megatron.core.distributed",),
    ),
)
