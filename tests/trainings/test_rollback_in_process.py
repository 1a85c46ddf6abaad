"""A rollback in Megatron-LM's packaged loop made in the same processes (recovery.mode: in_process):
in-memory snapshots certified by the checks after them, the newest certified one restored, the
iterations since redone on the batches they read, and the run then equal to an uninterrupted
one bit for bit (every rank's weights and optimizer state after every iteration, SHA-256 by
megatron_patches.testing.step_probe; every logged loss). The negative control leaves the data
position where the fault left it: the equality must break. The same equality holds for a
rollback made by a restart (recovery.mode: restart), with its own negative control.

Ranks are forked from pytest (conftest.run_packaged_loop): one process lifetime per rank, so an
exit 84 (a restart) shows as the run's exit code and fails these tests.
"""

from __future__ import annotations

import re
import shutil

import pytest

from megatron_patches.seams.megatron_lm import inprocess as megatron_lm_inprocess, state as megatron_lm_state
from megatron_patches.testing import step_probe
from megatron_lm_loop import FC1, TINY, Loop, _packaged_loop_available, guard_env, incidents, iterations, logged_losses, patched_copy
from test_variant_loops import BF16_STATES, OFFLOAD, PRECISION_AWARE, VARIANTS, connections

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not _packaged_loop_available(),
                                 reason="the installed megatron-core ships no megatron/training (0.17+ does)")]

ITERS = 10
FAULT = f"nan:step=5,count=2,rank=1,phase=local,param={FC1}"
"""Rank 1's own fc1 gradient NaN at iterations 5 and 6: a skip, then a rollback."""
EXACT = {"recovery": {"lr_factor": 1, "blacklist": "deterministic", "snapshot_interval": 2}}
"""A rollback that changes nothing but the iterations redone."""
DP2_BF16_DISTOPT = ("--bf16", "--use-distributed-optimizer")
LAYOUTS = {
    "dp2_bf16_distopt": (DP2_BF16_DISTOPT, FAULT),
    # Two stages: layer 1 and its fc1 live on rank 1 (no data parallelism: the optimizer's gradient).
    "pp2": (("--pipeline-model-parallel-size", "2"), f"nan:step=5,count=2,rank=1,param={FC1}"),
    # Two expert ranks (a dense weight: the experts' own are named in tests/trainings/test_moe.py).
    # Interleaved: each virtual stage's data iterator taped on its own (make test-all).
    "pp2_vpp2": (("--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
                  "1"), "nan:step=5,count=2,rank=1,param=decoder.layers.3.mlp.linear_fc1.weight"),
    "dp2_fp32": ((), FAULT),
    # The optimizer variants of tests/trainings/test_variant_loops.py (stand-ins named there): host copies of
    # CPU offload, scaled states of the precision-aware optimizer, DTensor shards of FSDP2, and
    # Megatron-FSDP, whose compute weights are copied again from the restored main shards. Under
    # FSDP the drill lands after the reduce-scatter (no view of a rank's gradient before it).
    # fp16 with a constant loss scale: a NaN is an overflow incident like any other (with a dynamic
    # scale it is the scaler's own skip), and the snapshot holds the scaler's state.
    "fp16_distopt": (("--fp16", "--loss-scale", "128", "--no-check-for-nan-in-loss-and-grad",
                      "--use-distributed-optimizer"), FAULT),
    "cpu_offload": (OFFLOAD, FAULT),
    "precision_aware_bf16_states": ((*PRECISION_AWARE, *BF16_STATES), FAULT),
    "torch_fsdp2": (VARIANTS["torch_fsdp2"], FAULT.replace("phase=local", "phase=grad")),
    "megatron_fsdp": (VARIANTS["megatron_fsdp"], FAULT.replace("phase=local", "phase=grad")),
    "ep2_moe": (("--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
                 "--disable-bias-linear", "--bf16", "--use-distributed-optimizer"),
                "nan:step=5,count=2,rank=1,phase=local,param=decoder.layers.1.self_attention.linear_qkv.weight"),
}


