"""Run megatron-core on a CPU-only torch, for tests and CPU-only CI runners.

megatron-core assumes CUDA in a handful of places: tensors created with ``device='cuda'``
or an integer device, ``torch.cuda.current_device()``, the CUDA RNG tracker of the
tensor-parallel layers, ``param.type() == 'torch.cuda.FloatTensor'`` checks in the
optimizer, and CUDA streams. :func:`install` redirects exactly those to the CPU so that
the real model, DDP, optimizer and schedules train on CPU with gloo. One more is not about
CUDA: core 0.12's ``quantize_param_shard`` (called by every distributed-optimizer step) raises
without Transformer Engine even when there are no FP8 parameters; with none it now returns.

Mixture-of-experts needs one more. The all-to-all token dispatcher moves its split sizes to the
host with ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA
tensors: on CPU the sizes stay tensors, and gloo's ``all_to_all_single`` rejects tensor split
sizes (TypeError). :func:`_host_copy_for_moe` converts CPU tensors the way the CUDA path does.

Sequence parallel needs a stand-in. The local layer spec's norm (``WrappedTorchNorm``, a torch
``LayerNorm``/``RMSNorm``) asserts that sequence parallel is off; the norms that support it (Apex's
fused one, Transformer Engine's) are CUDA kernels. What sequence parallel needs of a norm is that
its weights are marked ``sequence_parallel``, so that ``finalize_model_grads`` all-reduces their
gradients over the tensor-parallel group (each TP rank normalised only its slice of the sequence).
:func:`_sequence_parallel_torch_norm` stands in for those fused norms: the same torch norm, its
parameters marked as they mark theirs. Without sequence parallel it is ``WrappedTorchNorm`` unchanged.
The precision-aware optimizer (``use_precision_aware_optimizer``) needs Transformer Engine's
``FusedAdam``, a CUDA kernel; :mod:`megatron_patches.testing.fused_adam` stands in for it. Context
parallelism needs Transformer Engine's attention; :mod:`megatron_patches.testing.context_parallel`
lets the local attention gather K and V over the CP group instead. The optimizer's CPU offload
(``HybridDeviceOptimizer``) tells device from host parameters by ``is_cuda``, False for every
tensor here; :mod:`megatron_patches.testing.cpu_offload` makes the split as on a GPU machine.
Experts split over expert-tensor-parallel ranks under the all-to-all dispatcher gather pieces of
different lengths, which gloo refuses; :mod:`megatron_patches.testing.uneven_collectives` pads them.
The CUDA generator is the CPU one here, and that has one consequence a GPU does not have: a torch
``DataLoader`` draws a seed for its workers from the default generator each time its iterator is
made. On a GPU that moves the host generator, which dropout never reads; here it would move
dropout's, and Megatron-LM makes its data iterators after it loads a checkpoint (RNG included),
so a resumed job would drop other units than an uninterrupted one. A loader made without a
generator gets its own (:func:`_loader_with_own_generator`).
Nothing here is installed by importing this module, and :func:`uninstall` restores every attribute.

This is a test runtime: it makes numbers come out of real megatron-core code on
machines without an accelerator. It is not a way to train at speed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable

import torch
import torch.utils.data
from torch.overrides import TorchFunctionMode

from megatron_patches.testing import context_parallel, cpu_offload, fused_adam, uneven_collectives

__all__ = ["install", "uninstall", "installed", "cpu_runtime"]

_lock = threading.Lock()
_state: dict[str, Any] | None = None

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _is_accelerator_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # An integer device index means "that CUDA device" to torch.
    return isinstance(value, int) and not isinstance(value, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites every cuda (or integer) device argument of a torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_accelerator_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to:
            args = args[:1] + tuple(_CPU if _is_accelerator_device(a) else a for a in args[1:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):  # Event.wait(stream)
        pass

    def record_event(self, *args, **kwargs):
        return _NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _null_stream(*args, **kwargs):
    return _NullStream()


def _cpu_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *args, **kwargs):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, which would recurse here.
    torch.default_generator.manual_seed(int(seed))


def _loader_with_own_generator(original: Callable) -> Callable:
    """``DataLoader.__init__`` that gives a loader made without a generator its own (fixed seed),
    so the seed its iterators draw comes from there and not from the generator dropout reads."""

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator()
        original(self, *args, **kwargs)

    return init


def _tensor_type(original: Callable) -> Callable:
    def type_(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str):
            return _CUDA_TYPE_NAMES.get(result, result)
        return result

    type_.__wrapped__ = original
    return type_


def _redirects() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for every attribute this runtime swaps."""
    from megatron.core.tensor_parallel import random as tp_random

    items: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "set_device", lambda *a, **k: None),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "Stream", _NullStream),
        (torch.cuda, "Event", _NullStream),
        (torch.cuda, "current_stream", _null_stream),
        (torch.cuda, "default_stream", _null_stream),
        (torch.cuda, "stream", _null_stream),
        (torch.cuda, "get_rng_state", _cpu_rng_state),
        (torch.cuda, "set_rng_state", _set_cpu_rng_state),
        (torch.cuda, "manual_seed", _cpu_manual_seed),
        (torch.cuda, "memory_allocated", lambda *a, **k: 0),
        (torch.cuda, "max_memory_allocated", lambda *a, **k: 0),
        (torch.cuda.random, "get_rng_state", _cpu_rng_state),
        (tp_random, "_get_cuda_rng_state", _cpu_rng_state),
        (tp_random, "_set_cuda_rng_state", _set_cpu_rng_state),
        (torch.Tensor, "type", _tensor_type(torch.Tensor.type)),
        (torch.utils.data.DataLoader, "__init__", _loader_with_own_generator(torch.utils.data.DataLoader.__init__)),
    ]
    from megatron.core.optimizer import distrib_optimizer

    if "quantize_param_shard" in distrib_optimizer.__dict__:
        quantize = _nothing_to_quantize_without_fp8_params(distrib_optimizer.quantize_param_shard)
        items.append((distrib_optimizer, "quantize_param_shard", quantize))
    items += _moe_redirects()
    items += _sequence_parallel_norm_redirects()
    items += fused_adam.redirects()
    items += context_parallel.redirects()
    items += cpu_offload.redirects()
    items += uneven_collectives.redirects()
    return items


