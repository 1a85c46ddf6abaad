"""Where a non-finite loss was born: the first module, in forward order, whose output went
non-finite (or held a value of 2^64 or more, :data:`FORWARD_EXTREME`).

When the forward pass breaks (an activation overflows, a kernel writes NaN), the loss and then
every gradient are non-finite, and the gradient check alone names the tensor nearest the output:
the output layer is blamed for a fault born anywhere. The forward pass itself says more. During
a replay of the step (:class:`~megatron_patches.recovery.InProcessRecovery`), :class:`ForwardTrace`
puts a forward hook on every module of this rank's model chunks; each hook keeps, on the device,
whether that module's output held a NaN, an Inf or an extreme value. Hooks run when a module's forward returns, so a
child reports before its parent, and the first flagged call is the innermost module where the
fault appeared. One host read at the end; nothing runs on a training step.

Across ranks the earliest pipeline stage wins (later stages only receive what it sent); within
a stage, the earliest call. Every rank of a stage runs the same modules in the same order, so
the k-th module call of a step is the same event on each of them, even where the calls exchange
data: under expert parallelism a NaN born in one rank's expert reaches the other ranks through
the combine all-to-all and shows there only at the output of the MoE layer, a later call than
the expert's, so the expert's rank is named, not the ranks it reached. Ranks whose first
flagged call is the same one are listed together. An expert's module carries its global index
(``expert``).

The ``phase=forward`` drill (``nan:step=S,phase=forward,module=NAME``) is attached here too:
a forward hook on the named module that corrupts its output in step S (:func:`attach_drills`).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Optional

import torch

from . import collectives, naming
from .collectives import BoundedGroup, PeerLost, gather_to_zero
from . import faults
from .protocols import Guard

log = logging.getLogger("megatron_patches")

FORWARD_EXTREME = 2.0 ** 64
"""An activation of this magnitude is a fault, not a training's: the replay's trace flags it like
a NaN. A flipped high exponent bit turns an activation of about 1 into about 2^64 to 2^127, still
finite; the next layer norm squares it into an Inf, and a trace that looked for non-finite outputs
only named that layer norm instead of the module that produced the huge value."""


def _floating(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a module's output (a tensor, or nested tuples/lists/dicts)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _floating(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _floating(item)]
    return []


def _replace_first(value: Any, spec: Any) -> tuple[Any, bool]:
    """``value`` with its first floating tensor replaced by a corrupted copy (autograd intact)."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.numel() == 0:
            return value, False
        copy = value.clone()
        faults.corrupt(spec, copy)
        return copy, True
    if isinstance(value, (tuple, list)):
        items, done = list(value), False
        for i, item in enumerate(items):
            items[i], done = _replace_first(item, spec)
            if done:
                break
        return (tuple(items) if isinstance(value, tuple) else items), done
    return value, False


def attach_drills(monitor: Guard, model_chunks: list, ps: Any) -> int:
    """Hook each ``phase=forward``, ``phase=backward`` and ``phase=input`` drill onto the modules its pattern names on this rank;
    returns how many modules were hooked. A pattern matching nothing here is fine (another
    pipeline stage may hold that module). ``ps``: megatron-core's parallel state (``Seams.parallel_state``)."""
    specs = monitor.state.drills.forward_specs()
    if not specs:
        return 0
    hooked = 0
    for name, _, module in naming.name_modules(model_chunks, ps):
        if module in monitor.state.drills.hooked:  # the same model registered again (another optimizer of it)
            continue
        monitor.state.drills.hooked.add(module)
        for index, spec in specs:
            if fnmatch.fnmatchcase(name, spec.module):
                if spec.phase == "input":
                    module.register_forward_pre_hook(_input_drill_hook(monitor, index, spec, name))
                else:
                    module.register_forward_hook(_drill_hook(monitor, index, spec, name))
                hooked += 1
    return hooked


def _input_drill_hook(monitor: Guard, index: int, spec: Any, name: str):
    """Corrupts a copy of the integer ids ``name`` is fed (its first argument) while the drill is due,
    in every micro-batch of the step. Each time, a warning says how many ids it changed and, where the
    module has ``num_embeddings``, how many it left outside ``[0, num_embeddings)``: the drill's own
    account of whether any check could see it (a valid id is valid data), which the campaign reads."""
    def hook(module, args):
        ids = args[0] if args else None
        if not (torch.is_tensor(ids) and not ids.is_floating_point() and ids.numel()):
            return None
        step = monitor.state.clock.upcoming()
        if not monitor.state.drills.forward_due(index, step, collectives.rank(), name):
            return None
        copy = ids.clone()
        faults.corrupt(spec, copy)
        monitor.count("injected")
        size = getattr(module, "num_embeddings", None)
        outside = (f"; {int(((copy < 0) | (copy >= size)).sum())} outside the vocabulary [0, {size})"
                   if isinstance(size, int) else "")
        log.warning("step %d: drill %r fired into the token ids fed to %s on rank %d: changed %d of %d%s", step,
                    spec.text, name, collectives.rank(), int((copy != ids).sum()), ids.numel(), outside)
        return (copy, *args[1:])
    return hook


def _drill_hook(monitor: Guard, index: int, spec: Any, name: str):
    def hook(module, args, output):
        if not monitor.state.drills.forward_due(index, monitor.state.clock.upcoming(), collectives.rank(), name):
            return None
        if spec.phase == "backward":  # the gradient that will flow into this output
            target = next((t for t in _floating(output) if t.requires_grad), None)
            if target is not None:
                target.register_hook(lambda grad: _replace_first(grad, spec)[0])
                monitor.count("injected")
            return None
        corrupted, done = _replace_first(output, spec)
        if done:
            monitor.count("injected")
        return corrupted if done else None
    return hook


