"""Shared helpers: run the real tiny-GPT harness (in this process for one rank, under torchrun
for several) and read what it wrote."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Run:
    returncode: int
    output: str
    out: Path

    @property
    def result(self) -> dict:
        return json.loads((self.out / "result.json").read_text())

    @property
    def incidents(self) -> list[dict]:
        path = self.out / "incidents.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_tiny(out: Path, *args: str, nproc: int = 1, env: dict | None = None, timeout: int = 300,
             process: bool = False) -> Run:
    """Train with the tiny-GPT harness: ``python -m megatron_patches.tiny_gpt`` under torchrun when
    nproc > 1, or when ``env`` or ``process`` asks for a process of its own (a variable read at
    import, a kill drill); one rank otherwise runs here, in the test's process, through the same
    ``main`` (:func:`run_tiny_here`), which saves the 11 s of start-up a process costs."""
    if nproc == 1 and env is None and not process:
        return run_tiny_here(out, *args)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megatron_patches.tiny_gpt"]
    else:
        cmd = [sys.executable, "-m", "megatron_patches.tiny_gpt"]
    cmd += ["--out", str(out), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    full_env.pop("MEGATRON_PATCHES_CONFIG", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    return Run(proc.returncode, proc.stdout + proc.stderr, out)


_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_PATCHES_CONFIG")


def run_tiny_here(out: Path, *args: str) -> Run:
    """One rank of the harness in this process: ``tiny_gpt.main`` with its stdout, its stderr and
    the guard's log lines captured, then everything a run leaves in a process undone (the guard's
    patches and monitor, megatron-core's parallel groups, the process group, the CPU runtime, the
    launcher variables the harness sets), so the next run starts as a fresh process would. The
    exit code is what ``main`` returns, or the code a guard's stop raised."""
    from megatron.core import parallel_state
    import torch

    from megatron_patches import runtime
    from megatron_patches.testing import cpu, tiny_gpt

    saved_env = {name: os.environ.pop(name) for name in _LAUNCH_VARIABLES if name in os.environ}
    logger = logging.getLogger("megatron_patches")
    saved_log = (list(logger.handlers), logger.propagate, logger.level)
    streams = [(h, h.stream) for h in logger.handlers if type(h) is logging.StreamHandler]
    buffer = io.StringIO()
    for handler, _ in streams:
        handler.setStream(buffer)
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                code = tiny_gpt.main(["--out", str(out), *args])
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
    finally:
        runtime.uninstall()
        parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        cpu.uninstall()
        for name in _LAUNCH_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(saved_env)
        for handler, stream in streams:
            handler.setStream(stream)
        logger.handlers[:], logger.propagate, logger.level = saved_log
    return Run(code, buffer.getvalue(), out)


def assert_trained(run: Run, min_drop: float = 0.5) -> dict:
    """The run finished, every parameter on every rank is finite, and loss fell."""
    assert run.returncode == 0, run.output[-3000:]
    result = run.result
    assert result["params_finite"], run.output[-3000:]
    assert result["final_loss"] < result["initial_loss"] - min_drop, result
    return result


def assert_norm_is_megatrons(result: dict, steps: int) -> None:
    """On every step both measured, the guard's total gradient norm is the one Megatron's optimizer
    reported (relative difference <= 1e-5): same gradients, same parameters counted once. On a
    checked step Megatron reports the guard's own total (megatron_patches.served_norm), so this
    holds by construction there; tests/test_served_norm.py compares it with Megatron's own code."""
    gap = result["grad_norm_vs_megatron"]
    assert gap["steps"] == steps and gap["max_rel_diff"] <= 1e-5, gap


@pytest.fixture
def guard_log(caplog):
    """caplog for the "megatron_patches" logger, also after an earlier test in this process ran
    runtime.install(), which stops that logger from propagating to the root logger."""
    logger = logging.getLogger("megatron_patches")
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(caplog.handler)  # exactly one way in, whatever ran before
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate


@pytest.fixture
def clean_patches():
    """Leave no patches or monitor behind for the next test in this process."""
    from megatron_patches import runtime

    runtime.uninstall()
    yield
    runtime.uninstall()


@pytest.fixture(scope="session")
def megatron_lm_dir() -> Path:
    """The Megatron-LM checkout in $MEGATRON_LM_DIR; the test is skipped, saying why, without one
    (CI never has one: Megatron-LM's training code is on no package registry)."""
    value = os.environ.get("MEGATRON_LM_DIR")
    if not value:
        pytest.skip("MEGATRON_LM_DIR not set: point it at a Megatron-LM checkout (core 0.12-0.19 or main)")
    path = Path(value)
    if not (path / "pretrain_gpt.py").is_file():
        pytest.skip(f"MEGATRON_LM_DIR={value} has no pretrain_gpt.py")
    return path


def source_tree(variable: str, needed: str, example: str) -> Path:
    """The source tree named by environment ``variable`` (MINDSPEED_DIR, ...), or a skip saying
    why: unset, or without the file ``needed`` (relative to the tree)."""
    value = os.environ.get(variable)
    if not value:
        pytest.skip(f"{variable} not set: point it at {example}")
    path = Path(value)
    if not (path / needed).is_file():
        pytest.skip(f"{variable}={value} has no {needed}")
    return path


# --- tests that run on one megatron-core line --------------------------------------------------

EVERY_LINE = "MEGATRON_PATCHES_EVERY_LINE"


def _core_minor() -> tuple[int, int]:
    from importlib.metadata import version

    major, minor = version("megatron-core").split(".")[:2]
    return int(major), int(minor)


def pytest_collection_modifyitems(config, items):
    """``one_line`` tests cover what is the same on every megatron-core line (the guard's own files,
    CLI, alerts, detectors' arithmetic, the harness's data): ``make test`` runs them on the 0.16
    line only, to keep each CI leg near 15 minutes; ``make test-all`` (which sets EVERY_LINE) runs
    them on every line."""
    if os.environ.get(EVERY_LINE) or _core_minor() < (0, 17):
        return
    skip = pytest.mark.skip(reason=f"line-independent: run on the 0.16 leg (set {EVERY_LINE}=1 to run here)")
    for item in items:
        if item.get_closest_marker("one_line"):
            item.add_marker(skip)
