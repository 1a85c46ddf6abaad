"""The check's fused per-step work equals, bit for bit, the per-tensor and per-op definitions it
replaced (issue 59): the norms taken from Megatron's kernel vector, the peers' slots, the history
detector's statistics and the consistency fingerprint. The references below are the earlier code
(commit f3ce4c3), kept here as the definitions; inputs hold NaN, Inf, zeros and bf16/fp16 norms."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_patches import collectives
from megatron_patches.check import CheckStage, placed_norms
from megatron_patches.config_detectors import ConsistencyConfig, HistoryConfig, PeersConfig
from megatron_patches.detectors import CheckContext
from megatron_patches.detectors import consistency as consistency_module
from megatron_patches.detectors import history
from megatron_patches.detectors.consistency import ConsistencyDetector
from megatron_patches.detectors.peers import _HEAD, _PEERLESS, PeersDetector, _peerless_slot, role_of


def same_bits(a, b) -> bool:
    """Equal to the bit (NaN patterns included), dtype and shape too."""
    a, b = (torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x for x in (a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool or not a.dtype.is_floating_point:
        return torch.equal(a, b)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def awkward_grads(seed: int, count: int = 23) -> list:
    """Gradients of fp32, bf16 and fp16 with NaN, Inf, all-zero and huge tensors among them."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for i in range(count):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        g = (torch.randn(3 + i % 5, 4, generator=gen) * 10.0 ** float(torch.randint(-6, 4, (1,), generator=gen)))
        g = g.to(dtype)
        if i % 7 == 3:
            g.view(-1)[1] = math.nan
        if i % 11 == 5:
            g.view(-1)[0] = math.inf
        if i % 9 == 4:
            g.zero_()
        grads.append(g)
    return grads


# --- the norms the check takes from Megatron's kernel --------------------------------------


def old_norms(known: dict, grads: list) -> torch.Tensor:
    """f3ce4c3: a {(data_ptr, shape, dtype): 0-d norm} per tensor, the rest by _foreach_norm."""
    keys = [(g.data_ptr(), tuple(g.shape), g.dtype) for g in grads]
    norms = [known.get(k) for k in keys]
    missing = [i for i, n in enumerate(norms) if n is None]
    if missing:
        for i, n in zip(missing, torch._foreach_norm([grads[i] for i in missing])):
            norms[i] = n
    return torch.stack([n.float() for n in norms])


def kernel(grads: list) -> tuple:
    """What megatron-core's local kernel fallback gives: each tensor's torch.norm, in order."""
    return grads, torch.stack([torch.norm(g) for g in grads])


def as_dict(known: list) -> dict:
    return {(g.data_ptr(), tuple(g.shape), g.dtype): n for grads, vec in known for g, n in zip(grads, vec.unbind())}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kernel_vector_gives_the_norms_the_per_tensor_match_gave(seed):
    grads = awkward_grads(seed)
    cases = {
        "the same list": [kernel(grads)],
        "some left out of Megatron's norm": [kernel(grads[::2])],
        "other view objects of the same memory": [kernel([g.view(g.shape) for g in grads])],
        "a chain of two lists, out of order": [kernel(grads[10:]), kernel(grads[3:10])],
    }
    stage = CheckStage.__new__(CheckStage)
    for what, known in cases.items():
        stage.seams = SimpleNamespace(megatron_norms=lambda optimizer, known=known: known)
        fused = stage._norms(None, grads)
        assert same_bits(fused, old_norms(as_dict(known), grads)), what
        assert same_bits(placed_norms(known, grads), fused), what
    # No kernel: the check's own fused pass, as before.
    stage.seams = SimpleNamespace(megatron_norms=lambda optimizer: [])
    assert same_bits(stage._norms(None, grads), torch.stack(torch._foreach_norm(grads)).float())


