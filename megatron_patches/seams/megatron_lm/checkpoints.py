"""What megatron_patches keeps in Megatron-LM's ``--save`` directory, and when it writes it.

Megatron-LM writes ``iter_N/`` and, once a save is complete (async saves included), the tracker
file ``latest_checkpointed_iteration.txt``. Beside Megatron's data this module keeps, per
checkpoint:

- ``iter_N/megatron_patches.json`` (rank 0): healthy when no incident happened since the previous
  save, every parameter is finite and Megatron's rerun state machine did not make the save; with
  the ledger's learning-rate scale the param groups were saved with. An async save is marked only
  once Megatron finalized it: at the next ``train_step``, before any exit of the guard, or at
  process exit. A healthy save is written ``certified_at: null`` and becomes a rollback target
  only once ``recovery.certify_steps`` further checked steps came out clean (the replicas'
  agreement is part of each check): the marker is rewritten with ``certified_at`` the step that
  certified it, or unhealthy with ``not_certified`` the step flagged first, or the step a diverged
  replica may date from (:meth:`CheckpointMarks.disqualify_since`).
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

from ... import checkpoint, collectives
from ...callbacks import Callback
from ...certify import Certifier
from ...detectors import target_taken
from ...detectors.base import Rotation
from ...files import write_json_atomic
from ...protocols import Guard

log = logging.getLogger("megatron_patches")

TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's record of the newest complete checkpoint in ``--save``."""

STATE_DIR = "megatron_patches_state"
"""Per-rank guard state saved inside each Megatron-LM ``iter_N`` directory: each rank's history
baselines describe its own tensors, so every rank keeps its own file."""


DIVERGED = "rank_mismatch"
"""The incident kind of a data-parallel replica that differs from the others."""


def diverged_since(config: Any, found_at: int) -> int:
    """The earliest step a replica found diverged at ``found_at`` may date from: it was last seen
    agreeing at most as many steps ago as the consistency detector takes to read every tensor once."""
    consistency = config.detectors.consistency
    rotation = Rotation(consistency.interval, consistency.sample_fraction)
    return found_at - rotation.period * consistency.interval * config.check_interval


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
    value = _marker_fields(checkpoint.checkpoint_dir(root, iteration)).get("lr_scale", 1.0)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 1.0


# --- writing them as Megatron saves ---------------------------------------------------------------


