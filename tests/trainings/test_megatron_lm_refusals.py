"""Megatron-LM's loop refuses what it cannot check, each with one line and its exit code: an
optimizer variant, a drill it cannot feed, a misspelled key, a ledger nobody can apply, the
harness's retention key; a device whose Adam state goes bad twice is fenced (slow)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from megatron_patches import checkpoint
from megatron_patches.ledger import LEDGER_FILE, Ledger
from megatron_lm_loop import (  # noqa: F401 (loop_kind, megatron_lm_checkout: fixtures)
    REPO, LAUNCHER, FC1, loop_kind, megatron_lm_checkout, make_loop, guard_env, iterations, incidents)


# --- optimizer variants and checkpoint kinds (issue 12, items 4 and 5) ---------------------------


@pytest.mark.multiproc
def test_a_refused_variant_stops_the_job_before_its_model_is_built_with_exit_2_and_one_line(
        loop_kind, request, tmp_path):
    """A variant the guard does not check yet (here the flex token dispatcher, DeepEP/HybridEP)
    stops the job before the model is built and before the first iteration: exit code 2, one line
    on rank 0 naming the flag and why, no worker traceback."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = {**guard_env(tmp_path), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    proc = loop.run(env, "--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
                    "--moe-token-dispatcher-type", "flex", process=True)  # torchrun's summary is read
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and re.search(r"exitcode\s*: 2\b", output), output[-4000:]
    refusals = [line for line in output.splitlines() if "is not supported by megatron_patches yet" in line]
    assert len(refusals) == 1 and "--moe-token-dispatcher-type flex" in refusals[0], refusals
    assert "CUDA-only" in refusals[0]
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output
    assert iterations(output) == {}


@pytest.mark.slow  # make test-all: about 70 s on 2 CPU cores; the harness fences in the default run (test_cause.py)
@pytest.mark.multiproc
def test_a_device_whose_adam_state_goes_bad_twice_is_fenced_across_a_restart_with_88(loop_kind, request, tmp_path):
    """Megatron-LM's loop, DP2 bf16 with the distributed optimizer, under the launcher: a NaN written into rank 0's
    exp_avg_sq at iteration 3 is hardware (no iteration skipped, none blacklisted) and rolls back by restart; the
    ledger carries the device's count into the restarted job, where the second corruption (iteration 9) fences it:
    every rank exits 88, one line names the host and device, and the launcher stops with 88 instead of restarting."""
    loop, save = make_loop(loop_kind, request, tmp_path, only="pretrain"), tmp_path / "ckpt"
    drills = [f"nan:step={step},phase=state,slot=exp_avg_sq,param={FC1},rank=0" for step in (3, 9)]
    command = loop.command("--save", str(save), "--load", str(save), "--save-interval", "2", "--train-iters", "14",
                           "--bf16", "--use-distributed-optimizer", *loop.checkpoint_format())
    proc = subprocess.run([sys.executable, str(LAUNCHER), "--max-restarts", "3", "--", *command], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900, cwd=REPO, env=guard_env(tmp_path, inject=drills))
    assert proc.returncode == 88, proc.stdout[-6000:]
    records = incidents(tmp_path)
    assert {r["cause"]["class"] for r in records} == {"hardware"} and records[-1]["action"] == "fence"
    device = records[-1]["cause"]["devices"][0]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[megatron_patches] fence: exclude")]
    assert lines == [f"[megatron_patches] fence: exclude host {device['host']} device {device['device']} (rank 0): "
                     f"2 hardware-class incidents in this job, at steps [5, 11]; every rank exits with 88"], lines
    assert "[restart_on_rollback] attempt 2: fence: exclude host" in proc.stdout and "attempt 3" not in proc.stdout
    ledger = Ledger.load(str(save))
    assert ledger.blacklist == [] and ledger.events[0]["skip_iterations"] == [] and ledger.fenced["incidents"] == 2


@pytest.mark.multiproc
def test_a_misspelled_config_key_is_one_line_and_exit_2_on_every_rank(loop_kind, request, tmp_path):
    """At a thousand ranks a traceback per rank buries the cause, and a restarting launcher would
    retry input that never changes: one line on rank 0, every worker exits 2, nothing trains."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = guard_env(tmp_path, detectors={"nonfinit": {}})
    proc = loop.run(env, process=True)  # what torchrun shows of it is the subject
    output = proc.stdout + proc.stderr
    # Each worker exits 2 unless torchrun, seeing the first one go, tears it down first (SIGTERM, -15).
    codes = set(re.findall(r"exitcode\s*: (-?\d+)", output))
    assert "2" in codes and codes <= {"2", "-15"}, output[-4000:]
    lines = [line for line in output.splitlines() if "unknown config key" in line]
    assert lines == ["[megatron_patches] unknown config key detectors.nonfinit at detectors; valid keys: "
                     "activations, audit, consistency, history, loss_scale, loss_spike, magnitude, nonfinite, peak, peers, "
                     "state, tokens"], lines
    assert "Traceback" not in output.split("failed (exitcode")[0]  # torchrun's own summary follows
    assert iterations(output) == {}


@pytest.mark.multiproc
def test_a_ledger_nobody_can_apply_is_one_line_and_exit_2_before_the_first_iteration(loop_kind, request, tmp_path):
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LEDGER_FILE).write_text('{"schema": "megatron_patches.ledger/1", "lr_scale": NaN, "rollbacks": 1}')
    proc = loop.run(guard_env(tmp_path), "--save", str(save), "--load", str(save), "--save-interval", "2")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-4000:]
    [line] = [line for line in output.splitlines() if LEDGER_FILE in line and "`lr_scale`" in line]
    assert line.startswith("[megatron_patches] ledger ") and "move it away" in line
    assert "Traceback" not in output and iterations(output) == {}


@pytest.mark.multiproc
def test_the_harness_retention_key_is_refused_in_megatron_lms_loop(loop_kind, request, tmp_path):
    """keep_checkpoints is the harness's: in Megatron-LM's loop the guard deletes no checkpoint, so a
    job that sets it would believe in a retention nobody applies (issue 25 saw 4 kept with 3)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    proc = loop.run(guard_env(tmp_path, recovery={"keep_checkpoints": 3}))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output[-4000:]
    [line] = [line for line in output.splitlines() if "keep_checkpoints" in line and "harness" in line]
    assert line.startswith("[megatron_patches] recovery.keep_checkpoints is the tiny-GPT harness's retention")
    assert iterations(output) == {}
