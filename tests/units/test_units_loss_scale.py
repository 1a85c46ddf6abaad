"""The fp16 loss-scale rule (megatron_patches.seams.loss_scale) on Megatron's own grad scalers, in process:
which skips are the scaler's business and which are incidents."""

from types import SimpleNamespace

import pytest

from megatron_patches.config import LossScaleConfig
from megatron_patches.seams.loss_scale import HISTORY_LIMIT, LossScaleWatch
from megatron_patches.testing.cpu import cpu_runtime

grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")


def scaler(initial=2.0 ** 32, min_scale=1.0, hysteresis=2):
    with cpu_runtime():  # Megatron's scalers keep their scale in a CUDA tensor
        return grad_scaler.DynamicGradScaler(initial_scale=initial, min_scale=min_scale, growth_factor=2.0,
                                             backoff_factor=0.5, growth_interval=1000, hysteresis=hysteresis)


def optimizer(grad_scaler_):
    """What the watch reads of a ChainedOptimizer: its leaves' grad_scaler."""
    return SimpleNamespace(chained_optimizers=[SimpleNamespace(grad_scaler=grad_scaler_)])


def skip(watch, opt):
    """One overflow, as Megatron's step does it: the scaler updates, then the guard looks."""
    opt.chained_optimizers[0].grad_scaler.update(True)
    return watch.overflow(opt)


def test_calibration_from_two_to_the_32_is_not_counted():
    watch, opt = LossScaleWatch(LossScaleConfig()), optimizer(scaler())
    events = [skip(watch, opt) for _ in range(20)]  # 20 > max_consecutive_skips: still calibrating
    assert events == [None] * 20 and not watch.settled
    opt.chained_optimizers[0].grad_scaler.update(False)
    watch.clear()
    assert watch.settled


def test_after_a_success_a_run_of_skips_is_an_incident_with_its_scale_history():
    watch, opt = LossScaleWatch(LossScaleConfig(max_consecutive_skips=3)), optimizer(scaler(initial=2.0 ** 16))
    watch.clear()  # a step succeeded
    assert [skip(watch, opt) is None for _ in range(2)] == [True, True]
    event = skip(watch, opt)
    assert event is not None and event.why.startswith("3 consecutive overflow skips")
    field = event.record_field()
    assert field["dynamic"] and field["skips"] == 3 and field["history"] == sorted(field["history"], reverse=True)
    assert field["scale"] == field["history"][-1]
    assert skip(watch, opt) is None  # the count starts again after an incident


def test_a_collapse_to_the_scalers_own_floor_is_an_incident_even_while_calibrating():
    watch, opt = LossScaleWatch(LossScaleConfig()), optimizer(scaler(initial=64.0, min_scale=4.0, hysteresis=1))
    events = [skip(watch, opt) for _ in range(5)]  # 32, 16, 8, 4 (the floor), 4
    assert events[:3] == [None] * 3
    assert events[3].why.startswith("loss scale collapsed to 4 after 4 overflow skip(s)") and events[3].scale == 4.0
    assert events[4] is not None  # every skip at the floor is one: the grading's persistence rule sees them
    assert len(events[4].history) == 5


def test_a_constant_scale_makes_every_overflow_an_incident():
    with cpu_runtime():
        constant = grad_scaler.ConstantGradScaler(1024.0)
    watch, opt = LossScaleWatch(LossScaleConfig()), optimizer(constant)
    event = watch.overflow(opt)
    assert event.why == "overflow with a constant loss scale (1024)" and event.record_field() == {
        "scale": 1024.0, "dynamic": False, "skips": 1, "history": [1024.0]}


def test_disabled_leaves_every_dynamic_skip_to_the_scaler_and_history_stays_bounded():
    watch, opt = LossScaleWatch(LossScaleConfig(enabled=False)), optimizer(scaler(initial=2.0 ** 100, hysteresis=1))
    watch.clear()
    assert all(skip(watch, opt) is None for _ in range(HISTORY_LIMIT + 10))
    assert len(watch._history) == HISTORY_LIMIT

