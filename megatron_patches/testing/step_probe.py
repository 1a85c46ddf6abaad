"""What each iteration of Megatron-LM's loop did to the weights and the optimizer state, for tests.

With ``MEGATRON_PATCHES_STEP_PROBE=DIR`` set, the CPU runner
(:mod:`megatron_patches.testing.pretrain_cpu`) wraps ``megatron.training.training.train_step`` so
that each rank appends one JSON line per iteration to ``DIR/rank<R>.jsonl``::

    {"iteration": 3, "weights_changed": false, "state_changed": false, "finite": true,
     "weights": "9f2c...", "state": "41d0..."}

In a guarded run each line also has ``"guard": {"checked_steps": n, "norm_kernel_calls": k,
"shared_norm_reads": m}`` (Megatron's norm-kernel calls so far, and how many of them got the
check's own call's result).
``weights_changed``: any bit of the model's parameters differs after the step (all virtual stages;
under Megatron-FSDP its weight shards);
``state_changed``: any bit of the optimizer's state differs (each leaf's torch optimizer: its
parameters, which are the main weights or shards it steps, the host copies of CPU offload,
every state tensor and the groups' ``step``); ``finite``: every parameter is finite after it; ``weights`` and ``state``: SHA-256 of those bytes
after the step (two runs that agree bit for bit agree on them). A skipped step must leave both
``*_changed`` False.
It reads every byte twice per iteration: for tests only.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_patches.collectives import local_shard
from megatron_patches.seams import wrappers

ENV = "MEGATRON_PATCHES_STEP_PROBE"
GUARD_COUNTERS = ("checked_steps", "norm_kernel_calls", "shared_norm_reads")
"""The guard's counters each line carries under ``"guard"`` in a guarded run."""


def _tensors_of_optimizer(optimizer: Any) -> Iterator[torch.Tensor]:
    for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(leaf, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield torch.tensor([float(group.get("step", 0) or 0)])
            yield from group["params"]
        # CPU offload (HybridDeviceOptimizer): the host and fp32 copies its sub-optimizers step.
        yield from getattr(inner, "param_to_inner_param", {}).values()
        for state in inner.state.values():
            yield from (value for _, value in sorted(state.items()) if torch.is_tensor(value))


def _digest(tensors) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        tensor = local_shard(tensor)  # a DTensor (FSDP): this rank's shard
        # A host copy: numpy() needs one, would mark the storage as not resizable, and FSDP resizes storages.
        digest.update(tensor.detach().to("cpu", copy=True).view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _weights(model: Any, optimizer: Any) -> list:
    """The model's parameters; under Megatron-FSDP the sharded weights the optimizer steps
    instead (it frees the storage of the unsharded parameters until the next forward gathers
    them, and after a skipped step nothing gathers them before that forward)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if any(getattr(getattr(c, "ddp_config", None), "use_megatron_fsdp", False) for c in chunks):
        return [p for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]
                for group in leaf.optimizer.param_groups for p in group["params"]]
    return [p for chunk in chunks for p in chunk.parameters()]


def install(directory: str) -> None:
    """Wrap ``train_step`` of the imported ``megatron.training.training`` (see the module)."""
    from megatron.training import get_args, training

    original = training.train_step
    signature = inspect.signature(original)
    Path(directory).mkdir(parents=True, exist_ok=True)

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        params = _weights(bound["model"], bound["optimizer"])
        before = (_digest(params), _digest(_tensors_of_optimizer(bound["optimizer"])))
        result = original(*args, **kwargs)
        after = (_digest(params), _digest(_tensors_of_optimizer(bound["optimizer"])))
        line = {"iteration": int(get_args().curr_iteration) + 1, "weights_changed": before[0] != after[0],
                "state_changed": before[1] != after[1],
                "finite": all(bool(torch.isfinite(local_shard(p)).all()) for p in params),
                "weights": after[0], "state": after[1]}
        monitor = wrappers.get_monitor()
        if monitor is not None:
            line["guard"] = {name: monitor.state.counters[name] for name in GUARD_COUNTERS}
        rank = torch.distributed.get_rank()
        with open(Path(directory) / f"rank{rank}.jsonl", "a") as out:
            out.write(json.dumps(line) + "\n")
        return result

    training.train_step = train_step


def read(directory: Path) -> dict[int, list[dict]]:
    """{rank: [line per iteration]} of a probed run."""
    return {int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted(Path(directory).glob("rank*.jsonl"))}
