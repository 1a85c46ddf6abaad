"""Incident records: one JSON object per line in ``<report_dir>/incidents.jsonl``.

Schema ``megatron_patches.incident/1`` (documented in the README, read by ``megatron-patches
report``). Only global rank 0 writes, after the findings of every rank were gathered, so
each incident is one line. Lines are written whole and flushed, so a crash can at worst
leave a truncated last line, which readers skip with a message.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Optional

from .cause import Cause, Signs, classify
from .decisions import Decision, Severity

log = logging.getLogger("megatron_patches")

INCIDENT_SCHEMA = "megatron_patches.incident/1"
HISTORY_SCHEMA = "megatron_patches.grad_history/1"
INCIDENTS_FILE = "incidents.jsonl"
HISTORY_FILE = "grad_history.jsonl"

SEVERITIES = tuple(s.value for s in Severity)


def param_ranks(ranks: dict[str, int], info: Optional[Any]) -> dict[str, int]:
    """This process's ``ranks`` (:func:`~megatron_patches.naming.rank_info`) as they hold for one
    parameter (``info``: its :class:`~megatron_patches.naming.ParamInfo`): ``vpp`` is the virtual
    pipeline rank of the chunk the parameter is in, not the one being run right now."""
    return {**ranks, "vpp": info.chunk} if info is not None else ranks


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
    expert: Optional[dict] = None
    """``{"global": G, "local": K}`` for a routed expert's parameter (mixture-of-experts); None
    (left out of the record) for every other parameter."""
    full_shape: Optional[list[int]] = None
    """The whole weight's shape where ``shape`` is this rank's tensor-parallel (or expert-TP) slice
    of it; None (left out of the record) for a weight held whole."""

    @classmethod
    def located(cls, info: Any, ranks: dict[str, int], **fields: Any) -> "ParamFinding":
        """A finding on the parameter ``info`` describes (a :class:`~megatron_patches.naming.ParamInfo`,
        None when the parameter is unnamed) held by the rank of ``ranks``: name, layer, order,
        expert and the ranks as they hold for it come from ``info``; ``fields`` give the rest."""
        if info is None:
            return cls(name=f"<unnamed {tuple(fields['shape'])}>", layer=None, order=-1, ranks=ranks, **fields)
        expert = {"global": info.expert[0], "local": info.expert[1]} if info.expert is not None else None
        full = list(info.full_shape) if info.full_shape is not None else None
        return cls(name=info.name, layer=info.layer, order=info.order, ranks=param_ranks(ranks, info),
                   expert=expert, full_shape=full, **fields)

    def as_record(self) -> dict:
        """The finding as the record holds it (``expert`` and ``full_shape`` only where there is one)."""
        out = asdict(self)
        for optional in ("expert", "full_shape"):
            if out[optional] is None:
                del out[optional]
        return out


SHARED_REASONS = frozenset({"peer_ratio", "share", "zscore_layer", "drift_layer", "zscore_total", "drift_total",
                            "magnitude_total"})
"""Reasons judged on world-wide sums (a layer, the model, a tensor against its peers in the other
layers): every rank holding a piece of the tensor gets them alike, so they say nothing of which
rank the fault is on."""


def first_key(order: int, rank: int, reasons: Iterable[str] = ()) -> tuple[int, bool, int]:
    """Where a finding of forward ``order`` on global ``rank`` with ``reasons`` stands in the rule of
    :func:`first_of` (smaller first); a record's dicts are ordered with it too
    (:mod:`~megatron_patches.incident_text`)."""
    reasons = set(reasons)
    return (-order, bool(reasons) and reasons <= SHARED_REASONS, rank)


def nearest_first(findings: Iterable[ParamFinding]) -> list[ParamFinding]:
    """``findings`` in the order of :func:`first_of`: the first parameter leads; of its pieces on
    several ranks, one found by what its own rank read comes before those found by world-wide sums."""
    return sorted(findings, key=lambda f: first_key(f.order, f.ranks.get("global", 0), f.reasons))


def first_of(findings: Iterable[ParamFinding]) -> Optional[ParamFinding]:
    """The one rule for an incident's "first parameter": the finding nearest the output (the
    largest forward ``order``), where backward met the fault first. A tie (the same parameter
    found on several ranks: tensor-parallel shards, data-parallel replicas; unnamed parameters,
    which all have order -1) goes to a finding with a reason of its own rank's (not only
    :data:`SHARED_REASONS`), then to the lowest global rank, then to the finding listed first.
    The record's ``first`` and the order of its ``params``, the message, the replay's verdict and
    :attr:`Incident.first_name` all take it from here."""
    ordered = nearest_first(findings)
    return ordered[0] if ordered else None


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
    first: Optional[ParamFinding] = None,
    time: Optional[str] = None,
    **extra: Any,
) -> dict[str, Any]:
    """Assemble one incident record; ``params`` are ordered nearest-the-output first.
    ``first``: where the fault entered when that is known apart from ``params`` (a rank's own
    gradient before the data-parallel reduction); default the first of ``params``. ``time``:
    when it happened (default now)."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    as_dicts = [p.as_record() for p in nearest_first(params)]
    record = {
        "schema": INCIDENT_SCHEMA,
        "time": time or now_iso(),
        "step": step,
        "severity": str(severity),
        "kind": kind,
        "kinds": kinds,
        "action": str(action),
        "message": message,
        "first": first.as_record() if first is not None else as_dicts[0] if as_dicts else None,
        "params": as_dicts,
        "ranks_affected": sorted(set(ranks_affected)),
        "world": world,
    }
    record.update(extra)
    return record


