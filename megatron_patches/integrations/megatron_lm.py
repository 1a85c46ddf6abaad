"""Megatron-LM's training loop (``pretrain_gpt.py``): iterations, batches, exit-and-restart.

Three wrappers, declared in :mod:`megatron_patches.patching.registry` as optional targets
(``megatron.training`` exists only in a Megatron-LM checkout):

- ``get_optimizer_param_scheduler``: runs once, after the optimizer is built and before the
  checkpoint is loaded; the first moment Megatron's args and the optimizer both exist. Attaches
  :class:`~megatron_patches.recovery.ExitAndRestart` with the ledger next to ``--save`` and, from
  that ledger, points ``--load``/``--ckpt-step`` at the newest healthy checkpoint when a rollback
  was requested, adds the incident iterations to ``args.iterations_to_skip`` and scales the
  learning rate (``args.lr``/``min_lr``/``lr_warmup_init`` and each param group's ``max_lr``/
  ``min_lr``, with ``--override-opt_param-scheduler`` semantics).
- ``train_step``: tells the monitor the iteration about to run (``args.curr_iteration + 1``, the
  number Megatron logs) and its batch (sample positions for ``--dataloader-type single``,
  ``iteration``, ``consumed_train_samples``); on the first call re-applies the scaled learning
  rate the checkpoint load overwrote; after each call writes the guard's counters and gradient
  norm to Megatron's TensorBoard / W&B writers (last rank only, values already on the host).
- ``save_checkpoint``: after Megatron saved ``iter_N/``, writes ``megatron_patches.json`` there:
  healthy when no incident happened since the previous save and every parameter is finite.

Recovery protocol for Megatron-LM (no in-process executor: the loop cannot be re-entered)::

    rollback decision (every rank)  -> ledger: rollbacks+1, lr_scale*=lr_factor,
                                       rollback_requested={iteration, skip_iterations}
                                    -> every rank exits 84 (torchrun itself then exits 1)
    launcher sees 84 or the ledger  -> runs the same command again
    next start, before the load     -> --load/--ckpt-step = newest healthy iter <= tracker
                                       iterations_to_skip += incident iterations, lr scaled
    first train_step                -> lr re-applied after the load, rollback_requested cleared
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import math
import os
from typing import Any, Optional

import torch

from .. import checkpoint, hooks
from . import mindspeed_llm
from ..protocols import Guard
from ..response import EXIT_ROLLBACK, Action, Decision, Severity

log = logging.getLogger("megatron_patches")

TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's record of the newest complete checkpoint in ``--save``."""

TAG_PREFIX = "megatron_patches/"

STATE_DIR = "megatron_patches_state"
"""Per-rank guard state saved inside each Megatron-LM ``iter_N`` directory: each rank's history
baselines describe its own tensors, so every rank keeps its own file."""


# --- pure helpers (no Megatron needed) ---------------------------------------------------------


def read_tracker(root: str) -> Optional[int]:
    """The iteration in Megatron's tracker file, or None (missing, or a ``release`` checkpoint)."""
    try:
        with open(os.path.join(root, TRACKER_FILE), encoding="utf-8") as handle:
            text = handle.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def newest_healthy_iteration(root: str) -> Optional[int]:
    """The newest Megatron-LM checkpoint marked healthy and complete: not past the tracker,
    which Megatron writes only once a save finished (async saves included)."""
    tracker = read_tracker(root)
    healthy = [step for step, _, ok in checkpoint.list_checkpoints(root)
               if ok and step > 0 and (tracker is None or step <= tracker)]
    return healthy[-1] if healthy else None


def to_iterations_to_skip(logged: list, core_version: tuple) -> list:
    """Megatron's ``iterations_to_skip`` entries for iterations numbered as Megatron logs them:
    up to core 0.16 the loop tests the 0-based index (``iteration in ...``), from 0.17 on the
    logged number (``iteration + 1 in ...``)."""
    shift = 0 if core_version >= (0, 17) else 1
    return [int(i) - shift for i in logged]


def skip_iterations(ledger: Any) -> list:
    """Every iteration (as logged) a rollback of this job asked to skip, from the ledger's events."""
    return sorted({int(i) for event in ledger.events for i in event.get("skip_iterations", [])})