def train(tmp_path, name: str, *flags: str, drill: str | None = None, config: dict = EXACT, iters: int = ITERS,
          save_interval: int = 100, earlier: tuple[str, ...] = (), loop: Loop = Loop(None)) -> dict:
    """One run of ``iters`` iterations on 2 ranks: its exit code, output, probe lines and records.
    ``earlier``: the output of launches before this one into the same directory (a restart's
    first job), whose logged losses this run's own override; ``loop``: the packaged loop (its
    ranks forked from here) or a checkout's ``pretrain_gpt.py`` (under torchrun)."""
    where = tmp_path / name
    where.mkdir(exist_ok=True)
    env = {**guard_env(where, inject=[drill] if drill else [], **config), step_probe.ENV: str(where / "probe")}
    ckpt = where / "ckpt"
    proc = loop.run(env, "--train-iters", str(iters), "--save", str(ckpt), "--load", str(ckpt),
                    "--save-interval", str(save_interval), *flags)
    code, output = proc.returncode, proc.stdout + proc.stderr
    probes = step_probe.read(where / "probe")
    last = {rank: {line["iteration"]: line for line in lines} for rank, lines in probes.items()}  # a redo's line wins
    losses = logged_losses(*earlier, output)
    return {"code": code, "output": output, "outputs": (*earlier, output), "after": last, "losses": losses, "incidents": incidents(where)}


def digests(run: dict) -> dict:
    return {rank: {i: (line["weights"], line["state"]) for i, line in lines.items()} for rank, lines in run["after"].items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run of a layout (no drill, the same flags), made once per module."""
    made: dict = {}

    def of(layout: str) -> dict:
        if layout not in made:
            made[layout] = train(tmp_path_factory.mktemp(layout), "clean", *LAYOUTS[layout][0])
            assert made[layout]["code"] == 0, made[layout]["output"][-4000:]
        return made[layout]

    return of


@pytest.fixture
def baseline(uninterrupted):
    return uninterrupted("dp2_bf16_distopt")


SLOW = ("pp2_vpp2", "dp2_fp32", "precision_aware_bf16_states", "fp16_distopt")  # make test-all; measured exact like the others


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name
                                    for name in sorted(LAYOUTS)])
def test_a_persistent_nan_rolls_back_in_process_and_equals_the_uninterrupted_run(tmp_path, uninterrupted, layout,
                                                                                  monkeypatch):
    flags, drill = LAYOUTS[layout]
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections(flags))
    baseline = uninterrupted(layout)
    run = train(tmp_path, "rolled", *flags, drill=drill)
    output = run["output"]
    assert run["code"] == 0, output[-6000:]  # no exit 84: the same processes went on
    assert "stopping with exit code" not in output
    found = run["incidents"]
    assert [(i["step"], i["action"]) for i in found] == [(5, "skip_step"), (6, "rollback")]
    # Snapshots at 2 and 4; the check of 5 flagged, so 4 was never certified: the target is 2.
    assert found[1]["rolled_back_to"] == 2 and found[1]["checkpoint"] == "in-memory snapshot"
    assert found[1]["certified_at"] == 3  # the clean check of iteration 3 made it a target
    assert "rolled back in process to the snapshot of iteration 2 and redid 4 iteration(s)" in output
    assert sorted(iterations(output)) == list(range(1, ITERS + 1))
    assert digests(run) == digests(baseline)  # every rank, every iteration, every bit
    assert run["losses"] == baseline["losses"] and len(run["losses"]) == ITERS


def test_without_the_data_position_restored_the_rollback_is_not_exact(tmp_path, baseline, monkeypatch):
    """Negative control: the redo reads on from where the fault left the data iterator."""
    monkeypatch.setattr(megatron_lm_state.BatchTape, "replay", lambda self, iteration: None)
    run = train(tmp_path, "unrestored", *DP2_BF16_DISTOPT, drill=FAULT)
    assert run["code"] == 0, run["output"][-6000:]
    assert run["incidents"][1]["rolled_back_to"] == 2
    final = {rank: lines[ITERS] for rank, lines in digests(run).items()}
    assert final != {rank: lines[ITERS] for rank, lines in digests(baseline).items()}


@pytest.mark.megatron_lm
def test_a_checkout_s_pretrain_gpt_rolls_back_in_process_and_equals_its_uninterrupted_run(tmp_path,
                                                                                          megatron_lm_dir):
    """The same fault through a Megatron-LM checkout's own pretrain_gpt.py (patched by `make patch`'s
    script, run under torchrun: MEGATRON_LM_DIR), DP2 bf16 with the distributed optimizer: rolled
    back in process to the snapshot of 2, and every rank's weights, optimizer state and logged
    loss after every iteration equal the checkout's uninterrupted run."""
    loop = Loop(patched_copy(megatron_lm_dir, tmp_path, None))
    flags = (*DP2_BF16_DISTOPT, *loop.checkpoint_format())
    clean, rolled = train(tmp_path, "clean", *flags, loop=loop), train(tmp_path, "rolled", *flags, drill=FAULT, loop=loop)
    for run in (clean, rolled):
        assert run["code"] == 0, run["output"][-6000:]
    assert [(i["step"], i["action"], i.get("rolled_back_to")) for i in rolled["incidents"]] == [
        (5, "skip_step", None), (6, "rollback", 2)]
    assert "rolled back in process to the snapshot of iteration 2" in rolled["output"]
    assert digests(rolled) == digests(clean) and len(digests(clean)[0]) == ITERS
    assert rolled["losses"] == clean["losses"] and len(clean["losses"]) == ITERS


