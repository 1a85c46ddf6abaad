"""The instruments of ``scripts/bench_overhead.py``: a stopwatch for the time inside the guard,
counters of host reads and of gradient bytes read, and the memory the guard allocates or holds."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import time
import typing
from collections import Counter

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_patches
from megatron_patches.faults import held_tensors, optimizer_states
from megatron_patches.seams import wrappers

HOOK_METHODS = tuple(sorted(set(re.findall(r"_monitor\.(\w+)\(", inspect.getsource(wrappers)))))
"""The GradMonitor methods the patches call (read from wrappers.py, so new ones are timed too)."""
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class Stopwatch:
    """Adds up the time spent in the callables it wraps, in all (``ns``) and by the name each
    was wrapped under (``split``); ``reset()`` per step."""

    def __init__(self, sync):
        self.sync, self.ns, self.split = sync, 0, {}

    def reset(self) -> None:
        self.ns, self.split = 0, {}

    def wrap(self, fn, name: str = ""):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                spent = time.perf_counter_ns() - t0
                self.ns += spent
                self.split[name] = self.split.get(name, 0) + spent

        return timed


_INHERITED = object()


class HostReadCounter:
    """Counts calls of the Tensor methods that read a value to the host, while entered
    (``.to`` only towards the CPU). ``in_hook`` > 0 also counts them as the guard's. A call
    made inside another counted call (a TorchFunctionMode re-dispatching it) counts once.
    On an accelerator only reads of accelerator tensors count (those synchronize); on the CPU
    every read counts, since the CPU runtime puts would-be device tensors on the CPU too."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.step, self.hook = Counter(), Counter()
        self.in_hook = 0
        self.hooks: list[str] = []
        """Names of the monitor's hook methods being run now (innermost last)."""
        self._depth = 0
        self._saved: dict[str, object] = {}

    def _wrap(self, name: str, original):
        def counted(tensor, *args, **kwargs):
            if (name == "to" and not _to_host(tensor, args, kwargs)
                    or self.device != "cpu" and tensor.device.type == "cpu"):
                return original(tensor, *args, **kwargs)
            if self._depth == 0:
                self.step[name] += 1
                self.hook[name] += bool(self.in_hook)
            self._depth += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self):
        for name in HOST_READS + ("to",):
            self._saved[name] = torch.Tensor.__dict__.get(name, _INHERITED)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            if original is _INHERITED:
                delattr(torch.Tensor, name)  # the C base class's method shows through again
            else:
                setattr(torch.Tensor, name, original)
        self._saved = {}


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(megatron_patches.__file__) + os.sep
_DECORATOR = os.path.join(_TORCH_DIR, "utils", "_contextlib.py")
_HARNESS_DIR = os.path.join(_PACKAGE_DIR, "testing") + os.sep


def _passes_on(code) -> bool:
    """Frames that only pass a call on: torch's own, this file's (HostReadCounter's wrappers), and
    another TorchFunctionMode's handler re-dispatching the call it was given (the seam's
    ``_TensorNorms`` watching Megatron's own norm calls, the CPU runtime's): the call is its caller's."""
    return (code.co_filename.startswith(_TORCH_DIR) or code.co_filename == __file__
            or code.co_name == "__torch_function__")


