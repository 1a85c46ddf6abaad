"""Every output the README and docs/ quote, compared with what the code prints today (issue 58): the
start line, the report's table, ``doctor``'s lines, the one-line errors, the launcher's lines, and
bench.md's table of limits against ``scripts/bench_report.py``; and every test or file a doc cites
exists. Each check is a function that returns the quotes that differ, so that the negative controls
can change a message where the running code looks it up and see the check catch it."""

import ast
import re
import sys
from pathlib import Path

import pytest

from megatron_patches import cli, report, versions
from megatron_patches.seams import start_line
from megatron_patches.seams.targets import TARGETS, TRAINING_TARGETS

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def quoted(prefix: str) -> list[tuple[str, str]]:
    """(file, line) of every line of the README and docs that starts with ``prefix``."""
    return [(path.relative_to(REPO).as_posix(), line) for path in DOCS
            for line in path.read_text().splitlines() if line.startswith(prefix)]


def masked(text: str) -> str:
    """``text`` with what differs between machines made alike: absolute paths and x.y.z versions."""
    return re.sub(r"\b\d+\.\d+\.\d+\S*", "V", re.sub(r"(?<![\w.])/[^\s)]+", "PATH", text))


# --- the start line ------------------------------------------------------------------------------

START = "[megatron_patches] guarding megatron-core "


def start_line_mismatches() -> list[str]:
    """Each quoted start line against the one the code composes for the version it names: the targets
    the registry wraps (megatron-core's alone where the line says megatron.training is absent), and
    the snapshot figures it quotes in the code's words."""
    bad = []
    for where, line in quoted(START):
        version = line[len(START):].split(":", 1)[0]
        absent = ["megatron.training"] if "megatron.training absent" in line else []
        expected = "[megatron_patches] " + start_line.wrapped_text(
            version, len(TARGETS) + (0 if absent else len(TRAINING_TARGETS)), absent)
        memory = re.search(r"in-memory snapshots every (\d+) iterations, (\d+) kept: at most ([\d.]+) MiB", line)
        if memory:
            interval, kept, mib = int(memory.group(1)), int(memory.group(2)), float(memory.group(3))
            expected += start_line.memory_text(interval, kept, mib * 2**20 / kept)
        if line != expected:
            bad.append(f"{where}: {line!r}\n  the code: {expected!r}")
    return bad


@pytest.mark.one_line
def test_every_quoted_start_line_is_the_codes():
    assert len(quoted(START)) >= 4
    assert start_line_mismatches() == []


@pytest.mark.one_line
def test_a_changed_start_line_fails_the_comparison(monkeypatch):
    monkeypatch.setattr(start_line, "wrapped_text", lambda version, n, absent: f"guarding {version}: {n} wrapped")
    assert len(start_line_mismatches()) == len(quoted(START))


def test_the_start_line_counts_what_install_wraps_on_this_line(clean_patches):
    """The counts the comparison above assumes (19 in megatron-core, 5 more in megatron.training) are
    what installing the patches here wraps and holds for the start line."""
    from megatron_patches.seams import patching
    from megatron_patches.seams.parallel import megatron_core_version

    try:
        import megatron.training.training  # noqa: F401
        absent = []
    except ImportError:
        absent = ["megatron.training"]
    wrapped = patching.install(say_now=False)
    assert len(wrapped) == len(TARGETS) + (0 if absent else len(TRAINING_TARGETS))
    assert start_line.held() == start_line.wrapped_text(megatron_core_version(), len(wrapped), absent)


# --- the report's table ----------------------------------------------------------------------------

HEADER = "step  severity  kind  "


def quoted_tables() -> list[tuple[str, list[str]]]:
    """(file, lines) of every quoted report table: its header and the rows under it."""
    tables = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith(HEADER):
                rows = [line]
                for row in lines[i + 1:]:
                    if not re.match(r"\d+ ", row):
                        break
                    rows.append(row)
                tables.append((path.relative_to(REPO).as_posix(), rows))
    return tables


def record_of(cells: list[str]) -> dict:
    """The fields of an incident record the table shows, from one quoted row."""
    cells = cells + ["-"] * (11 - len(cells))
    value = lambda cell: None if cell == "-" else cell  # noqa: E731
    step, severity, kind, name, layer, tp_pp_dp, rank, host, action, replay, resumed = map(value, cells)
    tp, pp, dp = tp_pp_dp.split("/") if tp_pp_dp else (None, None, None)
    first = {"name": name, "layer": layer, "host": host, "ranks": {"tp": tp, "pp": pp, "dp": dp, "global": rank}}
    return {"step": step, "severity": severity, "kind": kind, "first": first, "action": action,
            "replay": {"verdict": replay} if replay else {},
            **({"rollback_pending": True} if resumed == "pending" else {"rolled_back_to": resumed})}


