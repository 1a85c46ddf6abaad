"""Rank 0's decision on an incident: a pure function of the ranks' reports, the facts of the step
and the policy.

:func:`decide` grades the incident (:class:`~megatron_patches.decisions.GradePolicy`), reads its
signs for the cause (:func:`signs_of`), names the ranks it entered on (:func:`origins_of`) and
assembles the frozen :class:`~megatron_patches.incidents.Incident` (:func:`assemble`, with its
summary line from :func:`describe`). It reads what it is given: this module imports neither torch
nor the collectives, so it runs, and is tested, with hand-made
:class:`~megatron_patches.findings.RankReport` values and no process group. The rank side (each
rank's own findings, read from its tensors) is :mod:`megatron_patches.findings`; the gather
and the broadcast around :func:`decide` are :class:`megatron_patches.respond.Responder`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from . import incident_text
from .cause import Device, Signs, growth_of
from .decisions import Action, Decision, GradePolicy, Severity
from .incidents import Incident, ParamFinding, finite_or_none, first_of

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only: both modules read tensors
    from .check import Verdict
    from .detectors import CheckContext
    from .findings import RankReport

_BUILT_IN_KINDS = ("nan", "inf", "overflow", "magnitude")

RecordFields = Callable[[list["RankReport"], dict], tuple[dict, str]]
"""Rank 0: the record's fields from Megatron's loss check and rerun in the reports, and a note for
the message (``Seams.record_fields``); given the fields found so far."""


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


def origins_of(everyone: list[RankReport]) -> tuple[list[int], int]:
    """(global ranks whose own gradients were non-finite before the reduction, how many
    independent replicas they are) from the reports rank 0 received.

    Without expert parallelism a replica is a data-parallel rank: its tensor- and pipeline-parallel
    ranks exchange activations within the step, so a fault on one reaches the others before any
    check. With EP > 1 the ranks of one expert-parallel group exchange tokens through the
    all-to-all, so one fault reaches all of them in the same step (an expert's NaN poisons the
    other ranks' losses, a NaN in its input gradient goes back to the rank that sent the tokens):
    there they count once, as their expert-data-parallel rank (:func:`replica_of`). Ranks whose own
    weights or optimizer state went non-finite (:attr:`RankReport.held`) are the origins where there
    are any: the gradients of every replica that read those weights follow from them. Without
    either, a finite fault's origin is the rank whose own gradient jumped far above its running mean
    (:attr:`RankReport.jumped`), where one replica alone shows such a jump: in several at once it is
    the data's doing (a loss spike), and no rank is named."""
    held = sorted(report.rank for report in everyone if report.held)
    origins = held or sorted(report.rank for report in everyone if report.origin)
    replica = replica_of(everyone)
    if not origins:
        origins = _jumped_alone(everyone, replica)
    return origins, len({replica.get(r, r) for r in origins})


def _jumped_alone(everyone: list[RankReport], replica: dict[int, int]) -> list[int]:
    """The ranks of the one replica whose own gradients jumped, if exactly one replica shows a jump."""
    jumped = sorted(report.rank for report in everyone if report.jumped or report.jumped_bucket)
    return jumped if len({replica.get(r, r) for r in jumped}) == 1 else []


def _expert_parallel(everyone: list[RankReport]) -> bool:
    return any(report.ranks.get("ep", 0) > 0 for report in everyone)


def replica_of(everyone: list[RankReport]) -> dict[int, int]:
    """Global rank -> the independent replica it belongs to (see :func:`origins_of`)."""
    key = "edp" if _expert_parallel(everyone) else "dp"
    return {report.rank: report.ranks.get(key, report.ranks["dp"]) for report in everyone}


def _one_expert_parallel_group(everyone: list[RankReport], origins: tuple) -> bool:
    """Whether several origin ranks are all of one expert-parallel group (EP > 1)."""
    if len(origins) < 2 or not _expert_parallel(everyone):
        return False
    replica = replica_of(everyone)
    stage = {report.rank: report.ranks.get("pp") for report in everyone}
    return len({(replica.get(r), stage.get(r)) for r in origins}) == 1


def _expert_note(finding: ParamFinding) -> str:
    """``, expert G (EP rank E)`` for a finding on a routed expert, else nothing."""
    return f", expert {finding.expert['global']} (EP rank {finding.ranks.get('ep')})" if finding.expert else ""


def _fed(finding: ParamFinding) -> bool:
    """Whether ``finding`` is a rank's input (token ids it fed), not a state it holds."""
    return any(r.startswith("input:") for r in finding.reasons)


def _output(finding: ParamFinding) -> bool:
    """Whether ``finding`` is a module's output gone off its history (``detectors.activations``)."""
    return any(r.startswith("activation:") for r in finding.reasons)


def describe(kind: str, findings: list[ParamFinding], total_norm: float,
             origin: Optional[ParamFinding] = None, held: bool = False) -> str:
    """The summary line; ``origin`` (a rank's own finding before the reduction, or with ``held`` a
    weight or optimizer state a rank holds non-finite) leads when known."""
    what = f"{kind} gradient" if kind in _BUILT_IN_KINDS else kind
    if held and origin is not None:
        state = " and ".join(r.split(":", 1)[1] for r in origin.reasons if r.startswith("held:"))
        altered = " and ".join(r.split(":", 1)[1] for r in origin.reasons if r.startswith("altered:"))
        off = " and ".join(r.split(":", 1)[1] for r in origin.reasons if r.startswith("off:"))
        what = (f"{altered} altered between two updates" if altered
                else f"{off} far above its previous check" if off and not state
                else f"non-finite {state}" if origin.nan or origin.inf else f"{state} beyond 2^100")
    if origin is not None:
        head = (f"{what} first at {origin.name} (layer {origin.layer}{_expert_note(origin)}, rank {origin.ranks['global']}, "
                f"host {origin.host} {origin.device})")
        if held and _fed(origin):
            head = (f"token ids outside the vocabulary fed to {origin.name.rsplit('.', 1)[0]} on rank "
                    f"{origin.ranks['global']} (host {origin.host} {origin.device})")
        elif held and _output(origin):
            what = " and ".join("RMS" if r == "activation:rms" else "crest factor"
                                for r in origin.reasons if r.startswith("activation:"))
            head = (f"output {what} far above its history first at {origin.name} (layer {origin.layer}, rank "
                    f"{origin.ranks['global']}, host {origin.host} {origin.device})")
        if not findings:
            return head
        return f"{head}; after it {len({f.name for f in findings})} parameter(s) on rank(s) " \
               f"{sorted({f.ranks['global'] for f in findings})}"
    if not findings:
        return f"{kind} in gradients (total norm {total_norm:.4g})"
    first = first_of(findings)
    ranks = sorted({f.ranks["global"] for f in findings})
    return (f"{what} first at {first.name} (layer {first.layer}{_expert_note(first)}, rank {first.ranks['global']}); "
            f"{len({f.name for f in findings})} parameter(s) on rank(s) {ranks}")


def assemble(ctx: CheckContext, everyone: list[RankReport], decision: Decision, *, kinds: list, extra: dict,
             batch_info: Mapping[str, Any], record_fields: RecordFields, checked: int, world: Mapping[str, int],
             cause: Optional[Any] = None) -> Incident:
    """Rank 0: the incident from the reports of the ranks that report (:meth:`RankReport.reports`)
    and the decision on it. ``kinds``: what the detectors flagged; ``extra``: the fields they add to
    the record. ``record_fields``: the fields and message note from Megatron's loss check and
    rerun (``Seams.record_fields``). ``checked``: gradients checked on every rank together.
    ``world``: the job's layout (:func:`~megatron_patches.naming.world_layout`). ``cause``: an
    event that made the step an incident beside its gradients (``kind``, ``why``,
    ``record_field()``: the loss scaler's); it leads the kinds and the message."""
    found = [f for report in everyone for f in report.findings]
    before = [f for report in everyone for f in report.pre_reduction]
    reasons = {r for f in found + before for r in f.reasons}
    found_kinds = [k for k in _BUILT_IN_KINDS if k in reasons or (k == "magnitude" and "magnitude_total" in reasons)]
    found_kinds += [k for k in kinds if k not in found_kinds]
    if cause is not None:
        found_kinds.insert(0, cause.kind)
    kind = found_kinds[0] if found_kinds else "magnitude"
    extra = dict(extra)
    if cause is not None:
        extra[cause.kind] = cause.record_field()
    # The origin leads: a fault that entered a rank's own gradient before the reduction is
    # named there (host and device of that rank), not where the reduction carried it.
    held = [f for report in everyone for f in report.held]
    if not before and decision.origins:  # a finite fault named where it entered (origins_of)
        before = [f for report in everyone if report.rank in decision.origins for f in report.jumped]
    origin = first_of(held) or first_of(before)
    named = "gradient far above its running mean" if kind == "loss_spike" else kind  # the loss names no tensor
    message = describe(found_kinds[1] if cause is not None and len(found_kinds) > 1 else named, found,
                       ctx.total_norm, origin=origin, held=bool(held))
    if "loss_spike" in extra:  # the loss says that a step went wrong; the other signals say where, if they do
        led = kind == "loss_spike"
        message = incident_text.spike_text(extra["loss_spike"], led, message if found or origin or not led else None)
    if cause is not None:
        message = f"{cause.why}: {message}"
    if before:
        extra["pre_reduction"] = [f.as_record() for f in before]
    for key, prefix in (("held_nonfinite", "held:"), ("held_altered", "altered:"), ("held_off", "off:")):
        mine = [f.as_record() for f in held if any(r.startswith(prefix) for r in f.reasons)]
        if mine:
            extra[key] = mine
    if checked and sum(1 for f in found if f.nan or f.inf) >= checked:
        extra["all_gradients_nonfinite"] = True
        message += incident_text.ALL_NONFINITE_NOTE
    routing = routing_field([(report.rank, report.moe_routing) for report in everyone if report.moe_routing])
    if routing is not None:
        extra["moe_routing"] = routing
    fields, note = record_fields(everyone, extra)  # Megatron's loss check and rerun
    extra.update(fields)
    message += note + _origins_note(everyone, decision.origins, found + before, world, extra)
    return Incident(
        step=ctx.step, decision=decision, kind=kind, kinds=tuple(found_kinds), message=message,
        params=tuple(found), first=origin, ranks_affected=tuple(f.ranks["global"] for f in found),
        world=dict(world), total_norm=finite_or_none(ctx.total_norm),
        batch=MappingProxyType({**batch_info, "samples": sorted({i for report in everyone for i in report.batch})}),
        injected=tuple(e for report in everyone for e in report.injected),
        origin_ranks=tuple(decision.origins), extra=MappingProxyType(extra))


def _origins_note(everyone: list[RankReport], origins: tuple, seen: list[ParamFinding], world: Mapping[str, int],
                  extra: dict) -> str:
    """The message's note on the origin ranks and the replicas the fault reached (sets
    ``replicas_reached`` in ``extra``); nothing without origins."""
    if not origins:
        return ""
    dp_of = {report.rank: report.ranks["dp"] for report in everyone}
    reached = {dp_of.get(f.ranks["global"], f.ranks["global"]) for f in seen} | {dp_of.get(r, r) for r in origins}
    extra["replicas_reached"] = len(reached)
    held = [f for report in everyone for f in report.held]
    if held and all(map(_fed, held)):
        return f"; fed by rank(s) {list(origins)}"
    if held and all(map(_output, held)):
        return f"; the forward pass went off first on rank(s) {list(origins)}"
    where = "held in the weights or optimizer state of rank(s)" if held else "entered on rank(s)"
    note = (f"; {where} {list(origins)} before the data-parallel reduction, "
            f"reached {len(reached)} of {world['dp'] * world['cp']} data-parallel replica(s)")
    if _one_expert_parallel_group(everyone, origins):
        note += ("; those ranks are one expert-parallel group, whose all-to-all carries a fault "
                 "to every member within the step: counted as one origin")
    return note


def routing_field(shares: list[tuple[int, dict]]) -> Optional[dict]:
    """Rank 0: the record's ``moe_routing`` from every rank's (global rank, :meth:`~megatron_patches.moe_routing.RoutingWatch.share`):
    per MoE layer, tokens sent to each global expert summed over the ranks, the experts that got
    none, and the ranks whose routing probabilities were non-finite."""
    layers: dict[str, dict[str, Any]] = {}
    for rank, share in shares:
        for layer, seen in share.items():
            entry = layers.setdefault(layer, {"tokens_per_expert": [0] * len(seen["tokens_per_expert"]),
                                              "router_nonfinite_ranks": []})
            entry["tokens_per_expert"] = [a + b for a, b in zip(entry["tokens_per_expert"], seen["tokens_per_expert"])]
            if not seen["router_finite"]:
                entry["router_nonfinite_ranks"].append(rank)
    for entry in layers.values():
        entry["zero_token_experts"] = [g for g, n in enumerate(entry["tokens_per_expert"]) if n == 0]
    return {"layers": layers} if layers else None
