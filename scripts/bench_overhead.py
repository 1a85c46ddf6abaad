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

Beside this file: ``bench_variants.py`` (the variants), ``bench_measure.py`` (stopwatch, counters,
memory) and ``bench_report.py`` (targets, tables, environment).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

import numpy as np
import torch

from bench_measure import (GradReadCounter, HostReadCounter, Stopwatch, TorchCallCounter, gradient_bytes, held_state_bytes,
                           instrumented_hooks, merged_counts, model_state_storages, retained_storages, stats, total_count)
from bench_report import DP2_NPROC, LIMITS, TITLES, VARIANTS, environment, print_table, targets
from bench_variants import Variants
from megatron_patches.seams import wrappers, patching
from megatron_patches.testing import tiny_gpt

SIZES = {
    "small": {"hidden": 64, "layers": 2, "heads": 4},
    "large": {"hidden": 512, "layers": 8, "heads": 8},
}
YARDSTICK = "Y"
PARTS = ("train", "optimizer", "finalize", "guard")
"""Timed per step: the whole train step, optimizer.step(), finalize_model_grads, and the time
inside the guard itself (the monitor's hooks; for D the naive loop; 0 for A)."""


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
        # Built unguarded: each variant's run names the parameters as get_megatron_optimizer's wrapper would.
        for monitor in self.variants.monitors.values():
            monitor.state.model_chunks.remember(self.trainer.optimizer, [self.trainer.model])
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
        self.state_reads = {v: [] for v in VARIANTS}
        self.torch_calls = {v: [] for v in VARIANTS}
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.tag = size if self.world == 1 else f"{size}, {self.world} ranks"

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[{self.tag}] {message}", flush=True)

    def step(self, variant: str, activated: bool = False) -> dict[str, float]:
        """One training step under ``variant`` (``activated``: the caller made it the active one); ms of each part."""
        if not activated:
            self.variants.activate(variant, self.trainer.optimizer)
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
                calls = TorchCallCounter()
                self.variants.activate(v, self.trainer.optimizer)  # outside the counters (bench_variants.Variants.activate)
                with scope, counter, grad_reads, calls:
                    self.step(v, activated=True)
                self.torch_calls[v].append(calls)
                self.checked[v] += monitor.counters["checked_steps"] - before if monitor else 1
                self.reads[v].append(+counter.step)  # unary + drops zero counts
                self.in_hooks[v].append(+counter.hook)
                self.grad_reads[v].append(grad_reads.bytes)
                self.grad_reads_by_hook[v].append(grad_reads.by_hook)
                self.state_reads[v].append(grad_reads.state_bytes)
            self.log(f"counting host reads, gradient reads and memory {r + 1}/{self.args.count_steps}")

    def n_params(self) -> int:
        return sum(p.numel() for p in self.trainer.model.parameters())

    def summary(self) -> dict:
        m = self.trainer.args
        model_storages = model_state_storages(self.trainer)
        state_bytes = sum(model_storages.values())
        grad_bytes = gradient_bytes(self.trainer.optimizer)
        held_bytes = held_state_bytes(self.trainer.optimizer)
        result = {
            "model": {"hidden": m.hidden, "layers": m.layers, "heads": m.heads, "vocab": m.vocab, "seq": m.seq,
                      "micro_batch_size": m.micro_batch_size, "micro_batches": m.micro_batches,
                      "precision": m.precision, "parameters": self.n_params(),
                      "param_tensors": sum(len(g["params"]) for g in self.trainer.optimizer.param_groups),
                      "model_optimizer_state_bytes": state_bytes, "gradient_bytes": grad_bytes,
                      "held_state_bytes": held_bytes},
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
                "host_reads_per_step": total_count(self.reads[v]) / len(self.reads[v]),
                "host_reads_per_step_by_method": merged_counts(self.reads[v]),
                "host_reads_per_checked_step": (total_count(self.reads[v]) - total_count(self.reads["A"])) / checked,
                "host_reads_in_hooks_per_checked_step": total_count(self.in_hooks[v]) / checked,
                "host_reads_in_hooks_by_method": merged_counts(self.in_hooks[v]),
                "gradient_bytes_read_per_step": sum(self.grad_reads[v]) / len(self.grad_reads[v]),
                "read_passes_per_step": sum(self.grad_reads[v]) / len(self.grad_reads[v]) / grad_bytes,
                "extra_read_passes_per_checked_step":
                    (sum(self.grad_reads[v]) - sum(self.grad_reads["A"])) / grad_bytes / checked,
                # The weights the optimizer steps and their moments, in the same unit (the audit's reads).
                "extra_state_read_passes_per_checked_step":
                    (sum(self.state_reads[v]) - sum(self.state_reads["A"])) / grad_bytes / checked,
                # The same bytes over the held state's own (issue 56: the held-state check reads a
                # rotating share of it; the optimizer's update reads it in every variant alike).
                "extra_held_state_read_passes_per_checked_step":
                    (sum(self.state_reads[v]) - sum(self.state_reads["A"])) / held_bytes / checked,
                # Where they are read: in each of the guard's hooks, and outside them ("-", where
                # Megatron's own norm pass, absent when the guard serves it, shows as a difference).
                "read_passes_per_step_by_hook": {k: n / len(self.grad_reads[v]) / grad_bytes for k, n in
                                                 sorted(sum(self.grad_reads_by_hook[v], Counter()).items())},
            })
            calls = self.torch_calls[v]
            entry.update({
                # Torch functions and Tensor methods called from the package's frames (TorchCallCounter).
                # Minus variant A's: the harness's own calls into the package's helpers
                # (collectives' loss average, the RNG state's clone), made unguarded too.
                "torch_calls_per_checked_step":
                    (sum(c.calls for c in calls) - sum(c.calls for c in self.torch_calls["A"])) / checked,
                "torch_calls_per_step": sum(c.calls for c in calls) / len(calls),
                "torch_attribute_reads_per_checked_step":
                    (sum(c.attributes for c in calls) - sum(c.attributes for c in self.torch_calls["A"])) / checked,
                "torch_calls_by_name": {k: n / len(calls) for k, n in
                                        sum((c.by_name for c in calls), Counter()).most_common()},
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
    device = tiny_gpt.init_distributed(tiny_gpt.parse_args(["--no-guard"]))  # CPU runtime + gloo without a GPU
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
        wrappers.set_monitor(None)
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
    from megatron_patches.files import write_json_atomic

    write_json_atomic(path, result, indent=1)


if __name__ == "__main__":
    sys.exit(main())
