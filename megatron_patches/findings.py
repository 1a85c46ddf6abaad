"""The locate stage: which parameters, on which ranks, tripped a check, and the
:class:`~megatron_patches.incidents.Incident` rank 0 assembles from every rank's findings.

Runs on the slow path only (a checked step flagged something): each rank looks inside its own
offending gradients (:func:`local_findings`), the parts are gathered to rank 0, which names where
the fault entered and builds the incident once (:func:`assemble`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch

from . import incident_text, moe_routing, naming
from .decisions import Decision
from .detectors import CheckContext
from .collectives import local_shard
from .faults import held_tensors
from .incidents import Incident, ParamFinding, finite_or_none, first_of

_BUILT_IN_KINDS = ("nan", "inf", "overflow", "magnitude")

RecordFields = Callable[[list["RankReport"], dict], tuple[dict, str]]
"""Rank 0: the record's fields from Megatron's loss check and rerun in the reports, and a note for
the message (``Seams.record_fields``); given the fields found so far."""


def _picked(config: Any, detectors: list, ctx: CheckContext, norm_list: list, max_list: Optional[list],
            total_over: bool) -> dict[int, list[str]]:
    """{index into ctx.entries: reasons} of this rank's parameters that tripped a check."""
    limit = config.detectors.magnitude.param_norm_max
    picked: dict[int, list[str]] = {}
    for i, (entry, norm) in enumerate(zip(ctx.entries, norm_list)):
        if not math.isfinite(norm):
            picked.setdefault(i, []).append("nonfinite")
        if limit is not None and math.isfinite(norm) and norm > limit:
            picked.setdefault(i, []).append("magnitude")
        if max_list is not None and max_list[i] >= torch.finfo(entry.model.dtype).max:
            picked.setdefault(i, []).append("overflow")
    for detector in detectors:
        for i, reasons in detector.suspects(ctx, norm_list).items():
            picked.setdefault(i, []).extend(reasons)
    if total_over and not picked and norm_list:
        picked[max(range(len(norm_list)), key=lambda i: norm_list[i])] = ["magnitude_total"]
    return picked


def local_findings(config: Any, detectors: list, ctx: CheckContext, maxabs: Optional[torch.Tensor],
                   total_over: bool, ranks: dict[str, int]) -> list[ParamFinding]:
    """This rank's parameters whose gradients tripped a check, counted element by element
    (``ranks``: this rank's, :func:`~megatron_patches.naming.rank_info`). A rank without
    gradients still asks every detector for suspects: that is the slow path's collective phase
    (detectors/__init__.py), and its peers wait for it there."""
    if ctx.norms is None:
        for detector in detectors:
            detector.suspects(ctx, [])
        return []
    norm_list = ctx.norms.tolist()
    max_list = maxabs.tolist() if maxabs is not None else None
    host, device = naming.host(), naming.device_name()
    findings = []
    for i, reasons in sorted(_picked(config, detectors, ctx, norm_list, max_list, total_over).items()):
        entry, grad = ctx.entries[i], ctx.grads[i]
        nan = int(torch.isnan(grad).sum())
        inf = int(torch.isinf(grad).sum())
        overflow = 0
        if "overflow" in reasons:
            overflow = int((grad.abs() >= torch.finfo(entry.model.dtype).max).sum())
        if "nonfinite" in reasons:
            reasons = [r for r in reasons if r != "nonfinite"] + (["nan"] if nan else []) + (["inf"] if inf else [])
        findings.append(ParamFinding.located(
            entry.info, ranks, shape=list(entry.model.shape), nan=nan, inf=inf, overflow=overflow,
            norm=finite_or_none(norm_list[i]), host=host, device=device, shard=entry.shard, reasons=reasons))
    return findings


HELD_EXTREME = 2.0 ** 100
"""A weight or optimizer-state value at least this large (about 1.3e30) counts as corrupted with
NaN and Inf: no weight or Adam moment of a model that trains comes near it (a squared gradient of
1e15 would), while flipping the top exponent bit of any fp32 or bf16 value above 2^-28 (3.7e-9)
lands beyond it."""


