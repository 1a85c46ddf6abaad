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
count) and the monitor's memory. Prints a table (Markdown) and writes every number, the
environment and the targets to ``--out`` (JSON).
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

from megatron_patches import hooks, patching, tiny_gpt
from megatron_patches.config import Config
from megatron_patches.monitor import GradMonitor

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
LIMITS = {"step_overhead_pct": 2.0, "read_passes": 1.5, "host_reads": 1.0, "memory_pct": 1.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps per variant and size (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    p.add_argument("--count-steps", type=int, default=2,
                   help="untimed steps per variant for host reads and memory (default 2)")
    p.add_argument("--sizes", default="small,large",
                   help=f"comma-separated, smallest first, of: {', '.join(SIZES)} (default all)")
    p.add_argument("--out", default="bench.json", help="JSON output (default bench.json)")
    args = p.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for size in args.sizes:
        if size not in SIZES:
            p.error(f"--sizes: unknown size {size!r}; choose from {', '.join(SIZES)}")
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
    def wrap(method):
        def inner(*args, **kwargs):
            counter.in_hook += 1
            try:
                result, nbytes = _allocated_by(lambda: method(*args, **kwargs), device)
            finally:
                counter.in_hook -= 1
            transient.append(nbytes)
            return result

        return inner

    saved = {name: monitor.__dict__.get(name) for name in HOOK_METHODS}
    for name in HOOK_METHODS:
        setattr(monitor, name, wrap(getattr(monitor, name)))
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
        from megatron_patches.trainer import TinyTrainer

        self.size, self.args, self.device, self.sync = size, args, device, sync
        shape = SIZES[size]
        rounds = args.warmup + args.steps + args.count_steps
        self.trainer = TinyTrainer(tiny_gpt.parse_args([
            "--no-guard", "--steps", str(rounds * len(VARIANTS)), "--out", os.path.join(workdir, size),
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

    def log(self, message: str) -> None:
        print(f"[{self.size}] {message}", flush=True)

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
        self.log(f"hidden {m.hidden}, {m.layers} layers, {m.heads} heads, {self.n_params():,} parameters; "
                 f"{a.warmup} warmup + {a.steps} measured + {a.count_steps} counted steps per variant")
        for r in range(a.warmup):
            for v in VARIANTS:
                self.step(v)
            self.log(f"warmup {r + 1}/{a.warmup}")
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
                with scope, counter:
                    self.step(v)
                self.checked[v] += monitor.counters["checked_steps"] - before if monitor else 1
                self.reads[v].append(+counter.step)  # unary + drops zero counts
                self.in_hooks[v].append(+counter.hook)
            self.log(f"counting host reads and memory {r + 1}/{self.args.count_steps}")

    def n_params(self) -> int:
        return sum(p.numel() for p in self.trainer.model.parameters())

    def summary(self) -> dict:
        m = self.trainer.args
        model_storages = model_state_storages(self.trainer)
        state_bytes = sum(model_storages.values())
        yard = float(np.median(self.yard_ms))
        result = {
            "model": {"hidden": m.hidden, "layers": m.layers, "heads": m.heads, "vocab": m.vocab, "seq": m.seq,
                      "micro_batch_size": m.micro_batch_size, "micro_batches": m.micro_batches,
                      "precision": m.precision, "parameters": self.n_params(),
                      "param_tensors": sum(len(g["params"]) for g in self.trainer.optimizer.param_groups),
                      "model_optimizer_state_bytes": state_bytes},
            "yardstick_ms": stats(self.yard_ms),
            "yardstick_samples_ms": self.yard_ms,
            "variant_c_changes": self.variants.all_on_changes,
            "variant_configs": {v: dataclasses.asdict(c) for v, c in self.variants.configs.items()},
            "variants": {},
        }
        base = {part: np.asarray(self.ms[part]["A"]) for part in PARTS}
        for v in VARIANTS:
            entry = {"title": TITLES[v], "overhead": {}}
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
            o["read_passes"] = (o["optimizer_ms"] + o["finalize_ms"]) / yard if yard > 0 else None
            o["read_passes_optimizer_step"] = o["optimizer_ms"] / yard if yard > 0 else None
            # Cross-checks on short windows, far less exposed to neighbours than a whole step.
            o["read_passes_direct"] = guard / yard if yard > 0 else None
            # Noise only ever adds time: the least-disturbed samples of each estimate the cost.
            o["guard_pct_of_train_min"] = 100 * min(self.ms["guard"][v]) / float(base["train"].min())
            checked = max(self.checked[v], 1)
            entry.update({
                "checked_steps_counted": self.checked[v],
                "host_reads_per_step": _total(self.reads[v]) / len(self.reads[v]),
                "host_reads_per_step_by_method": _merge(self.reads[v]),
                "host_reads_per_checked_step": (_total(self.reads[v]) - _total(self.reads["A"])) / checked,
                "host_reads_in_hooks_per_checked_step": _total(self.in_hooks[v]) / checked,
                "host_reads_in_hooks_by_method": _merge(self.in_hooks[v]),
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


def targets(sizes: dict) -> list[dict]:
    """The goals, each with its value and whether it was met. Timing goals are read on the last
    (largest) size; host reads and memory take the worst over sizes and guarded variants.
    ``verdict`` also weighs the spread ("within noise" when q1..q3 straddles the limit) and
    names a cross-check on the other side of the limit."""
    larger = list(sizes)[-1]
    big = sizes[larger]["variants"]
    worst = lambda key: max(key(sizes[s]["variants"][v]) for s in sizes for v in GUARDED)
    a_train = big["A"]["train_ms"]["median"]
    yard = sizes[larger]["yardstick_ms"]["median"]

    def step_pct(v):
        o = big[v]["overhead"]
        return (o["train_pct"], [100 * o["train_ms_q1"] / a_train, 100 * o["train_ms_q3"] / a_train],
                {"guard_pct_of_train_min": o["guard_pct_of_train_min"]})

    c = big["C"]["overhead"]
    c_passes = (c["read_passes"],
                [(c["optimizer_ms_q1"] + c["finalize_ms_q1"]) / yard, (c["optimizer_ms_q3"] + c["finalize_ms_q3"]) / yard],
                {"read_passes_direct": c["read_passes_direct"]})
    rows = [
        ("default_step_overhead_pct", f"default config (B): extra whole-step time on {larger}",
         *step_pct("B"), LIMITS["step_overhead_pct"], "%"),
        ("shipped_default_step_overhead_pct", f"default as shipped (E, grad_history on): extra whole-step time on {larger}",
         *step_pct("E"), LIMITS["step_overhead_pct"], "%"),
        ("all_detectors_read_passes",
         f"every detector on (C): extra optimizer.step + finalize_model_grads time in read passes on {larger}",
         *c_passes, LIMITS["read_passes"], "passes"),
        ("host_reads_per_checked_step", "host reads per checked step (B, C, E, every size: worst)",
         worst(lambda e: e["host_reads_per_checked_step"]), None, {}, LIMITS["host_reads"], "reads"),
        ("extra_memory_pct", "retained + transient bytes / model+optimizer state (B, C, E, every size: worst)",
         worst(lambda e: e["memory"]["pct_of_model_optimizer_state"]), None, {}, LIMITS["memory_pct"], "%"),
    ]
    out = []
    for name, what, value, spread, cross, limit, unit in rows:
        met = value is not None and value <= limit
        verdict = "met" if met else "missed"
        if spread is not None and spread[0] <= limit < spread[1]:  # the interquartile range
            verdict = f"within noise ({verdict} on the median)"
        for key, other in cross.items():
            if other is not None and (other <= limit) != met:
                verdict += f"; {key} {other:.3g} says {'met' if other <= limit else 'missed'}"
        out.append({"name": name, "what": what, "size": larger, "value": value, "spread_q1_q3": spread,
                    "limit": limit, "unit": unit, "met": met, "verdict": verdict, "cross_check": cross})
    return out


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
              f"{m['model_optimizer_state_bytes'] / 2**20:.1f} MiB; one read pass (_foreach_norm over all "
              f"gradients) {_ms(r['yardstick_ms'], 3)} ms\n")
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
                "-" if base else f"{e['host_reads_per_checked_step']:g}",
                f"{e['memory']['pct_of_model_optimizer_state']:.4f}" if "memory" in e else "-",
            ])
        print(_markdown(["variant", "optimizer.step ms", "extra", "finalize extra", "in guard ms",
                         "train step ms", "extra", "read passes (diff / direct)", "host reads", "memory %"], rows))
    print("\ntargets:\n")
    rows = []
    for t in result["targets"]:
        spread, cross = t["spread_q1_q3"], t["cross_check"]
        rows.append([t["verdict"] if t["met"] and t["verdict"] == "met" else f"**{t['verdict']}**", t["name"],
                     "n/a" if t["value"] is None else f"{t['value']:.3g} {t['unit']}",
                     f"[{spread[0]:.3g}, {spread[1]:.3g}]" if spread else "-", f"<= {t['limit']:g}",
                     ", ".join(f"{k} {v:.3g}" for k, v in cross.items()) or "-", t["what"]])
    print(_markdown(["verdict", "target", "value", "q1, q3", "limit", "cross-check", "what"], rows))


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


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.getLogger("megatron_patches").setLevel(logging.WARNING)  # not one "patched ..." line per switch
    device = tiny_gpt._init_distributed(tiny_gpt.parse_args(["--no-guard"]))  # CPU runtime + gloo without a GPU
    sync = getattr(torch, device).synchronize if device != "cpu" else (lambda: None)
    started = time.time()
    result = {"schema": "megatron_patches.bench/1", "environment": environment(device),
              "settings": {"steps": args.steps, "warmup": args.warmup, "count_steps": args.count_steps,
                           "sizes": args.sizes, "variants": TITLES, "limits": LIMITS}, "sizes": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="megatron_patches_bench_") as workdir:
            for size in args.sizes:
                result["sizes"][size] = SizeBench(size, args, device, sync, workdir).run()
    finally:
        patching.uninstall()
        hooks.set_monitor(None)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    result["targets"] = targets(result["sizes"])
    result["environment"]["load_average_after"] = list(os.getloadavg())
    result["seconds"] = round(time.time() - started, 1)
    print_table(result)
    with open(args.out + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    os.replace(args.out + ".tmp", args.out)
    print(f"\n{result['seconds']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