def _sequence_parallel_norm_redirects() -> list[tuple[Any, str, Any]]:
    try:
        from megatron.core.transformer import torch_norm
    except ImportError:  # pragma: no cover - a build without it
        return []
    owner = getattr(torch_norm, "WrappedTorchNorm", None)
    if owner is None or "__new__" not in owner.__dict__:
        return []
    return [(owner, "__new__", _sequence_parallel_torch_norm(owner.__dict__["__new__"]))]


def _sequence_parallel_torch_norm(original: Callable) -> Callable:
    """``WrappedTorchNorm.__new__`` that, under sequence parallel, builds the torch norm anyway and
    marks its parameters ``sequence_parallel`` (a CPU stand-in for Apex's and Transformer Engine's
    norms, which do the same)."""

    @functools.wraps(original)
    def new(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, *args, **kwargs)
        config_without = _SequenceParallelOff(config)
        norm = original(cls, config_without, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


class _SequenceParallelOff:
    """A view of a TransformerConfig that reads ``sequence_parallel`` as False (for the torch norm's
    own assertion) and everything else as the config says."""

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return False if name == "sequence_parallel" else getattr(self._config, name)


def _moe_redirects() -> list[tuple[Any, str, Any]]:
    """``maybe_move_tensor_to_cpu`` where megatron-core has it (from 0.12's MoE utilities on),
    in ``moe_utils`` and in every MoE module that imported it by name."""
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:  # pragma: no cover - a build without MoE
        return []
    original = moe_utils.__dict__.get("maybe_move_tensor_to_cpu")
    if original is None:
        return []
    replacement = _host_copy_for_moe(original)
    return [(module, "maybe_move_tensor_to_cpu", replacement) for module in (moe_utils, token_dispatcher)
            if module.__dict__.get("maybe_move_tensor_to_cpu") is original]


def _host_copy_for_moe(original: Callable) -> Callable:
    """``maybe_move_tensor_to_cpu`` that also converts a CPU tensor to numpy when asked."""

    @functools.wraps(original)
    def wrapper(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return wrapper


def _nothing_to_quantize_without_fp8_params(original: Callable) -> Callable:
    """core 0.12's ``quantize_param_shard`` raises without Transformer Engine even with no FP8 params."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if len(signature.bind(*args, **kwargs).arguments["model_params"]) == 0:
            return None
        return original(*args, **kwargs)

    return wrapper


def install() -> None:
    """Redirect megatron-core's CUDA assumptions to the CPU. Idempotent."""
    global _state
    with _lock:
        if _state is not None:
            return
        saved = []
        for owner, name, replacement in _redirects():
            saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, replacement)
        mode = _CudaToCpu()
        mode.__enter__()
        _state = {"saved": saved, "mode": mode}


def uninstall() -> None:
    """Undo :func:`install`; a no-op when not installed."""
    global _state
    with _lock:
        if _state is None:
            return
        _state["mode"].__exit__(None, None, None)
        fused_adam.restore()
        for owner, name, original in reversed(_state["saved"]):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _state = None


def installed() -> bool:
    """Whether the CPU runtime is active in this process."""
    return _state is not None


@contextlib.contextmanager
def cpu_runtime():
    """``with cpu_runtime(): ...`` installs the runtime for the block only."""
    was_installed = installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()


class _Missing:
    pass


_MISSING = _Missing()
