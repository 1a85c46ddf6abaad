"""The loss-spike detector's statistic and its pieces, without a process group: the robust baseline
(median and MAD of log(loss) over a window), the detector's feeds and verdicts, its bounds and its
message (megatron_patches/detectors/loss.py)."""

import math
import random

import pytest
import torch

from megatron_patches.config import Config, LossSpikeConfig
from megatron_patches.detectors import CheckContext, build
from megatron_patches.detectors.loss import Baseline, LossSpike, above_the_others, feed_loss, median
from megatron_patches.incident_text import spike_text
from megatron_patches.errors import ConfigError


def noisy(n: int, level: float = 2.0, spread: float = 0.03, seed: int = 0) -> list:
    draw = random.Random(seed)
    return [level * math.exp(draw.gauss(0.0, spread)) for _ in range(n)]


def warmed(cfg: LossSpikeConfig, losses: list) -> Baseline:
    baseline = Baseline(cfg)
    for loss in losses:
        baseline.add(loss)
    return baseline


def ctx(replay: bool = False) -> CheckContext:
    return CheckContext(step=1, entries=[], grads=[], norms=None, device=torch.device("cpu"), replay=replay)


def test_median_of_odd_and_even_counts():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_nothing_is_judged_before_warmup_steps_accepted_losses():
    cfg = LossSpikeConfig(warmup_steps=5, window=10)
    baseline = warmed(cfg, [2.0] * 4)
    assert baseline.judge(100.0) is None
    baseline.add(2.0)
    assert baseline.judge(100.0)["spike"]


def test_a_jump_past_the_factor_on_a_steady_loss_is_a_spike_and_one_below_it_is_not():
    cfg = LossSpikeConfig(factor=1.5, zscore=8.0)
    baseline = warmed(cfg, noisy(100))
    below, above = baseline.judge(2.0 * 1.4), baseline.judge(2.0 * 1.7)
    assert not below["spike"] and below["z"] > 8  # far out in deviations, but under the factor
    assert above["spike"] and 1.6 < above["ratio"] < 1.8 and above["median"] == pytest.approx(2.0, rel=0.02)


def test_a_noisy_loss_needs_more_than_the_factor():
    """Past the factor, not past zscore robust deviations: a loss that swings 30 % from step to step."""
    cfg = LossSpikeConfig(factor=1.5, zscore=8.0)
    baseline = warmed(cfg, noisy(100, spread=0.3))
    judged = baseline.judge(2.0 * 2.0)
    assert judged["ratio"] > 1.5 and judged["z"] < 8 and not judged["spike"]
    assert baseline.judge(2.0 * 40)["spike"]


def test_non_finite_and_non_positive_losses_are_neither_judged_nor_kept():
    cfg = LossSpikeConfig(warmup_steps=3, window=5)
    baseline = warmed(cfg, [1.0, 1.1, 0.9])
    for bad in (math.nan, math.inf, 0.0, -1.0):
        assert baseline.judge(bad) is None
        baseline.add(bad)
    assert len(baseline.logs) == 3


def test_the_window_keeps_the_latest_losses_only():
    cfg = LossSpikeConfig(warmup_steps=3, window=5)
    baseline = warmed(cfg, [100.0] * 5 + [1.0] * 5)
    assert len(baseline.logs) == 5 and baseline.judge(1.0)["median"] == pytest.approx(1.0)


def judge_fed(detector: LossSpike, loss: float, replay: bool = False, accepted: bool = True) -> list:
    detector.feed(loss)
    kinds = detector.verdict(ctx(replay), [0.0, 0.0])
    detector.commit(ctx(replay), accepted=accepted and not kinds)
    return kinds


def test_the_detector_judges_a_fed_float_a_replay_again_and_nothing_unfed():
    detector = LossSpike(LossSpikeConfig(warmup_steps=20, window=50))
    assert [judge_fed(detector, loss) for loss in noisy(30)] == [[]] * 30
    assert judge_fed(detector, 10.0, replay=True) == ["loss_spike"]  # a replay sees it, and does not add it
    assert len(detector.baseline.logs) == 30
    assert judge_fed(detector, 10.0) == ["loss_spike"]
    assert len(detector.baseline.logs) == 31
    assert detector.verdict(ctx(), [0.0, 0.0]) == []  # nothing fed: nothing judged


def test_one_spike_leaves_the_median_where_it_was_and_a_lasting_shift_is_absorbed():
    """Flagged losses join the window: the median ignores a spike (the next one is flagged as the
    first was), and a new level of loss stops being flagged within window / 2 steps."""
    detector = LossSpike(LossSpikeConfig(warmup_steps=20, window=40))
    for loss in noisy(40):
        judge_fed(detector, loss)
    assert judge_fed(detector, 10.0) == judge_fed(detector, 10.0) == ["loss_spike"]
    shifted = [judge_fed(detector, loss) for loss in noisy(40, level=8.0, seed=1)]
    assert shifted[0] == ["loss_spike"] and shifted[-1] == [] and sum(map(bool, shifted)) <= 20


