"""This rank's state in Megatron-LM's loop as an in-process rollback needs it: the batches each
iteration read (:class:`BatchTape`, inside Megatron's ``RerunDataIterator``), every tensor of the
model and the optimizer (:func:`live_tensors`) and the small values beside them
(:func:`small_values`, :func:`restore_values`). Used by :mod:`.inprocess`.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any, Optional

import torch

from ... import collectives
from .. import rng
from ...protocols import Guard

_RERUN_FIELDS = ("current_iteration", "large_value_counts", "max_values", "validation_counts")
"""What Megatron's rerun machine accumulates from iteration to iteration (its state while not rerunning)."""


class BatchTape:
    """Sits inside Megatron's ``RerunDataIterator`` and keeps what each iteration read from the
    data loader, so that a redo can read the same again (:meth:`replay`). Reads outside a trained
    iteration (``dummy_train_step`` of a skipped one) are passed through unrecorded."""

    def __init__(self, source: Any):
        self.source = source
        self.records: dict[int, list] = {}
        self.iteration: Optional[int] = None
        self._pending: deque = deque()

    def __iter__(self) -> "BatchTape":
        return self

    def __next__(self) -> Any:
        if self._pending:
            return self._pending.popleft()
        item = next(self.source)
        if self.iteration is not None:
            self.records.setdefault(self.iteration, []).append(item)
        return item

    def replay(self, iteration: int) -> None:
        """The next reads return what ``iteration`` read, in order."""
        self._pending = deque(self.records.get(iteration, ()))

    def live(self) -> None:
        """The next reads come from the data loader again (what a replay left unread is dropped)."""
        self._pending.clear()

    def forget_through(self, iteration: int) -> None:
        for old in [i for i in self.records if i <= iteration]:
            del self.records[old]


def install_tapes(data_iterator: Any) -> Optional[list]:
    """A :class:`BatchTape` inside each of Megatron's ``RerunDataIterator`` (a list of them under
    an interleaved pipeline; None where a rank reads no data); None when an iterator is of
    another kind (a loop the guard cannot tape)."""
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    tapes = []
    for iterator in iterators:
        if iterator is None:
            continue
        if type(iterator).__name__ != "RerunDataIterator" or not hasattr(iterator, "iterable"):
            return None
        if not isinstance(iterator.iterable, BatchTape):
            iterator.iterable = BatchTape(iterator.iterable)
        tapes.append(iterator.iterable)
    return tapes


# --- this rank's state: what a snapshot copies ---------------------------------------------------


def _leaves(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def live_tensors(model_chunks: list, optimizer: Any) -> list:
    """Every tensor of this rank's training state, in a fixed order: the model's parameters
    (except under Megatron-FSDP, see below), then each optimizer leaf's stepped parameters (main
    weights or their shards) and their state (Adam's moments and step), each once."""
    seen: set = set()
    out: list = []

    def add(tensor: Any) -> None:
        if torch.is_tensor(tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(collectives.local_shard(tensor))

    # Megatron-FSDP frees the storage of the unsharded parameters between the forward passes that
    # gather them from the shards the optimizer steps: the shards alone are the model's state.
    if not _megatron_fsdp(model_chunks):
        for chunk in model_chunks:
            for param in chunk.parameters():
                add(param)
    for leaf in _leaves(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                add(param)
                for _, value in sorted(inner.state.get(param, {}).items()):
                    add(value)
    return out


def _megatron_fsdp(model_chunks: list) -> bool:
    return any(getattr(getattr(chunk, "ddp_config", None), "use_megatron_fsdp", False) for chunk in model_chunks)


def after_restore(model_chunks: list, optimizer: Any) -> None:
    """Under Megatron-FSDP the weights the forward gathers live in a buffer of their own, copied
    from the main-weight shards after each step: copied again from the restored shards."""
    if not _megatron_fsdp(model_chunks):
        return
    for leaf in _leaves(optimizer):
        copy_over = getattr(leaf, "_copy_main_params_to_model_params", None)
        if copy_over is not None:
            copy_over()


def snapshot_bytes(model_chunks: list, optimizer: Any) -> int:
    """Bytes one snapshot of :func:`live_tensors` takes on this rank, known before the first step:
    the state tensors an optimizer creates at its first step are counted as they will be (Adam's
    two moments, and a third with amsgrad, shaped like the parameter; SGD's momentum buffer), the
    ones already there as they are."""
    total = sum(t.numel() * t.element_size() for t in live_tensors(model_chunks, optimizer))
    for leaf in _leaves(optimizer):
        inner = getattr(leaf, "optimizer", None)
        for group in getattr(inner, "param_groups", ()):
            for param in group["params"]:
                if inner.state.get(param):
                    continue  # already counted among the live tensors
                shard = collectives.local_shard(param)
                total += _state_tensors_to_come(group) * shard.numel() * shard.element_size()
                total += 4 if "betas" in group else 0  # torch Adam's step, a float32 scalar per parameter
    return total


def _state_tensors_to_come(group: dict) -> int:
    """Parameter-shaped state tensors a torch optimizer's group creates at its first step."""
    if "betas" in group:  # the Adam family
        return 3 if group.get("amsgrad") else 2
    return 1 if group.get("momentum") else 0


def small_values(optimizer: Any, scheduler: Any, monitor: Guard, lr_scale: float) -> dict:
    """Copies of what is not a tensor of the model or optimizer: scheduler, group settings (lr,
    step), loss scaler, every RNG, the rerun machine's counts (where the loop started one), the
    guard's baselines."""
    machine = _rerun_machine()
    leaves = _leaves(optimizer)
    return {
        "scheduler": {k: copy.deepcopy(v) for k, v in vars(scheduler).items() if k != "optimizer"},
        "groups": [[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                    for g in getattr(getattr(leaf, "optimizer", None), "param_groups", [])] for leaf in leaves],
        "scalers": [copy.deepcopy(leaf.grad_scaler.state_dict()) if getattr(leaf, "grad_scaler", None) else None
                    for leaf in leaves],
        "rng": rng.rng_state(),
        "rerun": {name: copy.deepcopy(getattr(machine, name)) for name in _RERUN_FIELDS if hasattr(machine, name)}
        if machine is not None else {},
        "monitor": copy.deepcopy(monitor.state_dict()),
        "lr_scale": lr_scale,
    }


def restore_values(values: dict, optimizer: Any, scheduler: Any, monitor: Guard) -> None:
    """Put :func:`small_values` back (the tensors are :func:`megatron_patches.snapshots.restore`'s)."""
    vars(scheduler).update(copy.deepcopy(values["scheduler"]))
    for leaf, groups, scaler in zip(_leaves(optimizer), values["groups"], values["scalers"]):
        for group, saved in zip(getattr(getattr(leaf, "optimizer", None), "param_groups", []), groups):
            group.update(copy.deepcopy(saved))
        if scaler is not None:
            leaf.grad_scaler.load_state_dict(copy.deepcopy(scaler))
    rng.set_rng_state(values["rng"])
    machine = _rerun_machine()
    for name, value in values["rerun"].items() if machine is not None else ():
        setattr(machine, name, copy.deepcopy(value))
    monitor.load_state_dict(copy.deepcopy(values["monitor"]))


def _rerun_machine() -> Any:
    """Megatron's rerun state machine where the loop started one (Megatron-LM's does), else None:
    asking for it would start one (the tiny-GPT harness has none)."""
    from megatron.core import rerun_state_machine

    return rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE
