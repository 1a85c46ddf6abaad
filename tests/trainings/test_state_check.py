"""Lasting faults in what a rank holds, found with the defaults (issue 56): an Adam first moment
x1000, a second moment set to Inf and one weight element x1000 on rank 0 are found by the
held-state check within one turn of its rotation, named (parameter, tensor, rank), classed hardware
with nothing blacklisted, and rolled back to a checkpoint the check had read in full and clean; the
state after the rollback equals the clean twin's bit for bit (``lr_factor: 1``). A job resumed from
a checkpoint judges the fault two steps after the resume against the baselines it carried. With the
check off the same faults pass and stay in the state.

One training per case, shared by the assertions on it (module-scoped fixtures)."""

import shutil

import pytest
import torch

from conftest import run_tiny

pytestmark = pytest.mark.one_line  # harness runs: the 0.16 leg (conftest)

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
AT = 30
DRILLS = {  # drill -> what the record must name
    f"scale:step={AT},phase=state,slot=exp_avg,param={FC1},rank=0,factor=1000": "off:exp_avg",
    f"inf:step={AT},phase=state,slot=exp_avg_sq,param={FC1},rank=0": "held:exp_avg_sq",
    # One weight element x1000: its slice's largest rises past weight_ratio (10), not the moments' 100.
    f"scale:step={AT},phase=param,param={FC1},rank=0,scope=element,seed=1234,factor=1000": "off:weight",
}
ONLY_ROLLBACK_TO_BE_SAME = "recovery: {lr_factor: 1.0}\nscene: {enabled: false}\n"
RUN = ("--steps", "40", "--save-interval", "4", "--branch-dump")


def train(where, *drills: str, state: bool = True, extra: tuple = (), nproc: int = 1):
    where.mkdir(parents=True)
    config = where / "guard.yaml"
    config.write_text(ONLY_ROLLBACK_TO_BE_SAME + ("" if state else "detectors: {state: {enabled: false}}\n"))
    args = [arg for spec in drills for arg in ("--inject", spec)]
    return run_tiny(where / "out", *RUN, *extra, "--config", str(config), *args, nproc=nproc)


def dumped(run, rank: int = 0) -> dict:
    """The weights, main weights and Adam moments the run ended with (testing/branch.py's dump)."""
    saved = torch.load(run.out / f"branch_state_rank{rank}.pt", weights_only=False)
    return {k: v for k, v in saved.items() if isinstance(v, torch.Tensor)}


