#!/usr/bin/env python3
"""The device check a session runs at once when it is lent an accelerator (``scripts/gpu_check.sh``).

Each check is a real run of the tiny-GPT harness (``python -m megatron_patches.tiny_gpt``, under
torchrun for several ranks), bounded in time, its output kept in the results folder:

- ``environment``: torch, CUDA and NCCL versions, the device, whether Transformer Engine imports;
- ``guard_on_off``: bf16, distributed optimizer, data parallel over every device (2 on CPU): the
  same run without and with the guard; the largest relative loss difference is measured, not judged;
- ``drill_<kind>``: a NaN and an Inf in one weight's gradient (one run, steps 3 and 5), a x1e4
  spike (a run of its own: a third incident within ``recur_window`` would be graded an error),
  and a NaN in rank 1's own gradient before the reduction (two ranks): each must be caught once
  at its step, named, skipped, the run finishing;
- ``fp16_clean``: fp16 from Megatron's initial loss scale 2^32: no incident;
- ``bench``: ``scripts/bench_overhead.py`` on the small and large sizes (device runs only).

``--dry-run`` runs the same checks on the CPU with gloo and fewer steps (CI runs it, so the script
does not rot); ``bench`` is skipped there. Results: ``summary.json`` and ``summary.txt`` in
``--out``; the exit code is 0 when every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WEIGHT = "decoder.layers.1.mlp.linear_fc1.weight"
DRILL_RUNS = [
    ("drills", 1, {"drill_nan": f"nan:step=3,param={WEIGHT}", "drill_inf": f"inf:step=5,param={WEIGHT}"}),
    ("drill_spike", 1, {"drill_spike": f"spike:step=5,param={WEIGHT},factor=1e4"}),
    ("drill_local_nan_rank1", 2, {"drill_local_nan_rank1": f"nan:step=5,rank=1,phase=local,param={WEIGHT}"}),
]
"""(folder, ranks, {check: drill}). At most two drills a run, on steps apart: under the default
grading each stays a warning, so each fault is judged on its own."""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu_check", help="results folder (default runs/gpu_check)")
    p.add_argument("--dry-run", action="store_true", help="on the CPU with gloo, fewer steps, no bench")
    p.add_argument("--step-timeout", type=int, default=150, help="seconds one run may take (default 150)")
    args = p.parse_args(argv)
    if args.step_timeout < 1:
        p.error(f"--step-timeout must be >= 1, got {args.step_timeout}")
    return args


def environment(dry_run: bool) -> dict:
    import torch

    cuda = torch.cuda.is_available() and not dry_run
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": "cpu", "devices": 0,
            "nccl": None, "transformer_engine": None, "dry_run": dry_run}
    if cuda:
        info.update(device=torch.cuda.get_device_name(0), devices=torch.cuda.device_count(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    try:
        import transformer_engine  # noqa: F401

        info["transformer_engine"] = getattr(transformer_engine, "__version__", "importable")
    except Exception as error:  # absent, or present and broken: both are facts worth keeping
        info["transformer_engine"] = f"not importable ({type(error).__name__})"
    return info


class Runner:
    def __init__(self, out: Path, ranks: int, timeout: int, env: dict):
        self.out, self.ranks, self.timeout, self.env = out, ranks, timeout, env

    def harness(self, name: str, *flags: str, ranks: int = 1) -> tuple[int, dict, list]:
        """One harness run in ``out/name``: (exit code, result.json or {}, incident records)."""
        folder = self.out / name
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                    if ranks > 1 else [sys.executable])
        command = [*launcher, "-m", "megatron_patches.tiny_gpt", "--out", str(folder), *flags]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=self.timeout, cwd=REPO, env=self.env)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as expired:
            code, output = 124, f"timed out after {self.timeout} s\n{expired.stdout or ''}{expired.stderr or ''}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "output.txt").write_text(output if isinstance(output, str) else output.decode(errors="replace"))
        result = json.loads((folder / "result.json").read_text()) if (folder / "result.json").exists() else {}
        records = folder / "incidents.jsonl"
        incidents = [json.loads(line) for line in records.read_text().splitlines() if line.strip()] \
            if records.exists() else []
        return code, result, incidents


def guard_on_off(run: Runner, steps: int) -> dict:
    flags = ("--precision", "bf16", "--distributed-optimizer", "--steps", str(steps))
    off_code, off, _ = run.harness("guard_off", *flags, "--no-guard", ranks=run.ranks)
    on_code, on, found = run.harness("guard_on", *flags, ranks=run.ranks)
    if off_code or on_code or not off.get("losses") or not on.get("losses"):
        return {"passed": False, "why": f"exit codes {off_code} (off), {on_code} (on)"}
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(on["losses"], off["losses"])]
    return {"passed": not found and len(on["losses"]) == len(off["losses"]), "incidents": len(found),
            "max_rel_loss_diff": max(diffs), "bit_identical": max(diffs) == 0.0, "steps": len(diffs)}


def drill_run(run: Runner, folder: str, ranks: int, drills: dict, steps: int) -> dict:
    """One run with ``drills``; a check per drill: one incident at its step naming the weight (and,
    for a rank's own gradient, that rank as the origin), the run finishing with finite weights."""
    flags = [flag for spec in drills.values() for flag in ("--inject", spec)]
    code, result, found = run.harness(folder, "--steps", str(steps), *flags, ranks=ranks)
    finished = code == 0 and result.get("params_finite") is True and len(found) == len(drills)
    checks = {}
    for name, spec in drills.items():
        fields = dict(part.split("=", 1) for part in spec.split(":", 1)[1].split(","))
        step = int(fields["step"])
        named = [(r.get("step"), (r.get("first") or {}).get("name"), r.get("origin_ranks")) for r in found
                 if r.get("step") == step]
        passed = finished and len(named) == 1 and named[0][:2] == (step, WEIGHT)
        if fields.get("phase") == "local":
            passed = passed and named[0][2] == [int(fields["rank"])]
        checks[name] = {"passed": passed, "exit": code, "incidents": named, "run": folder}
    return checks


def fp16_clean(run: Runner, steps: int) -> dict:
    code, result, found = run.harness("fp16_clean", "--precision", "fp16", "--steps", str(steps))
    return {"passed": code == 0 and not found and result.get("params_finite") is True, "exit": code,
            "skipped_steps": result.get("skipped_steps"), "incidents": len(found)}


def bench(out: Path, timeout: int, env: dict) -> dict:
    command = [sys.executable, str(REPO / "scripts" / "bench_overhead.py"), "--sizes", "small,large",
               "--steps", "10", "--dp2-sizes", "", "--out", str(out / "bench.json")]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"passed": False, "why": f"timed out after {timeout} s"}
    (out / "bench.txt").write_text(proc.stdout + proc.stderr)
    return {"passed": proc.returncode == 0, "exit": proc.returncode, "json": str(out / "bench.json")}


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    env.pop("MEGATRON_PATCHES_CONFIG", None)
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    info = environment(args.dry_run)
    run = Runner(out, max(2, info["devices"]), args.step_timeout, env)
    steps = 12 if args.dry_run else 40
    checks: dict = {"environment": {"passed": True, **info}}
    plan = [("guard_on_off", lambda: {"guard_on_off": guard_on_off(run, steps)})]
    plan += [(folder, lambda f=folder, r=ranks, d=drills: drill_run(run, f, r, d, 8))
             for folder, ranks, drills in DRILL_RUNS]
    plan += [("fp16_clean", lambda: {"fp16_clean": fp16_clean(run, 40 if args.dry_run else 100)})]
    if not args.dry_run:
        plan.append(("bench", lambda: {"bench": bench(out, 3 * args.step_timeout, env)}))
    for name, check in plan:
        started = time.monotonic()
        print(f"[gpu_check] {name} ...", flush=True)
        done = check()
        seconds = round(time.monotonic() - started, 1)
        for key, result in done.items():
            checks[key] = {**result, "seconds": seconds}
            print(f"[gpu_check] {key}: {'PASS' if result['passed'] else 'FAIL'} ({seconds} s)", flush=True)
    failed = [name for name, check in checks.items() if not check["passed"]]
    (out / "summary.json").write_text(json.dumps(checks, indent=1, default=str))
    lines = [f"{name}: {'PASS' if c['passed'] else 'FAIL'} " + json.dumps({k: v for k, v in c.items() if k != 'passed'},
             default=str) for name, c in checks.items()]
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"[gpu_check] {len(checks) - len(failed)} passed, {len(failed)} failed -> {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
