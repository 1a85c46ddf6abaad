"""The locate stage on each rank: which of its parameters tripped a check, and what it holds
non-finite, in the :class:`RankReport` it sends to rank 0.

Runs on the slow path only (a checked step flagged something): each rank looks inside its own
offending gradients (:func:`local_findings`) and its optimizer state (:func:`held_findings`); the
reports are gathered to rank 0, whose pure :func:`~megatron_patches.decide.decide` names where the
fault entered and builds the incident once (:func:`~megatron_patches.decide.assemble`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from . import naming
from .detectors import CheckContext
from .collectives import local_shard
from .faults import held_tensors
from .incidents import ParamFinding, finite_or_none


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
    :func:`~megatron_patches.decide.decide`."""

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
