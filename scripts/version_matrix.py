#!/usr/bin/env python3
"""Measure which features work with which megatron-core release: one venv per release.

    python scripts/version_matrix.py                      # Python 3.11: 0.12.3 ... 0.16.1
    .venv312/bin/python scripts/version_matrix.py         # Python 3.12: 0.17.1 0.18.2 0.19.2
    python scripts/version_matrix.py --versions 0.16.1,0.13.1 --json matrix.json

A release the running Python cannot install (0.17+ need 3.12) is reported as SETUP with the reason.

For each release a venv under ``--cache`` (default ``~/.cache/megatron_patches/version_matrix``)
is made with ``--system-site-packages``; when this script runs inside a venv, that venv's
packages are made visible behind the new one's (a ``.pth`` file), so the installed torch is
reused and nothing large is downloaded. Into it go ``megatron-core==VERSION`` (``--no-deps``:
torch, numpy and packaging come from outside) and this package (editable, ``--no-deps``);
``--numpy1`` adds ``numpy<2`` for releases before 0.16 (their distributed-optimizer checkpoint
code calls ``np.product``). Then each feature's tests run in that venv with pytest, and a table
of PASS / FAIL / ERROR (with seconds) is printed as Markdown.

Features and the tests that measure them (real tiny-GPT trainings on CPU, see tests/):

- install: ``tests/units/test_patching.py`` (every registry target wraps and unwraps)
- detection: a NaN in fp32 training caught before clipping and the step skipped
- names: TP=2, the NaN named on tensor-parallel rank 1 with its layer and shape
- rollback: a persistent fault rolls back in-process to a dist_checkpointing checkpoint
- norm: the guard's total gradient norm equals Megatron's (<= 1e-5) in 1 rank, TP2, PP2, DP2 with
  the distributed optimizer (fp32, bf16) and fp16 DP2
- loop_drill, loop_restart (0.17+): Megatron-LM's own loop from the wheel names a NaN at its
  iteration; a persistent fault exits 84 and the launcher resumes from the healthy checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from megatron_patches import versions  # noqa: E402  (standard library only)
DEFAULT_VERSIONS = ("0.12.3", "0.13.1", "0.14.0", "0.15.3", "0.16.1") if sys.version_info < (3, 12) \
    else ("0.17.1", "0.18.2", "0.19.2")
_LOOP = "tests/trainings/test_megatron_lm_"
FEATURES = {
    "install": ["tests/units/test_patching.py"],
    "detection": ["tests/trainings/test_detection.py::test_fp32_nan_named_and_skipped"],
    "names": ["tests/trainings/test_detection.py::test_tp2_nan_on_tensor_parallel_rank_1"],
    "rollback": ["tests/trainings/test_recovery.py::test_persistent_fault_rolls_back_with_lower_lr_and_blacklist"],
    "norm": ["tests/trainings/test_training.py::test_single_rank_fp32_trains", "tests/trainings/test_training.py::test_parallel_layouts_train"],
    "loop_drill": [f"{_LOOP}origin.py::test_pretrain_gpt_names_the_parameter_at_megatrons_iteration[package]"],
    "loop_restart": [f"{_LOOP}restart.py::test_persistent_fault_exits_84_and_the_launcher_resumes_from_the_healthy_checkpoint[package]"],
}
PROBE = ("import json, importlib.metadata as m, megatron.core, megatron_patches, numpy, torch; "
         "print(json.dumps({'megatron_core': m.version('megatron-core'), 'core_file': megatron.core.__file__, "
         "'package_file': megatron_patches.__file__, 'torch': torch.__version__, 'numpy': numpy.__version__}))")


def say(message: str) -> None:
    print(f"[version_matrix] {message}", file=sys.stderr, flush=True)


def run(cmd: list, timeout: int, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def make_venv(venv: Path, version: str, numpy1: bool) -> dict:
    """Create (or reuse) the venv for ``version``; returns what it imports (``PROBE``)."""
    python = venv_python(venv)
    if not python.exists():
        say(f"{version}: creating {venv}")
        proc = run([sys.executable, "-m", "venv", "--system-site-packages", venv], 300)
        if proc.returncode:
            raise RuntimeError(f"venv failed: {proc.stderr.strip()[-500:]}")
        if sys.prefix != sys.base_prefix:  # we run in a venv: its packages (torch...) go behind the new one's
            purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 60).stdout.strip()
            parent = sysconfig.get_paths()["purelib"]
            Path(purelib, "_version_matrix_parent.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    packages = [f"megatron-core=={version}"] + (["numpy<2"] if numpy1 else [])
    probe = run([python, "-c", PROBE], 300)
    current = json.loads(probe.stdout) if probe.returncode == 0 else {}
    own = current.get("megatron_core") == version and Path(current.get("core_file", "/")).is_relative_to(venv)
    if not own or (numpy1 and not current.get("numpy", "2").startswith("1.")):
        say(f"{version}: pip install --no-deps --ignore-installed {' '.join(packages)}")
        # --ignore-installed: the same release seen through the parent venv must not satisfy it.
        proc = run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed", *packages], 900)
        if proc.returncode:
            raise RuntimeError(f"pip install {' '.join(packages)} failed: {proc.stderr.strip()[-800:]}")
    if not Path(run([python, "-c", "import megatron_patches; print(megatron_patches.__file__)"], 120)
                .stdout.strip() or "/").is_relative_to(REPO):
        proc = run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", REPO], 900)
        if proc.returncode:
            raise RuntimeError(f"pip install -e {REPO} failed: {proc.stderr.strip()[-800:]}")
    probe = run([python, "-c", PROBE], 300)
    if probe.returncode:
        raise RuntimeError(f"imports fail in {venv}: {probe.stderr.strip()[-800:]}")
    seen = json.loads(probe.stdout)
    if seen["megatron_core"] != version or not Path(seen["core_file"]).is_relative_to(venv):
        raise RuntimeError(f"{venv} imports megatron-core {seen['megatron_core']} from {seen['core_file']}")
    return seen


def run_feature(venv: Path, tests: list, timeout: int) -> tuple[str, float, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_PATCHES_CONFIG")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    started = time.time()
    try:
        proc = run([venv_python(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], timeout,
                   cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", time.time() - started, f"over {timeout} s"
    seconds = time.time() - started
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = tail[-1] if tail else ""
    status = {0: "PASS", 1: "FAIL", 5: "NO TESTS"}.get(proc.returncode, "ERROR")
    if status == "PASS" and "skipped" in summary and "passed" not in summary:
        status = "SKIP"
    return status, seconds, "\n".join(tail[-25:]) if status != "PASS" else summary


def table(rows: list[dict], features: list[str]) -> str:
    head = "| megatron-core | torch | numpy | " + " | ".join(features) + " |"
    lines = [head, "|" + " --- |" * (3 + len(features))]
    for row in rows:
        cells = [f"{row['results'][f]['status']} ({row['results'][f]['seconds']:.0f} s)" if f in row["results"] else "-"
                 for f in features]
        lines.append(f"| {row['version']} | {row.get('torch', '-')} | {row.get('numpy', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=",".join(DEFAULT_VERSIONS),
                        help="comma-separated megatron-core releases (default: newest patch of 0.12-0.16)")
    parser.add_argument("--features", default=",".join(FEATURES), help=f"subset of {', '.join(FEATURES)}")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/megatron_patches/version_matrix"),
                        help="where the venvs live (reused between runs)")
    parser.add_argument("--numpy1", action="store_true", help="install numpy<2 for releases before 0.16")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per feature (default 900)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    features = [f.strip() for f in args.features.split(",") if f.strip()]
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        parser.error(f"unknown feature {unknown[0]!r}; valid: {', '.join(FEATURES)}")
    rows = []
    for version in [v.strip() for v in args.versions.split(",") if v.strip()]:
        row: dict = {"version": version, "results": {}}
        rows.append(row)
        numpy1 = args.numpy1 and tuple(int(x) for x in version.split(".")[:2]) < (0, 16)
        reason = versions.problem(version)
        if reason:
            say(f"{version}: {reason}")
            row["results"] = {f: {"status": "SETUP", "seconds": 0.0, "detail": reason} for f in features}
            continue
        try:
            row.update(make_venv(Path(args.cache) / f"megatron-core-{version}", version, numpy1))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            say(f"{version}: setup failed: {exc}")
            row["results"] = {f: {"status": "SETUP", "seconds": 0.0, "detail": str(exc)} for f in features}
            continue
        say(f"{version}: torch {row['torch']}, numpy {row['numpy']}, core from {row['core_file']}")
        for feature in features:
            status, seconds, detail = run_feature(Path(args.cache) / f"megatron-core-{version}",
                                                  FEATURES[feature], args.timeout)
            row["results"][feature] = {"status": status, "seconds": seconds, "detail": detail}
            say(f"{version} {feature}: {status} ({seconds:.0f} s)" + ("" if status == "PASS" else f"\n{detail}"))
    print(table(rows, features))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["status"] == "PASS" for row in rows for r in row["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