def state_file(directory: str, rank: int) -> str:
    """Where one rank's guard state (detector baselines, counters) lies in an ``iter_N`` directory."""
    return os.path.join(directory, STATE_DIR, f"rank_{rank:05d}.json")


def write_marker(directory: str, iteration: int, healthy: bool, incidents: int, lr_scale: float = 1.0,
                 **extra: Any) -> None:
    """``megatron_patches.json`` in a Megatron-LM ``iter_N`` directory (atomic). ``lr_scale``: the
    ledger's learning-rate scale the checkpoint's param groups were saved with; ``extra``: more
    fields (``rerun``: why Megatron's rerun machine saved it)."""
    checkpoint.write_marker(directory, iteration, healthy, format="megatron-lm", incidents=incidents,
                            lr_scale=lr_scale, **extra)


def saved_lr_scale(root: str, iteration: int) -> float:
    """The learning-rate scale a checkpoint was saved with (1.0: unknown, or saved unscaled)."""
    try:
        with open(os.path.join(checkpoint.checkpoint_dir(root, iteration), checkpoint.MARKER),
                  encoding="utf-8") as handle:
            value = json.load(handle).get("lr_scale", 1.0)
    except (OSError, ValueError, AttributeError):
        return 1.0
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 1.0


def _core_version() -> tuple:
    from megatron.core import package_info

    return tuple(int(x) for x in package_info.__version__.split(".")[:2])


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _warn0(message: str, *args: Any) -> None:
    """A warning every rank would print alike: printed by global rank 0 only."""
    if _rank() == 0:
        log.warning(message, *args)


# --- per-process state ---------------------------------------------------------------------------


