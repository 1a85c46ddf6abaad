"""Megatron's gradient norm for clipping, served from the guard's own checked pass.

Before clipping, Megatron's ``get_grad_norm`` reads every gradient once more, all-reduces the
sum of squares and reads it to the host. On a checked step the guard has just done all three
over the same gradients (:meth:`~megatron_patches.monitor.GradMonitor._check`), and its total
counts each element once the way Megatron's does (shared and tensor-parallel duplicate
parameters left out; from 0.19 the parameters of a separate grad-norm group such as MTP too).
So, with ``serve_norm: true`` (off by default: the guard's sum differs from Megatron's in the
last bits, and a guarded run should equal an unguarded one bit for bit), the ``get_grad_norm``
wrapper (:func:`megatron_patches.seams.wrappers.get_grad_norm_wrapper`) hands that total back instead of
recomputing it, when all of these hold, and runs Megatron's own code otherwise:

- a monitor is active and checked the gradients of this step (with ``check_interval`` > 1 the
  unchecked steps compute the norm as stock does);
- the call is on the optimizer the guard checked, the outermost one (a leaf of a chain called
  on its own gets its own stock norm);
- it is the first call since that check: a later call may come after clipping;
- the optimizer's gradients are float32. With the precision-aware optimizer and
  ``--main-grads-dtype bf16`` Megatron sums bf16 gradients with a kernel of its own: on the CPU
  fallback each tensor's norm is rounded to bf16 first, on a GPU TE's multi-tensor kernel keeps
  float32. The guard's per-tensor norms match neither to the bit (2e-3 relative apart on the
  CPU, measured), so there Megatron computes its own norm. Decided from the optimizer's
  config, the same on every rank;
- none of those gradients was replaced or changed in place since (tensor version counters,
  read on the host without touching the data: gradients zeroed by the guard, a skipped step's
  gradients recomputed, anything a custom loop did in between).

Every rank answers the first four alike (the check and its step are the same on all ranks),
so either every rank of Megatron's norm group leaves out its all-reduce or none does. The
fifth is rank-local: only a loop that changes some ranks' gradients between ``prepare_grads``
and ``get_grad_norm`` could split them, which no Megatron path does.

What stays stock: 0.19+'s per-group norms (``_compute_grad_norms_by_group``: MTP parameters,
read only there), ``clip_grad_norm`` (computes and clips in one call), optimizers that override
``get_grad_norm`` (the layer-wise distributed optimizer, MIMO's).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..collectives import collective_device
from .optimizer_params import current_grads, leaves, uses_decoupled_grad
from ..protocols import Guard


@dataclass(frozen=True)
class CheckedNorm:
    """The total norm of one check, with what it was computed over (weakly: no gradient is kept)."""

    optimizer: "weakref.ref"
    step: int
    total_norm: float
    entries: list
    grads: tuple
    """Weak references to the gradient tensors read, in the check's order."""
    versions: tuple
    """Their version counters at the check (bumped by every in-place change)."""


class HeldNorm:
    """One run's checked norm, held from the check until Megatron's ``get_grad_norm`` takes it.
    The seams make one per run (:class:`megatron_patches.seams.MegatronSeams`, ``held_norm``) and
    own it: the core hands the norm over through ``Seams.remember_norm``."""

    def __init__(self) -> None:
        self.checked: Optional[CheckedNorm] = None
        """The last check's norm, None once taken (or where Megatron computes its own)."""

    def remember(self, optimizer: Any, step: int, total_norm: float, entries: list, grads: list) -> None:
        """After each check (not a replay): ``total_norm`` is the world-wide norm of ``grads``, the
        gradients of ``entries`` that ``optimizer`` is about to clip."""
        if not grads_in_float32(optimizer):
            self.checked = None  # Megatron's own kernel for bf16 gradients (see the module's conditions)
            return
        self.checked = CheckedNorm(weakref.ref(optimizer), step, total_norm, entries,
                                   tuple(weakref.ref(g) for g in grads), tuple(g._version for g in grads))

    def pop(self) -> Optional[CheckedNorm]:
        """The held norm, once."""
        checked, self.checked = self.checked, None
        return checked


def take(monitor: Guard, optimizer: Any) -> Optional[Any]:
    """The checked total norm for ``optimizer.get_grad_norm()``, in the type Megatron returns
    there; None when Megatron must compute it (see the module's conditions). One call per check."""
    checked = monitor.state.seams.held_norm.pop()
    if checked is None or checked.optimizer() is not optimizer or checked.step != monitor.state.clock.step:
        return None
    now = [g for _, g in current_grads(optimizer, checked.entries) if g is not None and g.numel() > 0]
    if len(now) != len(checked.grads) or any(
            ref() is not g or g._version != version for g, ref, version in zip(now, checked.grads, checked.versions)):
        return None
    monitor.count("served_norms")
    return _as_megatron_returns(checked.total_norm, now[0].device if now else collective_device())


def grads_in_float32(optimizer: Any) -> bool:
    """Whether every leaf of ``optimizer`` steps on float32 gradients: all but a precision-aware
    leaf whose ``main_grads_dtype`` is narrower (its ``decoupled_grad`` then has that dtype)."""
    return all(getattr(leaf, "config", None) is None or not uses_decoupled_grad(leaf)
               or getattr(leaf.config, "main_grads_dtype", torch.float32) == torch.float32
               for leaf in leaves(optimizer))


def _as_megatron_returns(norm: float, device: torch.device) -> Any:
    """A float, or where megatron-core keeps the norm on the device for clipping (0.19+ with
    Transformer Engine's ``multi_tensor_scale_tensor``) a one-element float32 tensor there."""
    from megatron.core.optimizer import clip_grads

    if getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is not None:
        return torch.tensor([norm], dtype=torch.float32, device=device)
    return norm
