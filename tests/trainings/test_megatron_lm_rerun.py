"""A NaN in the loss through Megatron-LM's loop: Megatron's loss check and rerun machine, the guard's
replay without it, and the faults on a step the guard does not check (issue 12, items 1 and 3)."""

from __future__ import annotations

import math
import re

import pytest

from megatron_patches import checkpoint
from megatron_patches.ledger import Ledger
from megatron_patches.findings import RankReport
from megatron_patches.report import diagnosis
from megatron_patches.seams import rerun_machine
from megatron_lm_loop import (  # noqa: F401 (loop_kind, megatron_lm_checkout: fixtures)
    FC1, loop_kind, megatron_lm_checkout, make_loop, guard_env, iterations, incidents)


# --- a NaN in the loss with stock flags: Megatron's loss check and rerun (issue 12, items 1 and 3) ------

FORWARD_NAN = "nan:step=4,rank=1,phase=forward,module=decoder.layers.1.mlp"


def test_megatron_rerun_fields_take_the_reproducible_verdict_and_name_the_loss_ranks():
    """Rank 0 merges every rank's share: one rank that reproduced its fault makes the step's
    verdict reproducible; the ranks whose loss was rejected are named in the message."""
    share = {"mode": "validate_results", "check": "loss", "message": "found NaN in local forward loss"}
    everyone = [RankReport(ranks={"global": 0}, megatron={"rerun": {**share, "check": "bucket norm", "verdict": "transient"}}),
                RankReport(ranks={"global": 1}, megatron={"loss_nonfinite": True, "rerun": {**share, "verdict": "reproducible"}}),
                RankReport(ranks={"global": 2})]
    fields, note = rerun_machine.record_fields(everyone, {})
    assert fields["loss_nonfinite"] is True
    assert fields["megatron_rerun"]["verdict"] == "reproducible" and fields["megatron_rerun"]["mode"] == "validate_results"
    assert [(r["rank"], r["check"], r["verdict"]) for r in fields["megatron_rerun"]["by_rank"]] == [
        (0, "bucket norm", "transient"), (1, "loss", "reproducible")]
    assert "the loss was non-finite on rank(s) [1]" in note and "named first is not the suspect" in note
    assert "found it reproducible" in note
    # all_gradients_nonfinite's message already disclaims the parameter named first.
    _, note = rerun_machine.record_fields(everyone, {"all_gradients_nonfinite": True})
    assert "not the suspect" not in note
    assert rerun_machine.record_fields(everyone[2:], {}) == ({}, "")


@pytest.mark.multiproc
def test_stock_flags_loss_nan_on_one_rank_is_the_guards_incident_with_megatrons_verdict(loop_kind, request,
                                                                                      tmp_path):
    """Rank 1's forward pass goes NaN at iteration 4 (so does its loss): Megatron's loss check
    reruns the step in place, finds it reproducible and, not fatal on a checked step, carries on
    instead of saving a checkpoint and exiting 16. The guard skips the step; the record says the
    loss was non-finite, that the parameter named first is not the suspect, and, from the forward
    pass the guard watched during Megatron's rerun, which module's output went non-finite first."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    proc = loop.run(guard_env(tmp_path, inject=[FORWARD_NAN]))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Need to rerun step" in output and "Saving a checkpoint and exiting now" not in output
    [incident] = incidents(tmp_path)
    assert incident["step"] == 4 and incident["action"] == "skip_step" and incident["severity"] == "warning"
    assert incident["origin_ranks"] == [1]
    assert incident["loss_nonfinite"] is True and incident["all_gradients_nonfinite"] is True
    assert "the loss was non-finite on rank(s) [1]" in incident["message"]
    assert "named first is not the suspect" in incident["message"]
    assert incident["megatron_rerun"]["verdict"] == "reproducible"
    [rerun] = incident["megatron_rerun"]["by_rank"]
    assert rerun["rank"] == 1 and rerun["check"] == "loss" and "NaN" in rerun["message"]
    assert incident["forward_origin"] == {"module": "decoder.layers.1.mlp", "layer": 1, "ranks": [1]}
    assert "first went non-finite at the output of decoder.layers.1.mlp (layer 1) on rank(s) [1]" in incident["message"]
    _, entered, _, done = diagnosis(incident)
    assert entered.startswith("  entered at: the forward pass, output of decoder.layers.1.mlp (layer 1) on rank(s) [1], "
                              "found by Megatron's rerun in place"), entered
    assert "Megatron's rerun in place: reproducible" in done
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert "number of skipped iterations:   1" in logged[4]
    losses = [float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1)) for i in (5, 6)]
    assert all(loss == loss and loss < 100 for loss in losses), losses


@pytest.mark.multiproc
def test_without_megatrons_check_a_loss_nan_is_named_at_its_module_by_the_guards_replay(loop_kind, request,
                                                                                      tmp_path):
    """--no-check-for-nan-in-loss-and-grad: nothing in Megatron reruns the step, every gradient goes
    NaN and the guard skips the step. It then replays the step's forward pass (the micro-batches
    Megatron's RerunDataIterator kept, forward only) and the record names the module whose output
    went non-finite first, on its rank, as with Megatron's check on (issue 28)."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    proc = loop.run(guard_env(tmp_path, inject=[FORWARD_NAN]), "--no-check-for-nan-in-loss-and-grad")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Need to rerun step" not in output
    [incident] = incidents(tmp_path)
    assert (incident["step"], incident["action"], incident["severity"]) == (4, "skip_step", "warning")
    assert incident["all_gradients_nonfinite"] is True and "megatron_rerun" not in incident
    assert incident["forward_origin"] == {"module": "decoder.layers.1.mlp", "layer": 1, "ranks": [1]}
    _, entered, _, _ = diagnosis(incident)
    assert entered.startswith("  entered at: the forward pass, output of decoder.layers.1.mlp (layer 1) on rank(s) [1], "
                              "found by the replay"), entered
    logged = iterations(output)
    assert sorted(logged) == [1, 2, 3, 4, 5, 6] and "number of skipped iterations:   1" in logged[4]
    losses = [float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1)) for i in (5, 6)]
    assert all(math.isfinite(loss) and loss < 100 for loss in losses), losses


