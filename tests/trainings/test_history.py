"""Gradient-norm history: finite spikes and explosions still building up are caught and named;
the baseline survives a checkpoint; clean trainings raise nothing."""

import io
import math

import pytest
import torch

from conftest import assert_trained, run_tiny

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

FC2 = "decoder.layers.0.mlp.linear_fc2.weight"
PROJ = "decoder.layers.1.self_attention.linear_proj.weight"


def test_finite_spike_x100_is_a_zscore_incident_naming_the_parameter(tmp_path):
    run = run_tiny(tmp_path, "--steps", "40", "--inject", f"spike:step=30,param={FC2},factor=100")
    result = assert_trained(run)
    [record] = run.incidents
    assert (record["step"], record["kind"], record["action"]) == (30, "zscore", "skip_step")
    assert record["first"]["name"] == FC2 and record["first"]["layer"] == 0
    assert record["first"]["nan"] == record["first"]["inf"] == 0 and record["first"]["norm"] > 0
    assert {p["name"] for p in record["params"]} == {FC2}
    assert result["skipped_steps"] == 1


def test_growing_gradient_is_caught_long_before_it_overflows(tmp_path):
    # x1.5, x2.25, x3.4, ... from step 30: fp32 would overflow after ~220 such steps.
    run = run_tiny(tmp_path, "--steps", "50", "--save-interval", "10",
                   "--inject", f"growth:step=30,count=20,param={PROJ},factor=1.5")
    assert_trained(run)
    first = run.incidents[0]
    assert first["kind"] in ("zscore", "drift")
    assert first["first"]["name"] == PROJ
    growth = 1.5 ** (first["step"] - 30 + 1)
    print(f"caught at step {first['step']} ({first['kind']}): gradient x{growth:.1f}, norm {first['first']['norm']:.3g}")
    assert first["step"] <= 38 and growth < 100
    assert math.isfinite(first["first"]["norm"])


def test_layer_level_flag_names_the_largest_contributor(tmp_path):
    config = tmp_path / "guard.yaml"
    config.write_text("detectors:\n  history:\n    per_param: false\n")
    run = run_tiny(tmp_path / "out", "--steps", "40", "--config", str(config),
                   "--inject", f"spike:step=30,param={FC2},factor=100")
    assert_trained(run)
    [record] = run.incidents
    assert (record["step"], record["kind"]) == (30, "zscore")
    assert record["first"]["name"] == FC2
    levels = {t["level"] for t in record["history"]["tripped"]}
    assert "layer 0" in levels and "parameters" not in levels


# --- the baseline survives a checkpoint ----------------------------------------------------


class _Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.mlp = torch.nn.ModuleDict({"linear_fc1": torch.nn.Linear(width, 4 * width),
                                        "linear_fc2": torch.nn.Linear(4 * width, width)})


class _Model(torch.nn.Module):
    """Shaped like a GPT's decoder, so names and layers come out as in a real model."""

    def __init__(self, layers: int = 2, width: int = 16):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(_Layer(width) for _ in range(layers))
        self.config = type("Config", (), {"num_layers": layers})()


@pytest.fixture
def megatron_on_this_machine():
    """megatron-core's optimizer makes a CUDA tensor; without CUDA, the CPU test runtime."""
    if torch.cuda.is_available():
        yield
        return
    from megatron_patches.testing import cpu

    with cpu.cpu_runtime():
        yield


