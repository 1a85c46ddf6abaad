"""Drills and the origin flag at each DDP bucket group's start of its reduction (tiny-GPT harness).

With ``--overlap-grad-reduce`` a bucket group's collective starts during backward, before
``finalize_model_grads``; the guard's drill and origin pass must go in before it
(:mod:`megatron_patches.seams.grad_sync`). Megatron's own check is off in the harness (megatron-core's
default), so the guard's fused pass is what finds the origin.
"""

import pytest

from conftest import run_tiny

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def one_origin(run, step: int) -> dict:
    """One incident at ``step``: rank 1's own FC1 gradient, named before the reduction on dp 1, graded
    warning; the reduction carried the NaN into the optimizer's view (its owner's shard)."""
    assert run.returncode == 0 and run.result["params_finite"], run.output[-3000:]
    [record] = run.incidents
    assert (record["step"], record["kind"], record["action"]) == (step, "nan", "skip_step")
    assert record["origin_ranks"] == [1] and record["severity"] == "warning"
    [before] = record["pre_reduction"]
    assert (before["name"], before["layer"], before["ranks"]["global"], before["ranks"]["dp"]) == (FC1, 1, 1, 1)
    assert {p["name"] for p in record["params"]} == {FC1}
    return record


@pytest.mark.multiproc
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_overlapped_reduction_names_one_origin_at_the_bucket_group(tmp_path, precision):
    """Several bucket groups (small buckets), each reduced as soon as its gradients are ready."""
    run = run_tiny(tmp_path, "--steps", "6", "--distributed-optimizer", "--overlap-grad-reduce",
                   "--ddp-bucket-size", "20000", "--precision", precision,
                   "--inject", f"nan:step=3,rank=1,phase=local,param={FC1}", nproc=2)
    record = one_origin(run, 3)
    assert all(p["shard"] for p in record["params"])


@pytest.mark.multiproc
def test_overlapped_all_reduce_names_one_origin(tmp_path):
    """Without the distributed optimizer the groups all-reduce: every replica sees the NaN."""
    run = run_tiny(tmp_path, "--steps", "6", "--overlap-grad-reduce", "--ddp-bucket-size", "20000",
                   "--inject", f"nan:step=3,rank=1,phase=local,param={FC1}", nproc=2)
    record = one_origin(run, 3)
    assert record["replicas_reached"] == 2
