"""The respond stage: the findings of the ranks an incident reached to rank 0, which grades the
incident and assembles it, then the :class:`~megatron_patches.decisions.Decision` back to every rank.

Both collectives are bounded (``response.peer_timeout_s``): a peer lost between them raises
:class:`~megatron_patches.collectives.PeerLost` on the ranks still alive, and
:func:`exit_peer_lost` ends them. Nothing may escape on rank 0 between the gather and the
broadcast (the other ranks wait in the broadcast): a failure there becomes a critical stop.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, NoReturn, Optional

from . import naming
from .check import Verdict
from .collectives import broadcast_from_zero, gather_reports
from .decisions import EXIT_PEER_LOST, Action, Decision, GradePolicy, Severity
from .findings import assemble, first_name, local_findings, origins_of, reports
from .incidents import Incident, finite_or_none

log = logging.getLogger("megatron_patches")


class Responder:
    """Rank 0's grading (:class:`GradePolicy`) and the collectives around it."""

    def __init__(self, config: Any, detectors: list, peers: Any,
                 megatron_fields: Callable[[list, dict], tuple[dict, str]]):
        """``peers``: the guard's :class:`~megatron_patches.collectives.BoundedGroup`; no rank waits
        on another longer than ``response.peer_timeout_s`` while they agree. ``megatron_fields``:
        the record's fields from Megatron's loss check and rerun (``Seams.record_fields``)."""
        self.config = config
        self.megatron_fields = megatron_fields
        self.detectors = detectors
        self.peers = peers
        self.policy = GradePolicy(config)

    def agree(self, verdict: Verdict, action: Action, part: dict, batch_info: dict, rollbacks: int,
              can_replay: bool, cause: Optional[Any] = None) -> tuple[Decision, Optional[Incident]]:
        """Call on every rank with this rank's ``part`` (findings, batch, ranks, pre_reduction,
        origin, injected, megatron, moe_routing). Rank 0 takes in the parts of the ranks that
        report (:func:`~megatron_patches.findings.reports`), not every rank's. Returns the decision
        everywhere and the incident on rank 0.
        ``cause``: what made the step an incident beside the gradients (a
        :class:`~megatron_patches.seams.loss_scale.ScalerEvent`), the same on every rank."""
        ctx = verdict.ctx
        decision, incident = None, None
        everyone, checked = gather_reports(part, reports(part), self.peers, tally=len(ctx.entries))
        if everyone:  # rank 0
            try:
                decision, incident = self._decide(verdict, everyone, checked, action, batch_info, rollbacks,
                                                  can_replay, cause)
            except Exception as error:
                log.exception("step %d: the guard failed while deciding on an incident", ctx.step)
                decision = Decision(Severity.CRITICAL, Action.STOP, "the guard failed while deciding on "
                                    f"this incident ({type(error).__name__}: {error}); stopped rather "
                                    "than apply gradients nobody judged", ctx.step)
                incident = _fallback_incident(verdict, decision)
        return broadcast_from_zero(decision, self.peers), incident

    def _decide(self, verdict: Verdict, everyone: list, checked: int, action: Action, batch_info: dict,
                rollbacks: int, can_replay: bool, cause: Optional[Any]) -> tuple[Decision, Incident]:
        """Rank 0: grade the incident from every rank's findings and assemble it."""
        ctx = verdict.ctx
        origins, replicas = origins_of(everyone)
        if action == Action.SKIP_STEP:
            decision = self.policy.grade(ctx.step, replicas, rollbacks, can_replay, origins=tuple(origins))
        else:  # direct clip_grad_norm callers: nothing to skip, gradients are zeroed
            decision = Decision(Severity.WARNING, action, "checked in clip_grad_norm", ctx.step, origins=tuple(origins))
        extra: dict[str, Any] = {}
        for detector in self.detectors:
            extra.update(detector.extra(ctx, verdict.reduced[detector.name]))
        incident = assemble(ctx, everyone, verdict.kinds, extra, decision, batch_info, self.megatron_fields, checked,
                            cause)
        log.warning("step %d: %s: %s -> %s (%s)", ctx.step, decision.severity, incident.message,
                    decision.action, decision.reason)
        return decision, incident


    def replay_verdict(self, verdict: Verdict) -> dict:
        """A replay's check: ``{"flagged", "first"}`` on every rank, ``first`` the parameter nearest
        the output among every rank's findings (no incident, no grading)."""
        first = None
        if verdict.flagged:
            mine = local_findings(self.config, self.detectors, verdict.ctx, verdict.maxabs, verdict.total_over)
            parts, _ = gather_reports(mine, bool(mine), self.peers)
            first = first_name([f for part in parts for f in part])
        return broadcast_from_zero({"flagged": verdict.flagged, "first": first}, self.peers)


def _fallback_incident(verdict: Verdict, decision: Decision) -> Optional[Incident]:
    """The incident the guard failed to assemble: what is known for sure."""
    try:
        return Incident(step=decision.step, decision=decision, kind="guard_error", kinds=("guard_error",),
                        message=decision.reason, params=(), first=None, ranks_affected=(),
                        world=naming.world_layout(), total_norm=finite_or_none(verdict.ctx.total_norm))
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
