"""The state of one guarded run, in one typed object handed down from the monitor.

:class:`RunState` declares everything a run keeps between calls, grouped as torchtitan's
``Trainer`` declares its members: what the run was made from, what the hooks and seams keep beside
the pipeline, the pipeline's stages, the step being made, what the last check left, and who acts
on the decisions. :func:`build` makes a fresh one from the config; nothing per run lives in a
module global, so a second run in the same process starts clean. A function that needs the run
takes the ``RunState`` as an argument (:mod:`megatron_patches.slow_path`), so a reader sees what
it may touch.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from . import cause, collectives, detectors as detector_plugins, inject
from .callbacks import Callback
from .check import CheckStage, resolve_overflow_mode
from .config import Config
from .decisions import Decision
from .detectors import Detector
from .incidents import Incident
from .moe_routing import RoutingWatch
from .protocols import Executor, LossScaleWatch, ModelChunks, OriginWatch, RerunWatch, Seams
from .publish import Publisher
from .respond import Responder

COUNTERS = ("checked_steps", "skipped_steps", "incidents", "scaler_overflows", "injected", "served_norms",
            "norm_kernel_calls", "shared_norm_reads")
"""The run's counters (``monitor.counters``), totals over the job."""


@dataclass
class StepClock:
    """The optimizer step being made: named by the loop (``set_step``), else counted at each
    ``prepare_grads``. 1-based, as Megatron prints iterations."""

    step: int = 0
    named: bool = False
    """Whether the loop named :attr:`step` since the last ``prepare_grads``."""

    def upcoming(self) -> int:
        """The step whose gradients are being made now (before ``prepare_grads`` counts it)."""
        return self.step + (0 if self.named else 1)

    def name(self, step: int) -> None:
        self.step, self.named = int(step), True

    def tick(self) -> int:
        """At ``prepare_grads``: the step those gradients belong to."""
        if not self.named:
            self.step += 1
        self.named = False
        return self.step


@dataclass(frozen=True)
class Batch:
    """What this rank feeds in the step being made (``set_batch``)."""

    samples: tuple[int, ...] = ()
    """Dataset indices, for the incident record."""
    tokens: Optional[list] = None
    """The micro-batch tensors, saved in fault scenes."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """More fields for the record's and scene's ``batch``, the same on every rank (Megatron-LM's
    ``iteration`` and ``consumed_train_samples``)."""


@dataclass(kw_only=True, eq=False)
class RunState:
    """Everything one guarded run keeps between calls (``monitor.state``)."""

    # --- what the run was made from -------------------------------------------------------
    config: Config
    seams: Seams
    """Megatron's side, as the core may use it."""
    report_dir: str
    """Where records, history and scenes go (absolute)."""

    # --- beside the pipeline: what the hooks and seams keep between calls ------------------
    drills: inject.Injector
    """This run's fault drills (``config.inject``; an injector without specs does nothing)."""
    model_chunks: ModelChunks
    """The model chunks each optimizer steps, and each DDP bucket group's parameters."""
    rerun: RerunWatch
    """Megatron's rerun of a checked step in place: its verdict and trace."""
    peers: collectives.BoundedGroup
    """The guard's own gloo group for the slow path (made at the first check)."""

    # --- the pipeline's stages ---------------------------------------------------------------
    detectors: list[Detector]
    stage: CheckStage
    """check: the local vector, the all-reduce, the verdict."""
    origin: OriginWatch
    """Which rank a fault entered on, before the data-parallel reduction."""
    routing: RoutingWatch
    """Tokens per expert and router finiteness of the step being made (mixture-of-experts)."""
    loss_scale: LossScaleWatch
    """fp16: which of the scaler's skipped steps are incidents."""
    responder: Responder
    """respond: the bounded gather, rank 0's decision, the broadcast."""
    publisher: Publisher
    """publish: records, history, scenes, alerts."""

    # --- the step being made -------------------------------------------------------------------
    clock: StepClock
    batch: Batch = field(default_factory=Batch)
    prepared: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    """Optimizers whose ``prepare_grads`` ran this step (their ``clip_grad_norm`` is not checked again)."""
    drills_checked: bool = False
    """Whether the drills were matched against the model (once, at the first step)."""
    overflow_mode: Optional[str] = None
    """'ieee' or 'saturation' once resolved (:meth:`resolved_overflow_mode`)."""

    # --- what the checks left ----------------------------------------------------------------------
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    last_total_norm: Optional[float] = None
    norm_trail: deque = field(default_factory=lambda: deque(maxlen=cause.TRAIL))
    """The total gradient norms of the last clean checked steps since the last rollback (a growth
    before a fault is a sign of numerics: :func:`~megatron_patches.cause.growth_of`)."""
    last_layer_norms: dict[str, float] = field(default_factory=dict)
    """Per-layer gradient norms of the last checked step (keys as in grad_history.jsonl)."""
    decision: Optional[Decision] = None
    """The last incident's decision, identical on every rank, until the loop takes it."""
    last_incident: Optional[Incident] = None
    """The last incident as rank 0 assembled it (None on the other ranks)."""

    # --- who acts on the decisions, and who hears of them ----------------------------------------
    executor: Optional[Executor] = None
    """The recovery executor. Unless it acts in process, the monitor itself ends the job on stop
    and rollback decisions."""
    rollbacks: int = 0
    """Rollbacks the run has had so far (the ledger's count)."""
    callbacks: list[Callback] = field(default_factory=list)
    """The integrations that hear of the run's events, in the order added."""

    def resolved_overflow_mode(self) -> str:
        """'ieee' or 'saturation'; 'auto' is asked on the rank's own device at the first use."""
        if self.overflow_mode is None:
            self.overflow_mode = resolve_overflow_mode(self.config.overflow_mode)
        return self.overflow_mode


def build(config: Config, seams: Seams) -> RunState:
    """A fresh run's state. The drills come first: a bad spec stops the start before anything is
    made. Poison drills ask which step and rank a sample is fed on (the clock)."""
    clock = StepClock()
    drills = inject.build(config.inject, clock=lambda: (clock.upcoming(), collectives.rank()))
    model_chunks = seams.model_chunks()
    peers = collectives.BoundedGroup(config.response.peer_timeout_s)
    detectors = detector_plugins.build(config, seams.parallel_state, clock.upcoming,
                                       lambda step: step % config.check_interval == 0)
    report_dir = os.path.abspath(config.report_dir)
    return RunState(
        config=config, seams=seams, report_dir=report_dir,
        drills=drills, model_chunks=model_chunks, rerun=seams.rerun_watch(), peers=peers,
        detectors=detectors, stage=CheckStage(config, detectors, peers, model_chunks, seams),
        origin=seams.origin_watch(config.response.origin_check, config.detectors.peak.min_ratio
                                  if config.detectors.peak.enabled else None),
        routing=RoutingWatch(clock.upcoming, lambda step: step % config.check_interval == 0),
        loss_scale=seams.loss_scale_watch(config.detectors.loss_scale),
        responder=Responder(config, detectors, peers, seams.record_fields, seams.parallel_state),
        publisher=Publisher(config, report_dir, seams), clock=clock)


def tell(state: RunState, event: str, *args: Any) -> list:
    """Call ``event`` (a :class:`~megatron_patches.callbacks.Callback` method) on every callback, in order."""
    return [getattr(callback, event)(*args) for callback in state.callbacks]
