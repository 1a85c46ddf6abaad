"""What the guard reads back at start is validated: the rollback ledger, checkpoint markers, the
launcher's view of the ledger. Real files, real processes; nothing mocked."""

import json
import logging
import os
import subprocess
import sys

import pytest

from conftest import run_tiny
from megatron_patches import checkpoint
from megatron_patches.errors import UserError
from megatron_patches.ledger import LEDGER_FILE, LEDGER_SCHEMA, Ledger

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(REPO, "scripts", "restart_on_rollback.py")
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def write_ledger(root, text):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, LEDGER_FILE), "w", encoding="utf-8") as handle:
        handle.write(text)


def ledger_text(**fields):
    return json.dumps({"schema": LEDGER_SCHEMA, **fields})


# --- durable writes -----------------------------------------------------------------------


def test_ledger_round_trips_durably_and_leaves_no_temporary_file(tmp_path):
    ledger = Ledger(blacklist=[3, 1], rollbacks=2, lr_scale=0.25, events=[{"step": 7, "lr_scale": 0.25}])
    ledger.save(str(tmp_path / "ckpt"))
    ledger.rollbacks = 3
    ledger.save(str(tmp_path / "ckpt"))  # over the old one
    assert os.listdir(tmp_path / "ckpt") == [LEDGER_FILE]
    again = Ledger.load(str(tmp_path / "ckpt"))
    assert (again.blacklist, again.rollbacks, again.lr_scale, again.events) == ([3, 1], 3, 0.25, ledger.events)