def table_mismatches() -> list[str]:
    """Each quoted table against what ``report`` prints for the values its rows show."""
    bad = []
    for where, lines in quoted_tables():
        printed = report.format_table([record_of(re.split(r" {2,}", row.strip())) for row in lines[1:]])
        if printed.splitlines() != lines:
            bad.append(f"{where}:\n" + "\n".join(lines) + "\n  the code:\n" + printed)
    return bad


@pytest.mark.one_line
def test_every_quoted_report_table_is_what_report_prints():
    assert len(quoted_tables()) >= 5
    assert table_mismatches() == []


@pytest.mark.one_line
def test_a_changed_report_table_fails_the_comparison(monkeypatch):
    rows = report.table_rows
    monkeypatch.setattr(report, "table_rows", lambda incidents: [row[:-1] for row in rows(incidents)])
    assert len(table_mismatches()) == len(quoted_tables())


# --- doctor --------------------------------------------------------------------------------------

DOCTOR_STATUS = ("ok    ", "warn  ", "FAIL  ")


def doctor_quote(command: str) -> list[str]:
    """The lines docs/operations.md quotes under ``$ megatron-patches doctor ...`` (``command``)."""
    lines = (REPO / "docs" / "operations.md").read_text().splitlines()
    start = lines.index(f"$ megatron-patches doctor {command}")
    quote = []
    for line in lines[start + 1:]:
        if line.startswith("```"):
            break
        quote.append(line)
    return quote


def run_doctor(capsys, config: Path) -> list[str]:
    cli.main(["doctor", "--config", str(config)])
    return capsys.readouterr().out.splitlines()


def doctor_configs(tmp_path: Path) -> tuple[Path, Path]:
    """The two configs of operations.md's doctor section, in ``tmp_path``."""
    good = tmp_path / "alerts.yaml"
    good.write_text(f"report_dir: {tmp_path}\nalerts:\n  min_severity: error\n  jsonl: alerts.jsonl\n"
                    "  command: \"logger -t megatron_patches\"\n  webhooks:\n"
                    "    - {url: 'http://127.0.0.1:9/hooks/T000/B000/secret', format: slack, timeout_s: 2, retries: 1}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("check_intervall: 1\n")
    return good, bad


def doctor_mismatches(capsys, tmp_path: Path) -> list[str]:
    good, bad = doctor_configs(tmp_path)
    bad_lines = []
    quote = doctor_quote("--config /tmp/docrun/alerts.yaml")
    printed = run_doctor(capsys, good)
    if [masked(line) for line in quote] != [masked(line) for line in printed]:
        bad_lines.append("doctor --config alerts.yaml:\n" + "\n".join(quote) + "\n  the code:\n" + "\n".join(printed))
    quote = doctor_quote("--config bad.yaml | grep config")
    printed = [line for line in run_doctor(capsys, bad) if "config" in line]
    if quote != printed:
        bad_lines.append(f"doctor --config bad.yaml: {quote}\n  the code: {printed}")
    return bad_lines


@pytest.mark.one_line
def test_the_quoted_doctor_lines_are_what_doctor_prints(capsys, tmp_path, monkeypatch):
    """On a machine like the one quoted (a CPU, no torch_npu, no apex); a device here changes lines."""
    import importlib.util

    import torch

    if torch.cuda.is_available() or importlib.util.find_spec("amp_C") or importlib.util.find_spec("torch_npu"):
        pytest.skip("the quote is from a CPU machine without apex or torch_npu")
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    assert doctor_mismatches(capsys, tmp_path) == []


@pytest.mark.one_line
def test_a_changed_doctor_line_fails_the_comparison(capsys, tmp_path, monkeypatch):
    """The supported range the docs once quoted (<0.17), put where doctor looks it up."""
    monkeypatch.setattr("megatron_patches.seams.targets.MEGATRON_CORE_SUPPORTED", ">=0.12,<0.17")
    assert len(doctor_mismatches(capsys, tmp_path)) == 1


# --- one-line errors -------------------------------------------------------------------------------


def error_mismatches(capsys, tmp_path: Path) -> list[str]:
    """The error lines the README, operations.md and reliability.md quote, against the code's."""
    bad = []
    [(_, refusal)] = quoted("megatron-core 0.19.2 needs Python")
    if refusal != versions.problem("0.19.2", (3, 11)):
        bad.append(f"README: {refusal!r}\n  the code: {versions.problem('0.19.2', (3, 11))!r}")

    cli.main(["report", str(tmp_path / "nosuch")])
    printed = capsys.readouterr().err.strip()
    [(_, quote)] = quoted("megatron-patches report: error: report directory")
    if masked(quote) != masked(printed):
        bad.append(f"operations.md: {quote!r}\n  the code: {printed!r}")

    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "incidents.jsonl").write_text('{"schema": "megatron_patches.incident/1", "step": 3}\n{"schema": "mega')
    cli.main(["report", str(tmp_path / "cut")])
    printed = capsys.readouterr().err.strip()
    [(_, quote)] = [(w, line) for w, line in quoted("megatron-patches report: /") if "truncated" in line]
    if masked(quote) != masked(printed):
        bad.append(f"operations.md: {quote!r}\n  the code: {printed!r}")

    from megatron_patches.errors import UserError
    from megatron_patches.ledger import LEDGER_FILE, Ledger

    (tmp_path / LEDGER_FILE).write_text('{"schema": "megatron_patches.ledger/1", "rollbacks": "3"}')
    with pytest.raises(UserError) as refused:
        Ledger.load(str(tmp_path))
    [(_, quote)] = quoted("ledger /ckpt/megatron_patches_ledger.json: ")
    if masked(quote) != masked(str(refused.value)):
        bad.append(f"reliability.md: {quote!r}\n  the code: {str(refused.value)!r}")
    return bad


