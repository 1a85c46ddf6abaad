"""Drill specs (``KIND:key=value,...``) parsed without training: every kind and key, and the
message of every refusal (inject.parse_spec)."""

import logging

import pytest

from megatron_patches.errors import ConfigError, UserError
from megatron_patches.inject import KINDS, InjectionSpec, parse_spec

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)


def test_the_smallest_spec_takes_every_default():
    assert parse_spec("nan:step=5") == InjectionSpec(
        kind="nan", step=5, param=None, rank=None, count=1, phase="grad", factor=1.0e4, sample=None, bit=None,
        module=None, text="nan:step=5")


def test_every_gradient_key_is_read():
    spec = parse_spec("inf:step=3,param=*linear_fc1.weight,rank=1,count=4,phase=local")
    assert (spec.kind, spec.step, spec.param, spec.rank, spec.count, spec.phase) == (
        "inf", 3, "*linear_fc1.weight", 1, 4, "local")


def test_spaces_around_kind_keys_and_values_are_ignored_and_the_text_kept_stripped():
    spec = parse_spec("  spike:step = 2 , factor = 10 ,  ")
    assert (spec.kind, spec.step, spec.factor, spec.text) == ("spike", 2, 10.0, "spike:step = 2 , factor = 10 ,")


@pytest.mark.parametrize("text, factor", [
    ("spike:step=1", 1.0e4), ("spike:step=1,factor=0.5", 0.5), ("growth:step=1", 1.5), ("growth:step=1,factor=3", 3.0)])
def test_factor_defaults_per_kind(text, factor):
    assert parse_spec(text).factor == factor


def test_bitflip_takes_a_bit_and_defaults_to_none():
    assert parse_spec("bitflip:step=2,bit=3").bit == 3
    assert parse_spec("bitflip:step=2").bit is None
    assert parse_spec("saturate:step=2").kind == "saturate"


def test_poison_takes_one_sample_and_no_step():
    spec = parse_spec("poison:sample=7")
    assert (spec.kind, spec.sample, spec.step, spec.text) == ("poison", 7, 0, "poison:sample=7")
    assert parse_spec("poison:sample=0").sample == 0


def test_kill_takes_a_step_and_a_rank():
    spec = parse_spec("kill:step=4,rank=1")
    assert (spec.kind, spec.step, spec.rank) == ("kill", 4, 1)


def test_a_forward_drill_names_a_module():
    spec = parse_spec("spike:step=2,phase=forward,module=decoder.layers.1.mlp")
    assert (spec.phase, spec.module, spec.param) == ("forward", "decoder.layers.1.mlp", None)


def test_covers_its_window_and_poison_and_kill_cover_no_gradient_step():
    spec = parse_spec("nan:step=5,count=3")
    assert [s for s in range(3, 10) if spec.covers(s)] == [5, 6, 7]
    assert not any(parse_spec("poison:sample=1").covers(s) for s in range(0, 5))
    assert not any(parse_spec("kill:step=2,rank=0").covers(s) for s in range(0, 5))


