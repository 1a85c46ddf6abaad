"""Megatron's clipping norm comes from the guard's own checked pass (megatron_patches.served_norm):
the value Megatron's own code would give, without Megatron reading the gradients a second time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Run, assert_trained

AUDIT = Path(__file__).with_name("norm_audit.py")


def run_audited(out: Path, *args: str, nproc: int = 1) -> tuple[dict, list[dict]]:
    """Train with tests/norm_audit.py (the harness, Megatron's norm computation watched); returns
    result.json and each rank's audit."""
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MEGATRON_PATCHES_CONFIG", None)
    proc = subprocess.run([*runner, str(AUDIT), "--out", str(out), *args], capture_output=True, text=True,
                          env=env, timeout=300)
    result = assert_trained(Run(proc.returncode, proc.stdout + proc.stderr, out), min_drop=0.0)
    audits = [json.loads((out / f"norm_audit.rank{r}.json").read_text()) for r in range(nproc)]
    return result, audits


def assert_served_every_step(result: dict, audits: list[dict], steps: int) -> None:
    """Every step's norm came from the guard on every rank, equal to what Megatron's own code gives
    for the same gradients within 1e-6 relative, and Megatron never read the gradients for it."""
    assert result["monitor"]["served_norms"] == steps, result["monitor"]
    for rank, audit in enumerate(audits):
        assert audit["stock_calls"] == [], (rank, audit)
        assert [s for s, _, _ in audit["served"]] == list(range(1, steps + 1)), (rank, audit)
        for step, ours, stock in audit["served"]:
            assert abs(ours - stock) <= 1e-6 * abs(stock), (rank, step, ours, stock)


# fp16 from 2^16: Megatron's 2^32 would spend these six steps calibrating, serving no norm.
@pytest.mark.parametrize("args", [[], ["--precision", "bf16"], ["--precision", "fp16", "--initial-loss-scale", "65536"]],
                         ids=["fp32", "bf16", "fp16"])
def test_single_rank_norm_served(tmp_path, args):
    result, audits = run_audited(tmp_path, "--steps", "6", *args)
    assert_served_every_step(result, audits, steps=6)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "args",
    [["--tp", "2"], ["--pp", "2", "--layers", "4"], ["--distributed-optimizer"],
     ["--precision", "bf16", "--distributed-optimizer"]],
    ids=["tp2", "pp2", "dp2-distopt", "bf16-dp2-distopt"],
)
def test_parallel_norm_served(tmp_path, args):
    result, audits = run_audited(tmp_path, "--steps", "5", *args, nproc=2)
    assert_served_every_step(result, audits, steps=5)


def test_unchecked_steps_compute_the_norm_as_stock(tmp_path):
    """check_interval 2: the guard serves the checked (even) steps; on the others Megatron computes
    the norm itself, once per step."""
    config = tmp_path / "guard.yaml"
    config.write_text("check_interval: 2\n")
    result, (audit,) = run_audited(tmp_path / "out", "--steps", "6", "--config", str(config))
    assert result["monitor"]["checked_steps"] == 3 and result["monitor"]["served_norms"] == 3
    assert audit["stock_calls"] == [1, 3, 5], audit
    assert [s for s, _, _ in audit["served"]] == [2, 4, 6], audit
    for step, ours, stock in audit["served"]:
        assert abs(ours - stock) <= 1e-6 * abs(stock), (step, ours, stock)


def test_without_the_guard_megatron_computes_every_norm(tmp_path):
    result, (audit,) = run_audited(tmp_path, "--steps", "3", "--no-guard")
    assert result["monitor"] is None
    assert audit == {"stock_calls": [-1, -1, -1], "served": []}


def test_a_skipped_step_serves_nothing_stale(tmp_path):
    """The guard skips step 3 (a NaN gradient): no norm is asked for there, and the next step's
    norm is that step's own, served once more."""
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    result, (audit,) = run_audited(tmp_path, "--steps", "5", "--inject", f"nan:step=3,param={name}")
    assert result["skipped_steps"] == 1 and result["monitor"]["served_norms"] == 4
    assert audit["stock_calls"] == [], audit
    assert [s for s, _, _ in audit["served"]] == [1, 2, 4, 5], audit
    for step, ours, stock in audit["served"]:
        assert abs(ours - stock) <= 1e-6 * abs(stock), (step, ours, stock)
