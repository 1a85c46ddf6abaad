"""Where a fault entered: each rank's own gradients before the data-parallel reduction.

A non-finite gradient on one card is summed into every replica by the reduction, so after it
every rank sees the fault. The data-parallel reduction is not the only one: Megatron's
``finalize_model_grads`` all-reduces the gradients of sequence-parallel norm weights over the
tensor-parallel group and the tied embedding over the pipeline ends, after the data-parallel
buckets. So wherever the job has more than one rank, the flag is taken before all of them. Before it, a flag per rank says which ranks it came from: one fused norm
pass per DDP bucket group right before its collective (:mod:`~megatron_patches.seams.grad_sync`), or
Megatron's own per-bucket norms where :mod:`~megatron_patches.seams.bucket_norms` runs, or, for a model
without bucket groups, one fused pass at ``finalize_model_grads``.
The flags ride on the check's all-reduce as a count; which ranks they were, and the parameters
they name, are gathered on the slow path only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import naming
from .bucket_norms import names_of
from .model_chunks import ModelChunks
from ..collectives import collective_device
from ..detectors.peak import crest_factors
from ..incidents import ParamFinding
from .optimizer_params import model_grad
from .parallel import parallel_state


def named_grads(chunks: list) -> list[tuple[str, int, torch.Tensor]]:
    """(global name, forward order, gradient) of every parameter of ``chunks`` holding one."""
    infos = naming.name_parameters(chunks, parallel_state())
    return [(infos[id(p)].name, infos[id(p)].order, g) for chunk in chunks for p in chunk.parameters()
            if (g := model_grad(p)) is not None and id(p) in infos]


@dataclass
class PreReduction:
    """What one rank knew about its own gradients before the reduction of one step."""

    flag: Optional[torch.Tensor] = None
    """1.0 on the device when this rank's own gradients held NaN/Inf; None when not checked."""
    norms: list = field(default_factory=list)
    """(chunks or None, params, device norms) of each fused pass, read only when the flag is up
    (None: the chunks registered for the optimizer holding the params, found then)."""
    findings: list = field(default_factory=list)
    """Parameters Megatron's bucket check found non-finite here (:meth:`OriginWatch.note`)."""
    jumps: list = field(default_factory=list)
    """(chunks or None, params, ratios (:class:`_Ratios`, made when read), reason, threshold) per fused pass: each own
    gradient's norm (reason ``local_jump``, :data:`LOCAL_JUMP`), and with the peak detector on its
    crest factor (``local_peak``, the detector's ``min_ratio``), over its running mean on this rank
    (0 where there is none yet). Read on the slow path only."""

    bucket_jumps: list = field(default_factory=list)
    """Ratios (:class:`_Ratios`) of Megatron's own bucket norms over their running means on this rank, where
    its bucket check stood in for the guard's pass (:meth:`OriginWatch.note_bucket_norms`): they
    name no parameter, only whether this rank's gradients jumped. Read on the slow path only."""

    def bucket_jumped(self) -> bool:
        """Whether a bucket norm of this rank stood :data:`LOCAL_JUMP` times or more above its running
        mean before the reduction (one host read; the slow path only)."""
        return any(bool((ratios.get() >= LOCAL_JUMP).any()) for ratios in self.bucket_jumps)

    def is_origin(self) -> bool:
        """Reading the flag costs nothing on a quiet step: it is read on the slow path only."""
        return self.flag is not None and bool(self.flag.item() > 0)

    def named(self, model_chunks: ModelChunks) -> list[ParamFinding]:
        """This rank's own faulty gradients: the bucket check's, else from the fused norms (named
        from the run's ``model_chunks`` where a pass saw a bucket group, not the chunks)."""
        return self.findings or [f for norms in self.norms for f in _norm_findings(model_chunks, norms)]

    def jumped(self, model_chunks: ModelChunks) -> list[ParamFinding]:
        """This rank's own finite gradients whose norm stood :data:`LOCAL_JUMP` times or more above
        their running mean before the reduction (one host read; the slow path only)."""
        return [f for ratios in self.jumps for f in _jump_findings(model_chunks, ratios)]


LOCAL_JUMP = 16.0
"""How far above its running mean, on its own rank before the reduction, a finite gradient's norm
must stand to make that rank the origin of a step flagged for magnitude (the history detector's
default factor). Used only when one data-parallel replica alone shows such a jump
(:func:`~megatron_patches.decide.origins_of`): a loss spike moves every replica's norms alike."""

LOCAL_MEAN_DECAY = 0.9
"""Weight of the past in each own gradient's running mean of norms (kept on the device)."""


