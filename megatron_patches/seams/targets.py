"""Every Megatron target this package patches, declared once: where, which versions, why.

A target names the module that defines the object and its qualified name there. Re-exports
(``from .x import f`` in a package ``__init__``) are listed as aliases so that code importing
the name after installation sees the wrapper too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .. import versions

MEGATRON_CORE_SUPPORTED = versions.SUPPORTED
"""megatron-core releases the runtime patches support (:mod:`megatron_patches.versions`)."""


@dataclass(frozen=True)
class PatchTarget:
    module: str
    """Module that defines the object, e.g. ``megatron.core.optimizer.optimizer``."""
    qualname: str
    """Attribute path inside the module, e.g. ``FP32Optimizer.prepare_grads``."""
    wrapper: str
    """Dotted name of a wrapt-style wrapper ``(wrapped, instance, args, kwargs)``, e.g.
    ``megatron_patches.seams.wrappers.prepare_grads_wrapper``: resolved when installed (:meth:`resolve`), so
    the registry imports none of the code it wires."""
    why: str
    versions: str = MEGATRON_CORE_SUPPORTED
    aliases: tuple[str, ...] = ()
    """Other modules that re-export the same object under the same name (``from x import f``
    binds at import time: a module imported before the patches keeps the original unless it is
    listed here). An alias that cannot be imported is skipped."""
    required: bool = True
    """False: skipped with an info log when the module cannot be imported. Megatron-LM's
    ``megatron.training`` exists only in a checkout, never in the megatron-core package."""
    lazy: bool = False
    """True: never imported by the install; wrapped once something else imports the module (at
    once if it already is). Megatron-Bridge takes about 20 s to import and pulls in packages a
    Megatron-LM job does not have; only a Bridge job imports it."""

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"

    def resolve(self) -> Callable:
        """The wrapper function :attr:`wrapper` names."""
        module, _, name = self.wrapper.rpartition(".")
        return getattr(importlib.import_module(module), name)


_OPT = "megatron.core.optimizer.optimizer"

TARGETS: tuple[PatchTarget, ...] = (
    PatchTarget(
        _OPT,
        "ChainedOptimizer.prepare_grads",
        "megatron_patches.seams.wrappers.prepare_grads_wrapper",
        "get_megatron_optimizer returns a ChainedOptimizer; checking once over all its leaves "
        "costs one collective per step instead of one per leaf. Returning True skips the step.",
    ),
    PatchTarget(
        _OPT,
        "MixedPrecisionOptimizer.prepare_grads",
        "megatron_patches.seams.wrappers.prepare_grads_wrapper",
        "Last point before clipping for Float16 and distributed optimizers used without a chain; "
        "in bf16 nothing else checks these gradients.",
    ),
    PatchTarget(
        _OPT,
        "FP32Optimizer.prepare_grads",
        "megatron_patches.seams.wrappers.prepare_grads_wrapper",
        "Last point before clipping for fp32 training; never checks for NaN upstream.",
    ),
    *(PatchTarget(
        module,
        f"{cls}.step_with_ready_grads",
        "megatron_patches.seams.wrappers.step_with_ready_grads_wrapper",
        "Where each optimizer applies its update: right after it, the state audit (detectors.audit, off "
        "by default) fingerprints the weights and moments it holds, to find them altered by the next check.",
    ) for module, cls in ((_OPT, "ChainedOptimizer"), (_OPT, "MixedPrecisionOptimizer"), (_OPT, "FP32Optimizer"),
                          ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"))),
    PatchTarget(
        _OPT,
        "MegatronOptimizer.clip_grad_norm",
        "megatron_patches.seams.wrappers.clip_grad_norm_wrapper",
        "Callers that clip through clip_grad_norm without prepare_grads still get a check.",
    ),
    PatchTarget(
        _OPT,
        "ChainedOptimizer.get_grad_norm",
        "megatron_patches.seams.wrappers.get_grad_norm_wrapper",
        "ChainedOptimizer.step takes the clipping norm from here right after prepare_grads: on a "
        "checked step the guard's own pass already holds it (megatron_patches.seams.served_norm), so "
        "Megatron's second read of every gradient, its all-reduce and its host read are left out.",
    ),
    PatchTarget(
        _OPT,
        "MegatronOptimizer.get_grad_norm",
        "megatron_patches.seams.wrappers.get_grad_norm_wrapper",
        "The same for a leaf asked directly after its own checked prepare_grads (a loop without a "
        "chain). A leaf's own step() clips through clip_grad_norm, which stays stock.",
    ),
    PatchTarget(
        "megatron.core.optimizer.clip_grads",
        "multi_tensor_applier",
        "megatron_patches.seams.wrappers.multi_tensor_applier_wrapper",
        "get_grad_norm_fp32 reads every gradient with one L2 kernel call through this binding: the "
        "guard's check made that very call just before (asking per-tensor norms too), so Megatron "
        "gets its result and the gradients are read once for both, Megatron's norm unchanged to the "
        "bit (megatron_patches.seams.megatron_norm).",
    ),
    PatchTarget(
        "megatron.core.optimizer",
        "get_megatron_optimizer",
        "megatron_patches.seams.wrappers.get_optimizer_wrapper",
        "The one call that sees both the model chunks and the optimizer: parameter names come from here.",
        # Megatron-LM's training.py imports it by name: patch that binding too when it came first.
        aliases=("megatron.training.training",),
    ),
    PatchTarget(
        "megatron.core.distributed.finalize_model_grads",
        "finalize_model_grads",
        "megatron_patches.seams.wrappers.finalize_model_grads_wrapper",
        "Runs before the data-parallel gradient reduction of a model without DDP bucket groups: "
        "phase=local drills and the origin pass go in here for it (DDP chunks: at start_grad_sync).",
        aliases=("megatron.core.distributed", "megatron.training.training"),
    ),
    PatchTarget(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup.check_grads",
        "megatron_patches.seams.wrappers.check_grads_wrapper",
        "Megatron's own NaN/Inf check (--check-for-nan-in-loss-and-grad, on by default) takes each "
        "bucket's local norm right before its data-parallel collective and hands a non-finite one to "
        "the RerunStateMachine, which ends the job (exit 16/17) naming no parameter. The guard names "
        "the bucket's parameters on the origin rank and owns the fault (megatron_patches.seams.bucket_norms).",
    ),
    PatchTarget(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup.start_grad_sync",
        "megatron_patches.seams.wrappers.start_grad_sync_wrapper",
        "Where each bucket group's data-parallel collective starts: during backward under "
        "--overlap-grad-reduce (interleaved pipelines through grad_sync_func), long before "
        "finalize_model_grads. With Megatron's check off (or on a step it keeps), phase=local drills "
        "and the origin flag's fused pass go in here, before the collective reads the buffer "
        "(megatron_patches.seams.grad_sync).",
    ),
    PatchTarget(
        "megatron.core.rerun_state_machine",
        "RerunStateMachine.validate_result",
        "megatron_patches.seams.wrappers.validate_result_wrapper",
        "Where Megatron's NaN/Inf checks (bucket norms in check_grads, the loss in Megatron-LM's "
        "loss function) end the job: on the steps the guard checks they are not fatal, so Megatron "
        "reruns the step in place, gives its verdict (kept for the record) and carries on; the "
        "guard decides on the step (megatron_patches.seams.rerun_machine).",
    ),
    PatchTarget(
        "megatron.core.rerun_state_machine",
        "RerunStateMachine.should_run_forward_backward",
        "megatron_patches.seams.wrappers.should_run_forward_backward_wrapper",
        "Where Megatron starts and ends its rerun of a step in place: on a checked step the guard "
        "watches that rerun's forward pass for the first non-finite module output "
        "(megatron_patches.seams.rerun_machine, forward_origin).",
    ),
    PatchTarget(
        "megatron.core.rerun_state_machine",
        "RerunStateMachine.should_checkpoint_and_exit",
        "megatron_patches.seams.megatron_lm.should_checkpoint_and_exit_wrapper",
        "Where Megatron's rerun machine decides to end the job itself (exit 16: resume from its "
        "checkpoint to disambiguate; 17: validation failed), on steps the guard does not own: the "
        "exit goes into the rollback ledger (megatron_patches.seams.megatron_lm).",
    ),
    PatchTarget(
        "megatron.core.rerun_state_machine",
        "RerunStateMachine.load_state_dict",
        "megatron_patches.seams.megatron_lm.rerun_load_wrapper",
        "Where Megatron-LM's load_checkpoint restores a rerun pending since an exit 16: one that would "
        "run again on the node and device of the first rerun only exits 16 again, at every restart; "
        "the guard leaves it undone and skips its iteration (megatron_patches.seams.megatron_lm.rollback).",
    ),
)

_TRAINING = "megatron.training.training"

TRAINING_TARGETS: tuple[PatchTarget, ...] = (
    PatchTarget(
        _TRAINING,
        "train_step",
        "megatron_patches.seams.megatron_lm.train_step_wrapper",
        "Megatron-LM's loop runs one train_step per iteration: incidents get its iteration number, "
        "batch position and, after a rollback restart, the learning rate fixed after the load.",
        required=False,
    ),
    PatchTarget(
        _TRAINING,
        "setup_model_and_optimizer",
        "megatron_patches.seams.megatron_lm.setup_model_wrapper",
        "Called once, after Megatron parsed its args and before it builds the model: safe mode on "
        "retry switches off the features the ledger lists (recovery.disable_features) here.",
        required=False,
    ),
    PatchTarget(
        _TRAINING,
        "get_optimizer_param_scheduler",
        "megatron_patches.seams.megatron_lm.scheduler_wrapper",
        "Called once, after the optimizer is built and before the checkpoint is loaded: "
        "exit-and-restart recovery reads its ledger and adjusts args (checkpoint, lr, skips) here.",
        required=False,
    ),
    PatchTarget(
        _TRAINING,
        "dummy_train_step",
        "megatron_patches.seams.megatron_lm.dummy_train_step_wrapper",
        "How Megatron-LM's loop drains an iteration in iterations_to_skip (a rollback's incident "
        "iterations): under an interleaved pipeline its iterator is a list per virtual stage, which "
        "megatron-core 0.19.2 cannot drain; each stage's iterator is drained in turn.",
        required=False,
    ),
    PatchTarget(
        "megatron.training.checkpointing",
        "save_checkpoint",
        "megatron_patches.seams.megatron_lm.save_checkpoint_wrapper",
        "Marks each Megatron-LM checkpoint healthy or not (megatron_patches.json in iter_N/), "
        "so a rollback restarts from the newest healthy one.",
        aliases=(_TRAINING,),
        required=False,
    ),
)
"""Targets in Megatron-LM's training package (a checkout only; skipped where it is absent)."""


