"""Megatron's RerunStateMachine on the steps the guard checks: its rerun and verdict, not its exit.

Megatron validates results through ``RerunStateMachine.validate_result``: each gradient bucket's
local norm right before its data-parallel collective (``check_grads``) and, in Megatron-LM's loss
function, the loss; each once for NaN and once for Inf, with ``fatal=True``. With
``--rerun-mode validate_results`` (the default) a rejected result makes every rank rerun the
step in place (RNG state and data iterator restored), and the rank that rejected it compares the
rerun's result with the first one: different -> "possible transient error", exit 17; the same ->
a checkpoint and exit 16. Either way the job ends and the guard never sees the step.

On a step the guard checks, those NaN/Inf validations go to the machine with ``fatal=False`` and
nothing else changed. Megatron still reruns the step in place and compares; then, the failure
being non-fatal, it continues in the same process instead of exiting. This rank watches the
comparison (Megatron's own, or its default for 0-dim tensors) and keeps the verdict for the
incident record (``megatron_rerun``); a rejected loss is recorded too (``loss_nonfinite``). The
guard's check before clipping then decides on the step as usual: after a transient fault the
rank whose bucket was non-finite is still an origin, so the step is skipped; after a
reproducible one the gradients are non-finite again (skipped, rolled back when it persists).

Megatron's rerun in place is also the guard's replay: while it runs on a checked step, a
:class:`~megatron_patches.forward_origin.ForwardTrace` watches every module of this rank's
chunks (:func:`after_should_run`, on ``should_run_forward_backward``), so when the loss went
non-finite the record names the first module whose output did (``forward_origin``), as an
in-process replay does in the harness. Nothing is hooked outside that rerun. The guard's callbacks
hear of it (``before_rerun``, ``after_rerun`` with this rank's verdict): Megatron-LM's session turns
the rerun's per-sample losses into a replay verdict (:mod:`.megatron_lm.replay`).

With ``--rerun-mode disabled`` Megatron would raise on the rejecting rank alone; there a
rejected result is kept from the machine and the guard decides on every rank. Other validations (unexpectedly large values) and the determinism-stats mode pass through
unchanged, as does everything on the steps the guard does not check.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import bucket_norms
from .. import forward_origin
from ..findings import RankReport
from ..incident_text import module_text
from ..protocols import Guard
from ..run_state import tell
from .parallel import parallel_state

log = logging.getLogger("megatron_patches")

BUCKET_NORM, LOSS = "bucket norm", "loss"
TRANSIENT, REPRODUCIBLE = "transient", "reproducible"


@dataclass
class _Rejected:
    """The validation Megatron rejected on this rank in one step (it asks for a rerun for the first)."""

    step: int
    check: str
    message: str
    mode: str
    verdict: Optional[str] = None
    """Megatron's, once its rerun in place compared the two results."""


class RerunWatch:
    """One run's view of Megatron's reruns in place (held by its monitor as ``monitor.state.rerun``):
    what this rank rejected, and its trace of the rerun, until the incident takes them."""

    def __init__(self) -> None:
        self.rejected: Optional[_Rejected] = None
        self.loss_rejected_at: Optional[int] = None
        self.trace: Optional[tuple[int, Any]] = None
        """(step, ForwardTrace) while Megatron reruns a checked step in place."""
        self.first: Optional[tuple[int, dict]] = None
        """(step, ``{"forward": ..., "backward": ...}``): this rank's first non-finite module
        (``{"module", "stage"}``) in each pass of that rerun."""

    def note(self, step: int, check: str, message: str, mode: str) -> None:
        if check == LOSS:
            self.loss_rejected_at = step
        if self.rejected is None or self.rejected.step != step:
            self.rejected = _Rejected(step, check, message, mode)

    def part(self, step: int) -> Optional[dict]:
        """This rank's share of the incident of ``step`` (the loss it rejected, Megatron's verdict),
        taken once: a step reached again later starts with nothing."""
        out: dict[str, Any] = {}
        if self.loss_rejected_at == step:
            out["loss_nonfinite"] = True
        if self.first is not None and self.first[0] == step:
            out["forward_first"] = self.first[1]["forward"]
            out["backward_first"] = self.first[1]["backward"]
        if self.rejected is not None and self.rejected.step == step:
            out["rerun"] = {"mode": self.rejected.mode, "check": self.rejected.check,
                            "message": self.rejected.message, "verdict": self.rejected.verdict}
        self.rejected, self.loss_rejected_at, self.first = None, None, None
        return out or None