class MegatronLMSession:
    """What one Megatron-LM process needs between the wrapper calls."""

    def __init__(self, monitor: Guard):
        self.monitor = monitor
        self.root: Optional[str] = None
        self.restart: Optional[Any] = None
        """The :class:`~megatron_patches.recovery.ExitAndRestart` attached to the monitor."""
        self._episode_steps: list = []
        self._lr_bounds: dict = {}
        self._resume_from: Optional[int] = None
        self._first_step = True
        self._incidents_at_save = 0
        self._checked_before = 0
        self._pending_markers: list = []
        """(directory, iteration, healthy, marker fields) of async saves not finalized yet."""
        self._non_persistent_type: Optional[str] = None

    # -- before the checkpoint load ------------------------------------------------------------

    def before_scheduler(self, optimizer: Any) -> None:
        from megatron.training import get_args

        if self.restart is not None:
            return
        args = get_args()
        _refuse_unsupported(args, optimizer)
        self._advise(args)
        self.root = args.save or args.load
        if self.root is None:
            _warn0("neither --save nor --load given: a rollback decision exits with %d but "
                   "there is no checkpoint or ledger to resume from", EXIT_ROLLBACK)
            return
        from ..recovery import ExitAndRestart

        self.restart = ExitAndRestart(self.monitor, self.root, request_fields=self._rollback_fields)
        self.monitor.listeners.append(self._on_decision)
        self.monitor.before_exit.append(self._finalize_saves)  # before the ledger and the exit
        ledger = self.restart.ledger
        skips = skip_iterations(ledger)
        if skips:
            entries = to_iterations_to_skip(skips, _core_version())
            args.iterations_to_skip = sorted(set(args.iterations_to_skip or []) | set(entries))
            _warn0("ledger %s: skipping iterations %s (args.iterations_to_skip=%s)",
                   self.root, skips, args.iterations_to_skip)
        if ledger.lr_scale != 1.0:
            self._scale_lr(args, optimizer, ledger.lr_scale)
        if ledger.rollback_requested:
            self._load_newest_healthy(args, ledger.rollback_requested)
        self._match_saved_groups(args, optimizer)

    def _match_saved_groups(self, args: Any, optimizer: Any) -> None:
        """Give each param group the max_lr/min_lr the checkpoint about to be loaded was saved
        with: from 0.19 on, the optimizer finds each saved group by those values, among others.
        The ledger's scale goes onto the groups after the load (first train_step)."""
        if not args.load:
            return
        iteration = args.ckpt_step if getattr(args, "ckpt_step", None) is not None else read_tracker(args.load)
        scale = saved_lr_scale(args.load, iteration) if iteration else 1.0
        if scale == 1.0:
            return
        for group in optimizer.param_groups:
            for key in ("max_lr", "min_lr"):
                if group.get(key) is not None:
                    group[key] *= scale

    def _advise(self, args: Any) -> None:
        if getattr(args, "check_for_nan_in_loss_and_grad", False):
            log.info("Megatron-LM's own NaN/Inf check is on (--check-for-nan-in-loss-and-grad, the "
                     "default): a non-finite gradient bucket before the data-parallel reduction is "
                     "megatron_patches' to handle on the steps it checks (named on its origin rank, "
                     "then skipped or rolled back); a NaN/Inf in the loss is still handled by "
                     "Megatron's RerunStateMachine (RuntimeError, or exit 16/17) before "
                     "megatron_patches sees the step.")

    def _scale_lr(self, args: Any, optimizer: Any, scale: float) -> None:
        for name in ("lr", "min_lr", "lr_warmup_init"):
            if getattr(args, name, None):
                setattr(args, name, getattr(args, name) * scale)
        if getattr(args, "use_checkpoint_opt_param_scheduler", False):
            _warn0("--use-checkpoint-opt_param-scheduler is replaced by --override-opt_param-"
                   "scheduler: the ledger's lr scale %.3g must win over the checkpoint", scale)
            args.use_checkpoint_opt_param_scheduler = False
        args.override_opt_param_scheduler = True
        # The groups themselves are changed only after the checkpoint load (first train_step):
        # from 0.19 on, the optimizer finds each saved group by its max_lr/min_lr, among others.
        for group in optimizer.param_groups:
            self._lr_bounds[_group_key(group)] = tuple(
                None if group.get(key) is None else group[key] * scale for key in ("max_lr", "min_lr"))
        _warn0("ledger %s: learning rate scaled by %.3g (lr %.4g, min_lr %.4g; "
               "override_opt_param_scheduler on)", self.root, scale, args.lr, args.min_lr)

    def _load_newest_healthy(self, args: Any, request: dict) -> None:
        target = newest_healthy_iteration(self.root)
        if target is None:
            log.error("ledger %s asks for a rollback (from iteration %s) but no checkpoint there is "
                      "marked healthy; stopping", self.root, request.get("iteration", request.get("from_step")))
            self._stop(f"ledger {self.root} asks for a rollback but no checkpoint there is marked healthy")
        if args.load is None or os.path.abspath(args.load) != os.path.abspath(self.root):
            _warn0("rollback: --load %s replaced by %s (where the healthy checkpoints are)",
                   args.load, self.root)
            args.load = self.root
        args.ckpt_step = target
        self._resume_from = target
        if getattr(args, "non_persistent_ckpt_type", None):
            # Megatron loads a newer non-persistent checkpoint in preference to --ckpt-step; it is
            # not marked, so not a rollback target: off for this load, back after it.
            self._non_persistent_type = args.non_persistent_ckpt_type
            args.non_persistent_ckpt_type = None
            _warn0("rollback: non-persistent (%s) checkpoints are not loaded on this restart",
                   self._non_persistent_type)
        _warn0("rollback requested at iteration %s: loading healthy checkpoint iteration %d "
               "from %s (tracker: %s)", request.get("iteration", request.get("from_step")),
               target, self.root, read_tracker(self.root))

    # -- around each iteration ------------------------------------------------------------------

    def before_step(self, optimizer: Any, scheduler: Any, skipped: bool = False) -> None:
        """Before each ``train_step``; ``skipped``: one the guard skips for a loop that does not
        read ``iterations_to_skip`` (the first call's after-load work only)."""
        from megatron.training import get_args

        args = get_args()
        self._write_finalized_markers()
        iteration = int(args.curr_iteration) + 1  # as Megatron logs it
        if self._first_step:
            self._first_step = False
            self._after_load(args, optimizer, scheduler)
        if skipped:
            return
        self.monitor.set_step(iteration)
        self.monitor.set_batch(_sample_positions(args), iteration=iteration,
                               consumed_train_samples=int(args.consumed_train_samples))
        self._checked_before = self.monitor.counters["checked_steps"]

    def _after_load(self, args: Any, optimizer: Any, scheduler: Any) -> None:
        if self._non_persistent_type is not None:
            args.non_persistent_ckpt_type, self._non_persistent_type = self._non_persistent_type, None
        self._load_state(args.load, int(args.iteration))
        self._incidents_at_save = self.monitor.counters["incidents"]
        if self._lr_bounds:
            # The optimizer's load_state_dict brings back each group's max_lr/min_lr as saved.
            restored = 0
            for group in optimizer.param_groups:
                bounds = self._lr_bounds.get(_group_key(group))
                if bounds is not None and (group.get("max_lr"), group.get("min_lr")) != bounds:
                    group["max_lr"], group["min_lr"] = bounds
                    restored += 1
            if scheduler is not None:
                scheduler.step(increment=0)  # recompute every group's lr from the bounds
            if restored:
                _warn0("max_lr/min_lr of %d param group(s) scaled by the ledger's lr scale", restored)
        if self._resume_from is not None and self.restart is not None:
            ledger = self.restart.ledger
            if int(args.iteration) != self._resume_from:
                if _rank() == 0:
                    log.error("rollback asked to resume from healthy checkpoint iteration %d, but "
                              "Megatron loaded iteration %s; stopping", self._resume_from, args.iteration)
                self._stop(f"resumed from iteration {args.iteration}, not the healthy checkpoint "
                           f"iteration {self._resume_from} the rollback asked for")
            self.restart.resumed({"resumed_from": int(args.iteration), "lr_scale": ledger.lr_scale,
                                  "iterations_to_skip": list(args.iterations_to_skip or [])})
            lr = optimizer.param_groups[0]["lr"] if optimizer.param_groups else None
            _warn0("resumed from healthy checkpoint iteration %s with lr %s", args.iteration, lr)

    def after_step(self) -> None:
        from megatron.training import get_args
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
        if tensorboard is None and wandb is None:
            return
        args = get_args()
        iteration = int(args.curr_iteration) + 1
        if iteration % max(int(getattr(args, "tensorboard_log_interval", 1) or 1), 1):
            return
        values = {TAG_PREFIX + k: v for k, v in self.monitor.counters.items()}
        norm = self.monitor.last_total_norm
        if self.monitor.counters["checked_steps"] > self._checked_before and norm is not None and math.isfinite(norm):
            values[TAG_PREFIX + "total_grad_norm"] = norm
            for layer, value in getattr(self.monitor, "last_layer_norms", {}).items():
                if math.isfinite(value):
                    values[f"{TAG_PREFIX}layer_grad_norm/{layer}"] = value
        if tensorboard is not None:
            for tag, value in values.items():
                tensorboard.add_scalar(tag, value, iteration)
        if wandb is not None:
            wandb.log(values, iteration)

    # -- checkpoints and exits ------------------------------------------------------------------

    def after_save(self, iteration: int, model: Any, non_persistent: bool) -> None:
        from megatron.training import get_args

        args = get_args()
        if args.save is None or non_persistent:
            return
        incidents = self.monitor.counters["incidents"]
        healthy = incidents == self._incidents_at_save and checkpoint.params_finite(model)
        rerun = _rerun_checkpoint()
        self._incidents_at_save = incidents
        directory = checkpoint.checkpoint_dir(args.save, int(iteration))
        self._save_state(directory)
        if _rank() != 0 or not os.path.isdir(directory):
            return
        lr_scale = self.restart.ledger.lr_scale if self.restart is not None else 1.0
        fields = {"incidents": incidents, "lr_scale": lr_scale, **({"rerun": rerun} if rerun else {})}
        self._pending_markers.append((directory, int(iteration), healthy and rerun is None, fields))
        if getattr(args, "async_save", False) and not _async_saves_finalized():
            log.info("checkpoint iteration %d: marked once its async save is finalized", iteration)
            if len(self._pending_markers) == 1:
                atexit.register(self._write_finalized_markers)
        self._write_finalized_markers()

    def _write_finalized_markers(self) -> None:
        """The markers of saves now complete (all, unless an async save is still pending)."""
        if not self._pending_markers or not _async_saves_finalized():
            return
        for directory, iteration, healthy, fields in self._pending_markers:
            if os.path.isdir(directory):
                try:
                    write_marker(directory, iteration, healthy, **fields)
                except OSError as exc:  # the guard's own file must not end the job (rank 0 only)
                    log.warning("checkpoint iteration %d could not be marked (%s): without a marker it "
                                "is never a rollback target; training goes on", iteration, exc)
                    continue
                log.info("checkpoint iteration %d marked %s%s", iteration, "healthy" if healthy else "NOT healthy",
                         f" ({fields['rerun']})" if fields.get("rerun") else "")
        self._pending_markers = []

    def _stop(self, reason: str) -> None:
        """A critical stop before training starts (every rank reads the same ledger)."""
        self.monitor.exit(Decision(Severity.CRITICAL, Action.STOP, reason, self.monitor.step))

    def _finalize_saves(self, decision: Any = None) -> None:
        """Before any exit of the guard: finish pending async saves (every rank takes part, as
        every rank reaches the exit from the same decision), then mark them."""
        from megatron.training import get_args

        if getattr(get_args(), "async_save", False):
            try:
                from megatron.training.async_utils import maybe_finalize_async_save
            except ImportError:
                from megatron.training.training import maybe_finalize_async_save
            maybe_finalize_async_save(blocking=True)
        self._write_finalized_markers()

    def _save_state(self, directory: str) -> None:
        """This rank's detector baselines and counters beside the checkpoint it belongs to."""
        if not os.path.isdir(directory):
            return
        path = state_file(directory, _rank())
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            checkpoint.write_json_atomic(path, self.monitor.state_dict())
        except OSError as exc:
            log.warning("guard state %s not saved (%s): a restart from this checkpoint starts a new "
                        "detector baseline; training goes on", path, exc)

    def _load_state(self, root: Optional[str], iteration: int) -> None:
        """Detector baselines and counters as saved with the checkpoint Megatron just loaded, so
        the first iteration after a restart is judged like any other."""
        if root is None or iteration <= 0:
            return
        path = state_file(checkpoint.checkpoint_dir(root, iteration), _rank())
        try:
            with open(path, encoding="utf-8") as handle:
                state = json.load(handle)
        except FileNotFoundError:
            _warn0("no guard state in %s (saved without megatron_patches?): "
                   "the history detectors start a new baseline", os.path.dirname(path))
            return
        except (OSError, ValueError) as exc:
            log.warning("guard state %s unreadable (%s): the history detectors start a new baseline", path, exc)
            return
        self.monitor.load_state_dict(state)
        _warn0("guard state of iteration %d restored (detector baselines, counters) from %s",
               iteration, os.path.dirname(path))

    def _on_decision(self, decision: Any, incident: Any) -> None:
        self._episode_steps.append(int(decision.step))

    def _rollback_fields(self) -> dict:
        """What the ledger's rollback request adds for Megatron-LM (rank 0, at a rollback exit):
        the iteration, and the iterations a restart skips."""
        ledger = self.restart.ledger
        steps = sorted(set(self._episode_steps)) if self.monitor.config.recovery.blacklist == "always" else []
        log.warning("ledger %s: rollback requested at iteration %d; a restart skips iterations %s "
                    "and scales the lr to %.3g of the original", ledger.path(self.root),
                    self.monitor.step, steps, ledger.lr_scale)
        return {"iteration": self.monitor.step, "skip_iterations": steps}


