"""The guard's per-tensor gradient norms from the kernel call of Megatron's own clipping norm.

Megatron reads every gradient once per step for its clipping norm: ``get_grad_norm_fp32`` calls
its multi-tensor L2 kernel (``clip_grads.l2_norm_impl`` through ``clip_grads.multi_tensor_applier``)
over the norm's gradients (``get_grads_for_grad_norm``, before 0.19 ``get_main_grads_for_grad_norm``:
shared and tensor-parallel duplicate parameters left out). The guard's check comes first (right
after ``prepare_grads``), so it makes that very call itself, over the list Megatron is about to pass
(:func:`norm_lists`), asking the kernel for each tensor's norm as well, and keeps the call's result.
When Megatron's call comes with the same tensors in the same order and none changed since
(version counters, read on the host), it gets the kept result instead of a second read
(:func:`multi_tensor_applier_wrapper`).

Megatron's norm stays the same bits as in an unguarded run: it is the same kernel on the same
tensors, and its total does not depend on the per-tensor request. Apex's and Transformer Engine's
``multi_tensor_l2norm`` write the per-tensor sums beside the block sums the total is reduced
from; megatron-core's local fallback (no Apex, no TE: the CPU, and GPUs without either) ignores the
request and takes each tensor's ``torch.norm`` on its way to the total, and those are read as it
runs (:class:`_TensorNorms`).

Where the list is not what Megatron passes (a loop that computes its norm otherwise, ``clip_grad``
0, an optimizer that overrides the norm, gradients changed in between), Megatron's call runs as
stock: never a different norm, at worst the guard's read was an extra one. Gradients of the
guard's entries outside these lists (duplicates, shared copies) get a pass of the guard's own
(:meth:`megatron_patches.check.CheckStage._local`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode



def key(tensor: torch.Tensor) -> tuple:
    """Which memory a gradient is: two view objects of the same bytes share the key."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype


@dataclass
class _Call:
    """One kernel call the guard made for Megatron, waiting to be served once."""

    versions: tuple
    grads: tuple
    """Weak references: nothing is kept alive by waiting here."""
    result: Any


class KernelCalls:
    """This run's calls of Megatron's norm kernel made at the check, served to Megatron's own."""

    def __init__(self) -> None:
        self.waiting: list[_Call] = []

    def prepare(self, optimizer: Any) -> list:
        """Call the kernel over each list Megatron's clipping norm will read for ``optimizer``;
        returns ``[(that list of gradients, their norms as one vector on the device)]``, one per
        call that gave per-tensor norms. Empty where Megatron's kernel or lists cannot be had: the
        check then reads the gradients itself. No Python loop over the tensors touches torch: the
        kernel's per-tensor vector is kept whole (the local fallback's norms, one ``stack``)."""
        self.waiting = []
        kernel = _kernel()
        lists = norm_lists(optimizer) if kernel is not None else []
        out: list = []
        for grads in lists:
            applier, l2 = kernel
            found = _TensorNorms(grads)
            with found:
                result = applier(l2, _noop_flag(grads[0].device), [grads], True)
            per_tensor = result[1] if isinstance(result, tuple) and torch.is_tensor(result[1]) else None
            if per_tensor is not None and per_tensor.numel() == len(grads):
                out.append((grads, per_tensor))
            elif len(found.norms) == len(grads):
                out.append((grads, torch.stack(found.norms)))
            else:  # a kernel that gave neither: its total is still Megatron's, the check reads these itself
                pass
            self.waiting.append(_Call(tuple(g._version for g in grads), tuple(weakref.ref(g) for g in grads), result))
        return out

    def serve(self, grads: list) -> Optional[Any]:
        """The kept result for Megatron's call over ``grads``, or None (Megatron computes it)."""
        keys = None
        for call in self.waiting:
            if len(call.grads) != len(grads) or call.versions != tuple(g._version for g in grads):
                continue
            held = [ref() for ref in call.grads]
            if any(h is None for h in held):
                continue
            # The very tensor objects the check passed (the usual case) are the same memory; any
            # other objects are compared by what memory they view (the held ones' now: their
            # versions are unchanged since the check).
            if not all(h is g for h, g in zip(held, grads)):
                keys = keys or tuple(key(g) for g in grads)
                if tuple(key(h) for h in held) != keys:
                    continue
            self.waiting.remove(call)
            return call.result
        return None


class _TensorNorms(TorchFunctionMode):
    """While entered, keeps the ``torch.norm`` of each of ``grads`` that the code inside takes
    (megatron-core's local kernel fallback takes one per tensor, in order)."""

    def __init__(self, grads: list):
        super().__init__()
        self._wanted = {id(g) for g in grads}
        self.norms: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.norm and args and id(args[0]) in self._wanted:
            self.norms.append(out)
        return out


def _kernel() -> Optional[tuple]:
    """(multi_tensor_applier, l2_norm_impl) as megatron-core's clip_grads calls them, unwrapped."""
    try:
        from megatron.core.optimizer import clip_grads
    except ImportError:
        return None
    applier, l2 = getattr(clip_grads, "multi_tensor_applier", None), getattr(clip_grads, "l2_norm_impl", None)
    if applier is None or l2 is None:
        return None
    return getattr(applier, "__wrapped__", applier), l2


def _grads_for_norm(leaf: Any) -> list:
    getter = getattr(leaf, "get_grads_for_grad_norm", None) or getattr(leaf, "get_main_grads_for_grad_norm", None)
    return list(getter()) if getter is not None else []


def norm_lists(optimizer: Any) -> list[list]:
    """The gradient lists Megatron's step hands its norm kernel for ``optimizer``, in order.
    A chain's step always takes its norm: one list of all leaves where they share one grad-stats
    group, else one per leaf; a leaf's own step only when it clips. Empty lists are left out (no
    kernel call for them). Any surprise: no list (Megatron computes its own)."""
    try:
        chain = getattr(optimizer, "chained_optimizers", None)
        if chain is None:
            lists = [_grads_for_norm(optimizer)] if _clips(optimizer) else []
        elif len(chain) > 1 and chain_is_shared(optimizer):
            lists = [[g for leaf in chain for g in _grads_for_norm(leaf)]]
        else:
            lists = [_grads_for_norm(leaf) for leaf in chain]
    except Exception:  # an optimizer of another shape: nothing predicted, nothing changed
        return []
    return [[_local(g) for g in grads] for grads in lists if grads and all(torch.is_tensor(g) for g in grads)]


def chain_is_shared(optimizer: Any) -> bool:
    shared = getattr(optimizer, "grads_states_parallel_group_is_shared", None)
    return bool(shared()) if shared is not None else False


def _clips(leaf: Any) -> bool:
    return getattr(getattr(leaf, "config", None), "clip_grad", 0) > 0


def _local(grad: torch.Tensor) -> torch.Tensor:
    """What ``get_grad_norm_fp32`` reads of a gradient (a DTensor's local shard)."""
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


_NOOP: dict = {}
"""Per device: the zero flag the multi-tensor kernel takes (Megatron makes one per call). The
l2norm kernels only read it (the scaling kernels are those that set it), so one is kept."""


def _noop_flag(device: torch.device) -> torch.Tensor:
    flag = _NOOP.get(device)
    if flag is None:
        flag = _NOOP[device] = torch.zeros(1, dtype=torch.int, device=device)
    return flag
