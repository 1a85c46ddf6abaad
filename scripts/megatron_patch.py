#!/usr/bin/env python3
"""Apply, revert or inspect the megatron_patches source patches on a Megatron-LM tree.

    python scripts/megatron_patch.py apply  --megatron DIR [--only optimizer]
    python scripts/megatron_patch.py revert --megatron DIR
    python scripts/megatron_patch.py status --megatron DIR

DIR is a Megatron-LM checkout (or any directory holding ``megatron/core``, such as an unpacked
megatron-core source distribution or site-packages; use ``--only optimizer`` there, as it has no
``pretrain_gpt.py``). The megatron-core version is read from ``megatron/core/package_info.py`` and
picks ``patches/<line>/``. Every patch is checked with ``git apply --check`` (and ``--reverse
--check`` to recognise it as already applied) before anything is written; the patches to apply
then go in one ``git apply`` call, which changes all files or none.

Exit status: 0 done (``status``: fully patched); 1 ``status``: not patched or partly patched;
2 incompatible tree, unsupported version or bad arguments.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PATCHES_DIR = Path(__file__).resolve().parent.parent / "patches"

# (major, minor) of megatron/core/package_info.py -> directory under patches/.
# The release tag's package_info.py can be ahead of the tag name (core_v0.19.0 says 0.19.1); only
# (major, minor) is used. Megatron-LM main reports the next minor (0.20 at the snapshot the "main"
# patches were made from).
VERSION_LINES = {
    (0, 12): "core_v0.12",
    (0, 13): "core_v0.13",
    (0, 14): "core_v0.14",
    (0, 15): "core_v0.15",
    (0, 16): "core_v0.16",
    (0, 17): "core_v0.17",
    (0, 18): "core_v0.18",
    (0, 19): "core_v0.19",
    (0, 20): "main",
}

# --only name -> the patch file (same name in every version line) and the file it edits.
PARTS = {
    "pretrain": ("0001-pretrain_gpt-import-megatron_patches.patch", "pretrain_gpt.py"),
    "optimizer": ("0002-optimizer-hooks.patch", "megatron/core/optimizer/optimizer.py"),
}


class UsageError(Exception):
    """Bad input: exit status 2 with the message."""


@dataclass
class PatchState:
    part: str
    patch: Path
    target: str
    state: str  # "applied", "not applied" or "incompatible"
    detail: str = ""


def read_version(tree: Path) -> tuple[int, int, int, str]:
    """(major, minor, patch, pre_release) from megatron/core/package_info.py, without importing it."""
    info = tree / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise UsageError(
            f"{tree} has no megatron/core/package_info.py; --megatron must be the directory "
            "that holds megatron/ (a Megatron-LM checkout or an unpacked megatron-core)"
        )
    values = {}
    for node in ast.parse(info.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    try:
        return (int(values["MAJOR"]), int(values["MINOR"]), int(values["PATCH"]),
                str(values.get("PRE_RELEASE", "")))
    except KeyError as missing:
        raise UsageError(f"{info} does not set {missing.args[0]}") from None


def pick_line(version: tuple[int, int, int, str], forced: str | None) -> Path:
    available = sorted(p.name for p in PATCHES_DIR.iterdir() if p.is_dir())
    if forced is not None:
        if forced not in available:
            raise UsageError(f"--line {forced!r} does not exist; available: {', '.join(available)}")
        return PATCHES_DIR / forced
    line = VERSION_LINES.get(version[:2])
    if line is None:
        supported = ", ".join(f"{major}.{minor} ({name})" for (major, minor), name in VERSION_LINES.items())
        raise UsageError(
            f"megatron-core {format_version(version)} is not a supported version line; "
            f"supported: {supported}. Force one with --line NAME at your own risk."
        )
    return PATCHES_DIR / line


def format_version(version: tuple[int, int, int, str]) -> str:
    return f"{version[0]}.{version[1]}.{version[2]}{version[3]}"


def git_apply(tree: Path, *args: str) -> subprocess.CompletedProcess:
    """``git apply`` with paths relative to ``tree``, even when ``tree`` sits inside another repo.

    Inside a git work tree, ``git apply`` resolves paths from the top of that work tree and silently
    skips ("Skipped patch") files outside the current directory. Stopping the repository search
    at the tree's parent makes a vendored copy behave like a plain directory, while a checkout
    whose top is ``tree`` is still found.
    """
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return subprocess.run(
        ["git", "apply", *args], cwd=tree, env=env, capture_output=True, text=True, check=False
    )


def failed_hunk(patch: Path, stderr: str) -> str:
    """Names the hunk that did not match, from git's "patch failed: FILE:LINE"."""
    found = re.search(r"patch failed: (\S+):(\d+)", stderr)
    if not found:
        return stderr.strip().splitlines()[-1] if stderr.strip() else "no detail from git"
    path, line = found.group(1), found.group(2)
    for header in patch.read_text(encoding="utf-8").splitlines():
        if header.startswith(f"@@ -{line},"):
            return f"{path}: hunk {header}"
    return f"{path}: hunk at line {line}"


