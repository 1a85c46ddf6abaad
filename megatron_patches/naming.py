"""Where a gradient lives: global parameter names, layers, and the rank holding it.

Names are what a non-pipelined ``model.named_parameters()`` would give, without the
``module.`` prefixes of DDP/Float16Module, and with the global layer index under pipeline
parallelism (``decoder.layers.0`` on the second stage of a 4-layer, PP=2 model is
``decoder.layers.2``). ``order`` runs along the forward pass over the whole model, so in
backward order the bad parameter with the largest ``order`` is where the fault entered.

The ranks and sizes come from ``ps``: megatron-core's ``parallel_state`` module as the seams hand
it over (:meth:`~megatron_patches.protocols.Seams.parallel_state`), or None outside model
parallelism (one rank of every group). This module imports no megatron.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .collectives import rank, world_size

_LAYER_PATH = re.compile(r"^(?P<prefix>.*\blayers)\.(?P<idx>\d+)$")
_LAYER_IN_NAME = re.compile(r"\blayers\.(\d+)\.")
# A routed expert's parameter or module: ``...mlp.experts.local_experts.K...`` (sequential experts)
# or ``...mlp.experts.linear_fc1.weightK`` (Transformer Engine's grouped experts, one tensor each).
# ``shared_experts`` never matches: the dot before ``experts`` is required.
_EXPERT_IN_NAME = re.compile(r"\.experts\.(?:local_experts\.(\d+)(?:\.|$)|.*\.(?:weight|bias)(\d+)$)")
_STAGE_STRIDE = 1_000_000


@dataclass(frozen=True)
class ParamInfo:
    name: str
    layer: Optional[int]
    order: int
    counts_in_norm: bool
    """False for copies that Megatron's grad norm skips: TP-replicated parameters on TP ranks
    other than 0 (for a routed expert's parameters, replicated over the expert-TP group: on
    expert-TP ranks other than 0), and shared (tied) parameters."""
    chunk: int = 0
    """Index of the model chunk holding it: its virtual pipeline rank under an interleaved
    schedule (0 otherwise)."""
    expert: Optional[tuple[int, int]] = None
    """(global, local) index of the routed expert it belongs to (:func:`expert_of`); None outside
    the experts (dense layers, routers, shared experts)."""
    full_shape: Optional[tuple[int, ...]] = None
    """The whole weight's shape where this rank holds a tensor-parallel slice of it (the split
    dimension times the TP size, or the expert-TP size for a routed expert's); None otherwise."""


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def unwrap(chunk: Any) -> Any:
    """The model under Megatron's wrappers (DDP, Float16Module, FSDP: each keeps it in ``module``)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def num_layers(chunk: Any) -> int:
    """Transformer layers of the whole model (all pipeline stages), from its config."""
    config = getattr(unwrap(chunk), "config", None)
    return int(getattr(config, "num_layers", 0) or 0)


def rank_info(ps: Any) -> dict[str, int]:
    """{global, tp, pp, dp, cp, ep, edp, etp, vpp} of this process (0 where not initialized);
    ``edp`` is the expert-data-parallel rank, over which expert gradients are reduced, and ``etp``
    the expert-tensor-parallel rank, which holds one slice of each of its experts' weights
    (``--expert-tensor-parallel-size``; Megatron's default for MoE is the tensor-parallel size)."""
    ranks = {"global": rank()}
    getters = {
        "tp": "get_tensor_model_parallel_rank",
        "pp": "get_pipeline_model_parallel_rank",
        "dp": "get_data_parallel_rank",
        "cp": "get_context_parallel_rank",
        "ep": "get_expert_model_parallel_rank",
        "edp": "get_expert_data_parallel_rank",
        "etp": "get_expert_tensor_parallel_rank",
    }
    for key, getter in getters.items():
        ranks[key] = int(getattr(ps, getter)()) if ps is not None and hasattr(ps, getter) else 0
    vpp = getattr(ps, "get_virtual_pipeline_model_parallel_rank", lambda: None)() if ps else None
    ranks["vpp"] = int(vpp) if vpp is not None else 0
    return ranks


def expert_of(name: str, ep_rank: int, local_experts: int) -> Optional[tuple[int, int]]:
    """(global, local) index of the routed expert a parameter or module ``name`` belongs to, on
    the rank of expert-parallel rank ``ep_rank`` holding ``local_experts`` experts; None outside
    the routed experts. Megatron gives EP rank e the experts e * local_experts onwards."""
    match = _EXPERT_IN_NAME.search(name)
    if match is None:
        return None
    local = int(match.group(1) if match.group(1) is not None else match.group(2))
    return ep_rank * local_experts + local, local


def local_experts(model_chunks: list, ps: Any) -> int:
    """Routed experts each expert-parallel rank holds (0 for a dense model)."""
    config = next((getattr(unwrap(c), "config", None) for c in model_chunks), None)
    experts = int(getattr(config, "num_moe_experts", None) or 0)
    ep_size = ps.get_expert_model_parallel_world_size() if ps is not None else 1
    return experts // max(int(ep_size or 1), 1)


def expert_place(model_chunks: list, ps: Any) -> tuple[int, int]:
    """(this rank's expert-parallel rank, experts per EP rank) for :func:`expert_of`."""
    ep_rank = ps.get_expert_model_parallel_rank() if ps is not None else 0
    return int(ep_rank or 0), local_experts(model_chunks, ps)


def world_layout(ps: Any) -> dict[str, int]:
    """{size, tp, pp, dp, cp, ep} sizes of the job."""
    size = world_size()
    if ps is None:
        return {"size": size, "tp": 1, "pp": 1, "dp": size, "cp": 1, "ep": 1}
    return {
        "size": size,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
    }


def slot_index(info: ParamInfo, num_layers: int) -> int:
    """The per-layer slot a parameter's squared norm is summed into: its transformer layer,
    else ``num_layers`` for the embedding, else ``num_layers + 1`` (output side). ``count`` in
    :func:`slot_name` is ``num_layers + 2``."""
    if info.layer is not None and info.layer < num_layers:
        return info.layer
    return num_layers if info.name.startswith("embedding") else num_layers + 1


def slot_name(index: int, count: int, *, layer_prefix: str = "") -> str:
    """Name of per-layer slot ``index`` of ``count``: the transformer layers by index (after
    ``layer_prefix``), then ``embedding``, then ``output`` (the output layer and final norm).
    The monitor's vector, grad_history.jsonl and the history detector's records use this order."""
    if not 0 <= index < count:
        raise IndexError(f"slot {index} is outside the {count} per-layer slots")
    if index == count - 2:
        return "embedding"
    if index == count - 1:
        return "output"
    return f"{layer_prefix}{index}"


def slot_names(count: int, *, layer_prefix: str = "") -> list[str]:
    """Every per-layer slot's name, in slot order (see :func:`slot_name`)."""
    return [slot_name(i, count, layer_prefix=layer_prefix) for i in range(count)]


def host() -> str:
    return socket.gethostname()


def device_name() -> str:
    """A human name for this rank's device: cuda:3 (NVIDIA H100 ...), npu:1, or cpu."""
    try:
        if hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]
            return f"npu:{torch.npu.current_device()}"  # type: ignore[attr-defined]
    except Exception:
        pass
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return f"cpu (LOCAL_RANK={os.environ.get('LOCAL_RANK', '0')})"


def _layer_renames(model: Any) -> dict[str, str]:
    """Stage-local ``...layers.i.`` -> global ``...layers.(layer_number - 1).`` prefixes."""
    renames = {}
    for mod_name, module in model.named_modules():
        match = _LAYER_PATH.match(mod_name)
        number = getattr(module, "layer_number", None)
        if match and isinstance(number, int):
            renames[mod_name + "."] = f"{match['prefix']}.{number - 1}."
    return renames


def _global_name(raw_name: str, renames: dict[str, str]) -> str:
    name = _strip_wrappers(raw_name)
    for old, new in renames.items():
        if (name + ".").startswith(old):
            return (new + (name + ".")[len(old):]).rstrip(".")
    return name


def _stage_of(chunk_index: int, ps: Any) -> int:
    pp_rank = ps.get_pipeline_model_parallel_rank() if ps else 0
    pp_size = ps.get_pipeline_model_parallel_world_size() if ps else 1
    return chunk_index * pp_size + pp_rank


def layer_of(name: str) -> Optional[int]:
    """The transformer layer a global parameter or module name is in (None outside the layers)."""
    match = _LAYER_IN_NAME.search(name + ".")
    return int(match.group(1)) if match else None


def name_modules(model_chunks: list, ps: Any) -> list[tuple[str, int, torch.nn.Module]]:
    """(global dotted name, pipeline stage, module) for every named submodule of this rank's
    chunks: ``named_modules()`` names without wrapper prefixes, global layer numbers."""
    named = []
    for chunk_index, chunk in enumerate(model_chunks):
        model = unwrap(chunk)
        renames = _layer_renames(model)
        stage = _stage_of(chunk_index, ps)
        named += [(_global_name(raw, renames), stage, module) for raw, module in model.named_modules() if raw]
    return named


