"""The respond stage: the reports of the ranks an incident reached to rank 0, which decides on it
(:func:`decide`: grades it and assembles the incident, a pure function of the reports, the facts
of the step and the policy), then the :class:`~megatron_patches.decisions.Decision` back to every rank.

Both collectives are bounded (``response.peer_timeout_s``): a peer lost between them raises
:class:`~megatron_patches.collectives.PeerLost` on the ranks still alive, and
:func:`exit_peer_lost` ends them. Nothing may escape on rank 0 between the gather and the
broadcast (the other ranks wait in the broadcast): a failure there becomes a critical stop.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NoReturn, Optional

from . import naming
from .cause import Device, Signs, growth_of
from .check import Verdict
from .collectives import BoundedGroup, broadcast_from_zero, gather_reports
from .config import Config
from .decisions import EXIT_PEER_LOST, Action, Decision, GradePolicy, Severity
from .detectors import Detector
from .findings import RankReport, RecordFields, assemble, local_findings, origins_of, replica_of
from .incidents import Incident, finite_or_none, first_of

log = logging.getLogger("megatron_patches")


@dataclass(frozen=True)
class StepFacts:
    """What rank 0 knows of an incident's step beside the ranks' reports."""

    checked: int
    """Gradients checked on every rank together (summed in the gather)."""
    world: Mapping[str, int]
    """The job's layout (:func:`~megatron_patches.naming.world_layout`)."""
    action: Action = Action.SKIP_STEP
    """What the hook does with a flagged step: skip it, or zero the gradients of a direct
    ``clip_grad_norm`` call (then nothing is graded: a warning)."""
    rollbacks: int = 0
    """Rollbacks the run has had so far (the retry budget)."""
    can_replay: bool = False
    """Whether the executor replays a step itself, so the decision may ask for it."""
    batch_info: Mapping[str, Any] = field(default_factory=dict)
    """Fields of the step's batch, the same on every rank (Megatron-LM's iteration, ...)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The fields the detectors add to the record (their view on rank 0)."""
    cause: Optional[Any] = None
    """What made the step an incident beside its gradients (a
    :class:`~megatron_patches.seams.loss_scale.ScalerEvent`), the same on every rank."""
    clean_before: int = 1
    """Checked steps of the job that came out clean before this one (0: the fault is there from the start)."""
    norm_trail: tuple = ()
    """The gradient norms of the last clean checked steps, oldest first (:func:`~megatron_patches.cause.growth_of`)."""


def signs_of(step: int, reports: list[RankReport], origins: list[int], replicas: int, facts: StepFacts,
             kinds: tuple, total_norm: Optional[float], check_interval: int) -> Signs:
    """What the reports and the facts of the step say of the incident's cause (:class:`~megatron_patches.cause.Signs`)."""
    def ranks_with(prefix: str) -> tuple:
        return tuple(sorted({r.rank for r in reports for f in r.held if any(x.startswith(prefix) for x in f.reasons)}))
    held = [f for r in reports for f in r.held if any(x.startswith("held:") for x in f.reasons)]
    outputs = ranks_with("activation:")
    growth = growth_of(facts.norm_trail, total_norm)
    if outputs:
        growth += (f"a module's output stood far above its history on rank(s) {list(outputs)}",)
    replica = replica_of(reports)
    suspects_at = origins or sorted({r.rank for r in reports if r.findings})
    devices: tuple = ()
    if suspects_at and len({replica.get(r, r) for r in suspects_at}) == 1:
        seen = {r.rank: next(iter(r.held + r.pre_reduction + r.jumped + r.findings), None) for r in reports}
        devices = tuple(Device(rank, seen[rank].host, seen[rank].device) for rank in suspects_at
                        if seen.get(rank) is not None)
    return Signs(step=step, first_checked=facts.clean_before == 0,
                 held_ranks=ranks_with("held:"), held_extreme_only=bool(held) and not any(f.nan or f.inf for f in held),
                 off_ranks=ranks_with("off:"), altered_ranks=ranks_with("altered:"), fed_ranks=ranks_with("input:"), origin_ranks=tuple(origins),
                 origin_replicas=replicas, replicas=max(1, facts.world.get("dp", 1) * facts.world.get("cp", 1)),
                 replicas_disagree="consistency" in kinds, checked_every_step=check_interval == 1,
                 growth=growth, suspects=devices)


def no_megatron_fields(everyone: list[RankReport], extra: dict) -> tuple[dict, str]:
    """``record_fields`` where nothing of Megatron's loss check or rerun is known."""
    return {}, ""


def decide(verdict: Verdict, reports: list[RankReport], policy: GradePolicy, facts: StepFacts,
           record_fields: RecordFields = no_megatron_fields) -> tuple[Decision, Incident]:
    """Rank 0's decision on an incident and the incident itself, from the ``reports`` of the ranks
    that reported (in rank order) and ``facts``. No collective, no file, no clock but the
    record's time: what it reads is its arguments; what it changes is ``policy``'s count of recent
    incidents (the grading history is the policy's). ``record_fields``: ``Seams.record_fields``."""
    ctx = verdict.ctx
    origins, replicas = origins_of(reports)
    if facts.action == Action.SKIP_STEP:
        decision = policy.grade(ctx.step, replicas, facts.rollbacks, facts.can_replay, origins=tuple(origins))
    else:  # direct clip_grad_norm callers: nothing to skip, gradients are zeroed
        decision = Decision(Severity.WARNING, facts.action, "checked in clip_grad_norm", ctx.step,
                            origins=tuple(origins))
    signs = signs_of(ctx.step, reports, origins, replicas, facts, tuple(verdict.kinds), ctx.total_norm,
                     policy.check_interval)
    decision = replace(decision, signs=signs)
    incident = assemble(ctx, reports, decision, kinds=verdict.kinds, extra=dict(facts.extra),
                        batch_info=facts.batch_info, record_fields=record_fields, checked=facts.checked,
                        world=facts.world, cause=facts.cause)
    return decision, incident


