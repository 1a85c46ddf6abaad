"""The check's fused per-step work of issue 59 equals, bit for bit, the per-tensor definitions it
replaced (the earlier code, kept as references here and in test_units_fused.py):

- the history's per-parameter z-score, judged on the device against exact thresholds with its
  statistics kept on the host in float32: the same log-shares, validity, flags and statistics
  step after step as the device ``_Stats`` judge and update (flags firing, NaN, Inf, zero norms,
  sampled shares, thresholds below the zero share's log);
- the thresholds themselves: on the float32 lattice around each, the rule flags exactly the
  log-shares at or above it;
- the check's vector: made by one template-plus-``index_put`` op, the finite count and the total,
  it equals the earlier fill (zeros, non-finite count, total, per-layer ``index_add_``, the peers'
  head and slots), and the count of non-finite gradients the host reads is the earlier one;
- the held-state check's bound: ``not (largest <= bound)`` flags exactly what
  ``non-finite | (largest > previous * limit & previous > 0)`` flagged."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_patches.check import _FINITE, _HEAD, _NONFINITE, _TOTAL_SQ, CheckStage
from megatron_patches.config import Config
from megatron_patches.config_detectors import HistoryConfig, PeersConfig
from megatron_patches.detectors import CheckContext
from megatron_patches.detectors import series
from megatron_patches.detectors.history import HistoryDetector
from megatron_patches.detectors.peers import PeersDetector
from megatron_patches.detectors.state import _FLT_MAX, bound_of

from test_units_fused import OldStats, awkward_grads, old_shares, same_bits
from test_units_fused import series as norm_steps


def steps(seed: int, count: int, size: int):
    """Per step: test_units_fused's series (spikes x1,000, NaN, Inf, zeros, bf16 and fp16 norms) and
    two more: every norm zero, then one norm holding all; whether the step is accepted."""
    for step, (norms, accepted) in enumerate(norm_steps(seed, count, size)):
        if step == count // 3:
            norms.zero_()  # every share 0/0: none valid
        if step == count // 3 + 1:
            norms[1:] = 1e-30  # one tensor holds all: its rest floored at 1e-16 of its square
        yield norms, accepted


def fused_step(series_, norms, mask, cfg, turn=None):
    """The device judge and the host's judgement of one step as the history detector runs them."""
    size = len(mask)
    tail = torch.full((2 * size,), -7.0)  # stale values: every float is overwritten
    out = torch.zeros(1)
    limits = series_.device_thresholds(mask, turn, cfg, torch.device("cpu"))
    series.judge_on_device(norms, tail[:size], tail[size:], limits, series_.positive_needed, out)
    values = tail.tolist()
    judged = series_.judge_host(np.array(values[size:], dtype=np.float32), np.array(values[:size], dtype=np.float32),
                                mask, cfg, torch.device("cpu"))
    return judged, int(out[0])


@pytest.mark.parametrize("seed,period", [(0, 1), (1, 1), (2, 3)])
def test_the_history_judged_on_the_device_with_host_statistics_equals_the_device_statistics(seed, period):
    cfg = HistoryConfig(warmup_steps=4, zscore=1.5, min_ratio=1.05)  # low bars: flags do fire
    size = 17
    entries = [SimpleNamespace(info=SimpleNamespace(name=f"p{i}"), model=torch.zeros(i + 1)) for i in range(size)]
    host = series.HostParamSeries()
    host.rows(SimpleNamespace(entries=entries, device=torch.device("cpu")))
    judged = host.judged & np.array([i % 6 != 5 for i in range(size)])
    old = OldStats(size, torch.device("cpu"))
    fired = invalid = 0
    for step, (norms, accepted) in enumerate(steps(seed, 70, size)):
        mask = judged & (np.arange(size) % period == step % period)
        a, count = fused_step(host, norms, mask, cfg, step % period)
        b = old.judge(old_shares(norms), torch.from_numpy(mask), cfg, drift=False)
        valid = b.valid.numpy()
        assert (a.valid == valid).all() and (a.zflag == b.zflag.numpy()).all(), step
        assert count == int(b.zflag.sum()), step  # the device's count is the rule's
        assert same_bits(torch.from_numpy(a.logn[valid]), b.logn[torch.from_numpy(valid)]), step
        if accepted:
            host.update(a, cfg)
            old.update(b, cfg)
        for name in series._Stats.FIELDS:
            assert same_bits(torch.from_numpy(getattr(host.stats, name)), getattr(old, name)), (step, name)
        fired += count
        invalid += int((~valid & mask).sum())
    assert fired > 0 and invalid > 0  # flags and invalid shares both exercised


