"""Megatron-Bridge's training loop (``megatron.bridge.training.pretrain``): iterations, batches,
checkpoint markers and rollback by exit and restart.

Bridge builds megatron-core's optimizer, so detection needs nothing here; this module gives the
guard what Megatron-LM's loop gives it through :mod:`..megatron_lm`, from Bridge's own objects
(its ``GlobalState``: the config container and ``train_state``), through three lazy targets
(:data:`~.targets.BRIDGE_TARGETS`, wrapped when a Bridge job imports them):

- ``checkpointing.load_checkpoint``: Bridge's one load, after the optimizer and scheduler are
  built. Before it, the ledger beside ``checkpoint.save`` decides, as for Megatron-LM:
  ``train.iterations_to_skip`` += the incident iterations (Bridge reads them as logged), the
  scheduler's and param groups' learning-rate bounds times the ledger's ``lr_scale`` (the
  scheduler's ``override_opt_param_scheduler`` on, so its load keeps them), and on a rollback
  request ``checkpoint.ckpt_step`` = the newest certified checkpoint. After it, the loaded
  iteration is checked against the request and the request cleared.
- ``train.train_step``: the iteration (``train_state.step + 1``, Bridge's logged number) and the
  batch's sample positions for the monitor.
- ``checkpointing.save_checkpoint``: ``iter_N/megatron_patches.json`` and the per-rank guard state,
  certified or disqualified by the checks that follow (:class:`.CheckpointMarks`).

Recovery as in Megatron-LM's loop: under ``recovery.mode: in_process`` (the default) a rollback is
made inside the ``train_step`` call that brought the decision (:mod:`..megatron_lm.inprocess`, with
Bridge's ``train_state`` counters); where it cannot be, and under ``recovery.mode: restart``, every
rank exits 84 with the ledger's request and the launcher runs the same command again.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Optional

from ... import collectives, safe_mode
from ...callbacks import Callback, attached
from ...errors import UserError, exit_refused
from ...protocols import Guard
from .. import wrappers
from ..megatron_lm import sample_positions
from ..megatron_lm.inprocess import InProcessRollback, LoopCounters
from ..megatron_lm.checkpoints import CheckpointMarks, newest_healthy_iteration, read_tracker, saved_lr_scale, warn0
from ..megatron_lm.rollback import (Rollback, put_group_bounds, scale_group_bounds, scale_scheduler_bounds,
                                   scaled_group_bounds, skip_iterations)

log = logging.getLogger("megatron_patches")


class BridgeMarks(CheckpointMarks):
    """The checkpoint markers, with Bridge's config and async-save queue instead of Megatron-LM's args."""

    def __init__(self, monitor: Guard, session: "BridgeSession"):
        super().__init__(monitor)
        self.session = session

    def save_root(self) -> Optional[str]:
        return self.session.config().checkpoint.save

    def async_save(self) -> bool:
        return bool(self.session.config().checkpoint.async_save)

    def async_saves_finalized(self) -> bool:
        from megatron.bridge.training.checkpointing import is_empty_async_queue

        return bool(is_empty_async_queue(self.session.state))

    def finish_async_saves(self) -> None:
        from megatron.bridge.training.checkpointing import maybe_finalize_async_save

        maybe_finalize_async_save(global_state=self.session.state, ckpt_cfg=self.session.config().checkpoint,
                                  blocking=True)


class BridgeCounters(LoopCounters):
    """Bridge's iteration and sample counters (its ``train_state``) for the in-process redo."""

    scheduler_argument = "scheduler"

    def __init__(self, state: Any):
        self.state = state

    def get(self) -> tuple[int, int]:
        train_state = self.state.train_state
        return int(train_state.step), int(train_state.consumed_train_samples)

    def set(self, done: int, consumed: int) -> None:
        self.state.train_state.step, self.state.train_state.consumed_train_samples = done, consumed

    def total(self) -> int:
        return int(self.state.cfg.train.train_iters)