class OriginWatch:
    """Collects one step's :class:`PreReduction` on this rank until the check takes it."""

    def __init__(self, enabled: bool, peak_ratio: Optional[float] = None):
        self.enabled = enabled
        self.peak_ratio = peak_ratio
        """With the peak detector on (its ``min_ratio``): also take each own gradient's crest factor
        (largest magnitude over RMS; one more read per pass), and a crest factor this many times its
        running mean names the rank as a norm :data:`LOCAL_JUMP` times above does: a few elements
        gone far off on one replica lift its tensor's norm too little to name it."""
        self._means: dict = {}
        """Per fused pass (a bucket group's id, or "chunks"): each own gradient's running mean of norms, on the device."""
        self._proposed: dict = {}
        """The running means the step just taken would make, kept only if its check passes (:meth:`commit`)."""
        self._pending = PreReduction()
        self._bucket_checks = False
        self._world_size: Optional[int] = None
        self._groups: dict[int, tuple[list, torch.Tensor]] = {}
        """Per bucket group of the step being made: (params, device norms) of its fused pass."""
        self._groups_step: Optional[int] = None
        self._buckets: dict[int, torch.Tensor] = {}
        """Per bucket group of the step being made: Megatron's bucket norms (:meth:`note_bucket_norms`)."""
        self._buckets_step: Optional[int] = None

    def before_reduction(self, chunks: list) -> None:
        """At a checked step's reduction: raise the flag from one fused pass over the gradients.
        On a single rank there is nowhere else a fault could have entered: no extra read. Where
        Megatron's bucket check runs, the flag comes from its norms (:meth:`note`)."""
        if self.watching() and not self._bucket_checks:
            params = [param for chunk in chunks for param in chunk.parameters()]
            held, norms, crests = _fused_norms(params, self.peak_ratio is not None)
            if norms is None:
                self._pending.flag = torch.zeros((), device=collective_device())
                return
            self._pending.flag = (~torch.isfinite(norms)).any().float()
            self._pending.norms = [(chunks, held, norms)]
            self._pending.jumps = self._jumps("chunks", chunks, held, norms, crests)

    def before_group(self, group: object, params: list, step: int) -> None:
        """A DDP bucket group of a checked ``step`` right before its collective
        (:mod:`~megatron_patches.seams.grad_sync`): one fused pass over its gradients, kept on the
        device. A group seen again in the same step (a rerun) replaces its pass; passes left
        from a step whose check never ran are dropped."""
        if not self.watching():
            return
        if self._groups_step != step:
            self._groups, self._groups_step = {}, step
        held, norms, crests = _fused_norms(params, self.peak_ratio is not None)
        if norms is not None:
            self._groups[id(group)] = (held, norms, crests)

    def note_bucket_norms(self, group: object, norms: list, step: int) -> None:
        """Megatron's finite bucket norms of ``group`` on a checked ``step`` (its own check ran
        instead of the guard's pass): kept on the device for a running mean of each, no read."""
        if self._buckets_step != step:
            self._buckets, self._buckets_step = {}, step
        if all(n.ndim == 0 and n.dtype == torch.float32 and not n.requires_grad for n in norms):
            self._buckets[id(group)] = torch.stack(norms)  # one call: the same floats as the general case's
        else:
            self._buckets[id(group)] = torch.cat([norm.detach().reshape(-1).float() for norm in norms])

    def watching(self) -> bool:
        """Whether a pass before the reductions can tell anything: on a single rank there is
        nowhere else a fault could have entered. With one data-parallel replica but tensor or
        pipeline parallel ranks, finalize_model_grads' reductions still carry a fault across."""
        if self._world_size is None:
            self._world_size = naming.world_layout(parallel_state())["size"]
        return self.enabled and self._world_size > 1

    def note_bucket_check(self) -> None:
        self._bucket_checks = True

    def note(self, findings: list[ParamFinding]) -> None:
        """Megatron's bucket check found this rank's own gradients non-finite."""
        self._pending.findings += findings
        self._pending.flag = torch.ones((), dtype=torch.float32)  # costs no read: always kept

    def take(self) -> PreReduction:
        taken, self._pending = self._pending, PreReduction()
        if self._groups:  # the groups' flags join in one device op here, at the check
            norms = torch.cat([n for _, n, _ in self._groups.values()])
            flag = (~torch.isfinite(norms)).any().float()
            taken.flag = flag if taken.flag is None else torch.maximum(taken.flag, flag.to(taken.flag.device))
            taken.norms += [(None, params, n) for params, n, _ in self._groups.values()]
            for key, (params, n, crests) in self._groups.items():
                taken.jumps += self._jumps(key, None, params, n, crests)
        self._groups, self._groups_step = {}, None
        for key, norms in self._buckets.items():
            taken.bucket_jumps.append(self._ratios((key, "bucket"), norms))
        self._buckets, self._buckets_step = {}, None
        return taken

    def _jumps(self, key: object, chunks: Optional[list], params: list, norms: torch.Tensor,
               crests: Optional[torch.Tensor]) -> list:
        """The pass's entries of :attr:`PreReduction.jumps`: norms, and crest factors when taken."""
        found = [(chunks, params, self._ratios(key, norms), "local_jump", LOCAL_JUMP)]
        if crests is not None:
            found.append((chunks, params, self._ratios((key, "crest"), crests), "local_peak", self.peak_ratio))
        return found

    def _ratios(self, key: object, values: torch.Tensor) -> "_Ratios":
        """Each value over its running mean, made when read (:class:`_Ratios`: the slow path only).
        ``key``: the series (a fused pass's norms or crest factors). The mean this step would make
        is made now, on the device, and waits for :meth:`commit`."""
        mean = self._means.get(key)
        finite = torch.isfinite(values)
        if mean is None or mean.shape != values.shape:
            self._proposed[key] = torch.where(finite, values, 0.0)
            return _Ratios(values, None, finite)
        self._proposed[key] = torch.where(finite, LOCAL_MEAN_DECAY * mean + (1 - LOCAL_MEAN_DECAY) * values, mean)
        return _Ratios(values, mean, finite)

    def commit(self, accepted: bool) -> None:
        """After the step's check: a clean step's norms join the running means; a flagged step's do not."""
        if accepted:
            self._means.update(self._proposed)
        self._proposed = {}