def test_thresholds_below_the_zero_share_s_log_make_the_device_test_the_share_too():
    cfg = HistoryConfig(warmup_steps=1, zscore=1.0, min_ratio=1.0001)
    host = series.HostParamSeries()
    host.rows(SimpleNamespace(entries=[SimpleNamespace(info=SimpleNamespace(name=f"p{i}"), model=torch.zeros(1))
                                       for i in range(3)], device=torch.device("cpu")))
    old = OldStats(3, torch.device("cpu"))
    for stats in (host.stats, old):  # a baseline share of 1e-35: a zero share's clipped log (-69) is above it
        stats.mean[:], stats.count[:], stats.var[:] = -80.0, 5.0, 1e-4
    host.version += 1
    norms = torch.tensor([0.0, 1.0, 1.0])
    judged, count = fused_step(host, norms, np.ones(3, dtype=bool), cfg)
    assert host.positive_needed
    earlier = old.judge(old_shares(norms), torch.ones(3, dtype=torch.bool), cfg, drift=False)
    assert count == int(earlier.zflag.sum()) == 2  # the two shares of 1, not the zero share
    assert (judged.zflag == earlier.zflag.numpy()).all() and not judged.valid[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_thresholds_split_the_float32_lattice_exactly_where_the_rule_does(seed):
    rng = np.random.default_rng(seed)
    size = 400
    stats = series._Stats(size, dtype=np.float32)
    stats.mean[:] = rng.normal(0, 5, size).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 2, size)
    stats.var[:] = (rng.random(size) * 2).astype(np.float32) ** 4  # sd from below the 1e-3 floor to 4
    cfg = HistoryConfig(zscore=3.5, min_ratio=1.3)
    sd = torch.from_numpy(stats.var).sqrt().clip(series._MIN_SD, None)  # torch's square root, as the device's rule
    limits = series.thresholds(stats, np.ones(size, dtype=bool), cfg, sd.numpy())
    mean = torch.from_numpy(stats.mean)
    floor = math.log(cfg.min_ratio)
    below = torch.from_numpy(limits)
    for _ in range(6):  # the threshold and five floats either side, ruled on by torch as the device did
        below = torch.nextafter(below, torch.tensor(-math.inf))
    x = below
    for _ in range(11):
        dev = x - mean
        rule = (dev / sd > cfg.zscore) & (dev > floor)
        assert torch.equal(rule, x >= torch.from_numpy(limits))
        x = torch.nextafter(x, torch.tensor(math.inf))
    ready = rng.random(size) < 0.5
    assert np.isinf(series.thresholds(stats, ready, cfg, sd.numpy())[~ready]).all()


def test_the_bisection_finds_the_same_thresholds_as_the_lattice_steps():
    rng = np.random.default_rng(7)
    mean = rng.normal(0, 3, 50).astype(np.float32)
    sd = np.full(50, 0.37, dtype=np.float32)

    def hit(x):
        dev = x - mean
        return (dev / sd > np.float32(2.5)) & (dev > np.float32(0.2))

    stats = series._Stats(50, dtype=np.float32)
    stats.mean[:] = mean
    with np.errstate(over="ignore"):
        by_bisection = series._bisect(hit, mean.shape)
    assert (hit(by_bisection) & ~hit(np.nextafter(by_bisection, np.float32(-np.inf)))).all()
    by_steps = series.thresholds(stats, np.ones(50, dtype=bool), HistoryConfig(zscore=2.5, min_ratio=math.exp(0.2)), sd)
    assert np.array_equal(by_steps, by_bisection)


# --- the check's vector --------------------------------------------------------------------


