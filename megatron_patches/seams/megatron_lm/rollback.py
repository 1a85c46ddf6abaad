"""Rollback by exit and restart for Megatron-LM: the ledger read into Megatron's args at start-up,
checked after the load, and written (through :class:`~megatron_patches.recovery.ExitAndRestart`)
at a rollback exit.

At start-up, before the checkpoint load, the ledger next to ``--save`` decides:

- ``args.iterations_to_skip`` += the iterations earlier rollbacks asked to skip, and those that
  read a sample the ledger blacklists (:func:`blacklisted_iterations`);
- the learning rate (``args.lr``/``min_lr``/``lr_warmup_init``, with
  ``--override-opt_param-scheduler`` semantics) scaled by the ledger's ``lr_scale``; each param
  group's ``max_lr``/``min_lr`` only after the load, as the optimizer finds its saved groups by
  those values (0.19+);
- on a rollback request, ``--load``/``--ckpt-step`` = the newest healthy checkpoint.

After the load (first ``train_step``) the scaled group bounds go back on, the loaded iteration is
checked against the request, and the request is cleared. A request that cannot be met (no healthy
checkpoint, another iteration loaded) stops every rank critically.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NoReturn, Optional

from ... import collectives, safe_mode
from ...callbacks import Callback
from ...errors import UserError
from ...protocols import Guard
from ...decisions import Action, Decision, Severity
from .checkpoints import newest_healthy_iteration, read_tracker, saved_lr_scale, warn0

log = logging.getLogger("megatron_patches")


def to_iterations_to_skip(logged: list, core_version: tuple) -> list:
    """Megatron's ``iterations_to_skip`` entries for iterations numbered as Megatron logs them:
    up to core 0.16 the loop tests the 0-based index (``iteration in ...``), from 0.17 on the
    logged number (``iteration + 1 in ...``)."""
    shift = 0 if core_version >= (0, 17) else 1
    return [int(i) - shift for i in logged]


def skip_iterations(ledger: Any) -> list:
    """Every iteration (as logged) a rollback of this job asked to skip, from the ledger's events."""
    return sorted({int(i) for event in ledger.events for i in event.get("skip_iterations", [])})


