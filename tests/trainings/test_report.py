"""``megatron-patches report`` and ``doctor`` as a user runs them: a subprocess on real files."""

import json
import os
import subprocess
import sys

import pytest

from megatron_patches.incidents import HISTORY_SCHEMA, INCIDENTS_FILE, JsonlWriter, ParamFinding, make_record

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = {"size": 4, "tp": 2, "pp": 2, "dp": 1, "cp": 1, "ep": 1}
FC1 = "decoder.layers.3.mlp.linear_fc1.weight"


def finding(name, layer, rank, tp, pp, order, nan=0, norm=None):
    return ParamFinding(
        name=name, layer=layer, shape=[256, 64], nan=nan, inf=0, overflow=0, norm=norm,
        ranks={"global": rank, "tp": tp, "pp": pp, "dp": 0, "cp": 0, "ep": 0, "vpp": 0},
        host=f"node-{rank // 2}", device=f"cuda:{rank % 2}", order=order, reasons=["nan"] if nan else ["magnitude"],
    )


def write_run(run_dir, with_history=False):
    """Two incidents as the detector writes them: a localized NaN and an unlocalized loss-scale collapse."""
    writer = JsonlWriter(os.path.join(run_dir, INCIDENTS_FILE))
    writer.write(make_record(
        step=37, severity="error", kind="nan", kinds=["nan"], action="skip_step",
        message="NaN in 3 gradients on 2 ranks",
        params=[
            finding(FC1, 3, 3, 1, 1, order=20, nan=1024),
            finding("decoder.layers.2.mlp.linear_fc2.weight", 2, 2, 0, 1, order=15, nan=7),
        ],
        ranks_affected=[2, 3], world=WORLD, replay={"verdict": "deterministic"},
        scene=os.path.join(run_dir, "scene_step37"),
    ))
    writer.write(make_record(
        step=80, severity="critical", kind="loss_scale", kinds=["loss_scale"], action="stop",
        message="loss scale collapsed to 0.5", params=[], ranks_affected=[0, 1, 2, 3], world=WORLD,
    ))
    if with_history:
        history = JsonlWriter(os.path.join(run_dir, "grad_history.jsonl"), fsync=False)
        for step in range(1, 91):
            layers = {"embedding": 0.4, **{str(i): 1.0 + i + step / 100 for i in range(4)}, "output_layer": 2.0}
            total = sum(v * v for v in layers.values()) ** 0.5
            if step == 37:
                layers["3"], total = None, None
            history.write({"schema": HISTORY_SCHEMA, "step": step, "total_norm": total, "layers": layers})


