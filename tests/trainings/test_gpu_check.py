"""scripts/gpu_check.sh --dry-run: the device check a session with an accelerator runs at once,
run here on the CPU (gloo) so that it never rots. Every check must pass and leave its files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.one_line]  # once, on the 3.11 leg

REPO = Path(__file__).resolve().parents[2]


def test_the_dry_run_passes_every_check_and_writes_its_summary(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=480, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"environment", "guard_on_off", "drill_nan", "drill_inf", "drill_spike",
                            "drill_local_nan_rank1", "fp16_clean"}
    assert all(check["passed"] for check in summary.values()), summary
    assert summary["environment"]["dry_run"] and summary["environment"]["device"] == "cpu"
    assert summary["drill_local_nan_rank1"]["incidents"] == [[5, "decoder.layers.1.mlp.linear_fc1.weight", [1]]]
    assert summary["guard_on_off"]["max_rel_loss_diff"] < 1e-3 and summary["fp16_clean"]["incidents"] == 0
    assert (tmp_path / "summary.txt").read_text().count("PASS") == 7
    assert (tmp_path / "drills" / "incidents.jsonl").exists()
    assert [[i[:2] for i in summary[f"drill_{kind}"]["incidents"]] for kind in ("nan", "inf", "spike")] == [
        [[3, "decoder.layers.1.mlp.linear_fc1.weight"]], [[5, "decoder.layers.1.mlp.linear_fc1.weight"]],
        [[5, "decoder.layers.1.mlp.linear_fc1.weight"]]]


def test_a_bad_timeout_is_one_line():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--step-timeout", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith("--step-timeout must be >= 1, got 0")
