"""The restart launcher (``scripts/restart_on_rollback.py``) around real child processes that exit
as a training job would: a rollback's 84, torchrun's 1 with the ledger, other failures, its budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO
from megatron_patches import checkpoint
from megatron_patches.ledger import LEDGER_FILE


LAUNCHER = REPO / "scripts" / "restart_on_rollback.py"




def launch(tmp_path: Path, child: str, *options: str, extra: tuple = ()) -> subprocess.CompletedProcess:
    """The launcher around ``python -c child`` (which sees the attempt number in $ATTEMPT_FILE)."""
    env = {**os.environ, "ATTEMPT_FILE": str(tmp_path / "attempts")}
    return subprocess.run(
        [sys.executable, str(LAUNCHER), *options, "--", sys.executable, "-c", child, *extra],
        capture_output=True, text=True, timeout=120, env=env)


COUNT_ATTEMPTS = """
import json, os, sys
path = os.environ["ATTEMPT_FILE"]
attempt = int(open(path).read()) + 1 if os.path.exists(path) else 1
open(path, "w").write(str(attempt))
"""


def attempts(tmp_path: Path) -> int:
    return int((tmp_path / "attempts").read_text())


# --- the launcher (CI) -----------------------------------------------------------------------------


def test_launcher_restarts_on_84_and_ends_with_the_successful_run(tmp_path):
    run = launch(tmp_path, COUNT_ATTEMPTS + "sys.exit(84 if attempt == 1 else 0)", "--max-restarts", "3")
    assert run.returncode == 0, run.stderr
    assert attempts(tmp_path) == 2
    assert "attempt 1: rollback (exit 84" in run.stderr and "restarting (1 of 3)" in run.stderr


def test_launcher_reads_the_ledger_when_torchrun_reports_1(tmp_path):
    # torchrun exits 1 when its workers exit 84; the ledger next to --save tells it was a rollback.
    save = tmp_path / "ckpt"
    child = COUNT_ATTEMPTS + textwrap.dedent(f"""
    if attempt == 1:
        os.makedirs({str(save)!r}, exist_ok=True)
        json.dump({{"schema": "megatron_patches.ledger/1", "rollbacks": 1, "lr_scale": 0.5,
                   "rollback_requested": {{"iteration": 4, "skip_iterations": [3, 4]}}}},
                  open(os.path.join({str(save)!r}, {LEDGER_FILE!r}), "w"))
        sys.exit(1)
    sys.exit(0)
    """)
    run = launch(tmp_path, child, extra=("--save", str(save)))
    assert run.returncode == 0, run.stderr
    assert attempts(tmp_path) == 2
    assert "ledger: rollback 1 requested at iteration 4, lr scale 0.5, skipping iterations [3, 4]" in run.stderr


@pytest.mark.parametrize("code", [1, 85, 86])
def test_launcher_passes_other_failures_through(tmp_path, code):
    # An old ledger (rollback count unchanged by this attempt) is not a new rollback request.
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / LEDGER_FILE).write_text(json.dumps({"rollbacks": 1, "rollback_requested": {"iteration": 4}}))
    run = launch(tmp_path, COUNT_ATTEMPTS + f"sys.exit({code})", "--checkpoint-dir", str(save))
    assert run.returncode == code
    assert attempts(tmp_path) == 1
    assert f"exited with {code}" in run.stderr and "not a rollback" in run.stderr


def test_launcher_stops_when_the_restart_budget_is_spent(tmp_path):
    run = launch(tmp_path, COUNT_ATTEMPTS + "sys.exit(84)", "--max-restarts", "1")
    assert run.returncode == 84
    assert attempts(tmp_path) == 2
    assert "restart budget of 1 is spent" in run.stderr


def test_launcher_refuses_a_missing_command_and_answers_help():
    run = subprocess.run([sys.executable, str(LAUNCHER), "--max-restarts", "1"], capture_output=True, text=True)
    assert run.returncode == 2 and "put the training command after --" in run.stderr
    run = subprocess.run([sys.executable, str(LAUNCHER), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--restart-on CODES" in run.stdout