def _broken(tensor: torch.Tensor) -> torch.Tensor:
    """On the device: whether ``tensor`` holds a NaN, an Inf or a value of :data:`FORWARD_EXTREME` or more."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    return (~torch.isfinite(tensor)).any() | (tensor.detach().abs().amax() >= FORWARD_EXTREME)


class ForwardTrace:
    """While entered, every module of ``model_chunks`` reports whether its output was finite and,
    once backward reaches that output, whether the gradient flowing into it was (both kept on the
    device, read once by :meth:`first` / :meth:`first_backward`)."""

    def __init__(self, model_chunks: list, ps: Any):
        """``ps``: megatron-core's parallel state, for the modules' names (``Seams.parallel_state``)."""
        self._named = naming.name_modules(model_chunks, ps)
        self._expert_place = naming.expert_place(model_chunks, ps)
        self._handles: list = []
        self._calls: list[tuple[str, int]] = []
        self._flags: list[torch.Tensor] = []
        self._grad_calls: list[tuple[str, int]] = []
        self._grad_flags: list[torch.Tensor] = []

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
                    bad = torch.stack([_broken(t) for t in tensors]).any()
                self._calls.append((name, stage))
                self._flags.append(bad)
                target = next((t for t in tensors if t.requires_grad), None) if torch.is_grad_enabled() else None
                if target is not None:
                    target.register_hook(self._grad_hook(name, stage))
            return None
        return hook

    def _grad_hook(self, name: str, stage: int):
        def hook(grad):
            with torch.no_grad():
                self._grad_calls.append((name, stage))
                self._grad_flags.append((~torch.isfinite(grad)).any())
            return None
        return hook

    def first(self) -> Optional[dict]:
        """This rank's first module (in call order) whose output was non-finite, or None."""
        return self._first(self._calls, self._flags)

    def first_backward(self) -> Optional[dict]:
        """This rank's first module, in the order backward reached the outputs, whose output's
        gradient was non-finite, or None."""
        return self._first(self._grad_calls, self._grad_flags)

    def _first(self, calls: list, device_flags: list) -> Optional[dict]:
        if not device_flags:
            return None
        flags = torch.stack([f.to("cpu") for f in device_flags]).tolist()  # one host read per list
        for call, ((name, stage), bad) in enumerate(zip(calls, flags)):
            if bad:
                found = {"module": name, "stage": stage, "call": call}
                ep_rank, per_rank = self._expert_place
                expert = naming.expert_of(name, ep_rank, per_rank) if per_rank else None
                if expert is not None:
                    found["expert"] = {"global": expert[0], "local": expert[1], "ep": ep_rank}
                return found
        return None


def gather_origin(trace: ForwardTrace, peers: BoundedGroup) -> tuple[Optional[dict], Optional[dict]]:
    """Every rank's first non-finite module, on rank 0: the forward and the backward origin
    (:func:`origins_from`), each None when not found (and both None on the other ranks). Call on
    every rank."""
    mine = {"rank": collectives.rank(), "forward": trace.first(), "backward": trace.first_backward()}
    try:
        everyone = gather_to_zero(mine, peers)
    except PeerLost as error:
        log.warning("forward origin not located: %s", error)
        return None, None
    return origins_from(everyone) if everyone else (None, None)


def origins_from(everyone: list) -> tuple[Optional[dict], Optional[dict]]:
    """(forward origin, backward origin) from every rank's ``{"rank", "forward", "backward"}``
    (:meth:`ForwardTrace.first` and :meth:`ForwardTrace.first_backward`). A fault born in the
    forward pass makes every later gradient non-finite, so the backward origin is given only
    when the forward pass stayed finite everywhere: the fault was born in backward."""
    forward = earliest([{"rank": p["rank"], "first": p.get("forward")} for p in everyone])
    if forward is not None:
        return forward, None
    return None, earliest([{"rank": p["rank"], "first": p.get("backward")} for p in everyone], backward=True)


def earliest(everyone: list, backward: bool = False) -> Optional[dict]:
    """``{"module", "layer", "ranks"}`` (and ``expert`` for a routed expert's module) of the
    first non-finite module call among ``[{"rank", "first"}]`` (each rank's
    :meth:`ForwardTrace.first`): earliest pipeline stage, then earliest call; None if none.
    ``backward``: the parts are :meth:`ForwardTrace.first_backward`'s, and backward runs the
    stages from the last one back, so the latest stage comes first."""
    found = [part for part in everyone if part["first"] is not None]
    if not found:
        return None
    sign = -1 if backward else 1
    first = min(found, key=lambda part: (sign * part["first"]["stage"], part["first"].get("call", 0),
                                         part["rank"]))["first"]
    same = [part for part in found if (part["first"]["stage"], part["first"]["module"], part["first"].get("call"))
            == (first["stage"], first["module"], first.get("call"))]
    origin = {"module": first["module"], "layer": naming.layer_of(first["module"]),
              "ranks": sorted(part["rank"] for part in same)}
    experts = sorted((part["first"]["expert"] for part in same if part["first"].get("expert")),
                     key=lambda expert: expert["global"])
    experts = [e for i, e in enumerate(experts) if e not in experts[:i]]
    if experts:  # the same local module on several EP ranks is a different expert on each
        origin["expert"] = experts[0] if len(experts) == 1 else experts
    return origin

