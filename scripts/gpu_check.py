#!/usr/bin/env python3
"""The device check a session runs at once when it is lent an accelerator (``scripts/gpu_check.sh``).

Each check is a real run of the tiny-GPT harness (``python -m megatron_patches.tiny_gpt``, under
torchrun for several ranks), bounded in time, its output kept in the results folder:

- ``environment``: torch, CUDA and NCCL versions, the device, whether Transformer Engine imports;
- ``guard_on_off``: bf16, distributed optimizer, data parallel over every device (2 on CPU): the
  same run without and with the guard; the largest relative loss difference is measured, not judged;
- ``drill_<kind>``: a NaN and an Inf in one weight's gradient (a run each, steps 3 and 5), a x1e4
  spike (a run of its own too),
  and a NaN in rank 1's own gradient before the reduction (two ranks): each must be caught once
  at its step, named, skipped, the run finishing;
- ``fp16_clean``: fp16 from Megatron's initial loss scale 2^32: no incident;
- ``bench``: ``scripts/bench_overhead.py`` on the small and large sizes (device runs only);
- ``lm_*`` (megatron-core 0.17+, whose wheel ships Megatron-LM's loop; first, as the most telling):
  the packaged loop on one device, bf16 with the distributed optimizer, every weight and optimizer
  state after every iteration hashed (``testing/step_probe.py``). ``lm_guard_on_off``: guarded
  equals unguarded bit for bit; ``lm_rollback_in_process``: a persistent NaN (two iterations) rolled
  back in process to an in-memory snapshot (on a GPU: pinned buffers, a side stream) and the run
  then equal to the unguarded one bit for bit, with the time the loop was held inside the snapshot
  copies (per snapshot and per iteration), the snapshot's size and the rollback's time; ``lm_step_time``: Megatron's per-iteration times,
  guarded and not, without the probe (medians; measured, not judged), and a second unguarded run's
  losses against the first (is the device deterministic at all?).

A check that needs more devices than there are (a drill of rank 1 on one GPU) is left out and
says so. ``--dry-run`` runs the same checks on the CPU with gloo and fewer steps (CI runs it, so
the script does not rot); ``bench`` is skipped there. Results: ``summary.json`` and
``summary.txt`` in ``--out``; the exit code is 0 when every check that ran passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_patches.testing import step_probe  # noqa: E402
from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS  # noqa: E402

WEIGHT = "decoder.layers.1.mlp.linear_fc1.weight"
DRILL_RUNS = [
    ("drills", 1, {"drill_nan": f"nan:step=3,param={WEIGHT}"}),
    ("drill_inf", 1, {"drill_inf": f"inf:step=5,param={WEIGHT}"}),
    ("drill_spike", 1, {"drill_spike": f"spike:step=5,param={WEIGHT},factor=1e4"}),
    ("drill_local_nan_rank1", 2, {"drill_local_nan_rank1": f"nan:step=5,rank=1,phase=local,param={WEIGHT}"}),
]
"""(folder, ranks, {check: drill}). One drill a run: a gradient fault whose replay is clean is
classed hardware, and the second such fault on one device in a job fences it (exit 88, issue 57), so
each fault is judged on its own under the defaults."""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu_check", help="results folder (default runs/gpu_check)")
    p.add_argument("--dry-run", action="store_true", help="on the CPU with gloo, fewer steps, no bench")
    p.add_argument("--step-timeout", type=int, default=150, help="seconds one run may take (default 150)")
    p.add_argument("--only", default="", help="comma-separated checks to run (megatron_lm, guard_on_off, drills, "
                   "drill_spike, drill_local_nan_rank1, fp16_clean, bench); default all")
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


LM_FLAGS = ("--bf16", "--use-distributed-optimizer", "--save-interval", "1000")
LM_EXACT = {"recovery": {"mode": "in_process", "lr_factor": 1, "blacklist": "deterministic", "snapshot_interval": 5}}
"""A rollback that changes nothing but the iterations redone (as tests/trainings/test_rollback_in_process.py)."""
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([^ |]+).*?")
REDONE_LOSS = re.compile(r"\[megatron_patches\] redone iteration\s+(\d+)/\s*\d+ \| lm loss: ([^ |]+)")
STEP_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
ROLLED = re.compile(r"rolled back in process to the snapshot of iteration (\d+) and redid (\d+) iteration\(s\) "
                    r"in ([\d.]+) s")
SNAPSHOT_MIB = re.compile(r"([\d.]+) MiB per snapshot on rank 0")
SNAPSHOT_MS = re.compile(r"([\d.]+) ms inside the copy per snapshot, ([\d.]+) ms per iteration")
"""The in-process executor's line at exit: the time the loop was held inside the snapshot copies
(on a GPU: the pinned buffers' first allocation and the copies queued on the side stream)."""


class LoopRunner:
    """Megatron-LM's packaged loop (``python -m megatron_patches.testing.pretrain_cpu``) on one rank."""

    def __init__(self, out: Path, timeout: int, env: dict, on_gpu: bool):
        self.out, self.timeout, self.env = out, timeout, env
        self.backend = ("--distributed-backend", "nccl") if on_gpu else ()

    def __call__(self, name: str, iters: int, guard: dict | None, probe: bool) -> dict:
        folder = self.out / name
        shutil.rmtree(folder, ignore_errors=True)  # a checkpoint or ledger left by an earlier check resumes it
        folder.mkdir(parents=True)
        env = dict(self.env)
        if guard is not None:
            (folder / "guard.yaml").write_text(json.dumps({"report_dir": str(folder / "reports"), **guard}))
            env["MEGATRON_PATCHES_CONFIG"] = str(folder / "guard.yaml")
        if probe:
            env[step_probe.ENV] = str(folder / "probe")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                   "-m", "megatron_patches.testing.pretrain_cpu", *TINY_GPT_ARGS, *self.backend,
                   "--train-iters", str(iters), "--save", str(folder / "ckpt"), "--load", str(folder / "ckpt"),
                   *LM_FLAGS, *(() if guard is not None else ("--no-guard",))]
        try:
            proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=self.timeout, cwd=REPO, env=env)
            code, output = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as expired:
            code, output = 124, f"timed out after {self.timeout} s\n{expired.stdout or ''}"
        output = output if isinstance(output, str) else output.decode(errors="replace")
        (folder / "output.txt").write_text(output)
        losses = {int(i): loss for i, loss in LOSS.findall(output)}
        losses.update({int(i): loss for i, loss in REDONE_LOSS.findall(output)})  # a redone iteration's wins
        probes = step_probe.read(folder / "probe") if probe and (folder / "probe").exists() else {}
        after = {line["iteration"]: (line["weights"], line["state"]) for line in probes.get(0, [])}  # a redo's wins
        records = folder / "reports" / "incidents.jsonl"
        found = [json.loads(line) for line in records.read_text().splitlines() if line.strip()] \
            if records.exists() else []
        return {"code": code, "output": output, "losses": losses, "after": after, "incidents": found,
                "step_ms": [float(ms) for i, ms in STEP_MS.findall(output) if int(i) > 10]}