@pytest.mark.multiproc
def test_loss_nan_on_a_step_the_guard_does_not_check_is_left_to_megatron(loop_kind, request, tmp_path):
    """check_interval 5: iteration 4 is not checked, so Megatron's loss check acts as without the
    guard (reproducible: a checkpoint and exit 16) and the guard records no incident; Megatron's
    exit goes into the ledger with the drill spent. The restart Megatron asks for loads its
    checkpoint with the guard's state. Its rerun of iteration 4 would run on the node and device
    of the first one, where Megatron only asks for another restart ("Got rescheduled on the same
    GPU", exit 16 at every restart: measured before the guard stepped in): the guard leaves that
    rerun undone, skips iteration 4 and the job finishes, the skip kept in the ledger."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    env = guard_env(tmp_path, inject=[FORWARD_NAN], check_interval=5)
    proc = loop.run(env, "--save", str(save), "--save-interval", "100", *loop.checkpoint_format())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 16, output[-4000:]
    assert "Saving a checkpoint and exiting now" in output
    assert incidents(tmp_path) == []
    ledger = Ledger.load(str(save))
    assert ledger.events == [{"step": 4, "megatron_exit": 16, "state": "WILL_RERUN_FROM_CHECKPOINT"}], ledger.events
    assert ledger.rollbacks == 0 and ledger.spent_injections == [FORWARD_NAN]

    again = loop.run(env, "--save", str(save), "--load", str(save), "--save-interval", "100",
                     *loop.checkpoint_format())
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-4000:]
    assert "guard state of iteration 3 restored" in output
    assert ("Megatron's rerun of iteration 4 from its checkpoint would run on the node and device of its "
            "first rerun") in output
    assert "Got rescheduled on the same GPU" not in output
    logged = iterations(output)
    assert sorted(logged) == [5, 6] and incidents(tmp_path) == []
    assert all(math.isfinite(float(re.search(r"lm loss: ([^ ]+)", logged[i]).group(1))) for i in (5, 6)), logged
    assert Ledger.load(str(save)).events[1:] == [
        {"step": 4, "megatron_rerun": "left: same node and device", "skip_iterations": [4]}]


@pytest.mark.multiproc
def test_a_bucket_nan_on_a_step_the_guard_does_not_check_ends_with_megatrons_17_in_the_ledger(loop_kind, request,
                                                                                               tmp_path):
    """check_interval 5: a NaN in rank 1's own gradient at iteration 4 (once: Megatron's rerun in
    place is clean) meets Megatron's per-bucket check on a step the guard does not own. Megatron
    calls it a transient fault it cannot continue from (exit 17, no checkpoint); the guard records
    no incident, and Megatron's exit goes into the ledger with the drill spent."""
    loop = make_loop(loop_kind, request, tmp_path, only="pretrain")
    save = tmp_path / "ckpt"
    drill = f"nan:step=4,rank=1,phase=local,param={FC1}"
    proc = loop.run(guard_env(tmp_path, inject=[drill], check_interval=5), "--save", str(save),
                    "--save-interval", "100", *loop.checkpoint_format())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 17, output[-4000:]
    assert "Possible transient error" in output and incidents(tmp_path) == []
    ledger = Ledger.load(str(save))
    assert ledger.events == [{"step": 4, "megatron_exit": 17, "state": "RERUNNING_IN_PLACE"}], ledger.events
    assert ledger.rollbacks == 0 and ledger.spent_injections == [drill]
