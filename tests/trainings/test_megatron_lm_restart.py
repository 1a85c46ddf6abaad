"""Megatron-LM's loop across restarts: a persistent fault exits 84 and the launcher resumes from the
healthy checkpoint (safe mode, the scaled learning rate, skipped iterations), the detectors'
baselines survive, the guard's rollback path with stock flags, and the checkpoint markers."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megatron_patches import checkpoint
from megatron_patches.ledger import LEDGER_FILE, Ledger
from megatron_patches.seams import megatron_lm
from megatron_lm_loop import (  # noqa: F401 (loop_kind, megatron_lm_checkout: fixtures)
    FC1, loop_kind, megatron_lm_checkout, make_loop, guard_env, iterations, incidents, report_text, rollback_run)


@pytest.mark.multiproc
def test_persistent_fault_exits_84_and_the_launcher_resumes_from_the_healthy_checkpoint_in_safe_mode(
        loop_kind, request, tmp_path):
    """The rollback path end to end, and safe mode on the restart (recovery.disable_features
    [dropout, overlap_grad_reduce], issue 27): Megatron's default dropout 0.1 and
    --overlap-grad-reduce in the first attempt; after the rollback the restarted job's args are
    switched off before its model is built, and the built model shows it: no dropout module or
    layer with p > 0, DDP without overlap. The report says both beside the incident. With
    --non-persistent-save-interval 1 a non-persistent iteration 3 is left, newer than the target,
    which Megatron would load in preference to --ckpt-step: the restart loads iteration 2, the
    newest certified checkpoint (the clean check of 3 certified it; 4 holds an incident)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")  # hooks from the runtime wrappers
    save = tmp_path / "ckpt"
    first, second = rollback_run(loop, tmp_path, f"nan:step=4,count=2,param={FC1}", "--overlap-grad-reduce",
                                 "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global",
                                 config={"recovery": {"disable_features": ["dropout", "overlap_grad_reduce"]}})
    # Iteration 4 skipped (warning), iteration 5 again: an error, so every rank stops with 84. The
    # default in-process rollback cannot switch the overlap off in the live model: it says so first.
    assert ("rollback at iteration 5 made by a restart, not in process: recovery switches off "
            "overlap_grad_reduce, which needs the model built again") in first
    assert first.count("stopping with exit code 84") == 2
    assert re.search(r"exitcode\s*: 84", first)  # torchrun itself exits 1 and names the 84
    assert "ledger: rollback 1 requested at iteration 5" in first
    assert [i["step"] for i in incidents(tmp_path)] == [4, 5]
    assert incidents(tmp_path)[1]["severity"] == "error" and incidents(tmp_path)[1]["action"] == "rollback"

    # The restart loads iteration 2 (the newest certified one), trains 3, skips 4 and 5, trains 6, at half the lr.
    assert (save / "non_persistent" / "iter_0000003").is_dir() or "non_persistent/iter_0000003" in first
    assert "non-persistent (global) checkpoints are not loaded on this restart" in second
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert "resumed from healthy checkpoint iteration 2" in second
    resumed = iterations(second)
    assert sorted(resumed) == [3, 6]
    assert all("learning rate: 5.000000E-04" in line and "lm loss" in line for line in resumed.values())
    assert "learning rate: 1.000000E-03" in iterations(first)[2]

    ledger = Ledger.load(str(save))
    assert ledger.rollbacks == 1 and ledger.lr_scale == 0.5 and ledger.rollback_requested is None
    assert ledger.events[0]["skip_iterations"] == [4, 5] and ledger.events[1]["resumed_from"] == 2
    marks = {step: ok for step, _, ok in checkpoint.list_checkpoints(str(save))}
    assert marks[2] and not marks[4]  # 4 was saved after the incident of 4

    # The report finds the outcome through the ledger the rollback's record names.
    assert incidents(tmp_path)[1]["ledger"] == str(save / LEDGER_FILE)
    report = subprocess.run([sys.executable, "-m", "megatron_patches", "report", str(tmp_path / "reports"), "--json"],
                            capture_output=True, text=True)
    rollback = json.loads(report.stdout)["incidents"][1]
    assert {k: rollback[k] for k in ("rolled_back_to", "lr_scale", "iterations_skipped", "restart", "restarts_used")} \
        == {"rolled_back_to": 2, "lr_scale": 0.5, "iterations_skipped": [4, 5], "restart": 1, "restarts_used": 1}
    text = report_text(tmp_path)
    assert ("rolled back to the healthy checkpoint of step 2, learning rate x0.5; resumed in safe mode without "
            "dropout, overlap_grad_reduce; iteration(s) 4, 5 skipped on resuming; restart 1 (1 rollback(s) used in "
            "this job)") in text, text

    # Safe mode: nothing in the first attempt, the features off in the second one's args and model.
    assert "safe mode" not in first
    assert ("safe mode after rollback 1: switched off dropout, overlap_grad_reduce (hidden_dropout 0.1 -> 0.0; "
            "attention_dropout 0.1 -> 0.0; overlap_grad_reduce True -> False)") in second, second[-4000:]
    built = re.search(r"safe mode in the built model: (\d+) of (\d+) dropout modules with p > 0, (\d+) of (\d+) "
                      r"layers with hidden_dropout > 0; overlap_grad_reduce=(\w+)", second)
    assert built and built.group(1) == "0" and int(built.group(2)) > 0 and built.group(3) == "0", second[-4000:]
    assert built.group(5) == "False"
    assert ledger.disabled_features == ["dropout", "overlap_grad_reduce"]


