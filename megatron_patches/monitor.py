"""The gradient check that runs right before clipping: the guard's entry point.

Per checked step the fast path costs one fused pass over the gradients
(``torch._foreach_norm``, two in saturation mode), one small all-reduce of a few flags and
per-layer sums, and one host read. Only when a flag is up does the slow path look inside the
offending tensors, gather every rank's findings to rank 0 (which writes one incident record)
and broadcast the decision, so that all ranks act alike and none waits in a collective.

:class:`GradMonitor` holds the run's state and hands each checked step down the pipeline::

    hooks -> check (check.CheckStage: vector, all-reduce, verdicts)
          -> locate (findings: this rank's findings, gathered; rank 0 assembles a frozen Incident)
          -> respond (decisions.GradePolicy on rank 0, the Decision broadcast)
          -> publish (publish.Publisher: record made once, scenes, alerts, history)
          -> the executor acts on the Decision (recovery) and hands back an Outcome
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import weakref
from typing import Any, NoReturn, Optional, TypeVar

import torch

from . import detectors as detector_plugins
from . import collectives, inject, naming, scene
from .callbacks import Callback
from .check import CheckStage, Verdict, resolve_overflow_mode
from .collectives import PeerLost
from .config import Config
from .decisions import Action, Decision, exit_code
from .findings import local_findings, reports
from .incidents import Incident, Outcome
from .moe_routing import RoutingWatch
from .protocols import Seams
from .publish import Publisher
from .respond import Responder, exit_peer_lost

log = logging.getLogger("megatron_patches")

T = TypeVar("T")


class GradMonitor:
    """Checks the gradients an optimizer is about to clip and apply.

    Made by :func:`megatron_patches.seams.build_monitor` and activated by
    :func:`megatron_patches.install`; the hooks call :meth:`after_prepare_grads` and
    :meth:`before_grad_reduction`. Executors and integrations use what
    :class:`megatron_patches.protocols.Guard` lists.
    """

    def __init__(self, config: Config, seams: Seams):
        """``seams``: Megatron's side (:class:`megatron_patches.seams.MegatronSeams`)."""
        self.config = config
        self.seams = seams
        # The run's state beside the pipeline, each piece passed down from here. The drills come
        # first: a bad spec stops the start before anything is made. Poison drills ask the guard
        # which step and rank a sample is fed on.
        self.drills = inject.build(config.inject, clock=lambda: (self.upcoming_step(), self.rank))
        """This run's fault drills (``config.inject``; an injector without specs does nothing)."""
        self.model_chunks = seams.model_chunks()
        """The model chunks each optimizer steps, and each DDP bucket group's parameters."""
        self.rerun = seams.rerun_watch()
        """Megatron's rerun of a checked step in place: its verdict and trace (:mod:`~megatron_patches.seams.rerun_machine`)."""
        self.peers = collectives.BoundedGroup(config.response.peer_timeout_s)
        """The guard's own gloo group for the slow path (made at the first check)."""
        self._overflow_mode: Optional[str] = None  # resolved at the first check (resolve_overflow_mode)
        self.detectors = detector_plugins.build(config)
        self.report_dir = os.path.abspath(config.report_dir)
        self.stage = CheckStage(config, self.detectors, self.peers, self.model_chunks, seams)
        self.origin = seams.origin_watch(config.response.origin_check)
        self.routing = RoutingWatch(self.upcoming_step, lambda step: step % config.check_interval == 0)
        """Tokens per expert and router finiteness of the step being made (mixture-of-experts)."""
        self.publisher = Publisher(config, self.report_dir)
        self.responder = Responder(config, self.detectors, self.peers, seams.record_fields)
        self._loss_scale = seams.loss_scale_watch(config.detectors.loss_scale)
        self._step, self._step_set = 0, False  # the step being made, and whether the loop named it
        self._batch: list[int] = []  # this rank's samples, the fields beside them, their tokens (set_batch)
        self._batch_info: dict = {}
        self._batch_tokens: Optional[list] = None
        self._prepared: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._drills_checked = False
        self.counters = {"checked_steps": 0, "skipped_steps": 0, "incidents": 0, "scaler_overflows": 0,
                         "injected": 0, "served_norms": 0}
        self.last_total_norm: Optional[float] = None
        self.checked_norm: Optional[Any] = None
        """The last check's total norm, until Megatron's get_grad_norm takes it (served_norm)."""
        self.last_layer_norms: dict[str, float] = {}
        """Per-layer gradient norms of the last checked step (keys as in grad_history.jsonl)."""
        self.decision: Optional[Decision] = None
        """The last incident's decision, identical on every rank, until the loop takes it."""
        self.last_incident: Optional[Incident] = None
        """The last incident as rank 0 assembled it (None on the other ranks)."""
        self.executor: Optional[Any] = None
        """The recovery executor (:class:`megatron_patches.protocols.Executor`). Unless it acts in
        process, the monitor itself ends the job on stop and rollback decisions."""
        self.rollbacks = 0
        self.callbacks: list[Callback] = []
        """The integrations that hear of the run's events (:meth:`add_callback`), in the order added."""

    @property
    def overflow_mode(self) -> str:
        """'ieee' or 'saturation'; 'auto' is asked on the rank's own device at the first use."""
        if self._overflow_mode is None:
            self._overflow_mode = resolve_overflow_mode(self.config.overflow_mode)
        return self._overflow_mode

    @overflow_mode.setter
    def overflow_mode(self, mode: str) -> None:  # tests and the saturation drills
        self._overflow_mode = mode

    @property
    def rank(self) -> int:
        # Read each time: the monitor is usually made before torch.distributed starts.
        return collectives.rank()

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
        if not self._drills_checked:  # once, at the first step, when every rank is here
            self._drills_checked = True
            inject.refuse_unmatched(self.drills, self.model_chunks.chunks_for(optimizer), self.rank,
                                    self.seams.current_grads(optimizer, self.stage.entries_for(optimizer)))
        if not self._step_set:
            self._step += 1
        self._step_set = False
        self._prepared.add(optimizer)
        step = self._step
        if found_inf:  # fp16: the loss scaler found an overflow and skips the step
            return self._scaler_overflow(optimizer, step)
        self._loss_scale.clear()
        entries = self.stage.entries_for(optimizer)
        if self.drills:
            grads = [(e.info.name, e.info.order, g) for e, g in self.seams.current_grads(optimizer, entries) if g is not None]
            self.counters["injected"] += len(self.drills.apply(step, "grad", self.rank, grads))
        if step % self.config.check_interval:
            return False
        return self._check(optimizer, entries, step)

    def before_direct_clip(self, optimizer: Any) -> None:
        """``clip_grad_norm`` called without ``prepare_grads`` first: check, zero bad grads."""
        if optimizer in self._prepared:
            self._prepared.discard(optimizer)
            return
        entries = self.stage.entries_for(optimizer)
        if self._check(optimizer, entries, self._step, action=Action.ZERO_GRADS):
            for _, grad in self.seams.current_grads(optimizer, entries):
                if grad is not None:
                    grad.zero_()

    def before_grad_reduction(self, model_chunks: Any) -> None:
        """Runs at ``finalize_model_grads``. For Megatron DDP chunks the buckets' reductions start
        in their own ``start_grad_sync`` (under overlap, already during backward): phase=local drills
        and the origin pass go in there (:mod:`~megatron_patches.seams.grad_sync`); for other models, here."""
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        step = self.upcoming_step()
        if not self.seams.covers(chunks):
            if self.drills:
                self.counters["injected"] += len(self.drills.apply(step, "local", self.rank, self.seams.named_grads(chunks)))
            if step % self.config.check_interval == 0 and not self.seams.reduced_in_backward(chunks):
                self.origin.before_reduction(chunks)
        for detector in self.detectors:
            detector.before_reduction(chunks, step)

    def note_bucket_check(self) -> None:
        """Megatron's per-bucket check ran under the guard (:mod:`megatron_patches.seams.bucket_norms`):
        the origin flag comes from its norms from now on, with no read of our own."""
        self.origin.note_bucket_check()

    def note_pre_reduction(self, findings: list) -> None:
        """This rank's own gradients were non-finite before the data-parallel reduction (found
        by Megatron's bucket check): this rank is an origin, and the record names ``findings``."""
        self.origin.note(findings)

    # --- check -> locate -> respond -> publish ---------------------------------------------

    def _check(self, optimizer: Any, entries: list, step: int, action: Action = Action.SKIP_STEP) -> bool:
        before = self.origin.take()
        verdict = self.stage.run(optimizer, entries, step, before.flag, self.overflow_mode == "saturation")
        self._note_checked(optimizer, entries, verdict)
        self._tell("after_check", step, verdict.flagged)
        if not verdict.flagged:
            self.stage.commit(verdict, accepted=True)
            return False
        self._incident(verdict, action, before)
        self.stage.commit(verdict, accepted=False)
        return True

    def _note_checked(self, optimizer: Any, entries: list, verdict: Verdict) -> None:
        """A training step's check: counters, the served norm, the history line."""
        ctx = verdict.ctx
        self.drills.forget_before(ctx.step)
        self.counters["checked_steps"] += 1
        self.last_total_norm = ctx.total_norm
        if self.config.serve_norm:
            self.seams.remember_norm(self, optimizer, ctx.step, ctx.total_norm, entries, ctx.grads)
        self.last_layer_norms = verdict.layer_norms
        if self.rank == 0:
            self.publisher.write_history(ctx.step, ctx.total_norm, verdict.layer_sq)

    def _incident(self, verdict: Verdict, action: Action, before: Any,
                  cause: Optional[Any] = None) -> None:
        """The slow path: locate, agree on a decision, publish, and end the run if it says so.
        ``cause``: the loss scaler's event that made this skipped step an incident."""
        ctx = verdict.ctx
        own_origin = before.is_origin()
        pre_reduction = before.named(self.model_chunks) if own_origin else before.findings
        findings = local_findings(self.config, self.detectors, ctx, verdict.maxabs, verdict.total_over)
        if self.drills.kills(ctx.step, self.rank):  # drill: this rank is lost in mid-incident
            os.kill(os.getpid(), signal.SIGKILL)
        part = {"findings": findings, "batch": self._batch, "ranks": naming.rank_info(),
                "megatron": self.rerun.part(ctx.step),  # Megatron's loss check and rerun verdict
                "pre_reduction": pre_reduction, "origin": own_origin,
                "injected": self.drills.fired_at(ctx.step), "moe_routing": self.routing.share(ctx.step)}
        try:
            decision, incident = self.responder.agree(verdict, action, part, self._batch_info, self.rollbacks,
                                                      can_replay=getattr(self.executor, "replays", False),
                                                      cause=cause)
        except PeerLost as error:
            self._peer_lost(ctx.step, error)
        self.decision = decision
        self.counters["incidents"] += 1
        if decision.action == Action.SKIP_STEP:
            self.counters["skipped_steps"] += 1
        captured = None
        # Rank 0's scene holds the incident's summary; another rank writes one only where it reports.
        if (self.config.scene.enabled and decision.severity.at_least(self.config.scene.min_severity)
                and (self.rank == 0 or reports(part))):
            captured = self._capture_scene(verdict, findings)  # captured now, whenever it is written
        if incident is not None and captured is not None:  # rank 0: the scene goes in before the freeze
            incident = dataclasses.replace(incident, scene=os.path.dirname(captured[0]))
        ledger = getattr(self.executor, "ledger_path", None)  # an exit-and-restart rollback's outcome goes there
        if incident is not None and ledger is not None and decision.action == Action.ROLLBACK:
            incident = dataclasses.replace(incident, ledger=ledger)
        self.last_incident = incident
        replay = decision.replay or any(self._tell("wants_replay", decision))
        self.publisher.hand_off(incident, captured, wait_for_outcome=replay, rank=self.rank)
        self._tell("on_decision", decision, incident)
        if decision.ends_run and not getattr(self.executor, "in_process", False):
            self.exit(decision)

    def _capture_scene(self, verdict: Verdict, findings: list) -> tuple[str, dict]:
        batch = {**self._batch_info, "samples": list(self._batch), "tokens": self._batch_tokens}
        return scene.capture(self.report_dir, verdict.ctx, findings, batch, self.stage.first_optimizer(),
                             {"step": self._step, "rollbacks": self.rollbacks}, self.overflow_mode,
                             self.rank, episode=self.rollbacks, rng=self.seams.rng_state())

    def _scaler_overflow(self, optimizer: Any, step: int) -> bool:
        """A step the loss scaler skips (:mod:`~megatron_patches.seams.loss_scale`). What was seen before
        the reduction is the scaler's business too (a scaled overflow shows on every rank): it is
        dropped, unless the watch calls this skip an incident, which then goes the whole way
        (parameters named, origin ranks, grading) on the unscaled gradients."""
        self.counters["scaler_overflows"] += 1
        before = self.origin.take()
        event = self._loss_scale.overflow(optimizer)
        if event is None:
            return True
        verdict = self.stage.run(optimizer, self.stage.entries_for(optimizer), step, before.flag,
                                 self.overflow_mode == "saturation")
        self._tell("after_check", step, True)
        self._incident(verdict, Action.SKIP_STEP, before, cause=event)
        self.stage.commit(verdict, accepted=False)
        return True

    def _peer_lost(self, step: int, error: Exception) -> NoReturn:
        exit_peer_lost(step, error, self.config.response.peer_timeout_s, self.close,
                       self.config.response.exit_codes.peer_lost)

    # --- what the executor calls -------------------------------------------------------------

    def replay_check(self, optimizer: Any, step: int) -> dict:
        """Run the check on gradients a loop has just recomputed for ``step`` (no update, no new
        incident). Returns ``{"flagged", "first"}``, identical on every rank."""
        with self.seams.unchecked():  # Megatron's own prepare_grads: no second pass through the hooks
            found_inf = bool(optimizer.prepare_grads())
        self._step, self._step_set = step, False
        result = {"flagged": False, "first": None}
        if found_inf:  # counted; a replay makes no new incident
            self.counters["scaler_overflows"] += 1
            self.origin.take()
        else:
            self._loss_scale.clear()
            if step % self.config.check_interval:
                return result
            verdict = self.stage.run(optimizer, self.stage.entries_for(optimizer), step, self.origin.take().flag,
                                     self.overflow_mode == "saturation")
            self.stage.commit(verdict, accepted=False)  # judged, but baselines stay as they were
            try:
                result = self.responder.replay_verdict(verdict)
            except PeerLost as error:
                self._peer_lost(step, error)
        self.seams.undo_prepare_on_skip(optimizer)  # no update follows (MindSpeed --reuse-fp32-param)
        return result

    def attach(self, executor: Any, rollbacks: int) -> None:
        """Make ``executor`` (:class:`~megatron_patches.protocols.Executor`) act on this guard's
        decisions; ``rollbacks``: how many the run has had so far (its ledger's count)."""
        self.executor, self.rollbacks = executor, rollbacks

    def add_callback(self, callback: Callback) -> None:
        """Let ``callback`` hear of this run's events (:class:`~megatron_patches.callbacks.Callback`)."""
        self.callbacks.append(callback)

    def _tell(self, event: str, *args: Any) -> list:
        """Call ``event`` (a :class:`~megatron_patches.callbacks.Callback` method) on every callback, in order."""
        return [getattr(callback, event)(*args) for callback in self.callbacks]

    def callback_of(self, kind: type[T]) -> Optional[T]:
        """The first callback added that is a ``kind``, or None (an integration finds its own)."""
        return next((callback for callback in self.callbacks if isinstance(callback, kind)), None)

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to one of :attr:`counters` (the hooks and seams report what they did here)."""
        self.counters[counter] += n

    def take_decision(self) -> Optional[Decision]:
        decision, self.decision = self.decision, None
        return decision

    def resolve(self, outcome: Outcome) -> None:
        """The executor's outcome for the held incident (replay verdict, blacklisted samples,
        rollback target); rank 0 publishes the record with it. Call on every rank."""
        if self.rank == 0:
            self.publisher.resolve(outcome)

    def new_episode(self, rollbacks: int) -> None:
        """After an in-process rollback: grading counts afresh, and drills that began are over."""
        self.rollbacks = rollbacks
        self.responder.policy.reset()
        self.drills.spend_started()

    def exit(self, decision: Decision) -> NoReturn:
        """Stop this rank cleanly for ``decision``: flush scenes and alerts, then exit with its
        code. Every rank reaches this from the same broadcast decision, so none is left waiting
        in a collective. The executor settles the decision first (the exit-and-restart one writes
        the ledger, and turns a rollback it cannot record into a critical stop)."""
        self._tell("before_exit", decision)
        if self.executor is not None:
            decision = self.executor.settle_exit(decision)
        code = exit_code(decision, self.config.response.exit_codes)
        self.close()
        log.warning("stopping with exit code %d", code)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        raise SystemExit(code)

    def close(self) -> None:
        """Write what is queued (held record, scenes, alerts)."""
        self.publisher.close()

