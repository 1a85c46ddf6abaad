"""Megatron-LM's packaged loop rolls back in memory with neither --save nor --load (issue 60 item 5):
its in-memory snapshots need no checkpoint, and the ledger goes beside the report. Before, the
same run warned that a rollback decision would exit 84 with nothing to resume from."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_packaged_loop
from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS

pytestmark = [pytest.mark.multiproc]

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
FAULT = f"nan:step=5,count=2,rank=1,phase=local,param={FC1}"
"""Rank 1's own fc1 gradient NaN at iterations 5 and 6: a skip, then a rollback."""


def _packaged_loop_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        return False


def train(tmp_path, drill: str) -> tuple[int, str, list, object]:
    """8 iterations on 2 ranks, no --save, no --load: exit code, output, records, reports directory."""
    reports = tmp_path / "reports"
    config = tmp_path / "guard.yaml"
    config.write_text(json.dumps({"report_dir": str(reports), "inject": [drill],
                                  "recovery": {"lr_factor": 1, "blacklist": "deterministic", "snapshot_interval": 2}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PATCHES_CONFIG": str(config)}
    code, output = run_packaged_loop(env, [*TINY_GPT_ARGS, "--train-iters", "8"])
    path = reports / "incidents.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return code, output, records, reports


needs_loop = pytest.mark.skipif(not _packaged_loop_available(),
                                reason="the installed megatron-core ships no megatron/training (0.17+ does)")


@needs_loop
def test_a_rollback_in_memory_needs_neither_save_nor_load(tmp_path):
    code, output, records, reports = train(tmp_path, FAULT)
    assert code == 0, output[-6000:]  # no exit 84: the same processes went on
    assert "neither --save nor --load given: rollbacks in memory only, the ledger in " in output
    assert "no checkpoint or ledger to resume from" not in output
    assert [(r["step"], r["action"]) for r in records] == [(5, "skip_step"), (6, "rollback")]
    assert (records[1]["rolled_back_to"], records[1]["checkpoint"]) == (2, "in-memory snapshot")
    assert "rolled back in process to the snapshot of iteration 2 and redid 4 iteration(s)" in output
    ledger = json.loads((reports / "megatron_patches_ledger.json").read_text())
    assert ledger["rollbacks"] == 1 and ledger["events"][-1]["rolled_back_to"] == 2
    assert not list(tmp_path.glob("**/iter_*"))  # no checkpoint was written


@needs_loop
def test_without_a_certified_snapshot_or_a_checkpoint_the_rollback_is_a_critical_stop(tmp_path):
    """The fault at iterations 2 and 3: snapshot 2 is of a skipped iteration (not taken), so no target
    exists; with no checkpoint to restart from, every rank stops with 86 instead of asking for a restart."""
    code, output, records, _ = train(tmp_path, FAULT.replace("step=5", "step=2"))
    assert code == 86, output[-6000:]
    assert [(r["step"], r["action"]) for r in records] == [(2, "skip_step"), (3, "stop")]
    assert records[1]["severity"] == "critical"
    assert ("the rollback cannot be made in process (no in-memory snapshot is certified on every rank yet) and "
            "there is no checkpoint to restart from (neither --save nor --load)") in records[1]["reason"]
