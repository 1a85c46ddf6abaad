"""A poisoned sample in Megatron-LM's packaged loop with Megatron's own NaN check on (its default,
``--check-for-nan-in-loss-and-grad``; issue 57). Megatron's rerun machine reruns the step in place
when the loss goes NaN; the guard watches that rerun's per-sample losses, so the sample whose loss is
NaN again is named: the cause is ``data``, that sample is blacklisted in the ledger, the job goes on,
a job resumed from a checkpoint before it skips its iteration (the ledger's blacklist alone: no
rollback listed it), and the redo of a later in-process rollback leaves it out. Negative controls: in
the same training, a gradient NaN that Megatron's rerun finds gone (transient) blames no sample; a
resumed job whose ledger blacklists nothing trains the iteration and meets the poison again.

Ranks are forked from pytest (conftest.run_packaged_loop), two data-parallel ranks, fp32.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest

from megatron_patches.ledger import Ledger
from megatron_patches.seams.megatron_lm import TRACKER_FILE
from megatron_lm_loop import FC1, Loop, _packaged_loop_available, guard_env, incidents, iterations, logged_losses
from test_poison_megatron_lm import LATER, POISON  # the poisoned sample and the gradient NaN after it

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not _packaged_loop_available(),
                                 reason="the installed megatron-core ships no megatron/training (0.17+ does)")]

ITERS = 9
GRADIENT = f"nan:step=8,rank=0,phase=local,param={FC1}"
"""Rank 0's own fc1 gradient NaN at iteration 8, once: Megatron's rerun in place finds it gone."""
CONFIG = {"recovery": {"blacklist": "deterministic", "snapshot_interval": 1, "lr_factor": 1}}
"""A snapshot every iteration: at a rollback the newest certified one is no older than the newest checkpoint."""


def train(tmp_path, ckpt, *drills: str, extra: tuple = ()) -> dict:
    proc = Loop(None).run(guard_env(tmp_path, inject=list(drills), **CONFIG), "--save", str(ckpt), "--load", str(ckpt),
                          *extra)
    output = proc.stdout + proc.stderr
    losses = logged_losses(output)
    return {"code": proc.returncode, "output": output, "incidents": incidents(tmp_path), "losses": losses,
            "ledger": Ledger.load(str(ckpt))}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """One training with Megatron's default flags: the poison at 5, rank 0's gradient NaN at 8;
    checkpoints at 3, 6, 9."""
    where = tmp_path_factory.mktemp("checked")
    return {**train(where, where / "ckpt", POISON, GRADIENT, extra=("--train-iters", str(ITERS), "--save-interval", "3")),
            "ckpt": where / "ckpt"}


def test_megatrons_rerun_reproduces_the_poisoned_row_so_the_cause_is_data_and_only_it_is_blacklisted(checked):
    output = checked["output"]
    assert checked["code"] == 0, output[-6000:]
    assert [(i["step"], i["action"]) for i in checked["incidents"]] == [(5, "skip_step"), (8, "skip_step")]
    first = checked["incidents"][0]
    assert first["batch"]["samples"] == [16, 17, 18, 19]
    assert first["megatron_rerun"]["verdict"] == "reproducible"
    assert [(r["rank"], r["check"]) for r in first["megatron_rerun"]["by_rank"]] == [(0, "loss")]
    assert (first["cause"]["class"], first["cause"]["confidence"]) == ("data", "high"), first["cause"]
    assert first["cause"]["evidence"][:2] == ["the replay reproduced the fault from the same state and batch",
                                              "on some of the step's micro-batches only"]
    assert first["replay"] == {"verdict": "deterministic", "narrowed": True}
    assert first["blacklisted"] == [17]
    assert first["forward_origin"]["ranks"] == [0]  # the poisoned row is rank 0's
    assert output.count("step 5: sample(s) [17] reproduced the fault in the replay: cause data (high), blacklisted") == 1
    assert checked["ledger"].blacklist == [17] and checked["ledger"].events == []  # no rollback: no skip listed
    assert sorted(iterations(output)) == list(range(1, ITERS + 1))
    assert all(math.isfinite(float(checked["losses"][i])) for i in (6, 7, 9))


def test_a_gradient_nan_megatrons_rerun_finds_gone_is_no_data_and_blames_no_sample(checked):
    """Negative control, same training: rank 0's gradient NaN at 8 fires once, so Megatron's rerun
    in place finds its bucket norm finite (transient): the loss rows never went non-finite, the
    cause is hardware (a clean replay on the same rank), and nothing is blacklisted."""
    record = checked["incidents"][1]
    assert (record["step"], record["action"]) == (8, "skip_step")
    assert record["megatron_rerun"]["verdict"] == "transient"
    assert record["replay"] == {"verdict": "transient", "narrowed": False}
    assert (record["cause"]["class"], record["cause"]["confidence"]) == ("hardware", "medium"), record["cause"]
    assert record["blacklisted"] == [] and record["origin_ranks"] == [0]
    assert "step 8: sample(s)" not in checked["output"]
    assert checked["ledger"].blacklist == [17]  # still only the poisoned sample
    assert "--no-check-for-nan-in-loss-and-grad" not in checked["output"]  # Megatron's check stayed on
    assert math.isfinite(float(checked["losses"][9]))


@pytest.mark.slow  # make test-all: one more training (about 30 s on 2 CPU cores)
def test_the_redo_after_a_rollback_leaves_the_poisoned_iteration_out_and_training_goes_on(tmp_path):
    """Rank 1's gradient NaN at 6 follows the poison: a rollback in process to the snapshot of 3,
    whose redo leaves 5 out. (The redo's rule does not depend on Megatron's check: the default
    suite runs it with the check off, test_poison_megatron_lm.py.)"""
    run = train(tmp_path, tmp_path / "ckpt", POISON, LATER, extra=("--train-iters", "8", "--save-interval", "3"))
    output = run["output"]
    assert run["code"] == 0, output[-6000:]
    assert [(i["step"], i["action"]) for i in run["incidents"]] == [(5, "skip_step"), (6, "rollback")]
    assert (run["incidents"][0]["cause"]["class"], run["incidents"][0]["blacklisted"]) == ("data", [17])
    rollback = run["incidents"][1]
    assert rollback["rolled_back_to"] == 3 and rollback["iterations_skipped"] == [5]
    assert rollback["cause"]["class"] != "data" and rollback["blacklisted"] == []
    assert "rolled back in process to the snapshot of iteration 3 and redid 2 iteration(s)" in output
    assert sorted(iterations(output)) == list(range(1, 9))
    after = [float(run["losses"][i]) for i in (4, 6, 7, 8)]
    assert all(math.isfinite(loss) and loss < 100 for loss in after), after
    assert run["ledger"].blacklist == [17]


def _resume(where, checked: dict, blacklist: list | None = None) -> dict:
    """The same job started again from its checkpoint of 3, as after dying before its save of 6: a
    copy of its checkpoints and ledger with those of 6 and 9 gone, the poison drill still set;
    ``blacklist`` written into the ledger first where given."""
    ckpt = where / "ckpt"
    shutil.copytree(checked["ckpt"], ckpt, ignore=shutil.ignore_patterns("iter_0000006", "iter_0000009"))
    (ckpt / TRACKER_FILE).write_text("3")
    if blacklist is not None:
        path = ckpt / "megatron_patches_ledger.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "blacklist": blacklist}))
    return train(where, ckpt, POISON, extra=("--train-iters", str(ITERS), "--save-interval", "100"))


def test_a_job_resumed_from_a_checkpoint_before_the_poisoned_iteration_skips_it(checked, tmp_path):
    run = _resume(tmp_path, checked)
    output = run["output"]
    assert run["code"] == 0 and "Traceback" not in output, output[-6000:]
    assert re.search(r"successfully loaded checkpoint from .* at iteration\s+3\b", output), output[-4000:]
    lines = [line for line in output.splitlines() if "skipping iterations" in line]
    assert lines and lines[0].endswith("skipping iterations [5] (args.iterations_to_skip=[5]); [5] read blacklisted "
                                       "samples [17]"), lines
    assert sorted(iterations(output)) == [4, 6, 7, 8, 9]  # 5 is drained untrained, as Megatron skips
    assert run["incidents"] == []  # the poisoned sample was never fed
    assert all(math.isfinite(float(run["losses"][i])) for i in (4, 6, 7, 8, 9))


@pytest.mark.slow  # make test-all: one more training (about 20 s on 2 CPU cores)
def test_without_the_ledgers_blacklist_the_resumed_job_feeds_the_poisoned_sample_again(checked, tmp_path):
    """Negative control of the test above: the same resume with the ledger's blacklist emptied."""
    run = _resume(tmp_path, checked, blacklist=[])
    assert run["code"] == 0, run["output"][-6000:]
    assert "skipping iterations" not in run["output"]
    assert 5 in iterations(run["output"])
    assert [(i["step"], i["cause"]["class"], i["blacklisted"]) for i in run["incidents"]] == [(5, "data", [17])]
