"""The harness's checkpoints through megatron-core's dist_checkpointing.

A checkpoint is ``<root>/iter_0000012/``: model and optimizer as megatron-core sharded state
dicts, plus the scheduler, the data position, the guard's state and every rank's RNG states
(as ``ShardedObject``s, one per rank). It is saved under a temporary name and renamed when
every rank has finished, so a directory named ``iter_*`` is always complete; the healthy marker
and retention are :mod:`megatron_patches.checkpoint`'s.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch

from .. import checkpoint
from ..collectives import rank, world_size
from ..seams.rng import rng_state, set_rng_state

log = logging.getLogger("megatron_patches")


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


def save_checkpoint(root: str, step: int, model: Any, optimizer: Any, scheduler: Any, extra: dict,
                    healthy: bool, keep: int = 3, awaiting: bool = False) -> str:
    """Save on every rank (collective); returns the checkpoint directory.

    ``extra`` (scheduler-independent, identical on all ranks: data position, guard state...)
    is stored in the common part. ``healthy`` must be the same on every rank. ``awaiting``: a
    healthy one is marked ``certified_at: null`` (a rollback target once certified)."""
    from megatron.core import dist_checkpointing

    final = checkpoint.checkpoint_dir(root, step)
    tmp = os.path.join(root, f".tmp_{checkpoint.PREFIX}{step:07d}")
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
            checkpoint.write_marker(tmp, step, healthy, **({"certified_at": None} if healthy and awaiting else {}))
        except OSError as error:  # the others wait at the barrier below: never raise here
            log.warning("checkpoint step %d could not be marked (%s): without a marker it is never a "
                        "rollback target", step, error)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        checkpoint.apply_retention(root, keep)
    _barrier()
    return final


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
