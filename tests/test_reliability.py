"""The guard's own I/O never stops training, and the CLI and config never answer a bad file with a
traceback. Real files, real trainings (the tiny-GPT harness), a real full file system where
``mount -t tmpfs`` works; nothing mocked."""

import json
import logging
import os
import subprocess
import sys

import pytest

from conftest import run_tiny
from megatron_patches.config import Config, load_config
from megatron_patches.errors import ConfigError
from megatron_patches.incidents import HISTORY_FILE, INCIDENTS_FILE, JsonlWriter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs (a file system that fills up); skipped where mounting is not allowed."""
    mount_point = tmp_path / "small_fs"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root in a sandbox that allows it): {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def fill(directory, leave_bytes):
    """Fill the file system holding ``directory`` up to ``leave_bytes`` of free space."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    with open(os.path.join(directory, "ballast"), "wb") as handle:
        handle.write(b"\0" * max(free - leave_bytes, 0))


def warnings_about(log, path):
    return [r.getMessage() for r in log.records if r.name == "megatron_patches" and str(path) in r.getMessage()]


# --- JsonlWriter ------------------------------------------------------------------------


def test_failed_writes_are_counted_warned_rate_limited_and_never_raise(tmp_path, guard_log):
    blocker = tmp_path / "reports"
    blocker.write_text("a file where the report directory should be")
    writer = JsonlWriter(str(blocker / INCIDENTS_FILE), warn_every=3)
    with guard_log.at_level(logging.WARNING, logger="megatron_patches"):
        assert [writer.write({"n": i}) for i in range(7)] == [False] * 7
    assert writer.lost_writes == 7
    warned = warnings_about(guard_log, blocker / INCIDENTS_FILE)
    assert len(warned) == 3  # the 1st, 4th and 7th loss
    assert f"File exists: '{blocker}'" in warned[0] and "1 record(s) lost" in warned[0] and "7 record(s) lost" in warned[2]
    # The obstacle removed, writing resumes by itself.
    blocker.unlink()
    assert writer.write({"n": 7}) is True
    assert [json.loads(line) for line in (blocker / INCIDENTS_FILE).read_text().splitlines()] == [{"n": 7}]


def test_warnings_repeat_after_the_interval(tmp_path, guard_log):
    blocker = tmp_path / "reports"
    blocker.write_text("")
    writer = JsonlWriter(str(blocker / INCIDENTS_FILE), warn_every=1000, warn_interval_s=0.0)
    with guard_log.at_level(logging.WARNING, logger="megatron_patches"):
        for i in range(3):
            writer.write({"n": i})
    assert len(warnings_about(guard_log, blocker)) == 3


def test_strict_writer_raises_for_callers_that_report_failures_themselves(tmp_path):
    blocker = tmp_path / "reports"
    blocker.write_text("")
    with pytest.raises(FileExistsError):
        JsonlWriter(str(blocker / "alerts.jsonl"), strict=True).write({"n": 1})


def test_a_non_finite_number_in_a_record_is_written_as_null(tmp_path):
    writer = JsonlWriter(str(tmp_path / INCIDENTS_FILE))
    assert writer.write({"norm": float("nan"), "nested": [float("inf"), 1.5]}) is True
    assert json.loads((tmp_path / INCIDENTS_FILE).read_text()) == {"norm": None, "nested": [None, 1.5]}


def test_disk_full_mid_line_leaves_no_torn_line(small_tmpfs, guard_log):
    path = small_tmpfs / INCIDENTS_FILE
    writer = JsonlWriter(str(path))
    assert writer.write({"n": 0})
    fill(small_tmpfs, 4096)  # the page the first line is on, and one more
    with guard_log.at_level(logging.WARNING, logger="megatron_patches"):
        assert writer.write({"n": 1, "pad": "x" * 20000}) is False  # more than is free
    assert writer.lost_writes == 1
    assert any("No space left on device" in m for m in warnings_about(guard_log, path))
    os.unlink(small_tmpfs / "ballast")
    assert writer.write({"n": 2})
    assert [json.loads(line)["n"] for line in path.read_text().splitlines()] == [0, 2]


# --- the harness ------------------------------------------------------------------------


