#!/usr/bin/env python3
"""The guard's fixed per-step cost through Megatron-LM's packaged loop: guarded vs ``--no-guard``.

    python scripts/bench_loop_cost.py --out loop_cost.json        (megatron-core 0.17+; ~3 minutes here)

Runs the tiny GPT under torchrun on ``--nproc`` CPU ranks (2: DP2), bf16 with the distributed
optimizer, ``--iters`` iterations, unguarded and guarded (default config) interleaved ``--pairs``
times. Per run: the median of Megatron's own "elapsed time per iteration (ms)" from iteration 21
on. Reported: each run's median, the median of the paired differences (guarded - unguarded) in ms
and in % of the unguarded step, and the issue-41 limit (the larger of 1 ms and 1 % of the step).
A timing on a shared machine: run it when nothing else runs.

``--profile`` adds one guarded run sampled by py-spy (``pip install py-spy``; not a dependency):
of the samples taken inside Megatron's ``train``, the share whose innermost frame of ours or of
Megatron's is ours (torch's and the CPU test runtime's frames are passed over, so a torch call
the guard makes counts as the guard's), per guard function, and that share in ms of the guarded
step. Sampling slows the run; the shares, not its step times, are the result.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS  # noqa: E402

STEP_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
FLAGS = ["--bf16", "--use-distributed-optimizer"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="loop_cost.json", help="JSON output (default loop_cost.json)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved (unguarded, guarded) pairs (default 3)")
    p.add_argument("--iters", type=int, default=120, help="iterations per run, > 30 (default 120)")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    p.add_argument("--profile", action="store_true", help="also attribute the guarded step's samples with py-spy")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs must be >= 1, got {args.pairs}")
    if args.iters <= 30:
        p.error(f"--iters must be > 30 (the first 20 are not timed), got {args.iters}")
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.profile and py_spy() is None:
        p.error("--profile needs py-spy (pip install py-spy) beside this Python or on PATH")
    return args


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def one_run(where: Path, iters: int, nproc: int, guarded: bool, sampled: bool = False) -> float:
    """Median of Megatron's per-iteration ms from iteration 21 on, for one job (``sampled``: under
    py-spy, its samples in ``where/samples.txt``)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "guard.yaml").write_text(json.dumps({"report_dir": str(where / "reports")}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megatron_patches.testing.pretrain_cpu", *TINY_GPT_ARGS, "--train-iters", str(iters), *FLAGS,
               *(() if guarded else ("--no-guard",))]
    if sampled:
        command = [py_spy(), "record", "--rate", "200", "--subprocesses", "--format", "raw",
                   "--output", str(where / "samples.txt"), "--", *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MEGATRON_PATCHES_CONFIG": str(where / "guard.yaml")}
    proc = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench_loop_cost: the run in {where} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    times = [float(ms) for i, ms in STEP_MS.findall(proc.stdout) if int(i) > 20]
    if not times:
        raise SystemExit(f"bench_loop_cost: no iteration times in the output of {where}")
    return statistics.median(times)


_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):\d+\)$")


def attribute(samples: Path) -> tuple[float, list[tuple[str, float]]]:
    """(the guard's share of the samples inside Megatron's ``train``, in %; per guard function,
    its share, largest first) from py-spy's raw output."""
    inside, guard = 0, collections.Counter()
    for line in samples.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_FRAME.match(f) for f in stack.split(";") if not f.startswith("process ")]
        frames = [(m["func"], m["file"]) for m in frames if m]
        if not any(func == "train" and file.startswith("training/") for func, file in frames):
            continue
        inside += int(count)
        for func, file in reversed(frames):
            if file.startswith("megatron_patches/") and not file.startswith("megatron_patches/testing/"):
                guard[f"{file}:{func}"] += int(count)
                break
            if file.startswith(("core/", "training/")):
                break
    if not inside:
        raise SystemExit(f"bench_loop_cost: no samples inside Megatron's train in {samples}")
    return 100 * sum(guard.values()) / inside, [(name, 100 * n / inside) for name, n in guard.most_common()]


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    medians: dict[str, list[float]] = {"unguarded": [], "guarded": []}
    profile = None
    with tempfile.TemporaryDirectory(prefix="megatron_patches_loop_cost_") as root:
        for pair in range(args.pairs):
            for name in ("unguarded", "guarded"):
                print(f"[bench_loop_cost] pair {pair + 1}/{args.pairs}: {name}, {args.iters} iterations",
                      file=sys.stderr, flush=True)
                medians[name].append(one_run(Path(root) / f"{name}{pair}", args.iters, args.nproc, name == "guarded"))
        if args.profile:
            print("[bench_loop_cost] one guarded run sampled by py-spy", file=sys.stderr, flush=True)
            one_run(Path(root) / "sampled", args.iters, args.nproc, True, sampled=True)
            share, functions = attribute(Path(root) / "sampled" / "samples.txt")
            profile = {"guard_share_pct": round(share, 1),
                       "guard_ms_of_guarded_step": round(share / 100 * statistics.median(medians["guarded"]), 2),
                       "functions_pct": [[name, round(pct, 2)] for name, pct in functions[:15]]}
    diffs = [g - u for u, g in zip(medians["unguarded"], medians["guarded"])]
    step = statistics.median(medians["unguarded"])
    cost = statistics.median(diffs)
    limit = max(1.0, 0.01 * step)
    result = {"ranks": args.nproc, "iterations": args.iters, "pairs": args.pairs, "flags": FLAGS,
              "step_ms_unguarded": medians["unguarded"], "step_ms_guarded": medians["guarded"],
              "guard_ms_per_step": round(cost, 2), "guard_pct_of_step": round(100 * cost / step, 2),
              "limit_ms": round(limit, 2), "met": cost <= limit, **({"profile": profile} if profile else {})}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"unguarded step {step:.1f} ms (medians {medians['unguarded']}), guarded {medians['guarded']}: "
          f"the guard adds {cost:+.2f} ms per step ({100 * cost / step:+.1f} %); limit {limit:.2f} ms: "
          f"{'met' if cost <= limit else 'missed'} -> {args.out}")
    if profile:
        print(f"sampled: the guard's frames hold {profile['guard_share_pct']} % of the samples inside train "
              f"(~{profile['guard_ms_of_guarded_step']} ms of the guarded step); by function:")
        for name, pct in profile["functions_pct"]:
            print(f"  {pct:5.2f} %  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