def test_the_layer_sums_added_into_the_whole_vector_equal_those_added_into_its_slice():
    norms = torch.stack(torch._foreach_norm(awkward_grads(3))).float()
    weights = torch.rand(len(norms), generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([i % 4 for i in range(len(norms))])
    squares = norms.square() * weights
    old, new = torch.zeros(5 + 4 + 3), torch.zeros(5 + 4 + 3)
    old[5:5 + 4].index_add_(0, slots, squares)
    new.index_add_(0, slots + 5, squares)
    assert same_bits(old, new)


# --- peers -------------------------------------------------------------------------------


def entries(names_layers: list, weights: list) -> list:
    return [SimpleNamespace(info=SimpleNamespace(name=n, layer=l), weight=w) for (n, l), w in zip(names_layers, weights)]


def test_the_peers_piece_equals_the_one_filled_slot_by_slot():
    layout = [(f"decoder.layers.{layer}.{t}", layer) for layer in range(3)
              for t in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "input_layernorm.weight")]
    layout += [("embedding.word_embeddings.weight", None), ("output_layer.weight", None)]
    norms = torch.stack(torch._foreach_norm(awkward_grads(4, len(layout)))).float()
    weights = [1.0, 0.5] * (len(layout) // 2) + [1.0] * (len(layout) % 2)
    ents = entries(layout, weights)
    w = torch.tensor(weights, dtype=torch.float32)
    ctx = CheckContext(step=1, entries=ents, grads=[], norms=norms, device=torch.device("cpu"),
                       squares=norms.square() * w)
    detector = PeersDetector(PeersConfig(), lambda: None)
    detector.size([3, 3])
    new = torch.zeros(detector.width())
    start, index = detector.plan(ctx)  # the check fills the piece (check._Held): its start, then the squares
    new.copy_(start)
    new.index_put_((index[None],), ctx.squares, accumulate=True)
    detector.local(ctx, new)  # nothing of its own
    # f3ce4c3's fill: the head slot by slot, then the squares (norm^2 * weight) into their slots.
    roles = sorted({role_of(n) for n, l in layout if l is not None})
    index = [_peerless_slot(n) if l is None else _PEERLESS + l * len(roles) + roles.index(role_of(n)) for n, l in layout]
    old = torch.zeros(detector.width())
    old[0], old[1], old[2], old[3] = 1.0, detector._hash, detector._hash * detector._hash, float(len(roles))
    old[_HEAD:].index_add_(0, torch.tensor(index), norms.square() * w)
    assert same_bits(new, old)


# --- history -----------------------------------------------------------------------------


class OldStats(history._Stats):
    """f3ce4c3's judge and update, op by op."""

    def judge(self, values, valid, cfg, drift=True, min_ratio=None):
        xp = self.xp
        logn = xp.log(xp.clip(values, 1e-30, None))
        valid = valid & xp.isfinite(values) & (values > 0)
        warmed = self.count >= cfg.warmup_steps
        dev = logn - self.mean
        z = dev / xp.clip(xp.sqrt(self.var), history._MIN_SD, None)
        floor = math.log(cfg.min_ratio if min_ratio is None else min_ratio)
        zflag = valid & warmed & (z > cfg.zscore) & (dev > floor)
        if drift:
            grow = valid & (self.count > 0) & (logn - self.last > math.log(cfg.drift_ratio))
            run = xp.where(grow, self.run + 1, xp.zeros_like(self.run))
            dflag = valid & warmed & (run >= cfg.drift_steps)
        else:
            run, dflag = xp.zeros_like(self.run), valid & False
        return history.Judged(logn, valid, z, zflag, dflag, run)

    def update(self, j, cfg):
        xp = self.xp
        alpha = xp.clip(1.0 / (self.count + 1), 1.0 - cfg.ema_beta, None)
        dev = j.logn - self.mean
        limit = history._CLIP * xp.clip(xp.sqrt(self.var), history._MIN_SD, None)
        dev = xp.where(self.count >= cfg.warmup_steps, xp.maximum(xp.minimum(dev, limit), -limit), dev)
        self.mean = xp.where(j.valid, self.mean + alpha * dev, self.mean)
        self.var = xp.where(j.valid, (1.0 - alpha) * (self.var + alpha * dev * dev), self.var)
        self.count = self.count + xp.where(j.valid, 1.0, 0.0)
        self.last = xp.where(j.valid, j.logn, self.last)
        self.run = xp.where(j.valid, j.run, self.run)


def old_shares(norms):
    if isinstance(norms, torch.Tensor):
        wide = norms.double()
        squares = torch.where(torch.isfinite(wide), wide * wide, torch.zeros_like(wide))
        rest = torch.maximum(squares.sum() - squares, 1e-16 * squares)
        return torch.where(rest > 0, wide / rest.sqrt(), torch.zeros_like(wide)).float()
    return history.shares(norms)  # the host's numpy code is unchanged


def series(seed: int, steps: int, size: int):
    """Per step: float32 norms (some NaN, Inf, zero; now and then a x1,000 spike), accepted or not."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.rand(size, generator=gen) * 3 + 0.1
    for step in range(steps):
        norms = base * (1 + 0.3 * torch.rand(size, generator=gen))
        if step % 5 == 4:
            norms[step % size] *= 1000.0
        if step % 7 == 6:
            norms[(step * 3) % size] = math.nan
        if step % 11 == 10:
            norms[(step * 5) % size] = math.inf
        if step % 13 == 12:
            norms[(step * 2) % size] = 0.0
        if step == steps // 2:
            norms = norms.bfloat16().float()  # bf16 norms (the check reads them as float32)
        if step == steps // 2 + 1:
            norms = norms.half().float()
        yield norms, step % 9 != 8


FIELDS = ("logn", "valid", "z", "zflag")


def step_both(new, old, a, b, cfg, accepted: bool, fields: tuple) -> None:
    """The judgements ``a`` (the code's) and ``b`` (f3ce4c3's) equal bit for bit in ``fields``; on an
    accepted step both statistics take their update and stay equal bit for bit."""
    for name in fields:
        assert same_bits(getattr(a, name), getattr(b, name)), name
    if accepted:
        new.update(a, cfg)
        old.update(b, cfg)
    for name in history._Stats.FIELDS:
        assert same_bits(getattr(new, name), getattr(old, name)), name


@pytest.mark.parametrize("seed", [0, 1])
def test_history_per_tensor_statistics_and_flags_equal_the_earlier_ops(seed):
    cfg = HistoryConfig(warmup_steps=4, zscore=1.5, min_ratio=1.05)  # low bars: flags do fire
    size = 17
    new, old = history._Stats(size, torch.device("cpu")), OldStats(size, torch.device("cpu"))
    judged = torch.tensor([i % 6 != 5 for i in range(size)])
    fired = 0
    for norms, accepted in series(seed, 60, size):
        values = history.shares(norms)
        assert same_bits(values, old_shares(norms))
        a = new.judge(values, judged, cfg, drift=False)
        b = old.judge(values, judged & torch.ones(size, dtype=torch.bool), cfg, drift=False)
        step_both(new, old, a, b, cfg, accepted, FIELDS)
        fired += int(a.zflag.sum())
    assert fired > 0  # the flags were exercised, not only the quiet path


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf - inf on the host, as before
def test_history_host_levels_with_growth_equal_the_earlier_ops():
    cfg = HistoryConfig(warmup_steps=3, zscore=1.0, min_ratio=1.01, drift_steps=2, drift_ratio=1.05)
    new, old = history._Stats(6), OldStats(6)
    grew = 0
    for step, (norms, accepted) in enumerate(series(5, 50, 6)):
        values = history.shares(norms.numpy().astype(float) * (1.1 ** (step % 6)))
        a = new.judge(values, history.judged_slots(6), cfg)
        b = old.judge(values, history.judged_slots(6), cfg)
        step_both(new, old, a, b, cfg, accepted, FIELDS + ("dflag", "run"))
        grew += int(a.dflag.sum())
    assert grew > 0


# --- consistency -------------------------------------------------------------------------


def old_fingerprint(detector, ctx, out):
    """f3ce4c3's fill of the consistency piece (grads mode), after the share is chosen."""
    tensors, norms = detector._fingerprinted(ctx)
    sample = detector._sample(len(tensors))
    if sample is not None:
        tensors = [tensors[i] for i in sample]
    square = norms.float().square().sum()
    square = torch.where(torch.isnan(square), torch.full_like(square, math.nan), square)
    weights = torch.arange(detector._count, dtype=torch.int64) * 2 + 1
    if sample is not None:
        weights = weights[torch.tensor(sample)]
    total = (consistency_module._tensor_sums(tensors) * weights).sum()
    bits = square.reshape(1).view(torch.int32).to(torch.int64)[0]
    fp = torch.stack([square, (total & consistency_module._MASK24).float(),
                      ((total >> 24) & consistency_module._MASK24).float()])
    out.copy_(consistency_module._pieces(bits, total).float() * detector._weight(*detector._dp_group()[:2]))
    return fp


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_the_consistency_fingerprint_equals_the_earlier_ops(monkeypatch, fraction):
    monkeypatch.setattr(collectives, "world_size", lambda: 2)
    monkeypatch.setattr(collectives, "rank", lambda: 1)
    grads = awkward_grads(6)
    layout = [(f"p{i}", None) for i in range(len(grads))]
    ents = [SimpleNamespace(model=SimpleNamespace(), shard=False, **vars(e)) for e in entries(layout, [1.0] * len(grads))]
    norms = torch.stack(torch._foreach_norm(grads)).float()
    for check in range(1, 6):
        ctx = CheckContext(step=check, entries=ents, grads=grads, norms=norms, device=torch.device("cpu"))
        detector = ConsistencyDetector(ConsistencyConfig(sample_fraction=fraction), lambda: None)
        detector._sharded, detector._checks = False, check - 1
        new = torch.zeros(detector.width())
        detector.local(ctx, new)
        old = torch.zeros(detector.width())
        assert same_bits(detector.fingerprint(), old_fingerprint(detector, ctx, old)), check
        assert same_bits(new, old) and new.abs().sum() > 0, check


def test_the_check_writes_its_sums_into_the_vector_as_the_earlier_setitems_did():
    norms = torch.stack(torch._foreach_norm(awkward_grads(7))).float()
    squares = norms.square() * torch.rand(len(norms), generator=torch.Generator().manual_seed(2))
    old, new = torch.zeros(6), torch.zeros(6)
    old[0] = (~torch.isfinite(norms)).sum()
    old[3] = squares.sum()
    torch.sum(~torch.isfinite(norms), dim=0, dtype=torch.float32, out=new[0])
    torch.sum(squares, dim=0, out=new[3])
    assert same_bits(old, new) and old[0] > 0
    many = torch.rand(100_003, generator=torch.Generator().manual_seed(3)) * 1e3  # the vectorized, blocked sum
    total = torch.zeros(())
    torch.sum(many, dim=0, out=total)
    assert same_bits(total, many.sum())
    zflag = torch.tensor([True, False, True, True])
    slot = torch.zeros(1)
    torch.sum(zflag, dim=0, keepdim=True, dtype=torch.float32, out=slot)
    assert same_bits(slot, torch.tensor([float(zflag.sum())]))