class _Ratios:
    """Each value of a step over its running mean before that step (0 where either is not finite
    or the mean is not positive; all 0 before a mean exists), made on the device when read: only a
    flagged step's slow path reads them, so a quiet step makes none. Its tensors are not changed
    afterwards (a commit replaces the mean), so reading later gives what reading then would have."""

    def __init__(self, values: torch.Tensor, mean: Optional[torch.Tensor], finite: torch.Tensor):
        self.values, self.mean, self.finite = values, mean, finite

    def get(self) -> torch.Tensor:
        values, mean = self.values, self.mean
        if mean is None:
            return torch.zeros_like(values)
        return torch.where(self.finite & (mean > 0), values / mean.clamp_min(torch.finfo(mean.dtype).tiny),
                           torch.zeros_like(values))


def _fused_norms(params: list, crests: bool = False) -> tuple[list, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(the parameters holding a gradient, their gradients' norms in one fused pass, and with
    ``crests`` their crest factors from a second, all on the device); norms None when none holds
    one. The norms are accumulated and returned in float32: an fp16 gradient buffer's norm taken
    in fp16 overflows to Inf past 65504 while every element is finite (a loss-scaled gradient
    does, on every rank), which is no fault of any rank."""
    held, grads = [], []
    for param in params:
        grad = model_grad(param)
        if grad is not None and grad.numel() > 0:
            held.append(param)
            grads.append(grad)
    if not grads:
        return held, None, None
    with torch.no_grad():
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
        if not crests:
            return held, norms, None
        maxabs = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32))
        sizes = torch.tensor([float(g.numel()) for g in grads], device=norms.device)
        return held, norms, crest_factors(maxabs, norms, sizes)


def _jump_findings(model_chunks: ModelChunks, jumps: tuple) -> list[ParamFinding]:
    """This rank's parameters whose own finite gradient norm (or crest factor) stood ``threshold``
    times or more above its running mean before the reduction."""
    chunks, params, ratios, reason, threshold = jumps
    values = ratios.get().tolist()
    if not any(value >= threshold for value in values):
        return []
    infos = names_of(model_chunks, params) if chunks is None else naming.name_parameters(chunks, parallel_state())
    ranks, host, device = naming.rank_info(parallel_state()), naming.host(), naming.device_name()
    return [ParamFinding.located(infos.get(id(param)), ranks, shape=list(param.shape), nan=0, inf=0, overflow=0,
                                 norm=None, host=host, device=device, reasons=[reason, "pre_reduction"])
            for param, value in zip(params, values) if value >= threshold]


def _norm_findings(model_chunks: ModelChunks, origin_norms: Optional[tuple]) -> list[ParamFinding]:
    """This rank's parameters whose own gradient was non-finite before the reduction. NaN/Inf
    counts are those of the local gradient's norm only (the gradient itself was reduced since):
    1 marks which one it was."""
    if origin_norms is None:
        return []
    chunks, params, norms = origin_norms
    if chunks is None:
        infos = names_of(model_chunks, params)
    else:
        infos = naming.name_parameters(chunks, parallel_state())
    ranks, host, device = naming.rank_info(parallel_state()), naming.host(), naming.device_name()
    findings = []
    for param, norm in zip(params, norms.tolist()):
        if math.isfinite(norm):
            continue
        reason = "nan" if norm != norm else "inf"
        findings.append(ParamFinding.located(
            infos.get(id(param)), ranks, shape=list(param.shape), nan=int(reason == "nan"), inf=int(reason == "inf"),
            overflow=0, norm=None, host=host, device=device, reasons=[reason, "pre_reduction"]))
    return findings