class CheckpointMarks(Callback):
    """The markers and guard-state files of one Megatron-LM process's saves; a callback of its
    monitor (the loop integration adds it). A loop with another home for its arguments
    (Megatron-Bridge's) overrides the four methods that read them."""

    def __init__(self, monitor: Guard):
        self.monitor = monitor
        self._incidents_at_save = 0
        self._pending: list[dict] = []
        """Rank 0: saves not marked yet ({directory, iteration, healthy, fields})."""
        self.certifier = Certifier(monitor.state.config.recovery.certify_steps)
        """Rank 0: healthy saves not certified yet (the same entries, with ``marked``)."""

    # -- what the loop says about its saves (Megatron-LM's args here) --------------------------------

    def save_root(self) -> Optional[str]:
        """Where the loop saves its checkpoints (None: it saves none)."""
        from megatron.training import get_args

        return get_args().save

    def async_save(self) -> bool:
        """Whether the loop's saves finish in the background."""
        from megatron.training import get_args

        return bool(getattr(get_args(), "async_save", False))

    def async_saves_finalized(self) -> bool:
        """True when no async checkpoint save of this process is still unfinalized."""
        return _async_saves_finalized()

    def finish_async_saves(self) -> None:
        """Block until this process's async saves are finalized (every rank takes part)."""
        try:
            from megatron.training.async_utils import maybe_finalize_async_save
        except ImportError:
            from megatron.training.training import maybe_finalize_async_save
        maybe_finalize_async_save(blocking=True)

    # -- the markers -----------------------------------------------------------------------------------

    def after_save(self, iteration: int, model: Any, non_persistent: bool, lr_scale: float) -> None:
        """The loop's ``save_checkpoint`` returned: this rank's state file, and (rank 0) the
        marker, now or once the async save is finalized."""
        root = self.save_root()
        if root is None or non_persistent:
            return
        incidents = self.monitor.state.counters["incidents"]
        healthy = incidents == self._incidents_at_save and checkpoint.params_finite(model)
        rerun = _rerun_checkpoint()
        self._incidents_at_save = incidents
        directory = checkpoint.checkpoint_dir(root, int(iteration))
        self._save_state(directory)
        target_taken(self.monitor.state.detectors)  # every rank: the check that certifies it reads all the held state
        if collectives.rank() != 0 or not os.path.isdir(directory):
            return
        healthy = healthy and rerun is None
        entry = {"directory": directory, "iteration": int(iteration), "healthy": healthy, "marked": False,
                 "fields": {"incidents": incidents, "lr_scale": lr_scale, **({"rerun": rerun} if rerun else {}),
                            **({"certified_at": None} if healthy else {})}}
        self._pending.append(entry)
        if healthy:
            self.certifier.add(int(iteration), entry)
        if self.async_save() and not self.async_saves_finalized():
            log.info("checkpoint iteration %d: marked once its async save is finalized", iteration)
            if len(self._pending) == 1:
                atexit.register(self.write_finalized)
        self.write_finalized()

    def write_finalized(self) -> None:
        """The markers of saves now complete (all, unless an async save is still pending)."""
        if not self._pending or not self.async_saves_finalized():
            return
        for entry in self._pending:
            if self._write(entry):
                entry["marked"] = True
                log.info("checkpoint iteration %d marked %s%s", entry["iteration"],
                         "healthy" if entry["healthy"] else "NOT healthy",
                         f" ({entry['fields']['rerun']})" if entry["fields"].get("rerun") else "")
        self._pending = []

    def after_check(self, step: int, flagged: bool) -> None:
        """Rank 0, after each checked step: certify the healthy saves that have had
        ``recovery.certify_steps`` clean checked steps since, or disqualify them at a flagged one
        (:mod:`megatron_patches.certify`)."""
        certified, dropped = self.certifier.note_check(step, flagged)
        for entry in dropped:
            self._settle(entry, f"step {step} was flagged before the checkpoint was certified")
        for entry in certified:
            entry["fields"]["certified_at"] = step
            self._settle(entry, None)

    # -- the monitor's events (callbacks.Callback) ---------------------------------------------------

    def after_rollback(self, rollbacks: int) -> None:
        """An in-process rollback undid the incidents since the last save: they no longer make
        the next one unhealthy."""
        self._incidents_at_save = self.monitor.state.counters["incidents"]

    def on_decision(self, decision: Any, incident: Any) -> None:
        """Rank 0: a diverged replica disqualifies every checkpoint it may be in."""
        if incident is not None and DIVERGED in incident.kinds:
            self.disqualify_since(diverged_since(self.monitor.state.config, int(decision.step)), int(decision.step))

    def before_exit(self, decision: Any) -> None:
        """Before any exit of the guard (and before the ledger is written): pending async saves
        finished and marked."""
        self.finalize(decision)

    def disqualify_since(self, since: int, found_at: int) -> None:
        """Rank 0: a replica found diverged at ``found_at`` may date from ``since``: no checkpoint
        saved at or after it is a target (markers already certified are rewritten too)."""
        root = self.save_root()
        # Those still awaiting certification (a target only once certified, so not listed as one) and
        # the certified targets on disk.
        suspect = {e["iteration"]: e for e in self.certifier.waiting() if e["iteration"] >= since}
        for step, directory, target in checkpoint.list_checkpoints(root) if root else []:
            if target and step >= since and step not in suspect:
                suspect[step] = {"directory": directory, "iteration": step, "marked": True,
                                 "fields": _marker_fields(directory)}
        for entry in suspect.values():
            self._settle(entry, f"a replica found diverged at step {found_at} may date from step {since}")

    def _settle(self, entry: dict, not_certified: Optional[str]) -> None:
        self.certifier.discard(entry)
        if not_certified is not None:
            entry["healthy"] = False
            entry["fields"] = {**entry["fields"], "certified_at": None, "not_certified": not_certified}
        if entry["marked"] and self._write(entry):
            log.info("checkpoint iteration %d %s", entry["iteration"], f"not certified: {not_certified}"
                     if not_certified else f"certified at step {entry['fields']['certified_at']}")

    def _write(self, entry: dict) -> bool:
        if not os.path.isdir(entry["directory"]):
            return False
        try:
            write_marker(entry["directory"], entry["iteration"], entry["healthy"], **entry["fields"])
        except OSError as exc:  # the guard's own file must not end the job (rank 0 only)
            log.warning("checkpoint iteration %d could not be marked (%s): without a marker it is never a "
                        "rollback target; training goes on", entry["iteration"], exc)
            return False
        return True

    def finalize(self, decision: Any = None) -> None:
        """Before any exit of the guard: finish pending async saves (every rank takes part, as
        every rank reaches the exit from the same decision), then mark them."""
        if self.async_save():
            self.finish_async_saves()
        self.write_finalized()

    def after_load(self, root: Optional[str], iteration: int) -> None:
        """Megatron loaded ``iteration`` from ``root``: the guard state saved with it comes back,
        and incidents count towards the next marker from here."""
        self._load_state(root, iteration)
        self._incidents_at_save = self.monitor.state.counters["incidents"]
        if root is not None and iteration > 0 and collectives.rank() == 0:  # a job's last save awaits its next steps
            directory = checkpoint.checkpoint_dir(root, iteration)
            fields = _marker_fields(directory)
            if "certified_at" in fields and fields["certified_at"] is None and "not_certified" not in fields:
                self.certifier.add(iteration, {"directory": directory, "iteration": iteration, "healthy": True,
                                               "marked": True, "fields": fields})

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


def _marker_fields(directory: str) -> dict:
    """A marker's fields beyond step and healthy (empty where it cannot be read)."""
    try:
        with open(os.path.join(directory, checkpoint.MARKER), encoding="utf-8") as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in marker.items() if k not in ("step", "healthy", "format")} if isinstance(marker, dict) else {}


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
