"""What torch FSDP2 (``--use-torch-fsdp2``) and Megatron-FSDP (``--use-megatron-fsdp``) need to
train, save and resume on the CPU test runtime. Each redirect says whether it is about the CPU or
about this torch / the torch-optimizer fallback (no Transformer Engine or Apex here):

- CPU: megatron-core's FSDP2 wrapper builds its device mesh with
  ``DeviceMesh.from_group(group, "cuda")``; on the CPU the mesh must be a ``"cpu"`` one
  (:class:`_CpuMesh`), or ``fully_shard`` asserts that the parameters are not on ``cuda:0``.
- This torch: ``Parameter(DTensor).to_local()`` returns a new view at each call (torch 2.9+), and
  megatron-core's optimizer checkpointing pairs each optimizer parameter with its model tensor by
  the identity of that view, so no pair is found at save or load ("Param id ... does not match
  any model sharded param"). :func:`~megatron_patches.collectives.local_shard` returns the shard object (``_local_tensor``).
- Torch-optimizer fallback: under FSDP2 a ``torch_dist`` load fills parameters and Adam moments in
  place and never calls the optimizer's ``load_state_dict``, so torch's Adam has no ``step`` on
  the next update (KeyError). :func:`_with_adam_steps_restored` puts the checkpoint's step back.
- Megatron-FSDP, any machine with a rank whose shard of a parameter is empty (tiny models here):
  torch's Adam makes no state for a parameter without a gradient, the ranks then save different
  optimizer-state keys, and the uneven-DTensor preprocessing of ``fsdp_dtensor`` saves runs a
  different number of collectives per rank (the save hangs; Megatron-LM issues 4910, 6573).
  :func:`_with_state_for_every_param` gives every parameter zero moments and the common step.

- CPU, Megatron-FSDP: the parameter all-gathers are issued as one coalesced asynchronous gloo
  operation, whose copy into the unsharded buckets runs on a gloo worker thread while the main
  thread trains on; Megatron-FSDP orders the two by CUDA stream and event, which the CPU runtime's
  null stream does not give. Left asynchronous, a rank aborted in glibc ("malloc(): unaligned
  tcache chunk detected") or segfaulted in 4 of 9 runs of 300 iterations with the guard and 2 of
  13 without it; :func:`_waited_at_exit` makes each coalesced gather finish before its ``with``
  block ends (0 of 9 with the guard). The exact buffer written after its release was not found.

Used only by the CPU test runtime (:mod:`megatron_patches.testing.megatron_lm_cpu`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from megatron_patches.collectives import local_shard


def _cpu_mesh(mesh_class: Any) -> type:
    class _CpuMesh:
        """``DeviceMesh`` where megatron-core's FSDP2 wrapper asks for one over a process group."""

        @staticmethod
        def from_group(group, device_type, *args, **kwargs):
            return mesh_class.from_group(group, "cpu" if str(device_type).startswith("cuda") else device_type,
                                         *args, **kwargs)

    return _CpuMesh


def _with_adam_steps_restored(load_checkpoint, checkpointing) -> Any:
    @functools.wraps(load_checkpoint)
    def load(model, optimizer, *args, **kwargs):
        loaded = []
        base = checkpointing._load_base_checkpoint

        def keep(*a, **k):
            result = base(*a, **k)
            loaded.append(result[0])
            return result

        checkpointing._load_base_checkpoint = keep
        try:
            result = load_checkpoint(model, optimizer, *args, **kwargs)
        finally:
            checkpointing._load_base_checkpoint = base
        state = loaded[-1] if loaded else None
        if optimizer is not None and isinstance(state, dict) and "optimizer" in state:
            leaves = getattr(optimizer, "chained_optimizers", None) or [optimizer]
            saved = [state["optimizer"]] if len(leaves) == 1 else [state["optimizer"][i] for i in range(len(leaves))]
            for leaf, leaf_state in zip(leaves, saved):
                step = leaf_state.get("state", {}).get("common_step") if isinstance(leaf_state, dict) else None
                inner = getattr(leaf, "optimizer", None)
                if (step is not None and inner is not None and hasattr(leaf, "_restore_common_per_param_step")
                        and any("step" not in s for s in inner.state.values())):
                    leaf._restore_common_per_param_step({"state": inner.state}, step)
        return result

    return load


def _with_state_for_every_param(original):
    @functools.wraps(original)
    def state_dict(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = result["state"]
        steps = [v["step"].detach().float().reshape(()) for v in state.values()
                 if isinstance(v, dict) and torch.is_tensor(v.get("step"))]
        step = torch.stack(steps).max() if steps else torch.tensor(0.0)
        torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MAX, group=self.get_grad_stats_parallel_group())
        dtype = steps[0].dtype if steps else step.dtype
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state.setdefault(self._param_name(param), {
                    "step": step.to(dtype).clone(), "exp_avg": torch.zeros_like(param),
                    "exp_avg_sq": torch.zeros_like(param)})
        return result

    return state_dict


def _waited_at_exit(coalescing_manager):
    @contextlib.contextmanager
    def synchronous(group=None, device=None, async_ops=False):
        with coalescing_manager(group, device, async_ops=False) as manager:
            yield manager  # its wait() has no work left to wait for

    return synchronous


def redirects() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for the Megatron-LM CPU runtime, where this release has them."""
    items: list[tuple[Any, str, Any]] = []
    try:
        from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp2
    except ImportError:  # pragma: no cover - a torch without FSDP2
        fsdp2 = None
    if fsdp2 is not None and "DeviceMesh" in fsdp2.__dict__:
        items.append((fsdp2, "DeviceMesh", _cpu_mesh(fsdp2.DeviceMesh)))
    from megatron.core.dist_checkpointing import optimizer as checkpoint_optimizer

    if "to_local_if_dtensor" in checkpoint_optimizer.__dict__:
        items.append((checkpoint_optimizer, "to_local_if_dtensor", local_shard))
    from megatron.training import checkpointing, training

    if "_load_base_checkpoint" in checkpointing.__dict__:
        load = _with_adam_steps_restored(checkpointing.__dict__["load_checkpoint"], checkpointing)
        items += [(checkpointing, "load_checkpoint", load), (training, "load_checkpoint", load)]
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__.get("sharded_param_state_fsdp_dtensor")
    if original is not None:
        items.append((DistributedOptimizer, "sharded_param_state_fsdp_dtensor", _with_state_for_every_param(original)))
    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffers
    except ImportError:  # a megatron-core without Megatron-FSDP
        fsdp_buffers = None
    if fsdp_buffers is not None and "_coalescing_manager" in fsdp_buffers.__dict__:
        items.append((fsdp_buffers, "_coalescing_manager", _waited_at_exit(fsdp_buffers._coalescing_manager)))
    return items
