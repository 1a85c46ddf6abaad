"""Activations (``detectors.activations``, off by default; the campaign's hole 4): a module's output
multiplied by 1,000, or one element with its exponent's high bit flipped, stays finite and the next
layer norm hides it from every gradient check; its RMS or crest factor against its own history names
the module, and the rank it happened on. Its clean trainings: tests/trainings/test_opt_in_clean.py."""

import pytest

from conftest import detectors_config, run_tiny
from megatron_patches.config import Config
from megatron_patches.errors import ConfigError

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

MLP = "decoder.layers.1.mlp"


def _config(where, enabled: bool) -> str:
    return detectors_config(where, activations=enabled)


@pytest.mark.multiproc
def test_an_output_x1000_on_one_tensor_parallel_rank_is_named_there(tmp_path):
    """TP2: the MLP's output is the same on both ranks after fc2's reduction; the drill scales rank
    1's. The gradients stay inside their spread (the negative control: nothing is found)."""
    drill = f"scale:step=30,phase=forward,module={MLP},rank=1,factor=1000,scope=all,seed=1234"
    args = ("--steps", "33", "--precision", "bf16", "--tp", "2", "--inject", drill)
    run = run_tiny(tmp_path / "on", *args, "--config", _config(tmp_path, True), nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    assert (record["step"], record["kind"], record["action"], record["origin_ranks"]) == (30, "activation", "skip_step", [1])
    assert (record["first"]["name"], record["first"]["layer"], record["first"]["reasons"]) == (MLP, 1, ["activation:rms"])
    assert record["message"].startswith(f"output RMS far above its history first at {MLP} (layer 1, rank 1")
    off = run_tiny(tmp_path / "off", *args, "--config", _config(tmp_path, False), nproc=2)
    assert off.returncode == 0 and off.incidents == [], off.output[-3000:]


def test_one_output_element_with_its_exponent_flipped_is_found_by_the_crest_factor(tmp_path):
    drill = f"bitflip:step=30,phase=forward,module={MLP},bit=exponent_high,scope=element,seed=1234"
    run = run_tiny(tmp_path, "--steps", "31", "--precision", "bf16", "--inject", drill,
                   "--config", _config(tmp_path, True))
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    assert (record["step"], record["kind"], record["first"]["name"]) == (30, "activation", MLP)
    assert "activation:crest" in record["first"]["reasons"]


@pytest.mark.parametrize("key, value, message", [
    ("modules", [], "must be a non-empty list of non-empty names or fnmatch patterns"),
    ("modules", ["decoder.*", ""], "must be a non-empty list"),
    ("zscore", 0, "must be > 0"),
    ("min_ratio", 0.5, "must be >= 1"),
    ("ema_beta", 1.0, "must be between 0 and 1"),
])
def test_a_bad_setting_is_one_line_naming_the_key(key, value, message):
    with pytest.raises(ConfigError) as caught:
        Config.from_dict({"detectors": {"activations": {key: value}}})
    assert f"detectors.activations.{key}" in str(caught.value) and message in str(caught.value)
    assert "\n" not in str(caught.value)
