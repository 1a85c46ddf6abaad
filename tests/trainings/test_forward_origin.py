"""A NaN born in the forward pass is traced to the module whose output first went non-finite,
not blamed on the output layer that backward reaches first. Real trainings of the tiny GPT; the
fault is the ``phase=forward`` drill (a forward hook corrupting one module's output)."""

import json

import pytest

from conftest import run_tiny
from megatron_patches.errors import ConfigError
from megatron_patches.incidents import INCIDENTS_FILE
from megatron_patches.inject import parse_spec
from megatron_patches.report import diagnosis

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg; 0.17+ is held through Megatron-LM's loop (conftest)


def only_incident(out):
    (record,) = [json.loads(line) for line in (out / INCIDENTS_FILE).read_text().splitlines()]
    return record


def test_replay_names_the_module_whose_output_went_nan_first(tmp_path):
    out = tmp_path / "run"
    run = run_tiny(out, "--steps", "6", "--inject", "nan:step=3,phase=forward,module=decoder.layers.1.mlp")
    assert run.returncode == 0, run.output[-3000:]
    assert run.result["params_finite"] and run.result["skipped_steps"] == 1, run.result
    record = only_incident(out)
    assert record["step"] == 3 and record["all_gradients_nonfinite"] is True
    # Backward reaches the output layer first; the forward trace goes to where it was born.
    assert record["first"]["name"] == "output_layer.weight"
    assert record["forward_origin"] == {"module": "decoder.layers.1.mlp", "layer": 1, "ranks": [0]}
    assert record["injected"] == [{"drill": "nan:step=3,phase=forward,module=decoder.layers.1.mlp",
                                   "rank": 0, "module": "decoder.layers.1.mlp"}]
    assert record["replay"]["verdict"] == "deterministic"  # the module breaks the same way on replay
    lines = diagnosis(record)
    assert lines[1].startswith("  entered at: the forward pass, output of decoder.layers.1.mlp (layer 1) "
                               "on rank(s) [0], found by the replay"), lines


def test_a_nan_born_in_backward_is_named_by_the_replays_backward_origin(tmp_path):
    """``phase=backward``: the gradient flowing into the MLP's output is NaN; the forward pass
    stays finite, so the replay's trace of the gradients at module outputs names the module."""
    out = tmp_path / "run"
    run = run_tiny(out, "--steps", "6", "--inject", "nan:step=3,phase=backward,module=decoder.layers.1.mlp")
    assert run.returncode == 0, run.output[-3000:]
    record = only_incident(out)
    assert record["step"] == 3 and "forward_origin" not in record
    assert record["backward_origin"] == {"module": "decoder.layers.1.mlp", "layer": 1, "ranks": [0]}
    assert diagnosis(record)[1] == ("  entered at: the backward pass, the gradient into decoder.layers.1.mlp (layer 1) "
                                    "on rank(s) [0] (the forward pass stayed finite), found by the replay")


def test_under_pipeline_parallel_the_module_has_its_global_layer_and_stage_rank(tmp_path):
    """4 layers over 2 stages: global layer 2 is the second stage's local layer 0."""
    out = tmp_path / "run"
    run = run_tiny(out, "--steps", "5", "--pp", "2", "--layers", "4",
                   "--inject", "nan:step=3,phase=forward,module=decoder.layers.2.self_attention", nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    record = only_incident(out)
    assert record["forward_origin"] == {"module": "decoder.layers.2.self_attention", "layer": 2, "ranks": [1]}
    assert [e["rank"] for e in record["injected"]] == [1]


def test_without_a_replay_the_record_says_the_forward_pass_broke_not_the_output_layer(tmp_path):
    config = tmp_path / "guard.yaml"
    config.write_text("response:\n  replay: false\n")
    out = tmp_path / "run"
    run = run_tiny(out, "--steps", "5", "--config", str(config),
                   "--inject", "inf:step=2,phase=forward,module=decoder.layers.0.self_attention")
    assert run.returncode == 0, run.output[-3000:]
    record = only_incident(out)
    assert "forward_origin" not in record and record["all_gradients_nonfinite"] is True
    assert "the output layer named first is not the suspect" in record["message"]
    assert "without a replay not located further; output_layer.weight, named first, is not the suspect" \
        in diagnosis(record)[1]


def test_a_gradient_fault_is_not_called_a_forward_fault(tmp_path):
    out = tmp_path / "run"
    run = run_tiny(out, "--steps", "4", "--inject", "nan:step=2,param=decoder.layers.0.mlp.linear_fc1.weight")
    assert run.returncode == 0, run.output[-3000:]
    record = only_incident(out)
    assert "all_gradients_nonfinite" not in record and "forward_origin" not in record, record


@pytest.mark.parametrize("text, problem", [
    ("nan:step=3,phase=forward", "phase=forward takes module=NAME"),
    ("nan:step=3,phase=forward,module=a,param=b", "phase=forward takes module=NAME"),
    ("saturate:step=3,phase=forward,module=a", "phase=forward takes module=NAME"),
    ("nan:step=3,module=decoder.layers.0", "module applies to phases forward, backward, input only"),
])
def test_forward_drill_specs_are_checked(text, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_spec(text)


def test_a_huge_but_finite_activation_is_traced_to_its_module_not_to_the_norm_that_overflows():
    """An exponent flip leaves an activation finite at 2^64 or more; the next layer norm squares it into
    an Inf. The trace flags the huge value itself (FORWARD_EXTREME), so the module that produced it is
    the origin; a large but plausible activation is not flagged."""
    import torch

    from megatron_patches.forward_origin import FORWARD_EXTREME, _broken

    assert bool(_broken(torch.tensor([1.0, FORWARD_EXTREME])))
    assert bool(_broken(torch.tensor([1.0, float("nan")])))
    assert not bool(_broken(torch.tensor([1.0, -2.0 ** 40], dtype=torch.bfloat16)))
    assert not bool(_broken(torch.empty(0)))


def test_replay_names_the_module_whose_activation_got_an_exponent_flip(tmp_path):
    out = tmp_path / "run"
    drill = "bitflip:step=3,phase=forward,module=decoder.layers.1.mlp,bit=exponent_high,scope=row,seed=1234"
    run = run_tiny(out, "--steps", "5", "--precision", "bf16", "--inject", drill)
    assert run.returncode == 0, run.output[-3000:]
    record = only_incident(out)
    assert record["step"] == 3
    # Before the bound the trace named decoder.final_layernorm, the first output that went non-finite.
    assert record["forward_origin"]["module"] == "decoder.layers.1.mlp", record.get("forward_origin")