def test_report_dir_that_cannot_exist_loses_records_not_the_run(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    report_dir = blocker / "reports"  # its parent is a file: every write fails with ENOTDIR
    config = tmp_path / "config.yaml"
    config.write_text(f"report_dir: {report_dir}\n")
    run = run_tiny(tmp_path / "out", "--steps", "8", "--config", str(config), "--inject", f"nan:step=3,param={FC1}")
    assert run.returncode == 0, run.output[-3000:]
    assert "Traceback" not in run.output
    result = run.result  # under --out: results and reports live apart
    assert result["params_finite"] and result["steps_completed"] == 8 and result["skipped_steps"] == 1
    assert result["incidents"] == 1
    lost = result["lost_writes"]
    assert lost[str(report_dir / INCIDENTS_FILE)] == 1
    assert lost[str(report_dir / HISTORY_FILE)] == 8  # one line per checked step, the skipped one too
    assert lost[str(report_dir / "scenes")] == 1
    # Rate-limited: one warning per file for these 8 losses, naming the path and the error.
    history_warnings = [line for line in run.output.splitlines() if f"cannot write to {report_dir / HISTORY_FILE}" in line]
    assert len(history_warnings) == 1 and "Not a directory" in history_warnings[0]


def test_full_report_dir_loses_records_not_the_run(tmp_path, small_tmpfs):
    fill(small_tmpfs, 2 * 4096)  # a page for the incident, one for ~20 grad-history lines
    config = tmp_path / "config.yaml"
    # Scenes off: a bundle racing the incident record for the last page would make the test timing-dependent.
    config.write_text(f"report_dir: {small_tmpfs}\nscene:\n  enabled: false\n")
    run = run_tiny(tmp_path / "out", "--steps", "60", "--config", str(config), "--inject", f"nan:step=3,param={FC1}")
    assert run.returncode == 0, run.output[-3000:]
    assert "Traceback" not in run.output
    result = run.result
    assert result["params_finite"] and result["steps_completed"] == 60 and result["skipped_steps"] == 1
    assert result["final_loss"] < result["initial_loss"] - 0.5
    lost = result["lost_writes"]
    assert lost.get(str(small_tmpfs / HISTORY_FILE), 0) > 0, lost
    warned = [line for line in run.output.splitlines() if f"cannot write to {small_tmpfs / HISTORY_FILE}" in line]
    assert len(warned) == 1 and "No space left on device" in warned[0]
    # What did reach the disk is whole: every line parses, the incident is readable.
    history = [json.loads(line) for line in (small_tmpfs / HISTORY_FILE).read_text().splitlines()]
    assert len(history) + lost[str(small_tmpfs / HISTORY_FILE)] == 60
    assert [h["step"] for h in history] == list(range(1, len(history) + 1))
    (incident,) = [json.loads(line) for line in (small_tmpfs / INCIDENTS_FILE).read_text().splitlines()]
    assert incident["step"] == 3 and incident["first"]["name"] == FC1


def test_a_scene_that_does_not_fit_gives_its_space_back(small_tmpfs):
    import torch

    from megatron_patches import scene

    fill(small_tmpfs, 4096)
    path = scene.scene_dir(str(small_tmpfs), 3, 0)
    with pytest.raises(Exception):
        scene.write_bundle(path, {"grads": torch.zeros(4096)}, {})  # 16 KiB into 4 KiB
    step_dir = os.path.dirname(path)
    assert os.listdir(step_dir) == []  # no .tmp- directory left holding the disk
    assert scene.list_complete(str(small_tmpfs)) == []


def test_harness_report_dir_defaults_to_out(tmp_path):
    run = run_tiny(tmp_path, "--steps", "4", "--inject", f"nan:step=2,param={FC1}")
    assert run.returncode == 0, run.output[-3000:]
    assert [r["step"] for r in run.incidents] == [2] and run.result["lost_writes"] == {}


# --- CLI and config ---------------------------------------------------------------------


def cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_patches", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_report_json_is_strict_json_with_null_for_non_finite(tmp_path):
    (tmp_path / INCIDENTS_FILE).write_text(
        '{"schema":"megatron_patches.incident/1","step":4,"severity":"error","kind":"nan","action":"skip_step",'
        '"first":{"name":"w","norm":NaN},"total_norm":Infinity,"params":[{"norm":-Infinity}]}\n')
    out = cli("report", "--json", str(tmp_path))
    assert out.returncode == 0, out.stderr

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    (incident,) = json.loads(out.stdout, parse_constant=refuse)["incidents"]
    assert incident["first"]["norm"] is None and incident["total_norm"] is None and incident["params"][0]["norm"] is None


def test_report_on_an_incidents_file_that_is_a_directory(tmp_path):
    (tmp_path / INCIDENTS_FILE).mkdir()
    for args in (("report", str(tmp_path)), ("report", "--json", str(tmp_path))):
        out = cli(*args)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        (line,) = out.stderr.splitlines()
        assert str(tmp_path / INCIDENTS_FILE) in line and "is a directory" in line


@pytest.mark.parametrize("name, content, expected", [
    ("a_directory", None, "is a directory"),
    ("latin1.yaml", b"report_dir: caf\xe9\n", "is not UTF-8 text"),
    ("int_keys.yaml", b"1: 2\n", "config key 1 at the top level is not a name"),
    ("nested_keys.yaml", b"detectors:\n  null: 1\n", "config key None at detectors is not a name"),
    ("nan.yaml", b"detectors:\n  history:\n    min_ratio: .nan\n", "`detectors.history.min_ratio` must be a finite number"),
    ("inf.yaml", b"alerts:\n  webhooks:\n    - url: https://hooks.example/x\n      timeout_s: 1e400\n",
     "`alerts.webhooks[0].timeout_s` must be a finite number"),
])
def test_doctor_answers_a_bad_config_with_one_line(tmp_path, name, content, expected):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    out = cli("doctor", "--config", str(path))
    assert "Traceback" not in out.stdout + out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("FAIL  config")]
    assert expected in line, line
    with pytest.raises(ConfigError):
        load_config(str(path))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "1e400", "nan"])
def test_config_refuses_non_finite_numbers_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"`detectors\.magnitude\.total_norm_max` must be a finite number"):
        Config.from_dict({"detectors": {"magnitude": {"total_norm_max": value}}})
    assert Config.from_dict({"detectors": {"magnitude": {"total_norm_max": None}}}).detectors.magnitude.total_norm_max is None