class TorchCallCounter(TorchFunctionMode):
    """Torch functions and Tensor methods called from the guard's own frames, while entered.

    Every call of a torch function or Tensor method reaches ``__torch_function__`` (a C function
    directly, a Python one of torch's through ``handle_torch_function``); the call counts when
    the first frame above it that only passes calls on (:func:`_passes_on`) lies in the
    megatron_patches package, outside ``megatron_patches/testing`` (the tiny-GPT harness and the CPU
    runtime: the training loop and the stand-ins for CUDA, not the guard; Megatron's frames and this
    script's do not count either). A call made inside a counted one
    (torch's Python code calling further torch functions) does not reach the mode again: one call,
    one count. Attribute reads (``Tensor.shape``, ``.dtype``, ``.grad``: descriptors' ``__get__``)
    launch nothing and are counted apart, in ``attributes``. ``by_name``: the calls by function
    name and the package file that made them."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.attributes = 0
        self.by_name: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frame, decorated = sys._getframe(1), False
        while frame is not None and _passes_on(frame.f_code):
            decorated = decorated or frame.f_code.co_filename == _DECORATOR
            frame = frame.f_back
        # Made by torch's decorator around a function (torch.no_grad() on Megatron's step): that
        # function's call, not its caller's.
        where = frame.f_code.co_filename if frame is not None and not decorated else ""
        if where.startswith(_PACKAGE_DIR) and not where.startswith(_HARNESS_DIR):
            name = getattr(func, "__name__", str(func))
            if name == "__get__":
                self.attributes += 1
            else:
                self.calls += 1
                where = os.path.relpath(where, _PACKAGE_DIR)
                self.by_name[f"{name} ({where})"] += 1
        return func(*args, **(kwargs or {}))


def _to_host(tensor: torch.Tensor, args, kwargs) -> bool:
    """``.to`` copies to the host: an accelerator tensor sent to the CPU, or "cpu" spelled out
    (a copy on a GPU run; the CPU runtime keeps every tensor on the CPU). A device variable
    that merely equals the tensor's own device is no copy."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, str) and value.startswith("cpu"):
            return True
        if isinstance(value, torch.device) and value.type == "cpu" and tensor.device.type != "cpu":
            return True
    return False


def _no_data_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset(op.default for op in (aten.detach, aten.alias, aten.lift_fresh))


class GradReadCounter(TorchDispatchMode):
    """Bytes of gradient memory the tensor ops take as operands, while entered: each aten op
    (a fused ``_foreach_*`` op counts as one, collectives included) adds the bytes of every input
    tensor that lies in gradient memory. Views and detach read nothing and are left out.
    Gradient memory: the storages of the model parameters' ``main_grad`` (DDP's buffers) and
    ``.grad``, and of the optimizer's parameters' ``.grad`` / ``decoupled_grad``, looked up at each
    op (a Float16 or distributed optimizer makes fresh main gradients in prepare_grads).
    Destinations of ``copy_``/``zero_`` count too: the same in every variant, they cancel.
    Beside them, ``state_bytes``: the bytes of the weights the optimizer steps and of its state
    tensors taken as operands (the optimizer's own update reads them in every variant alike;
    the state audit reads them twice more per checked step)."""

    def __init__(self, trainer, host_reads: "HostReadCounter"):
        super().__init__()
        self.params = list(trainer.model.parameters())
        self.stepped = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        self.params += self.stepped
        states = optimizer_states(trainer.optimizer)
        self.states = [t for p in self.stepped for what, t in held_tensors(p, states).items() if what != "weight"]
        self.bytes = 0
        self.state_bytes = 0
        self.by_hook: Counter = Counter()
        """The same bytes by the monitor's hook method they were read in ("-": outside the hooks)."""
        self.host_reads = host_reads
        self._skip = _no_data_ops()

    def _grad_storages(self) -> set:
        out = set()
        for p in self.params:
            for name in ("main_grad", "grad", "decoupled_grad"):
                g = getattr(p, name, None)
                if isinstance(g, torch.Tensor) and g.numel():
                    out.add(g.untyped_storage().data_ptr())
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and func not in self._skip:
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.numel()]
            if tensors:
                grads = self._grad_storages()
                nbytes = sum(t.numel() * t.element_size() for t in tensors if t.untyped_storage().data_ptr() in grads)
                self.bytes += nbytes
                held = {t.untyped_storage().data_ptr() for t in self.stepped + self.states}
                self.state_bytes += sum(t.numel() * t.element_size() for t in tensors
                                        if t.untyped_storage().data_ptr() in held)
                self.by_hook[self.host_reads.hooks[-1] if self.host_reads.hooks else "-"] += nbytes
        return func(*args, **kwargs)


