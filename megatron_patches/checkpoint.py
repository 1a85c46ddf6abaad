"""Checkpoint directories marked healthy or not: ``<root>/iter_0000012/`` (the harness's own,
saved by :mod:`megatron_patches.testing.checkpoints`, or Megatron-LM's).

``megatron_patches.json`` beside the data says whether the checkpoint is *healthy*: no
incident since the previous healthy checkpoint and every parameter finite on every rank. A
healthy one written ``certified_at: null`` is a rollback target only once the checked steps
after it came out clean (:class:`Certification`; Megatron-LM's loop marks its own in
:mod:`megatron_patches.seams.megatron_lm.checkpoints`; both, and the in-memory snapshots, are
certified by :mod:`megatron_patches.certify`). Retention never deletes the newest rollback target.
Nothing here knows Megatron's classes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Optional

import torch

from .callbacks import Callback
from .certify import Certifier
from .collectives import collective_device, local_shard
from .files import write_json_atomic

log = logging.getLogger("megatron_patches")

MARKER = "megatron_patches.json"
PREFIX = "iter_"
"""Every checkpoint directory's name: ``iter_`` and the step in seven digits."""


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{PREFIX}{step:07d}")


def write_marker(directory: str, step: int, healthy: bool, **extra: Any) -> None:
    """``megatron_patches.json`` in a checkpoint directory (ours or Megatron-LM's ``iter_N``),
    written atomically (through this module's ``write_json_atomic``, which tests replace to
    plant a failing disk)."""
    write_json_atomic(os.path.join(directory, MARKER), {"step": step, "healthy": bool(healthy), **extra})


def params_finite(model: Any) -> bool:
    """Every parameter finite on every rank (what a healthy checkpoint needs; this rank's shard of
    a fully sharded one): one fused
    max-abs pass (NaN and Inf survive it, large finite values do not overflow), one
    all-reduce, one host read. Collective: call on every rank."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    params = [t for chunk in chunks for p in chunk.parameters() if _holds_data(t := local_shard(p))]
    device = collective_device()
    flag = torch.ones(1, device=device)
    if params:
        flag = torch.stack(torch._foreach_norm(params, float("inf"))).isfinite().all().float().reshape(1).to(device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def _holds_data(tensor: torch.Tensor) -> bool:
    """A non-empty tensor whose storage holds its elements: FSDP's shards (``_local_tensor`` of a
    DTensor) qualify; Megatron-FSDP's unsharded parameters between their all-gathers (storage
    freed to zero bytes) do not, their data lives in the shards."""
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.numel() > 0 and tensor.untyped_storage().nbytes() >= needed


def list_checkpoints(root: str) -> list[tuple[int, str, bool]]:
    """(step, path, healthy) of every complete checkpoint, oldest first.

    A checkpoint whose marker cannot be read (empty after a power loss, not JSON, wrong fields)
    is passed over with a warning: it is no rollback target, and retention leaves it alone."""
    found = []
    if not os.path.isdir(root):
        return found
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(PREFIX) or not os.path.isfile(os.path.join(path, MARKER)):
            continue
        marker = read_marker(path)
        if marker is not None:
            found.append((marker[0], path, marker[1]))
    return sorted(found)


def read_marker(directory: str) -> Optional[tuple[int, bool]]:
    """(step, a rollback target) from ``directory``'s marker: healthy, and certified where the marker
    says it awaits certification (``certified_at: null``); None, with a warning, when unusable."""
    path = os.path.join(directory, MARKER)
    try:
        with open(path, encoding="utf-8") as handle:
            marker = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        why = getattr(exc, "strerror", None) or (str(exc).splitlines() or ["empty"])[0]
        return _bad_marker(path, f"cannot be read as JSON ({why})")
    if not isinstance(marker, dict):
        return _bad_marker(path, f"holds {type(marker).__name__}, not an object")
    step, healthy = marker.get("step"), marker.get("healthy")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return _bad_marker(path, f"has step {step!r}, not a non-negative integer")
    if not isinstance(healthy, bool):
        return _bad_marker(path, f"has healthy {healthy!r}, not true or false")
    certified = marker.get("certified_at", step)  # markers from before certification: targets as they were
    if certified is not None and (isinstance(certified, bool) or not isinstance(certified, int)):
        return _bad_marker(path, f"has certified_at {certified!r}, not an integer or null")
    return step, healthy and certified is not None


def _bad_marker(path: str, why: str) -> None:
    log.warning("checkpoint marker %s %s: that checkpoint is passed over (no rollback target); "
                "delete the checkpoint or rewrite its marker", path, why)
    return None


def newest_healthy(root: str) -> Optional[tuple[int, str]]:
    """The newest rollback target: healthy, and certified where its marker awaited it."""
    healthy = [(step, path) for step, path, ok in list_checkpoints(root) if ok]
    return healthy[-1] if healthy else None


def newest_resumable(root: str) -> Optional[tuple[int, str, bool]]:
    """(step, path, awaiting) of the newest healthy checkpoint, certified or still awaiting it:
    what a job that resumes (not one that rolls back) loads. A save awaits certification when the
    job ended before the checks after it; a flagged check before the end marked it unhealthy."""
    found = [(step, path) for step, path, _ in list_checkpoints(root) if _marker(path).get("healthy") is True]
    if not found:
        return None
    step, path = found[-1]
    marker = _marker(path)
    return step, path, "certified_at" in marker and marker["certified_at"] is None


def _marker(directory: str) -> dict:
    with open(os.path.join(directory, MARKER), encoding="utf-8") as handle:
        return json.load(handle)


class Certification(Callback):
    """Rank 0's healthy checkpoints of this run awaiting certification (:mod:`megatron_patches.certify`):
    each becomes a rollback target at its ``certify_steps``-th clean checked step (its marker
    rewritten with ``certified_at``), and is marked unhealthy (``not_certified``) at a flagged step
    first. Loops that write these markers register one with the monitor (the tiny-GPT harness)."""

    def __init__(self, certify_steps: int, rank: int):
        self.rank = rank
        self.certifier = Certifier(certify_steps)
        """(step, path) of each checkpoint awaiting its clean checks (rank 0)."""

    def awaiting(self, step: int, path: str) -> None:
        """A checkpoint written (or loaded) with ``certified_at: null``."""
        if self.rank == 0:
            self.certifier.add(step, (step, path))

    def after_check(self, step: int, flagged: bool) -> None:
        certified, dropped = self.certifier.note_check(step, flagged)
        for entry in dropped:
            self._settle(entry, {"healthy": False,
                                 "not_certified": f"step {step} was flagged before the checkpoint was certified"})
        for entry in certified:
            self._settle(entry, {"certified_at": step})

    def _settle(self, entry: tuple, fields: dict) -> None:
        step, path = entry
        try:
            write_json_atomic(os.path.join(path, MARKER), {**_marker(path), **fields})
        except (OSError, ValueError) as error:  # gone (retention) or unreadable: it stays no target
            log.warning("checkpoint step %d: marker not rewritten (%s)", step, error)
            return
        log.info("checkpoint step %d %s", step, f"not certified: {fields['not_certified']}" if "not_certified" in fields
                 else f"certified at step {fields['certified_at']}")


def apply_retention(root: str, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints under ``root``, and the newest healthy one whatever its age."""
    checkpoints = list_checkpoints(root)
    protected = newest_healthy(root)
    for step, path, _ in checkpoints[:-keep] if keep > 0 else []:
        if protected is None or path != protected[1]:
            shutil.rmtree(path, ignore_errors=True)