@pytest.mark.multiproc
def test_detector_baselines_survive_a_megatron_lm_restart(loop_kind, request, tmp_path):
    """Each rank's history baselines are saved in iter_N and restored on --load: a finite x100
    spike on the first iteration after the resume is judged against the pre-restart history
    (without them it would fall in a fresh warm-up and pass unseen)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    history = {"detectors": {"history": {"warmup_steps": 8}}}
    # A 14-iteration job stopped by Megatron's --exit-interval at 12 (it saves there), then resumed.
    first = loop.run(guard_env(tmp_path, **history), "--save", str(save), "--save-interval", "12",
                     *loop.checkpoint_format(), "--train-iters", "14", "--exit-interval", "12")
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert sorted(p.name for p in (save / "iter_0000012" / megatron_lm.STATE_DIR).iterdir()) == [
        "rank_00000.json", "rank_00001.json"]
    assert incidents(tmp_path) == []

    env = guard_env(tmp_path, **history, inject=[f"spike:step=13,param={FC1},factor=100"])
    resumed = loop.run(env, "--save", str(save), "--load", str(save), "--save-interval", "100",
                       *loop.checkpoint_format(), "--train-iters", "14")
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert "guard state of iteration 12 restored" in output
    [incident] = incidents(tmp_path)
    assert incident["step"] == 13 and incident["kind"] == "zscore", incident
    assert incident["first"]["name"] == FC1


def test_stock_flags_persistent_local_nan_takes_the_guards_rollback_path(loop_kind, request, tmp_path):
    """Stock flags, rank 1's own gradient NaN at iterations 4 and 5: the guard, not Megatron's rerun
    machine, handles both (skip, then rollback with exit 84), and the launcher resumes from the
    certified checkpoint to the last iteration."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    first, second = rollback_run(loop, tmp_path, f"nan:step=4,count=2,rank=1,phase=local,param={FC1}")
    output = first + second
    # Megatron reruns each step in place (transient: the drill fires once a step) and carries on.
    assert "exitcode  : 17" not in output and "exitcode  : 16" not in output

    assert first.count("stopping with exit code 84") == 2
    found = incidents(tmp_path)
    assert [i["step"] for i in found] == [4, 5]
    assert [i["severity"] for i in found] == ["warning", "error"] and found[1]["action"] == "rollback"
    assert all(i["origin_ranks"] == [1] and i["pre_reduction"][0]["name"] == FC1 for i in found)
    assert [i["megatron_rerun"]["verdict"] for i in found] == ["transient", "transient"]
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+2\b", second), second[-4000:]
    assert sorted(iterations(second)) == [3, 6]
    text = report_text(tmp_path)
    assert ("rolled back to the healthy checkpoint of step 2, learning rate x0.5; iteration(s) 4, 5 skipped on "
            "resuming; restart 1 (1 rollback(s) used in this job)") in text, text  # no safe mode configured


@pytest.mark.multiproc
def test_a_marker_that_cannot_be_written_never_ends_the_job(loop_kind, request, tmp_path):
    """The guard's files beside a checkpoint fail to write (a directory already stands where the
    marker and rank 0's state file go): the job trains on, that checkpoint is no rollback target,
    the next one is marked healthy."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    blocked = save / "iter_0000002"
    (blocked / checkpoint.MARKER).mkdir(parents=True)
    (blocked / megatron_lm.STATE_DIR / "rank_00000.json").mkdir(parents=True)
    proc = loop.run(guard_env(tmp_path), "--save", str(save), "--save-interval", "2", "--train-iters", "4",
                    *loop.checkpoint_format())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "checkpoint iteration 2 could not be marked" in output and "guard state" in output
    assert sorted(iterations(output)) == [1, 2, 3, 4]
    marker = json.loads((save / "iter_0000004" / checkpoint.MARKER).read_text())
    # Healthy, and no rollback target yet: the job ended before a checked step after it could certify it.
    assert (marker["healthy"], marker["certified_at"]) == (True, None)
    assert {step: ok for step, _, ok in checkpoint.list_checkpoints(str(save))} == {4: False}


def test_a_checkpoint_is_a_target_once_the_checked_steps_after_it_came_out_clean(loop_kind, request, tmp_path):
    """recovery.certify_steps (default 1), issue 38 item 3: iteration 2's checkpoint is certified by
    the clean check of 3; 4's is not, iteration 5 was flagged first; 6 holds that incident; 8, the
    job's last, waits, and a resumed job certifies it with its first clean check (9)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    env = guard_env(tmp_path, inject=[f"nan:step=5,param={FC1}"])
    proc = loop.run(env, "--save", str(save), "--save-interval", "2", "--train-iters", "8", *loop.checkpoint_format())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    def markers() -> dict:
        return {int(d.name[5:]): json.loads((d / checkpoint.MARKER).read_text()) for d in save.glob("iter_*")}

    found = markers()
    assert (found[2]["healthy"], found[2]["certified_at"]) == (True, 3)
    assert (found[4]["healthy"], found[4]["certified_at"]) == (False, None)
    assert found[4]["not_certified"] == "step 5 was flagged before the checkpoint was certified"
    assert found[6]["healthy"] is False and "certified_at" not in found[6]  # the incident of 5 since 4
    assert (found[8]["healthy"], found[8]["certified_at"]) == (True, None)
    assert megatron_lm.newest_healthy_iteration(str(save)) == 2

    resumed = loop.run(env, "--save", str(save), "--load", str(save), "--save-interval", "100", "--train-iters", "10",
                       "--override-opt_param-scheduler", *loop.checkpoint_format())
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert markers()[8]["certified_at"] == 9
    assert megatron_lm.newest_healthy_iteration(str(save)) == 8  # the final save of 10 waits in turn
