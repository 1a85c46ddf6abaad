"""Checkpoints through megatron-core's dist_checkpointing, marked healthy or not.

A checkpoint is ``<root>/iter_0000012/``: model and optimizer as megatron-core sharded state
dicts, plus the scheduler, the data position, the guard's state and every rank's RNG states
(as ``ShardedObject``s, one per rank). It is saved under a temporary name and renamed when
every rank has finished, so a directory named ``iter_*`` is always complete.

``megatron_patches.json`` beside the data says whether the checkpoint is *healthy*: no
incident since the previous healthy checkpoint and every parameter finite on every rank.
Retention never deletes the newest healthy checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Optional

import torch

from .collectives import collective_device, local_shard, rank, world_size
from .files import write_json_atomic
from .rng import rng_state, set_rng_state  # trainer and monitor import these from here too

log = logging.getLogger("megatron_patches")

MARKER = "megatron_patches.json"
_PREFIX = "iter_"


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _inner(model: Any) -> Any:
    """The module inside DDP: its state-dict keys carry no ``module.`` prefix."""
    from megatron.core.distributed import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _optimizer_metadata(optimizer: Any) -> dict:
    """dp_reshardable: each rank saves its own distributed-optimizer buffers as they are
    (megatron-core 0.16's default format rejects flattened ranges at save time). Releases
    before 0.13 take no ``metadata`` argument on every leaf optimizer: pass none there."""
    import inspect

    leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    if all("metadata" in inspect.signature(leaf.sharded_state_dict).parameters for leaf in leaves):
        return {"metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}
    return {}


def _sharded_state(model: Any, optimizer: Any, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = _inner(model).sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **_optimizer_metadata(optimizer)),
        "rng": ShardedObject("megatron_patches.rng", None if is_loading else rng_state(),
                             (world_size(),), (rank(),), replica_id=0),
    }


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{_PREFIX}{step:07d}")


def save_checkpoint(root: str, step: int, model: Any, optimizer: Any, scheduler: Any, extra: dict,
                    healthy: bool, keep: int = 3) -> str:
    """Save on every rank (collective); returns the checkpoint directory.

    ``extra`` (scheduler-independent, identical on all ranks: data position, guard state...)
    is stored in the common part. ``healthy`` must be the same on every rank."""
    from megatron.core import dist_checkpointing

    final = checkpoint_dir(root, step)
    tmp = os.path.join(root, f".tmp_{_PREFIX}{step:07d}")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state["common"] = {"step": step, "scheduler": scheduler.state_dict(), **extra}
    dist_checkpointing.save(state, tmp)
    _barrier()
    if rank() == 0:
        try:
            write_marker(tmp, step, healthy)
        except OSError as error:  # the others wait at the barrier below: never raise here
            log.warning("checkpoint step %d could not be marked (%s): without a marker it is never a "
                        "rollback target", step, error)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _apply_retention(root, keep)
    _barrier()
    return final


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
        if not name.startswith(_PREFIX) or not os.path.isfile(os.path.join(path, MARKER)):
            continue
        marker = read_marker(path)
        if marker is not None:
            found.append((marker[0], path, marker[1]))
    return sorted(found)


def read_marker(directory: str) -> Optional[tuple[int, bool]]:
    """(step, healthy) from ``directory``'s marker; None, with a warning, when it is unusable."""
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
    return step, healthy


def _bad_marker(path: str, why: str) -> None:
    log.warning("checkpoint marker %s %s: that checkpoint is passed over (no rollback target); "
                "delete the checkpoint or rewrite its marker", path, why)
    return None


def newest_healthy(root: str) -> Optional[tuple[int, str]]:
    healthy = [(step, path) for step, path, ok in list_checkpoints(root) if ok]
    return healthy[-1] if healthy else None


def _apply_retention(root: str, keep: int) -> None:
    checkpoints = list_checkpoints(root)
    protected = newest_healthy(root)
    for step, path, _ in checkpoints[:-keep] if keep > 0 else []:
        if protected is None or path != protected[1]:
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: str, model: Any, optimizer: Any, scheduler: Any) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG from ``path``; returns the
    common part (step, data position, guard state...)."""
    from megatron.core import dist_checkpointing

    state = _sharded_state(model, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, path)
    _inner(model).load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    common = dist_checkpointing.load_common_state_dict(path)["common"]
    scheduler.load_state_dict(common["scheduler"])
    set_rng_state(loaded["rng"])
    return common
