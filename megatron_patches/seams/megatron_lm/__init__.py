"""Megatron-LM's training loop (``pretrain_gpt.py``): iterations, batches, exit-and-restart.

The wrappers of Megatron-LM's loop, declared in :mod:`megatron_patches.seams.targets` (those under
``megatron.training`` as optional targets: it exists only in a Megatron-LM checkout or a 0.17+
wheel). The main three:

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

Recovery: by default a rollback is made in process (:mod:`.inprocess`: in-memory
snapshots, the iterations since redone inside the ``train_step`` call that brought the decision).
Where that cannot be, and under ``recovery.mode: restart``, the exit-and-restart protocol::

    rollback decision (every rank)  -> ledger: rollbacks+1, lr_scale*=lr_factor,
                                       rollback_requested={iteration, skip_iterations}
                                    -> every rank exits 84 (torchrun itself then exits 1)
    launcher sees 84 or the ledger  -> runs the same command again
    next start, before the load     -> --load/--ckpt-step = newest healthy iter <= tracker
                                       iterations_to_skip += incident iterations (and those
                                       that read blacklisted samples), lr scaled
    first train_step                -> lr re-applied after the load, rollback_requested cleared

Beside them: ``setup_model_and_optimizer`` (safe mode on retry), ``dummy_train_step`` (the skip of
an iteration under an interleaved pipeline), and Megatron's rerun machine at its exits 16/17
(``should_checkpoint_and_exit``, into the ledger) and at a checkpoint load (``load_state_dict``: a
rerun that would only repeat on the same device is left undone). A skipped step is replayed
(:mod:`.replay`): by the guard with Megatron's check off, by Megatron's rerun in place with it on.

This module wires the wrappers to one session per process; the session hands the ledger's work
to :mod:`.rollback` and the checkpoint files (markers, per-rank guard state, async
saves) to :mod:`.checkpoints`. Names other code reads from here stay importable here.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Optional

from ... import collectives, recovery
from ...callbacks import Callback, attached
from ...errors import UserError, exit_refused
from ...detectors.loss import fed_schedule
from ...protocols import Guard
from .. import start_line, wrappers
from ..mindspeed import llm as mindspeed_llm
from .checkpoints import STATE_DIR, TRACKER_FILE, CheckpointMarks, newest_healthy_iteration, read_tracker, saved_lr_scale, state_file, warn0, write_marker
from .inprocess import InProcessRollback
from .poison import PoisonFeed
from .replay import ForwardReplay, replay_for
from .rollback import Rollback, built_model_facts, core_version, skip_iterations, switch_off_for_retry, to_iterations_to_skip

__all__ = [
    "MegatronLMSession", "session", "scheduler_wrapper", "setup_model_wrapper", "train_step_wrapper",
    "save_checkpoint_wrapper", "should_checkpoint_and_exit_wrapper", "rerun_load_wrapper", "dummy_train_step_wrapper",
    "TAG_PREFIX",
    # re-exported: tests and callers read them from here
    "STATE_DIR", "TRACKER_FILE", "newest_healthy_iteration", "read_tracker", "saved_lr_scale",
    "state_file", "write_marker", "skip_iterations", "to_iterations_to_skip",
]

log = logging.getLogger("megatron_patches")

TAG_PREFIX = "megatron_patches/"


class MegatronLMSession(Callback):
    """What one Megatron-LM process needs between the wrapper calls; a callback of its monitor."""

    def __init__(self, monitor: Guard):
        self.monitor = monitor
        self.root: Optional[str] = None
        self.rollback: Optional[Rollback] = None
        """The ledger's side; None until the scheduler is built, and without --save/--load."""
        self.marks = CheckpointMarks(monitor)
        monitor.add_callback(self.marks)
        self.replay: Optional[ForwardReplay] = None
        """A skipped step's replay, its verdict and cause (:mod:`.replay`)."""
        self.in_process: Optional[InProcessRollback] = None
        """Snapshots and in-process rollbacks (``recovery.mode: in_process``)."""
        self._first_step = True
        self._checked_before = 0
        self.positions: tuple = ()
        """The dataset positions this rank reads in the iteration running (empty where unknown)."""
        self.poison: Optional[PoisonFeed] = None
        """Feeds ``poison:sample=I`` drills through the embedding (:mod:`.poison`)."""

    @property
    def restart(self) -> Optional[Any]:
        """The :class:`~megatron_patches.recovery.ExitAndRestart` attached to the monitor."""
        return self.rollback.restart if self.rollback is not None else None

    # -- before the checkpoint load ------------------------------------------------------------

    def before_scheduler(self, optimizer: Any) -> None:
        from megatron.training import get_args

        if self.rollback is not None:
            return
        args = get_args()
        _refuse_unsupported(args)
        if self.monitor.state.config.recovery.keep_checkpoints is not None:
            if collectives.rank() == 0:
                log.error("recovery.keep_checkpoints is the tiny-GPT harness's retention; Megatron-LM's loop "
                          "keeps every checkpoint it saves and megatron_patches deletes none there: remove the key")
            exit_refused(collectives.rank())
        _advise(args)
        self.root = args.save or args.load
        in_process = self.monitor.state.config.recovery.mode == "in_process"
        if self.root is None and not in_process:
            warn0("neither --save nor --load given: a rollback decision exits with %d but "
                  "there is no checkpoint or ledger to resume from", self.monitor.state.config.response.exit_codes.rollback)
            return
        if self.root is None:  # in-memory snapshots need no checkpoint: the ledger goes beside the report
            warn0("neither --save nor --load given: rollbacks in memory only, the ledger in %s", self.monitor.state.report_dir)
        try:
            self.rollback = Rollback(self.monitor, self.root or self.monitor.state.report_dir)
        except UserError as error:  # a ledger nobody can apply: one line, every rank exits 2
            if collectives.rank() == 0:
                log.error("%s", error)
            exit_refused(collectives.rank())
        self.rollback.before_load(args, optimizer)
        if in_process:
            self.in_process = InProcessRollback(self.monitor, self.rollback, self.before_step,
                                                restartable=self.root is not None, after_step=self.replayed)

    # -- around each iteration ------------------------------------------------------------------

    def before_step(self, optimizer: Any, scheduler: Any, skipped: bool = False) -> None:
        """Before each ``train_step``; ``skipped``: one the guard skips for a loop that does not
        read ``iterations_to_skip`` (the first call's after-load work only)."""
        from megatron.training import get_args

        args = get_args()
        self.marks.write_finalized()
        iteration = int(args.curr_iteration) + 1  # as Megatron logs it
        if self._first_step:
            self._first_step = False
            self.marks.after_load(args.load, int(args.iteration))
            self.poison = PoisonFeed(self.monitor, int(args.micro_batch_size))
            self.replay = replay_for(args, self.monitor, self.blacklist, lambda: self.positions)
            if self.rollback is not None:
                self.rollback.after_load(args, optimizer, scheduler)
        if skipped:
            return
        self.monitor.set_step(iteration)
        self.positions = tuple(_sample_positions(args))
        self.monitor.set_batch(list(self.positions), iteration=iteration,
                               consumed_train_samples=int(args.consumed_train_samples))
        self.poison.before_iteration(list(self.positions))
        self._checked_before = self.monitor.state.counters["checked_steps"]

    def blacklist(self, samples: list) -> None:
        """Every rank: samples a data cause blames, into the ledger (rank 0 saves it); an in-process
        rollback's redo then leaves out the iterations that read them."""
        if self.restart is None:
            warn0("samples %s blamed for a fault; no --save/--load, so no ledger keeps them", samples)
            return
        ledger = self.restart.ledger
        ledger.blacklist = sorted(set(ledger.blacklist) | set(samples))
        recovery.save_in_process(ledger, self.restart.checkpoint_root, collectives.rank())

    def replayed(self, arguments: dict) -> None:
        """After each ``train_step``, a redone one too: a step the guard skipped is replayed now, on
        its own batch (its record waits for the outcome)."""
        if self.replay is not None and self.replay.pending is not None:
            self.replay.run(arguments, self.positions)

    def megatron_exits(self, code: int, state: str) -> None:
        """Megatron's rerun machine ends the job itself with ``code`` (16: resume from the
        checkpoint it saves now to tell a transient fault from a persistent one; 17: a result
        failed its validation), from ``state``: the ledger records it (rank 0), so a restart and
        whoever reads the ledger know this exit was Megatron's, not a guard decision. Every rank
        gets here with the same answer (Megatron's machine agrees on it across ranks), so the
        drills that fired anywhere are gathered to rank 0 for the ledger (where there is one:
        --save/--load are the same on every rank)."""
        if self.restart is None:
            warn0("Megatron's rerun machine exits with %d (%s) at iteration %d; no --save/--load, so "
                  "no ledger records it", code, state, self.monitor.state.clock.step)
            return
        fired = collectives.gather_to_zero(self.monitor.state.drills.fired_specs())
        self.restart.megatron_exit(self.monitor.state.clock.step, code, state, sorted({s for specs in fired for s in specs}))

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
        values = {TAG_PREFIX + k: v for k, v in self.monitor.state.counters.items()}
        norm = self.monitor.state.last_total_norm
        if self.monitor.state.counters["checked_steps"] > self._checked_before and norm is not None and math.isfinite(norm):
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
        lr_scale = self.rollback.lr_scale if self.rollback is not None else 1.0
        self.marks.after_save(iteration, model, non_persistent, lr_scale)

    # -- the monitor's events (callbacks.Callback) ----------------------------------------------

    def wants_replay(self, decision: Any) -> bool:
        """A skipped step is replayed after the step (:mod:`.replay`): its record waits for that outcome."""
        return self.replay is not None and self.replay.wants(decision)