def test_with_a_blacklist_the_rollback_equals_a_run_that_skips_those_iterations(tmp_path):
    """blacklist: always leaves the episode's iterations (5 and 6) out of the redo: the run then
    equals an uninterrupted one told to skip them (Megatron's --iterations-to-skip 5 6), every rank
    and iteration outside them, the last one included; its losses too."""
    skipping = train(tmp_path, "skipping", *DP2_BF16_DISTOPT, "--iterations-to-skip", "5", "6")
    assert skipping["code"] == 0, skipping["output"][-6000:]
    always = {"recovery": {**EXACT["recovery"], "blacklist": "always"}}
    run = train(tmp_path, "blacklisted", *DP2_BF16_DISTOPT, drill=FAULT, config=always)
    assert run["code"] == 0, run["output"][-6000:]
    assert run["incidents"][1]["rolled_back_to"] == 2 and run["incidents"][1]["iterations_skipped"] == [5, 6]
    outside = {rank: {i: d for i, d in lines.items() if i not in (5, 6)} for rank, lines in digests(run).items()}
    assert outside == digests(skipping) and len(outside[0]) == ITERS - 2
    assert {i: v for i, v in run["losses"].items() if i not in (5, 6)} == {
        i: v for i, v in skipping["losses"].items() if i not in (5, 6)}


def test_a_weight_one_rank_holds_corrupted_is_named_there_and_rolled_back(tmp_path):
    """DP2 bf16, distributed optimizer: a NaN in rank 0's shard of fc1's main weights (rank 0 holds
    it) before the update of iteration 5. The all-gather hands it to both replicas, so both ranks'
    gradients of iteration 6 are non-finite before the reduction (before: two origins, a critical
    stop, exit 86); the slow path finds it held on rank 0, the one origin: a skip, then (it
    lasts) a rollback in process, and the run ends finite. Since issue 56 the held-state check
    reads all of the held state at the check after snapshot 4 (iteration 5), so the NaN is found
    there, before any gradient goes non-finite; that flagged check drops snapshot 4, not yet
    certified, and the rollback goes to the snapshot of 2."""
    run = train(tmp_path, "held", *DP2_BF16_DISTOPT, drill=f"nan:step=5,rank=0,phase=param,param={FC1}")
    assert run["code"] == 0, run["output"][-6000:]
    found = run["incidents"]
    assert [(i["step"], i["action"], i["origin_ranks"]) for i in found] == [(5, "skip_step", [0]), (6, "rollback", [0])]
    first = found[0]["first"]
    assert (first["name"], first["ranks"]["global"], first["reasons"]) == (FC1, 0, ["held:weight"])
    assert found[0]["message"].startswith(f"non-finite weight first at {FC1} (layer 1, rank 0")
    assert found[1]["rolled_back_to"] == 2 and all(line["finite"] for line in run["after"][0].values())