REFUSED = [
    ("boom:step=1", "kind must be one of " + ", ".join(KINDS) + ", got 'boom'"),
    (":step=1", "kind must be one of " + ", ".join(KINDS) + ", got ''"),
    ("nan", "step=N is required"),
    ("nan:rank=1", "step=N is required"),
    ("nan:step", "expected key=value with key in step, param, rank, count, phase, factor, sample, bit, module, "
                 "scope, seed, bits, slot, got 'step'"),
    ("nan:stp=1", "expected key=value with key in"),
    ("nan:step=x", "step must be an integer, got 'x'"),
    ("nan:step=0", "step must be >= 1, got 0"),
    ("nan:step=1,rank=-1", "rank must be >= 0, got -1"),
    ("nan:step=1,rank=one", "rank must be an integer, got 'one'"),
    ("nan:step=1,count=0", "count must be >= 1, got 0"),
    ("nan:step=1,sample=2", "sample applies to poison only"),
    ("nan:step=1,phase=sideways", "phase must be one of grad, local, param, forward, backward, state, input, got "
                                  "'sideways'"),
    ("nan:step=1,phase=input,module=embedding.word_embeddings",
     "phase=input takes module=NAME (a module's dotted name) and no param, with kind spike, bitflip, sign, scale, noise"),
    ("bitflip:step=1,phase=input,module=m,bit=exponent_high",
     "phase=input changes integer token ids, which have no exponent or mantissa: give bit as an index"),
    ("nan:step=1,phase=backward", "phase=backward takes module=NAME"),
    ("nan:step=1,phase=forward", "phase=forward takes module=NAME"),
    ("nan:step=1,phase=forward,module=m,param=p", "phase=forward takes module=NAME"),
    ("saturate:step=1,phase=forward,module=m", "with kind nan, inf, spike, sign, scale, noise, bitflip"),
    ("nan:step=1,module=decoder", "module applies to phases forward, backward, input only"),
    ("nan:step=1,bit=3", "bit applies to bitflip only"),
    ("bitflip:step=1,bit=-1", "bit must be >= 0, got -1"),
    ("nan:step=1,factor=2", "factor applies to spike, growth, scale, noise only"),
    ("bitflip:step=1,bit=exponent", "bit must be an integer or one of exponent_high, mantissa_high, mantissa_low, "
                                    "got 'exponent'"),
    ("bitflip:step=1,bit=3,bits=2", "bit and bits exclude each other"),
    ("bitflip:step=1,bits=0", "bits must be >= 1, got 0"),
    ("sign:step=1,bits=2", "bits applies to bitflip only"),
    ("scale:step=1,scope=half", "scope must be one of element, row, 1pct, 10pct, all, got 'half'"),
    ("noise:step=1,seed=-3", "seed must be >= 0, got -3"),
    ("nan:step=1,slot=exp_avg", "slot applies to phase=state only"),
    ("nan:step=1,phase=state,slot=momentum", "slot must be one of exp_avg, exp_avg_sq, got 'momentum'"),
    ("spike:step=1,factor=big", "factor must be a number, got 'big'"),
    ("poison:step=3", "poison takes exactly sample=I (a dataset index)"),
    ("poison:sample=1,rank=0", "poison takes exactly sample=I"),
    ("poison:sample=-1", "sample must be >= 0, got -1"),
    ("poison:sample=x", "sample must be an integer, got 'x'"),
    ("kill:step=3", "kill takes exactly step=S and rank=R"),
    ("kill:step=3,rank=1,count=2", "kill takes exactly step=S and rank=R"),
]


@pytest.mark.parametrize("text, message", REFUSED, ids=[t for t, _ in REFUSED])
def test_a_bad_spec_is_refused_naming_the_spec_and_the_problem(text, message):
    with pytest.raises(ConfigError) as caught:
        parse_spec(text)
    said = str(caught.value)
    assert said.startswith(f"injection {text!r}: ") and message in said, said
    assert isinstance(caught.value, UserError) and "\n" not in said


def test_the_drills_are_the_runs_and_go_with_it(clean_patches):
    """runtime.install gives the run's monitor config.inject as its drills; a second run in the
    process starts with its own, and none is left anywhere once the guard is uninstalled."""
    pytest.importorskip("megatron.core", reason="runtime.install patches megatron-core")
    from megatron_patches.seams import wrappers
    from megatron_patches import runtime
    from megatron_patches.config import Config

    logger = logging.getLogger("megatron_patches")
    kept = (logger.propagate, list(logger.handlers), logger.level)  # install sets logging up
    try:
        monitor = runtime.install(Config.from_dict({"inject": ["nan:step=3,phase=local", "poison:sample=7"]}))
        assert [s.text for s in monitor.state.drills.specs] == ["nan:step=3,phase=local", "poison:sample=7"]
        assert monitor.state.drills.poisoned([6, 7]) == {7}
        assert monitor.state.drills.fired_at(monitor.state.clock.upcoming()) == [
            {"drill": "poison:sample=7", "rank": 0, "sample": 7}]  # fed on the step the guard is making
        runtime.uninstall()
        assert wrappers.get_monitor() is None
        again = runtime.install(Config())
        assert again is not monitor and again.state.drills.specs == () and not again.state.drills
    finally:
        runtime.uninstall()
        logger.propagate, logger.handlers[:] = kept[0], kept[1]
        logger.setLevel(kept[2])


def test_a_bad_spec_stops_the_start_before_anything_is_patched(clean_patches):
    from megatron_patches.seams import wrappers, patching
    from megatron_patches import runtime
    from megatron_patches.config import Config

    config = Config.from_dict({"inject": ["nan:step=2", "nan:step=zero"]})
    with pytest.raises(ConfigError, match="step"):
        runtime.install(config)
    assert wrappers.get_monitor() is None and patching.installed_targets() == []