def _guarded_optimizer(tmp_path, model, **history):
    """megatron-core's real FP32Optimizer, guarded by a fresh monitor (as after a restart)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer

    from megatron_patches.seams import wrappers, patching
    from megatron_patches import runtime
    from megatron_patches.config import Config
    from megatron_patches.seams import build_monitor

    runtime.uninstall()
    # runtime.install() without its logging setup, which would hide records from later caplog tests.
    monitor = build_monitor(Config.from_dict({"report_dir": str(tmp_path), "grad_history": False,
                                            "detectors": {"history": history}}))
    wrappers.set_monitor(monitor)
    patching.install()
    optimizer = FP32Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), OptimizerConfig(lr=0.0), lambda opt: None)
    wrappers.register_model(optimizer, [model])
    return monitor, optimizer


def _grads(model, step: int, spike: str = None):
    gen = torch.Generator().manual_seed(step)
    for index, (name, param) in enumerate(model.named_parameters()):
        scale = 0.01 * (index + 1) * math.exp(0.2 * torch.randn((), generator=gen).item())
        param.main_grad = torch.randn(param.shape, generator=gen) * scale * (100.0 if name == spike else 1.0)


def _step(monitor, optimizer, model, step: int, spike: str = None) -> bool:
    _grads(model, step, spike)
    monitor.set_step(step)
    return optimizer.prepare_grads()  # True: the monitor says skip


def test_baseline_survives_state_dict_and_the_first_step_after_restore_is_checked(
        tmp_path, clean_patches, megatron_on_this_machine):
    from megatron_patches.incidents import INCIDENTS_FILE

    model, spiked = _Model(), "decoder.layers.1.mlp.linear_fc1.weight"
    monitor, optimizer = _guarded_optimizer(tmp_path / "before", model)
    assert not any(_step(monitor, optimizer, model, step) for step in range(1, 31))
    saved = io.BytesIO()
    torch.save(monitor.state_dict(), saved)  # as a checkpoint carries it

    # A restart: new monitor, new optimizer, state loaded; the very first step holds a spike.
    monitor, optimizer = _guarded_optimizer(tmp_path / "after", model)
    saved.seek(0)
    monitor.load_state_dict(torch.load(saved, weights_only=False))
    assert _step(monitor, optimizer, model, 31, spike=spiked) is True
    record = (tmp_path / "after" / INCIDENTS_FILE).read_text().splitlines()
    assert len(record) == 1 and '"kind":"zscore"' in record[0] and f'"name":"{spiked}"' in record[0]
    history = next(d for d in monitor.state.detectors if d.name == "history").state_dict()
    assert history["total"]["count"] == [30.0]  # the skipped step did not enter the baseline

    # Without the state the same step is in warm-up: nothing to compare with, nothing flagged.
    monitor, optimizer = _guarded_optimizer(tmp_path / "fresh", model)
    assert _step(monitor, optimizer, model, 31, spike=spiked) is False


def test_detector_state_round_trip_is_exact(tmp_path, clean_patches, megatron_on_this_machine):
    from megatron_patches.config import HistoryConfig
    from megatron_patches.detectors.history import HistoryDetector

    model = _Model()
    monitor, optimizer = _guarded_optimizer(tmp_path, model)
    for step in range(1, 26):
        _step(monitor, optimizer, model, step)
    original = next(d for d in monitor.state.detectors if d.name == "history")
    restored = HistoryDetector(HistoryConfig())
    restored.load_state_dict(original.state_dict())
    assert restored.state_dict() == original.state_dict()


def test_sampling_and_interval_cover_every_tensor_in_turn(tmp_path, clean_patches, megatron_on_this_machine):
    model = _Model()
    monitor, optimizer = _guarded_optimizer(tmp_path, model, sample_fraction=0.25, interval=2)
    for step in range(1, 81):
        _step(monitor, optimizer, model, step)
    state = next(d for d in monitor.state.detectors if d.name == "history").state_dict()
    assert state["total"]["count"] == [40.0]  # every 2nd of 80 checks
    assert set(state["params"]["count"]) == {10.0}  # each tensor on every 4th of those 40


# --- clean trainings raise nothing ------------------------------------------------------


def _false_positives(tmp_path, seeds, precisions, steps):
    found = {}
    for precision in precisions:
        for seed in seeds:
            run = run_tiny(tmp_path / f"{precision}-{seed}", "--steps", str(steps), "--seed", str(seed),
                           "--precision", precision)
            assert_trained(run)
            found[(precision, seed)] = [(r["step"], r["kind"]) for r in run.incidents]
    count = sum(len(v) for v in found.values())
    print(f"false positives over {len(found)} clean runs of {steps} steps: {count} {found}")
    return count, found


def test_clean_training_raises_nothing_in_any_precision(tmp_path):
    count, found = _false_positives(tmp_path, seeds=[7], precisions=["fp32", "bf16", "fp16"], steps=100)
    assert count == 0, found


@pytest.mark.slow
def test_clean_training_sweep_raises_nothing(tmp_path):
    count, found = _false_positives(tmp_path, seeds=[1, 2, 3], precisions=["fp32", "bf16", "fp16"], steps=150)
    assert count == 0, found


def test_resume_keeps_the_history_baseline_end_to_end(tmp_path):
    """A checkpoint carries the detectors' baselines: the first steps after --resume are judged
    against the pre-restart history instead of starting a fresh warm-up."""
    from conftest import run_tiny

    first = run_tiny(tmp_path, "--steps", "30", "--save-interval", "30")
    assert first.returncode == 0, first.output[-2000:]
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    resumed = run_tiny(tmp_path, "--steps", "34", "--resume", "--inject", f"spike:step=31,param={name},factor=100")
    assert resumed.returncode == 0, resumed.output[-2000:]
    records = [r for r in resumed.incidents if r["step"] == 31]
    assert len(records) == 1 and records[0]["kind"] == "zscore", resumed.incidents
    assert records[0]["first"]["name"] == name


# --- shares: a loss spike that lifts the whole model is not a fault in each tensor ---------


def test_shares_remove_the_common_mode_and_keep_a_lone_spike():
    import numpy as np

    from megatron_patches.detectors.history import shares

    norms = np.array([1.0, 2.0, 3.0, 0.5])
    base = shares(norms)
    assert base[0] == pytest.approx(1.0 / math.sqrt(4.0 + 9.0 + 0.25))
    assert np.allclose(shares(norms * 7.0), base)  # everything x7 at once: no share moves
    spiked = norms.copy()
    spiked[1] *= 100.0
    out = shares(spiked)
    assert out[1] == pytest.approx(100.0 * base[1])  # the rest of the model is unchanged for it
    assert np.all(out[[0, 2, 3]] < base[[0, 2, 3]])  # the others' rest grew: their shares fell
    as_torch = shares(torch.tensor(spiked, dtype=torch.float32))
    assert as_torch.dtype == torch.float32 and np.allclose(as_torch.numpy(), out, rtol=1e-6)
    # A non-finite norm is in no one's rest (the non-finite check owns it); a zero share is
    # invalid to the detector; a series alone (or holding all of the sum) reads as 1e8.
    assert list(shares(np.array([np.inf, 1.0, 1.0]))[1:]) == [1.0, 1.0]
    assert shares(np.array([0.0, 1.0]))[0] == 0.0
    assert shares(np.array([3.0]))[0] == pytest.approx(1e8)


def test_a_baseline_of_raw_norms_from_an_older_version_is_dropped(caplog):
    from megatron_patches.config import HistoryConfig
    from megatron_patches.detectors.history import HistoryDetector

    old = {"version": 1, "checks": 40, "total": {"mean": [0.1], "var": [0.01], "count": [40.0], "last": [0.1],
                                                 "run": [0.0]}}
    import logging

    detector = HistoryDetector(HistoryConfig())
    logger = logging.getLogger("megatron_patches")  # an earlier runtime.install() may have stopped propagation
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="megatron_patches"):
            detector.load_state_dict(old)
    finally:
        logger.removeHandler(caplog.handler)
    assert "older kind" in caplog.text
    assert "total" not in detector.state_dict()  # warms up again instead of judging shares by norms


def test_vocabulary_tensors_and_their_slots_are_left_to_peers():
    from megatron_patches.detectors.history import is_vocabulary, judged_slots

    assert is_vocabulary("embedding.word_embeddings.weight") and is_vocabulary("output_layer.weight")
    assert not is_vocabulary("embedding.position_embeddings.weight")
    assert not is_vocabulary("decoder.layers.0.mlp.linear_fc1.weight")
    assert judged_slots(4).tolist() == [True, True, False, False]  # layer 0, layer 1, embedding, output