def held_findings(entries: list, states: Mapping[int, Mapping[str, Any]], ranks: dict[str, int]) -> list[ParamFinding]:
    """This rank's parameters whose stepped weight (``entry.main``: the main weight or its shard)
    or optimizer state tensors (``states``: by ``id`` of the main weight) hold NaN, Inf or a value
    of :data:`HELD_EXTREME` or more (counted as ``overflow``), each with
    a reason ``held:<what>`` per tensor (``held:weight``, ``held:exp_avg``...). Slow path only: one
    read of this rank's optimizer state. Under the distributed optimizer a corrupted shard reaches
    every replica through the all-gather, so every rank's gradients go non-finite together; the
    rank holding the corruption is where it entered."""
    host, device = naming.host(), naming.device_name()
    found = []
    for entry in entries:
        tensors = held_tensors(entry.main, states)
        nan = inf = extreme = 0
        reasons = []
        for what, tensor in tensors.items():
            local = local_shard(tensor).detach()
            if local.numel() == 0:
                continue
            bad_nan, bad_inf = int(torch.isnan(local).sum()), int(torch.isinf(local).sum())
            bad_extreme = int((local.abs() >= HELD_EXTREME).sum()) - bad_inf
            if bad_nan or bad_inf or bad_extreme:
                nan, inf, extreme = nan + bad_nan, inf + bad_inf, extreme + bad_extreme
                reasons.append(f"held:{what}")
        if reasons:
            found.append(ParamFinding.located(entry.info, ranks, shape=list(entry.model.shape), nan=nan, inf=inf,
                                              overflow=extreme, norm=None, host=host, device=device, shard=entry.shard,
                                              reasons=reasons))
    return found


@dataclass(frozen=True)
class RankReport:
    """One rank's part of an incident, as it travels to rank 0 (``gather_object`` pickles it, so
    its fields are plain values): made once by the rank's slow path, read by rank 0's
    :func:`~megatron_patches.respond.decide`."""

    ranks: dict[str, int]
    """``{"global", "tp", "pp", "dp", "cp", "ep", "edp", "vpp"}`` of the rank (:func:`~megatron_patches.naming.rank_info`)."""
    findings: tuple[ParamFinding, ...] = ()
    """Its parameters whose gradients tripped a check (after the data-parallel reduction)."""
    pre_reduction: tuple[ParamFinding, ...] = ()
    """Its own gradients found non-finite before the reduction."""
    origin: bool = False
    """Whether the fault entered on this rank (its own gradients, before the reduction)."""
    held: tuple[ParamFinding, ...] = ()
    """Its parameters whose weight the optimizer steps (main weight or its shard) or optimizer state
    is non-finite on this rank (:func:`held_findings`): a corruption of the state it holds."""
    jumped: tuple[ParamFinding, ...] = ()
    """Its own finite gradients whose norm stood far above their running mean before the reduction
    (``PreReduction.jumped``): where a finite fault entered, if this replica alone shows one."""
    jumped_bucket: bool = False
    """Where no pass named its gradients (Megatron's bucket check stood in for it): whether one of
    its bucket norms stood far above its running mean before the reduction."""
    batch: tuple[int, ...] = ()
    """The dataset indices it fed in the step."""
    injected: tuple[dict, ...] = ()
    """What the drills did on it in the step (:meth:`~megatron_patches.inject.Injector.fired_at`)."""
    megatron: Optional[dict] = None
    """Megatron's loss check and rerun on it (``RerunWatch.part``), None when they said nothing."""
    moe_routing: Optional[dict] = None
    """Tokens per expert and router finiteness on it (:meth:`~megatron_patches.moe_routing.RoutingWatch.share`)."""

    @property
    def rank(self) -> int:
        """Its global rank."""
        return self.ranks["global"]

    def reports(self) -> bool:
        """Whether it goes to rank 0 (:func:`~megatron_patches.collectives.gather_reports`): the rank
        found something, the fault entered there, Megatron rejected something there, a drill fired
        there, or a router's probabilities went non-finite there. A rank with none of these adds
        nothing to the record, and neither it nor its scene is needed."""
        routing = self.moe_routing or {}
        return bool(self.findings or self.pre_reduction or self.origin or self.held or self.jumped or self.megatron
                    or self.injected or any(not seen["router_finite"] for seen in routing.values()))


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
    message = describe(found_kinds[1] if cause is not None and len(found_kinds) > 1 else kind, found,
                       ctx.total_norm, origin=origin, held=bool(held))
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
    routing = moe_routing.record_field([(report.rank, report.moe_routing) for report in everyone if report.moe_routing])
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