def cli(*args, cwd=None, prelude=""):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MEGATRON_PATCHES_CONFIG", None)
    code = f"{prelude}from megatron_patches.cli import main; raise SystemExit(main({list(args)!r}))"
    cmd = [sys.executable, "-m", "megatron_patches", *args] if not prelude else [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_report_names_first_parameter_rank_and_verdict(tmp_path):
    write_run(tmp_path)
    out = cli("report", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    table_row = next(line for line in out.stdout.splitlines() if line.startswith("37 "))
    for cell in ("error", "nan", FC1, "1/1/0", "node-1", "skip_step", "deterministic"):
        assert cell in table_row
    assert f"entered at: {FC1} (layer 3), global rank 3 (tp 1, pp 1, dp 0), host node-1 cuda:1, 1024 NaN" in out.stdout
    assert "spread: 2 of 4 ranks, 2 parameter(s)" in out.stdout
    assert "suspect data or code" in out.stdout
    assert f"scene {tmp_path / 'scene_step37'}" in out.stdout
    assert "not localized to a parameter" in out.stdout  # the loss-scale incident
    assert "2 incident(s): 1 critical, 1 error" in out.stdout


def test_damaged_lines_are_named_and_the_rest_still_shown(tmp_path):
    write_run(tmp_path)
    with open(tmp_path / INCIDENTS_FILE, "a", encoding="utf-8") as handle:
        handle.write("this is not json\n")
        handle.write(json.dumps({"schema": "megatron_patches.incident/2", "step": 90}) + "\n")
        handle.write('{"schema": "megatron_patches.incident/1", "step": 95, "sever')  # killed mid-write
    out = cli("report", str(tmp_path))
    assert out.returncode == 0
    path = str(tmp_path / INCIDENTS_FILE)
    assert f"{path}:3: not a JSON line" in out.stderr
    assert f"{path}:4: schema 'megatron_patches.incident/2' is not 'megatron_patches.incident/1'" in out.stderr
    assert f"{path}:5: truncated last line" in out.stderr
    assert "Traceback" not in out.stderr
    assert FC1 in out.stdout and "loss_scale" in out.stdout


def test_empty_and_missing_incident_files_exit_zero_with_a_message(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / INCIDENTS_FILE).write_text("")
    (tmp_path / "none").mkdir()
    empty = cli("report", str(tmp_path / "empty"))
    assert empty.returncode == 0
    assert "incidents.jsonl: is empty" in empty.stderr
    assert "no incidents" in empty.stdout
    missing = cli("report", str(tmp_path / "none"))
    assert missing.returncode == 0
    assert "incidents.jsonl: does not exist" in missing.stderr


def test_missing_directory_is_one_line_and_exit_2(tmp_path):
    out = cli("report", str(tmp_path / "no_such_run"))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "no_such_run' does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_json_summary_lists_incidents_counts_and_problems(tmp_path):
    write_run(tmp_path)
    with open(tmp_path / INCIDENTS_FILE, "a", encoding="utf-8") as handle:
        handle.write("[1, 2]\n")
    out = cli("report", str(tmp_path), "--json")
    assert out.returncode == 0
    summary = json.loads(out.stdout)
    assert summary["counts"]["total"] == 2
    assert summary["counts"]["severity"] == {"error": 1, "critical": 1}
    assert summary["incidents"][0]["first"]["name"] == FC1
    assert summary["incidents"][0]["first"]["ranks"]["global"] == 3
    assert summary["problems"] == [{
        "file": str(tmp_path / INCIDENTS_FILE), "line": 3,
        "message": "expected a JSON object, got list; skipped",
    }]


@pytest.mark.plot
def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'megatron_patches[plot]')")
    import matplotlib.image

    write_run(tmp_path, with_history=True)
    png = tmp_path / "norms.png"
    out = cli("report", str(tmp_path), "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert png.stat().st_size > 0
    image = matplotlib.image.imread(str(png))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_plot_without_history_says_what_is_missing(tmp_path):
    write_run(tmp_path)
    out = cli("report", str(tmp_path), "--plot", str(tmp_path / "norms.png"))
    assert out.returncode == 2
    assert "--plot needs" in out.stderr
    assert not (tmp_path / "norms.png").exists()


def test_plot_without_matplotlib_says_how_to_install(tmp_path):
    write_run(tmp_path, with_history=True)
    # matplotlib may well be installed here; blocking its import is how a machine without it looks.
    block = "import sys; sys.modules['matplotlib'] = None; "
    out = cli("report", str(tmp_path), "--plot", str(tmp_path / "n.png"), prelude=block)
    assert out.returncode == 2
    assert "--plot needs matplotlib: pip install 'megatron_patches[plot]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_doctor_fails_on_a_misspelled_key(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("check_intervall: 2\n")
    out = cli("doctor", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 1
    line = next(line for line in out.stdout.splitlines() if line.split()[1:2] == ["config"])
    assert line.startswith("FAIL") and "check_intervall" in line and "check_interval" in line
    assert "Traceback" not in out.stderr


def test_doctor_checks_report_dir_and_lists_alerts(tmp_path):
    (tmp_path / "a_file").write_text("")
    good = tmp_path / "good.yaml"
    good.write_text(
        f"report_dir: {tmp_path / 'reports'}\n"
        "alerts:\n  webhooks:\n    - url: https://hooks.example.com/T0/secret\n      format: slack\n"
    )
    out = cli("doctor", "--config", str(good), cwd=tmp_path)
    lines = {line.split()[1]: line for line in out.stdout.splitlines() if len(line.split()) > 1}
    assert lines["config"].startswith("ok")
    assert lines["report_dir"].startswith("ok") and "will be created" in lines["report_dir"]
    assert "slack webhook to hooks.example.com" in lines["alerts"] and "secret" not in out.stdout
    assert lines["megatron-core"].split()[0] in ("ok", "warn", "FAIL")

    blocked = tmp_path / "blocked.yaml"
    blocked.write_text(f"report_dir: {tmp_path / 'a_file' / 'reports'}\n")
    out = cli("doctor", "--config", str(blocked), cwd=tmp_path)
    assert out.returncode == 1
    assert any(line.startswith("FAIL  report_dir") and "is a file" in line for line in out.stdout.splitlines())


def test_harness_writes_live_metrics_to_tensorboard(tmp_path):
    """Issue 8: per-step anomaly counters and gradient-norm summaries in TensorBoard."""
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install 'megatron_patches[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conftest import run_tiny

    run = run_tiny(tmp_path / "out", "--steps", "6", "--tensorboard-dir", str(tmp_path / "tb"),
                   "--inject", "nan:step=3,param=decoder.layers.1.mlp.linear_fc1.weight")
    assert run.returncode == 0, run.output[-2000:]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "megatron_patches/incidents", "megatron_patches/total_grad_norm",
            "megatron_patches/layer_grad_norm/1"} <= tags
    incidents = [e.value for e in events.Scalars("megatron_patches/incidents")]
    assert incidents == [0, 0, 1, 1, 1, 1]


def test_a_rollback_whose_restart_has_not_resumed_is_pending_and_a_broken_ledger_is_one_problem(tmp_path):
    """In process: the outcome comes from the ledger the record names; none yet -> pending."""
    from megatron_patches.report import load_report

    ledger = tmp_path / "ckpt" / "megatron_patches_ledger.json"
    ledger.parent.mkdir()
    ledger.write_text(json.dumps({"schema": "megatron_patches.ledger/1", "rollbacks": 1, "events": [
        {"step": 9, "exit": 84, "lr_scale": 0.5, "blacklisted": 0, "skip_iterations": [8, 9]}]}))
    writer = JsonlWriter(os.path.join(tmp_path, INCIDENTS_FILE))
    for step, path in ((9, ledger), (12, tmp_path / "missing.json")):
        writer.write(make_record(step=step, severity="error", kind="nan", kinds=["nan"], action="rollback",
                                 message="m", params=[], ranks_affected=[], world=WORLD, ledger=str(path)))
    report = load_report(str(tmp_path))
    first, second = report.incidents
    assert first["rollback_pending"] and first["iterations_skipped"] == [8, 9] and first["restart"] == 1
    assert "rolled_back_to" not in first and "rolled_back_to" not in second
    [problem] = report.problems
    assert problem.path == str(tmp_path / "missing.json") and "cannot be read" in problem.message


def _caused(step, klass, action="skip_step", severity="warning", devices=(), rank=0):
    cause = {"class": klass, "evidence": ["hand-made"], "confidence": "high"}
    if devices:
        cause["devices"] = [{"rank": r, "host": h, "device": d} for r, h, d in devices]
    return make_record(step=step, severity=severity, kind="nan", kinds=["nan"], action=action, message="m",
                       params=[finding(FC1, 3, rank, 0, 0, order=20, nan=1)], ranks_affected=[rank], world=WORLD,
                       cause=cause)


def test_report_groups_incidents_by_cause_and_device_and_leads_with_the_verdict(tmp_path):
    gpu3 = (3, "node-7", "cuda:3")
    writer = JsonlWriter(os.path.join(tmp_path, INCIDENTS_FILE))
    for record in (_caused(6, "data", rank=2), _caused(7, "hardware", "rollback", "error", [gpu3]),
                   _caused(9, "numerics", rank=2), _caused(15, "hardware", "fence", "critical", [gpu3])):
        writer.write(record)
    out = cli("report", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == ("verdict: hardware: device node-7 cuda:3 fenced after 2 hardware-class incident(s); "
                        "restart the job without host node-7")
    table = lines[lines.index("by cause and device:") + 1:lines.index("by cause and device:") + 5]
    assert [line.split()[:1] + line.split()[-2:] for line in table] == [
        ["cause", "incidents", "steps"], ["hardware", "7,", "15"], ["data", "1", "6"], ["numerics", "1", "9"]]
    assert "node-7 cuda:3" in table[1] and "node-1 cuda:0" in table[2]  # data: where it was named first
    summary = json.loads(cli("report", str(tmp_path), "--json").stdout)
    assert summary["verdict"] == lines[0] and summary["counts"]["cause"] == {"data": 1, "hardware": 2, "numerics": 1}
    assert summary["groups"][0] == {"cause": "hardware", "device": "node-7 cuda:3", "count": 2, "steps": [7, 15]}


def test_the_verdict_without_a_fence_names_the_leading_cause_and_a_record_without_cause_is_unknown(tmp_path):
    write_run(tmp_path)  # records written before `cause` existed
    lines = cli("report", str(tmp_path)).stdout.splitlines()
    assert lines[0] == "verdict: 2 incident(s), most of them unknown (2); the run stopped at step 80"
    software = tmp_path / "bug"
    software.mkdir()
    JsonlWriter(os.path.join(software, INCIDENTS_FILE)).write(_caused(1, "software", "stop", "critical"))
    assert cli("report", str(software)).stdout.splitlines()[0].startswith(
        "verdict: software: a fault on every replica from the first checked step (1 incident(s)); fix the code")
