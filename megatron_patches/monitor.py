"""The gradient check that runs right before clipping: the guard's entry point.

Per checked step the fast path costs one fused pass over the gradients
(``torch._foreach_norm``, two in saturation mode), one small all-reduce of a few flags and
per-layer sums, and one host read. Only when a flag is up does the slow path look inside the
offending tensors, gather every rank's findings to rank 0 (which writes one incident record)
and broadcast the decision, so that all ranks act alike and none waits in a collective.

:class:`GradMonitor` is a thin driver: the run's state is one typed
:class:`~megatron_patches.run_state.RunState` (``monitor.state``), and the monitor hands each
checked step down the pipeline with it::

    hooks -> check (check.CheckStage: vector, all-reduce, verdicts)
          -> locate (slow_path: this rank's RankReport, gathered to rank 0)
          -> respond (respond: the gather, decide.decide on rank 0, the Decision broadcast)
          -> publish (publish.Publisher: record made once, scenes, alerts, history)
          -> the executor acts on the Decision (recovery) and hands back an Outcome
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any, Mapping, NoReturn, Optional

import torch

from . import collectives, inject, run_state, slow_path
from .callbacks import Callback
from .check import Verdict
from .collectives import PeerLost
from .config import Config
from .decisions import Action, Decision, exit_code
from .detectors import audit
from .errors import exit_refused
from .incidents import Outcome
from .protocols import PreReduction, Seams
from .run_state import RunState

log = logging.getLogger("megatron_patches")

class GradMonitor:
    """Checks the gradients an optimizer is about to clip and apply.

    Made by :func:`megatron_patches.seams.build_monitor` and activated by
    :func:`megatron_patches.install`; the hooks call :meth:`after_prepare_grads` and
    :meth:`before_grad_reduction`. Executors and integrations use what
    :class:`megatron_patches.protocols.Guard` lists.
    """

    def __init__(self, config: Config, seams: Seams):
        """``seams``: Megatron's side (:class:`megatron_patches.seams.MegatronSeams`)."""
        self.state: RunState = run_state.build(config, seams)
        """Everything this run keeps between calls."""

    @property
    def overflow_mode(self) -> str:
        """'ieee' or 'saturation'; 'auto' is asked on the rank's own device at the first use."""
        return self.state.resolved_overflow_mode()

    @property
    def counters(self) -> Mapping[str, int]:
        """The run's counters, read-only (:meth:`count` adds to them)."""
        return MappingProxyType(self.state.counters)

    @property
    def rank(self) -> int:
        # Read each time: the monitor is usually made before torch.distributed starts.
        return collectives.rank()

    # --- what the training loop may tell us ---------------------------------------------

    @property
    def step(self) -> int:
        return self.state.clock.step

    def set_step(self, step: int) -> None:
        """Name the optimizer step about to run (1-based, as Megatron prints iterations).
        Without it the monitor counts ``prepare_grads`` calls itself."""
        self.state.clock.name(step)

    def set_batch(self, sample_indices: list[int], tokens: Optional[list] = None, **info: Any) -> None:
        """The dataset indices this rank feeds in the current step (for incident records), and
        optionally the micro-batch tensors themselves (saved in fault scenes). ``info``: more
        fields for the record's and scene's ``batch``, the same on every rank (Megatron-LM's
        ``iteration`` and ``consumed_train_samples``)."""
        self.state.batch = run_state.Batch(tuple(sample_indices), tokens, info)

    def state_dict(self) -> dict:
        """What a checkpoint carries so a restart keeps its baselines and counters."""
        return {
            "step": self.state.clock.step,
            "counters": dict(self.state.counters),
            "detectors": {d.name: d.state_dict() for d in self.state.detectors},
        }

    def load_state_dict(self, state: dict) -> None:
        clock = self.state.clock
        clock.step = int(state.get("step", clock.step))
        # Counters are totals over the job's life: a rollback in this process must not lower
        # them, a fresh process resuming takes the saved ones.
        for name, value in state.get("counters", {}).items():
            self.state.counters[name] = max(self.state.counters.get(name, 0), value)
        for detector in self.state.detectors:
            if detector.name in state.get("detectors", {}):
                detector.load_state_dict(state["detectors"][detector.name])

    # --- hooks ---------------------------------------------------------------------------

    def after_prepare_grads(self, optimizer: Any, found_inf: bool) -> bool:
        """Run after Megatron's ``prepare_grads``; returns True to skip the update."""
        run = self.state
        if not run.drills_checked:  # once, at the first step, when every rank is here
            run.drills_checked = True
            self._refuse_at_start(optimizer)
        step = run.clock.tick()
        run.prepared.add(optimizer)
        if found_inf:  # fp16: the loss scaler found an overflow and skips the step
            return self._scaler_overflow(optimizer, step)
        run.loss_scale.clear()
        entries = run.stage.entries_for(optimizer)
        if run.drills:
            stepped = run.seams.current_grads(optimizer, entries)
            run.counters["injected"] += run.drills.fire_on_optimizer(optimizer, entries, stepped, step, self.rank)
        if step % run.config.check_interval:
            return False
        return self._check(optimizer, entries, step)

    def _refuse_at_start(self, optimizer: Any) -> None:
        """Drills that cannot act, and a state audit where it cannot hold, stop every rank (exit 2)."""
        run = self.state
        poison = [spec.text for spec in run.drills.specs if spec.kind == "poison"]
        if poison and not run.drills.poison_asked:  # the same on every rank: the loop's code, not its data
            if self.rank == 0:
                log.error("drill(s) %s cannot act: this training loop feeds no poisoned sample (the tiny-GPT harness "
                          "does, and Megatron-LM's loop with --dataloader-type single); rehearse a bad batch with an "
                          "input drill instead, e.g. bitflip:step=3,phase=input,module=embedding.word_embeddings,bit=30",
                          ", ".join(map(repr, poison)))
            exit_refused(self.rank)
        inject.refuse_unmatched(run.drills, run.model_chunks.chunks_for(optimizer), self.rank,
                                run.seams.current_grads(optimizer, run.stage.entries_for(optimizer)),
                                run.seams.parallel_state())
        if run.config.detectors.audit.enabled:
            audit.refuse(run.seams.audit_refusal(optimizer), self.rank)

    def after_update(self, optimizer: Any) -> None:
        """Right after ``optimizer`` applied an update: the state audit fingerprints what it holds."""
        run, entries = self.state, self.state.stage.entries_for(optimizer)
        for detector in run.detectors:
            detector.after_update(optimizer, entries, (run.clock.step + 1) % run.config.check_interval == 0)

    def before_direct_clip(self, optimizer: Any) -> None:
        """``clip_grad_norm`` called without ``prepare_grads`` first: check, zero bad grads."""
        run = self.state
        if optimizer in run.prepared:
            run.prepared.discard(optimizer)
            return
        entries = run.stage.entries_for(optimizer)
        if self._check(optimizer, entries, run.clock.step, action=Action.ZERO_GRADS):
            for _, grad in run.seams.current_grads(optimizer, entries):
                if grad is not None:
                    grad.zero_()

    def before_grad_reduction(self, model_chunks: Any) -> None:
        """Runs at ``finalize_model_grads``. For Megatron DDP chunks the buckets' reductions start
        in their own ``start_grad_sync`` (under overlap, already during backward): phase=local drills
        and the origin pass go in there (:mod:`~megatron_patches.seams.grad_sync`); for other models, here."""
        run = self.state
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        step = self.state.clock.upcoming()
        if not run.seams.covers(chunks):
            if run.drills:
                run.counters["injected"] += len(run.drills.apply(step, "local", self.rank, run.seams.named_grads(chunks)))
            if step % run.config.check_interval == 0 and not run.seams.reduced_in_backward(chunks):
                run.origin.before_reduction(chunks)
        for detector in run.detectors:
            detector.before_reduction(chunks, step)

    # --- check -> locate -> respond -> publish ---------------------------------------------

    def _check(self, optimizer: Any, entries: list, step: int, action: Action = Action.SKIP_STEP) -> bool:
        run = self.state
        before = run.origin.take()
        verdict = self._verdict(optimizer, step, before, entries)
        self._note_checked(optimizer, entries, verdict)
        self._tell("after_check", step, verdict.flagged)
        run.origin.commit(accepted=not verdict.flagged)
        if not verdict.flagged:
            run.stage.commit(verdict, accepted=True)
            run.norm_trail.append(verdict.ctx.total_norm)
            return False
        self._incident(verdict, action, before)
        run.stage.commit(verdict, accepted=False)
        return True

    def _verdict(self, optimizer: Any, step: int, before: PreReduction, entries: Optional[list] = None,
                 replay: bool = False) -> Verdict:
        """The check stage on ``optimizer``'s gradients for ``step`` (``entries``: its gradient
        pairs, looked up when not given), with what this rank saw before the reduction."""
        run = self.state
        if entries is None:
            entries = run.stage.entries_for(optimizer)
        return run.stage.run(optimizer, entries, step, before.flag, run.resolved_overflow_mode() == "saturation",
                             replay=replay)

    def _note_checked(self, optimizer: Any, entries: list, verdict: Verdict) -> None:
        """A training step's check: counters, the served norm, the history line."""
        run, ctx = self.state, verdict.ctx
        run.drills.forget_before(ctx.step)
        run.counters["checked_steps"] += 1
        run.last_total_norm = ctx.total_norm
        if run.config.serve_norm:
            run.seams.remember_norm(optimizer, ctx.step, ctx.total_norm, entries, ctx.grads)
        run.last_layer_norms = verdict.layer_norms
        if self.rank == 0:
            run.publisher.write_history(ctx.step, ctx.total_norm, verdict.layer_sq)

    def _incident(self, verdict: Verdict, action: Action, before: PreReduction, cause: Optional[Any] = None) -> None:
        """The slow path (:func:`~megatron_patches.slow_path.handle_incident`), then the end of the
        run if the decision says so and the executor does not act in process.
        ``cause``: the loss scaler's event that made this skipped step an incident."""
        decision = slow_path.handle_incident(self.state, verdict, action, before, cause)
        executor = self.state.executor
        if decision.ends_run and not (executor is not None and executor.in_process):
            self.exit(decision)

    def _scaler_overflow(self, optimizer: Any, step: int) -> bool:
        """A step the loss scaler skips (:mod:`~megatron_patches.seams.loss_scale`). What was seen before
        the reduction is the scaler's business too (a scaled overflow shows on every rank): it is
        dropped, unless the watch calls this skip an incident, which then goes the whole way
        (parameters named, origin ranks, grading) on the unscaled gradients."""
        run = self.state
        run.counters["scaler_overflows"] += 1
        before = run.origin.take()
        event = run.loss_scale.overflow(optimizer)
        if event is None:
            return True
        verdict = self._verdict(optimizer, step, before)
        self._tell("after_check", step, True)
        self._incident(verdict, Action.SKIP_STEP, before, cause=event)
        run.stage.commit(verdict, accepted=False)
        return True

    # --- what the executor calls -------------------------------------------------------------

    def replay_check(self, optimizer: Any, step: int) -> dict:
        """Run the check on gradients a loop has just recomputed for ``step`` (no update, no new
        incident). Returns ``{"flagged", "first"}``, identical on every rank."""
        run = self.state
        with run.seams.unchecked():  # Megatron's own prepare_grads: no second pass through the hooks
            found_inf = bool(optimizer.prepare_grads())
        run.clock.step, run.clock.named = step, False
        result = {"flagged": False, "first": None}
        if found_inf:  # counted; a replay makes no new incident
            run.counters["scaler_overflows"] += 1
            run.origin.take()
        else:
            run.loss_scale.clear()
            if step % run.config.check_interval:
                return result
            verdict = self._verdict(optimizer, step, run.origin.take(), replay=True)
            run.stage.commit(verdict, accepted=False)  # judged, but baselines stay as they were
            try:
                result = run.responder.replay_verdict(verdict)
            except PeerLost as error:
                slow_path.peer_lost(run, step, error)
        run.seams.undo_prepare_on_skip(optimizer)  # no update follows (MindSpeed --reuse-fp32-param)
        return result

    def attach(self, executor: Any, rollbacks: int) -> None:
        """Make ``executor`` (:class:`~megatron_patches.protocols.Executor`) act on this guard's
        decisions; ``rollbacks``: how many the run has had so far (its ledger's count)."""
        self.state.executor, self.state.rollbacks = executor, rollbacks

    def add_callback(self, callback: Callback) -> None:
        """Let ``callback`` hear of this run's events (:class:`~megatron_patches.callbacks.Callback`)."""
        self.state.callbacks.append(callback)

    def _tell(self, event: str, *args: Any) -> list:
        """Call ``event`` (a :class:`~megatron_patches.callbacks.Callback` method) on every callback, in order."""
        return run_state.tell(self.state, event, *args)

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to one of :attr:`counters` (the hooks and seams report what they did here)."""
        self.state.counters[counter] += n

    def take_decision(self) -> Optional[Decision]:
        decision, self.state.decision = self.state.decision, None
        return decision

    def resolve(self, outcome: Outcome) -> None:
        """The executor's outcome for the held incident (replay verdict, blacklisted samples,
        rollback target); rank 0 publishes the record with it. Call on every rank."""
        if self.rank == 0:
            self.state.publisher.resolve(outcome)

    def new_episode(self, rollbacks: int) -> None:
        """After an in-process rollback: grading counts afresh, and drills that began are over."""
        self.state.rollbacks = rollbacks
        self.state.responder.policy.reset()
        self.state.norm_trail.clear()
        self.state.drills.spend_started()
        for detector in self.state.detectors:
            detector.forget()
        self._tell("after_rollback", rollbacks)

    def exit(self, decision: Decision) -> NoReturn:
        """Stop this rank cleanly for ``decision``: flush scenes and alerts, then exit with its
        code. Every rank reaches this from the same broadcast decision, so none is left waiting
        in a collective. The executor settles the decision first (the exit-and-restart one writes
        the ledger, and turns a rollback it cannot record into a critical stop)."""
        self._tell("before_exit", decision)
        if self.state.executor is not None:
            decision = self.state.executor.settle_exit(decision)
        code = exit_code(decision, self.state.config.response.exit_codes)
        self.close()
        log.warning("stopping with exit code %d", code)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        raise SystemExit(code)

    def close(self) -> None:
        """Write what is queued (held record, scenes, alerts)."""
        self.state.publisher.close()
