"""A poisoned sample in Megatron-LM's packaged loop (issue 57): the ``poison:sample=I`` drill acts there
(a NaN in the word embedding's output for exactly that sample's row, every time it is fed), the
guard's forward replay of the skipped step finds the loss of that row, and only that row, non-finite
again, so the cause is ``data`` and that sample is blacklisted in the ledger; a later in-process
rollback's redo leaves out the iteration that read it, so the training goes on without meeting it
again. Negative controls: a gradient NaN that the forward replay does not reproduce blames no sample;
a NaN written into a rank's Adam state, which the replay reproduces too, is hardware and blames no
sample; a loop whose sample positions the guard does not know refuses the drill at the first step.

Ranks are forked from pytest (conftest.run_packaged_loop), two data-parallel ranks, fp32.
"""

from __future__ import annotations

import math

import pytest

from megatron_patches.ledger import Ledger
from megatron_patches.seams.megatron_lm import inprocess as megatron_lm_inprocess
from megatron_lm_loop import FC1, Loop, _packaged_loop_available, guard_env, incidents, iterations, logged_losses

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not _packaged_loop_available(),
                                 reason="the installed megatron-core ships no megatron/training (0.17+ does)")]

ITERS = 10
POISON = "poison:sample=17"
"""Iteration 5 reads positions 16..19 (global batch 4): 16, 17 on rank 0 (17 its second row), 18, 19 on rank 1."""
LATER = f"nan:step=6,rank=1,phase=local,param={FC1}"
"""Rank 1's own fc1 gradient NaN at iteration 6: the second incident in a row, a rollback in process."""
CONFIG = {"recovery": {"blacklist": "deterministic", "snapshot_interval": 2, "lr_factor": 1}}
OWN_CHECK_OFF = "--no-check-for-nan-in-loss-and-grad"
"""Megatron's loss check off: the guard skips the step and replays its forward pass itself."""


