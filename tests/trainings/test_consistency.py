"""Cross-replica consistency: one data-parallel replica whose gradients or parameters differ
from the others' is caught as rank_mismatch, and the record names that rank and parameter."""

import pytest

from conftest import assert_trained, run_tiny

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg; 0.17+ is held through Megatron-LM's loop (conftest)

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def mismatch(record):
    return record["rank_mismatch"]["groups"][0]


@pytest.mark.multiproc
def test_dp2_bitflip_on_rank_1_names_rank_1(tmp_path):
    run = run_tiny(tmp_path, "--steps", "20", "--inject", f"bitflip:step=8,param={FC1},rank=1", nproc=2)
    assert_trained(run, min_drop=0.3)
    [record] = run.incidents
    assert (record["step"], record["kind"], record["action"]) == (8, "rank_mismatch", "skip_step")
    assert record["suspected_ranks"] == [1]
    assert record["first"]["name"] == FC1 and record["first"]["ranks"]["global"] == 1
    # Two replicas have no majority: the one farther from the last accepted step is suspected.
    assert mismatch(record)["decided_by"] == "distance_to_last_accepted"
    [hardware] = record["rank_mismatch"]["suspected_hardware"]
    assert hardware["rank"] == 1 and hardware["dp"] == 1 and hardware["params"] == [FC1]


def every_tensor_each_check(tmp_path, target="auto"):
    """A config that checksums every tensor on every check (the default rotates 1/16 of them)."""
    config = tmp_path / "guard.yaml"
    config.write_text(f"detectors:\n  consistency:\n    target: {target}\n    sample_fraction: 1.0\n")
    return str(config)


@pytest.mark.multiproc
def test_dp4_bitflips_on_one_rank_are_found_by_majority(tmp_path):
    # Step 6: the top exponent bit (the norm overflows on that rank). Step 12: a mantissa bit:
    # no NaN, no Inf, the same sum of squares in fp32 -- only the bit-exact checksum differs.
    run = run_tiny(tmp_path / "out", "--steps", "20", "--config", every_tensor_each_check(tmp_path),
                   "--inject", f"bitflip:step=6,param={FC1},rank=3",
                   "--inject", f"bitflip:step=12,param={QKV},rank=2,bit=20", nproc=4)
    assert_trained(run, min_drop=0.3)
    loud, silent = run.incidents
    for record, step, rank, name in ((loud, 6, 3, FC1), (silent, 12, 2, QKV)):
        assert (record["step"], record["kind"]) == (step, "rank_mismatch")
        assert record["suspected_ranks"] == [rank]
        assert mismatch(record)["decided_by"] == "majority"
        assert record["first"]["name"] == name and record["first"]["ranks"]["global"] == rank
    assert silent["kinds"] == ["rank_mismatch"] and silent["total_norm"] is not None
    prints = mismatch(silent)["fingerprints"]
    assert prints["2"][0] == prints["0"][0] and prints["2"][1:] != prints["0"][1:]


@pytest.mark.multiproc
def test_diverged_parameters_are_caught_the_step_after(tmp_path):
    # target=params compares what the distributed optimizer compares (the parameters). A
    # silent flip in rank 1's gradient at step 8 makes rank 1 apply a different update; from
    # step 9 its parameters differ from the three other replicas'.
    run = run_tiny(tmp_path / "out", "--steps", "20", "--config", every_tensor_each_check(tmp_path, "params"),
                   "--save-interval", "5",
                   "--inject", f"bitflip:step=8,param={QKV},rank=1,bit=20", nproc=4)
    assert_trained(run, min_drop=0.3)  # the diverged replica persists until a rollback to step 5
    first = run.incidents[0]
    assert (first["step"], first["kind"]) == (9, "rank_mismatch")
    assert first["rank_mismatch"]["compared"] == "params"
    assert first["suspected_ranks"] == [1]
    assert first["rank_mismatch"]["suspected_hardware"][0]["params"] == [QKV]


@pytest.mark.multiproc
def test_default_rotating_share_still_catches_diverged_parameters(tmp_path):
    """The default checksums 1/16 of the tensors per check: the diverged replica of the test
    above is found within 16 checks of the divergence, named the same way."""
    config = tmp_path / "guard.yaml"
    config.write_text("detectors:\n  consistency:\n    target: params\n")
    run = run_tiny(tmp_path / "out", "--steps", "26", "--config", str(config),
                   "--inject", f"bitflip:step=8,param={QKV},rank=1,bit=20", nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    first = run.incidents[0]
    assert first["kind"] == "rank_mismatch" and 9 <= first["step"] <= 9 + 16, first["step"]
    # Two replicas cannot outvote each other: rank 1 alone when the distance to the share's last
    # accepted value decides, both when it cannot (the record says which).
    group = first["rank_mismatch"]["groups"][0]
    assert group["ranks"] == [0, 1]
    assert (group["decided_by"], first["suspected_ranks"]) in (("distance_to_last_accepted", [1]),
                                                               ("undecided", [0, 1])), group


# --- clean trainings raise nothing ------------------------------------------------------

CLEAN = [
    ("fp32", 2, []),
    ("bf16", 2, ["--distributed-optimizer"]),
    ("fp16", 4, ["--tp", "2"]),
]


def _clean(tmp_path, cases, steps):
    found = {}
    for precision, nproc, extra in cases:
        run = run_tiny(tmp_path / f"{precision}-{nproc}", "--steps", str(steps), "--precision", precision,
                       *extra, nproc=nproc)
        assert_trained(run)
        found[(precision, nproc, *extra)] = [(r["step"], r["kind"]) for r in run.incidents]
    count = sum(len(v) for v in found.values())
    print(f"false positives over {len(found)} clean multi-rank runs of {steps} steps: {count} {found}")
    return count, found


@pytest.mark.multiproc
def test_clean_data_parallel_training_raises_nothing(tmp_path):
    count, found = _clean(tmp_path, CLEAN[:2], steps=40)
    assert count == 0, found


@pytest.mark.multiproc
@pytest.mark.slow
def test_clean_data_parallel_sweep_raises_nothing(tmp_path):
    count, found = _clean(tmp_path, CLEAN + [("bf16", 4, []), ("fp32", 4, ["--pp", "2", "--layers", "4"])],
                          steps=120)
    assert count == 0, found
