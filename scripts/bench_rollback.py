#!/usr/bin/env python3
"""A persistent fault rolled back in process vs by a restart, and what the snapshots cost, in one run.

    python scripts/bench_rollback.py --out bench_rollback.json      (make bench-rollback; ~4 minutes here)

Megatron-LM's packaged loop (megatron-core 0.17+) under torchrun, 2 CPU ranks, the tiny GPT,
bf16 with the distributed optimizer, ``--save-interval 100``, ``recovery.snapshot_interval`` 5:

- **recovery**: rank 1's own gradient NaN at iterations F and F+1 (a skip, then a rollback), once
  with ``recovery.mode: in_process`` and once with ``restart`` under ``scripts/restart_on_rollback.py``.
  For each: how far back it went (the decision's iteration minus the one resumed from), the
  iterations trained again (those left out under ``blacklist: always`` not counted), and the
  seconds from the decision to the first iteration after it. In process: the redo's own timing.
  Restart: from the last iteration logged before the exit to the first one logged after the load,
  less one iteration's median time (the iteration the decision cut short).
- **snapshot cost**: clean runs of ``--iters`` iterations, in_process (snapshots every 5) and restart
  (none) interleaved ``--pairs`` times; the medians of Megatron's per-iteration times from iteration
  21 on, and their ratio; beside them, measured in the process, the time rank 0 spent inside the
  snapshot copies per snapshot and per iteration (the line the in-process run prints at exit) and
  its share of the step; the host memory one snapshot holds per rank (the same line); the copy
  rate of this machine for 1 GiB (``torch.Tensor.copy_`` into a preallocated host buffer, as a
  snapshot reuses its buffers).
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS  # noqa: E402

STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per "
                   r"iteration \(ms\): ([\d.]+)")
REDONE = re.compile(r"to the snapshot of iteration (\d+) and redid (\d+) iteration\(s\) in ([\d.]+) s")
SNAPSHOT = re.compile(r"([\d.]+) MiB per snapshot on rank 0")
COPIES = re.compile(r"in-memory snapshots: (\d+) taken in (\d+) iterations, ([\d.]+) ms inside the copy per "
                    r"snapshot, ([\d.]+) ms per iteration")
FLAGS = ["--bf16", "--use-distributed-optimizer", "--save-interval", "100"]


def say(message: str) -> None:
    print(f"[bench_rollback] {message}", file=sys.stderr, flush=True)


def run(where: Path, iters: int, mode: str, drill: str | None, launcher: bool) -> tuple[str, float]:
    """One job (under the restart launcher when ``launcher``); its whole output and wall seconds."""
    where.mkdir(parents=True, exist_ok=True)
    config = where / "guard.yaml"
    config.write_text(json.dumps({"report_dir": str(where / "reports"), "inject": [drill] if drill else [],
                                  "recovery": {"mode": mode, "snapshot_interval": 5}}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "megatron_patches.testing.pretrain_cpu", *TINY_GPT_ARGS, "--train-iters", str(iters),
               "--save", str(where / "ckpt"), "--load", str(where / "ckpt"), *FLAGS]
    if launcher:
        command = [sys.executable, str(REPO / "scripts" / "restart_on_rollback.py"), "--max-restarts", "2", "--",
                   *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PATCHES_CONFIG": str(config)}
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench_rollback: the {mode} run in {where} exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return proc.stdout, time.perf_counter() - started


def iteration_times(output: str) -> list[tuple[float, int, float]]:
    """(wall clock, iteration, Megatron's ms) of each logged iteration, in log order."""
    from datetime import datetime

    return [(datetime.fromisoformat(m.group(1)).timestamp(), int(m.group(2)), float(m.group(3)))
            for m in STAMP.finditer(output)]


def recovery(root: Path, fault: int) -> dict:
    drill = f"nan:step={fault},count=2,rank=1,phase=local,param=decoder.layers.1.mlp.linear_fc1.weight"
    iters = fault + 10
    say(f"in-process rollback of a fault at iterations {fault}-{fault + 1} ({iters} iterations)")
    output, wall = run(root / "in_process", iters, "in_process", drill, launcher=False)
    redone = REDONE.search(output)
    if redone is None:
        raise SystemExit("bench_rollback: the in-process run made no rollback in process:\n" + output[-3000:])
    decided = fault + 1  # the second faulty iteration is the rollback's
    in_process = {"resumed_from": int(redone.group(1)), "iterations_back": decided - int(redone.group(1)),
                  "trained_again": int(redone.group(2)), "decision_to_resumed_s": float(redone.group(3)),
                  "job_wall_s": round(wall, 1)}
    say("the same fault rolled back by exit 84 and a restart")
    output, wall = run(root / "restart", iters, "restart", drill, launcher=True)
    first, second = output.split("[restart_on_rollback] attempt 2:")
    before, after = iteration_times(first), iteration_times(second)
    resumed_from = int(re.search(r"resumed from healthy checkpoint iteration (\d+)", second).group(1))
    step_s = statistics.median(ms for _, _, ms in before[5:]) / 1000
    restart = {"resumed_from": resumed_from, "iterations_back": decided - resumed_from,
               "trained_again": sum(1 for _, i, _ in after if i <= decided),
               "decision_to_resumed_s": round(after[0][0] - before[-1][0] - step_s, 2), "job_wall_s": round(wall, 1)}
    return {"fault_at": fault, "in_process": in_process, "restart": restart}


def snapshot_cost(root: Path, iters: int, pairs: int) -> dict:
    medians: dict[str, list] = {"in_process": [], "restart": []}
    megabytes, copies = None, []
    for pair in range(pairs):
        for mode in ("in_process", "restart"):
            say(f"clean run {pair + 1}/{pairs}, {mode} ({iters} iterations)")
            output, _ = run(root / f"clean_{mode}_{pair}", iters, mode, None, launcher=False)
            medians[mode].append(statistics.median(ms for _, i, ms in iteration_times(output) if i > 20))
            found = SNAPSHOT.search(output)
            megabytes = float(found.group(1)) if found else megabytes
            if mode == "in_process":
                found = COPIES.search(output)
                if found is None:
                    raise SystemExit("bench_rollback: no line of the snapshots' cost in the in_process run:\n"
                                     + output[-3000:])
                copies.append({"snapshots": int(found.group(1)), "iterations": int(found.group(2)),
                               "ms_per_snapshot": float(found.group(3)), "ms_per_iteration": float(found.group(4))})
    with_snapshots, without = statistics.median(medians["in_process"]), statistics.median(medians["restart"])
    per_iteration = statistics.median(c["ms_per_iteration"] for c in copies)
    return {"step_ms_with_snapshots": with_snapshots, "step_ms_without": without,
            "overhead_pct": round(100 * (with_snapshots / without - 1), 2), "pairs": medians,
            # Measured inside the process (rank 0's time in SnapshotStore.take): load on the machine
            # slows the copies it times, but cannot swamp them as it does the whole-run pairs above.
            "copy_ms_per_snapshot": statistics.median(c["ms_per_snapshot"] for c in copies),
            "copy_ms_per_iteration": per_iteration,
            "copy_pct_of_step": round(100 * per_iteration / without, 3), "copies": copies,
            "snapshot_mib_per_rank": megabytes, "host_copy_s_per_gib": copy_rate()}


def copy_rate() -> float:
    """Seconds to copy 1 GiB into a preallocated host buffer (median of 5)."""
    import torch

    source, target = torch.empty(2**28, dtype=torch.float32), torch.empty(2**28, dtype=torch.float32)
    source.fill_(1.0)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_rollback.json", help="where the figures go (JSON)")
    parser.add_argument("--fault-at", type=int, default=157, help="first faulty iteration (after the save at 100)")
    parser.add_argument("--iters", type=int, default=200, help="iterations of each clean run")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved clean pairs")
    args = parser.parse_args()
    if args.fault_at <= 100 or args.iters <= 20 or args.pairs < 1:
        raise SystemExit("bench_rollback: --fault-at must be > 100 (a disk checkpoint first), --iters > 20, --pairs >= 1")
    with tempfile.TemporaryDirectory(prefix="bench_rollback_") as tmp:
        figures = {"recovery": recovery(Path(tmp), args.fault_at),
                   "snapshots": snapshot_cost(Path(tmp), args.iters, args.pairs)}
    figures["snapshots"]["target_overhead_pct"] = 1.0
    # Judged on the copies' own time: the whole-run pairs spread by more than the target under load.
    figures["snapshots"]["met"] = figures["snapshots"]["copy_pct_of_step"] <= 1.0
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