def megatron_lm_checks(loop: LoopRunner, iters: int) -> dict:
    """The packaged loop's three checks (see the module): five runs of one rank."""
    fault = iters // 2 + 2  # past a snapshot (every 5) and the clean check that certifies it
    off = loop("lm_guard_off", iters, None, probe=True)
    on = loop("lm_guard_on", iters, LM_EXACT, probe=True)
    drill = f"nan:step={fault},count=2,param=decoder.layers.1.mlp.linear_fc1.weight"
    rolled = loop("lm_rollback", iters, {**LM_EXACT, "inject": [drill]}, probe=True)
    timed_off = loop("lm_time_off", 3 * iters, None, probe=False)
    timed_on = loop("lm_time_on", 3 * iters, LM_EXACT, probe=False)
    exits = {name: run["code"] for name, run in
             [("off", off), ("on", on), ("rollback", rolled), ("time_off", timed_off), ("time_on", timed_on)]}

    def why(*runs: dict) -> str:
        return " | ".join(r["output"][-1500:] for r in runs if r["code"])

    on_off = {"passed": off["code"] == on["code"] == 0 and len(off["after"]) == iters
              and on["after"] == off["after"] and on["losses"] == off["losses"] and not on["incidents"],
              "iterations": len(on["after"]), "probes_equal": on["after"] == off["after"],
              "losses_equal": on["losses"] == off["losses"], "incidents": len(on["incidents"]), "exits": exits,
              "why": why(off, on)}
    seen = ROLLED.search(rolled["output"])
    actions = [(i.get("step"), i.get("action")) for i in rolled["incidents"]]
    rollback = {"passed": rolled["code"] == 0 and seen is not None and actions == [(fault, "skip_step"),
                                                                                  (fault + 1, "rollback")]
                and rolled["after"] == off["after"] and rolled["losses"] == off["losses"],
                "incidents": actions, "probes_equal_to_unguarded": rolled["after"] == off["after"],
                "losses_equal_to_unguarded": rolled["losses"] == off["losses"],
                "rolled_back_to": int(seen.group(1)) if seen else None,
                "redone": int(seen.group(2)) if seen else None,
                "decision_to_resumed_s": float(seen.group(3)) if seen else None,
                "snapshot_mib": float(m.group(1)) if (m := SNAPSHOT_MIB.search(rolled["output"])) else None,
                "snapshot_blocking_ms": float(m.group(1)) if (m := SNAPSHOT_MS.search(rolled["output"])) else None,
                "snapshot_blocking_ms_per_iteration": float(m.group(2)) if m else None,
                "why": why(rolled)}
    median = {name: statistics.median(run["step_ms"]) if run["step_ms"] else None
              for name, run in (("off", timed_off), ("on", timed_on))}
    shared = sorted(set(timed_off["losses"]) & set(off["losses"]))
    step_time = {"passed": timed_off["code"] == timed_on["code"] == 0 and None not in median.values(),
                 "median_step_ms_unguarded": median["off"], "median_step_ms_guarded": median["on"],
                 "guard_ms_per_step": round(median["on"] - median["off"], 3) if None not in median.values() else None,
                 "iterations_timed": len(timed_on["step_ms"]),
                 "unguarded_runs_agree_on_losses": [timed_off["losses"][i] for i in shared]
                 == [off["losses"][i] for i in shared] if shared else None,
                 "guarded_losses_equal_unguarded": timed_on["losses"] == timed_off["losses"],
                 "why": why(timed_off, timed_on)}
    return {"lm_guard_on_off": on_off, "lm_rollback_in_process": rollback, "lm_step_time": step_time}


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
    ranks = info["devices"] or 2  # one per GPU; two CPU ranks in a dry run
    run = Runner(out, ranks, args.step_timeout, env)
    steps = 12 if args.dry_run else 40
    checks: dict = {"environment": {"passed": True, **info}}
    plan = []
    if importlib.util.find_spec("megatron.training") is not None:
        loop = LoopRunner(out, args.step_timeout, env, on_gpu=not args.dry_run and info["devices"] > 0)
        plan.append(("megatron_lm", lambda: megatron_lm_checks(loop, 12 if args.dry_run else 40)))
    else:
        print("[gpu_check] megatron_lm: left out (the installed megatron-core ships no megatron/training)")
    plan.append(("guard_on_off", lambda: {"guard_on_off": guard_on_off(run, steps)}))
    for folder, wanted, drills in DRILL_RUNS:
        if wanted > ranks:
            print(f"[gpu_check] {folder}: left out ({wanted} ranks needed, {ranks} device(s))")
            continue
        plan.append((folder, lambda f=folder, r=wanted, d=drills: drill_run(run, f, r, d, 8)))
    plan += [("fp16_clean", lambda: {"fp16_clean": fp16_clean(run, 40 if args.dry_run else 100)})]
    if not args.dry_run:
        plan.append(("bench", lambda: {"bench": bench(out, 3 * args.step_timeout, env)}))
    wanted = {name for name in args.only.split(",") if name}
    known = {"megatron_lm", "guard_on_off", "fp16_clean", "bench", *(folder for folder, _, _ in DRILL_RUNS)}
    if wanted - known:
        raise SystemExit(f"gpu_check: --only names unknown check(s) {sorted(wanted - known)}; known: {sorted(known)}")
    plan = [(name, check) for name, check in plan if not wanted or name in wanted]
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
