#!/usr/bin/env python
"""What the guard costs on a real megatron-core training step (``make bench``).

One process, world size 1, the tiny-GPT harness's model and optimizer at each size. The same
model steps under every variant, interleaved step by step (A B C D E Y, then B C D E Y A, ...)
so that drift and neighbours on the machine fall on all variants alike:

  A  unpatched megatron-core
  B  patched, default Config, grad_history off
  C  patched, every detector on (a generic walk over Config, see all_detectors_config)
  D  unpatched plus the naive per-parameter loop a first attempt writes (naive_prepare_grads)
  E  patched, default Config as shipped (grad_history on: one JSON line per step)
  Y  the yardstick: one fused read of all gradients (torch._foreach_norm), no training step

Timed per step: the whole train step, ``optimizer.step()`` and ``finalize_model_grads`` (the
guard works in these two) and the time inside the guard's own hooks. Then, untimed: host
reads per checked step (Tensor.item, .tolist, ... counted during the step, minus variant A's
count), read passes (bytes of gradient memory the step's tensor ops take as operands, minus
variant A's, over the bytes of the gradients the optimizer applies) and the monitor's memory.
Then the same counts, untimed, on two CPU ranks (data parallel, a torchrun child process).
Prints a table (Markdown) and writes every number, the environment and the targets to
``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib
import inspect
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import types
import typing
from collections import Counter

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_patches import hooks, patching
from megatron_patches.config import Config
from megatron_patches.monitor import GradMonitor
from megatron_patches.testing import tiny_gpt

SIZES = {
    "small": {"hidden": 64, "layers": 2, "heads": 4},
    "large": {"hidden": 512, "layers": 8, "heads": 8},
}
VARIANTS = ("A", "B", "C", "D", "E")
GUARDED = ("B", "C", "E")
TITLES = {
    "A": "unpatched megatron-core",
    "B": "patched, default config, grad_history off",
    "C": "patched, every detector on",
    "D": "naive per-parameter loop",
    "E": "patched, default config as shipped",
}
YARDSTICK = "Y"
PARTS = ("train", "optimizer", "finalize", "guard")
"""Timed per step: the whole train step, optimizer.step(), finalize_model_grads, and the time
inside the guard itself (the monitor's hooks; for D the naive loop; 0 for A)."""
HOOK_METHODS = tuple(sorted(set(re.findall(r"_monitor\.(\w+)\(", inspect.getsource(hooks)))))
"""The GradMonitor methods the patches call (read from hooks.py, so new ones are timed too)."""
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
LIMITS = {"step_overhead_pct": 2.0, "default_extra_read_passes": 0.1, "default_extra_host_reads": 0.0,
          "all_detectors_read_passes": 1.1, "host_reads": 1.0, "memory_pct": 1.0}
DP2_NPROC = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps per variant and size (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    p.add_argument("--count-steps", type=int, default=2,
                   help="untimed steps per variant for host reads and memory (default 2)")
    p.add_argument("--sizes", default="small,large",
                   help=f"comma-separated, smallest first, of: {', '.join(SIZES)} (default all)")
    p.add_argument("--out", default="bench.json", help="JSON output (default bench.json)")
    p.add_argument("--dp2-sizes", default="small",
                   help="sizes counted again on 2 data-parallel CPU ranks (default small; '' skips it)")
    p.add_argument("--counts-only", action="store_true",
                   help="no timed steps: host reads, read passes and memory only (the DP=2 child run)")
    args = p.parse_args(argv)
    args.dp2_sizes = [s.strip() for s in args.dp2_sizes.split(",") if s.strip()]
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for size in args.sizes + args.dp2_sizes:
        if size not in SIZES:
            p.error(f"--sizes/--dp2-sizes: unknown size {size!r}; choose from {', '.join(SIZES)}")
    for name in ("steps", "count_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


# --- variant C: every detector on, built generically --------------------------------------


def _optional_number(tp) -> typing.Optional[type]:
    """float or int when ``tp`` is Optional[float] / Optional[int], else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType) or type(None) not in typing.get_args(tp):
        return None
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    return inner[0] if len(inner) == 1 and inner[0] in (int, float) else None


def all_detectors_config(base: Config) -> tuple[Config, list[str]]:
    """Every boolean ``enabled`` true, check_interval 1, and every Optional number that is None
    a large finite value its validator accepts (its code path runs, it never fires). Walks
    the Config dataclasses, so sections added later are picked up without edits here."""
    data = dataclasses.asdict(base)
    changes = []
    large = {float: (1e30, 1e9, 1e3, 0.999), int: (2**31 - 1, 10**6, 1000, 1)}

    def walk(cls, values: dict, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp, where = hints[f.name], prefix + f.name
            if dataclasses.is_dataclass(tp) and isinstance(values[f.name], dict):
                walk(tp, values[f.name], where + ".")
            elif f.name == "enabled" and tp is bool and values[f.name] is not True:
                values[f.name] = True
                changes.append(f"{where}: true")
            elif values[f.name] is None and _optional_number(tp):
                check = f.metadata.get("check") or (lambda v: None)
                value = next((v for v in large[_optional_number(tp)] if check(v) is None), None)
                values[f.name] = value
                changes.append(f"{where}: {'left null (no large value passes its check)' if value is None else value}")

    walk(Config, data, "")
    if data["check_interval"] != 1:
        data["check_interval"] = 1
        changes.append("check_interval: 1")
    return Config.from_dict(data), changes


# --- variant D: the naive baseline ---------------------------------------------------------


def naive_check(optimizer) -> bool:
    """The per-parameter loop as first attempts write it: two kernels and two host reads per
    gradient. True when a gradient holds NaN or Inf."""
    found = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and (torch.isnan(p.grad).any().item() or torch.isinf(p.grad).any().item()):
                found = True
    return found


def naive_prepare_grads(original, check=naive_check):
    """megatron-core's prepare_grads, then the naive check; True (skip the step) on a bad gradient."""

    @functools.wraps(original)
    def prepare_grads(self, *args, **kwargs):
        found_inf = original(self, *args, **kwargs)
        return check(self) or found_inf

    return prepare_grads


class Variants:
    """Switches the process between variants with cheap setattrs; one monitor per patched variant."""

    def __init__(self, report_dir: str, guard: "Stopwatch"):
        from megatron.core.optimizer.optimizer import ChainedOptimizer

        self.chained = ChainedOptimizer
        self.original = ChainedOptimizer.__dict__["prepare_grads"]
        self.naive = naive_prepare_grads(self.original, guard.wrap(naive_check, "naive_check"))
        shipped = Config(report_dir=report_dir)
        default = shipped.replace(grad_history=False)
        all_on, self.all_on_changes = all_detectors_config(default)
        self.configs = {"B": default, "C": all_on, "E": shipped}
        self.monitors = {v: GradMonitor(c) for v, c in self.configs.items()}
        for monitor in self.monitors.values():  # time spent inside the guard itself
            for name in HOOK_METHODS:
                setattr(monitor, name, guard.wrap(getattr(monitor, name), name))

    def activate(self, variant: str) -> None:
        # Unwrap first: patching.install() wraps whatever prepare_grads the class holds then.
        patching.uninstall()
        hooks.set_monitor(None)
        setattr(self.chained, "prepare_grads", self.naive if variant == "D" else self.original)
        if variant in self.monitors:
            patching.install()
            hooks.set_monitor(self.monitors[variant])


# --- measuring ---------------------------------------------------------------------------------


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
    Destinations of ``copy_``/``zero_`` count too: the same in every variant, they cancel."""

    def __init__(self, trainer, host_reads: "HostReadCounter"):
        super().__init__()
        self.params = list(trainer.model.parameters())
        self.params += [p for g in trainer.optimizer.param_groups for p in g["params"]]
        self.bytes = 0
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
                self.by_hook[self.host_reads.hooks[-1] if self.host_reads.hooks else "-"] += nbytes
        return func(*args, **kwargs)


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


def _total(counts: list[Counter]) -> int:
    return sum(sum(c.values()) for c in counts)


def _merge(counts: list[Counter]) -> dict:
    return dict(sum(counts, Counter()))


# --- one size --------------------------------------------------------------------------------


class SizeBench:
    """One model size: the harness's trainer, the variants, and what was measured on them."""

    def __init__(self, size: str, args, device: str, sync, workdir: str):
        from megatron_patches.testing.trainer import TinyTrainer

        self.size, self.args, self.device, self.sync = size, args, device, sync
        shape = SIZES[size]
        rounds = args.warmup + args.steps + args.count_steps
        self.trainer = TinyTrainer(tiny_gpt.parse_args([
            "--no-guard", "--steps", str(rounds * len(VARIANTS)), "--out", os.path.join(workdir, size),
            "--check-for-nan-in-grad",  # as Megatron-LM runs by default (--check-for-nan-in-loss-and-grad)
            "--hidden", str(shape["hidden"]), "--layers", str(shape["layers"]), "--heads", str(shape["heads"])]),
            device)
        # Built unguarded: name the parameters as get_megatron_optimizer's wrapper would.
        hooks.register_model(self.trainer.optimizer, [self.trainer.model])
        # The guard works in optimizer.step() (prepare_grads) and in finalize_model_grads (before
        # the data-parallel reduction): time both. Both are looked up at each call, so that the
        # patched variants go through whatever the patches wrap.
        fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        self.timers = {part: Stopwatch(sync) for part in PARTS[1:]}
        optimizer = self.trainer.optimizer
        optimizer.step = self.timers["optimizer"].wrap(lambda *a, **k: type(optimizer).step(optimizer, *a, **k))
        self.trainer.config.finalize_model_grads_func = self.timers["finalize"].wrap(
            lambda *a, **k: fmg.finalize_model_grads(*a, **k))
        self.variants = Variants(os.path.join(workdir, size, "reports"), self.timers["guard"])
        self.steps_done = 0
        self.ms = {part: {v: [] for v in VARIANTS} for part in PARTS}
        self.yard_ms: list[float] = []
        self.guard_split = {v: [] for v in VARIANTS}
        self.reads = {v: [] for v in VARIANTS}
        self.in_hooks = {v: [] for v in VARIANTS}
        self.transient = {v: [] for v in VARIANTS}
        self.checked = {v: 0 for v in VARIANTS}
        self.grad_reads = {v: [] for v in VARIANTS}
        self.grad_reads_by_hook = {v: [] for v in VARIANTS}
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.tag = size if self.world == 1 else f"{size}, {self.world} ranks"

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[{self.tag}] {message}", flush=True)

    def step(self, variant: str) -> dict[str, float]:
        """One training step under ``variant``; ms of each part."""
        self.variants.activate(variant)
        self.steps_done += 1
        for timer in self.timers.values():
            timer.reset()
        self.sync()
        t0 = time.perf_counter_ns()
        out = self.trainer.train_step(self.steps_done)
        self.sync()
        total = time.perf_counter_ns() - t0
        if out["skipped"]:
            self.log(f"warning: step {self.steps_done} ({variant}) was skipped")
        return {"train": total / 1e6, **{part: t.ns / 1e6 for part, t in self.timers.items()}}

    def yardstick(self) -> float:
        """One fused read of every gradient the optimizer holds, in ms."""
        grads = [p.grad if p.grad is not None else getattr(p, "main_grad", None)
                 for g in self.trainer.optimizer.param_groups for p in g["params"]]
        grads = [g for g in grads if g is not None]
        self.sync()
        t0 = time.perf_counter_ns()
        torch._foreach_norm(grads)
        self.sync()
        return (time.perf_counter_ns() - t0) / 1e6

    def run(self) -> dict:
        a, m = self.args, self.trainer.args
        measured = 0 if a.counts_only else a.steps
        self.log(f"hidden {m.hidden}, {m.layers} layers, {m.heads} heads, {self.n_params():,} parameters; "
                 f"{a.warmup} warmup + {measured} measured + {a.count_steps} counted steps per variant")
        for r in range(a.warmup):
            for v in VARIANTS:
                self.step(v)
            self.log(f"warmup {r + 1}/{a.warmup}")
        if not a.counts_only:
            self.timed()
        self.counted()
        result = self.summary()
        self.variants.activate("A")
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        return result

    def timed(self) -> None:
        """Interleaved rounds; round r starts at slot r, so no variant always follows the same one."""
        slots = VARIANTS + (YARDSTICK,)
        gc.collect()
        gc.disable()  # a collection would land on whichever variant runs then; collect between rounds
        try:
            for r in range(self.args.steps):
                for v in slots[r % len(slots):] + slots[:r % len(slots)]:
                    if v == YARDSTICK:
                        self.yard_ms.append(self.yardstick())
                        continue
                    for part, ms in self.step(v).items():
                        self.ms[part][v].append(ms)
                    self.guard_split[v].append({k: ns / 1e6 for k, ns in self.timers["guard"].split.items()})
                gc.collect()
                self.log(f"step {r + 1}/{self.args.steps} (optimizer.step/train step ms): " + "  ".join(
                    f"{v} {self.ms['optimizer'][v][-1]:.1f}/{self.ms['train'][v][-1]:.0f}" for v in VARIANTS)
                    + f"  {YARDSTICK} {self.yard_ms[-1]:.2f}")
        finally:
            gc.enable()

    def counted(self) -> None:
        """Untimed steps: host reads (whole step, and inside the monitor's hooks) and the
        monitor's allocations."""
        for r in range(self.args.count_steps):
            for v in VARIANTS:
                monitor = self.variants.monitors.get(v)
                counter = HostReadCounter(self.device)
                scope = (instrumented_hooks(monitor, counter, self.device, self.transient[v])
                         if monitor else contextlib.nullcontext())
                before = monitor.counters["checked_steps"] if monitor else 0
                grad_reads = GradReadCounter(self.trainer, counter)
                with scope, counter, grad_reads:
                    self.step(v)
                self.checked[v] += monitor.counters["checked_steps"] - before if monitor else 1
                self.reads[v].append(+counter.step)  # unary + drops zero counts
                self.in_hooks[v].append(+counter.hook)
                self.grad_reads[v].append(grad_reads.bytes)
                self.grad_reads_by_hook[v].append(grad_reads.by_hook)
            self.log(f"counting host reads, gradient reads and memory {r + 1}/{self.args.count_steps}")

    def n_params(self) -> int:
        return sum(p.numel() for p in self.trainer.model.parameters())

    def summary(self) -> dict:
        m = self.trainer.args
        model_storages = model_state_storages(self.trainer)
        state_bytes = sum(model_storages.values())
        grad_bytes = gradient_bytes(self.trainer.optimizer)
        result = {
            "model": {"hidden": m.hidden, "layers": m.layers, "heads": m.heads, "vocab": m.vocab, "seq": m.seq,
                      "micro_batch_size": m.micro_batch_size, "micro_batches": m.micro_batches,
                      "precision": m.precision, "parameters": self.n_params(),
                      "param_tensors": sum(len(g["params"]) for g in self.trainer.optimizer.param_groups),
                      "model_optimizer_state_bytes": state_bytes, "gradient_bytes": grad_bytes},
            "world_size": self.world, "rank": self.rank,
            "variant_c_changes": self.variants.all_on_changes,
            "variant_configs": {v: dataclasses.asdict(c) for v, c in self.variants.configs.items()},
            "variants": {},
        }
        timed = bool(self.yard_ms)
        if timed:
            result["yardstick_ms"] = stats(self.yard_ms)
            result["yardstick_samples_ms"] = self.yard_ms
        for v in VARIANTS:
            entry = {"title": TITLES[v]}
            if timed:
                self.timing(entry, v)
            checked = max(self.checked[v], 1)
            entry.update({
                "checked_steps_counted": self.checked[v],
                "host_reads_per_step": _total(self.reads[v]) / len(self.reads[v]),
                "host_reads_per_step_by_method": _merge(self.reads[v]),
                "host_reads_per_checked_step": (_total(self.reads[v]) - _total(self.reads["A"])) / checked,
                "host_reads_in_hooks_per_checked_step": _total(self.in_hooks[v]) / checked,
                "host_reads_in_hooks_by_method": _merge(self.in_hooks[v]),
                "gradient_bytes_read_per_step": sum(self.grad_reads[v]) / len(self.grad_reads[v]),
                "read_passes_per_step": sum(self.grad_reads[v]) / len(self.grad_reads[v]) / grad_bytes,
                "extra_read_passes_per_checked_step":
                    (sum(self.grad_reads[v]) - sum(self.grad_reads["A"])) / grad_bytes / checked,
                # Where they are read: in each of the guard's hooks, and outside them ("-", where
                # Megatron's own norm pass, absent when the guard serves it, shows as a difference).
                "read_passes_per_step_by_hook": {k: n / len(self.grad_reads[v]) / grad_bytes for k, n in
                                                 sorted(sum(self.grad_reads_by_hook[v], Counter()).items())},
            })
            monitor = self.variants.monitors.get(v)
            if monitor is not None:
                entry["memory"] = self.memory(monitor, v, model_storages, state_bytes)
                entry["monitor_counters"] = dict(monitor.counters)
                if monitor.counters["incidents"]:
                    self.log(f"warning: variant {v} raised {monitor.counters['incidents']} incident(s); "
                             f"its timings include the slow path")
            result["variants"][v] = entry
        return result

    def timing(self, entry: dict, v: str) -> None:
        """The timed figures of variant ``v`` into ``entry`` (paired with A by round)."""
        base = {part: np.asarray(self.ms[part]["A"]) for part in PARTS}
        yard = float(np.median(self.yard_ms))
        entry["overhead"] = {}
        for part in PARTS:
            samples = np.asarray(self.ms[part][v])
            # Paired by round: A ran within a few steps of this one, so drift cancels.
            extra = stats(samples - base[part])
            entry[f"{part}_ms"] = stats(samples)
            entry[f"{part}_samples_ms"] = samples.tolist()
            entry["overhead"][f"{part}_ms"] = extra["median"]
            entry["overhead"].update({f"{part}_ms_{k}": extra[k] for k in ("p10", "q1", "q3", "p90")})
            if part != "guard":  # A spends no time in a guard
                entry["overhead"][f"{part}_pct"] = 100 * extra["median"] / float(np.median(base[part]))
        o, guard = entry["overhead"], entry["guard_ms"]["median"]
        split = self.guard_split[v]
        entry["guard_ms_by_hook"] = {k: float(np.median([t.get(k, 0.0) for t in split]))
                                     for k in sorted({k for t in split for k in t})}
        # Time in read passes: extra time over the yardstick's (one fused read of every gradient).
        o["read_passes"] = (o["optimizer_ms"] + o["finalize_ms"]) / yard if yard > 0 else None
        o["read_passes_optimizer_step"] = o["optimizer_ms"] / yard if yard > 0 else None
        # Cross-checks on short windows, far less exposed to neighbours than a whole step.
        o["read_passes_direct"] = guard / yard if yard > 0 else None
        # Noise only ever adds time: the least-disturbed samples of each estimate the cost.
        o["guard_pct_of_train_min"] = 100 * min(self.ms["guard"][v]) / float(base["train"].min())

    def memory(self, monitor, variant: str, model_storages: dict, state_bytes: int) -> dict:
        retained = sum(retained_storages(monitor, model_storages).values())
        transient = max(self.transient[variant], default=0)
        return {
            "retained_bytes": retained,
            "transient_bytes": transient,
            "transient_method": ("total bytes allocated inside the hooks (profiler; bounds the peak)"
                                 if self.device == "cpu" else
                                 f"peak {self.device} memory above the allocation at hook entry"),
            "model_optimizer_state_bytes": state_bytes,
            "pct_of_model_optimizer_state": 100 * (retained + transient) / state_bytes,
        }


# --- report ------------------------------------------------------------------------------------


def targets(sizes: dict, dp2: typing.Optional[dict] = None) -> list[dict]:
    """The goals, each with its value and whether it was met. Timing goals are read on the last
    (largest) size; counts (host reads, read passes, memory) take the worst over sizes (and, on
    two ranks, over ranks). ``verdict`` also weighs the spread of a timing ("within noise" when
    q1..q3 straddles the limit) and names a cross-check on the other side of the limit."""
    larger = list(sizes)[-1]
    big = sizes[larger]["variants"]
    rows = []
    if "train_ms" in big["A"]:  # timed (not a --counts-only run)
        a_train = big["A"]["train_ms"]["median"]

        def step_pct(v):
            o = big[v]["overhead"]
            return (o["train_pct"], [100 * o["train_ms_q1"] / a_train, 100 * o["train_ms_q3"] / a_train],
                    {"guard_pct_of_train_min": o["guard_pct_of_train_min"]})

        rows += [
            ("default_step_overhead_pct", f"default config (B): extra whole-step time on {larger}",
             *step_pct("B"), LIMITS["step_overhead_pct"], "%"),
            ("shipped_default_step_overhead_pct",
             f"default as shipped (E, grad_history on): extra whole-step time on {larger}",
             *step_pct("E"), LIMITS["step_overhead_pct"], "%"),
        ]
    rows += _count_rows({s: [r] for s, r in sizes.items()}, "")
    worst = lambda key: max(key(sizes[s]["variants"][v]) for s in sizes for v in GUARDED)
    rows += [
        ("host_reads_per_checked_step", "host reads per checked step (B, C, E, every size: worst)",
         worst(lambda e: e["host_reads_per_checked_step"]), None, {}, LIMITS["host_reads"], "reads"),
        ("extra_memory_pct", "retained + transient bytes / model+optimizer state (B, C, E, every size: worst)",
         worst(lambda e: e["memory"]["pct_of_model_optimizer_state"]), None, {}, LIMITS["memory_pct"], "%"),
    ]
    out = [_target(row, larger, "1 rank") for row in rows]
    if dp2:
        out += [_target(row, list(dp2)[-1], f"dp{len(next(iter(dp2.values()))['ranks'])}")
                for row in _count_rows({s: r["ranks"] for s, r in dp2.items()}, f" on {DP2_NPROC} ranks")]
    return out


def _count_rows(sizes: dict, where: str) -> list[tuple]:
    """The counted goals over ``{size: [each rank's summary]}``: the worst rank and size."""
    def worst(variant, key):
        return max(r["variants"][variant][key] for ranks in sizes.values() for r in ranks)

    return [
        ("default_extra_read_passes",
         f"default config (B) vs unpatched (A): extra bytes of gradient memory read per checked step / "
         f"gradient bytes{where} (every size: worst)",
         worst("B", "extra_read_passes_per_checked_step"), None, {}, LIMITS["default_extra_read_passes"], "passes"),
        ("default_extra_host_reads",
         f"default config (B) vs unpatched (A): extra host reads per checked step{where} (every size: worst)",
         worst("B", "host_reads_per_checked_step"), None, {}, LIMITS["default_extra_host_reads"], "reads"),
        ("all_detectors_read_passes",
         f"every detector on (C) vs unpatched (A): extra bytes of gradient memory read per checked step / "
         f"gradient bytes{where} (every size: worst)",
         worst("C", "extra_read_passes_per_checked_step"), None, {}, LIMITS["all_detectors_read_passes"], "passes"),
    ]


def _target(row: tuple, size: str, layout: str) -> dict:
    name, what, value, spread, cross, limit, unit = row
    met = value is not None and value <= limit
    verdict = "met" if met else "missed"
    if spread is not None and spread[0] <= limit < spread[1]:  # the interquartile range
        verdict = f"within noise ({verdict} on the median)"
    for key, other in cross.items():
        if other is not None and (other <= limit) != met:
            verdict += f"; {key} {other:.3g} says {'met' if other <= limit else 'missed'}"
    return {"name": name, "layout": layout, "what": what, "size": size, "value": value, "spread_q1_q3": spread,
            "limit": limit, "unit": unit, "met": met, "verdict": verdict, "cross_check": cross}


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _ms(st: dict, digits: int) -> str:
    return f"{st['median']:.{digits}f} [{st['q1']:.{digits}f}-{st['q3']:.{digits}f}]"


def print_table(result: dict) -> None:
    for size, r in result["sizes"].items():
        m = r["model"]
        print(f"\n{size}: hidden {m['hidden']}, {m['layers']} layers, {m['heads']} heads, {m['parameters']:,} "
              f"parameters in {m['param_tensors']} tensors, model+optimizer state "
              f"{m['model_optimizer_state_bytes'] / 2**20:.1f} MiB, gradients {m['gradient_bytes'] / 2**20:.1f} MiB; "
              f"one read pass (_foreach_norm over all gradients) {_ms(r['yardstick_ms'], 3)} ms\n")
        rows = []
        for v, e in r["variants"].items():
            d, base = e["overhead"], v == "A"
            rows.append([
                f"{v} {e['title']}",
                _ms(e["optimizer_ms"], 2), "-" if base else f"{d['optimizer_ms']:+.2f}",
                "-" if base else f"{d['finalize_ms']:+.2f}",
                "-" if base else _ms(e["guard_ms"], 2),
                _ms(e["train_ms"], 1), "-" if base else f"{d['train_ms']:+.1f} ({d['train_pct']:+.1f}%)",
                "-" if base else f"{d['read_passes']:.2f} / {d['read_passes_direct']:.2f}",
                f"{e['read_passes_per_step']:.2f}" + ("" if base else f" ({e['extra_read_passes_per_checked_step']:+.2f})"),
                "-" if base else f"{e['host_reads_per_checked_step']:+g}",
                f"{e['memory']['pct_of_model_optimizer_state']:.4f}" if "memory" in e else "-",
            ])
        print(_markdown(["variant", "optimizer.step ms", "extra", "finalize extra", "in guard ms",
                         "train step ms", "extra", "time in read passes (diff / direct)",
                         "gradient read passes (extra)", "extra host reads", "memory %"], rows))
    for size, r in result.get("dp2", {}).items():
        print(f"\n{size} on {len(r['ranks'])} data-parallel ranks (counted, not timed; per rank):\n")
        rows = [[f"{v} {TITLES[v]}", *[f"{rank['variants'][v]['read_passes_per_step']:.2f}"
                                        + ("" if v == "A" else f" ({rank['variants'][v]['extra_read_passes_per_checked_step']:+.2f})")
                                        for rank in r["ranks"]],
                 *["-" if v == "A" else f"{rank['variants'][v]['host_reads_per_checked_step']:+g}" for rank in r["ranks"]]]
                for v in VARIANTS]
        n = len(r["ranks"])
        print(_markdown(["variant", *[f"read passes rank {i} (extra)" for i in range(n)],
                         *[f"extra host reads rank {i}" for i in range(n)]], rows))
    print("\ntargets:\n")
    rows = []
    for t in result["targets"]:
        spread, cross = t["spread_q1_q3"], t["cross_check"]
        rows.append([t["verdict"] if t["met"] and t["verdict"] == "met" else f"**{t['verdict']}**", t["name"],
                     t["layout"], "n/a" if t["value"] is None else f"{t['value']:.3g} {t['unit']}",
                     f"[{spread[0]:.3g}, {spread[1]:.3g}]" if spread else "-", f"<= {t['limit']:g}",
                     ", ".join(f"{k} {v:.3g}" for k, v in cross.items()) or "-", t["what"]])
    print(_markdown(["verdict", "target", "layout", "value", "q1, q3", "limit", "cross-check", "what"], rows))


def environment(device: str) -> dict:
    from megatron.core import package_info

    if device == "cpu":
        name = platform.processor() or platform.machine()
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                name = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), name)
    else:
        name = getattr(torch, device).get_device_name()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = lambda *cmd: subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=root).stdout
    commit = git("rev-parse", "--short", "HEAD").strip() or None
    # What was measured when the package differs from the commit (uncommitted edits).
    uncommitted = [line[3:] for line in git("status", "--porcelain", "--", "megatron_patches").splitlines()]
    return {"torch": torch.__version__, "megatron_core": package_info.__version__,
            "python": platform.python_version(), "device": device, "device_name": name,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_average": list(os.getloadavg()),
            "cpu_test_runtime": device == "cpu", "commit": commit, "uncommitted": uncommitted,
            "platform": platform.platform()}


