"""The gradient check that runs right before clipping.

Per checked step the fast path costs one fused pass over the gradients
(``torch._foreach_norm``, two in saturation mode), one small all-reduce of a few flags and
per-layer sums, and one host read. Only when a flag is up does the slow path look inside the
offending tensors, gather every rank's findings to rank 0 (which writes one incident record)
and broadcast the decision, so that all ranks act alike and none waits in a collective.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import signal
import sys
import weakref
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch

from . import detectors as detector_plugins
from . import hooks, locate, served_norm
from .collectives import PeerLost, broadcast_from_zero, collective_device, gather_to_zero, prepare_bounded
from .config import Config
from .detectors import CheckContext
from .incidents import (
    HISTORY_FILE,
    HISTORY_SCHEMA,
    INCIDENTS_FILE,
    JsonlWriter,
    ParamFinding,
    finite_or_none,
    make_record,
)
from .inject import Injector, parse_spec
from .optimizer_params import Entry, build_entries, current_grads, leaves
from .response import EXIT_CRITICAL, EXIT_PEER_LOST, EXIT_ROLLBACK, EXIT_STOP, Decision, GradePolicy

log = logging.getLogger("megatron_patches")

# Slots of the reduced vector ahead of the per-layer sums of squares. _ORIGINS counts the ranks
# whose own gradients were non-finite before the data-parallel reduction: which ranks they were is
# gathered on the slow path, so the vector's size does not grow with the world.
_NONFINITE, _OVER_PARAM, _SATURATED, _TOTAL_SQ, _ORIGINS, _HEAD = 0, 1, 2, 3, 4, 5


def resolve_overflow_mode(mode: str) -> str:
    """'auto' -> what the device does: saturation on Ascend parts that saturate, else ieee.

    torch_npu's ``is_support_inf_nan()`` initialises the current device, so this is asked lazily
    (:attr:`GradMonitor.overflow_mode`, at the first check, after Megatron's set_device), and only
    when torch_npu is already imported (MindSpeed imports it; without it the answer is ieee)."""
    if mode != "auto":
        return mode
    torch_npu = sys.modules.get("torch_npu")
    try:
        supports = getattr(getattr(getattr(torch_npu, "npu", None), "utils", None), "is_support_inf_nan", None)
        if supports is not None and not supports():
            return "saturation"
    except Exception as exc:
        log.warning("overflow_mode auto: torch_npu's is_support_inf_nan failed (%s); checking as ieee, "
                    "set overflow_mode explicitly", exc)
    return "ieee"


class GradMonitor:
    """Checks the gradients an optimizer is about to clip and apply.

    Created and activated by :func:`megatron_patches.install`; the hooks call
    :meth:`after_prepare_grads` and :meth:`before_grad_reduction`.
    """

    def __init__(self, config: Config):
        self.config = config
        self._overflow_mode: Optional[str] = None  # resolved at the first check (resolve_overflow_mode)
        self.injector = Injector([parse_spec(s) for s in config.inject],
                                 clock=lambda: (self.upcoming_step(), self.rank))
        self.detectors = detector_plugins.build(config)
        self._detector_width = sum(d.width() for d in self.detectors)
        self.report_dir = os.path.abspath(config.report_dir)
        self._incidents: Optional[JsonlWriter] = None
        self._history: Optional[JsonlWriter] = None
        self._history_lines = 0
        self._step = 0
        self._step_set = False
        self._batch: list[int] = []
        self._batch_info: dict = {}
        self._entries: "weakref.WeakKeyDictionary[Any, list[Entry]]" = weakref.WeakKeyDictionary()
        self._num_slots: dict[int, int] = {}
        self._static: dict[tuple, tuple] = {}
        self._prepared: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._consecutive_overflows = 0
        self.listeners: list[Callable[[dict, dict], None]] = []
        """Called on every rank after a decision: ``fn(decision, record_or_empty)``."""
        self.counters = {
            "checked_steps": 0,
            "skipped_steps": 0,
            "incidents": 0,
            "scaler_overflows": 0,
            "injected": 0,
            "served_norms": 0,
        }
        self.last_total_norm: Optional[float] = None
        self.checked_norm: Optional[served_norm.CheckedNorm] = None
        """The last check's total norm, until Megatron's get_grad_norm takes it (served_norm)."""
        self.last_layer_norms: dict[str, float] = {}
        """Per-layer gradient norms of the last checked step (keys as in grad_history.jsonl)."""
        self.policy = GradePolicy(config)
        self.decision: Optional[Decision] = None
        """The last incident's decision, identical on every rank, until the loop takes it."""
        self.executor: Optional[Any] = None
        """Set by an in-process recovery executor (it replays and rolls back); None means the
        monitor itself stops the job on stop/rollback (exit-and-restart)."""
        self.rollbacks = 0
        self.on_exit: list[Callable[[int], Optional[int]]] = []
        """Called in order with the exit code before the monitor ends the process (writes the
        ledger); one that returns a code replaces it for the callbacks after it and the exit."""
        self._origin_flag: Optional[torch.Tensor] = None
        self._origin_norms: Optional[tuple] = None  # (chunks, params, device norms) before the reduction
        self._pre_reduction: list[ParamFinding] = []
        self._bucket_checks = False
        self._replica_count: Optional[int] = None
        self._pending_record: Optional[dict] = None
        self._pending_scene: Optional[tuple] = None  # (path, payload) captured at the incident
        self._scenes = None
        self._alerts = None
        self._batch_tokens: Optional[list] = None
        self._replaying = False
        self._replay_result: Optional[dict] = None
        self.last_incident_first: Optional[dict] = None
        self.last_incident_ranks: list = []

    @property
    def overflow_mode(self) -> str:
        """'ieee' or 'saturation'; 'auto' is asked on the rank's own device at the first use."""
        if self._overflow_mode is None:
            self._overflow_mode = resolve_overflow_mode(self.config.overflow_mode)
        return self._overflow_mode

    @overflow_mode.setter
    def overflow_mode(self, mode: str) -> None:
        self._overflow_mode = mode

    @property
    def rank(self) -> int:
        # Read each time: the monitor is usually made before torch.distributed starts.
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    # --- what the training loop may tell us ---------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    def upcoming_step(self) -> int:
        """The step whose gradients are being made now (before ``prepare_grads`` counts it)."""
        return self._step + (0 if self._step_set else 1)

    def set_step(self, step: int) -> None:
        """Name the optimizer step about to run (1-based, as Megatron prints iterations).
        Without it the monitor counts ``prepare_grads`` calls itself."""
        self._step = int(step)
        self._step_set = True

    def set_batch(self, sample_indices: list[int], tokens: Optional[list] = None, **info: Any) -> None:
        """The dataset indices this rank feeds in the current step (for incident records), and
        optionally the micro-batch tensors themselves (saved in fault scenes). ``info``: more
        fields for the record's and scene's ``batch``, the same on every rank (Megatron-LM's
        ``iteration`` and ``consumed_train_samples``)."""
        self._batch = list(sample_indices)
        self._batch_tokens = tokens
        self._batch_info = info

    def state_dict(self) -> dict:
        """What a checkpoint carries so a restart keeps its baselines and counters."""
        return {
            "step": self._step,
            "counters": dict(self.counters),
            "detectors": {d.name: d.state_dict() for d in self.detectors},
        }

    def load_state_dict(self, state: dict) -> None:
        self._step = int(state.get("step", self._step))
        # Counters are totals over the job's life: a rollback in this process must not lower
        # them, a fresh process resuming takes the saved ones.
        for name, value in state.get("counters", {}).items():
            self.counters[name] = max(self.counters.get(name, 0), value)
        for detector in self.detectors:
            if detector.name in state.get("detectors", {}):
                detector.load_state_dict(state["detectors"][detector.name])

    # --- hooks ---------------------------------------------------------------------------

    def after_prepare_grads(self, optimizer: Any, found_inf: bool) -> bool:
        """Run after Megatron's ``prepare_grads``; returns True to skip the update."""
        if not self._step_set:
            self._step += 1
        self._step_set = False
        self._prepared.add(optimizer)
        step = self._step
        if found_inf:  # fp16: the loss scaler found an overflow and will skip the step
            return self._scaler_overflow(optimizer, step)
        self._consecutive_overflows = 0
        entries = self._entries_for(optimizer)
        if self.injector:
            grads = [(e.info.name, e.info.order, g) for e, g in self._grads(optimizer, entries) if g is not None]
            self.counters["injected"] += len(self.injector.apply(step, "grad", self.rank, grads))
        if step % self.config.check_interval:
            return False
        return self._check(optimizer, entries, step)

    def before_direct_clip(self, optimizer: Any) -> None:
        """``clip_grad_norm`` called without ``prepare_grads`` first: check, zero bad grads."""
        if optimizer in self._prepared:
            self._prepared.discard(optimizer)
            return
        entries = self._entries_for(optimizer)
        if self._check(optimizer, entries, self._step, action="zero_grads"):
            for _, grad in self._grads(optimizer, entries):
                if grad is not None:
                    grad.zero_()

    def before_grad_reduction(self, model_chunks: Any) -> None:
        """Runs before the data-parallel reduction: phase=local drills corrupt here."""
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        step = self.upcoming_step()
        if self.injector:
            self._inject_local(chunks, step)
        # With one replica there is nowhere else a fault could have entered: skip the extra read.
        # Where Megatron's bucket check runs, the flag comes from its norms (note_pre_reduction).
        if (self.config.response.origin_check and step % self.config.check_interval == 0
                and self._replicas() > 1 and not self._bucket_checks):
            self._origin_flag = self._local_origin_norms(chunks)
        for detector in self.detectors:
            detector.before_reduction(chunks, step)

    def _local_origin_norms(self, chunks: list) -> torch.Tensor:
        """The origin flag (1.0: this rank's own gradients hold NaN/Inf before the reduction),
        from one fused pass over the per-parameter gradients. Their norms stay on the device:
        read only on the slow path, when this rank turns out to be an origin, to name them."""
        params, grads = [], []
        for chunk in chunks:
            for param in chunk.parameters():
                grad = getattr(param, "main_grad", None)
                grad = grad if grad is not None else param.grad
                if grad is not None and grad.numel() > 0:
                    params.append(param)
                    grads.append(grad)
        if not grads:
            self._origin_norms = None
            return torch.zeros((), device=collective_device())
        norms = torch.stack(torch._foreach_norm(grads)).float()
        self._origin_norms = (chunks, params, norms)
        return (~torch.isfinite(norms)).any().float()

    def _origin_findings(self, origin_norms: Optional[tuple]) -> list[ParamFinding]:
        """This rank's parameters whose own gradient was non-finite before the reduction (slow path,
        on an origin rank without Megatron's bucket check). NaN/Inf counts are those of the local
        gradient's norm only (the gradient itself was reduced since): 1 marks which one it was."""
        if origin_norms is None:
            return []
        chunks, params, norms = origin_norms
        infos = locate.name_parameters(chunks)
        ranks, host, device = locate.rank_info(), locate.host(), locate.device_name()
        findings = []
        for param, norm in zip(params, norms.tolist()):
            if math.isfinite(norm):
                continue
            info = infos.get(id(param))
            reason = "nan" if norm != norm else "inf"
            findings.append(ParamFinding(
                name=info.name if info else f"<unnamed {tuple(param.shape)}>", layer=info.layer if info else None,
                shape=list(param.shape), nan=int(reason == "nan"), inf=int(reason == "inf"), overflow=0, norm=None,
                ranks=ranks, host=host, device=device, order=info.order if info else -1,
                reasons=[reason, "pre_reduction"]))
        return findings

    def note_bucket_check(self) -> None:
        """Megatron's per-bucket check ran under the guard (:mod:`megatron_patches.bucket_check`):
        the origin flag comes from its norms from now on, with no read of our own."""
        self._bucket_checks = True

    def note_pre_reduction(self, findings: list[ParamFinding]) -> None:
        """This rank's own gradients were non-finite before the data-parallel reduction (found
        by Megatron's bucket check): this rank is an origin, and the record names ``findings``."""
        self._pre_reduction += findings
        self._origin_flag = torch.ones((), dtype=torch.float32)  # costs no read: always kept

    def _replicas(self) -> int:
        """Data-parallel replicas (context parallel included); fixed for the run."""
        if self._replica_count is None:
            layout = locate.world_layout()
            self._replica_count = layout["dp"] * layout["cp"]
        return self._replica_count

    def _inject_local(self, chunks: list, step: int) -> None:
        infos = locate.name_parameters(chunks)
        grads = []
        for chunk in chunks:
            for param in chunk.parameters():
                grad = getattr(param, "main_grad", None)
                grad = grad if grad is not None else param.grad
                if grad is not None and id(param) in infos:
                    grads.append((infos[id(param)].name, infos[id(param)].order, grad))
        self.counters["injected"] += len(self.injector.apply(step, "local", self.rank, grads))

    # --- fast path -----------------------------------------------------------------------

    def _entries_for(self, optimizer: Any) -> list[Entry]:
        entries = self._entries.get(optimizer)
        if entries is None:
            entries, self._num_slots[id(optimizer)] = build_entries(optimizer, hooks.model_chunks_for(optimizer) or [])
            self._entries[optimizer] = entries
        return entries

    def _grads(self, optimizer: Any, entries: list[Entry]):
        return current_grads(optimizer, entries)

    def _static_tensors(self, optimizer: Any, live: list[Entry], device: torch.device):
        key = (id(optimizer), len(live), device)
        cached = self._static.get(key)
        if cached is None:
            weights = torch.tensor([e.weight for e in live], dtype=torch.float32, device=device)
            slots = torch.tensor([e.slot for e in live], dtype=torch.long, device=device)
            limits = torch.tensor([torch.finfo(e.model.dtype).max if e.model.dtype.is_floating_point else math.inf
                                   for e in live], dtype=torch.float32, device=device)
            cached = self._static[key] = (weights, slots, limits)
        return cached

    def _local_stats(self, optimizer: Any, entries: list[Entry], step: int):
        """Per-parameter norms on the device and the vector to all-reduce."""
        pairs = [(e, g) for e, g in self._grads(optimizer, entries) if g is not None and g.numel() > 0]
        live = [e for e, _ in pairs]
        grads = [g for _, g in pairs]
        device = grads[0].device if grads else collective_device()
        num_slots = self._num_slots[id(optimizer)]
        vec = torch.zeros(_HEAD + num_slots + self._detector_width, dtype=torch.float32, device=device)
        if self._origin_flag is not None:
            vec[_ORIGINS] = self._origin_flag.to(device)
        ctx = CheckContext(step=step, entries=live, grads=grads, norms=None, device=device)
        maxabs = None
        if grads:
            weights, slots, limits = self._static_tensors(optimizer, live, device)
            norms = ctx.norms = torch.stack(torch._foreach_norm(grads)).float()
            detectors = self.config.detectors
            if detectors.nonfinite.enabled:
                vec[_NONFINITE] = (~torch.isfinite(norms)).sum()
            if detectors.magnitude.enabled and detectors.magnitude.param_norm_max is not None:
                vec[_OVER_PARAM] = (norms > detectors.magnitude.param_norm_max).sum()
            if self.overflow_mode == "saturation":
                maxabs = torch.stack(torch._foreach_norm(grads, float("inf"))).float()
                vec[_SATURATED] = (maxabs >= limits).sum()
            squares = norms.square() * weights
            vec[_TOTAL_SQ] = squares.sum()
            vec[_HEAD:_HEAD + num_slots].index_add_(0, slots, squares)
        offset = _HEAD + num_slots
        for detector in self.detectors:
            width = detector.width()
            detector.local(ctx, vec[offset:offset + width])
            offset += width
        return ctx, maxabs, vec

    def _check(self, optimizer: Any, entries: list[Entry], step: int, action: str = "skip_step") -> bool:
        pre_reduction, self._pre_reduction = self._pre_reduction, []
        origin_norms, self._origin_norms = self._origin_norms, None
        origin_flag, self._origin_flag = self._origin_flag, None
        ctx, maxabs, vec = self._local_stats(optimizer, entries, step)
        prepare_bounded(self.config.response.peer_timeout_s)  # once, while every rank is here
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(vec)  # every rank joins, stub optimizers included
        values = vec.tolist()  # the one host read of a checked step
        num_slots = self._num_slots[id(optimizer)]
        total_norm = math.sqrt(values[_TOTAL_SQ]) if values[_TOTAL_SQ] >= 0 else float("nan")
        ctx.total_norm = total_norm
        layer_sq = values[_HEAD:_HEAD + num_slots]
        ctx.layer_norms = [math.sqrt(v) if v >= 0 else float("nan") for v in layer_sq]
        if not self._replaying:  # a replay is a diagnosis, not a training step: no history of it
            self.injector.forget_before(step)
            self.counters["checked_steps"] += 1
            self.last_total_norm = total_norm
            served_norm.remember(self, optimizer, step, total_norm, entries, ctx.grads)
            self.last_layer_norms = dict(zip(_slot_names(num_slots), ctx.layer_norms))
            self._write_history(step, total_norm, layer_sq)
        magnitude = self.config.detectors.magnitude
        total_over = (magnitude.enabled and magnitude.total_norm_max is not None
                      and not total_norm <= magnitude.total_norm_max and values[_NONFINITE] == 0)
        kinds = []
        offset = _HEAD + num_slots
        reduced = {}
        for detector in self.detectors:
            width = detector.width()
            reduced[detector.name] = values[offset:offset + width]
            kinds += detector.verdict(ctx, reduced[detector.name])
            offset += width
        # A rank whose own gradients were non-finite before the reduction flags the step even where
        # the reduced gradients escape this check (Megatron's bucket check was left to us).
        flagged = bool(values[_NONFINITE] or values[_OVER_PARAM] or values[_SATURATED] or total_over
                       or kinds or values[_ORIGINS])
        if self._replaying:
            for detector in self.detectors:
                detector.commit(ctx, accepted=False)  # judged, but baselines stay as they were
            return self._replay_verdict(ctx, maxabs, total_over, flagged)
        if not flagged:
            for detector in self.detectors:
                detector.commit(ctx, accepted=True)
            return False
        # Slow path from here: reading this rank's own flag costs nothing on a quiet step.
        own_origin = origin_flag is not None and bool(origin_flag.item() > 0)
        if own_origin and not pre_reduction:  # name this rank's own faulty gradients
            pre_reduction = self._origin_findings(origin_norms)
        skip = self._incident(ctx, maxabs, total_over, kinds, reduced, action, own_origin, pre_reduction)
        for detector in self.detectors:
            detector.commit(ctx, accepted=not skip)
        return skip

    # --- slow path -----------------------------------------------------------------------

    def _findings(self, ctx: CheckContext, maxabs, total_over: bool) -> list[ParamFinding]:
        if ctx.norms is None:
            return []
        live, grads = ctx.entries, ctx.grads
        norm_list = ctx.norms.tolist()
        max_list = maxabs.tolist() if maxabs is not None else None
        limit = self.config.detectors.magnitude.param_norm_max
        ranks, host, device = locate.rank_info(), locate.host(), locate.device_name()
        picked: dict[int, list[str]] = {}
        for i, (entry, norm) in enumerate(zip(live, norm_list)):
            if not math.isfinite(norm):
                picked.setdefault(i, []).append("nonfinite")
            if limit is not None and math.isfinite(norm) and norm > limit:
                picked.setdefault(i, []).append("magnitude")
            if max_list is not None and max_list[i] >= torch.finfo(entry.model.dtype).max:
                picked.setdefault(i, []).append("overflow")
        for detector in self.detectors:
            for i, reasons in detector.suspects(ctx, norm_list).items():
                picked.setdefault(i, []).extend(reasons)
        if total_over and not picked and norm_list:
            picked[max(range(len(norm_list)), key=lambda i: norm_list[i])] = ["magnitude_total"]
        findings = []
        for i, reasons in sorted(picked.items()):
            entry, grad = live[i], grads[i]
            nan = int(torch.isnan(grad).sum())
            inf = int(torch.isinf(grad).sum())
            overflow = 0
            if "overflow" in reasons:
                overflow = int((grad.abs() >= torch.finfo(entry.model.dtype).max).sum())
            if "nonfinite" in reasons:
                reasons = [r for r in reasons if r != "nonfinite"] + (["nan"] if nan else []) + (["inf"] if inf else [])
            findings.append(ParamFinding(
                name=entry.info.name, layer=entry.info.layer, shape=list(entry.model.shape),
                nan=nan, inf=inf, overflow=overflow, norm=finite_or_none(norm_list[i]), ranks=ranks,
                host=host, device=device, order=entry.info.order, shard=entry.shard, reasons=reasons))
        return findings

    def _incident(self, ctx: CheckContext, maxabs, total_over: bool, kinds: list, reduced: dict,
                  action: str, own_origin: bool, pre_reduction: list) -> bool:
        step = ctx.step
        findings = self._findings(ctx, maxabs, total_over)
        if self.injector.kills(step, self.rank):  # drill: this rank is lost in mid-incident
            os.kill(os.getpid(), signal.SIGKILL)
        timeout = self.config.response.peer_timeout_s
        record: dict = {}
        decision = None
        try:
            everyone = gather_to_zero({"findings": findings, "batch": self._batch, "ranks": locate.rank_info(),
                                       "pre_reduction": pre_reduction, "origin": own_origin,
                                       "checked": len(ctx.entries),
                                       "injected": self.injector.fired_at(step)}, timeout)
            if self.rank == 0:
                # Nothing may escape between the gather and the broadcast: the other ranks wait in it.
                try:
                    decision, record = self._decide(ctx, everyone, total_over, kinds, reduced, action)
                except Exception as error:
                    log.exception("step %d: the guard failed while deciding on an incident", step)
                    decision = Decision("critical", "stop", f"the guard failed while deciding on this incident "
                                        f"({type(error).__name__}: {error}); stopped rather than apply "
                                        "gradients nobody judged", step)
                    record = self._fallback_record(ctx, decision)
            decision = broadcast_from_zero(decision, timeout)
        except PeerLost as error:
            self._peer_lost(step, error)
        self.decision = decision
        self.counters["incidents"] += 1
        if decision.action == "skip_step":
            self.counters["skipped_steps"] += 1
        scene = None
        if self.config.scene.enabled and _at_least(decision.severity, self.config.scene.min_severity):
            scene = self._capture_scene(ctx, findings)  # captured now, whenever it is written
            if self.rank == 0:
                record = {**record, "scene": os.path.dirname(scene[0])}
        if self.rank == 0:
            if decision.replay:  # written once the executor's replay has a verdict
                self._pending_record, self._pending_scene = record, scene
            else:
                self._publish(record, scene)
        elif scene is not None:
            self._submit_scene(scene, None)
        for listener in self.listeners:
            listener(decision, copy.deepcopy(record))
        if self.executor is None and decision.action in ("stop", "rollback"):
            self.exit(EXIT_CRITICAL if decision.severity == "critical" else
                      EXIT_ROLLBACK if decision.action == "rollback" else EXIT_STOP)
        return decision.action != "continue"

    def _decide(self, ctx: CheckContext, everyone: list, total_over: bool, kinds: list, reduced: dict,
                action: str) -> tuple[Decision, dict]:
        """Rank 0: grade the incident from every rank's findings and assemble its record."""
        step = ctx.step
        found = [f for part in everyone for f in part["findings"]]
        before = [f for part in everyone for f in part["pre_reduction"]]
        origins = sorted(part["ranks"]["global"] for part in everyone if part["origin"])
        reasons = {r for f in found + before for r in f.reasons}
        found_kinds = [k for k in ("nan", "inf", "overflow", "magnitude") if k in reasons or
                       (k == "magnitude" and "magnitude_total" in reasons)]
        found_kinds += [k for k in kinds if k not in found_kinds]
        kind = found_kinds[0] if found_kinds else "magnitude"
        dp_of = {part["ranks"]["global"]: part["ranks"]["dp"] for part in everyone}
        replicas = len({dp_of.get(r, r) for r in origins})
        if action == "skip_step":
            decision = self.policy.grade(step, replicas, self.rollbacks, can_replay=self.executor is not None)
        else:  # direct clip_grad_norm callers: nothing to skip, gradients are zeroed
            decision = Decision("warning", action, "checked in clip_grad_norm", step)
        decision.origins = origins
        extra: dict[str, Any] = {}
        for detector in self.detectors:
            extra.update(detector.extra(ctx, reduced[detector.name]))
        # The origin leads: a fault that entered a rank's own gradient before the reduction is
        # named there (host and device of that rank), not where the reduction carried it.
        origin = max(before, key=lambda f: f.order) if before else None
        reached = sorted({dp_of.get(f.ranks["global"], f.ranks["global"]) for f in found + before}
                         | {dp_of.get(r, r) for r in origins})
        message = _describe(kind, found, ctx.total_norm, origin=origin)
        if before:
            extra["pre_reduction"] = [asdict(f) for f in before]
        checked = sum(part["checked"] for part in everyone)
        if checked and sum(1 for f in found if f.nan or f.inf) >= checked:
            # Backward spreads a broken forward pass to every gradient; the tensor nearest the
            # output comes first in backward order, but it is where the fault arrived last.
            extra["all_gradients_nonfinite"] = True
            message += ("; every gradient is non-finite: the loss or an activation went non-finite in the "
                        "forward pass, so the output layer named first is not the suspect")
        if origins:
            world = locate.world_layout()
            extra["replicas_reached"] = len(reached)
            message += (f"; entered on rank(s) {origins} before the data-parallel reduction, reached "
                        f"{len(reached)} of {world['dp'] * world['cp']} data-parallel replica(s)")
        record = make_record(
            step=step, severity=decision.severity, kind=kind, kinds=found_kinds, action=decision.action,
            message=message, params=found, first=origin,
            ranks_affected=[f.ranks["global"] for f in found], world=locate.world_layout(),
            total_norm=finite_or_none(ctx.total_norm),
            batch={**self._batch_info, "samples": sorted({i for part in everyone for i in part["batch"]})},
            injected=[e for part in everyone for e in part["injected"]],
            origin_ranks=origins, reason=decision.reason, **extra,
        )
        self.last_incident_first = record["first"]
        self.last_incident_ranks = record["ranks_affected"]
        log.warning("step %d: %s: %s -> %s (%s)", step, decision.severity, record["message"],
                    decision.action, decision.reason)
        return decision, record

    def _fallback_record(self, ctx: CheckContext, decision: Decision) -> dict:
        """The record of an incident the guard failed to assemble: what is known for sure."""
        try:
            return make_record(step=ctx.step, severity=decision.severity, kind="guard_error", kinds=["guard_error"],
                               action=decision.action, message=decision.reason, params=[], ranks_affected=[],
                               world=locate.world_layout(), total_norm=finite_or_none(ctx.total_norm),
                               reason=decision.reason)
        except Exception:
            log.exception("step %d: no record could be made of this incident", ctx.step)
            return {}

    def _peer_lost(self, step: int, error: Exception) -> None:
        """A peer died or went silent during an incident's decision: nothing can be agreed on any
        more. Flush what this rank holds, then end the process at once: a barrier, Megatron's
        teardown or an exit callback would wait for the lost peer (under nccl up to the process
        group's timeout), so none of them runs."""
        log.error("step %d: a peer was lost while the ranks agreed on an incident (%s); exiting with code %d "
                  "within response.peer_timeout_s=%gs; restart the job (nothing was decided, no ledger written)",
                  step, error, EXIT_PEER_LOST, self.config.response.peer_timeout_s)
        try:
            self.close()
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PEER_LOST)

    def replay_check(self, optimizer: Any, step: int) -> dict:
        """Run the check on gradients a loop has just recomputed for ``step`` (no update, no new
        incident). Returns ``{"flagged", "first"}``, identical on every rank."""
        self._replaying, self._replay_result = True, {"flagged": False, "first": None}
        try:
            self.set_step(step)
            optimizer.prepare_grads()
        finally:
            self._replaying = False
        return self._replay_result

    def _replay_verdict(self, ctx: CheckContext, maxabs, total_over: bool, flagged: bool) -> bool:
        first = None
        timeout = self.config.response.peer_timeout_s
        try:
            if flagged:
                everyone = gather_to_zero(self._findings(ctx, maxabs, total_over), timeout)
                found = [f for part in everyone for f in part]
                first = max(found, key=lambda f: f.order).name if found else None
            self._replay_result = broadcast_from_zero({"flagged": flagged, "first": first}, timeout)
        except PeerLost as error:
            self._peer_lost(ctx.step, error)
        return True

    def resolve(self, **fields: Any) -> None:
        """The executor's outcome for the pending incident (replay verdict, blacklisted samples,
        rollback target); rank 0 writes the record with it. Call on every rank."""
        if self.rank == 0 and self._pending_record is not None:
            self._publish({**self._pending_record, **fields}, self._pending_scene)
        self._pending_record, self._pending_scene = None, None

    def take_decision(self) -> Optional[Decision]:
        decision, self.decision = self.decision, None
        return decision

    def exit(self, code: int) -> None:
        """Stop this rank cleanly: flush scenes and alerts, then exit with ``code``. Every rank
        reaches this from the same broadcast decision, so none is left waiting in a collective."""
        for callback in self.on_exit:
            code = callback(code) or code  # a callback may turn the code into a stop
        self.close()
        log.warning("stopping with exit code %d", code)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        raise SystemExit(code)

    def close(self) -> None:
        """Write what is queued (pending record, scenes, alerts)."""
        if self._pending_record is not None and self.rank == 0:
            self._publish(self._pending_record, self._pending_scene)
            self._pending_record, self._pending_scene = None, None
        if self._scenes is not None:
            self._scenes.close()
            self._scenes = None
        if self._alerts is not None:
            self._alerts.close()
            self._alerts = None

    def _publish(self, record: dict, scene: Optional[tuple] = None) -> None:
        """Hand the complete record on: the scene writer and the alert sinks get their own copies."""
        if not record:  # nothing could be assembled (see _fallback_record): nothing to hand on
            return
        if scene is not None:
            self._submit_scene(scene, record)
        self._write_incident(record)
        if record.get("severity") in ("error", "critical"):
            if self._alerts is None:
                from .alerts import AlertDispatcher

                self._alerts = AlertDispatcher(self.config.alerts, self.report_dir)
            self._alerts.submit(record)

    def _capture_scene(self, ctx: CheckContext, findings: list) -> tuple[str, dict]:
        """This rank's scene (path, payload) as it is now: CPU copies, nothing shared."""
        from . import scene
        from .checkpoint import rng_state

        norms = ctx.norms.tolist() if ctx.norms is not None else []
        payload = {
            "step": ctx.step,
            "ranks": locate.rank_info(),
            "host": locate.host(),
            "device": locate.device_name(),
            "batch": {**self._batch_info, "samples": list(self._batch),
                      "tokens": [t.detach().cpu().clone() for t in self._batch_tokens] if self._batch_tokens else None},
            "rng": rng_state(),
            "grad_norms": {e.info.name: n for e, n in zip(ctx.entries, norms)},
            "findings": [asdict(f) for f in findings],
            "optimizer": self._optimizer_meta(),
            "overflow_mode": self.overflow_mode,
        }
        # Each episode keeps its own scene: a step reached again after a rollback is another one.
        return scene.scene_dir(self.report_dir, ctx.step, self.rank, episode=self.rollbacks), payload

    def _submit_scene(self, captured: tuple, record: Optional[dict]) -> None:
        """Queue a captured scene; rank 0 adds the environment and the complete ``record``."""
        from . import scene

        if self._scenes is None:
            self._scenes = scene.SceneWriter(self.config.scene.queue_size, self.config.scene.max_bytes)
        path, payload = captured
        files = {}
        if record is not None:
            files = {"environment.json": {**scene.environment(), "world": locate.world_layout()},
                     "incident.json": record}
        self._scenes.submit(path, payload, files)  # the writer deep-copies what it is given

    def _optimizer_meta(self) -> dict:
        meta: dict[str, Any] = {"step": self._step, "rollbacks": self.rollbacks}
        optimizer = next(iter(self._entries.keys()), None)
        if optimizer is None:
            return meta
        meta["param_groups"] = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, type(None)))}
                                for g in optimizer.param_groups]
        scale = optimizer.get_loss_scale() if hasattr(optimizer, "get_loss_scale") else None
        meta["loss_scale"] = float(scale) if scale is not None else None
        return meta

    def _scaler_overflow(self, optimizer: Any, step: int) -> bool:
        self.counters["scaler_overflows"] += 1
        self._consecutive_overflows += 1
        settings = self.config.detectors.loss_scale
        scaler = next((getattr(l, "grad_scaler", None) for l in leaves(optimizer)
                       if getattr(l, "grad_scaler", None) is not None), None)
        scale = float(scaler.scale) if scaler is not None else None
        collapsed = scale is not None and scale <= settings.min_scale
        if settings.enabled and (collapsed or self._consecutive_overflows >= settings.max_consecutive_skips):
            why = (f"loss scale collapsed to {scale:g}" if collapsed else
                   f"{self._consecutive_overflows} consecutive overflow skips (loss scale {scale:g})")
            self.counters["incidents"] += 1
            if self.rank == 0:
                self._write_incident(make_record(
                    step=step, severity="warning", kind="loss_scale", kinds=["loss_scale"],
                    action="skip_step", message=why, params=[], ranks_affected=[],
                    world=locate.world_layout(), loss_scale=scale,
                    batch={**self._batch_info, "samples": self._batch}))
                log.warning("step %d: %s", step, why)
            self._consecutive_overflows = 0
        return True

    # --- files ---------------------------------------------------------------------------

    def _write_incident(self, record: dict) -> None:
        if self._incidents is None:
            self._incidents = JsonlWriter(os.path.join(self.report_dir, INCIDENTS_FILE))
        self._incidents.write(record)

    def _write_history(self, step: int, total_norm: float, layer_sq: list[float]) -> None:
        if self.rank != 0 or not self.config.grad_history:
            return
        if self._history is None:
            self._history = JsonlWriter(os.path.join(self.report_dir, HISTORY_FILE), fsync=False)
        if self._history_lines >= self.config.grad_history_max_lines:
            try:
                os.replace(self._history.path, self._history.path + ".1")
            except OSError as exc:  # a failing disk must not stop training: keep appending
                log.warning("cannot rotate %s (%s); it keeps growing", self._history.path, exc)
            self._history_lines = 0
        names = _slot_names(len(layer_sq))
        written = self._history.write({
            "schema": HISTORY_SCHEMA, "step": step, "total_norm": finite_or_none(total_norm),
            "layers": {n: finite_or_none(math.sqrt(v)) if v >= 0 else None for n, v in zip(names, layer_sq)},
        })
        self._history_lines += int(written)