@pytest.mark.one_line
def test_the_quoted_error_lines_are_the_codes(capsys, tmp_path):
    assert error_mismatches(capsys, tmp_path) == []


@pytest.mark.one_line
def test_a_changed_error_line_fails_the_comparison(capsys, tmp_path, monkeypatch):
    """The Python a release line needs, changed where ``versions.problem`` looks it up."""
    monkeypatch.setattr(versions, "LINES", (((0, 12), (0, 16), (3, 11), "0.16.1"), ((0, 17), (0, 20), (3, 13), "0.19.x")))
    assert len(error_mismatches(capsys, tmp_path)) == 1


# --- the launcher's lines --------------------------------------------------------------------------

LAUNCHER = "[restart_on_rollback] attempt "
FAKE_TRAINING = """
import json, os, sys
ledger = os.path.join(sys.argv[1], "megatron_patches_ledger.json")
if not os.path.exists(ledger):  # the first attempt: a rollback at iteration 5, exit 1 as torchrun reports it
    json.dump({"rollbacks": 1, "lr_scale": 0.5, "rollback_requested": {"iteration": 5, "skip_iterations": [4, 5]}},
              open(ledger, "w"))
    sys.exit(1)
"""


def launcher_line(line: str) -> str:
    """A launcher line with its seconds masked, and of an ``attempt N: COMMAND`` line the command left out."""
    line = re.sub(r"\b\d+ s\b", "N s", line)
    return re.sub(r"^(\[restart_on_rollback\] attempt \d+): (?!rollback).*", r"\1: COMMAND", line)


def launcher_mismatches(capfd, tmp_path: Path) -> list[str]:
    """megatron_lm.md's launcher lines against the launcher's own, run on a stand-in for the training
    (a script that writes the ledger a rollback writes and exits 1, then succeeds): the command and
    the seconds masked; the quote may leave lines out."""
    from megatron_patches import launch

    script = tmp_path / "training.py"
    script.write_text(FAKE_TRAINING)
    assert launch.main(["--max-restarts", "2", "--checkpoint-dir", str(tmp_path), "--",
                        sys.executable, str(script), str(tmp_path)]) == 0
    printed = [line for line in capfd.readouterr().err.splitlines() if line.startswith(LAUNCHER)]
    quote = [launcher_line(line) for _, line in quoted(LAUNCHER)]
    code = [launcher_line(line) for line in printed]
    rest = iter(code)  # the quote is abridged: its lines in the code's order, some left out
    return [] if all(line in rest for line in quote) else [f"megatron_lm.md: {quote}\n  the code: {code}"]


@pytest.mark.one_line
def test_the_quoted_launcher_lines_are_the_launchers(capfd, tmp_path):
    assert len(quoted(LAUNCHER)) == 3
    assert launcher_mismatches(capfd, tmp_path) == []


@pytest.mark.one_line
def test_a_changed_launcher_line_fails_the_comparison(capfd, tmp_path, monkeypatch):
    from megatron_patches import launch

    say = launch.say
    monkeypatch.setattr(launch, "say", lambda message: say(message.replace("restarting", "restarts")))
    assert len(launcher_mismatches(capfd, tmp_path)) == 1


# --- bench.md's limits -------------------------------------------------------------------------------


def bench_limits() -> dict[str, list[float]]:
    """{target name: the LIMITS values its row in scripts/bench_report.py uses}."""
    source = (REPO / "scripts" / "bench_report.py").read_text()
    limits = ast.literal_eval(re.search(r"^LIMITS = (\{.*?\})$", source, re.S | re.M).group(1))
    found = {}
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Constant)
                and isinstance(node.elts[0].value, str) and re.fullmatch(r"[a-z_]+", node.elts[0].value)):
            keys = [sub.slice.value for sub in ast.walk(node) if isinstance(sub, ast.Subscript)
                    and isinstance(sub.value, ast.Name) and sub.value.id == "LIMITS"]
            if keys:
                found[node.elts[0].value] = sorted({limits[k] for k in keys})
    return found