_BRIDGE_TRAIN = "megatron.bridge.training"

BRIDGE_TARGETS: tuple[PatchTarget, ...] = (
    PatchTarget(
        f"{_BRIDGE_TRAIN}.optim",
        "get_megatron_optimizer",
        "megatron_patches.seams.wrappers.get_optimizer_wrapper",
        "Megatron-Bridge's optim.py binds megatron-core's get_megatron_optimizer by name when imported: "
        "a Bridge module imported before megatron_patches.apply keeps the unwrapped one, and the guard "
        "would learn no parameter names.",
        required=False, lazy=True,
    ),
    PatchTarget(
        f"{_BRIDGE_TRAIN}.train",
        "train_step",
        "megatron_patches.seams.megatron_bridge.train_step_wrapper",
        "Megatron-Bridge's loop runs one train_step per iteration: incidents get its iteration number "
        "and batch position; the ledger's learning rate goes back on after the checkpoint load.",
        required=False, lazy=True,
    ),
    PatchTarget(
        f"{_BRIDGE_TRAIN}.checkpointing",
        "load_checkpoint",
        "megatron_patches.seams.megatron_bridge.load_checkpoint_wrapper",
        "Megatron-Bridge loads its checkpoint once, after the optimizer and scheduler are built: a "
        "rollback restart points it at the newest certified checkpoint and scales the learning rate here.",
        required=False, lazy=True,
    ),
    PatchTarget(
        f"{_BRIDGE_TRAIN}.checkpointing",
        "save_checkpoint",
        "megatron_patches.seams.megatron_bridge.save_checkpoint_wrapper",
        "Marks each Megatron-Bridge checkpoint healthy or not (megatron_patches.json in iter_N/), as "
        "for Megatron-LM, so a rollback restarts from the newest certified one.",
        required=False, lazy=True,
    ),
)
"""Targets in Megatron-Bridge's training package, wrapped when a Bridge job imports it."""
