"""Run Megatron-LM's training package (``megatron/training``, ``pretrain_gpt.py``) on a CPU-only torch.

:mod:`megatron_patches.testing.cpu` covers megatron-core. The training package of a Megatron-LM
checkout assumes CUDA in a few more places, each redirected here and nowhere else:

- ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda=True``;
  ``pretrain`` never passes it, so the call is re-bound with ``allow_no_cuda=True``.
- ``_initialize_distributed`` builds the model-parallel groups and ``_set_random_seed`` seeds the
  tensor-parallel RNG tracker only ``if torch.cuda.device_count() > 0``; both run with a device
  count of one (the CPU runtime already maps that one device to the CPU).
- ``_compile_dependencies`` runs ``make`` for the dataset index helpers and builds fused CUDA
  kernels with nvcc. Neither is built here: the helpers come from the checkout when it has them
  compiled, otherwise from the installed megatron-core wheel, which ships them prebuilt (same
  ``helpers.cpp`` interface from core 0.12 to main); the fused kernels are not loaded (the command
  line must turn the fusions off).
- Without Apex or Transformer Engine (always the case on CPU), loading a distributed-optimizer
  checkpoint asserts in ``DistributedOptimizer.state_dict`` because the fresh torch optimizer has
  no ``step`` yet; the optimizer state is created first (see
  :func:`_with_optimizer_state_before_load`). The same load then gives every parameter's torch
  Adam state one shared ``step`` tensor, which torch's Adam advances in place once per parameter,
  so every bias correction after a resume is wrong; each parameter gets its own copy (see
  :func:`_own_step_per_parameter`). Apex's and Transformer Engine's Adam keep the step in the
  param group: a job with either never meets these two.
- ``set_jit_fusion_options`` warms up the bias-GeLU/bias-dropout fusions with ``torch.compile``
  (~25 s on two CPU cores) even when the command line turns them off; the warm-up is skipped.
- ``validate_args`` asks CUDA for the device's compute capability (``get_device_arch_version``,
  imported into ``arguments``) when tensor or context parallelism is on. The CPU has none; it
  answers :data:`CPU_ARCH_VERSION` (9, a Hopper part's major version), so Megatron applies the
  rules of the GPUs most users train on: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` must be set for TP/CP.

Torch FSDP2 and Megatron-FSDP need a few more (:mod:`megatron_patches.testing.fsdp`).

The rest (``'cuda'`` devices in training.py, ``torch.cuda.Stream`` in ``get_model``) is handled by
the CPU runtime's device rewrite and stream stand-ins. Nothing is installed by importing this module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megatron_patches.testing import cpu, fsdp

__all__ = ["install", "uninstall", "installed"]

_HELPERS = "megatron.core.datasets.helpers_cpp"

CPU_ARCH_VERSION = 9
"""What ``get_device_arch_version`` answers on the CPU: a pre-Blackwell (Hopper) major version."""

_lock = threading.Lock()
_state: dict[str, Any] | None = None


def _log(message: str) -> None:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
    if rank in (None, 0):
        print(f"[megatron_patches.testing.megatron_lm_cpu] {message}", flush=True)


@contextlib.contextmanager
def _one_device() -> Iterator[None]:
    """``torch.cuda.device_count()`` is 1 inside the block (the CPU runtime's single device)."""
    original = torch.cuda.__dict__["device_count"]
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = original


def _with_one_device(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with _one_device():
            return original(*args, **kwargs)

    return wrapper


def _allowing_no_cuda(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    return wrapper


def _cpu_arch_version() -> int:
    return CPU_ARCH_VERSION


def _skip_fused_kernels(*args, **kwargs) -> None:
    _log("fused CUDA kernels not built or loaded (CPU run)")


def _skip_jit_warmup(*args, **kwargs) -> None:
    _log("JIT fusion warm-up skipped (torch.compile of fusions the command line turned off: ~25 s on a CPU)")


def _helpers_are_importable() -> None:
    """Stands in for ``compile_helpers`` (``make -C megatron/core/datasets``)."""
    importlib.import_module(_HELPERS)


def _installed_wheel_helpers() -> Path | None:
    """The prebuilt ``helpers_cpp`` extension of the installed megatron-core distribution."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name.startswith("helpers_cpp.") and file.suffix in (".so", ".pyd"):
            path = Path(dist.locate_file(file))
            if path.exists():
                return path
    return None


def _provide_dataset_helpers() -> str:
    """Make ``megatron.core.datasets.helpers_cpp`` importable without compiling anything."""
    if _HELPERS in sys.modules or importlib.util.find_spec(_HELPERS) is not None:
        return "from megatron.core"
    datasets_dir = Path(importlib.import_module("megatron.core.datasets").__file__).parent
    wheel_helpers = _installed_wheel_helpers()
    if wheel_helpers is None:
        raise RuntimeError(
            f"{_HELPERS} is not built in {datasets_dir} and no installed megatron-core wheel ships "
            f"it; build it with `make -C {datasets_dir}` or `pip install megatron-core`"
        )
    loader = importlib.machinery.ExtensionFileLoader(_HELPERS, str(wheel_helpers))
    spec = importlib.util.spec_from_file_location(_HELPERS, wheel_helpers, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[_HELPERS] = module
    importlib.import_module("megatron.core.datasets").helpers_cpp = module
    return f"prebuilt from the installed wheel: {wheel_helpers}"


def _with_optimizer_state_before_load(original: Callable) -> Callable:
    """``DistributedOptimizer.sharded_state_dict(is_loading=True)`` on a fresh optimizer.

    Without Apex or Transformer Engine, ``DistributedOptimizer.state_dict`` reads the Adam ``step``
    from the torch optimizer's per-parameter state and asserts there is exactly one value; before
    the first step there is none, so every ``--load`` of a distributed-optimizer checkpoint fails
    (core 0.12 to main). One zero-gradient step of the inner torch optimizer creates the state;
    the checkpoint load then overwrites it, the main parameters and the model parameters.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        inner = self.optimizer
        if bound.arguments["is_loading"] and inner is not None and not inner.state:
            params = [p for group in inner.param_groups for p in group["params"] if p.numel() > 0]
            for param in params:
                param.grad = torch.zeros_like(param)
            inner.step()
            inner.zero_grad()
        return original(*bound.args, **bound.kwargs)

    return wrapper


def _own_step_per_parameter(original: Callable) -> Callable:
    """``DistributedOptimizer.load_state_dict`` after which each parameter's torch Adam ``step``
    is its own tensor holding the loaded step.

    Without Apex or Transformer Engine that load (core 0.16.1 and 0.19.2, the two installed here)
    first puts one ``torch.tensor(step)`` from the saved param groups into every parameter's state,
    then copies each parameter's ``step`` from the loading template's parameter state into it, and
    that template is the fresh optimizer's (one warm-up step here: 1). So the resumed job steps
    with 1 instead of the saved step, and torch's single-tensor Adam, adding 1 in place per
    parameter, advances the one shared tensor by the number of parameters per step: both change
    the bias correction. Each parameter gets its own tensor with its group's saved ``step``, and
    the groups lose the ``step`` key the load added (torch's Adam keeps none there and never reads
    it; Megatron's ``state_dict`` derives it from the parameters' state on every save), so the
    optimizer is laid out as in a job that never stopped.
    """

    @functools.wraps(original)
    def wrapper(self, state_dict, *args, **kwargs):
        result = original(self, state_dict, *args, **kwargs)
        # Megatron-FSDP's fsdp_dtensor checkpoints hand over another layout, with the step elsewhere.
        saved_groups = (state_dict.get("optimizer") or {}).get("param_groups") or ()
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            if saved.get("step") is None:
                continue
            group.pop("step", None)
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(saved["step"]), dtype=state["step"].dtype)
        return result

    return wrapper


def _redirects(on_cpu: bool) -> list[tuple[Any, str, Any]]:
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.optimizer import distrib_optimizer
    from megatron.training import arguments, initialize, training

    # On any device: the wheel has no Makefile beside helpers.cpp (its helpers come prebuilt), the
    # warm-up compiles fusions the command line turned off, and the load needs the optimizer state.
    items = [
        (dataset_utils, "compile_helpers", _helpers_are_importable),
        (initialize, "_warmup_jit_function", _skip_jit_warmup),
    ]
    if on_cpu:
        initialize_megatron = _allowing_no_cuda(initialize.__dict__["initialize_megatron"])
        items += [
            (initialize, "initialize_megatron", initialize_megatron),
            (training, "initialize_megatron", initialize_megatron),
            (initialize, "_initialize_distributed", _with_one_device(initialize._initialize_distributed)),
            (initialize, "_set_random_seed", _with_one_device(initialize._set_random_seed)),
        ]
        if "get_device_arch_version" in arguments.__dict__:  # checkouts from before TP asked it have none
            items.append((arguments, "get_device_arch_version", _cpu_arch_version))
        fused_kernels = initialize.__dict__.get("fused_kernels")  # megatron.legacy, gone in main
        if fused_kernels is not None:
            items.append((fused_kernels, "load", _skip_fused_kernels))
        items += fsdp.redirects()
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        owner = distrib_optimizer.DistributedOptimizer
        items.append(
            (owner, "sharded_state_dict", _with_optimizer_state_before_load(owner.sharded_state_dict))
        )
        items.append((owner, "load_state_dict", _own_step_per_parameter(owner.load_state_dict)))
    return items


def install(on_cpu: bool = True) -> None:
    """Install the CPU runtime plus the Megatron-LM training-package redirects. Idempotent.

    ``megatron`` must resolve to the checkout being run (its directory first on ``sys.path``).
    ``on_cpu=False`` (a machine with CUDA) installs only what the wheel needs on any device: the
    prebuilt dataset helpers, no JIT warm-up, the optimizer state before a distributed-optimizer
    load without Apex or Transformer Engine.
    """
    global _state
    with _lock:
        if _state is not None:
            return
        cpu_was_installed = cpu.installed()
        if on_cpu:
            cpu.install()
        helpers = _provide_dataset_helpers()
        saved = []
        for owner, name, replacement in _redirects(on_cpu):
            saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, replacement)
        _state = {"saved": saved, "cpu_was_installed": cpu_was_installed}
    core_dir = Path(importlib.import_module("megatron.core").__file__).parent
    _log(f"megatron.core from {core_dir}; dataset helpers {helpers}")


def uninstall() -> None:
    """Undo :func:`install` (the CPU runtime included); a no-op when not installed."""
    global _state
    with _lock:
        if _state is None:
            return
        for owner, name, original in reversed(_state["saved"]):
            setattr(owner, name, original)
        if not _state["cpu_was_installed"]:
            cpu.uninstall()
        _state = None


def installed() -> bool:
    return _state is not None
