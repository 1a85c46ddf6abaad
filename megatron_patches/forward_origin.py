"""Where a non-finite loss was born: the first module, in forward order, whose output went
non-finite.

When the forward pass breaks (an activation overflows, a kernel writes NaN), the loss and then
every gradient are non-finite, and the gradient check alone names the tensor nearest the output:
the output layer is blamed for a fault born anywhere. The forward pass itself says more. During
a replay of the step (:class:`~megatron_patches.recovery.InProcessRecovery`), :class:`ForwardTrace`
puts a forward hook on every module of this rank's model chunks; each hook keeps, on the device,
whether that module's output held a NaN or Inf. Hooks run when a module's forward returns, so a
child reports before its parent, and the first flagged call is the innermost module where the
fault appeared. One host read at the end; nothing runs on a training step.

Across ranks the earliest pipeline stage wins (later stages only receive what it sent); ranks of
that stage whose first flagged module is the same one are listed together.

The ``phase=forward`` drill (``nan:step=S,phase=forward,module=NAME``) is attached here too:
a forward hook on the named module that corrupts its output in step S (:func:`attach_drills`).
"""

from __future__ import annotations

import fnmatch
import logging
import weakref
from typing import Any, Optional

import torch

from . import collectives, inject, locate
from .collectives import PeerLost, gather_to_zero
from .inject import _corrupt
from .protocols import Guard

log = logging.getLogger("megatron_patches")

_drilled: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # modules given their drill hooks


def _floating(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, or nested tuples/lists/dicts)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _floating(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _floating(item)]
    return []


def _replace_first(value: Any, kind: str, factor: float) -> tuple[Any, bool]:
    """``value`` with its first floating tensor replaced by a corrupted copy (autograd intact)."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.numel() == 0:
            return value, False
        copy = value.clone()
        with torch.no_grad():
            _corrupt(kind, copy, factor)
        return copy, True
    if isinstance(value, (tuple, list)):
        items, done = list(value), False
        for i, item in enumerate(items):
            items[i], done = _replace_first(item, kind, factor)
            if done:
                break
        return (tuple(items) if isinstance(value, tuple) else items), done
    return value, False


def attach_drills(monitor: Guard, model_chunks: list) -> int:
    """Hook each ``phase=forward`` drill onto the modules its pattern names on this rank;
    returns how many modules were hooked. A pattern matching nothing here is fine (another
    pipeline stage may hold that module)."""
    specs = inject.active().forward_specs()
    if not specs:
        return 0
    hooked = 0
    for name, _, module in locate.name_modules(model_chunks):
        if module in _drilled:  # the same model registered again (another optimizer of it)
            continue
        _drilled.add(module)
        for index, spec in specs:
            if fnmatch.fnmatchcase(name, spec.module):
                module.register_forward_hook(_drill_hook(monitor, index, spec, name))
                hooked += 1
    return hooked


def _drill_hook(monitor: Guard, index: int, spec: Any, name: str):
    def hook(module, args, output):
        if not inject.active().forward_due(index, monitor.upcoming_step(), monitor.rank, name):
            return None
        corrupted, done = _replace_first(output, spec.kind, spec.factor)
        if done:
            monitor.counters["injected"] += 1
        return corrupted if done else None
    return hook


class ForwardTrace:
    """While entered, every module of ``model_chunks`` reports whether its output was finite."""

    def __init__(self, model_chunks: list):
        self._named = locate.name_modules(model_chunks)
        self._handles: list = []
        self._calls: list[tuple[str, int]] = []
        self._flags: list[torch.Tensor] = []

    def __enter__(self) -> "ForwardTrace":
        for name, stage, module in self._named:
            self._handles.append(module.register_forward_hook(self._hook(name, stage)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, name: str, stage: int):
        def hook(module, args, output):
            tensors = _floating(output)
            if tensors:
                with torch.no_grad():
                    bad = torch.stack([(~torch.isfinite(t)).any() for t in tensors]).any()
                self._calls.append((name, stage))
                self._flags.append(bad)
            return None
        return hook

    def first(self) -> Optional[dict]:
        """This rank's first module (in call order) whose output was non-finite, or None."""
        if not self._flags:
            return None
        flags = torch.stack([f.to("cpu") for f in self._flags]).tolist()  # the one host read
        for (name, stage), bad in zip(self._calls, flags):
            if bad:
                return {"module": name, "stage": stage}
        return None


def gather_origin(trace: ForwardTrace, timeout_s: float) -> Optional[dict]:
    """Every rank's first non-finite module, on rank 0: ``{"module", "layer", "ranks"}`` of the
    earliest pipeline stage's, else None (and None on the other ranks). Call on every rank."""
    mine = trace.first()
    rank = collectives.rank()
    try:
        everyone = gather_to_zero({"rank": rank, "first": mine}, timeout_s)
    except PeerLost as error:
        log.warning("forward origin not located: %s", error)
        return None
    return earliest(everyone)


def earliest(everyone: list) -> Optional[dict]:
    """``{"module", "layer", "ranks"}`` of the earliest pipeline stage's first non-finite module
    among ``[{"rank", "first"}]`` (each rank's :meth:`ForwardTrace.first`), or None."""
    found = [part for part in everyone if part["first"] is not None]
    if not found:
        return None
    first = min(found, key=lambda part: (part["first"]["stage"], part["rank"]))["first"]
    ranks = sorted(part["rank"] for part in found if part["first"] == first)
    return {"module": first["module"], "layer": locate.layer_of(first["module"]), "ranks": ranks}
