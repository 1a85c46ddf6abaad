"""The walking skeleton: real megatron-core tiny GPTs train on CPU in every layout."""

import pytest

from conftest import assert_norm_is_megatrons, assert_trained, run_tiny
from test_served_norm import assert_served_every_step, run_audited


def test_single_rank_fp32_trains(tmp_path):
    result = assert_trained(run_tiny(tmp_path, "--steps", "30"))
    assert (result["world_size"], result["tp"], result["pp"], result["dp"]) == (1, 1, 1, 1)
    assert result["steps_completed"] == 30
    assert result["skipped_steps"] == 0 and result["incidents"] == 0
    assert_norm_is_megatrons(result, steps=30)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "args, layout",
    [
        (["--tp", "2"], (2, 1, 1)),
        (["--pp", "2", "--layers", "4"], (1, 2, 1)),
        (["--distributed-optimizer"], (1, 1, 2)),
        (["--precision", "bf16", "--distributed-optimizer"], (1, 1, 2)),
    ],
    ids=["tp2", "pp2", "dp2-distopt", "bf16-dp2-distopt"],
)
def test_parallel_layouts_train_and_the_guard_serves_megatrons_norm(tmp_path, args, layout):
    """Two ranks in each layout, with ``serve_norm: true`` and Megatron's norm computation watched
    (tests/norm_audit.py): the model trains, nothing is reported, and on every step of every rank
    the clipping norm came from the guard, equal to what Megatron's own code gives for the same
    gradients, Megatron never reading them for it. (Serving off, the default, is
    tests/trainings/test_served_norm.py: Megatron computes every norm.)"""
    result, audits = run_audited(tmp_path, "--steps", "20", *args, nproc=2, min_drop=0.5)
    assert (result["tp"], result["pp"], result["dp"]) == layout
    assert result["world_size"] == 2 and result["incidents"] == 0
    assert_served_every_step(result, audits, steps=20)


@pytest.mark.multiproc
def test_fp16_data_parallel_trains_through_the_scalers_calibration(tmp_path):
    result = assert_trained(run_tiny(tmp_path, "--steps", "25", "--precision", "fp16", nproc=2))
    assert (result["tp"], result["pp"], result["dp"], result["world_size"]) == (1, 1, 2, 2)
    assert result["incidents"] == 0
    assert_norm_is_megatrons(result, steps=25 - result["skipped_steps"])  # the loss-scale skips


def test_bf16_single_rank_trains(tmp_path):
    result = assert_trained(run_tiny(tmp_path, "--steps", "25", "--precision", "bf16"))
    assert result["precision"] == "bf16" and result["incidents"] == 0
    assert_norm_is_megatrons(result, steps=25)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--tp", "2"], "tp*pp = 2*1 does not divide the world size 1"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--inject", "nan:param=x"], "step=N is required"),
        (["--inject", "melt:step=1"], "kind must be one of nan, inf, spike, bitflip, saturate"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, message):
    run = run_tiny(tmp_path, *args)
    assert run.returncode == 2
    errors = [line for line in run.output.splitlines() if line.startswith("tiny_gpt: error:")]
    assert len(errors) == 1 and message in errors[0], run.output
    assert "Traceback" not in run.output


def test_bad_config_file_is_refused_before_training(tmp_path):
    config = tmp_path / "guard.yaml"
    config.write_text("detectors:\n  magnitude:\n    total_norm_maxx: 5\n")
    run = run_tiny(tmp_path / "out", "--config", str(config))
    assert run.returncode == 2
    assert "unknown config key detectors.magnitude.total_norm_maxx" in run.output
    assert "valid keys: enabled, param_norm_max, total_norm_max" in run.output
    assert "Traceback" not in run.output
