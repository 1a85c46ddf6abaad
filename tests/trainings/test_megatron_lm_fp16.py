"""fp16 through Megatron-LM's loop: the loss scaler's skips are its own business (issue 29)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from megatron_patches import checkpoint
from megatron_lm_loop import (  # noqa: F401 (loop_kind, megatron_lm_checkout: fixtures)
    FC1, loop_kind, megatron_lm_checkout, make_loop, guard_env, iterations, incidents)


# --- fp16: the loss scaler's skips are its own business (issue 29) -------------------------------


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc,flags", [(2, ("--use-distributed-optimizer",)), (2, ()),
                                         pytest.param(1, (), marks=pytest.mark.slow)],  # make test-all
                         ids=["dp2-distopt", "dp2", "1rank"])
def test_fp16_clean_run_calibrates_without_a_record(loop_kind, request, tmp_path, nproc, flags):
    """Megatron's defaults (initial loss scale 2^32, fp16 gradient buffers): the scaler skips its
    first iterations while the scale comes down, and the scaled overflow is in every rank's own
    gradients before the reduction. With --loss-scale-window 20 the scale then doubles after each 20
    clean iterations and overflows again: routine skips after the calibration. None of it is an
    origin or an incident: 80 iterations, exit 0, no record, the loss falls."""
    loop = replace(make_loop(loop_kind, request, tmp_path, only="pretrain"), nproc=nproc)
    proc = loop.run(guard_env(tmp_path), "--fp16", "--train-iters", "80", "--loss-scale-window", "20", *flags)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert incidents(tmp_path) == []
    logged = iterations(output)
    assert sorted(logged) == list(range(1, 81))
    skipped = [i for i, line in logged.items() if re.search(r"number of skipped iterations:\s+[1-9]", line)]
    calibrated = min(i for i in logged if i not in skipped)  # the first iteration applied
    assert 1 in skipped and any(i > calibrated for i in skipped), skipped  # calibration, then routine skips
    loss = {i: float(m.group(1)) for i, line in logged.items() if (m := re.search(r"lm loss: ([^ ]+)", line))}
    assert loss[80] < loss[calibrated] - 0.1, (loss[calibrated], loss[80])


@pytest.mark.multiproc
def test_fp16_persistent_nan_collapses_the_scale_and_is_named_with_its_origin(loop_kind, request, tmp_path):
    """A NaN in rank 1's own fc1 gradient from iteration 30 on: the scaler skips and halves its
    scale each time. Ten skips after calibration are a warning; the collapse to the scale's floor
    is an incident too, named on rank 1 with the scale history, and persisting it rolls back."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = guard_env(tmp_path, inject=[f"nan:step=30,count=100,rank=1,phase=local,param={FC1}"])
    proc = loop.run(env, "--fp16", "--use-distributed-optimizer", "--train-iters", "80")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]  # rolled back in memory: no checkpoint needed (issue 60)
    found = incidents(tmp_path)
    assert [i["kind"] for i in found] == ["loss_scale"] * len(found) and len(found) >= 2, found
    assert all(i["first"]["name"] == FC1 and i["origin_ranks"] == [1] for i in found)
    assert all(i["pre_reduction"][0]["ranks"]["global"] == 1 for i in found)
    run_of_skips, collapse = found[0], next(i for i in found if "collapsed" in i["message"])
    assert run_of_skips["step"] == 39 and run_of_skips["severity"] == "warning"
    assert run_of_skips["message"].startswith("10 consecutive overflow skips")
    history = collapse["loss_scale"]["history"]
    assert history == sorted(history, reverse=True) and history[-1] == collapse["loss_scale"]["scale"] == 1.0
    assert found[-1]["action"] == "rollback" and found[-1]["severity"] == "error"


@pytest.mark.multiproc
def test_fp16_constant_loss_scale_overflow_is_an_incident(loop_kind, request, tmp_path):
    """--loss-scale 128: nothing adapts, so a NaN on rank 1 is a fault like any other: named, origin
    rank 1, warning; the job goes on to its last iteration."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    env = guard_env(tmp_path, inject=[f"nan:step=5,rank=1,phase=local,param={FC1}"])
    proc = loop.run(env, "--fp16", "--loss-scale", "128", "--no-check-for-nan-in-loss-and-grad", "--train-iters", "8")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["kind"], incident["severity"]) == (5, "loss_scale", "warning")
    assert incident["message"].startswith("overflow with a constant loss scale (128)")
    assert incident["first"]["name"] == FC1 and incident["origin_ranks"] == [1]
    assert incident["loss_scale"] == {"scale": 128.0, "dynamic": False, "skips": 1, "history": [128.0]}
    assert sorted(iterations(output)) == list(range(1, 9))
