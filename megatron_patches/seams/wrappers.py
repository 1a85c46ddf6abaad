"""The calls both ways in go through: runtime wrappers (``import megatron_patches.apply``)
and the decorators the source patch adds to Megatron's optimizer (``make patch``).

One implementation, two ways in: the wrappers below and the decorators call the same
functions, which hand over to the active :class:`~megatron_patches.monitor.GradMonitor`.
With no monitor active every hook passes straight through.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Any, Callable, Optional

from . import bucket_norms, grad_sync, rerun_machine, served_norm, start_line
from .. import forward_origin
from ..monitor import GradMonitor
from .mindspeed import undo_prepare_on_skip
from .parallel import parallel_state

_monitor: Optional[GradMonitor] = None
"""The one pointer to the run: the active monitor holds everything else the run keeps (its
drills, model chunks, Megatron's rerun verdicts, the loop integration's session)."""
_inside_check = contextvars.ContextVar("megatron_patches_inside_check", default=False)
_inside_update = contextvars.ContextVar("megatron_patches_inside_update", default=False)


@functools.lru_cache(maxsize=None)
def _signature(function: Callable) -> inspect.Signature:
    """Signatures of the wrapped functions, computed once (finalize runs every step)."""
    return inspect.signature(function)


def set_monitor(monitor: Optional[GradMonitor]) -> None:
    """Make ``monitor`` the one the hooks call (None: pass through)."""
    global _monitor
    _monitor = monitor


def get_monitor() -> Optional[GradMonitor]:
    return _monitor


def register_model(optimizer: Any, model_chunks: list) -> None:
    """Tell the active guard which model an optimizer belongs to (names for incident records).
    Done automatically for optimizers made by ``get_megatron_optimizer``; custom loops that
    build optimizers otherwise call this once, after the guard is installed. With no guard
    active there is nothing to tell."""
    if _monitor is None:
        return
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    _monitor.state.model_chunks.remember(optimizer, chunks)
    if _monitor.state.drills.forward_specs():
        forward_origin.attach_drills(_monitor, chunks, parallel_state())
    _monitor.state.routing.attach(chunks, parallel_state())  # after the drills: a drilled router is seen as broken (MoE routers, if any)
    for detector in _monitor.state.detectors:  # after the drills too: the token range check sees drilled ids
        detector.attach(chunks, parallel_state())


@contextlib.contextmanager
def unchecked():
    """Within it, ``prepare_grads`` runs as Megatron's own: the guard's replay calls it and then
    checks the recomputed gradients itself."""
    token = _inside_check.set(True)
    try:
        yield
    finally:
        _inside_check.reset(token)


def _checked_prepare(optimizer: Any, call: Callable[[], bool]) -> bool:
    # A ChainedOptimizer's prepare_grads calls each leaf's: only the outermost call checks,
    # so a chain costs one collective per step, not one per leaf.
    if _monitor is None or _inside_check.get():
        return call()
    token = _inside_check.set(True)
    try:
        found_inf = bool(call())
    finally:
        _inside_check.reset(token)
    skip = _monitor.after_prepare_grads(optimizer, found_inf)
    if skip:  # step() returns now: undo what prepare_grads began (MindSpeed --reuse-fp32-param)
        undo_prepare_on_skip(optimizer)
    return skip


def prepare_grads_wrapper(wrapped, instance, args, kwargs) -> bool:
    """wrapt wrapper for every ``prepare_grads``: True means 'skip this step'."""
    return _checked_prepare(instance, lambda: wrapped(*args, **kwargs))


def step_with_ready_grads_wrapper(wrapped, instance, args, kwargs) -> bool:
    """wrapt wrapper for every ``step_with_ready_grads``: after the outermost one (a chain steps its
    leaves inside its own) the guard hears that the update was applied."""
    if _monitor is None or _inside_update.get():
        return wrapped(*args, **kwargs)
    token = _inside_update.set(True)
    try:
        success = wrapped(*args, **kwargs)
    finally:
        _inside_update.reset(token)
    _monitor.after_update(instance)
    return success


def clip_grad_norm_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``MegatronOptimizer.clip_grad_norm``: checks callers that clip
    without going through ``prepare_grads`` first; bad gradients are zeroed before clipping."""
    if _monitor is not None and not _inside_check.get():
        _monitor.before_direct_clip(instance)
    return wrapped(*args, **kwargs)


def get_grad_norm_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``get_grad_norm``: right after the guard checked these gradients, the
    total norm of its own pass; Megatron's computation otherwise (:mod:`megatron_patches.seams.served_norm`)."""
    if _monitor is not None:
        norm = served_norm.take(_monitor, instance)
        if norm is not None:
            return norm
    return wrapped(*args, **kwargs)


