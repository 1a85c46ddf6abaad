"""Megatron configurations the guard does not check yet, refused at start in one line.

A variant the guard cannot read correctly must stop the job before the first step, never leave
its gradients silently unchecked: :func:`refuse_args` reads Megatron-LM's parsed arguments before
the checkpoint load (:mod:`megatron_patches.seams.megatron_lm`). Every megatron-core optimizer
leaf is read (:func:`megatron_patches.seams.optimizer_params.param_pairs`), so no check on the
optimizer objects is left.

Checked and tested (not refused): FP32, Float16 and distributed optimizers (``--bf16``/``--fp16``,
``--use-distributed-optimizer``, ``--overlap-grad-reduce``), tensor and pipeline parallel, and
interleaved (virtual) pipelines, MTP, mixture-of-experts with expert parallelism (alltoall and
allgather dispatchers; experts split over expert-tensor-parallel ranks, Megatron's default under
TP; docs/moe.md), the precision-aware optimizer
(``--use-precision-aware-optimizer``: the bf16 shards' ``decoupled_grad`` is read), its CPU offload
(``--optimizer-cpu-offload``: read there too, before ``HybridDeviceOptimizer`` copies it to the host), context
parallelism (``--context-parallel-size``: ranks named with their ``cp``), torch FSDP2
(``--use-torch-fsdp2``) and Megatron-FSDP (``--use-megatron-fsdp``): each rank's shard of the DTensor
gradients, after the reduce-scatter of backward; tests/trainings/test_variant_loops.py.
"""

from __future__ import annotations

from typing import Any, Optional

from .errors import UnsupportedConfig


def _unsupported(flag: str, why: str) -> UnsupportedConfig:
    return UnsupportedConfig(
        f"{flag} is not supported by megatron_patches yet ({why}); it stops the job rather than "
        f"guard it wrongly: run without {flag}, or without the guard")


def refuse_args(args: Any) -> None:
    """Raise :class:`UnsupportedConfig` naming the first Megatron-LM flag in ``args`` whose
    gradients the guard does not check yet."""
    problem = unsupported_flag(args)
    if problem is not None:
        raise _unsupported(*problem)


HIGH_AVAILABILITY_ARGS = ("enable_high_availability", "enable_elastic_training", "enable_worker_reboot",
                          "enable_hbmfault_repair")
"""MindSpeed-LLM's high-availability (MindIO TTP) arguments, each also set from its
``HIGH_AVAILABILITY`` environment variable (dump, recover, retry, elastic-training). The last three
act only together with the first; any of them is refused, named."""

HIGH_AVAILABILITY_WHY = (
    "MindIO TTP keeps each distributed-optimizer shard on several ranks, so the guard's total norm "
    "would count it several times; elastic scale-in rewrites the world collectives the guard uses; "
    "its PRECISION ERROR retry rewrites latest_checkpointed_iteration.txt, which bounds the rollback "
    "target")


def unsupported_flag(args: Any) -> Optional[tuple[str, str]]:
    """(flag, why) for the first unsupported variant in Megatron-LM's ``args``, or None."""
    on = lambda name: bool(getattr(args, name, False))  # noqa: E731
    for name in HIGH_AVAILABILITY_ARGS:
        if on(name):
            return "--" + name.replace("_", "-"), HIGH_AVAILABILITY_WHY
    if getattr(args, "num_experts", None) and getattr(args, "moe_token_dispatcher_type", None) == "flex":
        return ("--moe-token-dispatcher-type flex",
                "the DeepEP/HybridEP dispatcher is CUDA-only and has not run with the guard; use alltoall or allgather")
    return None