def inspect_part(tree: Path, line_dir: Path, part: str) -> PatchState:
    name, target = PARTS[part]
    patch = line_dir / name
    if not (tree / target).is_file():
        return PatchState(part, patch, target, "incompatible", f"{target} not found in {tree}")
    forward = git_apply(tree, "--check", "-v", str(patch))
    if forward.returncode == 0 and "Skipped patch" not in forward.stderr:
        return PatchState(part, patch, target, "not applied")
    reverse = git_apply(tree, "--check", "--reverse", "-v", str(patch))
    if reverse.returncode == 0 and "Skipped patch" not in reverse.stderr:
        return PatchState(part, patch, target, "applied")
    return PatchState(part, patch, target, "incompatible", failed_hunk(patch, forward.stderr))


def choose_parts(tree: Path, only: list[str] | None) -> list[str]:
    if only:
        return list(dict.fromkeys(only))
    if not (tree / PARTS["pretrain"][1]).is_file():
        raise UsageError(
            f"{tree} has no pretrain_gpt.py (a megatron-core package rather than a Megatron-LM "
            "checkout?); patch only the optimizer with --only optimizer"
        )
    return list(PARTS)


def run(command: str, tree: Path, only: list[str] | None, forced_line: str | None) -> int:
    if shutil.which("git") is None:
        raise UsageError("git not found on PATH; this script patches with `git apply`")
    tree = tree.resolve()
    version = read_version(tree)
    line_dir = pick_line(version, forced_line)
    parts = choose_parts(tree, only)
    print(f"megatron-core {format_version(version)} in {tree}: patches/{line_dir.name}")
    states = [inspect_part(tree, line_dir, part) for part in parts]
    for s in states:
        print(f"  {s.patch.name}: {s.state}" + (f" ({s.detail})" if s.detail else ""))

    broken = [s for s in states if s.state == "incompatible"]
    if broken:
        for s in broken:
            print(f"incompatible tree: {s.detail}", file=sys.stderr)
        print("nothing was changed", file=sys.stderr)
        return 2

    if command == "status":
        applied = sum(s.state == "applied" for s in states)
        print("patched" if applied == len(states) else "not patched" if applied == 0 else "partly patched")
        return 0 if applied == len(states) else 1

    wanted = "not applied" if command == "apply" else "applied"
    todo = [s for s in states if s.state == wanted]
    if not todo:
        print("already patched" if command == "apply" else "not patched: nothing to revert")
        return 0
    args = ["--reverse"] if command == "revert" else []
    result = git_apply(tree, *args, *(str(s.patch) for s in todo))
    if result.returncode != 0:
        # git apply is atomic: a failure here leaves every file as it was.
        print(f"git apply failed, nothing was changed:\n{result.stderr.strip()}", file=sys.stderr)
        return 2
    verb = "applied" if command == "apply" else "reverted"
    for s in todo:
        print(f"{verb} {s.patch.name} to {s.target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["apply", "revert", "status"])
    parser.add_argument("--megatron", required=True, type=Path, metavar="DIR",
                        help="Megatron-LM checkout, or a directory holding megatron/core")
    parser.add_argument("--only", action="append", choices=sorted(PARTS),
                        help="patch only this part (repeatable); default: all")
    parser.add_argument("--line", help="force a version line (a directory under patches/)")
    args = parser.parse_args(argv)
    try:
        return run(args.command, args.megatron, args.only, args.line)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
