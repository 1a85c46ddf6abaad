"""Which megatron-core releases megatron_patches supports, and which Python each one needs.

Standard library only: ``make install`` reads it (``python -m megatron_patches.versions``) before
anything else is installed, to refuse in one line a release the chosen Python cannot install.
"""

from __future__ import annotations

import re
import sys

PYTHON_MIN = (3, 11)
"""The oldest Python megatron_patches runs on (``enum.StrEnum``; setup.py's ``python_requires``)."""

SUPPORTED = ">=0.12,<0.21"
"""megatron-core 0.12.x to 0.19.x and Megatron-LM main (0.20.x). CI trains with 0.16.1 (the newest
release for Python 3.11) and 0.19.x (Python 3.12)."""

LINES = (
    # (first minor, last minor, minimum Python, what CI trains with); megatron-core 0.12-0.16 take
    # Python 3.10 too, megatron_patches does not (PYTHON_MIN).
    ((0, 12), (0, 16), PYTHON_MIN, "0.16.1"),
    ((0, 17), (0, 20), (3, 12), "0.19.x"),
)
"""The supported lines and the Python each needs with megatron_patches (0.17+ wheels need 3.12)."""

REFUSED = {
    (0, 8): ("MindSpeed's older branches use it, but it lacks what the guard wraps: no "
             "RerunStateMachine and no _ParamAndGradBucketGroup.check_grads (its NaN check is an "
             "assert in Bucket.start_grad_sync that ends the job before the guard sees the "
             "gradient); use 0.12.1 (MindSpeed's core_r0.12.1 branches, MindSpeed-LLM 2.2.0 and later)"),
}
"""Releases refused by name, with the reason (read off the core_v0.8.0 tag)."""


def _minor(version: str) -> tuple[int, int]:
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a megatron-core version: {version!r} (expected e.g. 0.19.2)")
    return int(match.group(1)), int(match.group(2))


def supported_lines() -> str:
    """``0.12-0.16 (Python >= 3.11), 0.17-0.20/main (Python >= 3.12)``: for error messages."""
    return ", ".join(
        f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}{'/main' if hi >= (0, 20) else ''} "
        f"(Python >= {py[0]}.{py[1]})" for lo, hi, py, _ in LINES)


def python_min() -> str:
    """``3.11``: :data:`PYTHON_MIN` as people write it."""
    return ".".join(map(str, PYTHON_MIN))


def refusal(version: str) -> str | None:
    """Why a release asked for by name is not supported, when it is one of :data:`REFUSED`."""
    why = REFUSED.get(_minor(version))
    return f"megatron-core {version} is not supported by megatron_patches: {why}" if why else None


def python_needed(version: str) -> tuple[int, int] | None:
    """The minimum Python for a megatron-core version; None when the version is not supported."""
    minor = _minor(version)
    for lo, hi, python, _ in LINES:
        if lo <= minor <= hi:
            return python
    return None


def problem(version: str, python: tuple[int, int] | None = None) -> str | None:
    """Why ``version`` cannot be used with ``python`` (this interpreter by default), or None."""
    python = python or tuple(sys.version_info[:2])
    needed = python_needed(version)
    if needed is None:
        return refusal(version) or (f"megatron-core {version} is not supported by megatron_patches; "
                f"supported: {supported_lines()}")
    if tuple(python) < needed:
        return (f"megatron-core {version} needs Python >= {needed[0]}.{needed[1]} and this is "
                f"Python {python[0]}.{python[1]}: make install PYTHON=python{needed[0]}.{needed[1]} "
                f"VENV=.venv{needed[0]}{needed[1]} MEGATRON_CORE={version}")
    return None


def requirement(version: str = "") -> str:
    """The pip requirement for megatron-core: the pinned ``version``, or the supported range."""
    return f"megatron-core=={version}" if version else f"megatron-core{SUPPORTED}"


if __name__ == "__main__":
    # python -m megatron_patches.versions [VERSION]: print the pip requirement, or exit 2 saying why not.
    wanted = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        reason = problem(wanted) if wanted else None
    except ValueError as exc:
        reason = str(exc)
    if reason:
        print(reason, file=sys.stderr)
        raise SystemExit(2)
    print(requirement(wanted))