# --- a drill with nothing to act on is refused, not silently idle (issue 25) ----------------------

NAMES = ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight",
         "decoder.layers.1.mlp.linear_fc1.weight"]
MODULES = ["embedding", "decoder.layers.0.mlp", "decoder.layers.1.mlp"]


def test_targets_are_matched_per_rank_and_summed_over_the_job():
    from megatron_patches.inject import Injector, unmatched

    drills = Injector([parse_spec(t) for t in (
        "nan:step=3,param=decoder.layers.1.*",           # on rank 1's stage only: matched by the job
        "nan:step=3,param=decoder.layers.1.*,rank=0",    # rank 0 holds no layer 1
        "nan:step=2,phase=forward,module=decoder.layers.7.mlp",
        "kill:step=3,rank=4",                            # a rank the job does not have
        "nan:step=2",                                    # the model's first parameter: somewhere
        "poison:sample=5")])
    params = [(name, order) for order, name in enumerate(NAMES)]
    rank0 = drills.holds(params[:2], params[:2], MODULES[:2])
    rank1 = drills.holds(params[2:], params[2:], MODULES[2:])
    assert rank0 == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0] and rank1 == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    line = unmatched(drills, [rank0, rank1], NAMES, MODULES)
    assert "\n" not in line and line.startswith("drill(s) that would do nothing: ")
    assert ("'nan:step=3,param=decoder.layers.1.*,rank=0' (no parameter matches 'decoder.layers.1.*' among the "
            "gradients the optimizer steps on rank 0; held on rank(s) 1: bind it to one of them or drop rank)") in line
    assert "(no module matches 'decoder.layers.7.mlp'; nearest: decoder.layers.1.mlp, decoder.layers.0.mlp)" in line
    assert "'kill:step=3,rank=4' (rank 4 is outside the job's 2 rank(s))" in line
    assert "'nan:step=3,param=decoder.layers.1.*' (" not in line  # the job has layer 1: matched
    assert "'nan:step=2' (" not in line and "poison" not in line
    assert unmatched(Injector([parse_spec("nan:step=3,param=*fc1*")]), [[1.0], [0.0]], NAMES, MODULES) is None


def test_a_grad_drill_is_held_where_the_optimizer_steps_its_gradient_and_a_module_drill_where_the_module_is():
    """Distributed optimizer over two ranks: both hold every parameter, each steps half the
    gradients. Pipeline stages: a module lives on one rank. A drill bound to a rank without its
    target names the ranks that hold it; phase=local acts before the shards, on every replica."""
    from megatron_patches.inject import Injector, unmatched

    drills = Injector([parse_spec(t) for t in (
        f"nan:step=2,param={NAMES[2]},rank=0",                  # rank 1's shard steps it
        f"nan:step=2,param={NAMES[2]},rank=1",
        f"nan:step=2,param={NAMES[2]},rank=0,phase=local",      # every replica holds it before the shards
        "nan:step=2,rank=1",                                    # the first parameter: rank 0's shard
        "spike:step=2,phase=backward,module=decoder.layers.1.mlp,rank=0",
        "sign:step=2,phase=input,module=embedding,rank=1")])                # the first stage's
    params = [(name, order) for order, name in enumerate(NAMES)]
    rank0 = drills.holds(params, params[:2], MODULES[:2])
    rank1 = drills.holds(params, params[2:], MODULES[2:])
    line = unmatched(drills, [rank0, rank1], NAMES, MODULES)
    assert (f"'nan:step=2,param={NAMES[2]},rank=0' (no parameter matches '{NAMES[2]}' among the gradients the "
            "optimizer steps on rank 0; held on rank(s) 1: bind it to one of them or drop rank)") in line
    assert ("'nan:step=2,rank=1' (the model's first parameter is not among the gradients the optimizer steps on "
            "rank 1; held on rank(s) 0: ") in line
    assert ("'spike:step=2,phase=backward,module=decoder.layers.1.mlp,rank=0' (no module matches "
            "'decoder.layers.1.mlp' on rank 0; held on rank(s) 1: ") in line
    assert ("'sign:step=2,phase=input,module=embedding,rank=1' (no module matches 'embedding' on rank 1; held on "
            "rank(s) 0: ") in line
    assert f"'nan:step=2,param={NAMES[2]},rank=1' (" not in line and "phase=local" not in line


