"""Drills and the origin flag at each DDP bucket group's own start of its data-parallel reduction.

Megatron DDP reduces gradients per bucket group, in ``_ParamAndGradBucketGroup.start_grad_sync``.
Without ``--overlap-grad-reduce`` that runs inside ``finalize_model_grads``; with it, during
backward, as soon as the group's gradients are ready (interleaved pipelines reach it through
``config.grad_sync_func``, and ``--overlap-param-gather`` changes nothing on this side). By the
time ``finalize_model_grads`` runs, an overlapped group's collective has long been launched:
a drill there corrupts a buffer the reduction no longer reads, and an origin read there sees
reduced data (the owner of a NaN shard looks like a second origin).

So for models made of DDP chunks the guard acts per group, right before the wrapped
``start_grad_sync`` (before its collective, and before ``gradient_scaling_factor`` scales the
buffer), on the groups Megatron's own check does not cover for the guard (its check off, or a
step :func:`megatron_patches.seams.bucket_norms.owns` leaves alone; where it owns the step,
:mod:`~megatron_patches.seams.bucket_norms` does the same from Megatron's norms):

- ``phase=local`` drills due now are fired into this group's gradients;
- on a step the guard checks, with more than one data-parallel replica, one fused
  ``torch._foreach_norm`` over the group's gradients feeds this rank's origin flag
  (:meth:`megatron_patches.seams.origin.OriginWatch.before_group`); nothing is read on the host.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from . import bucket_norms
from ..collectives import fully_sharded, rank
from .marks import already_hooked

def start_grad_sync(monitor: Any, group: Any, call: Callable[[], Any]) -> Any:
    """Run ``start_grad_sync`` for ``group`` after this rank's part before the collective."""
    # From core 0.16 a group's second start in its first batch is a no-op (``is_first_batch``,
    # absent before): nothing to do then, the collective is already under way.
    if not (getattr(group, "is_first_batch", False) and group.grad_reduce_handle is not None):
        ddp_config = group.ddp_config
        if not bucket_norms.owns(monitor, ddp_config.check_for_nan_in_grad):
            _before_collective(monitor, group)
    return call()


def _before_collective(monitor: Any, group: Any) -> None:
    step = monitor.state.clock.upcoming()
    drills = bool(monitor.state.drills) and bool(monitor.state.drills.due(step, "local", rank()))
    origin = step % monitor.state.config.check_interval == 0 and monitor.state.origin.watching()
    if not (drills or origin):  # one replica, a step not checked: nothing is read
        return
    params = monitor.state.model_chunks.group_params(group)
    _wait_for_replayed_grads(params)
    if drills:
        bucket_norms.fire_local_drills(monitor, params)
    if origin:
        monitor.state.origin.before_group(group, params, step)


def _wait_for_replayed_grads(params: list) -> None:
    """A CUDA-graph replay may still be accumulating into these gradients (megatron-core 0.19+
    marks such parameters with an event, which its own start_grad_sync waits for too)."""
    events = {id(e): e for p in params if (e := getattr(p, "_cudagraph_wgrad_ready_event", None)) is not None}
    if events:
        stream = torch.cuda.current_stream()
        for event in events.values():
            stream.wait_event(event)


def covers(model_chunks: list) -> bool:
    """Whether every chunk is Megatron DDP reducing through bucket groups whose
    ``start_grad_sync`` calls the hooks: then drills and the origin pass go in per group, and
    ``finalize_model_grads`` leaves them alone. Anything else (a plain module, a custom
    data-parallel wrapper) keeps the check at ``finalize_model_grads``."""
    if not model_chunks:
        return False
    for chunk in model_chunks:
        groups = getattr(chunk, "bucket_groups", None)
        experts = getattr(chunk, "expert_parallel_bucket_groups", None)
        if not isinstance(groups, list) or not isinstance(experts, list):
            return False
        if not all(_hooked(type(group)) for group in groups + experts):
            return False
    return True


def reduced_in_backward(model_chunks: list) -> bool:
    """Whether a chunk is fully sharded (torch FSDP2, Megatron-FSDP: its parameters are DTensors):
    each gradient is reduce-scattered by the FSDP hooks during backward, so by
    ``finalize_model_grads`` no rank holds its own unreduced gradient any more."""
    return fully_sharded(p for chunk in model_chunks or () for p in chunk.parameters())


def _hooked(cls: type) -> bool:
    return already_hooked(inspect.getattr_static(cls, "start_grad_sync", None))
