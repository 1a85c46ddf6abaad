"""Megatron's own pre-reduction check, with the guard owning what it finds.

With ``--check-for-nan-in-loss-and-grad`` (Megatron-LM's default), DDP's
``_ParamAndGradBucketGroup.check_grads`` takes each bucket's local gradient norm right before the
bucket's data-parallel collective and hands it to the RerunStateMachine with ``fatal=True``. A
one-off NaN there makes Megatron rerun the step, call it a possible transient error and exit 17 on
every rank (16 when it reproduces; a RuntimeError on the faulty rank with ``--rerun-mode
disabled``), with no parameter named.

While a bucket group's check runs on a step the guard checks, each NaN/Inf validation Megatron
asks for is looked at first, on Megatron's own norm (no extra read). A non-finite one makes this
rank name the non-finite parameters of the group (or, where every gradient is finite in a
float32-range buffer, those whose sum of squares overflowed) and raise its origin flag; the validation goes
to the rerun machine as a non-fatal one (:mod:`~megatron_patches.seams.rerun_machine`: Megatron reruns
the step in place, gives its verdict and carries on; with ``--rerun-mode disabled`` it is kept
from the machine). The guard's check before clipping then skips the step (or rolls back when the
fault persists), grading by origin, and the record carries this rank's pre-reduction findings.

On steps the guard does not check (``check_interval``) Megatron's check acts as without the guard.
"""

from __future__ import annotations

import contextvars
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .. import collectives, naming
from ..incidents import ParamFinding
from .model_chunks import ModelChunks
from .optimizer_params import model_grad
from ..protocols import Guard
from .parallel import parallel_state

log = logging.getLogger("megatron_patches")


@dataclass
class _Scope:
    """One ``check_grads`` call the guard owns."""

    norms: list[float] = field(default_factory=list)
    """Megatron's non-finite bucket norms seen in this call."""
    last: Optional[tuple[Any, bool]] = None
    """(norm tensor, finite): the NaN and the Inf validation of a bucket share one host read."""
    finite: list = field(default_factory=list)
    """Megatron's finite bucket norms seen in this call (device tensors, read no further)."""


_scope: contextvars.ContextVar[Optional[_Scope]] = contextvars.ContextVar("megatron_patches_bucket_check", default=None)


def owns(monitor: Guard, check_for_nan_or_inf: bool) -> bool:
    """Whether the guard takes this check over: Megatron's NaN check on, a step the guard checks."""
    return bool(check_for_nan_or_inf) and checks_nonfinite(monitor)


def checks_nonfinite(monitor: Guard) -> bool:
    """Whether the guard checks the step whose gradients are being made for NaN/Inf."""
    config = monitor.state.config
    return config.detectors.nonfinite.enabled and monitor.state.clock.upcoming() % config.check_interval == 0


def check_grads(monitor: Guard, group: Any, call: Callable[[], Any]) -> Any:
    """Run Megatron's ``check_grads`` for ``group`` with its NaN/Inf verdicts routed to the guard.
    Megatron's bucket norms stand in for the origin pass's norms, but a crest factor per gradient
    needs a pass of our own: with the peak detector on it runs here, after the drills."""
    _inject(monitor, group)
    if monitor.state.origin.peak_ratio is not None and monitor.state.origin.watching():
        monitor.state.origin.before_group(group, monitor.state.model_chunks.group_params(group), monitor.state.clock.upcoming())
    scope = _Scope()
    token = _scope.set(scope)
    try:
        result = call()
    finally:
        _scope.reset(token)
    monitor.state.origin.note_bucket_check()
    if not scope.norms and scope.finite and monitor.state.origin.peak_ratio is None and monitor.state.origin.watching():
        # No pass of the guard's own over this group's gradients on such a step: its bucket norms,
        # against their running means, are what can name this rank as a finite fault's origin.
        monitor.state.origin.note_bucket_norms(group, scope.finite, monitor.state.clock.upcoming())
    if scope.norms:
        if rerunning():  # Megatron's rerun of the step in place: noted in the first run already
            log.info("step %d: non-finite local gradient again in Megatron's rerun of the step", monitor.state.clock.upcoming())
            return result
        findings = nonfinite_params(monitor.state.model_chunks, group) or overflowed_params(monitor.state.model_chunks, group)
        if not findings:  # an fp16 bucket's norm overflowed; every gradient in it is finite
            log.info("step %d: Megatron's bucket norm is %s but every local gradient in the bucket group is finite "
                     "(the norm overflowed in the buffer's dtype); not an origin", monitor.state.clock.upcoming(),
                     ", ".join(f"{n:g}" for n in scope.norms))
            return result
        monitor.state.origin.note(findings)
        ranks = naming.rank_info(parallel_state())
        names = ", ".join(_counted(f) for f in findings) or "none found"
        what = "non-finite" if any(f.nan or f.inf for f in findings) else "overflowing (finite, squares past float32)"
        log.warning("step %d: before the data-parallel reduction: " + what + " local gradient on rank %d "
                    "(tp %d, pp %d, dp %d), bucket norm(s) %s: %s; not fatal to Megatron's RerunStateMachine, "
                    "the guard's check before clipping decides",
                    monitor.state.clock.upcoming(), ranks["global"], ranks["tp"], ranks["pp"], ranks["dp"],
                    ", ".join(f"{n:g}" for n in scope.norms), names)
    return result