def test_a_weight_drill_is_held_where_the_optimizer_steps_the_weight_and_flips_it_in_place():
    """phase=param acts on the weight this rank's optimizer steps (under the distributed optimizer
    its shard only): refused elsewhere like a phase=grad drill, and a bit flip there changes the
    weight itself, one element, nothing else."""
    import torch

    from megatron_patches.inject import Injector, unmatched

    drills = Injector([parse_spec(f"bitflip:step=2,param={NAMES[2]},rank=0,phase=param,bit=0")])
    params = [(name, order) for order, name in enumerate(NAMES)]
    line = unmatched(drills, [drills.holds(params, params[:2], MODULES[:2]), drills.holds(params, params[2:], MODULES[2:])],
                     NAMES, MODULES)
    assert (f"(no parameter matches '{NAMES[2]}' among the weights the optimizer steps on rank 0; held on "
            "rank(s) 1: ") in line
    weight = torch.ones(3)
    held = Injector([parse_spec(f"bitflip:step=2,param={NAMES[2]},phase=param,bit=0")])
    assert held.apply(2, "grad", 0, [(NAMES[2], 2, weight)]) == []  # another phase: untouched
    assert len(held.apply(2, "param", 0, [(NAMES[2], 2, weight)])) == 1
    assert weight[0].item() != 1.0 and abs(weight[0].item() - 1.0) < 1e-6 and weight[1:].tolist() == [1.0, 1.0]


def test_drills_for_an_optimizer_whose_model_the_guard_never_saw_are_refused(guard_log):
    """An optimizer built by a get_megatron_optimizer imported before the guard (Megatron-Bridge did
    that when the opt-in line came after its imports): no names, so a drill would fire into nothing
    and the run would look clean. Refused on every rank with one line; a poison drill needs no model."""
    from megatron_patches.inject import Injector, refuse_unmatched

    with pytest.raises(SystemExit) as stopped:
        refuse_unmatched(Injector([parse_spec("nan:step=3")]), None, 0, [], None)
    assert stopped.value.code == 2
    assert "drills 'nan:step=3' cannot act: the guard does not know this optimizer's model" in guard_log.text
    refuse_unmatched(Injector([parse_spec("poison:sample=7")]), None, 0, [], None)  # goes on


@pytest.mark.parametrize("ranks, said", [([3], "3"), ([0, 1, 2, 5], "0-2, 5"), ([1, 3, 4, 5, 7], "1, 3-5, 7")])
def test_the_holding_ranks_are_written_as_runs(ranks, said):
    from megatron_patches.inject import _rank_list

    assert _rank_list(ranks) == said


def test_a_bad_config_ends_the_import_with_exit_2_and_one_line(tmp_path, monkeypatch, capsys, clean_patches):
    from megatron_patches import runtime

    path = tmp_path / "guard.yaml"
    path.write_text("detectors:\n  nonfinit: {}\n")
    monkeypatch.setenv("MEGATRON_PATCHES_CONFIG", str(path))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stopped:
        runtime.install_from_environment()
    assert stopped.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("[megatron_patches] unknown config key detectors.nonfinit") and "nonfinite" in line
    monkeypatch.setenv("RANK", "3")  # the other ranks exit alike and say nothing
    with pytest.raises(SystemExit):
        runtime.install_from_environment()
    assert capsys.readouterr().err == ""


# --- the fault menu (issue 40): what each kind and scope does to a tensor -------------------------

def _changed_count(text, tensor):
    import torch

    from megatron_patches import faults

    before = tensor.clone()
    assert faults.corrupt(parse_spec(text), tensor)
    as_int = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return int((before.view(as_int) != tensor.view(as_int)).sum()), before


@pytest.mark.parametrize("scope, count", [("element", 1), ("row", 64), ("1pct", 81), ("10pct", 819), ("all", 8192)])
def test_each_scope_changes_that_many_elements(scope, count):
    import torch

    weight = torch.randn(128, 64)
    assert _changed_count(f"sign:step=1,scope={scope},seed=3", weight)[0] == count


def test_a_row_is_one_row_of_a_matrix_and_a_run_of_64_in_a_flat_shard():
    import torch

    weight = torch.randn(128, 64)
    _, before = _changed_count("nan:step=1,scope=row,seed=5", weight)
    rows = torch.isnan(weight).all(dim=1)
    assert int(rows.sum()) == 1 and int(torch.isnan(weight).sum()) == 64
    shard = torch.randn(1000)
    _changed_count("nan:step=1,scope=row,seed=5", shard)
    where = torch.isnan(shard).nonzero().view(-1)
    assert len(where) == 64 and int(where[-1] - where[0]) == 63 and int(where[0]) % 64 == 0