class BridgeSession(Callback):
    """What one Megatron-Bridge process needs between the wrapper calls; a callback of its monitor."""

    def __init__(self, monitor: Guard):
        self.monitor = monitor
        self.state: Any = None
        """Bridge's ``GlobalState``, from the first wrapped call that carries it."""
        self.rollback: Optional[Rollback] = None
        """The ledger's side; None before the load, and without ``checkpoint.save``/``load``."""
        self.marks = BridgeMarks(monitor, self)
        monitor.add_callback(self.marks)
        self._started = False
        self._loaded = False
        self._lr_bounds: dict = {}
        self._resume_from: Optional[int] = None
        self.in_process: Optional[InProcessRollback] = None
        """Snapshots and in-process rollbacks (``recovery.mode: in_process``, with a checkpoint directory)."""

    def config(self) -> Any:
        return self.state.cfg

    # -- before the first iteration -------------------------------------------------------------

    def start(self, state: Any, model: Any, optimizer: Any, scheduler: Any) -> None:
        """Once, before the checkpoint load (or, without one, before the first iteration): the ledger."""
        if self._started:
            return
        self._started, self.state = True, state
        cfg = state.cfg
        recovery = self.monitor.state.config.recovery
        if recovery.keep_checkpoints is not None:
            if collectives.rank() == 0:
                log.error("recovery.keep_checkpoints is the tiny-GPT harness's retention; Megatron-Bridge keeps "
                          "what its own checkpoint config says and megatron_patches deletes none there: remove the key")
            exit_refused(collectives.rank())
        root = cfg.checkpoint.save or cfg.checkpoint.load
        if root is None:
            warn0("neither checkpoint.save nor checkpoint.load set: a rollback decision exits with %d but there "
                  "is no checkpoint or ledger to resume from", self.monitor.state.config.response.exit_codes.rollback)
            return
        try:
            self.rollback = Rollback(self.monitor, root)
        except UserError as error:  # a ledger nobody can apply: one line, every rank exits 2
            if collectives.rank() == 0:
                log.error("%s", error)
            exit_refused(collectives.rank())
        if recovery.mode == "in_process":
            def before_redone(optimizer: Any, scheduler: Any) -> None:
                self.before_step(state, model, optimizer, scheduler)

            self.in_process = InProcessRollback(self.monitor, self.rollback, before_redone, BridgeCounters(state))
            warn0("rollbacks in process%s", self.in_process.memory_bound(optimizer))
        ledger = self.rollback.restart.ledger
        skips = skip_iterations(ledger)
        if skips:
            cfg.train.iterations_to_skip = sorted(set(cfg.train.iterations_to_skip or []) | set(skips))
            warn0("ledger %s: skipping iterations %s (train.iterations_to_skip)", root, skips)
        if ledger.lr_scale != 1.0:
            self._scale_lr(scheduler, optimizer, ledger.lr_scale)
        if ledger.rollback_requested:
            self._load_newest_healthy(cfg, root, ledger.rollback_requested)
        if ledger.disabled_features:
            self._safe_mode(model, ledger.disabled_features)

    def _safe_mode(self, model: Any, names: Any) -> None:
        """The ledger's safe mode on retry: dropout goes off in the built model; every other feature
        needs the model or its wrappers built again, before this point in Bridge's setup."""
        wanted = safe_mode.expand(names)
        if "dropout" in wanted:
            safe_mode.dropout_off(module for chunk in model for module in chunk.modules())
        rest = [name for name in wanted if name != "dropout"]
        warn0("safe mode after rollback %d: %s%s", self.rollback.restart.ledger.rollbacks,
              "dropout switched off in the built model" if "dropout" in wanted else "dropout left on",
              f"; NOT switched off in Megatron-Bridge's loop (they need the model built again, which the guard "
              f"does not reach there yet): {', '.join(rest)}" if rest else "")

    def _scale_lr(self, scheduler: Any, optimizer: Any, scale: float) -> None:
        """The scheduler's bounds now (its load then keeps them); the param groups' after the load,
        matched first to the checkpoint's saved scale, by which the optimizer finds its saved groups."""
        scale_scheduler_bounds(scheduler, scale)
        scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
        self._lr_bounds = scaled_group_bounds(optimizer, scale)
        warn0("ledger %s: learning rate scaled by %.3g (max_lr %.4g, min_lr %.4g; the scheduler's "
              "override_opt_param_scheduler on)", self.rollback.root, scale, scheduler.max_lr, scheduler.min_lr)

    def _load_newest_healthy(self, cfg: Any, root: str, request: dict) -> None:
        target = newest_healthy_iteration(root)
        asked = request.get("iteration", request.get("from_step"))
        if target is None:
            log.error("ledger %s asks for a rollback (from iteration %s) but no checkpoint there is certified "
                      "healthy; stopping", root, asked)
            self.rollback._stop(f"ledger {root} asks for a rollback but no checkpoint there is marked healthy")
        if cfg.checkpoint.load is None or os.path.abspath(cfg.checkpoint.load) != os.path.abspath(root):
            warn0("rollback: checkpoint.load %s replaced by %s (where the healthy checkpoints are)",
                  cfg.checkpoint.load, root)
            cfg.checkpoint.load = root
        cfg.checkpoint.ckpt_step = target
        self._resume_from = target
        warn0("rollback requested at iteration %s: loading healthy checkpoint iteration %d from %s (tracker: %s)",
              asked, target, root, read_tracker(root))

    def before_load(self, state: Any, model: Any, optimizer: Any, scheduler: Any) -> None:
        """Right before Bridge's ``load_checkpoint``: the ledger, then the param groups given the
        bounds the checkpoint about to be loaded was saved with."""
        self.start(state, model, optimizer, scheduler)
        cfg = state.cfg
        iteration = cfg.checkpoint.ckpt_step
        if iteration is None:
            iteration = read_tracker(cfg.checkpoint.load)
        scale = saved_lr_scale(cfg.checkpoint.load, iteration) if iteration else 1.0
        if scale != 1.0 and optimizer is not None:
            scale_group_bounds(optimizer, scale)

    def after_load(self, optimizer: Any, scheduler: Any) -> None:
        """Right after the load (or before the first iteration when Bridge loaded none): the
        ledger's bounds back on the param groups, a requested rollback checked against the
        iteration loaded, the guard state saved with it restored."""
        if self._loaded:
            return
        self._loaded = True
        cfg, loaded = self.config(), int(self.state.train_state.step)
        if self._lr_bounds and optimizer is not None:
            put_group_bounds(optimizer, self._lr_bounds)
            if scheduler is not None:
                scheduler.step(increment=0)
        self.marks.after_load(cfg.checkpoint.load, loaded)
        if self._resume_from is None:
            if self.rollback is not None and self.rollback.restart.ledger.rollback_requested:
                self.rollback._stop(f"ledger {self.rollback.root} asks for a rollback but Megatron-Bridge loaded "
                                    "no checkpoint: set checkpoint.load to the checkpoint.save directory")
            return
        if loaded != self._resume_from:
            if collectives.rank() == 0:
                log.error("rollback asked to resume from healthy checkpoint iteration %d, but Megatron-Bridge "
                          "loaded iteration %s; stopping", self._resume_from, loaded)
            self.rollback._stop(f"resumed from iteration {loaded}, not the healthy checkpoint iteration "
                                f"{self._resume_from} the rollback asked for")
        ledger = self.rollback.restart.ledger
        self.rollback.restart.resumed({"resumed_from": loaded, "lr_scale": ledger.lr_scale,
                                       "iterations_to_skip": list(cfg.train.iterations_to_skip or []),
                                       "disabled_features": list(ledger.disabled_features)})
        lr = optimizer.param_groups[0]["lr"] if optimizer is not None and optimizer.param_groups else None
        warn0("resumed from healthy checkpoint iteration %s with lr %s", loaded, lr)

    # -- each iteration --------------------------------------------------------------------------

    def before_step(self, state: Any, model: Any, optimizer: Any, scheduler: Any) -> None:
        """Before each ``train_step``: pending markers written, the iteration and batch for the monitor."""
        self.start(state, model, optimizer, scheduler)
        self.after_load(optimizer, scheduler)
        self.marks.write_finalized()
        iteration = int(state.train_state.step) + 1  # as Bridge logs it
        self.monitor.set_step(iteration)
        cfg, consumed = state.cfg, int(state.train_state.consumed_train_samples)
        self.monitor.set_batch(sample_positions(getattr(cfg.dataset, "dataloader_type", None),
                                                int(cfg.train.micro_batch_size), consumed),
                               iteration=iteration, consumed_train_samples=consumed)

    def after_save(self, state: Any, model: Any, non_persistent: bool) -> None:
        self.state = self.state or state
        lr_scale = self.rollback.lr_scale if self.rollback is not None else 1.0
        self.marks.after_save(int(state.train_state.step), model, non_persistent, lr_scale)