def stage_for(entries, grads, detectors, norms):
    config = Config.from_dict({})
    seams = SimpleNamespace(build_entries=lambda optimizer, chunks: (entries, 4),
                            current_grads=lambda optimizer, entries_: list(zip(entries_, grads)),
                            megatron_norms=lambda optimizer: [(grads, norms)])
    stage = CheckStage(config, detectors, SimpleNamespace(prepare=lambda: None),
                       SimpleNamespace(chunks_for=lambda optimizer: []), seams)
    return stage


@pytest.mark.parametrize("weighted", [False, True])
def test_the_check_vector_from_one_template_and_index_op_equals_the_earlier_fill(weighted):
    layout = [(f"decoder.layers.{layer}.{t}", layer) for layer in range(2)
              for t in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "input_layernorm.weight")]
    layout += [("embedding.word_embeddings.weight", None), ("output_layer.weight", None)]
    grads = awkward_grads(8, len(layout))
    norms = torch.stack(torch._foreach_norm(grads)).float()
    weights = [0.5 if weighted and i % 3 == 1 else 1.0 for i in range(len(layout))]
    entries = [SimpleNamespace(info=SimpleNamespace(name=n, layer=l), weight=w, slot=(l if l is not None else 2 + i % 2),
                               model=SimpleNamespace(dtype=torch.float32, shape=g.shape))
               for i, ((n, l), w, g) in enumerate(zip(layout, weights, grads))]
    peers = PeersDetector(PeersConfig(), lambda: None)
    history = HistoryDetector(HistoryConfig())
    stage = stage_for(entries, grads, [history, peers], norms)
    stage._size_detectors(entries)
    optimizer = torch.nn.Linear(1, 1)  # any object a weak reference can point to
    stage.entries_for(optimizer)
    ctx, _, held = stage._local(optimizer, entries, 1, None, False, False)
    vec = held.vec.clone()
    # The earlier fill (f3ce4c3 and before): zeros, counts and sums slot by slot, the layers' and the
    # peers' index_add_, the peers' head set in place; the history's one slot its flag count (0: cold).
    old = torch.zeros_like(vec)
    squares = norms.square() * torch.tensor(weights)
    finite = torch.isfinite(norms)
    old[_NONFINITE] = float(len(layout))
    old[_FINITE] = finite.sum()
    old[_TOTAL_SQ] = squares.sum()
    old[_HEAD:].index_add_(0, torch.tensor([e.slot for e in entries]), squares)
    start = _HEAD + 4 + history.width()
    head, index = peers._plan  # what its plan gave the check
    old[start:start + peers.width()] = head
    old[start:start + peers.width()].index_add_(0, index, squares)
    assert same_bits(vec, old)
    assert same_bits(ctx.squares, squares)
    values = held.buffer.tolist()[:held.vec_size]
    values[_NONFINITE] -= values[_FINITE]
    assert values[_NONFINITE] == float((~finite).sum()) > 0  # the earlier slot's count
    # A second check of the same layout reuses every buffer and leaves the same vector.
    stage._local(optimizer, entries, 2, None, False, False)
    assert same_bits(held.vec, old)


# --- the held-state check's bound ----------------------------------------------------------


def test_the_state_bound_flags_exactly_what_the_earlier_rule_flagged():
    inf, nan = math.inf, math.nan
    previous = torch.tensor([inf, 0.0, 1.0, 1.0, 1.0, 3e37, 3e37, 1e-3, 2.0, nan, 1e-45])
    limits = torch.tensor([100.0, 100.0, 100.0, 100.0, 1e4, 100.0, 100.0, 1e4, 100.0, 100.0, 100.0])
    rng = torch.Generator().manual_seed(3)
    cases = [torch.tensor([v] * len(previous)) for v in (0.0, 1.0, 99.0, 100.0, 100.00001, 1e4, 3e38, inf, nan)]
    cases += [previous * limits, torch.nextafter(previous * limits, torch.tensor(inf)),
              torch.rand(len(previous), generator=rng) * 1e3]
    bound = bound_of(previous, limits)
    assert (bound <= _FLT_MAX).all()
    for largest in cases:
        earlier = ~torch.isfinite(largest) | ((largest > previous * limits) & (previous > 0))
        assert torch.equal(~(largest <= bound), earlier), largest