def multi_tensor_applier_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``clip_grads.multi_tensor_applier``: the L2 kernel call of Megatron's
    clipping norm gets the result of the same call the guard's check made over the same, unchanged
    gradients (:mod:`megatron_patches.seams.megatron_norm`); every other call runs as stock."""
    calls = getattr(_monitor.state.seams, "kernel_calls", None) if _monitor is not None else None
    if calls is not None and len(args) >= 3 and not kwargs:
        from megatron.core.optimizer import clip_grads

        op, _, lists = args[:3]
        if op is clip_grads.l2_norm_impl and len(lists) == 1:
            _monitor.count("norm_kernel_calls")
            served = calls.serve(lists[0]) if calls.waiting else None
            if served is not None:
                _monitor.count("shared_norm_reads")
                return served
    return wrapped(*args, **kwargs)


def get_optimizer_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``get_megatron_optimizer``: remembers the model chunks."""
    bound = _signature(wrapped).bind(*args, **kwargs)
    optimizer = wrapped(*args, **kwargs)
    register_model(optimizer, bound.arguments["model_chunks"])
    start_line.say()
    return optimizer


def finalize_model_grads_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``finalize_model_grads``: runs just before the data-parallel reduction."""
    if _monitor is not None:
        bound = _signature(wrapped).bind(*args, **kwargs)
        _monitor.before_grad_reduction(bound.arguments["model"])
    return wrapped(*args, **kwargs)


def _bind(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind a method call's arguments on the plain function (one cached signature per method,
    not one per bound instance)."""
    function = getattr(wrapped, "__func__", None)
    if function is None:
        return _signature(wrapped).bind(*args, **kwargs)
    return _signature(function).bind(instance, *args, **kwargs)


def check_grads_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for DDP's per-bucket ``check_grads`` (Megatron's own NaN/Inf check, right
    before the bucket's data-parallel collective): the guard owns the non-finite buckets."""
    if _monitor is None:
        return wrapped(*args, **kwargs)
    if not bucket_norms.owns(_monitor, _bind(wrapped, instance, args, kwargs).arguments["check_for_nan_or_inf"]):
        return wrapped(*args, **kwargs)
    return bucket_norms.check_grads(_monitor, instance, lambda: wrapped(*args, **kwargs))


def start_grad_sync_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for DDP's per-bucket-group ``start_grad_sync`` (the start of its data-parallel
    collective; during backward under ``--overlap-grad-reduce``): drills and the origin pass go in
    first where Megatron's own check does not run for the guard (:mod:`megatron_patches.seams.grad_sync`)."""
    if _monitor is None:
        return wrapped(*args, **kwargs)
    return grad_sync.start_grad_sync(_monitor, instance, lambda: wrapped(*args, **kwargs))


def validate_result_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``RerunStateMachine.validate_result``: on the steps the guard checks,
    NaN/Inf validations (bucket norms, the loss) are not fatal; Megatron's verdict is kept
    (:mod:`megatron_patches.seams.rerun_machine`). Everything else passes through."""
    if _monitor is None:
        return wrapped(*args, **kwargs)
    arguments = dict(_bind(wrapped, instance, args, kwargs).arguments)
    arguments.pop("self", None)
    return rerun_machine.validate(_monitor, instance, arguments,
                                   lambda **changes: wrapped(**{**arguments, **changes}))


def should_run_forward_backward_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``RerunStateMachine.should_run_forward_backward``: while Megatron reruns a
    checked step in place, the guard watches the forward pass (:mod:`megatron_patches.seams.rerun_machine`)."""
    again = wrapped(*args, **kwargs)
    if _monitor is not None:
        rerun_machine.after_should_run(_monitor, instance, again)
    return again


# --- decorators used by the source patch (patches/*/0002-optimizer-hooks.patch) -----------


def checked_prepare_grads(method: Callable) -> Callable:
    """Decorator for ``prepare_grads`` in Megatron's optimizer source: same checks as the runtime patch."""

    @functools.wraps(method)
    def prepare_grads(self, *args, **kwargs):
        return _checked_prepare(self, lambda: method(self, *args, **kwargs))

    prepare_grads.__megatron_patches__ = True
    return prepare_grads


def checked_clip_grad_norm(method: Callable) -> Callable:
    """Decorator for ``clip_grad_norm`` in Megatron's optimizer source."""

    @functools.wraps(method)
    def clip_grad_norm(self, *args, **kwargs):
        return clip_grad_norm_wrapper(functools.partial(method, self), self, args, kwargs)

    clip_grad_norm.__megatron_patches__ = True
    return clip_grad_norm


def save_checkpoint_wrapper(session: Callable[[Any], Any], first: str) -> Callable:
    """The ``save_checkpoint`` wrapper of a training loop (Megatron-LM's, Megatron-Bridge's): once
    the save returned, ``session(monitor).after_save(<first>, model, non_persistent)``, where
    ``first`` names the argument the loop's save takes first (``iteration`` for Megatron-LM,
    ``state`` for Bridge, which reads its iteration from it). With no monitor active, the save alone."""

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        monitor = get_monitor()
        if monitor is not None:
            bound = _signature(wrapped).bind(*args, **kwargs)
            session(monitor).after_save(bound.arguments[first], bound.arguments["model"],
                                        bool(bound.arguments.get("non_persistent_ckpt", False)))
        return result

    wrapper.__name__ = wrapper.__qualname__ = "save_checkpoint_wrapper"
    wrapper.__doc__ = f"``save_checkpoint({first}, model, ...)``: the healthy marker once the save returned."
    return wrapper
