"""Incident records: one JSON object per line in ``<report_dir>/incidents.jsonl``.

Schema ``megatron_patches.incident/1`` (documented in the README, read by ``megatron-patches
report``). Only global rank 0 writes, after the findings of every rank were gathered, so
each incident is one line. Lines are written whole and flushed, so a crash can at worst
leave a truncated last line, which readers skip with a message.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

INCIDENT_SCHEMA = "megatron_patches.incident/1"
HISTORY_SCHEMA = "megatron_patches.grad_history/1"
INCIDENTS_FILE = "incidents.jsonl"
HISTORY_FILE = "grad_history.jsonl"

SEVERITIES = ("warning", "error", "critical")


@dataclass
class ParamFinding:
    """One parameter that looked wrong on one rank."""

    name: str
    """Global name as in a non-pipelined ``model.named_parameters()``, without wrapper prefixes."""
    layer: Optional[int]
    """0-based global transformer layer index, or None for embeddings/output/final norm."""
    shape: list[int]
    nan: int
    inf: int
    overflow: int
    """Elements at or beyond finfo.max (saturation mode); 0 in ieee mode."""
    norm: Optional[float]
    """L2 norm of this rank's piece of the gradient; None when not finite."""
    ranks: dict[str, int]
    """{"global", "tp", "pp", "dp", "cp", "ep", "vpp"} of the rank holding it."""
    host: str
    device: str
    order: int
    """Position in forward order over the whole model; the largest is nearest the output."""
    shard: bool = False
    """True when this rank holds only a slice (distributed optimizer)."""
    reasons: list[str] = field(default_factory=list)
    """Which checks this parameter tripped (nan, inf, overflow, magnitude, ...)."""


def now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def make_record(
    *,
    step: int,
    severity: str,
    kind: str,
    kinds: list[str],
    action: str,
    message: str,
    params: list[ParamFinding],
    ranks_affected: list[int],
    world: dict[str, int],
    **extra: Any,
) -> dict[str, Any]:
    """Assemble one incident record; ``params`` are ordered nearest-the-output first."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    ordered = sorted(params, key=lambda p: (-p.order, p.ranks.get("global", 0)))
    as_dicts = [asdict(p) for p in ordered]
    record = {
        "schema": INCIDENT_SCHEMA,
        "time": now_iso(),
        "step": step,
        "severity": severity,
        "kind": kind,
        "kinds": kinds,
        "action": action,
        "message": message,
        "first": as_dicts[0] if as_dicts else None,
        "params": as_dicts,
        "ranks_affected": sorted(set(ranks_affected)),
        "world": world,
    }
    record.update(extra)
    return record


class JsonlWriter:
    """Appends JSON lines to one file; each line is written in one call and flushed."""

    def __init__(self, path: str, fsync: bool = True):
        self.path = path
        self._fsync = fsync
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_jsonable) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            if self._fsync:
                os.fsync(handle.fileno())


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def finite_or_none(x: float) -> Optional[float]:
    """JSON has no NaN/Inf: non-finite numbers are written as null."""
    return x if x == x and x not in (float("inf"), float("-inf")) else None
