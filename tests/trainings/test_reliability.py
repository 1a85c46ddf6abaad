"""The guard's own I/O never stops training, and the CLI and config never answer a bad file with a
traceback. Real files, real trainings (the tiny-GPT harness), a real full file system where
``mount -t tmpfs`` works; nothing mocked."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import run_tiny
from megatron_patches.config import Config, load_config
from megatron_patches.errors import ConfigError
from megatron_patches.incidents import HISTORY_FILE, INCIDENTS_FILE, JsonlWriter
from megatron_patches.decisions import EXIT_CRITICAL, EXIT_PEER_LOST, EXIT_STOP

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


# --- bounded decisions ------------------------------------------------------------------

def _rank_lines(proc) -> str:
    return proc.stdout[-3000:]


@pytest.mark.multiproc
def test_a_rank_killed_mid_incident_ends_the_others_with_87_within_the_bound(tmp_path):
    """Rank 1 dies by SIGKILL after the NaN at step 3 was found and before the ranks agreed on
    a decision (the `kill` drill). Plain processes, no torchrun: nothing tears the job down for
    the guard. Rank 0 must not wait for the process group's timeout."""
    from rank_launcher import run_ranks

    out = tmp_path / "run"
    started = time.monotonic()
    rank0, rank1 = run_ranks(2, ["--out", str(out), "--steps", "8", "--inject", "nan:step=3",
                                 "--inject", "kill:step=3,rank=1"], timeout=240)
    took = time.monotonic() - started
    assert rank1.returncode == -signal.SIGKILL, _rank_lines(rank1)
    assert rank0.returncode == EXIT_PEER_LOST, _rank_lines(rank0)
    assert "step 3: a peer was lost while the ranks agreed on an incident" in rank0.stdout
    assert took < 120, took  # start-up and 3 steps; the default peer_timeout_s is 300
    assert not (out / INCIDENTS_FILE).exists()  # nothing was decided, so nothing is recorded as decided
    assert not (out / "result.json").exists()


def _gather_reports_rank() -> int:
    """One rank of four: ranks 1 and 3 report (their object is a list as long as their rank),
    every rank tallies 10 + its rank. Rank 0 writes what it took in to $GATHERED; a second round
    where nobody reports takes every rank's object."""
    import torch

    from megatron_patches.collectives import BoundedGroup, gather_reports

    torch.distributed.init_process_group("gloo")
    me = torch.distributed.get_rank()
    peers = BoundedGroup(30.0)
    peers.prepare()
    some = gather_reports({"rank": me, "findings": list(range(me))}, me in (1, 3), peers, tally=10 + me)
    none = gather_reports({"rank": me}, False, peers, tally=1)
    if me == 0:
        with open(os.environ["GATHERED"], "w") as out:
            json.dump({"some": some, "none": none}, out)
    else:
        assert some == ([], 46) and none == ([], 4), (some, none)
    torch.distributed.destroy_process_group()
    return 0


@pytest.mark.multiproc
def test_rank_zero_takes_in_the_parts_of_the_reporting_ranks_only(tmp_path, monkeypatch):
    """The slow path's gather at scale (issue 25): what rank 0 receives is the reporting ranks'
    parts, one message each; every rank learns the tally; nobody reporting means everyone does."""
    from conftest import run_forked

    monkeypatch.setenv("GATHERED", str(tmp_path / "gathered.json"))
    code, output = run_forked(_gather_reports_rank, timeout=120, nproc=4)
    assert code == 0, output
    gathered = json.loads((tmp_path / "gathered.json").read_text())
    assert gathered["some"] == [[{"rank": 1, "findings": [0]}, {"rank": 3, "findings": [0, 1, 2]}], 46]
    assert gathered["none"] == [[{"rank": r} for r in range(4)], 4]


_SILENT_PEER = r"""
import os, sys, time, torch
from megatron_patches.collectives import BoundedGroup, PeerLost, gather_to_zero
torch.distributed.init_process_group("gloo")
peers = BoundedGroup(2.0)
peers.prepare()
if torch.distributed.get_rank() == 1:
    time.sleep(20)  # alive, connected, silent
    os._exit(0)
started = time.monotonic()
try:
    gather_to_zero({"findings": []}, peers)
except PeerLost as error:
    print(f"PEER_LOST after {time.monotonic() - started:.1f}s: {error}")
    os._exit(0)
print("gathered: no bound")
os._exit(1)
"""


