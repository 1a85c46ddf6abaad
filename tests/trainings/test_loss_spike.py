"""The loss as a signal (``detectors.loss_spike``, on by default) on real tiny trainings: a fault
that lifts one step's loss with finite gradients is found, skipped and recorded with what else
pointed anywhere; with the signal switched off the same fault goes by unseen; clean trainings
raise nothing; and the same through Megatron-LM's own loop, where the loss rides the check's
all-reduce instead of arriving as a host float."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics

import pytest

from conftest import TEXT_DATA, clean_incidents, detectors_config, run_packaged_loop, run_tiny

DRILL_STEP = 240
DRILL = f"noise:step={DRILL_STEP},phase=forward,module=output_layer,factor=1.0,scope=all"
"""Gaussian noise of the logits' own size on one step: a corrupted activation that lifts the loss
(x2.9 on real text at step 240, bf16) with every gradient finite, none far off its history."""
ARGS = ("--steps", str(DRILL_STEP + 2), "--seed", "3", "--precision", "bf16", *TEXT_DATA, "--inject", DRILL)


@pytest.mark.one_line
def test_a_loss_spike_is_found_and_skipped_and_missed_with_the_signal_switched_off(tmp_path):
    on = run_tiny(tmp_path / "on", *ARGS, "--config", detectors_config(_dir(tmp_path / "on-config"), loss_spike=True))
    off = run_tiny(tmp_path / "off", *ARGS, "--config", detectors_config(_dir(tmp_path / "off-config"), loss_spike=False))
    assert on.returncode == 0 and off.returncode == 0, (on.output + off.output)[-4000:]
    # The fault lifts the loss of its step in both runs alike, and nothing before it differs.
    before = DRILL_STEP - 1
    assert on.result["losses"][:DRILL_STEP] == off.result["losses"][:DRILL_STEP]
    assert on.result["losses"][before] > 2 * max(on.result["losses"][before - 10:before])
    # Signal off: missed, and its update applied.
    assert off.incidents == [] and off.result["skipped_steps"] == 0, off.incidents
    # Signal on: one incident at the drill's step, the loss alone pointing at it, the update skipped.
    (incident,) = on.incidents
    assert (incident["step"], incident["kinds"], incident["severity"], incident["action"]) == \
        (DRILL_STEP, ["loss_spike"], "warning", "skip_step")
    spike = incident["loss_spike"]
    assert spike["ratio"] > 2 and spike["z"] > spike["zscore"] and spike["baseline_steps"] == 100
    assert spike["loss"] == pytest.approx(on.result["losses"][before])
    assert spike["rank_losses"] == {"0": pytest.approx(spike["loss"])}
    assert "nothing else points anywhere" in incident["message"] and incident["params"] == []
    assert [d["drill"] for d in incident["injected"]] == [DRILL]
    assert incident["replay"]["verdict"] == "deterministic"  # the replay lifted the loss again
    assert on.result["skipped_steps"] == 1


@pytest.mark.one_line
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_clean_training_raises_no_loss_spike(tmp_path, precision):
    """300 steps on the harness's synthetic data at the defaults (280 of them judged)."""
    found = clean_incidents(tmp_path / "out", detectors_config(tmp_path), 1, ("--precision", precision), steps=300)
    assert found == [], found


@pytest.mark.slow
@pytest.mark.one_line
@pytest.mark.parametrize("data", [(), TEXT_DATA], ids=["synthetic", "text"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_2000_clean_steps_raise_no_loss_spike(tmp_path, precision, data):
    """The runs docs/detectors.md quotes the clean ratio and deviations of (seed 3 on text, 2 synthetic)."""
    found = clean_incidents(tmp_path / "out", detectors_config(tmp_path), 1, ("--precision", precision, *data),
                            steps=2000, seed=3 if data else 2)
    assert found == [], found


MEGATRON_LOOP = importlib.util.find_spec("megatron.training") is not None
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


@pytest.mark.multiproc
@pytest.mark.skipif(not MEGATRON_LOOP, reason="megatron-core ships megatron/training from 0.17 on")
def test_megatron_lms_loop_finds_the_spike_from_the_schedules_loss_tensors(tmp_path):
    """Megatron-LM's packaged loop, 2 ranks (DP2 bf16, distributed optimizer): the loss never reaches
    the host before the update there; the schedule's loss tensors ride the check's all-reduce. The
    drill's iteration is the one incident, its update skipped; the iterations before it are clean."""
    from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS

    step = 24
    config = tmp_path / "guard.yaml"
    config.write_text(f"report_dir: {tmp_path / 'reports'}\nscene: {{enabled: false}}\n"
                      "detectors: {loss_spike: {warmup_steps: 10, window: 20}}\n"
                      # x50: the logits of a model at its initial loss are near zero (mock data: random tokens)
                      f"inject: ['noise:step={step},phase=forward,module=output_layer,factor=50,scope=all']\n")
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PATCHES_CONFIG": str(config),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    code, output = run_packaged_loop(env, [*TINY_GPT_ARGS, "--train-iters", str(step + 1), "--bf16",
                                           "--use-distributed-optimizer"], nproc=2)
    assert code == 0, output[-4000:]
    losses = {int(i): float(v) for i, v in ITERATION.findall(output)}
    assert len(losses) == step + 1 and losses[step] == 0.0  # Megatron logs a skipped iteration's loss as 0
    records = [json.loads(line) for line in (tmp_path / "reports" / "incidents.jsonl").read_text().splitlines()]
    (incident,) = records
    assert (incident["step"], incident["kinds"], incident["action"]) == (step, ["loss_spike"], "skip_step")
    spike = incident["loss_spike"]
    assert spike["ratio"] > 2 and set(spike["rank_losses"]) == {"0", "1"}
    # The baseline is the losses Megatron printed: the median of the last 20 iterations' (to print precision).
    assert spike["median"] == pytest.approx(statistics.median(losses[i] for i in range(step - 20, step)), rel=1e-5)


def _dir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.multiproc
@pytest.mark.one_line
def test_one_replicas_spike_is_named_by_the_ranks_own_losses(tmp_path):
    """DP2 on real text: the logits of rank 1 alone go noisy at step 60 (noise 3x their size; the loss
    still falls fast there, and its history is wide); the job's loss (the mean of the two) spikes, and
    two signals name rank 1: the ranks' own losses, and its own gradients far above their running mean
    before the reduction (the origin, as for any finite fault that one replica alone shows)."""
    step = 60
    drill = f"noise:step={step},phase=forward,module=output_layer,factor=3.0,scope=all,rank=1"
    run = run_tiny(tmp_path / "out", "--steps", str(step + 1), "--seed", "3", "--precision", "bf16", *TEXT_DATA,
                   "--inject", drill, "--config", detectors_config(tmp_path), nproc=2)
    assert run.returncode == 0, run.output[-4000:]
    (incident,) = run.incidents
    assert (incident["step"], incident["kinds"], incident["action"]) == (step, ["loss_spike"], "skip_step")
    spike = incident["loss_spike"]
    losses = spike["rank_losses"]
    assert set(losses) == {"0", "1"} and losses["1"] > 2 * losses["0"]
    assert spike["loss"] == pytest.approx((losses["0"] + losses["1"]) / 2, rel=1e-6)
    assert spike["ranks_above"] == [1] and incident["origin_ranks"] == [1]
    assert "gradient far above its running mean first at" in incident["message"]
    assert "; rank(s) [1] alone stood above the other ranks' losses" in incident["message"]
