"""The held-state check (``detectors.state``, issue 56) on hand-made optimizers, no process group:
the rotation covers every held element once per turn, a non-finite or far-off slice is flagged and
named by parameter and tensor, a clean update is not, and certification waits for a full turn."""

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_patches.config import Config
from megatron_patches.errors import ConfigError
from megatron_patches.detectors.base import CheckContext
from megatron_patches.detectors.state import OFF, HeldStateCheck
from megatron_patches.naming import ParamInfo

SETTINGS = Config.from_dict({"detectors": {"state": {"warmup_steps": 1}}}).detectors.state
"""The defaults but a warm-up of one check (the default's 20 keep the baselines at +Inf that long)."""
RANKS = {"global": 0, "tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0, "edp": 0, "etp": 0, "vpp": 0}


def adam_with_state(seed: int = 0):
    """An Adam over two weights after one update, with the monitor's entries for them."""
    torch.manual_seed(seed)
    weights = [torch.nn.Parameter(torch.randn(40, 8) * 0.02), torch.nn.Parameter(torch.randn(13) * 0.02)]
    optimizer = torch.optim.Adam(weights, lr=1e-3)
    for w in weights:
        w.grad = torch.randn_like(w)
    optimizer.step()
    entries = [SimpleNamespace(main=w, model=w, shard=False, info=ParamInfo(name=name, layer=0, order=i,
                                                                            counts_in_norm=True))
               for i, (w, name) in enumerate(zip(weights, ("fc1.weight", "fc1.bias")))]
    return optimizer, entries


def check(detector, step: int, accept: bool = True):
    """One check: the detector's float, its verdict, and (accepted or not) its commit."""
    ctx = CheckContext(step=step, entries=[], grads=[], norms=None, device=torch.device("cpu"))
    out = torch.zeros(detector.width())
    plan = detector.plan(ctx)  # as the check does: its start copied in, then the detector's local
    if plan is not None:
        out.copy_(plan[0])
    detector.local(ctx, out)
    kinds = detector.verdict(ctx, out.tolist())
    found = detector.held(ctx, RANKS)
    detector.commit(ctx, accepted=accept and not kinds)
    return int(out[0] - out[1]), kinds, found


def test_each_turn_reads_one_slice_of_every_held_tensor_and_a_turn_covers_every_element_once():
    optimizer, entries = adam_with_state()
    detector = HeldStateCheck(SETTINGS)
    detector.after_update(optimizer, entries, True)
    assert detector.period == 5
    check(detector, 1)
    slices = detector._slices
    assert sorted(what for _, what in slices.owners) == ["exp_avg", "exp_avg", "exp_avg_sq", "exp_avg_sq",
                                                         "weight", "weight"]
    held = [t for e in entries for t in (e.main, *optimizer.state[e.main].values()) if t.dim() > 0]
    for tensor in held:  # every element in exactly one slice, each slice about a fifth
        pieces = [p for turn in slices.turns for p in turn if p.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()]
        assert sum(p.numel() for p in pieces) == tensor.numel()
        assert max(p.numel() for p in pieces) <= -(-tensor.numel() // 5)


@pytest.mark.parametrize("slot, value, reason", [
    ("exp_avg", 1000.0, "off:exp_avg"),  # x1000 of the whole first moment
    ("exp_avg_sq", float("inf"), "held:exp_avg_sq"),  # the weight it divides would freeze
    ("weight", float("nan"), "held:weight"),
])
def test_a_corrupted_held_tensor_is_flagged_within_a_turn_and_named_by_parameter_and_tensor(slot, value, reason):
    optimizer, entries = adam_with_state()
    detector = HeldStateCheck(SETTINGS)
    detector.after_update(optimizer, entries, True)
    for step in range(1, 11):  # clean turns: the baselines
        assert check(detector, step)[:2] == (0, [])
    target = entries[0].main if slot == "weight" else optimizer.state[entries[0].main][slot]
    with torch.no_grad():
        if value == 1000.0:
            target.mul_(value)
        else:
            target.view(-1)[-1] = value  # the last element: in the last slice, read at the turn's end
    flagged = [(step, *check(detector, step)) for step in range(11, 16)]
    hits = [(step, n, kinds, found) for step, n, kinds, found in flagged if n]
    assert hits, flagged
    step, n, kinds, found = hits[0]
    assert kinds == [OFF] and [f.name for f in found] == ["fc1.weight"] and found[0].reasons == [reason]
    assert found[0].ranks["global"] == 0
    if reason.startswith("held:"):
        assert found[0].nan + found[0].inf == 1


@pytest.mark.parametrize("weight_ratio, flagged", [(10.0, True), (50.0, False)])
def test_a_weight_element_that_lifts_its_slice_30_fold_is_flagged_by_the_weights_own_ratio(weight_ratio, flagged):
    """A weight moves by about the learning rate a step: its slices are judged against
    ``weight_ratio`` (10), far below the moments' ``ratio`` (100), so one element x1000 of a
    typical value (its slice's largest 30 times higher) is found; with a looser ratio it passes."""
    state = {"warmup_steps": 1, "weight_ratio": weight_ratio}
    settings = Config.from_dict({"detectors": {"state": state}}).detectors.state
    optimizer, entries = adam_with_state()
    detector = HeldStateCheck(settings)
    detector.after_update(optimizer, entries, True)
    for step in range(1, 11):
        assert check(detector, step)[:2] == (0, [])
    weight = entries[0].main.detach().view(-1)
    with torch.no_grad():
        weight[-1] = 30 * weight[4 * weight.numel() // 5:].abs().max()  # in the last turn's slice
    hits = [found for step in range(11, 16) for n, _, found in [check(detector, step)] if n]
    assert ([[f.reasons for f in found] for found in hits] == [[["off:weight"]]]) == flagged, hits


def test_clean_updates_a_zero_baseline_and_a_replay_flag_nothing():
    optimizer, entries = adam_with_state()
    detector = HeldStateCheck(SETTINGS)
    detector.after_update(optimizer, entries, True)
    with torch.no_grad():
        entries[1].main.zero_()  # a zero-initialised bias: its first growth is no fault
    for step in range(1, 31):
        for w in optimizer.param_groups[0]["params"]:
            w.grad = torch.randn_like(w) * (1 + step / 10)
        optimizer.step()
        assert check(detector, step)[:2] == (0, []), step
    ctx = CheckContext(step=31, entries=[], grads=[], norms=None, device=torch.device("cpu"), replay=True)
    with torch.no_grad():
        optimizer.state[entries[0].main]["exp_avg"].fill_(float("nan"))
    out = torch.zeros(detector.width())
    assert detector.plan(ctx) is None
    detector.local(ctx, out)
    assert int(out[0] - out[1]) == 0  # a replay recomputes gradients; the state was judged at the step's own check


def test_a_reloaded_optimizer_state_is_cut_afresh():
    optimizer, entries = adam_with_state()
    detector = HeldStateCheck(SETTINGS)
    detector.after_update(optimizer, entries, True)
    check(detector, 1)
    first = detector._slices
    state = optimizer.state[entries[0].main]
    state["exp_avg"] = state["exp_avg"].clone()  # a new tensor in the state, as a checkpoint load may put
    check(detector, 2)
    assert detector._slices is not first
    exp_avg = state["exp_avg"]
    assert any(p.untyped_storage().data_ptr() == exp_avg.untyped_storage().data_ptr()
               for turn in detector._slices.turns for p in turn)


def test_after_a_rollback_target_is_taken_the_next_check_reads_all_of_the_held_state():
    """What certifies a snapshot or checkpoint has read every slice of it, not a turn's fifth."""
    optimizer, entries = adam_with_state()
    detector = HeldStateCheck(SETTINGS)
    detector.after_update(optimizer, entries, True)
    for step in range(1, 11):
        check(detector, step)
    with torch.no_grad():
        optimizer.state[entries[0].main]["exp_avg_sq"].view(-1)[-1] = float("inf")  # in the last turn's slice
    assert check(detector, 11)[0] == 0  # the first turn's slices: not read
    detector.target_taken()
    n, kinds, found = check(detector, 12)
    assert (n, kinds) == (1, [OFF]) and found[0].reasons == ["held:exp_avg_sq"] and found[0].inf == 1
    assert check(detector, 13)[0] == 0  # then back to the rotation: the second turn's slices


def test_a_whole_read_on_the_same_turn_each_time_still_gives_that_turn_a_baseline():
    """Checkpoints every ``period`` checks make each whole read land on one turn: that turn's slices
    are then only ever read whole, so the whole read must set their baseline (it once did not: a
    x1000 there passed for good)."""
    optimizer, entries = adam_with_state()
    detector = HeldStateCheck(SETTINGS)
    detector.after_update(optimizer, entries, True)
    for step in range(1, 21):
        if step % 5 == 2:  # turn 1's checks are all whole reads
            detector.target_taken()
        assert check(detector, step)[:2] == (0, []), step
    exp_avg = optimizer.state[entries[0].main]["exp_avg"].view(-1)
    with torch.no_grad():
        exp_avg[exp_avg.numel() // 5:2 * exp_avg.numel() // 5].mul_(1000.0)  # turn 1's slice alone
    assert [check(detector, step)[0] for step in (21,)] == [0]  # turn 0: not that slice
    detector.target_taken()
    n, kinds, found = check(detector, 22)
    assert (n, kinds) == (1, [OFF]) and found[0].reasons == ["off:exp_avg"]


def test_a_restarted_check_keeps_its_count_and_baselines_and_judges_ratios_at_once():
    """A resume or a branch from a checkpoint: the loaded check is past its warm-up with the saved
    turns' baselines, so a x1000 just after the load is flagged; a fresh one (nothing loaded) warms
    up again for ``warmup_steps`` checks and lets it pass."""
    settings = Config.from_dict({}).detectors.state  # the defaults: a warm-up of 20 checks
    optimizer, entries = adam_with_state()
    detector = HeldStateCheck(settings)
    detector.after_update(optimizer, entries, True)
    for step in range(1, 27):
        check(detector, step)
    saved = json.loads(json.dumps(detector.state_dict()))  # a checkpoint writes it as JSON
    assert (saved["checks"], saved["rank"]) == (26, 0) and all(len(p) > 0 for p in saved["previous"])
    with torch.no_grad():
        optimizer.state[entries[0].main]["exp_avg"].mul_(1000.0)
    # Another rank's baselines (a loop that stores one rank's guard state for all) are not taken.
    for load, expected in ((saved, 1), (None, 0), ({**saved, "rank": 1}, 0)):
        restarted = HeldStateCheck(settings)
        if load:
            restarted.load_state_dict(load)
        restarted.after_update(optimizer, entries, True)
        assert check(restarted, 27)[0] == expected


@pytest.mark.parametrize("key, value, message", [
    ("fraction", 0, "`detectors.state.fraction` must be > 0 and <= 1, got 0"),
    ("ratio", 1, "`detectors.state.ratio` must be > 1, got 1"),
    ("weight_ratio", 0.5, "`detectors.state.weight_ratio` must be > 1, got 0.5"),
])
def test_a_wrong_setting_is_one_line_naming_the_key(key, value, message):
    with pytest.raises(ConfigError) as error:
        Config.from_dict({"detectors": {"state": {key: value}}})
    assert message in str(error.value) and "\n" not in str(error.value)