def _async_saves_finalized() -> bool:
    """True when no async checkpoint save of this process is still unfinalized."""
    try:
        from megatron.training import async_utils
    except ImportError:
        return True
    check = getattr(async_utils, "is_empty_async_queue", None)
    return True if check is None else bool(check())


def _rerun_checkpoint() -> Optional[str]:
    """Why the save under way is Megatron's rerun/fault checkpoint (its RerunStateMachine is
    mid-diagnosis and exits 16/17 next), or None for an ordinary save."""
    try:
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine
    except ImportError:
        return None
    state = getattr(get_rerun_state_machine(), "state", RerunState.NOT_RUNNING_YET)
    if state == RerunState.NOT_RUNNING_YET:
        return None
    return f"saved by Megatron's rerun state machine in state {state.name}"


def _refuse_unsupported(args: Any, optimizer: Any) -> None:
    """Stop every rank with exit code 2 and one line (rank 0) when the job uses a variant the
    guard does not check yet (:mod:`megatron_patches.variants`): never run it unchecked."""
    from .. import variants
    from ..errors import UnsupportedConfig
    from ..optimizer_params import leaves

    from .mindspeed import refuse_unchecked_paths

    try:
        variants.refuse_args(args)
        refuse_unchecked_paths(args)  # MindSpeed's quantized and LayerZeRO steps skip prepare_grads
        for leaf in leaves(optimizer):
            variants.refuse_optimizer(leaf)
    except UnsupportedConfig as exc:
        if _rank() == 0:
            log.error("%s", exc)
        raise SystemExit(variants.EXIT_UNSUPPORTED) from None


