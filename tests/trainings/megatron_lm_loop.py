"""Megatron-LM's training loop for the tests under tests/trainings: the packaged one (megatron-core
0.17+, CI) or a patched copy of a checkout (``MEGATRON_LM_DIR``), the fixtures that pick it
(``loop_kind``, ``megatron_lm_checkout``), and readers of what a run wrote."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, run_packaged_loop
from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS


LAUNCHER = REPO / "scripts" / "restart_on_rollback.py"
PATCH_CLI = REPO / "scripts" / "megatron_patch.py"
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"

# --- Megatron-LM's loop: the packaged one (megatron-core 0.17+, CI) or a checkout (MEGATRON_LM_DIR) ------

TINY = [*TINY_GPT_ARGS, "--train-iters", "6"]
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")


@pytest.fixture(scope="module")
def megatron_lm_checkout(megatron_lm_dir) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git not on PATH: scripts/megatron_patch.py applies the patches with git apply")
    return megatron_lm_dir


def patched_copy(checkout: Path, where: Path, only: str | None) -> Path:
    """A copy of the checkout (never the checkout itself) with our source patches applied:
    all of them, or ``--only pretrain`` (the import line; hooks then come from the runtime wrappers)."""
    copy = where / "Megatron-LM"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "tests", "docs", "examples", "images"))
    subprocess.run([sys.executable, str(PATCH_CLI), "revert", "--megatron", str(copy)], capture_output=True)
    proc = subprocess.run([sys.executable, str(PATCH_CLI), "apply", "--megatron", str(copy),
                           *(["--only", only] if only else [])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return copy


@dataclass
class Loop:
    """Where Megatron-LM's training loop comes from: a patched copy of a checkout, or (``tree`` None)
    the ``megatron/training`` that the installed megatron-core package ships."""

    tree: Path | None
    nproc: int = 2

    @property
    def version(self) -> tuple[int, int]:
        if self.tree is None:
            from megatron.core import package_info

            return tuple(int(x) for x in package_info.__version__.split(".")[:2])
        info = (self.tree / "megatron" / "core" / "package_info.py").read_text()
        return tuple(int(re.search(rf"^{key} = (\d+)", info, re.M).group(1)) for key in ("MAJOR", "MINOR"))

    def command(self, *extra: str) -> list[str]:
        script = [] if self.tree is None else [str(self.tree / "pretrain_gpt.py")]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                "-m", "megatron_patches.testing.pretrain_cpu", *script, *TINY, *extra]

    def run(self, env: dict, *extra: str, process: bool = False) -> subprocess.CompletedProcess:
        """Train with ``extra`` flags under ``env`` from the repository root (10 minutes at most).
        The packaged loop's ranks are forked from this process (:func:`conftest.run_packaged_loop`:
        the code returned is the failing rank's own, output all in ``stdout``); a checkout, or
        ``process=True`` where torchrun's own behaviour is under test, runs under torchrun."""
        if self.tree is not None or process:
            return subprocess.run(self.command(*extra), capture_output=True, text=True, timeout=600, cwd=REPO,
                                  env=env)
        code, output = run_packaged_loop(env, [*TINY, *extra], nproc=self.nproc)
        return subprocess.CompletedProcess(self.command(*extra), code, output, "")

    def checkpoint_format(self) -> list[str]:
        """torch_dist saves of core <= 0.15 call np.product, gone in NumPy 2: the legacy format then."""
        import numpy

        if self.version < (0, 16) and int(numpy.__version__.split(".")[0]) >= 2:
            return ["--ckpt-format", "torch"]
        return []


def _packaged_loop_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        return False


@pytest.fixture(params=["package", pytest.param("checkout", marks=pytest.mark.megatron_lm)])
def loop_kind(request) -> str:
    if request.param == "package" and not _packaged_loop_available():
        pytest.skip("the installed megatron-core ships no megatron/training (0.17+ does: "
                    "make test PYTHON=python3.12 VENV=.venv312)")
    if request.param == "checkout":
        request.getfixturevalue("megatron_lm_checkout")
    return request.param


def make_loop(kind: str, request, where: Path, only: str | None) -> Loop:
    """The packaged loop as is (runtime wrappers, ``import megatron_patches.apply`` in the runner),
    or a checkout copy with the source patches named by ``only``."""
    if kind == "package":
        return Loop(None)
    return Loop(patched_copy(request.getfixturevalue("megatron_lm_checkout"), where, only))


def guard_env(tmp_path: Path, **config) -> dict:
    path = tmp_path / "guard.yaml"
    path.write_text(json.dumps({"report_dir": str(tmp_path / "reports"), **config}))  # JSON is YAML
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PATCHES_CONFIG": str(path)}
    return env


def iterations(output: str) -> dict[int, str]:
    """Megatron's per-iteration log lines by iteration number (the last one of each number wins)."""
    return {int(m.group(1)): m.group(2) for m in ITERATION_LINE.finditer(output)}


REDONE = re.compile(r"\[megatron_patches\] redone iteration\s+(\d+)/\s*\d+ \| lm loss: ([^ |]+)")
"""The guard's log line of an iteration an in-process rollback redid (Megatron's loop logged its first run)."""


def logged_losses(*outputs: str) -> dict[int, str]:
    """Each iteration's ``lm loss`` as logged in ``outputs`` (a later output's wins), a redone
    iteration's (the last output's :data:`REDONE` lines) winning over its first run's."""
    losses = {i: m.group(1) for out in outputs for i, line in iterations(out).items()
              if (m := re.search(r"lm loss: ([^ |]+)", line))}
    losses.update({int(i): loss for i, loss in REDONE.findall(outputs[-1])})
    return losses


def incidents(tmp_path: Path) -> list[dict]:
    path = tmp_path / "reports" / "incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def report_text(tmp_path: Path) -> str:
    """What ``megatron-patches report`` prints for the run's reports directory."""
    return subprocess.run([sys.executable, "-m", "megatron_patches", "report", str(tmp_path / "reports")],
                          capture_output=True, text=True, cwd=REPO).stdout


def rollback_run(loop: Loop, tmp_path: Path, drill: str, *extra: str, config: dict | None = None) -> tuple[str, str]:
    """The launcher around ``loop`` with checkpoints every 2 iterations and ``drill`` as the guard's
    drill; asserts it ends with exit 0 and returns the first and the second attempt's output (one
    stream, so that the launcher's lines fall between the two attempts)."""
    save = tmp_path / "ckpt"
    command = loop.command("--save", str(save), "--load", str(save), "--save-interval", "2", *extra,
                           *loop.checkpoint_format())
    proc = subprocess.run([sys.executable, str(LAUNCHER), "--max-restarts", "2", "--", *command],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, cwd=REPO,
                          env=guard_env(tmp_path, inject=[drill], **(config or {})))
    assert proc.returncode == 0, proc.stdout[-6000:]
    first, second = proc.stdout.split("[restart_on_rollback] attempt 2:")
    return first, second