def test_write_json_atomic_failing_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "result.json"
    checkpoint.write_json_atomic(str(path), {"a": 1})
    with pytest.raises(TypeError):  # not serialisable: fails after the temporary file was opened
        checkpoint.write_json_atomic(str(path), {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["result.json"]
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(NotADirectoryError):
        checkpoint.write_json_atomic(str(blocked / "result.json"), {"a": 1})


# --- the ledger -------------------------------------------------------------------------


HOSTILE = {
    "lr_scale NaN": ('{"schema": "%s", "lr_scale": NaN}' % LEDGER_SCHEMA, "`lr_scale`"),
    "lr_scale 0": (ledger_text(lr_scale=0), "`lr_scale`"),
    "lr_scale negative": (ledger_text(lr_scale=-0.5), "`lr_scale`"),
    "lr_scale 1e300": (ledger_text(lr_scale=1e300), "`lr_scale`"),
    "lr_scale Infinity": ('{"schema": "%s", "lr_scale": Infinity}' % LEDGER_SCHEMA, "`lr_scale`"),
    "lr_scale 1e400": ('{"schema": "%s", "lr_scale": 1e400}' % LEDGER_SCHEMA, "`lr_scale`"),
    "lr_scale string": (ledger_text(lr_scale="0.5"), "`lr_scale`"),
    "rollbacks string": (ledger_text(rollbacks="3"), "`rollbacks`"),
    "rollbacks negative": (ledger_text(rollbacks=-1), "`rollbacks`"),
    "rollbacks float": (ledger_text(rollbacks=1.5), "`rollbacks`"),
    "rollbacks bool": (ledger_text(rollbacks=True), "`rollbacks`"),
    "blacklist string": (ledger_text(blacklist="1,2"), "`blacklist`"),
    "blacklist floats": (ledger_text(blacklist=[1.5]), "`blacklist`"),
    "blacklist negative": (ledger_text(blacklist=[-1]), "`blacklist`"),
    "events NaN": ('{"schema": "%s", "events": [{"lr_scale": NaN}]}' % LEDGER_SCHEMA, "`events[0].lr_scale`"),
    "rollback_requested list": (ledger_text(rollback_requested=[4]), "`rollback_requested`"),
    "unknown field": (ledger_text(rolbacks=1), "`rolbacks`"),
    "malformed JSON": ('{"schema": "%s", "rollbacks": 1' % LEDGER_SCHEMA, "cannot be read as JSON"),
    "empty file": ("", "cannot be read as JSON"),
    "not UTF-8": ('{"schema": "\xff"}', "cannot be read as JSON"),
    "a list": ("[1, 2]", "not a megatron_patches ledger"),
    "another schema": ('{"schema": "other/1"}', "not a megatron_patches ledger"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_ledger_is_refused_with_one_line_naming_file_field_and_fix(tmp_path, case):
    text, field = HOSTILE[case]
    root = str(tmp_path / "ckpt")
    if case == "not UTF-8":
        os.makedirs(root)
        (tmp_path / "ckpt" / LEDGER_FILE).write_bytes(b'{"schema": "\xff"}')
    else:
        write_ledger(root, text)
    with pytest.raises(UserError) as caught:
        Ledger.load(root)
    message = str(caught.value)
    assert "\n" not in message
    assert Ledger.path(root) in message and field in message and "move it away" in message


@pytest.mark.parametrize("recovery", ["in-process", "exit"])
def test_training_refuses_a_hostile_ledger_at_start_with_exit_2(tmp_path, recovery):
    write_ledger(str(tmp_path / "checkpoints"), '{"schema": "%s", "lr_scale": NaN, "rollbacks": 1}' % LEDGER_SCHEMA)
    run = run_tiny(tmp_path, "--steps", "3", "--recovery", recovery)
    assert run.returncode == 2, run.output[-3000:]
    (line,) = [line for line in run.output.splitlines() if line.startswith("tiny_gpt: error:")]
    assert "megatron_patches_ledger.json" in line and "`lr_scale`" in line
    assert "Traceback" not in run.output and "step    1/" not in run.output  # never applied, never trained
    assert not (tmp_path / "result.json").exists()


# --- markers ----------------------------------------------------------------------------


def make_checkpoint(root, step, marker_bytes):
    path = root / f"iter_{step:07d}"
    path.mkdir(parents=True)
    (path / checkpoint.MARKER).write_bytes(marker_bytes)
    return str(path)


def test_unreadable_markers_are_passed_over_with_a_warning(tmp_path, guard_log):
    root = tmp_path / "ckpt"
    good = make_checkpoint(root, 4, json.dumps({"step": 4, "healthy": True}).encode())
    bad = {
        8: b"",  # power loss after the rename
        12: b"{\"step\": 12, \"heal",  # torn write
        16: b"\xff\xfe",
        20: b"[16, true]",
        24: json.dumps({"step": "24", "healthy": True}).encode(),
        28: json.dumps({"step": 28, "healthy": "yes"}).encode(),
    }
    for step, content in bad.items():
        make_checkpoint(root, step, content)
    os.makedirs(root / "iter_0000032" / checkpoint.MARKER)  # a directory where the marker should be
    with guard_log.at_level(logging.WARNING, logger="megatron_patches"):
        assert checkpoint.list_checkpoints(str(root)) == [(4, good, True)]
        assert checkpoint.newest_healthy(str(root)) == (4, good)
    warned = [r.getMessage() for r in guard_log.records if r.name == "megatron_patches"]
    for step in bad:
        assert any(f"iter_{step:07d}" in message and "passed over" in message for message in warned), step


def test_resume_passes_over_an_empty_marker_to_the_next_healthy_checkpoint(tmp_path):
    first = run_tiny(tmp_path, "--steps", "8", "--save-interval", "4")
    assert first.returncode == 0, first.output[-3000:]
    marker = tmp_path / "checkpoints" / "iter_0000008" / checkpoint.MARKER
    marker.write_bytes(b"")  # what a power loss after the rename leaves without the directory fsync
    again = run_tiny(tmp_path, "--steps", "10", "--resume")
    assert again.returncode == 0, again.output[-3000:]
    assert "Traceback" not in again.output
    assert str(marker) in again.output and "passed over" in again.output
    assert f"resumed from {tmp_path / 'checkpoints' / 'iter_0000004'} at step 5" in again.output
    result = again.result
    assert result["params_finite"] and result["loss_log"][0][0] == 5 and result["steps_completed"] == 6


# --- the launcher -----------------------------------------------------------------------


@pytest.mark.parametrize("text, field", [
    ('{"rollbacks": 1', "cannot be read as JSON"),
    ("", "cannot be read as JSON"),
    ('{"rollbacks": "3"}', "`rollbacks`"),
    ('{"rollbacks": 1, "rollback_requested": "yes"}', "`rollback_requested`"),
    ("[]", "holds list"),
])
def test_launcher_refuses_a_corrupt_ledger_with_exit_2(tmp_path, text, field):
    write_ledger(str(tmp_path), text)
    proc = subprocess.run([sys.executable, LAUNCHER, "--checkpoint-dir", str(tmp_path), "--",
                           sys.executable, "-c", "print('the job ran')"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "the job ran" not in proc.stdout and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("[restart_on_rollback] error: ledger ") and field in line
    assert os.path.join(str(tmp_path), LEDGER_FILE) in line


def test_launcher_runs_with_a_valid_or_missing_ledger(tmp_path):
    for setup in (lambda: None, lambda: write_ledger(str(tmp_path), ledger_text(rollbacks=1))):
        setup()
        proc = subprocess.run([sys.executable, LAUNCHER, "--checkpoint-dir", str(tmp_path), "--",
                               sys.executable, "-c", "print('the job ran')"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "the job ran" in proc.stdout, proc.stderr


def test_restart_on_rollback_never_restarts_a_fence_and_names_the_host_and_device(tmp_path):
    """A command whose workers fenced a device (the ledger's ``fenced`` set, torchrun's own exit 1): the
    launcher stops with the fence code after one line naming the host and device, with no second attempt."""
    fenced = {"host": "node7", "device": "cuda:3", "rank": 3, "step": 15, "incidents": 2}
    writer = ("import json, sys; json.dump({'schema': %r, 'rollbacks': 1, 'fenced': %r}, open(sys.argv[1], 'w')); "
              "sys.exit(1)" % (LEDGER_SCHEMA, fenced))
    proc = subprocess.run([sys.executable, LAUNCHER, "--max-restarts", "3", "--checkpoint-dir", str(tmp_path), "--",
                           sys.executable, "-c", writer, str(tmp_path / LEDGER_FILE)], capture_output=True, text=True)
    assert proc.returncode == 88, proc.stderr
    assert ("fence: exclude host node7 device cuda:3 (2 hardware-class incidents; exit 1" in proc.stderr
            and "attempt 2" not in proc.stderr)
    # Negative control: the same exit with no fence in the ledger is no fence (a crash: its own status).
    os.remove(tmp_path / LEDGER_FILE)
    plain = subprocess.run([sys.executable, LAUNCHER, "--max-restarts", "0", "--checkpoint-dir", str(tmp_path / "none"),
                            "--", sys.executable, "-c", "raise SystemExit(1)"], capture_output=True, text=True)
    assert plain.returncode == 1 and "fence" not in plain.stderr
