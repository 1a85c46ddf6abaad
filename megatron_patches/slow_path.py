"""The slow path of a flagged step, on every rank: this rank's :class:`~megatron_patches.findings.RankReport`,
the agreement on a decision (:meth:`~megatron_patches.respond.Responder.agree`: a bounded gather,
rank 0's pure :func:`~megatron_patches.decide.decide`, a bounded broadcast), the scene, the
hand-off to the publisher and the callbacks' events. Every function takes the run's
:class:`~megatron_patches.run_state.RunState`; ending the process is left to the monitor.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from typing import Any, NoReturn, Optional

from . import collectives, naming, scene
from .check import Verdict
from .collectives import PeerLost
from .decisions import Action, Decision
from .faults import optimizer_states
from .findings import RankReport, held_findings, local_findings
from .incidents import Incident, ParamFinding
from .protocols import PreReduction
from .respond import exit_peer_lost
from .run_state import RunState, tell


def handle_incident(state: RunState, verdict: Verdict, action: Action, before: PreReduction,
                    cause: Optional[Any] = None) -> Decision:
    """Locate, agree on a decision, capture the scene and hand the incident to the publisher;
    returns the decision (identical on every rank), which the caller acts on. ``before``: what
    this rank saw before the reduction; ``cause``: the loss scaler's event that made this skipped
    step an incident."""
    rank = collectives.rank()
    report, findings = rank_report(state, verdict, before, rank)
    counters = state.counters  # this check is counted, the incident not yet
    try:
        decision, incident = state.responder.agree(
            verdict, report, action=action, batch_info=state.batch.info, rollbacks=state.rollbacks,
            can_replay=state.executor is not None and state.executor.replays, cause=cause,
            clean_before=max(0, counters["checked_steps"] - 1 - counters["incidents"]),
            norm_trail=tuple(state.norm_trail))
    except PeerLost as error:
        peer_lost(state, verdict.ctx.step, error)
    state.decision = decision
    state.counters["incidents"] += 1
    if decision.action == Action.SKIP_STEP:
        state.counters["skipped_steps"] += 1
    captured = None
    # Rank 0's scene holds the incident's summary; another rank writes one only where it reports.
    settings = state.config.scene
    if settings.enabled and decision.severity.at_least(settings.min_severity) and (rank == 0 or report.reports()):
        captured = capture_scene(state, verdict, findings, rank)  # captured now, whenever it is written
    incident = _completed(state, incident, decision, captured)
    state.last_incident = incident
    # Held for the executor's outcome where one follows: a replay's verdict, or an in-process
    # rollback's target (or the stop a recovery step escalated it to).
    in_process = decision.ends_run and state.executor is not None and state.executor.in_process
    wait = decision.replay or in_process or any(tell(state, "wants_replay", decision))
    state.publisher.hand_off(incident, captured, wait_for_outcome=wait, rank=rank)
    tell(state, "on_decision", decision, incident)
    return decision


def rank_report(state: RunState, verdict: Verdict, before: PreReduction,
                rank: int) -> tuple[RankReport, list[ParamFinding]]:
    """This rank's part of the incident, and its findings (for its scene)."""
    ctx = verdict.ctx
    own_origin = before.is_origin()
    pre_reduction = before.named(state.model_chunks) if own_origin else before.findings
    ranks = naming.rank_info(state.seams.parallel_state())
    findings = local_findings(state.config, state.detectors, ctx, verdict.maxabs, verdict.total_over, ranks)
    held = held_findings(ctx.entries, optimizer_states(state.stage.first_optimizer()), ranks) if ctx.entries else []
    held += [finding for detector in state.detectors for finding in detector.held(ctx, ranks)]
    if state.drills.kills(ctx.step, rank):  # drill: this rank is lost in mid-incident
        os.kill(os.getpid(), signal.SIGKILL)
    finite = ctx.total_norm is not None and math.isfinite(ctx.total_norm)  # the same on every rank
    jumped = before.jumped(state.model_chunks) if finite and not own_origin else []
    jumped_bucket = finite and not own_origin and not jumped and before.bucket_jumped()
    report = RankReport(
        ranks=ranks, findings=tuple(findings), pre_reduction=tuple(pre_reduction), origin=own_origin, held=tuple(held),
        jumped=tuple(jumped), jumped_bucket=jumped_bucket,
        batch=state.batch.samples, injected=tuple(state.drills.fired_at(ctx.step)),
        megatron=state.rerun.part(ctx.step),  # Megatron's loss check and rerun verdict
        moe_routing=state.routing.share(ctx.step))
    return report, findings


def _completed(state: RunState, incident: Optional[Incident], decision: Decision,
               captured: Optional[tuple]) -> Optional[Incident]:
    """Rank 0's incident with where its scene went (before the freeze) and, for an
    exit-and-restart rollback, the ledger its outcome goes to."""
    if incident is not None and captured is not None:
        incident = dataclasses.replace(incident, scene=os.path.dirname(captured[0]))
    ledger = state.executor.ledger_path if state.executor is not None else None
    if incident is not None and ledger is not None and decision.action == Action.ROLLBACK:
        incident = dataclasses.replace(incident, ledger=ledger)
    return incident


def capture_scene(state: RunState, verdict: Verdict, findings: list, rank: int) -> tuple[str, dict]:
    batch = {**state.batch.info, "samples": list(state.batch.samples), "tokens": state.batch.tokens}
    return scene.capture(state.report_dir, verdict.ctx, findings, batch, state.stage.first_optimizer(),
                         {"step": state.clock.step, "rollbacks": state.rollbacks}, state.resolved_overflow_mode(),
                         rank, episode=state.rollbacks, rng=state.seams.rng_state(),
                         ranks=naming.rank_info(state.seams.parallel_state()))


def peer_lost(state: RunState, step: int, error: Exception) -> NoReturn:
    """A peer was lost while the ranks agreed: flush and end this process at once."""
    exit_peer_lost(step, error, state.config.response.peer_timeout_s, state.publisher.close,
                   state.config.response.exit_codes.peer_lost)