def session(monitor: Guard) -> BridgeSession:
    """The run's session: a callback of its monitor, made at the first call (a new monitor gets a new one)."""
    return attached(monitor, BridgeSession)


# --- wrapt wrappers (lazy registry targets under megatron.bridge.training) ------------------------


def load_checkpoint_wrapper(wrapped, instance, args, kwargs):
    """``load_checkpoint(state, model, optimizer, opt_param_scheduler, ...)``: the ledger before, its checks after."""
    monitor = wrappers.get_monitor()
    if monitor is None:
        return wrapped(*args, **kwargs)
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    optimizer, scheduler = bound.arguments.get("optimizer"), bound.arguments.get("opt_param_scheduler")
    run = session(monitor)
    run.before_load(bound.arguments["state"], bound.arguments["model"], optimizer, scheduler)
    result = wrapped(*args, **kwargs)
    run.after_load(optimizer, scheduler)
    return result


def train_step_wrapper(wrapped, instance, args, kwargs):
    """``train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state, ...)``:
    iteration and batch for the monitor; in process, the batches taped and a snapshot or rollback after."""
    monitor = wrappers.get_monitor()
    if monitor is None:
        return wrapped(*args, **kwargs)
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    state, run = bound.arguments["global_state"], session(monitor)
    run.before_step(state, bound.arguments["model"], bound.arguments["optimizer"], bound.arguments.get("scheduler"))
    iteration = int(state.train_state.step) + 1
    if run.in_process is not None:
        run.in_process.before_iteration(iteration, bound.arguments["data_iterator"],
                                        int(state.train_state.consumed_train_samples))
    result = wrapped(*args, **kwargs)
    if run.in_process is not None:  # a snapshot, or a rollback made here: the redone iteration's result
        result = run.in_process.after_iteration(iteration, wrapped, bound, result)
    return result


save_checkpoint_wrapper = wrappers.save_checkpoint_wrapper(session, "state")