def run_dp2(args) -> dict:
    """The counted steps again on DP2_NPROC data-parallel CPU ranks (a torchrun child of this
    script with --counts-only); returns ``{size: {"ranks": [each rank's summary]}}``."""
    with tempfile.TemporaryDirectory(prefix="megatron_patches_bench_dp2_") as tmp:
        out = os.path.join(tmp, "dp2.json")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={DP2_NPROC}",
               os.path.abspath(__file__), "--counts-only", "--sizes", ",".join(args.dp2_sizes), "--dp2-sizes", "",
               "--warmup", str(args.warmup), "--count-steps", str(args.count_steps), "--out", out]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"the {DP2_NPROC}-rank run failed (exit {proc.returncode}): {' '.join(cmd)}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)["sizes"]


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("megatron_patches").setLevel(logging.WARNING)  # not one "patched ..." line per switch
    device = tiny_gpt._init_distributed(tiny_gpt.parse_args(["--no-guard"]))  # CPU runtime + gloo without a GPU
    sync = getattr(torch, device).synchronize if device != "cpu" else (lambda: None)
    started = time.time()
    result = {"schema": "megatron_patches.bench/2", "environment": environment(device),
              "settings": {"steps": args.steps, "warmup": args.warmup, "count_steps": args.count_steps,
                           "sizes": args.sizes, "dp2_sizes": args.dp2_sizes, "variants": TITLES,
                           "limits": LIMITS}, "sizes": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="megatron_patches_bench_") as workdir:
            for size in args.sizes:
                summary = SizeBench(size, args, device, sync, workdir).run()
                if args.counts_only:  # every rank's counts, on rank 0
                    summary = {"ranks": _gather(summary)}
                result["sizes"][size] = summary
    finally:
        patching.uninstall()
        hooks.set_monitor(None)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if rank != 0:
        return 0
    if args.counts_only:
        _write(result, args.out)
        return 0
    if args.dp2_sizes:
        print(f"\ncounting again on {DP2_NPROC} data-parallel CPU ranks: {', '.join(args.dp2_sizes)}", flush=True)
        result["dp2"] = run_dp2(args)
    result["targets"] = targets(result["sizes"], result.get("dp2"))
    result["environment"]["load_average_after"] = list(os.getloadavg())
    result["seconds"] = round(time.time() - started, 1)
    print_table(result)
    _write(result, args.out)
    print(f"\n{result['seconds']:.0f} s; wrote {args.out}")
    return 0


def _gather(summary: dict) -> list:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [summary]
    out = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(summary, out, dst=0)
    return out or []


def _write(result: dict, path: str) -> None:
    from megatron_patches.checkpoint import write_json_atomic

    write_json_atomic(path, result, indent=1)


if __name__ == "__main__":
    sys.exit(main())