def _advise(args: Any) -> None:
    if getattr(args, "check_for_nan_in_loss_and_grad", False):
        log.debug("Megatron's NaN check is on: on checked steps its rerun verdict goes into the record "
                  "and the guard decides (docs/megatron_lm.md)")


def _refuse_unsupported(args: Any) -> None:
    """Stop every rank with exit code 2 and one line (rank 0) when the job uses a variant the
    guard does not check yet (:mod:`megatron_patches.variants`): never run it unchecked. Asked
    on the arguments before the model is built (a variant's model may not even build on this
    machine) and again before the scheduler, where the arguments are parsed inside ``pretrain``."""
    from ... import variants
    from ...errors import UnsupportedConfig

    from ..mindspeed import refuse_unchecked_paths

    try:
        variants.refuse_args(args)
        refuse_unchecked_paths(args)  # MindSpeed's quantized and LayerZeRO steps skip prepare_grads
    except UnsupportedConfig as exc:
        if collectives.rank() == 0:
            log.error("%s", exc)
        exit_refused(collectives.rank())


def _sample_positions(args: Any) -> list:
    """Positions in the training dataset this rank reads this iteration (Megatron-LM's args)."""
    if getattr(args, "perform_rl_step", False):
        return []
    return sample_positions(getattr(args, "dataloader_type", "single"), int(args.micro_batch_size),
                            int(args.consumed_train_samples))