def test_a_weight_bit_flipped_under_the_audit_is_rolled_back_to_the_uninterrupted_run(tmp_path, baseline):
    """detectors.audit on, DP2 bf16, distributed optimizer: the lowest mantissa bit of one element of
    rank 0's shard of fc1's main weights flips before the update of iteration 5, a change no other
    check can see. The audit finds it at that check, on rank 0; it stays, so 6 rolls back in process
    to the snapshot of 2 (the check of 5 flagged: 4 was never certified), the iterations since are
    redone on their own batches, and every rank's weights and optimizer state after every iteration
    equal the unguarded-by-audit uninterrupted run's, bit for bit."""
    config = {**EXACT, "detectors": {"audit": {"enabled": True}}}
    drill = f"bitflip:step=5,rank=0,phase=param,param={FC1},bit=mantissa_low"
    run = train(tmp_path, "audited", *DP2_BF16_DISTOPT, drill=drill, config=config)
    assert run["code"] == 0, run["output"][-6000:]
    found = run["incidents"]
    assert [(i["step"], i["kind"], i["action"], i["origin_ranks"]) for i in found] == [
        (5, "state_altered", "skip_step", [0]), (6, "state_altered", "rollback", [0])]
    first = found[0]["first"]
    assert (first["name"], first["ranks"]["global"], first["reasons"]) == (FC1, 0, ["altered:weight"])
    assert found[1]["rolled_back_to"] == 2
    assert digests(run) == digests(baseline)


RESTART = {"recovery": {**EXACT["recovery"], "mode": "restart"}}


def test_a_rollback_made_by_a_restart_equals_the_uninterrupted_run(tmp_path, baseline, monkeypatch):
    """recovery.mode: restart, lr_factor 1, DP2 bf16 with the distributed optimizer, checkpoints
    every 2 iterations: the first job exits 84 at iteration 6, the second (the same command)
    loads the checkpoint of 2 (4 was never certified: the check of 5 flagged) and trains on.
    Every rank's weights and optimizer state after every iteration equal the uninterrupted run's
    (the second job's lines win for 3 to 10), and so does every logged loss but one: Megatron's
    first logged iteration of a job (3 here) does not reset its running sums (0.17+), so the
    job's next line (4) prints the mean of 3 and 4. The negative control resumes a copy of the
    first job's directory with the data loader started at the first sample."""
    first = train(tmp_path, "restarted", *DP2_BF16_DISTOPT, drill=FAULT, config=RESTART, save_interval=2)
    assert first["code"] == 84, first["output"][-6000:]
    shutil.copytree(tmp_path / "restarted", tmp_path / "unrestored")
    run = train(tmp_path, "restarted", *DP2_BF16_DISTOPT, config=RESTART, save_interval=2, earlier=(first["output"],))
    assert run["code"] == 0, run["output"][-6000:]
    assert "resumed from healthy checkpoint iteration 2" in run["output"]
    assert [(i["step"], i["action"]) for i in run["incidents"]] == [(5, "skip_step"), (6, "rollback")]
    assert digests(run) == digests(baseline)  # every rank, every iteration, every bit
    resumed_second = 4
    mean = (float(baseline["losses"][3]) + float(baseline["losses"][4])) / 2
    assert float(run["losses"].pop(resumed_second)) == pytest.approx(mean, rel=1e-6)
    assert run["losses"] == {i: loss for i, loss in baseline["losses"].items() if i != resumed_second}

    from megatron.training import training

    loader = training.build_pretraining_data_loader
    monkeypatch.setattr(training, "build_pretraining_data_loader", lambda dataset, consumed: loader(dataset, 0))
    unrestored = train(tmp_path, "unrestored", *DP2_BF16_DISTOPT, config=RESTART, save_interval=2)
    assert unrestored["code"] == 0, unrestored["output"][-6000:]
    final = {rank: lines[ITERS] for rank, lines in digests(unrestored).items()}
    assert final != {rank: lines[ITERS] for rank, lines in digests(baseline).items()}