def same_state(a: dict, b: dict) -> list:
    """Keys whose tensors differ in any bit (NaN compared as a value)."""
    return [k for k in a if k not in b or not torch.equal(a[k].view(torch.int32), b[k].view(torch.int32))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("state_check")
    out = {"twin": train(base / "twin")}
    for i, spec in enumerate(DRILLS):
        out[spec] = train(base / f"drill{i}", spec)
    out["off"] = train(base / "off", *DRILLS, state=False)
    return out


def test_a_clean_run_raises_nothing(runs):
    twin = runs["twin"]
    assert twin.returncode == 0, twin.output[-3000:]
    assert twin.incidents == [] and twin.result["params_finite"]


@pytest.mark.parametrize("spec", list(DRILLS))
def test_a_lasting_state_fault_is_found_within_a_turn_named_and_rolled_back_to_the_clean_twins_state(runs, spec):
    run = runs[spec]
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    # Within one turn of the rotation (5 checks), or sooner: the checkpoint of step 32 makes the check
    # of step 33 read all of the held state before it can certify that checkpoint.
    assert record["kind"] == "state_off" and AT <= record["step"] <= 33
    assert record["origin_ranks"] == [0] and record["first"]["name"] == FC1
    assert record["first"]["ranks"]["global"] == 0 and DRILLS[spec] in record["first"]["reasons"]
    assert (record["cause"]["class"], record["blacklisted"]) == ("hardware", [])
    # Rolled back at once to the newest checkpoint read clean: step 28's, read in full at step 29.
    assert (record["action"], record["rolled_back_to"]) == ("rollback", 28)
    # Nothing corrupted is left: weights, main weights and moments equal the clean twin's, bit for bit.
    assert same_state(dumped(run), dumped(runs["twin"])) == []
    assert run.result["losses"][-1] == runs["twin"].result["losses"][-1]


def test_with_the_check_off_the_same_faults_pass_and_stay(runs):
    off = runs["off"]
    assert off.returncode == 0, off.output[-3000:]
    assert not [r for r in off.incidents if r["step"] >= AT], off.incidents
    state = dumped(off)
    assert same_state(state, dumped(runs["twin"]))  # the run ends elsewhere than the clean twin...
    assert not all(bool(torch.isfinite(v).all()) for v in state.values())  # ...with the Inf second moment kept


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A job that saved at step 24 and is resumed from that checkpoint, an exp_avg x1000 at step 26:
    once with the defaults, once with the check off (both resumed from one copy of the first job)."""
    base = tmp_path_factory.mktemp("resumed")
    first = train(base / "first", extra=("--steps", "24"))
    assert first.returncode == 0 and first.incidents == [], first.output[-3000:]
    out = {}
    for name, state in (("on", True), ("off", False)):
        shutil.copytree(first.out, base / name / "out")
        off = "" if state else "detectors: {state: {enabled: false}}\n"
        (base / name / "guard.yaml").write_text(ONLY_ROLLBACK_TO_BE_SAME + off)
        out[name] = run_tiny(base / name / "out", *RUN, "--resume", "--config", str(base / name / "guard.yaml"),
                             "--inject", RESUMED_DRILL)
    return out


RESUMED_DRILL = f"scale:step=26,phase=state,slot=exp_avg,param={FC1},rank=0,factor=1000"


def test_a_resumed_job_keeps_the_checks_warm_up_and_baselines_and_finds_a_fault_just_after(resumed, runs):
    """The check's count and baselines travel in the checkpoint: two steps after a resume the x1000
    is judged against the saved baselines. (Without them the check warmed up again for 20 checks
    after every resume or campaign branch and took its first baselines from the corrupted state,
    which nothing then stood far above: the quick campaign's DP2 miss.)"""
    run = resumed["on"]
    assert run.returncode == 0, run.output[-3000:]
    (record,) = run.incidents
    assert (record["kind"], record["step"], record["first"]["name"]) == ("state_off", 26, FC1)
    assert record["first"]["reasons"] == ["off:exp_avg"] and record["origin_ranks"] == [0]
    assert (record["action"], record["rolled_back_to"]) == ("rollback", 24)
    assert same_state(dumped(run), dumped(runs["twin"])) == []  # as if neither the restart nor the fault had been


def test_a_resumed_job_with_the_check_off_lets_the_same_fault_pass(resumed, runs):
    off = resumed["off"]
    assert off.returncode == 0, off.output[-3000:]
    assert off.incidents == []
    assert same_state(dumped(off), dumped(runs["twin"]))


@pytest.mark.multiproc
def test_dp2_with_the_distributed_optimizer_names_rank_0s_shard_and_leaves_nothing_corrupted(tmp_path):
    """bf16, distributed optimizer: FC1's main weight and moments live in rank 0's shard."""
    dp2 = ("--precision", "bf16", "--distributed-optimizer")
    spec = next(iter(DRILLS))
    run = train(tmp_path / "on", spec, extra=dp2, nproc=2)
    twin = train(tmp_path / "twin", extra=dp2, nproc=2)
    assert run.returncode == 0 and twin.returncode == 0, run.output[-3000:] + twin.output[-3000:]
    assert twin.incidents == []
    (record,) = run.incidents
    assert record["kind"] == "state_off" and AT <= record["step"] <= 33
    assert record["origin_ranks"] == [0] and record["first"]["name"] == FC1 and record["first"]["shard"]
    assert [f["ranks"]["global"] for f in record["held_off"]] == [0]
    assert (record["cause"]["class"], record["action"], record["blacklisted"]) == ("hardware", "rollback", [])
    assert record["rolled_back_to"] == 28
    # No corrupted value is left: every rank's moments end finite and of the twin's magnitude (the x1000
    # would stand 100 times above it). Not bit for bit: under bf16 and the distributed optimizer a
    # rollback in the harness redoes the steps after its checkpoint a few ulps apart from an
    # uninterrupted run, whatever triggered it (a NaN drill with this check off does the same; 2026-12-07).
    for rank in (0, 1):
        state, clean = dumped(run, rank), dumped(twin, rank)
        for key in ("main", "exp_avg", "exp_avg_sq"):
            assert bool(torch.isfinite(state[key]).all()), (rank, key)
            assert state[key].abs().max() <= 2 * clean[key].abs().max(), (rank, key)
