"""The ledger kept next to the checkpoints: what survives a restart of the job.

Blacklisted samples, the rollbacks done (against ``recovery.max_rollbacks``), the learning-rate
scale, the features switched off, the drills already rehearsed, a pending rollback request, the
events of the job's recoveries, each device's hardware-class incidents (against
``response.hardware_repeat``), the device fenced, and the rollback targets disqualified. One JSON file, written atomically by rank 0; a ledger that
cannot be applied (not JSON, wrong schema, a field of the wrong type) is refused with one line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Optional

from .errors import UserError
from .files import write_json_atomic

LEDGER_FILE = "megatron_patches_ledger.json"
LEDGER_SCHEMA = "megatron_patches.ledger/1"


@dataclass
class Ledger:
    """What survives restarts: blacklisted samples, rollbacks done, learning-rate scale."""

    blacklist: list = field(default_factory=list)
    rollbacks: int = 0
    lr_scale: float = 1.0
    disabled_features: list = field(default_factory=list)
    spent_injections: list = field(default_factory=list)
    """Drill specs that already fired: a restarted job does not inject them again."""
    rollback_requested: Optional[dict] = None
    """Set by the exit-and-restart path: {"from_step", "reason"}; cleared once resumed."""
    events: list = field(default_factory=list)
    hardware: list = field(default_factory=list)
    """Hardware-class incidents, one ``{"host", "device", "rank", "step"}`` per device they pointed at."""
    fenced: Optional[dict] = None
    """The device that reached ``response.hardware_repeat``: ``{"host", "device", "rank", "step", "incidents"}``."""
    disqualified: list = field(default_factory=list)
    """Rollback targets (steps) whose redo met the same fault again: never taken again, nor any newer."""

    @staticmethod
    def path(checkpoint_root: str) -> str:
        return os.path.join(checkpoint_root, LEDGER_FILE)

    @classmethod
    def load(cls, checkpoint_root: str) -> "Ledger":
        """The ledger under ``checkpoint_root`` (a fresh one when there is none). A ledger that is
        not JSON, or whose fields have the wrong type or range, raises UserError with one line
        naming the file, the field and the fix: it is never applied."""
        path = cls.path(checkpoint_root)
        if not os.path.exists(path):
            return cls()
        fix = "repair it, or move it away to start a fresh ledger (its blacklist and rollback count are lost)"
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or (str(exc).splitlines() or ["empty"])[0]
            raise UserError(f"ledger {path} cannot be read as JSON ({why}); {fix}") from None
        if not isinstance(data, dict) or data.get("schema") != LEDGER_SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise UserError(f"ledger {path} is not a megatron_patches ledger (schema {found!r}, "
                            f"expected {LEDGER_SCHEMA!r}); {fix}")
        data = dict(data)
        data.pop("schema")
        problem = _ledger_problem(data)
        if problem:
            raise UserError(f"ledger {path}: {problem}; {fix}")
        return cls(**data)

    def record_rollback(self, recovery: Any, samples: list) -> list:
        """One more rollback under ``recovery`` (the config section): blacklist ``samples``, lower
        the learning-rate scale (never under the floor), switch off the configured features
        (``disable_features``, and the lists of ``disable_on_further_rollbacks`` this rollback has
        reached). Returns the features switched off now for the first time."""
        new = self._switched_off_by_next(recovery)
        self.blacklist = sorted(set(self.blacklist) | set(samples))
        self.rollbacks += 1
        self.lr_scale = self._lr_scale_after_next(recovery)
        self.disabled_features += new
        return new

    def would_repeat(self, recovery: Any, step: int, samples: Iterable, skipped: Iterable = ()) -> bool:
        """Whether one more rollback, from ``step``, would redo the last one to no purpose: the last
        left from the same step (its redo met the anomaly there again), and this one would leave the
        learning-rate scale and the switched-off features as they are and leave out the same
        iterations (``skipped``), and change the data only if the last did not: blacklisting new
        ``samples`` is a change until a redo fed other samples and met the anomaly at the same step
        anyway (then the data is not its cause). Such a redo meets the anomaly again: a loop only
        the retry budget ends."""
        last = self.events[-1] if self.events else None
        if last is None or "rolled_back_to" not in last or last.get("step") != step:
            return False
        data_tried = bool(last.get("blacklisted")) or set(samples) <= set(self.blacklist)
        return (data_tried and self._lr_scale_after_next(recovery) == self.lr_scale
                and not self._switched_off_by_next(recovery)
                and sorted(skipped) == sorted(last.get("skip_iterations", [])))

    def count_hardware(self, devices: Iterable[Any], step: int, interval: int = 1) -> list[tuple[Any, int]]:
        """One hardware-class incident at ``step`` on each of ``devices``
        (:class:`~megatron_patches.cause.Device`); returns each with its count in the job so far. An
        incident on the checked step right after the device's last one (``interval``: the check
        interval) continues that fault and is not counted again."""
        counted = []
        for device in devices:
            mine = [e for e in self.hardware if (e["host"], e["device"]) == (device.host, device.device)]
            if not mine or not 0 < step - mine[-1]["step"] <= interval:
                self.hardware.append({"host": device.host, "device": device.device, "rank": device.rank, "step": step})
                mine.append(self.hardware[-1])
            counted.append((device, len(mine)))
        return counted

    def _lr_scale_after_next(self, recovery: Any) -> float:
        return max(self.lr_scale * recovery.lr_factor, recovery.lr_floor)

    def features_off_after_next(self, recovery: Any) -> list:
        """The features ``recovery`` wants off once the next rollback is made (``disable_features``
        and the stages of ``disable_on_further_rollbacks`` it reaches), in order, repeats kept."""
        stages = recovery.disable_on_further_rollbacks[:self.rollbacks]
        return list(recovery.disable_features) + [name for stage in stages for name in stage]

    def _switched_off_by_next(self, recovery: Any) -> list:
        """The features the next rollback switches off for the first time."""
        wanted = self.features_off_after_next(recovery)
        return [name for name in dict.fromkeys(wanted) if name not in self.disabled_features]

    def save(self, checkpoint_root: str) -> None:
        """Durable and atomic (:func:`~megatron_patches.files.write_json_atomic`): a crash or power loss
        leaves the previous ledger or the new one, never half of one."""
        os.makedirs(checkpoint_root, exist_ok=True)
        write_json_atomic(self.path(checkpoint_root), {"schema": LEDGER_SCHEMA, **asdict(self)}, indent=1)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _device_entry(value: Any, more: tuple = ()) -> bool:
    """Whether ``value`` is one device's entry: exactly host, device (strings), rank, step and ``more`` (integers >= 0)."""
    numbers = ("rank", "step") + more
    return (isinstance(value, dict) and set(value) == {"host", "device", *numbers}
            and isinstance(value["host"], str) and isinstance(value["device"], str)
            and all(_is_int(value[n]) and value[n] >= 0 for n in numbers))