def _group_key(group: dict) -> tuple:
    return tuple(id(p) for p in group["params"])


def _sample_positions(args: Any) -> list:
    """Positions in the training dataset this rank reads this iteration. Known only for
    ``--dataloader-type single`` (Megatron's sequential sampler): global batch ``consumed ..
    consumed + global batch - 1``, each micro-batch split across data-parallel ranks."""
    if getattr(args, "dataloader_type", "single") != "single" or getattr(args, "perform_rl_step", False):
        return []
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs, start = int(args.micro_batch_size), int(args.consumed_train_samples)
    return [start + m * mbs * dp + dp_rank * mbs + j for m in range(get_num_microbatches()) for j in range(mbs)]


_session: Optional[MegatronLMSession] = None


def session(monitor: Any) -> MegatronLMSession:
    """This process's session for ``monitor`` (a new monitor gets a new session)."""
    global _session
    if _session is None or _session.monitor is not monitor:
        _session = MegatronLMSession(monitor)
    return _session


# --- wrapt wrappers (registry targets under megatron.training) -----------------------------------


def scheduler_wrapper(wrapped, instance, args, kwargs):
    """``get_optimizer_param_scheduler(optimizer)``: apply the ledger before the scheduler exists."""
    monitor = hooks.get_monitor()
    if monitor is not None:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        session(monitor).before_scheduler(bound.arguments["optimizer"])
    return wrapped(*args, **kwargs)