def held_state_bytes(optimizer) -> int:
    """Bytes of what ``optimizer`` holds on this rank: each weight it steps and its floating state
    tensors (``exp_avg``, ``exp_avg_sq``): the denominator of the held-state read passes."""
    states = optimizer_states(optimizer)
    return sum(t.numel() * t.element_size() for g in optimizer.param_groups for p in g["params"]
               for t in held_tensors(p, states).values())


def gradient_bytes(optimizer) -> int:
    """Bytes of the gradients ``optimizer`` applies on this rank (one per parameter it steps, in
    the parameter's dtype): what one pass of a norm over all of them reads."""
    return sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])


def _allocated_by(fn, device: str):
    """Run ``fn``; returns (result, bytes): on an accelerator the peak above what was allocated
    before, on the CPU the total bytes allocated inside (profiler; bounds the peak)."""
    if device != "cpu":
        acc = getattr(torch, device)
        acc.synchronize()
        before = acc.memory_allocated()
        acc.reset_peak_memory_stats()
        result = fn()
        acc.synchronize()
        return result, acc.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return result, sum(max(e.self_cpu_memory_usage, 0) for e in prof.events() if e.name != "[memory]")


@contextlib.contextmanager
def instrumented_hooks(monitor, counter: HostReadCounter, device: str, transient: list):
    """Count host reads and allocations inside the monitor's hook methods (instance attributes
    shadow the class's for the duration)."""
    def wrap(name, method):
        def inner(*args, **kwargs):
            counter.in_hook += 1
            counter.hooks.append(name)
            try:
                result, nbytes = _allocated_by(lambda: method(*args, **kwargs), device)
            finally:
                counter.in_hook -= 1
                counter.hooks.pop()
            transient.append(nbytes)
            return result

        return inner

    saved = {name: monitor.__dict__.get(name) for name in HOOK_METHODS}
    for name in HOOK_METHODS:
        setattr(monitor, name, wrap(name, getattr(monitor, name)))
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is None:
                monitor.__dict__.pop(name, None)
            else:
                setattr(monitor, name, previous)


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return out


def model_state_storages(trainer) -> dict[int, int]:
    """Storages of params, grads (main_grad buffers) and optimizer state, deduplicated."""
    tensors = []
    for p in trainer.model.parameters():
        tensors += [p, getattr(p, "main_grad", None), p.grad]
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            tensors += [p, p.grad, getattr(p, "main_grad", None)]
    for leaf in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = getattr(leaf, "optimizer", None)
        for state in (inner.state.values() if inner is not None else []):
            tensors += list(state.values())
    return _storages(tensors)


def retained_storages(root, exclude: dict[int, int]) -> dict[int, int]:
    """Storages the monitor holds that are not the model's own (caches such as ``_static``)."""
    found, seen = [], set()

    def walk(obj, depth):
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, typing.Mapping):
            for value in list(obj.values()):
                walk(value, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in list(obj):
                walk(value, depth + 1)
        elif type(obj).__module__.startswith("megatron_patches") and hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                walk(value, depth + 1)

    walk(root, 0)
    return {ptr: n for ptr, n in _storages(found).items() if ptr not in exclude}


def stats(samples) -> dict:
    a = np.asarray(samples, dtype=float)
    p10, q1, med, q3, p90 = np.percentile(a, [10, 25, 50, 75, 90])
    return {"median": float(med), "p10": float(p10), "q1": float(q1), "q3": float(q3), "p90": float(p90),
            "n": int(a.size)}


def total_count(counts: list[Counter]) -> int:
    return sum(sum(c.values()) for c in counts)


def merged_counts(counts: list[Counter]) -> dict:
    return dict(sum(counts, Counter()))
