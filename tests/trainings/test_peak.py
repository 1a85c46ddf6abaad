"""Gradient peaks (``detectors.peak``, off by default): one gradient element x1,000 lifts its
tensor's norm about 8x, under every norm check, and its crest factor (largest magnitude over RMS)
about 20x; the detector names the tensor, and under DP2 the pass before the reduction names the
replica it came from. Its clean trainings: tests/trainings/test_opt_in_clean.py."""

import pytest
import torch

from conftest import detectors_config, run_tiny
from megatron_patches.config import Config
from megatron_patches.errors import ConfigError
from megatron_patches.detectors.peak import crest_factors

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
ONE_ELEMENT = f"scale:step=30,param={FC1},scope=element,seed=1234,factor=1000"


def _config(where, peak: bool) -> str:
    return detectors_config(where, peak=peak)


@pytest.mark.multiproc
@pytest.mark.parametrize("megatron_check", [(), ("--check-for-nan-in-grad", "--overlap-grad-reduce")],
                         ids=["own-pass", "megatron-bucket-check"])
def test_one_gradient_element_x1000_on_one_replica_is_named_there(tmp_path, megatron_check):
    """DP2, bf16, distributed optimizer: the element is multiplied on rank 1 before the reduction;
    rank 0's shard holds the parameter, so only the pre-reduction pass can say where it came from.
    With Megatron's own bucket check (Megatron-LM's default) its norms stand in for the pass's, but
    the crest factors still come from a pass of the guard's own, after the drill."""
    spec = f"{ONE_ELEMENT},phase=local,rank=1"
    args = ("--steps", "33", "--precision", "bf16", "--distributed-optimizer", *megatron_check, "--inject", spec)
    run = run_tiny(tmp_path / "on", *args, "--config", _config(tmp_path, True), nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    assert (record["step"], record["kind"], record["action"]) == (30, "peak", "skip_step")
    assert record["origin_ranks"] == [1]
    assert (record["first"]["name"], record["first"]["ranks"]["global"]) == (FC1, 1)
    assert record["first"]["reasons"] == ["local_peak", "pre_reduction"]
    if not megatron_check:  # negative control: the guard's defaults let the same fault pass
        off = run_tiny(tmp_path / "off", *args, "--config", _config(tmp_path, False), nproc=2)
        assert off.returncode == 0 and off.incidents == [], off.output[-3000:]


def test_one_reduced_gradient_element_x1000_is_named_on_one_rank(tmp_path):
    run = run_tiny(tmp_path, "--steps", "33", "--precision", "bf16", "--config", _config(tmp_path, True),
                   "--inject", f"{ONE_ELEMENT},phase=grad,rank=0")
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    assert (record["step"], record["kind"], record["first"]["name"]) == (30, "peak", FC1)
    assert record["first"]["reasons"] == ["peak"]
    assert record["peak"] == {"tensors": 1, "zscore": 8.0, "min_ratio": 8.0}


def test_crest_factor_is_the_largest_magnitude_over_the_rms_and_zero_where_undefined():
    grads = [torch.tensor([3.0, -4.0]), torch.zeros(3), torch.tensor([1.0, float("inf")])]
    maxabs = torch.stack([g.abs().max() for g in grads])
    norms = torch.stack([g.norm() for g in grads])
    sizes = torch.tensor([2.0, 3.0, 2.0])
    crest = crest_factors(maxabs, norms, sizes).tolist()
    assert crest[0] == pytest.approx(4.0 / (5.0 / 2 ** 0.5)) and crest[1:] == [0.0, 0.0]


@pytest.mark.parametrize("key, value, message", [
    ("min_ratio", 0.5, "min_ratio"),
    ("zscore", 0, "zscore"),
    ("warmup_steps", 0, "warmup_steps"),
    ("ema_beta", 1.5, "ema_beta"),
])
def test_settings_are_validated(key, value, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"detectors": {"peak": {key: value}}})
    assert not Config().detectors.peak.enabled
