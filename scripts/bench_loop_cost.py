#!/usr/bin/env python3
"""The guard's fixed per-step cost through Megatron-LM's packaged loop: guarded vs ``--no-guard``.

    python scripts/bench_loop_cost.py --out loop_cost.json        (megatron-core 0.17+; ~3 minutes here)

Runs the tiny GPT under torchrun on ``--nproc`` CPU ranks (2: DP2), bf16 with the distributed
optimizer, ``--iters`` iterations, unguarded and guarded (default config) interleaved ``--pairs``
times. Per run: the median of Megatron's own "elapsed time per iteration (ms)" from iteration 21
on. Reported: each run's median, the median of the paired differences (guarded - unguarded) in ms
and in % of the unguarded step, and the issue-41 limit (the larger of 1 ms and 1 % of the step).
A timing on a shared machine: run it when nothing else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs must be >= 1, got {args.pairs}")
    if args.iters <= 30:
        p.error(f"--iters must be > 30 (the first 20 are not timed), got {args.iters}")
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    return args


def one_run(where: Path, iters: int, nproc: int, guarded: bool) -> float:
    """Median of Megatron's per-iteration ms from iteration 21 on, for one job."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "guard.yaml").write_text(json.dumps({"report_dir": str(where / "reports")}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megatron_patches.testing.pretrain_cpu", *TINY_GPT_ARGS, "--train-iters", str(iters), *FLAGS,
               *(() if guarded else ("--no-guard",))]
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


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    medians: dict[str, list[float]] = {"unguarded": [], "guarded": []}
    with tempfile.TemporaryDirectory(prefix="megatron_patches_loop_cost_") as root:
        for pair in range(args.pairs):
            for name in ("unguarded", "guarded"):
                print(f"[bench_loop_cost] pair {pair + 1}/{args.pairs}: {name}, {args.iters} iterations",
                      file=sys.stderr, flush=True)
                medians[name].append(one_run(Path(root) / f"{name}{pair}", args.iters, args.nproc, name == "guarded"))
    diffs = [g - u for u, g in zip(medians["unguarded"], medians["guarded"])]
    step = statistics.median(medians["unguarded"])
    cost = statistics.median(diffs)
    limit = max(1.0, 0.01 * step)
    result = {"ranks": args.nproc, "iterations": args.iters, "pairs": args.pairs, "flags": FLAGS,
              "step_ms_unguarded": medians["unguarded"], "step_ms_guarded": medians["guarded"],
              "guard_ms_per_step": round(cost, 2), "guard_pct_of_step": round(100 * cost / step, 2),
              "limit_ms": round(limit, 2), "met": cost <= limit}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"unguarded step {step:.1f} ms (medians {medians['unguarded']}), guarded {medians['guarded']}: "
          f"the guard adds {cost:+.2f} ms per step ({100 * cost / step:+.1f} %); limit {limit:.2f} ms: "
          f"{'met' if cost <= limit else 'missed'} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