def _ledger_problem(data: dict) -> Optional[str]:
    """What is wrong with a ledger's fields (schema already removed), or None."""
    known = {f.name for f in fields(Ledger)}
    unknown = sorted(set(data) - known)
    if unknown:
        return f"unknown field `{unknown[0]}` (valid: {', '.join(sorted(known))})"
    checks = {
        "blacklist": (lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
                      "a list of non-negative integers (sample indices)"),
        "rollbacks": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
        "lr_scale": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                     and 0 < v <= 1, "a finite number in (0, 1]"),
        "disabled_features": (lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
                              "a list of strings"),
        "spent_injections": (lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
                             "a list of strings"),
        "rollback_requested": (lambda v: v is None or isinstance(v, dict), "an object or null"),
        "events": (lambda v: isinstance(v, list) and all(isinstance(i, dict) for i in v), "a list of objects"),
        "hardware": (lambda v: isinstance(v, list) and all(_device_entry(i) for i in v),
                     'a list of {"host": string, "device": string, "rank": integer >= 0, "step": integer >= 0}'),
        "fenced": (lambda v: v is None or (_device_entry(v, ("incidents",)) and v["incidents"] >= 1),
                   'null or {"host", "device", "rank", "step", "incidents" >= 1}'),
        "disqualified": (lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
                         "a list of non-negative integers (checkpoint steps)"),
    }
    for name, value in data.items():
        ok, expected = checks[name]
        if not ok(value):
            return f"`{name}` must be {expected}, got {json.dumps(value)[:80]}"
    for name in ("events", "rollback_requested"):
        where = _non_finite(data.get(name), name)
        if where:
            return f"`{where[0]}` must be a finite number, got {where[1]}"
    return None


def _non_finite(value: Any, where: str) -> Optional[tuple[str, float]]:
    """(path, value) of the first NaN or infinite number inside ``value``, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}")
        if found:
            return found
    return None
