"""CPU stand-ins that let Megatron-Bridge's pretraining loop be imported and run on a CPU-only torch.

For tests only (docs/bridge.md says what each one replaces and why). Megatron-Bridge 0.6.2 with
megatron-core 0.19.2 cannot be imported on these machines for two reasons, both answered here and
nowhere else:

- Two of its modules import Transformer Engine unguarded at module level (TE cannot be installed
  on a CPU-only machine): ``megatron.bridge.peft.lora_layers`` (``import transformer_engine.pytorch
  as te``) and ``megatron.bridge.models.gpt_full_te_layer_autocast_spec`` (``from
  transformer_engine.pytorch import TransformerLayer``, a base class). Every other TE import in
  Bridge and megatron-core is guarded by ``try``.
- ``megatron.bridge.training.pretrain`` imports ``nvidia_resiliency_ext.inprocess.CallWrapper``
  unguarded, and the newest nvidia-resiliency-ext on the registry (0.4.1) breaks ``import
  megatron.core`` 0.19.2 (it asks for ``nvidia_resiliency_ext.__version__``, absent before 0.6), so
  the package must stay uninstalled here.

The stand-ins are *scoped*: each is served only to the ``import`` statements of the Bridge module
that needs it (through that module's own ``__import__``), never put in ``sys.modules``. A stand-in
visible to everyone makes the guarded imports succeed as well; megatron-core then takes
Transformer Engine for present and fails (``get_te_version`` -> ``PackageNotFoundError:
transformer-engine``) while building its layer specs. Every stand-in class raises when built, so a
run that actually reaches a TE layer or NVRx's in-process restart stops with its name.

Call :func:`install_stand_ins` before anything imports Megatron-Bridge (and before ``import
megatron_patches.apply``, which must precede Bridge's imports too), then :func:`install`: it adds
megatron_patches' CPU runtime for Megatron's loops (:mod:`megatron_patches.testing.megatron_lm_cpu`)
and the same CUDA redirects for Bridge's own copy of Megatron-LM's initialisation. Nothing is
installed by importing this module.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
import types
from typing import Any, Callable

import torch

from megatron_patches.seams import patching
from megatron_patches.testing import megatron_lm_cpu

__all__ = ["install", "install_stand_ins", "uninstall", "installed", "CpuStandInError", "STAND_INS", "TE_STAND_IN",
           "NVRX_STAND_IN"]


class CpuStandInError(RuntimeError):
    """A Transformer Engine or NVRx name that only a CPU stand-in provides was actually used."""


def _absent_class(qualified: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise CpuStandInError(
            f"{qualified} is a CPU stand-in (megatron_patches.testing.bridge_cpu): the package is not "
            "installed here; use megatron-core's local layer spec and leave the feature off")

    return type(qualified.rsplit(".", 1)[-1], (), {"__init__": __init__, "__module__": qualified.rsplit(".", 1)[0]})


def _absent_function(qualified: str) -> Callable[..., Any]:
    def absent(*args: Any, **kwargs: Any) -> Any:
        raise CpuStandInError(f"{qualified} is a CPU stand-in (megatron_patches.testing.bridge_cpu): not on CPU")

    absent.__qualname__ = absent.__name__ = qualified.rsplit(".", 1)[-1]
    return absent


def _package(name: str, classes: tuple[str, ...] = (), functions: tuple[str, ...] = (),
             **children: types.ModuleType) -> types.ModuleType:
    module = types.ModuleType(name, f"CPU stand-in for {name} (megatron_patches.testing.bridge_cpu)")
    module.__path__ = []  # a package, so that dotted imports of its children resolve
    for cls in classes:
        setattr(module, cls, _absent_class(f"{name}.{cls}"))
    for fn in functions:
        setattr(module, fn, _absent_function(f"{name}.{fn}"))
    for child, value in children.items():
        setattr(module, child, value)
    return module


def _transformer_engine() -> dict[str, types.ModuleType]:
    # The names lora_layers.py and gpt_full_te_layer_autocast_spec.py reach while being imported
    # (a base class, annotations) or in isinstance checks that must simply answer False.
    ops = _package("transformer_engine.pytorch.ops",
                   classes=("Sequential", "Linear", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput",
                            "Dropout", "ConstantScale", "AddExtraInput"))
    pytorch = _package("transformer_engine.pytorch", classes=("TransformerLayer", "Linear", "LayerNormLinear"),
                       functions=("fp8_autocast",), ops=ops)
    root = _package("transformer_engine", pytorch=pytorch)
    return {m.__name__: m for m in (root, pytorch, ops)}


def _nvidia_resiliency_ext() -> dict[str, types.ModuleType]:
    inprocess = _package("nvidia_resiliency_ext.inprocess", classes=("CallWrapper",))
    root = _package("nvidia_resiliency_ext", inprocess=inprocess)
    return {m.__name__: m for m in (root, inprocess)}


TE_STAND_IN = "transformer_engine"
NVRX_STAND_IN = "nvidia_resiliency_ext"

STAND_INS: dict[str, tuple[str, ...]] = {
    "megatron.bridge.peft.lora_layers": (TE_STAND_IN,),
    "megatron.bridge.models.gpt_full_te_layer_autocast_spec": (TE_STAND_IN,),
    "megatron.bridge.training.pretrain": (NVRX_STAND_IN,),
}
"""Each Bridge module that imports an absent package unguarded, and the stand-ins it is served."""

_BUILDERS = {TE_STAND_IN: _transformer_engine, NVRX_STAND_IN: _nvidia_resiliency_ext}


def _scoped_import(modules: dict[str, types.ModuleType]) -> Callable[..., Any]:
    """``__import__`` that answers the stand-in packages from ``modules`` and defers the rest."""
    real_import = builtins.__import__

    def __import__(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and name in modules:
            return modules[name] if fromlist else modules[name.partition(".")[0]]
        return real_import(name, globals, locals, fromlist, level)

    return __import__


def _scoped_execution(stand_ins: tuple[str, ...]) -> Callable[[types.ModuleType, Callable[[], None]], None]:
    """Runs a module's code with its own ``__import__``, which answers ``stand_ins`` (fresh each time)."""
    def around(module: types.ModuleType, execute: Callable[[], None]) -> None:
        modules: dict[str, types.ModuleType] = {}
        for package in stand_ins:
            modules.update(_BUILDERS[package]())
        scoped = dict(builtins.__dict__)
        scoped["__import__"] = _scoped_import(modules)
        module.__dict__["__builtins__"] = scoped
        execute()

    return around


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        stand_ins = STAND_INS.get(fullname)
        if stand_ins is None:
            return None
        return patching.spec_around(fullname, path, _scoped_execution(stand_ins))