def counts_in_norm(param: Any, tp_rank: int, etp_rank: int) -> bool:
    """Whether Megatron's grad norm counts ``param`` on this rank: a slice of a tensor-parallel
    weight always; a replicated one on rank 0 of its group, which for the parameters reduced
    over expert-data-parallel ranks (``allreduce`` False: the routed experts') is the
    expert-tensor-parallel group, for every other the tensor-parallel group; a shared (tied)
    copy never."""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    return (etp_rank if not getattr(param, "allreduce", True) else tp_rank) == 0


def name_parameters(model_chunks: list, ps: Any) -> dict[int, ParamInfo]:
    """``{id(param): ParamInfo}`` for every parameter of this rank's model chunks."""
    tp_rank = ps.get_tensor_model_parallel_rank() if ps else 0
    etp_rank = int(getattr(ps, "get_expert_tensor_parallel_rank", lambda: 0)() or 0) if ps else 0
    ep_rank, per_rank = expert_place(model_chunks, ps)
    infos: dict[int, ParamInfo] = {}
    for chunk_index, chunk in enumerate(model_chunks):
        model = unwrap(chunk)
        renames = _layer_renames(model)
        stage = _stage_of(chunk_index, ps)
        for position, (raw_name, param) in enumerate(model.named_parameters()):
            name = _global_name(raw_name, renames)
            layer_match = _LAYER_IN_NAME.search(name)
            infos[id(param)] = ParamInfo(
                name=name,
                layer=int(layer_match.group(1)) if layer_match else None,
                order=stage * _STAGE_STRIDE + position,
                counts_in_norm=counts_in_norm(param, tp_rank, etp_rank),
                chunk=chunk_index,
                expert=expert_of(name, ep_rank, per_rank) if per_rank else None,
                full_shape=_full_shape(param, ps),
            )
    return infos


def _full_shape(param: Any, ps: Any) -> Optional[tuple[int, ...]]:
    """The shape of the weight ``param`` is a tensor-parallel slice of (None when it is whole)."""
    dim = getattr(param, "partition_dim", -1)
    if ps is None or not getattr(param, "tensor_model_parallel", False) or not 0 <= dim < param.dim():
        return None
    expert = not getattr(param, "allreduce", True)
    ways = (int(getattr(ps, "get_expert_tensor_parallel_world_size", lambda: 1)() or 1) if expert
            else ps.get_tensor_model_parallel_world_size())
    if ways <= 1:
        return None
    shape = list(param.shape)
    shape[dim] *= ways
    return tuple(shape)