IN_MEMORY = "in-memory snapshot"
"""An in-process rollback's target (the record's ``checkpoint``): a snapshot in host memory."""


@dataclass(frozen=True)
class Outcome:
    """What the recovery executor made of an incident, merged into its record when published."""

    replay: Optional[dict] = None
    """The replay's verdict (deterministic or transient), when the step was replayed."""
    blacklisted: tuple = ()
    forward_origin: Optional[dict] = None
    """Where the replayed forward pass first went non-finite (:mod:`~megatron_patches.forward_origin`)."""
    backward_origin: Optional[dict] = None
    """Where the replayed backward pass first carried a non-finite gradient, when the forward
    pass stayed finite (a fault born in backward)."""
    rolled_back_to: Optional[int] = None
    checkpoint: Optional[str] = None
    """The checkpoint directory rolled back to, or :data:`IN_MEMORY` for an in-memory snapshot."""
    lr_scale: Optional[float] = None
    iterations_skipped: tuple = ()
    """Iterations the redo after an in-process rollback left out (their samples blacklisted)."""
    certified_at: Optional[int] = None
    """The step whose clean check made the in-memory target a rollback target."""
    decision: Optional[Decision] = None
    """Set when the executor had to change the decision (no healthy checkpoint: a critical stop)."""
    cause: Optional[Cause] = None
    """The incident's cause as the executor classed it, with the replay's verdict (:mod:`~megatron_patches.cause`)."""

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"replay": self.replay, "blacklisted": list(self.blacklisted)}
        if self.cause is not None:
            out["cause"] = self.cause.record()
        for name in ("rolled_back_to", "checkpoint", "certified_at", "lr_scale", "forward_origin", "backward_origin"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.iterations_skipped:
            out["iterations_skipped"] = list(self.iterations_skipped)
        if self.decision is not None:
            out.update(severity=str(self.decision.severity), action=str(self.decision.action),
                       reason=self.decision.reason)
        return out


def _narrow_to_traced(record: dict, forward: Optional[dict]) -> None:
    """Tensor- and pipeline-parallel peers exchange activations within the step, so a fault that
    entered on one of them leaves every peer's own gradients non-finite: all are ``origin_ranks``.
    The replay's forward trace sees further: where only some of them produced the first non-finite
    output, the fault entered there. ``origin_ranks`` becomes those ranks (the earlier set is kept
    as ``origin_ranks_before_trace``) and the message says so."""
    traced, origins = (forward or {}).get("ranks"), record.get("origin_ranks")
    if traced and origins and set(traced) < set(origins):
        record["origin_ranks_before_trace"], record["origin_ranks"] = origins, sorted(traced)
        record["message"] += (f"; the replayed forward pass went non-finite first on rank(s) {sorted(traced)} "
                              f"({forward.get('module')}): the fault entered there")


@dataclass(frozen=True)
class Incident:
    """One incident as rank 0 assembled it from every rank's findings: a value, never changed.
    The JSON record is made from it once, when it is published (:meth:`record`)."""

    step: int
    decision: Decision
    kind: str
    kinds: tuple
    message: str
    params: tuple
    """Every rank's :class:`ParamFinding` after the reduction."""
    first: Optional[ParamFinding]
    ranks_affected: tuple
    world: Mapping[str, int]
    total_norm: Optional[float]
    batch: Optional[Mapping[str, Any]] = None
    """Batch fields of the step (``samples``: every rank's dataset indices)."""
    injected: Optional[tuple] = None
    origin_ranks: Optional[tuple] = None
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Fields the detectors and the locate stage add (pre_reduction, replicas_reached, ...)."""
    scene: Optional[str] = None
    """The directory of the step's fault scenes, when they were captured."""
    ledger: Optional[str] = None
    """The recovery ledger a rollback exit wrote, where the restart records its outcome
    (``megatron-patches report`` reads it from there)."""
    time: str = field(default_factory=now_iso)

    @property
    def first_name(self) -> Optional[str]:
        """The parameter named first in the record (``record["first"]["name"]``)."""
        first = self.first if self.first is not None else first_of(self.params)
        return first.name if first is not None else None

    def record(self, outcome: Optional[Outcome] = None) -> dict[str, Any]:
        """The JSON record (schema ``megatron_patches.incident/1``), a new dict on every call."""
        record = make_record(
            step=self.step, severity=self.decision.severity, kind=self.kind, kinds=list(self.kinds),
            action=self.decision.action, message=self.message, params=list(self.params), first=self.first,
            ranks_affected=list(self.ranks_affected), world=dict(self.world), time=self.time,
            total_norm=self.total_norm, **self._optional(), reason=self.decision.reason,
            **copy.deepcopy(dict(self.extra)))
        # Without the executor's outcome (no replay ran) the cause is what the signs alone say.
        record["cause"] = classify(self.decision.signs or Signs(step=self.step)).record()
        if self.scene is not None:
            record["scene"] = self.scene
        if self.ledger is not None:
            record["ledger"] = self.ledger
        if outcome is not None:
            record.update(outcome.fields())
            _narrow_to_traced(record, outcome.forward_origin)
        return record

    def _optional(self) -> dict[str, Any]:
        """batch, injected and origin_ranks, where known (a guard_error record has none)."""
        out: dict[str, Any] = {}
        if self.batch is not None:
            out["batch"] = copy.deepcopy(dict(self.batch))
        if self.injected is not None:
            out["injected"] = copy.deepcopy(list(self.injected))
        if self.origin_ranks is not None:
            out["origin_ranks"] = list(self.origin_ranks)
        return out


class JsonlWriter:
    """Appends JSON lines to one file; each line is written in one call and flushed.

    A write that fails (disk full, read-only or vanished directory, no permission) never
    raises: the record is counted in ``lost_writes`` and a warning names the path and the
    error, the first time and then at most once per ``warn_every`` losses or
    ``warn_interval_s`` seconds, whichever comes first. ``strict=True`` raises the OSError
    instead (for callers that report failures themselves, such as the alert sink)."""

    def __init__(self, path: str, fsync: bool = True, *, strict: bool = False,
                 warn_every: int = 100, warn_interval_s: float = 60.0):
        self.path = path
        self.lost_writes = 0
        """Records not written because the file system refused them."""
        self._fsync = fsync
        self._strict = strict
        self._warn_every = warn_every
        self._warn_interval_s = warn_interval_s
        self._warned_at: Optional[tuple[int, float]] = None  # (lost_writes, monotonic time) of the last warning
        self._dir_ready = False
        self._lock = threading.Lock()

    def write(self, obj: dict[str, Any]) -> bool:
        """Append ``obj``; True when it reached the file (False: counted and warned about)."""
        try:
            line = json.dumps(obj, separators=(",", ":"), allow_nan=False, default=_jsonable) + "\n"
        except ValueError:  # a NaN or Inf slipped into the record: JSON has null for it
            line = json.dumps(finite_json(obj), separators=(",", ":"), allow_nan=False, default=_jsonable) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            start = None
            try:
                if not self._dir_ready:
                    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                    self._dir_ready = True
                with open(self.path, "ab") as handle:
                    start = handle.seek(0, os.SEEK_END)
                    handle.write(data)
                    handle.flush()
                    if self._fsync:
                        os.fsync(handle.fileno())
                return True
            except OSError as exc:
                self._dir_ready = False  # the directory may have been removed: make it again next time
                if start is not None:
                    _cut(self.path, start)
                if self._strict:
                    raise
                self._lost(exc)
                return False

    def _lost(self, exc: OSError) -> None:
        self.lost_writes += 1
        now = time.monotonic()
        if self._warned_at is not None:
            count, when = self._warned_at
            if self.lost_writes - count < self._warn_every and now - when < self._warn_interval_s:
                return
        self._warned_at = (self.lost_writes, now)
        log.warning("cannot write to %s (%s); %d record(s) lost so far, training goes on "
                    "(free space or fix report_dir; warned again after %d more or %.0f s)",
                    self.path, exc, self.lost_writes, self._warn_every, self._warn_interval_s)


def _cut(path: str, size: int) -> None:
    """Drop a partly written line (e.g. the disk filled mid-line), so the next line starts clean."""
    try:
        os.truncate(path, size)
    except OSError:
        pass


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def finite_json(value: Any) -> Any:
    """``value`` with every NaN and infinite float replaced by None (null), recursively."""
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def finite_or_none(x: float) -> Optional[float]:
    """JSON has no NaN/Inf: non-finite numbers are written as null."""
    return x if x == x and x not in (float("inf"), float("-inf")) else None