def validate(monitor: Guard, machine: Any, arguments: dict, call: Callable[..., Any]) -> Any:
    """``validate_result`` with ``arguments`` (bound, without self); ``call(**changes)`` runs
    Megatron's with some arguments changed."""
    rejection = arguments["rejection_func"]
    if rejection not in (torch.isnan, torch.isinf) or not bucket_norms.checks_nonfinite(monitor):
        return call()
    check = BUCKET_NORM if bucket_norms.inside_guarded_check() else LOSS
    mode = str(getattr(machine.get_mode(), "value", machine.get_mode()))
    step, result, message = monitor.state.clock.upcoming(), arguments["result"], arguments["message"]
    if check == BUCKET_NORM:
        bucket_norms.takes_over(result, rejection)  # names the bucket's parameters, raises the origin flag
    if mode == "disabled":
        # Megatron would only test the result and raise on this rank: test it here, once.
        if _rejects(rejection, result, check):
            monitor.state.rerun.note(step, check, message, mode)
        return None
    if mode != "validate_results":
        return call()

    def rejected(value: Any) -> bool:  # Megatron asks only on the initial run, before any rejection
        verdict = _rejects(rejection, value, check)
        if verdict:
            monitor.state.rerun.note(step, check, message, mode)
        return verdict

    compare = arguments.get("comparison_func") or _default_comparison()
    tolerance = arguments.get("tolerance", 0.0)

    def compared(initial: Any, rerun: Any) -> float:  # the rerun in place reached the rejected call
        difference = compare(initial, rerun)
        rejected = monitor.state.rerun.rejected
        if rejected is not None and rejected.step == step:
            rejected.verdict = TRANSIENT if difference > tolerance else REPRODUCIBLE
            log.warning("step %d: Megatron's rerun of the step in place: the %s is %s (%s); the job goes "
                        "on in this process, the guard's check before clipping decides", step, check,
                        "finite now: a transient fault" if rejected.verdict == TRANSIENT
                        else "the same again: reproducible", message)
        return difference

    return call(fatal=False, rejection_func=rejected, comparison_func=compared)


def _rejects(rejection: Callable, result: Any, check: str) -> bool:
    """Megatron's own test of the result. A finite bucket norm is known from the bucket check's
    one host read (shared by its NaN and Inf tests); only a non-finite one is read again."""
    if check == BUCKET_NORM and not bucket_norms.takes_over(result, rejection):
        return False
    return bool(rejection(result))


def _default_comparison() -> Callable[[Any, Any], float]:
    """The comparison Megatron uses when the caller gives none (0-dim float tensors)."""
    from megatron.core import rerun_state_machine

    return rerun_state_machine._compare_floats


def after_should_run(monitor: Guard, machine: Any, again: bool) -> None:
    """After each ``should_run_forward_backward`` (every rank calls it, and the decision to rerun
    is already agreed there): a rerun in place of a checked step starts -> watch the forward pass;
    it ended -> keep this rank's first non-finite module for the incident."""
    watch = monitor.state.rerun
    in_place = again and _state_name(machine) == "RERUNNING_IN_PLACE"
    if watch.trace is not None and not in_place:
        step, trace = watch.trace
        watch.trace = None
        trace.__exit__(None, None, None)
        first = {"forward": trace.first(), "backward": trace.first_backward()}  # host reads, once per rerun
        watch.first = (step, first) if any(first.values()) else None
        rejected = watch.rejected
        tell(monitor.state, "after_rerun", step, rejected.verdict if rejected is not None and rejected.step == step
             else None)
    elif watch.trace is None and in_place and bucket_norms.checks_nonfinite(monitor):
        monitor.state.routing.restart()  # the rerun routes the step's tokens again
        trace = forward_origin.ForwardTrace(monitor.state.model_chunks.modules(), parallel_state())
        watch.trace = (monitor.state.clock.upcoming(), trace.__enter__())
        tell(monitor.state, "before_rerun", watch.trace[0])


def _state_name(machine: Any) -> str:
    state = getattr(machine, "state", None)
    return str(getattr(state, "name", state))


def record_fields(everyone: list[RankReport], extra: dict) -> tuple[dict, str]:
    """Rank 0: the record fields from every report's ``megatron`` (its rank's :meth:`RerunWatch.part`),
    and what the message adds to the one made with ``extra`` (the fields found so far)."""
    shares = [(report.rank, report.megatron) for report in everyone if report.megatron]
    fields: dict[str, Any] = {}
    note = ""
    loss_ranks = [rank for rank, share in shares if share.get("loss_nonfinite")]
    if loss_ranks:
        fields["loss_nonfinite"] = True
        note += f"; the loss was non-finite on rank(s) {loss_ranks}: the fault entered in the forward pass"
        if not extra.get("all_gradients_nonfinite"):  # that message says it already
            note += ", so the parameter named first is not the suspect"
    reruns = [{"rank": rank, **share["rerun"]} for rank, share in shares if share.get("rerun")]
    if reruns:
        verdicts = [r["verdict"] for r in reruns]
        verdict = (REPRODUCIBLE if REPRODUCIBLE in verdicts else TRANSIENT if TRANSIENT in verdicts else None)
        fields["megatron_rerun"] = {"mode": reruns[0]["mode"], "verdict": verdict, "by_rank": reruns}
        if verdict is not None:
            note += f"; Megatron's rerun of the step in place found it {verdict}"
    forward, backward = forward_origin.origins_from(
        [{"rank": rank, "forward": share.get("forward_first"), "backward": share.get("backward_first")}
         for rank, share in shares])
    for key, origin, what in (("forward_origin", forward, "the forward pass first went non-finite at the output of"),
                              ("backward_origin", backward, "backward first carried a non-finite gradient into")):
        if origin is not None:
            fields[key] = origin
            note += f"; in the rerun {what} {module_text(origin)} on rank(s) {origin['ranks']}"
    return fields, note
