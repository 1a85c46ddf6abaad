"""What docs/architecture.md and docs/contributing.md claim about the code, read against the code
(as tests/units/test_units_config.py reads docs/configuration.md against the config): who writes the
recovery ledger, and which drill phases exist."""

import ast
import re
from pathlib import Path

import pytest

from megatron_patches import inject

pytestmark = pytest.mark.one_line  # the same on every megatron-core line (conftest)

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_patches"


def _doc(name: str) -> str:
    return " ".join((REPO / "docs" / name).read_text().split())  # one line: claims wrap


def ledger_writers() -> set[str]:
    """``module:Class.function`` of every function that writes the ledger file (calls ``.save`` on
    something named ``ledger``), found in the package's source."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")

        def visit(node: ast.AST, where: str) -> None:
            for child in ast.iter_child_nodes(node):
                inner = where
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = f"{where}.{child.name}" if where else child.name
                if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and child.func.attr == "save"
                        and ast.unparse(child.func.value).split(".")[-1] == "ledger"):
                    found.add(f"{module}:{where}")
                visit(child, inner)

        visit(ast.parse(path.read_text()), "")
    return found


def test_architecture_md_names_every_ledger_writer_and_no_other():
    text = _doc("architecture.md")
    claim = re.search(r"The ledger file is written \(`Ledger\.save`\) only in `recovery\.py`, by (.*?); `tests/units/test_units_docs\.py`", text)
    assert claim, "docs/architecture.md no longer says who writes the ledger"
    named = {f"recovery:{name}" for name in re.findall(r"`([\w.]+)`", claim.group(1))}
    assert named == ledger_writers(), (
        f"docs/architecture.md names {sorted(named)} as the ledger's writers; the code has {sorted(ledger_writers())}")


def test_the_ledger_writer_finder_finds_them():
    assert "recovery:ExitAndRestart.settle_exit" in ledger_writers()


def test_contributing_md_lists_the_drill_phases_the_code_has():
    text = _doc("contributing.md")
    keys = re.search(r"`phase` \((.*?)\), `module` \((.*?)\)\.", text)
    assert keys, "docs/contributing.md no longer describes the phase and module keys"
    assert tuple(re.findall(r"`(\w+)`:", keys.group(1))) == inject.PHASES
    module_phases = keys.group(2).split(" only")[0]
    assert tuple(re.findall(r"`(\w+)`", module_phases)) == inject.MODULE_PHASES


@pytest.mark.parametrize("doc", ["architecture.md", "contributing.md", "operations.md"])
def test_every_phase_a_doc_names_exists(doc):
    named = set(re.findall(r"phase=(\w+)", _doc(doc)))
    assert named <= set(inject.PHASES), f"docs/{doc} names phase(s) {sorted(named - set(inject.PHASES))}"