def train_step_wrapper(wrapped, instance, args, kwargs):
    """``train_step(...)``: iteration and batch for the monitor; writers after the step. Called for
    an iteration in ``iterations_to_skip`` (MindSpeed-LLM's loop does not read them), skips it
    as Megatron-LM's loop would (:mod:`.mindspeed_llm`)."""
    monitor = hooks.get_monitor()
    if monitor is None:
        return wrapped(*args, **kwargs)
    from megatron.training import get_args

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    current, megatron_args = session(monitor), get_args()
    optimizer, scheduler = bound.arguments["optimizer"], bound.arguments.get("opt_param_scheduler")
    if mindspeed_llm.listed(megatron_args, _core_version()):  # a loop that does not read the skips
        current.before_step(optimizer, scheduler, skipped=True)
        return mindspeed_llm.skip(megatron_args, bound.arguments["data_iterator"], _core_version())
    current.before_step(optimizer, scheduler)
    result = wrapped(*args, **kwargs)
    current.after_step()
    return result


def save_checkpoint_wrapper(wrapped, instance, args, kwargs):
    """``save_checkpoint(iteration, model, ...)``: the healthy marker once the save returned."""
    result = wrapped(*args, **kwargs)
    monitor = hooks.get_monitor()
    if monitor is not None:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        session(monitor).after_save(bound.arguments["iteration"], bound.arguments["model"],
                                    bool(bound.arguments.get("non_persistent_ckpt", False)))
    return result