CORRUPTED = 8
DIVERGENCE = {"recovery": {**EXACT["recovery"], "snapshots_kept": 4},
              "detectors": {"consistency": {"target": "params", "sample_fraction": 0.25}},
              "response": {"recur_count": 1}}
"""Replicas compared on their weights, a quarter of the tensors per check (each tensor every 4th
check); any incident an error, so the first finding rolls back."""
FLIP = f"bitflip:step={CORRUPTED},rank=1,phase=param,param={FC1},bit=0"
"""Rank 1's copy of fc1 loses its lowest mantissa bit right before iteration 8's update: no NaN, no
spike, only the two replicas no longer agree."""


def test_a_replica_corrupted_before_a_snapshot_rolls_back_to_a_target_before_the_corruption(tmp_path, monkeypatch):
    """DP2 fp32: the corruption is found at the check that next reads fc1 (iteration 11 here), after
    the snapshot of iteration 8, which holds the corrupted copy, was certified by the check of 9,
    which did not read fc1. The divergence dates back one round of the detector (4 checks): every
    snapshot from iteration 7 on is passed over, the target precedes the corruption, and the
    replicas agree again at the end, as in the run without the fault. Without the dating (the
    negative control), the rollback goes to the snapshot of iteration 8."""
    baseline = train(tmp_path, "clean", iters=16, config=DIVERGENCE)
    run = train(tmp_path, "dated", drill=FLIP, iters=16, config=DIVERGENCE)
    assert run["code"] == 0, run["output"][-6000:]
    found = run["incidents"]
    assert found and "rank_mismatch" in found[0]["kinds"] and found[0]["action"] == "rollback", found
    assert (found[0]["step"], found[0]["rolled_back_to"]) == (11, 6)  # 8 certified at 9, passed over
    assert digests(run) == digests(baseline)
    final = {rank: lines[16] for rank, lines in digests(run).items()}
    assert final[0][0] == final[1][0]  # the replicas' weights agree again

    monkeypatch.setattr(megatron_lm_inprocess, "diverged_since", lambda config, found_at: found_at)
    undated = train(tmp_path, "undated", drill=FLIP, iters=16, config=DIVERGENCE)
    target = undated["incidents"][0]["rolled_back_to"]
    assert target == CORRUPTED, undated["incidents"][0]  # the snapshot holding the corrupted copy


def test_a_guarded_job_says_one_line_at_start(baseline):
    """At the default log level the guard's start is one line on rank 0 (Megatron's own NaN check
    being on, the default, is a debug line), said once the optimizer is built: with what the
    in-memory snapshots may hold in host memory. The first snapshot, measured, holds no more than
    that (else a warning says so)."""
    first = re.search(r"iteration\s+1/", baseline["output"])
    started = [line for line in baseline["output"][:first.start()].splitlines() if line.startswith("[megatron_patches]")]
    assert len(started) == 1 and started[0].startswith("[megatron_patches] guarding megatron-core "), started
    bound = re.search(r"; in-memory snapshots every 2 iterations, 2 kept: at most ([0-9.]+) MiB of host memory per rank$",
                      started[0])
    assert bound and float(bound.group(1)) > 0, started[0]
    assert "reckoned at start" not in baseline["output"]