class Responder:
    """The respond stage on every rank: the bounded gather, rank 0's :func:`decide`, the bounded
    broadcast. Holds rank 0's grading (:class:`GradePolicy`)."""

    def __init__(self, config: Config, detectors: list[Detector], peers: BoundedGroup,
                 megatron_fields: RecordFields, parallel_state: Callable[[], Any]):
        """``peers``: the guard's :class:`~megatron_patches.collectives.BoundedGroup`; no rank waits
        on another longer than ``response.peer_timeout_s`` while they agree. ``megatron_fields``:
        the record's fields from Megatron's loss check and rerun (``Seams.record_fields``);
        ``parallel_state``: where the job's layout is read (``Seams.parallel_state``)."""
        self.config = config
        self.megatron_fields = megatron_fields
        self.parallel_state = parallel_state
        self.detectors = detectors
        self.peers = peers
        self.policy = GradePolicy(config)

    def agree(self, verdict: Verdict, report: RankReport, *, action: Action, batch_info: Mapping[str, Any],
              rollbacks: int, can_replay: bool, cause: Optional[Any] = None, clean_before: int = 1,
              norm_trail: tuple = ()) -> tuple[Decision, Optional[Incident]]:
        """Call on every rank with this rank's ``report``. Rank 0 takes in the reports of the ranks
        that report (:meth:`~megatron_patches.findings.RankReport.reports`), not every rank's, and
        decides (:func:`decide`). Returns the decision everywhere and the incident on rank 0.
        ``cause``: what made the step an incident beside the gradients, the same on every rank."""
        ctx = verdict.ctx
        decision, incident = None, None
        everyone, checked = gather_reports(report, report.reports(), self.peers, tally=len(ctx.entries))
        if everyone:  # rank 0
            try:
                world = naming.world_layout(self.parallel_state())
                facts = StepFacts(checked=checked, world=world, action=action, rollbacks=rollbacks,
                                  can_replay=can_replay, batch_info=batch_info, extra=self._extra(verdict),
                                  cause=cause, clean_before=clean_before, norm_trail=norm_trail)
                decision, incident = decide(verdict, everyone, self.policy, facts, self.megatron_fields)
                log.warning("step %d: %s: %s -> %s (%s)", ctx.step, decision.severity, incident.message,
                            decision.action, decision.reason)
            except Exception as error:
                log.exception("step %d: the guard failed while deciding on an incident", ctx.step)
                decision = Decision(Severity.CRITICAL, Action.STOP, "the guard failed while deciding on "
                                    f"this incident ({type(error).__name__}: {error}); stopped rather "
                                    "than apply gradients nobody judged", ctx.step)
                incident = _fallback_incident(verdict, decision, self.parallel_state)
        return broadcast_from_zero(decision, self.peers), incident

    def _extra(self, verdict: Verdict) -> dict[str, Any]:
        """The fields the detectors add to the record (rank 0)."""
        extra: dict[str, Any] = {}
        for detector in self.detectors:
            extra.update(detector.extra(verdict.ctx, verdict.reduced[detector.name]))
        return extra

    def replay_verdict(self, verdict: Verdict) -> dict:
        """A replay's check: ``{"flagged", "first"}`` on every rank, ``first`` the parameter named
        first (:func:`~megatron_patches.incidents.first_of`) among every rank's findings (no
        incident, no grading)."""
        first = None
        if verdict.flagged:
            mine = local_findings(self.config, self.detectors, verdict.ctx, verdict.maxabs, verdict.total_over,
                                  naming.rank_info(self.parallel_state()))
            parts, _ = gather_reports(mine, bool(mine), self.peers)
            found = first_of(f for part in parts for f in part)
            first = found.name if found is not None else None
        return broadcast_from_zero({"flagged": verdict.flagged, "first": first}, self.peers)


def _fallback_incident(verdict: Verdict, decision: Decision, parallel_state: Callable[[], Any]) -> Optional[Incident]:
    """The incident the guard failed to assemble: what is known for sure."""
    try:
        return Incident(step=decision.step, decision=decision, kind="guard_error", kinds=("guard_error",),
                        message=decision.reason, params=(), first=None, ranks_affected=(),
                        world=naming.world_layout(parallel_state()), total_norm=finite_or_none(verdict.ctx.total_norm))
    except Exception:
        log.exception("step %d: no record could be made of this incident", decision.step)
        return None


def exit_peer_lost(step: int, error: Exception, timeout_s: float, close: Callable[[], None],
                   code: int = EXIT_PEER_LOST) -> NoReturn:
    """A peer died or went silent during an incident's decision: nothing can be agreed on any
    more. Flush what this rank holds (``close``), then end the process at once: a barrier,
    Megatron's teardown or an exit callback would wait for the lost peer (under nccl up to the
    process group's timeout), so none of them runs. ``code``: ``response.exit_codes.peer_lost``."""
    log.error("step %d: a peer was lost while the ranks agreed on an incident (%s); exiting with code %d "
              "within response.peer_timeout_s=%gs; restart the job (nothing was decided, no ledger written)",
              step, error, code, timeout_s)
    try:
        close()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
