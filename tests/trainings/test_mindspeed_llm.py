"""MindSpeed-LLM's training loop under the guard: its iteration numbers, a rollback's skips, its saves.

MindSpeed-LLM cannot run on this machine (its training module imports torch_npu, MindSpeed's
transformer-engine shims and a Megatron-LM 0.12.1 checkout). So:

- the rollback test runs Megatron-LM's real loop from the megatron-core wheel (0.17+, ``.venv312``)
  on two CPU ranks with ``tests/standin_mindspeed_llm_loop.py``: a stand-in for MindSpeed-LLM's
  training module that binds ``train_step``/``save_checkpoint`` by name before the guard and
  replaces Megatron's ``train`` with a loop that never reads ``iterations_to_skip``;
- the tests marked ``mindspeed_llm`` check, on MindSpeed-LLM's own source in ``MINDSPEED_LLM_DIR``
  (e.g. a worktree of its tag 26.0.0, which pairs with megatron-core 0.12.1), that the stand-in's
  premises hold: those bindings, that loop, and the high-availability argument names the guard
  refuses. They read the source; nothing of it is imported or copied.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_patches import checkpoint, variants
from megatron_patches.seams import mindspeed
from megatron_patches.seams.mindspeed import llm as mindspeed_llm
from megatron_patches.ledger import Ledger

REPO = Path(__file__).resolve().parents[2]
STANDIN_LOOP = REPO / "tests" / "standin_mindspeed_llm_loop.py"
LAUNCHER = REPO / "scripts" / "restart_on_rollback.py"
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"
LINE = re.compile(r"standin-loop iteration (\d+) skipped (\d) lr (\S+)")


@pytest.mark.parametrize("core, listed_as, called_for", [((0, 12), [2, 3], [2, 3]), ((0, 19), [3, 4], [2, 3])])
def test_a_listed_iteration_is_recognised_in_each_release_numbering(core, listed_as, called_for):
    # iterations_to_skip holds 0-based indices up to core 0.16 and logged numbers from 0.17 on;
    # train_step is called with the 0-based index (args.curr_iteration) in both.
    for index in range(6):
        args = SimpleNamespace(curr_iteration=index, iterations_to_skip=listed_as)
        assert mindspeed_llm.listed(args, core) == (index in called_for)
    assert not mindspeed_llm.listed(SimpleNamespace(curr_iteration=2, iterations_to_skip=[]), core)


def _packaged_loop() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:
        return False


@pytest.mark.slow  # make test-all (about 40 s): outside CI's time budget
@pytest.mark.multiproc
@pytest.mark.skipif(not _packaged_loop(), reason="the installed megatron-core ships no megatron/training "
                    "(0.17+ does: make test PYTHON=python3.12 VENV=.venv312)")
def test_rollback_through_a_loop_that_ignores_iterations_to_skip_standin(tmp_path):
    from megatron_patches.testing.pretrain_cpu import TINY_GPT_ARGS

    save = tmp_path / "ckpt"
    config = tmp_path / "guard.yaml"
    config.write_text(json.dumps({"report_dir": str(tmp_path / "reports"),
                                  "inject": [f"nan:step=4,count=2,param={FC1}"]}))
    loop = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(STANDIN_LOOP),
            *TINY_GPT_ARGS, "--train-iters", "6", "--save", str(save), "--load", str(save), "--save-interval", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_PATCHES_CONFIG": str(config)}
    proc = subprocess.run([sys.executable, str(LAUNCHER), "--max-restarts", "2", "--", *loop], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    first, second = proc.stdout.split("[restart_on_rollback] attempt 2:")

    # The guard reached the stand-in's bindings (identity scan), and its incidents carry the loop's numbers.
    assert "rebound mindspeed_llm.training.training.train_step too" in first
    assert "rebound mindspeed_llm.training.training.save_checkpoint too" in first
    incidents = [json.loads(line) for line in (tmp_path / "reports" / "incidents.jsonl").read_text().splitlines()]
    assert [(i["step"], i["action"]) for i in incidents] == [(4, "skip_step"), (5, "rollback")]
    assert incidents[0]["batch"]["iteration"] == 4 and incidents[0]["first"]["name"] == FC1

    # The restart loads iteration 2 (certified by the clean check of 3); 3 trains; the loop calls
    # train_step for 4 and 5, which the guard skips as Megatron-LM's loop would (their batches
    # drained); 6 trains; all at half the learning rate.
    logged = {int(n): (int(s), float(lr)) for n, s, lr in LINE.findall(second)}
    assert logged == {3: (0, 5e-4), 4: (1, 5e-4), 5: (1, 5e-4), 6: (0, 5e-4)}, second[-4000:]
    assert second.count("skipped (iterations_to_skip, from the rollback)") == 2
    assert [i["step"] for i in incidents] == [4, 5]  # nothing new: the drill's steps were never run again
    ledger = Ledger.load(str(save))
    assert ledger.rollbacks == 1 and ledger.rollback_requested is None and ledger.events[1]["resumed_from"] == 2
    # Its saves (through save_checkpoint_and_time and the final save_checkpoint) are marked and
    # certified by the checks after them; 6, the job's last, waits for a later job's.
    assert {step: ok for step, _, ok in checkpoint.list_checkpoints(str(save))} == {2: True, 4: True, 6: False}


# --- MindSpeed-LLM's own source (MINDSPEED_LLM_DIR) -----------------------------------------------------


@pytest.fixture(scope="module")
def mindspeed_llm_dir() -> Path:
    from conftest import source_tree

    return source_tree("MINDSPEED_LLM_DIR", "mindspeed_llm/training/training.py",
                       "a MindSpeed-LLM source tree (e.g. tag 26.0.0)")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


@pytest.mark.mindspeed_llm
def test_its_training_module_binds_what_the_guard_wraps_and_its_loop_ignores_skips(mindspeed_llm_dir):
    module = mindspeed_llm_dir / "mindspeed_llm" / "training" / "training.py"
    tree = _tree(module)
    imported = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert module.as_posix().endswith(mindspeed.BINDING_MODULES[0].replace(".", "/") + ".py")
    assert imported["train_step"] == "megatron.training.training"
    assert imported["save_checkpoint"] == "megatron.training.checkpointing"
    assert imported["save_checkpoint_and_time"] == "megatron.training.training"
    assert imported["finalize_model_grads"] == "megatron.core.distributed"

    [train] = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train"]
    names = {node.attr for node in ast.walk(train) if isinstance(node, ast.Attribute)}
    calls = {node.func.id for node in ast.walk(train) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "curr_iteration" in names and "train_step" in calls and "save_checkpoint_and_time" in calls
    assert "iterations_to_skip" not in names and "dummy_train_step" not in calls
    assert "iterations_to_skip" not in module.read_text(encoding="utf-8")


@pytest.mark.mindspeed_llm
def test_every_high_availability_argument_is_refused_by_name(mindspeed_llm_dir):
    feature = mindspeed_llm_dir / "mindspeed_llm" / "features_manager" / "high_availability" / "high_availability.py"
    flags = {node.args[0].value for node in ast.walk(_tree(feature)) if isinstance(node, ast.Call)
             and getattr(node.func, "attr", "") == "add_argument"}
    # --distributed-optimizer-no-replica only turns the replica off inside high availability.
    assert flags - {"--distributed-optimizer-no-replica"} == {
        "--" + name.replace("_", "-") for name in variants.HIGH_AVAILABILITY_ARGS}
    for flag in flags - {"--distributed-optimizer-no-replica"}:
        assert variants.unsupported_flag(SimpleNamespace(**{flag[2:].replace("-", "_"): True}))[0] == flag
