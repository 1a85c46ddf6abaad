"""The package's size rule (#43 item 9): modules of at most 400 lines, functions of at most 80,
classes of at most 300. A room that outgrows it gets split, not exempted."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_patches"
LIMITS = {"module": 400, "function": 80, "class": 300}


def oversized(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root.parent)
        if len(text.splitlines()) > LIMITS["module"]:
            found.append(f"{where}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            kind = ("function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    else "class" if isinstance(node, ast.ClassDef) else None)
            if kind is not None and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
                found.append(f"{where}:{node.lineno} {kind} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    return found


def test_modules_functions_and_classes_keep_to_their_size():
    assert oversized() == []


def test_the_size_check_finds_an_oversized_function(tmp_path):
    package = tmp_path / "megatron_patches"
    package.mkdir()
    (package / "big.py").write_text("def f():\n" + "    x = 1\n" * 80)
    assert oversized(package) == ["megatron_patches/big.py:1 function f: 81 lines"]


# --- the tests (issue 60 item 4): by kind, no file over 800 lines --------------------------------------

TESTS = Path(__file__).resolve().parents[1]
TEST_FILE_LINES = 800
KINDS = ("units", "trainings")
"""``tests/units``: no ranks, no training; ``tests/trainings``: trainings, several ranks, Megatron-LM's
loop, fresh processes (docs/contributing.md). Shared helpers and plugins stay in ``tests/`` itself."""


def oversized_test_files(root: Path = TESTS) -> list[str]:
    return [f"{p.relative_to(root.parent)}: {n} lines" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > TEST_FILE_LINES]


def test_no_test_file_is_over_800_lines():
    assert oversized_test_files() == []


def test_every_test_file_sits_in_its_kind_and_no_unit_trains_on_several_ranks():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert loose == [], f"put {loose} under tests/units (no ranks, no training) or tests/trainings (docs/contributing.md)"
    assert {p.parent.name for p in TESTS.rglob("test_*.py")} == set(KINDS)
    several_ranks = sorted(p.name for p in (TESTS / "units").glob("test_*.py") if p.name != Path(__file__).name
                           and ("mark.multiproc" in p.read_text() or "run_tiny(" in p.read_text()))
    assert several_ranks == []


def test_the_test_size_check_finds_a_long_file(tmp_path):
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "test_long.py").write_text("x = 1\n" * 801)
    assert oversized_test_files(tmp_path) == [f"{tmp_path.name}/units/test_long.py: 801 lines"]