def _describe(kind: str, findings: list[ParamFinding], total_norm: float,
              origin: Optional[ParamFinding] = None) -> str:
    """The summary line; ``origin`` (a rank's own finding before the reduction) leads when known."""
    what = f"{kind} gradient" if kind in ("nan", "inf", "overflow", "magnitude") else kind
    if origin is not None:
        head = (f"{what} first at {origin.name} (layer {origin.layer}, rank {origin.ranks['global']}, "
                f"host {origin.host} {origin.device})")
        if not findings:
            return head
        return f"{head}; after it {len({f.name for f in findings})} parameter(s) on rank(s) " \
               f"{sorted({f.ranks['global'] for f in findings})}"
    if not findings:
        return f"{kind} in gradients (total norm {total_norm:.4g})"
    first = max(findings, key=lambda f: f.order)
    ranks = sorted({f.ranks["global"] for f in findings})
    return (f"{what} first at {first.name} (layer {first.layer}, rank {first.ranks['global']}); "
            f"{len({f.name for f in findings})} parameter(s) on rank(s) {ranks}")


def _slot_names(num_slots: int) -> list[str]:
    """Names of the per-layer slots: transformer layers by index, then embedding and output."""
    return [str(i) for i in range(num_slots - 2)] + ["embedding", "output"]


def _at_least(severity: str, floor: str) -> bool:
    order = ("warning", "error", "critical")
    return order.index(severity) >= order.index(floor)