def sample_positions(dataloader_type: Optional[str], micro_batch_size: int, consumed: int) -> list:
    """Positions in the training dataset this rank reads this iteration. Known only for the
    ``single`` data loader (Megatron's sequential sampler, also Megatron-Bridge's): global batch
    ``consumed .. consumed + global batch - 1``, each micro-batch split across data-parallel ranks."""
    if dataloader_type != "single":
        return []
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    return [consumed + m * micro_batch_size * dp + dp_rank * micro_batch_size + j
            for m in range(get_num_microbatches()) for j in range(micro_batch_size)]


def session(monitor: Guard) -> MegatronLMSession:
    """The run's session: a callback of its monitor, made at the first call (a new monitor gets a new one)."""
    return attached(monitor, MegatronLMSession)


# --- wrapt wrappers (registry targets under megatron.training) -----------------------------------


def scheduler_wrapper(wrapped, instance, args, kwargs):
    """``get_optimizer_param_scheduler(optimizer)``: apply the ledger before the scheduler exists."""
    monitor = wrappers.get_monitor()
    if monitor is not None:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        optimizer = bound.arguments["optimizer"]
        run = session(monitor)
        run.before_scheduler(optimizer)
        if start_line.held() is not None:
            start_line.say(run.in_process.memory_bound(optimizer) if run.in_process else "", final=True)
    return wrapped(*args, **kwargs)