def inside_guarded_check() -> bool:
    """Inside a ``check_grads`` the guard owns."""
    return _scope.get() is not None


def takes_over(result: Any, rejection_func: Callable) -> bool:
    """For a NaN/Inf validation of a bucket norm inside a check the guard owns: True when the norm
    is not finite (this rank's parameters are then named once the check returns)."""
    scope = _scope.get()
    if scope is None or rejection_func not in (torch.isnan, torch.isinf) or not isinstance(result, torch.Tensor):
        return False
    if scope.last is not None and scope.last[0] is result:
        finite = scope.last[1]
    else:
        # One element (a bucket's norm): one host read of it, as Megatron's own test made.
        finite = (math.isfinite(float(result)) if math.prod(result.shape) == 1
                  else bool(torch.isfinite(result).all()))
        scope.last = (result, finite)
        if not finite:
            scope.norms.append(float(result.float().max() if result.numel() > 1 else result))
        else:
            scope.finite.append(result)
    return not finite


def nonfinite_params(chunks: ModelChunks, group: Any) -> list[ParamFinding]:
    """This rank's parameters in ``group`` whose local gradient holds NaN/Inf (the fault path)."""
    def judge(grad: torch.Tensor) -> Optional[dict]:
        nan, inf = int(torch.isnan(grad).sum()), int(torch.isinf(grad).sum())
        return {"nan": nan, "inf": inf, "overflow": 0,
                "reasons": (["nan"] if nan else []) + (["inf"] if inf else [])} if nan or inf else None

    return _local_findings(chunks, group, judge)


OVERFLOW_ABS = 2.0 ** 64
"""A gradient element this large has a square past float32's range on its own."""


def overflowed_params(chunks: ModelChunks, group: Any) -> list[ParamFinding]:
    """This rank's parameters in ``group`` whose finite local gradient has a sum of squares past
    float32's range: in an fp32 or bf16 buffer (float32's range) no trained gradient comes near it
    (an element of 2^64 or more, a bit flipped into the exponent), so the rank is an origin; an
    fp16 buffer's norm overflows on ordinary values, which the loss scaler handles (none named)."""
    def judge(grad: torch.Tensor) -> Optional[dict]:
        if grad.dtype == torch.float16 or torch.isfinite(grad.float().pow(2).sum()):
            return None
        return {"nan": 0, "inf": 0, "overflow": int((grad.abs() >= OVERFLOW_ABS).sum()), "reasons": ["overflow"]}

    return _local_findings(chunks, group, judge)


def _local_findings(chunks: ModelChunks, group: Any, judge: Callable[[torch.Tensor], Optional[dict]]) -> list:
    """A finding for each parameter of ``group`` whose local gradient ``judge`` faults (its counts
    and reasons), named and located on this rank."""
    params = chunks.group_params(group)
    infos = names_of(chunks, params)
    ranks, host, device = naming.rank_info(parallel_state()), naming.host(), naming.device_name()
    findings = []
    for param in params:
        grad = model_grad(param)
        found = judge(grad) if grad is not None else None
        if found is not None:
            findings.append(ParamFinding.located(infos.get(id(param)), ranks, shape=list(param.shape), norm=None,
                                                 host=host, device=device, **found))
    return findings


def _counted(finding: ParamFinding) -> str:
    if finding.nan or finding.inf:
        return f"{finding.name} ({'nan' if finding.nan else 'inf'} {finding.nan or finding.inf})"
    return f"{finding.name} ({finding.overflow} element(s) of 2^64 or more)"


def _inject(monitor: Guard, group: Any) -> None:
    """``phase=local`` drills due now, into this group's gradients before Megatron takes its norm.
    Under ``--overlap-grad-reduce`` this runs during backward, the last moment before the
    collective; without it ``finalize_model_grads`` came first and has fired them already."""
    if monitor.state.drills:
        fire_local_drills(monitor, monitor.state.model_chunks.group_params(group))


def fire_local_drills(monitor: Guard, params: list) -> None:
    """Fire the ``phase=local`` drills due now whose targets are among ``params`` (one bucket group)."""
    infos = names_of(monitor.state.model_chunks, params)
    grads = [(infos[id(p)].name, infos[id(p)].order, g) for p in params
             if (g := model_grad(p)) is not None and id(p) in infos]
    fired = monitor.state.drills.apply(monitor.state.clock.upcoming(), "local", collectives.rank(), grads, part=True)
    monitor.count("injected", len(fired))


def names_of(model_chunks: ModelChunks, params: list) -> dict:
    """Names from the model chunks the optimizer was built for (the chunks holding ``params``)."""
    wanted = {id(p) for p in params}
    for chunks in model_chunks.known():
        infos = naming.name_parameters(chunks, parallel_state())
        if wanted & infos.keys():
            return infos
    return {}


def rerunning() -> bool:
    """Whether Megatron is rerunning the current step in place (its findings were noted already)."""
    try:
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
    except ImportError:
        return False
    return getattr(get_rerun_state_machine(), "state", None) == RerunState.RERUNNING_IN_PLACE