@pytest.mark.multiproc
def test_a_silent_peer_is_lost_after_peer_timeout_s(tmp_path):
    """A peer that is alive but never answers (hung, stopped): the guard's gather gives up after
    its timeout with PeerLost, on real gloo, two processes."""
    script = tmp_path / "silent_peer.py"
    script.write_text(_SILENT_PEER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore", "PYTHONPATH": REPO})
             for r in (0, 1)]
    out0, _ = procs[0].communicate(timeout=60)
    procs[1].kill()
    procs[1].communicate()
    assert procs[0].returncode == 0, out0
    seconds = float(out0.split("PEER_LOST after ")[1].split("s:")[0])
    assert 1.5 <= seconds <= 10, out0


_FAIL_ON_RANK_ZERO = """
import os
if os.environ.get("RANK") == "0":
    import megatron_patches.decide as decide

    def _describe(*args, **kwargs):
        raise KeyError("a bug in the guard, planted by the test")

    decide.describe = _describe
"""


@pytest.mark.multiproc
def test_an_error_on_rank_zero_while_deciding_is_broadcast_as_a_stop(tmp_path):
    """Rank 0 raises between the gather and the broadcast (a planted bug: the only fake here,
    put in through sitecustomize). The other rank must not wait in the broadcast: both stop
    with the critical code, and the record says what failed."""
    from rank_launcher import run_ranks

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FAIL_ON_RANK_ZERO)
    out = tmp_path / "run"
    started = time.monotonic()
    ranks = run_ranks(2, ["--out", str(out), "--steps", "8", "--inject", "nan:step=3"], timeout=240,
                      extra_env={"PYTHONPATH": os.pathsep.join([str(site), REPO])})
    assert [r.returncode for r in ranks] == [EXIT_CRITICAL, EXIT_CRITICAL], [_rank_lines(r) for r in ranks]
    assert time.monotonic() - started < 120
    (record,) = [json.loads(line) for line in (out / INCIDENTS_FILE).read_text().splitlines()]
    assert record["step"] == 3 and record["severity"] == "critical" and record["kind"] == "guard_error"
    assert "KeyError" in record["message"] and "planted by the test" in record["message"]


# --- webhook URLs ---------------------------------------------------------------------

SECRET = "T0SECRET/B0SECRET/xoxbTOKEN"


@pytest.mark.parametrize("url", [f"hooks.example.com/services/{SECRET}", f"ftp://hooks.example.com/{SECRET}",
                                 "ftp://user:xoxbTOKEN@hooks.example.com/x?token=xoxbTOKEN"])
def test_a_bad_webhook_url_is_refused_showing_only_its_host(url):
    with pytest.raises(ConfigError) as caught:
        Config.from_dict({"alerts": {"webhooks": [{"url": url}]}})
    message = str(caught.value)
    assert "SECRET" not in message and "TOKEN" not in message, message
    assert "hooks.example.com/…" in message and "`alerts.webhooks[0].url` must be an http://" in message


def test_a_webhook_url_of_the_wrong_type_is_not_echoed():
    with pytest.raises(ConfigError) as caught:
        Config.from_dict({"alerts": {"webhooks": [{"url": [f"https://hooks.example.com/{SECRET}"]}]}})
    assert "SECRET" not in str(caught.value) and "not shown" in str(caught.value)