@pytest.mark.parametrize("pairs", [True, False], ids=["sum-and-count", "micro-batch-means"])
def test_schedule_loss_tensors_ride_the_vector_and_the_quotient_is_the_loss(pairs):
    """Megatron-LM's path: (sum, count) per micro-batch, or a mean per micro-batch, into two slots;
    the verdict divides the reduced sums (two ranks with the same pair: the same quotient)."""
    detector = LossSpike(LossSpikeConfig(warmup_steps=1, window=5))
    detector.baseline.add(2.0)
    if pairs:
        losses = [{"lm loss": torch.tensor([6.0, 3.0])}, {"lm loss": torch.tensor([12.0, 3.0])}]
        expected = 3.0
    else:
        losses = [{"lm loss": torch.tensor(2.0)}, {"lm loss": torch.tensor(4.0)}]
        expected = 3.0
    detector.feed_tensors(losses)
    out = torch.zeros(detector.width())
    detector.local(ctx(), out)
    reduced = (2 * out).tolist()  # two tensor-parallel copies of the same last stage
    assert reduced[0] / reduced[1] == pytest.approx(expected)
    detector.verdict(ctx(), reduced)
    assert detector._loss == pytest.approx(expected)


def test_a_stage_without_a_loss_or_an_unknown_loss_adds_zeros():
    detector = LossSpike(LossSpikeConfig())
    for losses in ([], [{"lm loss": torch.tensor([1.0, 2.0, 3.0])}], [{"lm loss": 1.5}]):
        detector.feed_tensors(losses)
        out = torch.zeros(2)
        detector.local(ctx(), out)
        assert out.tolist() == [0.0, 0.0]
        assert detector.verdict(ctx(), out.tolist()) == []


def test_the_window_travels_in_the_state_dict():
    cfg = LossSpikeConfig(warmup_steps=3, window=5)
    first = LossSpike(cfg)
    first.baseline = warmed(cfg, [1.0, 1.2, 0.9])
    second = LossSpike(cfg)
    second.load_state_dict(first.state_dict())
    assert list(second.baseline.logs) == list(first.baseline.logs) and second.baseline.warm


def test_on_by_default_and_off_when_switched_off():
    names = lambda config: [d.name for d in build(config, lambda: None)]
    assert "loss_spike" in names(Config())
    assert "loss_spike" not in names(Config.from_dict({"detectors": {"loss_spike": {"enabled": False}}}))


@pytest.mark.parametrize("data, message", [
    ({"factor": 1}, "`detectors.loss_spike.factor` must be > 1, got 1"),
    ({"zscore": 0}, "`detectors.loss_spike.zscore` must be > 0, got 0"),
    ({"window": 0}, "`detectors.loss_spike.window` must be >= 1, got 0"),
    ({"warmup_steps": 200}, "`detectors.loss_spike.warmup_steps` must be <= `detectors.loss_spike.window` (100), "
                            "got 200: lower warmup_steps or raise window"),
])
def test_bad_values_are_one_line_naming_the_key_and_value(data, message):
    with pytest.raises(ConfigError) as caught:
        Config.from_dict({"detectors": {"loss_spike": data}})
    assert str(caught.value) == message


def test_ranks_above_the_others_are_named_only_where_the_ranks_differ():
    assert above_the_others({0: 2.0, 1: 2.1, 2: 9.0, 3: 1.9}, 1.5) == [2]
    assert above_the_others({0: 2.0, 1: 2.0}, 1.5) == []  # one replica's loss, copied: nothing to tell apart


def test_the_message_says_when_nothing_else_points_anywhere():
    field = {"why": "loss 9 is 4.5x its median 2", "rank_losses": {0: 9.0, 1: 9.0}, "ranks_above": []}
    assert spike_text(field, True, None) == ("loss 9 is 4.5x its median 2; nothing else points anywhere: no gradient, "
                                             "held weight or optimizer state was flagged")
    field = {**field, "rank_losses": {0: 16.0, 1: 2.0}, "ranks_above": [0]}
    assert spike_text(field, True, None).endswith(", and rank(s) [0] alone stood above the other ranks' losses")
    assert spike_text(field, True, "non-finite exp_avg first at w").startswith("loss 9 is 4.5x its median 2; non-finite")
    assert spike_text(field, False, "zscore in gradients").startswith("zscore in gradients; loss 9")


def test_feed_loss_reaches_the_detector_with_a_float_or_the_schedules_tensors_and_nothing_else():
    detector = LossSpike(LossSpikeConfig())
    feed_loss([object(), detector], 2.5, local=2.0)
    assert (detector._value, detector._local, detector._tensors) == (2.5, 2.0, None)
    feed_loss([detector], ({"lm loss": torch.tensor(1.0)},))
    assert detector._value is None and len(detector._tensors) == 1
    feed_loss([], 2.5)  # the detector switched off: nothing to feed, nothing fails
