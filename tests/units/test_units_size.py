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
