"""Megatron's seams: everything that knows Megatron's classes, apart from the core pipeline.

The core (:mod:`megatron_patches.monitor` and its stages: check, findings, respond, publish,
recovery) never imports this package (``tests/units/test_units_imports.py``); it is handed
:class:`MegatronSeams` when the monitor is made (:func:`build_monitor`).

- the patch targets (:mod:`.targets`, by dotted string per megatron-core line), their installer
  (:mod:`.patching`, :mod:`.marks`) and the wrappers themselves (:mod:`.wrappers`);
- DDP: the pre-reduction origin (:mod:`.origin`) at each bucket group's ``start_grad_sync``
  (:mod:`.grad_sync`) or from Megatron's own per-bucket norms (:mod:`.bucket_norms`);
- the rerun state machine (:mod:`.rerun_machine`), optimizer pairing (:mod:`.optimizer_params`,
  :mod:`.model_chunks`), the norm served to ``get_grad_norm`` (:mod:`.served_norm`), the norm
  kernel's call shared with Megatron's clipping norm (:mod:`.megatron_norm`), the fp16
  loss scaler (:mod:`.loss_scale`), the parallel layout and megatron-core's version (:mod:`.parallel`);
- the loops: Megatron-LM's ``pretrain_gpt.py`` (:mod:`.megatron_lm`, with :mod:`.megatron_lm.rollback`
  applying the ledger at a restart and :mod:`.megatron_lm.checkpoints` marking checkpoints),
  MindSpeed (:mod:`.mindspeed`) and MindSpeed-LLM (:mod:`.mindspeed.llm`).

Importing this package changes nothing; the wrappers are installed through :mod:`.patching`.
"""

from __future__ import annotations

from typing import Any, Optional

from ..config import Config
from ..monitor import GradMonitor
from . import grad_sync, megatron_norm, mindspeed, optimizer_params, origin, parallel, rerun_machine, rng, served_norm, wrappers
from .loss_scale import LossScaleWatch
from .model_chunks import ModelChunks


class MegatronSeams:
    """The :class:`~megatron_patches.protocols.Seams` the core runs on: Megatron's functions and
    the per-run watches, each made fresh for the monitor that asks."""

    build_entries = staticmethod(optimizer_params.build_entries)
    current_grads = staticmethod(optimizer_params.current_grads)
    audit_refusal = staticmethod(optimizer_params.audit_refusal)
    covers = staticmethod(grad_sync.covers)
    reduced_in_backward = staticmethod(grad_sync.reduced_in_backward)
    named_grads = staticmethod(origin.named_grads)
    unchecked = staticmethod(wrappers.unchecked)
    undo_prepare_on_skip = staticmethod(mindspeed.undo_prepare_on_skip)
    record_fields = staticmethod(rerun_machine.record_fields)
    rng_state = staticmethod(rng.rng_state)
    parallel_state = staticmethod(parallel.parallel_state)
    megatron_core_version = staticmethod(parallel.megatron_core_version_or_none)

    def __init__(self) -> None:
        self.kernel_calls = megatron_norm.KernelCalls()
        """Megatron's norm-kernel calls made at the check, until its own call takes them."""
        self.held_norm = served_norm.HeldNorm()
        """The check's total norm, until Megatron's ``get_grad_norm`` takes it (``serve_norm``)."""

    def remember_norm(self, optimizer: Any, step: int, total_norm: float, entries: list, grads: list) -> None:
        self.held_norm.remember(optimizer, step, total_norm, entries, grads)

    def megatron_norms(self, optimizer: Any) -> list:
        return self.kernel_calls.prepare(optimizer)

    def model_chunks(self) -> ModelChunks:
        return ModelChunks()

    def rerun_watch(self) -> rerun_machine.RerunWatch:
        return rerun_machine.RerunWatch()

    def origin_watch(self, enabled: bool, peak_ratio: Optional[float] = None) -> origin.OriginWatch:
        return origin.OriginWatch(enabled, peak_ratio)

    def loss_scale_watch(self, settings: Any) -> LossScaleWatch:
        return LossScaleWatch(settings)


def build_monitor(config: Config) -> GradMonitor:
    """The guard for one run on Megatron (what ``import megatron_patches.apply`` makes)."""
    return GradMonitor(config, MegatronSeams())
