"""What megatron_patches keeps in Megatron-LM's ``--save`` directory, and when it writes it.

Megatron-LM writes ``iter_N/`` and, once a save is complete (async saves included), the tracker
file ``latest_checkpointed_iteration.txt``. Beside Megatron's data this module keeps, per
checkpoint:

- ``iter_N/megatron_patches.json`` (rank 0): healthy when no incident happened since the previous
  save, every parameter is finite and Megatron's rerun state machine did not make the save; with
  the ledger's learning-rate scale the param groups were saved with. An async save is marked only
  once Megatron finalized it: at the next ``train_step``, before any exit of the guard, or at
  process exit.
- ``iter_N/megatron_patches_state/rank_NNNNN.json`` (every rank): that rank's detector baselines
  and counters, restored after the load so a restart judges its first iteration like any other.

A file the guard cannot write is logged and training goes on: without a marker a checkpoint is
never a rollback target, without a state file a restart starts new detector baselines.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
from typing import Any, Optional

from .. import checkpoint, collectives
from ..files import write_json_atomic
from ..protocols import Guard

log = logging.getLogger("megatron_patches")

TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's record of the newest complete checkpoint in ``--save``."""

STATE_DIR = "megatron_patches_state"
"""Per-rank guard state saved inside each Megatron-LM ``iter_N`` directory: each rank's history
baselines describe its own tensors, so every rank keeps its own file."""


def warn0(message: str, *args: Any) -> None:
    """A warning every rank would print alike: printed by global rank 0 only (shared by the
    Megatron-LM integration's modules)."""
    if collectives.rank() == 0:
        log.warning(message, *args)


# --- reading and naming the files (no Megatron needed) -------------------------------------------


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


# --- writing them as Megatron saves ---------------------------------------------------------------


class CheckpointMarks:
    """The markers and guard-state files of one Megatron-LM process's saves."""

    def __init__(self, monitor: Guard):
        self.monitor = monitor
        self._incidents_at_save = 0
        self._pending: list = []
        """(directory, iteration, healthy, marker fields) of saves not marked yet."""

    def after_save(self, iteration: int, model: Any, non_persistent: bool, lr_scale: float) -> None:
        """Megatron's ``save_checkpoint`` returned: this rank's state file, and (rank 0) the
        marker, now or once the async save is finalized."""
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
        if collectives.rank() != 0 or not os.path.isdir(directory):
            return
        fields = {"incidents": incidents, "lr_scale": lr_scale, **({"rerun": rerun} if rerun else {})}
        self._pending.append((directory, int(iteration), healthy and rerun is None, fields))
        if getattr(args, "async_save", False) and not _async_saves_finalized():
            log.info("checkpoint iteration %d: marked once its async save is finalized", iteration)
            if len(self._pending) == 1:
                atexit.register(self.write_finalized)
        self.write_finalized()

    def write_finalized(self) -> None:
        """The markers of saves now complete (all, unless an async save is still pending)."""
        if not self._pending or not _async_saves_finalized():
            return
        for directory, iteration, healthy, fields in self._pending:
            if os.path.isdir(directory):
                try:
                    write_marker(directory, iteration, healthy, **fields)
                except OSError as exc:  # the guard's own file must not end the job (rank 0 only)
                    log.warning("checkpoint iteration %d could not be marked (%s): without a marker it "
                                "is never a rollback target; training goes on", iteration, exc)
                    continue
                log.info("checkpoint iteration %d marked %s%s", iteration, "healthy" if healthy else "NOT healthy",
                         f" ({fields['rerun']})" if fields.get("rerun") else "")
        self._pending = []

    def finalize(self, decision: Any = None) -> None:
        """Before any exit of the guard: finish pending async saves (every rank takes part, as
        every rank reaches the exit from the same decision), then mark them."""
        from megatron.training import get_args

        if getattr(get_args(), "async_save", False):
            try:
                from megatron.training.async_utils import maybe_finalize_async_save
            except ImportError:
                from megatron.training.training import maybe_finalize_async_save
            maybe_finalize_async_save(blocking=True)
        self.write_finalized()

    def after_load(self, root: Optional[str], iteration: int) -> None:
        """Megatron loaded ``iteration`` from ``root``: the guard state saved with it comes back,
        and incidents count towards the next marker from here."""
        self._load_state(root, iteration)
        self._incidents_at_save = self.monitor.counters["incidents"]

    def _save_state(self, directory: str) -> None:
        """This rank's detector baselines and counters beside the checkpoint it belongs to."""
        if not os.path.isdir(directory):
            return
        path = state_file(directory, collectives.rank())
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_json_atomic(path, self.monitor.state_dict())
        except OSError as exc:
            log.warning("guard state %s not saved (%s): a restart from this checkpoint starts a new "
                        "detector baseline; training goes on", path, exc)

    def _load_state(self, root: Optional[str], iteration: int) -> None:
        """Detector baselines and counters as saved with the checkpoint Megatron just loaded, so
        the first iteration after a restart is judged like any other."""
        if root is None or iteration <= 0:
            return
        path = state_file(checkpoint.checkpoint_dir(root, iteration), collectives.rank())
        try:
            with open(path, encoding="utf-8") as handle:
                state = json.load(handle)
        except FileNotFoundError:
            warn0("no guard state in %s (saved without megatron_patches?): "
                  "the history detectors start a new baseline", os.path.dirname(path))
            return
        except (OSError, ValueError) as exc:
            log.warning("guard state %s unreadable (%s): the history detectors start a new baseline", path, exc)
            return
        self.monitor.load_state_dict(state)
        warn0("guard state of iteration %d restored (detector baselines, counters) from %s",
              iteration, os.path.dirname(path))


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
