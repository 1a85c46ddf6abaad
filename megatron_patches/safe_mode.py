"""Safe mode on retry: the features ``recovery.disable_features`` switches off in a restarted job.

After a numerical incident the retry should run without the optimisations that may have caused
it. Each name below maps to the Megatron-LM arguments that switch the feature off. They are set
after Megatron has parsed and validated its arguments and before it builds the model and the
optimizer (:mod:`megatron_patches.seams.megatron_lm`), so the restarted job really trains
without them. Only features whose change keeps the checkpoint loadable are listed: none changes
a parameter's shape or layout, or the optimizer state. Left out on purpose: ``--moe-grouped-gemm``
(it stores the experts' weights as one tensor per layer instead of one per expert), fp8 and the
attention backend (Transformer Engine keeps per-module extra state in checkpoints; not verified
here).

This module is data and one function over an ``argparse.Namespace``; it imports nothing of Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Feature:
    name: str
    off: tuple
    """(Megatron-LM argument, the value that switches the feature off), in the order applied."""
    why_safe: str


_FUSION = "a kernel choice: the same parameters and optimizer state, computed unfused"

FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("dropout", (("hidden_dropout", 0.0), ("attention_dropout", 0.0)), "dropout has no parameters"),
    Feature("bias_gelu_fusion", (("bias_gelu_fusion", False),), _FUSION),
    Feature("bias_swiglu_fusion", (("bias_swiglu_fusion", False),), _FUSION),
    Feature("bias_dropout_fusion", (("bias_dropout_fusion", False),), _FUSION),
    Feature("masked_softmax_fusion", (("masked_softmax_fusion", False),), _FUSION),
    Feature("rope_fusion", (("apply_rope_fusion", False),), _FUSION),
    Feature("cross_entropy_fusion", (("cross_entropy_loss_fusion", False),), _FUSION),
    Feature("gradient_accumulation_fusion", (("gradient_accumulation_fusion", False),), _FUSION),
    Feature("persist_layer_norm", (("no_persist_layer_norm", True),), _FUSION),
    Feature("moe_permute_fusion", (("moe_permute_fusion", False),), _FUSION),
    Feature("moe_router_fusion", (("moe_router_fusion", False),), _FUSION),
    Feature("overlap_grad_reduce", (("overlap_param_gather", False), ("overlap_grad_reduce", False)),
            "when the reduction runs, not what it reduces; the parameter-gather overlap needs it, so it "
            "goes off too"),
    Feature("overlap_param_gather", (("overlap_param_gather", False),), "when the gather runs, not what it gathers"),
    Feature("tp_comm_overlap", (("tp_comm_overlap", False),), "when tensor-parallel communication runs"),
)}
"""Every feature name the guard can switch off, by name."""

GROUPS: dict[str, tuple[str, ...]] = {
    "fusions": tuple(name for name, f in FEATURES.items() if f.why_safe == _FUSION),
    "overlap": ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"),
}
"""Names that stand for several features."""

KNOWN = tuple(FEATURES) + tuple(GROUPS)


def expand(names: Any) -> list[str]:
    """The feature names ``names`` stand for (groups expanded), each once, in order."""
    out: list[str] = []
    for name in names:
        for one in GROUPS.get(name, (name,)):
            if one not in out:
                out.append(one)
    return out


def unknown(names: Any) -> list[str]:
    """The names that are neither a feature nor a group."""
    return [name for name in names if name not in FEATURES and name not in GROUPS]


def switch_off(args: Any, names: Any) -> tuple[list[str], list[str]]:
    """Set ``args`` so that every feature ``names`` stands for is off. Returns (what changed, as
    ``arg old -> new``; the features that were already off or that this Megatron lacks)."""
    changed, already = [], []
    for name in expand(names):
        moved = []
        for arg, off in FEATURES[name].off:
            if hasattr(args, arg) and getattr(args, arg) not in (off, None):
                moved.append(f"{arg} {getattr(args, arg)!r} -> {off!r}")
                setattr(args, arg, off)
        if moved:
            changed += moved
        else:
            already.append(name)
    return changed, already


def dropout_off(modules: Any) -> None:
    """Dropout switched off in a live model's ``modules`` (``model.modules()`` of each chunk): every
    ``torch.nn.Dropout`` at p 0, and the layers' own float rates (``hidden_dropout``,
    ``attention_dropout``) at 0. The one feature that changes without building the model again."""
    import torch

    for module in modules:
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attribute in ("hidden_dropout", "attention_dropout"):
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)
