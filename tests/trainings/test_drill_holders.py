"""A drill bound to a rank that does not hold its target is refused at the first step, the line naming
the ranks that do (issue 40): under the distributed optimizer a phase=grad drill acts only where a
rank's optimizer steps that gradient, its shard. Tiny GPT, bf16, DP2 with the distributed optimizer,
ranks forked from pytest: rank 0's shard holds the whole of FC1's gradient, rank 1's none of it."""

import signal

import pytest

from conftest import run_forked, run_tiny

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg; 0.17+ is held through Megatron-LM's loop (conftest)

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
SHARDED = ("--steps", "3", "--precision", "bf16", "--distributed-optimizer")


@pytest.mark.multiproc
def test_a_grad_drill_on_a_rank_whose_shard_lacks_the_parameter_stops_every_rank_with_2_naming_the_holder(tmp_path):
    from megatron_patches import errors
    from megatron_patches.testing import tiny_gpt

    drill = f"nan:step=2,param={FC1},rank=1"

    def rank():
        # Each rank's own exit code is the outcome: outlive run_forked's ending of the others after
        # the first exit (torchrun's too), and skip the grace the other ranks give rank 0's line.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        errors.REFUSAL_GRACE_S = 0.0
        return tiny_gpt.main(["--out", str(tmp_path), *SHARDED, "--inject", drill])

    code, output = run_forked(rank, nproc=2)
    assert code == 2 and "rank 0 exited 2" in output and "rank 1 exited 2" in output, output[-3000:]
    [line] = [line for line in output.splitlines() if "drill(s) that would do nothing" in line]
    assert (f"'{drill}' (no parameter matches '{FC1}' among the gradients the optimizer steps on rank 1; "
            "held on rank(s) 0: bind it to one of them or drop rank)") in line
    assert "fired" not in output and "Traceback" not in output
    assert not (tmp_path / "result.json").exists()  # stopped before any update


@pytest.mark.multiproc
def test_the_same_drill_on_the_rank_holding_the_parameter_fires_and_is_named(tmp_path):
    drill = f"nan:step=2,param={FC1},rank=0"
    run = run_tiny(tmp_path, *SHARDED, "--inject", drill, nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    assert f"step 2: drill '{drill}' fired into {FC1} on rank 0" in run.output
    [record] = run.incidents
    assert (record["step"], record["kind"], record["action"]) == (2, "nan", "skip_step")
    assert record["first"]["name"] == FC1 and record["first"]["ranks"]["global"] == 0
    assert record["injected"] == [{"drill": drill, "rank": 0, "param": FC1}]