def blacklisted_iterations(blacklist: list, args: Any) -> list:
    """The iterations (as logged) that read a position of ``blacklist``. Known for the ``single``
    data loader with a constant global batch (Megatron's defaults): iteration ``k`` reads positions
    ``(k - 1) * global_batch .. k * global_batch - 1``, skipped iterations included (Megatron's
    loop counts their samples consumed). Elsewhere none, with one line (rank 0)."""
    if not blacklist:
        return []
    if getattr(args, "dataloader_type", "single") != "single" or getattr(args, "rampup_batch_size", None):
        warn0("ledger: blacklisted samples %s are not left out on this start: the iterations that read them are "
              "known only for --dataloader-type single without --rampup-batch-size", blacklist)
        return []
    return sorted({int(sample) // int(args.global_batch_size) + 1 for sample in blacklist})


def switch_off_for_retry(args: Any) -> list:
    """Safe mode on retry: before Megatron builds the model, switch off in ``args`` what the
    ledger next to ``--save`` (else ``--load``) lists in ``disabled_features``
    (:mod:`megatron_patches.safe_mode`). Returns those names ([] when none, or no ledger)."""
    from ...ledger import Ledger

    root = args.save or args.load
    if root is None:
        return []
    try:
        ledger = Ledger.load(root)
    except UserError:  # said in one line when the ledger is read for the rollback itself
        return []
    if not ledger.disabled_features:
        return []
    changed, already = safe_mode.switch_off(args, ledger.disabled_features)
    warn0("safe mode after rollback %d: switched off %s (%s)%s", ledger.rollbacks,
          ", ".join(ledger.disabled_features), "; ".join(changed) or "no argument changed",
          f"; already off or not in this Megatron: {', '.join(already)}" if already else "")
    return list(ledger.disabled_features)


def built_model_facts(model_chunks: list) -> str:
    """What the built model shows of safe mode: dropout probabilities and DDP's overlap flags."""
    import torch

    modules = [m for chunk in model_chunks for m in chunk.modules()]
    dropouts = [m.p for m in modules if isinstance(m, torch.nn.Dropout)]
    hidden = [m.hidden_dropout for m in modules if isinstance(getattr(m, "hidden_dropout", None), float)]
    ddp = getattr(model_chunks[0], "ddp_config", None) if model_chunks else None
    overlap = (f"overlap_grad_reduce={ddp.overlap_grad_reduce}, overlap_param_gather={ddp.overlap_param_gather}"
               if ddp is not None else "no DDP config")
    return (f"{sum(p > 0 for p in dropouts)} of {len(dropouts)} dropout modules with p > 0, "
            f"{sum(h > 0 for h in hidden)} of {len(hidden)} layers with hidden_dropout > 0; {overlap}")


def core_version() -> tuple:
    """megatron-core's (major, minor)."""
    from megatron.core import package_info

    return tuple(int(x) for x in package_info.__version__.split(".")[:2])


def rerun_repeats_here(machine: Any) -> bool:
    """Whether Megatron's rerun machine, loaded from the checkpoint it saved at an exit 16 (state
    ``WILL_RERUN_FROM_CHECKPOINT``), would rerun on this rank's node and device of its first rerun.
    There its second rerun proves nothing, so it asks for yet another restart ("Got rescheduled on
    the same GPU", exit 16), as often as the job restarts there."""
    import os

    import torch

    if getattr(getattr(machine, "state", None), "name", None) != "WILL_RERUN_FROM_CHECKPOINT":
        return False
    if getattr(machine, "suspicious_node", None) is None:
        return False
    try:
        device = torch.cuda.current_device()  # what Megatron compares (the CPU runtime redirects it)
    except (AssertionError, RuntimeError):
        return False
    return machine.suspicious_node == os.uname()[1] and machine.suspicious_device == device


class Rollback(Callback):
    """The ledger's side of one Megatron-LM process. Attaches
    :class:`~megatron_patches.recovery.ExitAndRestart` (the ledger's one writer) to the monitor."""

    def __init__(self, monitor: Guard, root: str):
        from ...recovery import ExitAndRestart

        self.monitor = monitor
        self.root = root
        self.episode_steps: list = []
        """Every rank: the iterations of this episode's incidents (a restart skips them under ``blacklist: always``)."""
        self._lr_bounds: dict = {}
        self._resume_from: Optional[int] = None
        self._non_persistent_type: Optional[str] = None
        self.restart = ExitAndRestart(monitor, root, request_fields=self._request_fields)
        monitor.add_callback(self)

    @property
    def lr_scale(self) -> float:
        return self.restart.ledger.lr_scale

    # -- before the checkpoint load ------------------------------------------------------------

    def before_load(self, args: Any, optimizer: Any) -> None:
        """Megatron's args and the optimizer as the ledger asks, before the checkpoint load."""
        ledger = self.restart.ledger
        reading = blacklisted_iterations(ledger.blacklist, args)
        skips = sorted(set(skip_iterations(ledger)) | set(reading))
        if skips:
            entries = to_iterations_to_skip(skips, core_version())
            args.iterations_to_skip = sorted(set(args.iterations_to_skip or []) | set(entries))
            warn0("ledger %s: skipping iterations %s (args.iterations_to_skip=%s)%s", self.root, skips,
                  args.iterations_to_skip, f"; {reading} read blacklisted samples {ledger.blacklist}" if reading else "")
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
        if scale != 1.0:
            scale_group_bounds(optimizer, scale)

    def _scale_lr(self, args: Any, optimizer: Any, scale: float) -> None:
        for name in ("lr", "min_lr", "lr_warmup_init"):
            if getattr(args, name, None):
                setattr(args, name, getattr(args, name) * scale)
        if getattr(args, "use_checkpoint_opt_param_scheduler", False):
            warn0("--use-checkpoint-opt_param-scheduler is replaced by --override-opt_param-"
                  "scheduler: the ledger's lr scale %.3g must win over the checkpoint", scale)
            args.use_checkpoint_opt_param_scheduler = False
        args.override_opt_param_scheduler = True
        # The groups themselves are changed only after the checkpoint load (first train_step):
        # from 0.19 on, the optimizer finds each saved group by its max_lr/min_lr, among others.
        self._lr_bounds = scaled_group_bounds(optimizer, scale)
        warn0("ledger %s: learning rate scaled by %.3g (lr %.4g, min_lr %.4g; "
              "override_opt_param_scheduler on)", self.root, scale, args.lr, args.min_lr)

    def _load_newest_healthy(self, args: Any, request: dict) -> None:
        target = newest_healthy_iteration(self.root)
        if target is None:
            log.error("ledger %s asks for a rollback (from iteration %s) but no checkpoint there is "
                      "marked healthy; stopping", self.root, request.get("iteration", request.get("from_step")))
            self._stop(f"ledger {self.root} asks for a rollback but no checkpoint there is marked healthy")
        if args.load is None or os.path.abspath(args.load) != os.path.abspath(self.root):
            warn0("rollback: --load %s replaced by %s (where the healthy checkpoints are)",
                  args.load, self.root)
            args.load = self.root
        args.ckpt_step = target
        self._resume_from = target
        if getattr(args, "non_persistent_ckpt_type", None):
            # Megatron loads a newer non-persistent checkpoint in preference to --ckpt-step; it is
            # not marked, so not a rollback target: off for this load, back after it.
            self._non_persistent_type = args.non_persistent_ckpt_type
            args.non_persistent_ckpt_type = None
            warn0("rollback: non-persistent (%s) checkpoints are not loaded on this restart",
                  self._non_persistent_type)
        warn0("rollback requested at iteration %s: loading healthy checkpoint iteration %d "
              "from %s (tracker: %s)", request.get("iteration", request.get("from_step")),
              target, self.root, read_tracker(self.root))

    # -- after the load (first train_step) -----------------------------------------------------

    def after_load(self, args: Any, optimizer: Any, scheduler: Any) -> None:
        """The ledger's lr scale back on the loaded param groups; a requested rollback checked
        against the iteration Megatron loaded, then cleared in the ledger."""
        if self._non_persistent_type is not None:
            args.non_persistent_ckpt_type, self._non_persistent_type = self._non_persistent_type, None
        if self._lr_bounds:
            # The optimizer's load_state_dict brings back each group's max_lr/min_lr as saved.
            restored = put_group_bounds(optimizer, self._lr_bounds)
            if scheduler is not None:
                scheduler.step(increment=0)  # recompute every group's lr from the bounds
            if restored:
                warn0("max_lr/min_lr of %d param group(s) scaled by the ledger's lr scale", restored)
        if self._resume_from is not None:
            ledger = self.restart.ledger
            if int(args.iteration) != self._resume_from:
                if collectives.rank() == 0:
                    log.error("rollback asked to resume from healthy checkpoint iteration %d, but "
                              "Megatron loaded iteration %s; stopping", self._resume_from, args.iteration)
                self._stop(f"resumed from iteration {args.iteration}, not the healthy checkpoint "
                           f"iteration {self._resume_from} the rollback asked for")
            self.restart.resumed({"resumed_from": int(args.iteration), "lr_scale": ledger.lr_scale,
                                  "iterations_to_skip": list(args.iterations_to_skip or []),
                                  "disabled_features": list(ledger.disabled_features)})
            lr = optimizer.param_groups[0]["lr"] if optimizer.param_groups else None
            warn0("resumed from healthy checkpoint iteration %s with lr %s", args.iteration, lr)

    def after_rerun_state_loaded(self, args: Any, machine: Any) -> None:
        """Megatron's rerun machine was just loaded (every rank, inside ``load_checkpoint``). When
        it would rerun the iteration of its exit 16 on the node and device of its first rerun on
        any rank, that rerun can only ask for another restart: the guard leaves the disambiguation
        undone, skips that iteration (``iterations_to_skip``, kept by the ledger for later
        restarts too) and lets the job go on. Elsewhere (a new node) Megatron reruns as it asks."""
        if not collectives.any_rank(rerun_repeats_here(machine)):
            return
        exits = [event for event in self.restart.ledger.events if event.get("megatron_exit") == 16]
        if not exits:
            warn0("Megatron's rerun machine will rerun its last iteration on the node and device of its first "
                  "rerun and exit 16 again; no ledger event names that iteration (was the guard off at the "
                  "exit?), so it is left to Megatron: restart on another node")
            return
        step = int(exits[-1]["step"])
        machine.state = type(machine.state).NOT_RUNNING_YET
        machine.data_iterator_checkpoints = None  # the iterator resumes from consumed_train_samples
        machine.rerun_requested = machine.checkpoint_requested = False
        machine.restart_again_requested = machine.continue_requested = False
        args.iterations_to_skip = sorted(set(args.iterations_to_skip or [])
                                         | set(to_iterations_to_skip([step], core_version())))
        self.restart.megatron_rerun_left(step)
        warn0("Megatron's rerun of iteration %d from its checkpoint would run on the node and device of its "
              "first rerun, where it proves nothing and exits 16 again at every restart: the guard resumes "
              "without it and skips iteration %d (ledger %s); to have Megatron's diagnosis, restart on "
              "another node", step, step, self.restart.ledger_path)

    # -- at a rollback exit --------------------------------------------------------------------

    def on_decision(self, decision: Any, incident: Any) -> None:
        """Every rank notes the incident's iteration (a restart skips them under ``blacklist: always``)."""
        self.episode_steps.append(int(decision.step))

    def _request_fields(self, blacklisting: bool = True) -> dict:
        """What the ledger's rollback request adds for Megatron-LM (rank 0, at a rollback exit):
        the iteration, and the iterations a restart skips (none where the incident's cause leaves
        the samples in: ``blacklisting`` False, :mod:`~megatron_patches.cause_response`)."""
        ledger = self.restart.ledger
        always = self.monitor.state.config.recovery.blacklist == "always"
        steps = sorted(set(self.episode_steps)) if always and blacklisting else []
        log.warning("ledger %s: rollback requested at iteration %d; a restart skips iterations %s "
                    "and scales the lr to %.3g of the original", ledger.path(self.root),
                    self.monitor.state.clock.step, steps, ledger.lr_scale)
        return {"iteration": self.monitor.state.clock.step, "skip_iterations": steps}

    def _stop(self, reason: str) -> NoReturn:
        """A critical stop before training starts (every rank reads the same ledger)."""
        self.monitor.exit(Decision(Severity.CRITICAL, Action.STOP, reason, self.monitor.state.clock.step))


def scale_scheduler_bounds(scheduler: Any, factor: float) -> None:
    """The scheduler's ``init_lr``/``max_lr``/``min_lr`` times ``factor`` (those it has)."""
    for name in ("init_lr", "max_lr", "min_lr"):
        if getattr(scheduler, name, None) is not None:
            setattr(scheduler, name, getattr(scheduler, name) * factor)


def scale_group_bounds(optimizer: Any, factor: float) -> None:
    """Each param group's ``max_lr``/``min_lr`` times ``factor`` (those it has)."""
    for group in optimizer.param_groups:
        for key in GROUP_BOUNDS:
            if group.get(key) is not None:
                group[key] *= factor


def scaled_group_bounds(optimizer: Any, scale: float) -> dict:
    """{:func:`group_key`: (max_lr, min_lr) times ``scale``} of each param group, to put back after
    a checkpoint load (:func:`put_group_bounds`), which restores the saved ones."""
    return {group_key(group): tuple(None if group.get(key) is None else group[key] * scale for key in GROUP_BOUNDS)
            for group in optimizer.param_groups}


def put_group_bounds(optimizer: Any, bounds: dict) -> int:
    """Each param group's (max_lr, min_lr) from ``bounds``; returns how many groups changed."""
    changed = 0
    for group in optimizer.param_groups:
        wanted = bounds.get(group_key(group))
        if wanted is not None and tuple(group.get(key) for key in GROUP_BOUNDS) != wanted:
            group["max_lr"], group["min_lr"] = wanted
            changed += 1
    return changed


GROUP_BOUNDS = ("max_lr", "min_lr")
"""A param group's learning-rate bounds, which the scheduler reads and a rollback scales."""


def group_key(group: dict) -> tuple:
    """A param group's identity across a checkpoint load: its parameters' ids."""
    return tuple(id(p) for p in group["params"])
