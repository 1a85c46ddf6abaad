"""The tests' own layout (issue 60 item 4): by kind, ``tests/units`` (no ranks, no training) and
``tests/trainings`` (trainings, several ranks, Megatron-LM's loop, fresh processes), as
docs/contributing.md and tests/README.md say, and no test file over 800 lines."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)


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