def setup_model_wrapper(wrapped, instance, args, kwargs):
    """``setup_model_and_optimizer(...)``: safe mode on retry, on Megatron's args before the model
    and optimizer are built; then one line of what the built model shows of it."""
    monitor = wrappers.get_monitor()
    if monitor is None:
        return wrapped(*args, **kwargs)
    from megatron.training import get_args

    _refuse_unsupported(get_args())
    switched = switch_off_for_retry(get_args())
    start_line.defer()  # said by the scheduler hook, with what the in-memory snapshots may hold
    result = wrapped(*args, **kwargs)
    start_line.say(final=True)  # a setup that built no scheduler
    if switched:
        warn0("safe mode in the built model: %s", built_model_facts(list(result[0])))
    return result


def train_step_wrapper(wrapped, instance, args, kwargs):
    """``train_step(...)``: iteration and batch for the monitor; writers after the step. Called for
    an iteration in ``iterations_to_skip`` (MindSpeed-LLM's loop does not read them), skips it
    as Megatron-LM's loop would (:mod:`..mindspeed.llm`)."""
    monitor = wrappers.get_monitor()
    if monitor is None:
        return wrapped(*args, **kwargs)
    from megatron.training import get_args

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    current, megatron_args = session(monitor), get_args()
    optimizer, scheduler = bound.arguments["optimizer"], bound.arguments.get("opt_param_scheduler")
    if mindspeed_llm.listed(megatron_args, core_version()):  # a loop that does not read the skips
        current.before_step(optimizer, scheduler, skipped=True)
        return mindspeed_llm.skip(megatron_args, bound.arguments["data_iterator"], core_version())
    current.before_step(optimizer, scheduler)
    iteration = int(megatron_args.curr_iteration) + 1
    if current.in_process is not None:
        current.in_process.before_iteration(iteration, bound.arguments["data_iterator"],
                                            int(megatron_args.consumed_train_samples))
    schedule = bound.arguments.get("forward_backward_func")
    if schedule is not None and monitor.state.config.detectors.loss_spike.enabled:
        bound.arguments["forward_backward_func"] = fed_schedule(schedule, monitor.state.detectors)
    result = wrapped(*bound.args, **bound.kwargs)
    current.after_step()
    current.replayed(bound.arguments)
    if current.in_process is not None:  # a snapshot, or a rollback made here: the redone iteration's result
        result = current.in_process.after_iteration(iteration, wrapped, bound, result)
    return result


def should_checkpoint_and_exit_wrapper(wrapped, instance, args, kwargs):
    """``RerunStateMachine.should_checkpoint_and_exit()``, asked by Megatron-LM's ``train_step``:
    when the answer is to end the job (exits 16 and 17), the session writes that into the ledger
    before Megatron saves and exits."""
    state = getattr(getattr(instance, "state", None), "name", "unknown state")
    answer = wrapped(*args, **kwargs)
    monitor = wrappers.get_monitor()
    if monitor is not None and answer[1] and answer[2]:
        session(monitor).megatron_exits(int(answer[2]), state)
    return answer


def rerun_load_wrapper(wrapped, instance, args, kwargs):
    """``RerunStateMachine.load_state_dict(state_dict)``, called by Megatron-LM's ``load_checkpoint``
    when the checkpoint carries a pending rerun (its exit 16): a rerun that would only repeat on
    this node and device is left undone and its iteration skipped (:meth:`Rollback.after_rerun_state_loaded`)."""
    result = wrapped(*args, **kwargs)
    monitor = wrappers.get_monitor()
    if monitor is not None:
        current = session(monitor)
        if current.rollback is not None:
            from megatron.training import get_args

            current.rollback.after_rerun_state_loaded(get_args(), instance)
    return result


def dummy_train_step_wrapper(wrapped, instance, args, kwargs):
    """``dummy_train_step(data_iterator)``: how Megatron-LM's loop drains an iteration listed in
    ``iterations_to_skip`` (a rollback's incident iterations). Under an interleaved pipeline the
    iterator is a list, one per virtual stage, which megatron-core 0.19.2's ``next()`` rejects
    ("'list' object is not an iterator", the resumed job dies): each stage's iterator is drained
    in turn, as each would be in a trained iteration. One iterator goes through unchanged."""
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    iterators = bound.arguments["data_iterator"]
    if not isinstance(iterators, list):
        return wrapped(*args, **kwargs)
    result = None
    for iterator in iterators:
        if iterator is not None:
            result = wrapped(iterator)
    return result


save_checkpoint_wrapper = wrappers.save_checkpoint_wrapper(session, "iteration")