def bench_table_mismatches(limits: dict[str, list[float]]) -> list[str]:
    text = (REPO / "docs" / "bench.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (<= [^|]*?) \|", text, re.M))
    bad = [f"bench.md's limits table has {sorted(set(rows) ^ set(limits))} where bench_report.py differs"] \
        if set(rows) != set(limits) else []
    for name, values in limits.items():
        shown = sorted({float(v) for v in re.findall(r"\d+(?:\.\d+)?", rows.get(name, ""))})
        if shown != values:
            bad.append(f"bench.md: `{name}` {rows.get(name)!r}; bench_report.py: {values}")
    return bad


@pytest.mark.one_line
def test_bench_md_states_the_limits_bench_report_applies():
    limits = bench_limits()
    assert len(limits) == 10  # default_torch_calls_per_check joined the eight (issue 59), state reads (56)
    assert bench_table_mismatches(limits) == []


@pytest.mark.one_line
def test_a_changed_limit_fails_the_comparison():
    limits = bench_limits()
    limits["default_extra_host_reads"] = [0.0]
    assert len(bench_table_mismatches(limits)) == 1


# --- what the docs cite ------------------------------------------------------------------------------


def missing_citations() -> list[str]:
    """Tests the docs name (``test_...``, ``tests/x.py::test_...``; a glob ``test_x_*.py`` is no name) and repository paths they cite in
    code quotes (``megatron_patches/...``, ``tests/...``, ``scripts/...``) that do not exist."""
    defined = {name for path in (REPO / "tests").rglob("*.py")
               for name in re.findall(r"def (test_\w+)", path.read_text())}
    files = {path.name for path in (REPO / "tests").rglob("*.py")}
    tensorboard_tags = ("megatron_patches/checked_steps", "megatron_patches/incidents", "megatron_patches/layer_grad_norm",
                        "megatron_patches/skipped_steps", "megatron_patches/total_grad_norm")
    bad = []
    for path in DOCS:
        text, where = path.read_text(), path.relative_to(REPO).as_posix()
        bad += [f"{where}: {name}" for name in sorted(set(re.findall(r"\b(test_\w+)\b(?!\*)", text)))
                if name not in defined and f"{name}.py" not in files]
        for cited in sorted(set(re.findall(r"`((?:megatron_patches|tests|scripts|docs|patches)/[\w./-]+)", text))):
            cited = cited.rstrip(".")
            if "*" not in cited and not cited.startswith(tensorboard_tags) and not (REPO / cited).exists():
                bad.append(f"{where}: {cited}")
    return bad


@pytest.mark.one_line
def test_every_test_and_file_the_docs_cite_exists():
    assert missing_citations() == []


# --- the runbook names every exit code --------------------------------------------------------------


def runbook_gaps(codes: dict[str, int]) -> list[str]:
    """The exit codes of ``response.exit_codes`` (name: default) the runbook in docs/operations.md has
    no row for, and rows for codes the config does not have."""
    text = (REPO / "docs" / "operations.md").read_text()
    runbook = text.split("## Runbook: what to do on each exit code", 1)[1].split("\n## ", 1)[0]
    rows = {int(code) for code in re.findall(r"^\| \*\*(\d+)\*\* ", runbook, re.M)}
    return [f"no runbook row for {name} ({code})" for name, code in codes.items() if code not in rows] + \
        [f"a runbook row for {code}, which response.exit_codes does not have" for code in rows - set(codes.values())]


def exit_codes() -> dict[str, int]:
    import dataclasses

    from megatron_patches.config import ExitCodesConfig

    return {f.name: f.default for f in dataclasses.fields(ExitCodesConfig)}


@pytest.mark.one_line
def test_the_runbook_has_a_row_for_every_exit_code():
    assert len(exit_codes()) >= 4
    assert runbook_gaps(exit_codes()) == []


@pytest.mark.one_line
def test_an_exit_code_without_a_row_fails_the_runbook_check():
    assert runbook_gaps({**exit_codes(), "spare": 99}) == ["no runbook row for spare (99)"]


# --- the Python it needs, said once -----------------------------------------------------------------


def test_setup_py_the_readme_and_doctor_ask_for_the_same_python():
    """setup.py's python_requires, versions.PYTHON_MIN (doctor and the release lines) and the README's
    "Python 3.11+" are one fact."""
    setup = (REPO / "setup.py").read_text()
    assert f'python_requires=">={versions.python_min()}"' in setup
    assert f"(Python {versions.python_min()}+," in (REPO / "README.md").read_text()
    assert all(python >= versions.PYTHON_MIN for _, _, python, _ in versions.LINES)
