"""The configuration reference, generated from the config dataclasses and the docstring under each
field: ``python -m megatron_patches.config_reference > docs/configuration.md``. A unit test fails
when that file and the code drift apart, so the reference never quotes a stale default."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
import typing
from typing import Any, Iterator

from . import config

HEADER = """# Configuration reference

Every key of the guard's YAML config (`MEGATRON_PATCHES_CONFIG`, or `--config` in the harness),
with its type, its default and what it does. Every key has a working default; a wrong one is refused
with one line naming it. Generated from `megatron_patches/config.py` (and `config_detectors.py`) by
`python -m megatron_patches.config_reference > docs/configuration.md`; do not edit by hand
(`tests/units/test_units_config.py` compares the two). How the sections work together:
[operations.md](operations.md#configuration).
"""


def _field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """Field name -> (its annotation as written, the docstring under it, on one line)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = (ast.unparse(node.annotation), " ".join(after.value.value.split()))
    return docs


def _config_class(annotation: Any) -> type | None:
    """The config dataclass a field holds, alone or as the items of a tuple, else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _yaml(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return value if isinstance(value, str) and value else json.dumps(value)


def _sections(cls: type, prefix: str) -> Iterator[tuple[str, type]]:
    """(dotted section name, dataclass) for ``cls`` and every section under it, depth first."""
    yield prefix, cls
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        inner = _config_class(hints[f.name])
        if inner is not None:
            name = f"{prefix}.{f.name}" if prefix else f.name
            yield from _sections(inner, name if inner is hints[f.name] else f"{name}[]")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(config))


def _rows(cls: type) -> Iterator[str]:
    docs = _field_docs(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue  # a section of its own
        if f.default is not dataclasses.MISSING:
            default = _yaml(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _yaml(f.default_factory())
        else:
            default = "(required)"
        kind, text = docs[f.name]
        yield f"| `{f.name}` | `{_cell(kind)}` | `{_cell(default)}` | {_cell(text)} |"


def markdown(text: str) -> str:
    """A docstring's reStructuredText markup as Markdown: a role (``:class:`~x.Y```) becomes its
    target in code quotes (`` `Y` ``, ``~`` keeping the last name), a double-backtick literal a
    single-backtick one."""
    def role(match: re.Match) -> str:
        target = match.group(1)
        return f"`{target.rsplit('.', 1)[-1] if target.startswith('~') else target}`"

    text = re.sub(r":[a-z]+(?::[a-z]+)?:`([^`]+)`", role, text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _cell(text: str) -> str:
    """``text`` inside a Markdown table cell."""
    return markdown(text).replace("|", "\\|")


def render() -> str:
    """The whole reference as Markdown."""
    parts = [HEADER]
    for name, cls in _sections(config.Config, ""):
        rows = list(_rows(cls))
        if not rows:
            continue
        parts.append(f"\n## {name or 'top level'}\n\n| key | type | default | what it does |\n| --- | --- | --- | --- |\n")
        parts.append("\n".join(rows) + "\n")
    return "".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render())
