"""A drill per cause class through the tiny-GPT harness, each with its expected cause and response and a
negative control, and the device that corrupts twice fenced (megatron_patches.cause, cause_response)."""

import json

import pytest

from conftest import assert_trained, run_tiny

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
MLP0 = "decoder.layers.0.mlp"


def ledger(out):
    return json.loads((out / "checkpoints" / "megatron_patches_ledger.json").read_text())


@pytest.mark.multiproc
def test_a_nan_in_a_ranks_adam_state_is_hardware_none_blacklisted_and_the_second_fences_the_device(tmp_path):
    # The measured bug (DP2, bf16, distributed optimizer, checkpoints every 4 steps): the corrupt exp_avg_sq
    # reproduced the NaN on replay, and the run blacklisted the innocent samples of the steps after it.
    state = f"nan:phase=state,slot=exp_avg_sq,param={FC1},rank=0"
    run = run_tiny(tmp_path, "--steps", "20", "--save-interval", "4", "--precision", "bf16", "--distributed-optimizer",
                   "--inject", state.replace("nan:", "nan:step=6,"), "--inject", state.replace("nan:", "nan:step=14,"),
                   nproc=2)
    assert run.returncode == 88, run.output[-3000:]
    first, second = run.incidents
    # The first corruption: hardware on rank 0's device, rolled back at once, no sample blacklisted. The
    # held-state check (detectors.state) reads it at the step it happened, before any gradient went
    # non-finite, so a replay of that step is clean; without the check it was found a step later.
    assert first["replay"]["verdict"] == "transient"
    assert (first["cause"]["class"], first["cause"]["confidence"]) == ("hardware", "high")
    assert first["cause"]["devices"][0]["rank"] == 0
    assert "non-finite values in the weights or optimizer state held on rank(s) 0" in first["cause"]["evidence"]
    assert (first["step"], first["action"], first["rolled_back_to"], first["blacklisted"]) == (6, "rollback", 4, [])
    # The second on the same device fences it: every rank exits 88, one line names the host and device.
    assert (second["step"], second["severity"], second["action"], second["blacklisted"]) == (14, "critical", "fence", [])
    device = first["cause"]["devices"][0]
    line = (f"fence: exclude host {device['host']} device {device['device']} (rank 0): 2 hardware-class incidents "
            "in this job, at steps [6, 14]; every rank exits with 88")
    assert run.output.count(line) == 1, run.output[-3000:]
    kept = ledger(tmp_path)
    assert kept["blacklist"] == [] and [e["step"] for e in kept["hardware"]] == [6, 14]
    assert kept["fenced"] == {"host": device["host"], "device": device["device"], "rank": 0, "step": 14, "incidents": 2}


def test_a_poisoned_sample_is_data_and_its_micro_batch_blacklisted_where_a_transient_nan_is_hardware(tmp_path):
    run = run_tiny(tmp_path / "poison", "--steps", "8", "--inject", "poison:sample=45")
    assert_trained(run, min_drop=0.0)
    (record,) = run.incidents
    assert (record["cause"]["class"], record["cause"]["confidence"]) == ("data", "high")
    assert record["replay"]["narrowed"] and record["blacklisted"] == [44, 45, 46, 47]
    # Negative control: a NaN that the replay does not reproduce is no data fault: nothing blacklisted.
    control = run_tiny(tmp_path / "transient", "--steps", "8", "--inject", f"inf:step=5,param={FC1}")
    assert_trained(control, min_drop=0.0)
    (record,) = control.incidents
    assert (record["cause"]["class"], record["replay"]["verdict"], record["blacklisted"]) == ("hardware", "transient", [])


def test_a_nan_on_every_micro_batch_from_the_first_step_is_software_and_stops_with_the_evidence(tmp_path):
    run = run_tiny(tmp_path / "bug", "--steps", "6", "--inject", f"nan:step=1,count=50,phase=forward,module={MLP0}")
    assert run.returncode == 86, run.output[-3000:]
    (record,) = run.incidents
    assert (record["step"], record["severity"], record["action"], record["blacklisted"]) == (1, "critical", "stop", [])
    assert record["cause"]["class"] == "software"
    assert "cause software (non-finite on every replica from the job's first checked step" in record["reason"]
    # Negative control: the same fault from step 3 (clean checks before it) is no software bug; training goes on.
    control = run_tiny(tmp_path / "later", "--steps", "4", "--inject", f"nan:step=3,phase=forward,module={MLP0}")
    assert control.returncode == 0, control.output[-3000:]
    (record,) = control.incidents
    assert record["cause"]["class"] == "data" and record["action"] == "skip_step"


def test_a_growing_gradient_norm_is_numerics_rolled_back_with_a_lower_lr_and_nothing_blacklisted(tmp_path):
    # A stand-in for an LR-induced divergence: Adam on the tiny model stays finite from lr 0.05 to 100
    # (measured), so the growth drill multiplies FC1's gradient by 4 each step until the magnitude limit trips.
    config = tmp_path / "guard.yaml"
    config.write_text("detectors: {magnitude: {param_norm_max: 1000}, peers: {enabled: false}, history: {enabled: false}}\n"
                      "scene: {enabled: false}\n")
    run = run_tiny(tmp_path, "--steps", "12", "--save-interval", "2", "--config", str(config),
                   "--inject", f"growth:step=2,count=8,factor=4,param={FC1}")
    result = assert_trained(run, min_drop=0.0)
    warning, error = run.incidents
    for record in (warning, error):
        assert record["cause"]["class"] == "numerics" and record["blacklisted"] == []
        assert record["cause"]["evidence"][0].startswith("gradient norm rose")
    assert (error["action"], error["lr_scale"], result["lr_scale"]) == ("rollback", 0.5, 0.5)
    assert ledger(tmp_path)["blacklist"] == [] and ledger(tmp_path)["hardware"] == []