def test_the_same_seed_draws_the_same_elements_and_another_seed_others():
    import torch

    a, b, c = torch.ones(1000), torch.ones(1000), torch.ones(1000)
    for tensor, seed in ((a, 1), (b, 1), (c, 2)):
        _changed_count(f"nan:step=1,scope=10pct,seed={seed}", tensor)
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and not torch.equal(torch.isnan(a), torch.isnan(c))


def test_named_bits_move_a_value_as_their_names_say():
    import torch

    for name, expected in (("mantissa_low", 1.0 + 2.0 ** -23), ("mantissa_high", 1.5), ("exponent_high", float("inf"))):
        value = torch.ones(1)
        _changed_count(f"bitflip:step=1,bit={name}", value)
        assert float(value[0]) == expected, (name, float(value[0]))
    half = torch.ones(1, dtype=torch.bfloat16)
    _changed_count("bitflip:step=1,bit=mantissa_high", half)
    assert float(half[0]) == 1.5  # bf16's highest mantissa bit is bit 6


def test_bits_n_flips_n_bits_of_every_element_in_scope():
    import torch

    values = torch.randn(256)
    before = values.clone()
    _changed_count("bitflip:step=1,bits=3,scope=all,seed=9", values)
    flipped = (before.view(torch.int32) ^ values.view(torch.int32))
    assert all(bin(int(x) & 0xFFFFFFFF).count("1") == 3 for x in flipped)


def test_scale_noise_and_their_defaults():
    import torch

    values = torch.full((10000,), 2.0)
    _changed_count("scale:step=1", values)
    assert torch.equal(values, torch.full((10000,), 4.0))
    _changed_count("scale:step=1,factor=1000,scope=element,seed=1", values)
    assert int((values == 4000.0).sum()) == 1
    noisy = torch.full((10000,), 2.0)
    _changed_count("noise:step=1,seed=4", noisy)
    assert 0.009 < float((noisy / 2.0 - 1.0).std()) < 0.011


def test_a_state_drill_takes_its_slot_of_the_adam_state():
    import types

    import torch

    from megatron_patches import faults

    weight = torch.nn.Parameter(torch.ones(4, 4))
    adam = torch.optim.Adam([weight])
    entry = types.SimpleNamespace(main=weight, info=types.SimpleNamespace(name="w", order=0))
    assert faults.optimizer_state(adam, [entry]) == []  # no state before the first update
    weight.grad = torch.ones(4, 4)
    adam.step()
    [(name, order, state)] = faults.optimizer_state(types.SimpleNamespace(optimizer=adam), [entry])
    assert faults.corrupt(parse_spec("nan:step=1,phase=state,slot=exp_avg_sq"), state)
    assert torch.isnan(state["exp_avg_sq"]).sum() == 1 and not torch.isnan(state["exp_avg"]).any()


# --- phase=input: the token ids a rank feeds (issue 40) --------------------------------------------

def test_an_input_fault_changes_integer_ids_and_keeps_their_dtype():
    """Token ids are integers: bit 63 makes them negative, bit 0 turns an id into its neighbour (inside
    an even vocabulary), scale and noise round back to integers; nothing turns into a float."""
    import torch

    from megatron_patches import faults

    ids = torch.arange(128, dtype=torch.int64).reshape(4, 32)

    def hit(text):
        copy = ids.clone()
        faults.corrupt(parse_spec(f"{text},step=1,phase=input,module=embedding.word_embeddings,seed=1234"), copy)
        assert copy.dtype == torch.int64
        return copy

    assert (hit("bitflip:bit=63,scope=all") < 0).all()
    low = hit("bitflip:bit=0,scope=all")
    assert torch.equal(low, ids ^ 1) and ((low >= 0) & (low < 128)).all()
    assert torch.equal(hit("scale:factor=1000,scope=all"), ids * 1000)
    assert torch.equal(hit("sign:scope=all"), -ids)
    noisy = hit("noise:scope=all")
    assert ((noisy - ids).abs() <= 0.05 * ids + 0.5).all() and (noisy != ids).any()  # within 5 sigma of 1 %, rounded
    row = hit("bitflip:bit=30,scope=row")
    assert (row != ids).sum() == 32 and (row != ids).any(dim=1).sum() == 1