def train(tmp_path, *drills: str, iters: int = ITERS, flags: tuple = (OWN_CHECK_OFF,)) -> dict:
    ckpt = tmp_path / "ckpt"
    proc = Loop(None).run(guard_env(tmp_path, inject=list(drills), **CONFIG), "--train-iters", str(iters),
                          "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "100", *flags)
    output = proc.stdout + proc.stderr
    losses = logged_losses(output)
    return {"code": proc.returncode, "output": output, "incidents": incidents(tmp_path), "losses": losses,
            "ledger": Ledger.load(str(ckpt))}


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """One training shared by the assertions: the poison at iteration 5, rank 1's gradient NaN at 6."""
    return train(tmp_path_factory.mktemp("poison"), POISON, LATER)


def test_the_poisoned_sample_is_data_and_only_it_is_blacklisted(poisoned):
    output = poisoned["output"]
    assert poisoned["code"] == 0, output[-6000:]
    first = poisoned["incidents"][0]
    assert (first["step"], first["action"]) == (5, "skip_step")
    assert first["batch"]["samples"] == [16, 17, 18, 19]
    assert (first["cause"]["class"], first["cause"]["confidence"]) == ("data", "high"), first["cause"]
    assert first["cause"]["evidence"][:2] == ["the replay reproduced the fault from the same state and batch",
                                              "on some of the step's micro-batches only"]
    assert first["replay"] == {"verdict": "deterministic", "narrowed": True}
    assert first["blacklisted"] == [17]
    assert first["forward_origin"]["ranks"] == [0]  # the poisoned row is rank 0's
    assert poisoned["ledger"].blacklist == [17]


def test_after_the_rollback_the_redo_leaves_the_poisoned_iteration_out_and_training_goes_on(poisoned):
    output = poisoned["output"]
    assert poisoned["code"] == 0, output[-6000:]
    assert [(i["step"], i["action"]) for i in poisoned["incidents"]] == [(5, "skip_step"), (6, "rollback")]
    rollback = poisoned["incidents"][1]
    # Snapshots at 2 and 4; the check of 5 flagged, so 4 was never certified: the target is 2.
    assert rollback["rolled_back_to"] == 2 and rollback["iterations_skipped"] == [5]
    assert rollback["cause"]["class"] != "data" and rollback["blacklisted"] == []  # no replay reproduced it
    assert "rolled back in process to the snapshot of iteration 2 and redid 3 iteration(s)" in output
    # The poison was fed once (iteration 5 the first time): no record after the rollback met it again.
    poisoned_steps = [i["step"] for i in poisoned["incidents"] if any("poison" in str(d) for d in i.get("injected", []))]
    assert poisoned_steps == [5], poisoned_steps
    assert sorted(iterations(output)) == list(range(1, ITERS + 1))
    after = [float(poisoned["losses"][i]) for i in range(6, ITERS + 1)]
    assert all(math.isfinite(loss) and loss < 100 for loss in after), after
    assert poisoned["ledger"].blacklist == [17] and poisoned["ledger"].hardware == []


def test_without_the_blacklisted_iteration_left_out_the_redo_meets_the_poison_again(tmp_path, monkeypatch):
    """Negative control of the test above: a redo that leaves no iteration out feeds sample 17 again."""
    monkeypatch.setattr(megatron_lm_inprocess, "reading", lambda consumed, blacklist, iterations: [])
    run = train(tmp_path, POISON, LATER)
    assert run["code"] == 0, run["output"][-6000:]
    assert [(i["step"], i["action"]) for i in run["incidents"]] == [(5, "skip_step"), (6, "rollback"), (5, "skip_step")]
    assert "iterations_skipped" not in run["incidents"][1] and run["losses"][5] == "NAN"
    # The skip decided during the redo is replayed at once, on its own batch (not after the next live
    # iteration, on that one's): the redone 5 is data again, sample 17 blamed again.
    redone = run["incidents"][2]
    assert redone["replay"] == {"verdict": "deterministic", "narrowed": True}, redone
    assert (redone["cause"]["class"], redone["blacklisted"]) == ("data", [17]), redone


def test_a_gradient_nan_the_forward_replay_does_not_reproduce_blames_no_sample(tmp_path):
    """Negative control: the same iteration's fault put into rank 0's gradient (not its data): the
    replay's losses stay finite, so no verdict, no data cause and nothing blacklisted."""
    run = train(tmp_path, f"nan:step=5,rank=0,phase=local,param={FC1}", iters=6)
    assert run["code"] == 0, run["output"][-6000:]
    [record] = run["incidents"]
    assert (record["step"], record["action"]) == (5, "skip_step")
    assert record["replay"] is None and record["cause"]["class"] != "data" and record["blacklisted"] == []
    assert run["ledger"].blacklist == []


def test_a_nan_written_into_adam_state_is_hardware_and_blames_no_sample(tmp_path):
    """Issue 57's other item in Megatron-LM's loop: a NaN written into rank 0's exp_avg_sq at iteration 5
    (bf16, distributed optimizer). The held-state check (issue 56; the snapshot of 4 asks for its whole
    read) finds it at that very step, before any forward pass goes non-finite, so the skipped step's
    replay has nothing to reproduce; the next step's NaN weight rolls back in process to the snapshot of
    2 (4 was never certified: its certifying check was the flagged one). Hardware, no sample
    blacklisted, no iteration left out."""
    run = train(tmp_path, f"nan:step=5,phase=state,slot=exp_avg_sq,param={FC1},rank=0", iters=10,
                flags=(OWN_CHECK_OFF, "--bf16", "--use-distributed-optimizer"))
    assert run["code"] == 0, run["output"][-6000:]
    skip, rollback = run["incidents"]
    assert (skip["step"], skip["action"], rollback["step"], rollback["action"]) == (5, "skip_step", 6, "rollback")
    assert skip["replay"] is None
    for record in (skip, rollback):
        assert (record["cause"]["class"], record["cause"]["confidence"]) == ("hardware", "high"), record["cause"]
        assert record["blacklisted"] == [] and "iterations_skipped" not in record
    assert rollback["rolled_back_to"] == 2
    assert run["ledger"].blacklist == [] and [e["step"] for e in run["ledger"].hardware] == [6]
    assert all(math.isfinite(float(run["losses"][i])) for i in range(1, 11))


def test_a_poison_drill_is_refused_at_start_where_the_loop_tells_no_sample_positions(tmp_path):
    """With another data loader than ``single`` the guard does not know which samples a rank reads,
    so the drill could not act: one line on rank 0, exit 2, no iteration, no record (the refusal every
    Megatron-LM loop gave before the drill acted there)."""
    run = train(tmp_path, "poison:sample=10", iters=4, flags=("--dataloader-type", "cyclic"))
    output = run["output"]
    assert run["code"] == 2, output[-4000:]
    lines = [line for line in output.splitlines() if "cannot act" in line]
    assert lines == ["[megatron_patches] drill(s) 'poison:sample=10' cannot act: this training loop feeds no poisoned "
                     "sample (the tiny-GPT harness does, and Megatron-LM's loop with --dataloader-type single); "
                     "rehearse a bad batch with an input drill instead, e.g. "
                     "bitflip:step=3,phase=input,module=embedding.word_embeddings,bit=30"], lines
    assert "Traceback" not in output and iterations(output) == {} and run["incidents"] == []