def _with_one_device(original: Callable) -> Callable:
    """``torch.cuda.device_count()`` answers 1 inside the call (the CPU runtime's single device)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        saved = torch.cuda.__dict__["device_count"]
        torch.cuda.device_count = lambda: 1
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.device_count = saved

    return wrapper


def _allowing_no_cuda(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    return wrapper


def _dataset_helpers_importable() -> None:
    """Stands in for ``compile_helpers`` (``make`` in megatron/core/datasets): the wheel ships them built."""
    importlib.import_module("megatron.core.datasets.helpers_cpp")


def _skip_jit_warmup(*args: Any, **kwargs: Any) -> None:
    """Bridge's bias-GeLU/bias-dropout warm-up allocates on ``device="cuda"``; the fusions are off here."""


def _loop_redirects() -> list[tuple[Any, str, Any]]:
    """Bridge's own copies of Megatron-LM's CUDA assumptions in ``megatron.bridge.training.initialize``."""
    from megatron.bridge.training import initialize, setup

    initialize_megatron = _allowing_no_cuda(initialize.__dict__["initialize_megatron"])
    return [
        (initialize, "initialize_megatron", initialize_megatron),
        (setup, "initialize_megatron", initialize_megatron),
        (initialize, "_initialize_distributed", _with_one_device(initialize.__dict__["_initialize_distributed"])),
        (initialize, "_set_random_seed", _with_one_device(initialize.__dict__["_set_random_seed"])),
        (initialize, "compile_helpers", _dataset_helpers_importable),
        (initialize, "_warmup_jit_function", _skip_jit_warmup),
    ]


_ORIGINAL = "_bridge_cpu_original"
"""The attribute a redirect carries: what it replaced (so the process's state is the patched names
themselves and ``sys.meta_path``, not a module global)."""

_lock = threading.Lock()


def _finder_installed() -> bool:
    return any(isinstance(finder, _Finder) for finder in sys.meta_path)


def install_stand_ins() -> None:
    """Serve the stand-ins to the Bridge modules in :data:`STAND_INS` from their next import on."""
    with _lock:
        if _finder_installed():
            return
        already = sorted(name for name in STAND_INS if name in sys.modules)
        if already:
            raise RuntimeError(f"bridge_cpu must be installed before Megatron-Bridge is imported; already imported: "
                               f"{', '.join(already)}")
        sys.meta_path.insert(0, _Finder())


def install() -> None:
    """The stand-ins, megatron_patches' CPU runtime for Megatron's loops, and Bridge's own redirects."""
    install_stand_ins()
    megatron_lm_cpu.install()
    with _lock:
        for owner, name, replacement in _loop_redirects():
            current = owner.__dict__[name]
            if getattr(current, _ORIGINAL, None) is None:
                setattr(replacement, _ORIGINAL, current)
                setattr(owner, name, replacement)


def uninstall() -> None:
    """Undo the redirects and stop serving stand-ins to later imports (imported modules keep theirs)."""
    with _lock:
        if "megatron.bridge.training.setup" in sys.modules:
            from megatron.bridge.training import initialize, setup

            for owner in (initialize, setup):
                for name, value in list(owner.__dict__.items()):
                    original = getattr(value, _ORIGINAL, None)
                    if original is not None:
                        setattr(owner, name, original)
        for finder in [f for f in sys.meta_path if isinstance(f, _Finder)]:
            sys.meta_path.remove(finder)
    megatron_lm_cpu.uninstall()


def installed() -> bool:
    setup = sys.modules.get("megatron.bridge.training.setup")
    return (_finder_installed() and setup is not None
            and getattr(setup.__dict__["initialize_megatron"], _ORIGINAL, None) is not None)