def test_effective_config_shows_the_webhook_host_and_the_run_posts_to_the_whole_url(tmp_path):
    """The harness's effective_config.yaml is for people: host only. The ranks still post to the
    whole URL (a loopback receiver sees the secret path), and no copy of it is left on disk."""
    import yaml
    from test_alerts import Receiver

    receiver = Receiver()
    try:
        config = tmp_path / "guard.yaml"
        config.write_text(f"alerts:\n  webhooks:\n    - url: {receiver.url}/hook/{SECRET}\n"
                          "response:\n  on_error: stop\n  persist_steps: 2\n")
        out = tmp_path / "run"
        run = run_tiny(out, "--steps", "6", "--config", str(config), "--inject", "nan:step=2,count=2")
        assert run.returncode == EXIT_STOP, run.output[-3000:]
        written = (out / "effective_config.yaml").read_text()
        assert "SECRET" not in written, written
        assert yaml.safe_load(written)["alerts"]["webhooks"][0]["url"] == "http://127.0.0.1/…"
        assert [path for path, _, _ in receiver.posts] == [f"/hook/{SECRET}"]
    finally:
        receiver.stop()
    leftovers = [p for p in (out.rglob("*")) if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leftovers == []


# --- markers and the ledger that cannot be written ------------------------------------------

_MARKER_FAILS = """
import errno, os
import megatron_patches.checkpoint as checkpoint

_write = checkpoint.write_json_atomic

def write_json_atomic(path, value, **kwargs):
    if path.endswith(checkpoint.MARKER) and value.get("step") == 4:
        raise OSError(errno.ENOSPC, "No space left on device (planted by the test)", path)
    return _write(path, value, **kwargs)

checkpoint.write_json_atomic = write_json_atomic
"""


@pytest.mark.multiproc
def test_a_checkpoint_that_cannot_be_marked_is_no_rollback_target_and_training_goes_on(tmp_path):
    """The marker of the step-4 checkpoint fails to write on rank 0 (a planted ENOSPC, through
    sitecustomize: the only fake). Before, rank 0 raised inside save_checkpoint while rank 1
    waited at its barrier."""
    from rank_launcher import run_ranks

    from megatron_patches.checkpoint import list_checkpoints

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_MARKER_FAILS)
    out = tmp_path / "run"
    ranks = run_ranks(2, ["--out", str(out), "--steps", "9", "--save-interval", "4"], timeout=240,
                      extra_env={"PYTHONPATH": os.pathsep.join([str(site), REPO])})
    assert [r.returncode for r in ranks] == [0, 0], [_rank_lines(r) for r in ranks]
    assert "checkpoint step 4 could not be marked" in ranks[0].stdout
    assert "never a rollback target" in ranks[0].stdout
    listed = {step: healthy for step, _, healthy in list_checkpoints(str(out / "checkpoints"))}
    assert 4 not in listed and listed.get(8) is True, listed  # 8: certified by the clean check of 9
    assert json.loads((out / "result.json").read_text())["params_finite"]


def test_a_ledger_that_cannot_be_written_turns_a_rollback_exit_into_a_stop(tmp_path, guard_log):
    """Exit-and-restart: rank 0 writes the ledger before every rank exits 84. Where it cannot
    (the ledger's path is a directory), a restart would not know why: the exit becomes 86."""
    from megatron_patches.seams import build_monitor
    from megatron_patches.recovery import ExitAndRestart
    from megatron_patches.decisions import Action, Decision, Severity, exit_code

    rollback = Decision(Severity.ERROR, Action.ROLLBACK, "anomaly on 2 consecutive checked steps", 4)
    stop = Decision(Severity.ERROR, Action.STOP, "anomaly on 2 consecutive checked steps", 4)
    root = tmp_path / "checkpoints"
    root.mkdir()
    executor = ExitAndRestart(build_monitor(Config()), str(root))
    (root / "megatron_patches_ledger.json").mkdir()  # now the write fails
    assert exit_code(executor.settle_exit(rollback)) == EXIT_CRITICAL
    assert any("the ledger could not be written" in r.getMessage() for r in guard_log.records)
    assert executor.settle_exit(stop) is stop  # only a rollback needs the ledger


def test_the_kill_drill_parses_strictly_and_fires_once():
    from megatron_patches.inject import Injector, parse_spec

    for bad in ("kill:step=3", "kill:rank=1", "kill:step=3,rank=1,param=x", "kill:step=3,rank=1,count=2"):
        with pytest.raises(ConfigError, match="kill takes exactly step=S and rank=R"):
            parse_spec(bad)
    injector = Injector([parse_spec("kill:step=3,rank=1")])
    assert not injector  # no gradient drill: the hooks hand no gradients over for it
    assert not injector.kills(3, 0) and not injector.kills(2, 1)
    assert injector.kills(3, 1) and not injector.kills(3, 1)


@pytest.mark.parametrize("config, flags, expected", [
    ("response: {on_error: stop, exit_codes: {stop: 91}}", [], 91),
    ("response: {exit_codes: {rollback: 90}}", ["--recovery", "exit"], 90),
], ids=["stop-91", "rollback-90"])
def test_a_job_ends_with_the_exit_code_its_config_gives_each_outcome(tmp_path, config, flags, expected):
    """response.exit_codes reaches the process's exit status: an error that stops and an
    exit-and-restart rollback, each with the code the config sets. (A critical stop with its
    configured code: tests/trainings/test_recovery.py::test_faults_on_two_replicas_at_once_are_critical_and_every_rank_exits.)"""
    path = tmp_path / "guard.yaml"
    path.write_text(config + "\n")
    run = run_tiny(tmp_path / "run", "--steps", "6", "--config", str(path), *flags,
                   "--inject", "nan:step=2,count=2")
    assert run.returncode == expected, run.output[-3000:]
    assert f"stopping with exit code {expected}" in run.output, run.output[-3000:]
