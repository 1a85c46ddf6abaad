"""Why an incident happened, not only where: its cause class, decided from the observations the
guard made of it (a pure function, tested with hand-made inputs and no process group).

The classes, and the response each asks for (:mod:`megatron_patches.recovery`):

* ``data``: the same batch reproduces the fault and nothing the ranks hold went bad: blacklist
  the samples the replay reproduced it with;
* ``hardware``: silent corruption on a device: a rank's weights or optimizer state went bad while
  every gradient applied to them was checked clean, the replicas disagree, or a replay of the step
  on the same rank from the same state and batch is clean: no sample is blacklisted, the held
  state is rolled back, the device is counted (``response.hardware_repeat`` of them in one job
  fence it);
* ``numerics``: the gradient norm grew across the checked steps before the fault (with a held value
  past 2^100 and finite, too): the learning-rate cut and safe mode of a rollback;
* ``software``: non-finite on every replica from the job's first checked step, reproduced by the
  replay on every micro-batch: a bug, which no rollback fixes: stop with the evidence;
* ``unknown``: none of these holds: the response as graded, samples blacklisted as configured.

:class:`Signs` is what rank 0 saw when it decided on the incident (it travels with the
:class:`~megatron_patches.decisions.Decision` to every rank); :func:`classify` adds the replay's
verdict where one ran. Nothing here imports torch or a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

CLASSES = ("data", "hardware", "numerics", "software", "unknown")
"""The cause classes a record's ``cause.class`` takes."""

GROWTH_STEPS = 4
"""Clean checked steps before a fault that a growth needs at least (:func:`growth_of`)."""
GROWTH_FACTOR = 4.0
"""How far the gradient norm must have risen over those steps (last over smallest) to be a growth."""
TRAIL = 8
"""Clean checked gradient norms the guard keeps for :func:`growth_of`."""


@dataclass(frozen=True)
class Device:
    """A device a cause points at: the rank on it, its host and device names as the records give them."""

    rank: int
    host: str
    device: str

    def key(self) -> str:
        return f"{self.host} {self.device}"


@dataclass(frozen=True)
class Signs:
    """What rank 0 observed of an incident when deciding on it: plain values, the same on every rank."""

    step: int
    first_checked: bool = False
    """No checked step of this job came out clean before this one (the fault is there from the start)."""
    held_ranks: tuple[int, ...] = ()
    """Ranks whose weights or optimizer state held NaN, Inf or a value beyond 2^100 (a corruption of
    what they hold, unless the gradients grew there: :attr:`held_extreme_only` with :attr:`growth`)."""
    held_extreme_only: bool = False
    """The held values went beyond 2^100 but stayed finite (no NaN or Inf): a bit flip of the top
    exponent bit leaves that, and so does a growth, which the gradient norm's trail tells apart."""
    off_ranks: tuple[int, ...] = ()
    """Ranks whose weights or optimizer state held a finite value far above the same tensor's at
    its previous check (the held-state check, ``detectors.state``): a lasting corruption."""
    altered_ranks: tuple[int, ...] = ()
    """Ranks whose state changed between two updates (the state audit): nothing but a fault does that."""
    fed_ranks: tuple[int, ...] = ()
    """Ranks that fed token ids outside the vocabulary (the data's doing)."""
    origin_ranks: tuple[int, ...] = ()
    origin_replicas: int = 0
    """Independent replicas the origin ranks are."""
    replicas: int = 1
    """Data-parallel replicas in the job."""
    replicas_disagree: bool = False
    """The consistency detector found replicas that should agree bit for bit differing."""
    checked_every_step: bool = True
    """Every update's gradients were checked (``check_interval`` 1): a held state that went bad did
    not get there through an applied gradient."""
    growth: tuple[str, ...] = ()
    """What grew across the checked steps before the fault (:func:`growth_of`), said in words."""
    suspects: tuple[Device, ...] = ()
    """The devices of the ranks the fault entered on, where that is one replica."""


@dataclass(frozen=True)
class Cause:
    """An incident's cause class with the observations that decided it (the record's ``cause``)."""

    klass: str
    evidence: tuple[str, ...]
    confidence: str
    """``high`` (an observation that admits one reading), ``medium`` (the likely reading), ``low``."""
    devices: tuple[Device, ...] = ()
    """hardware: the devices to count against ``response.hardware_repeat``."""

    def __post_init__(self) -> None:
        if self.klass not in CLASSES:
            raise ValueError(f"cause class must be one of {CLASSES}, got {self.klass!r}")

    def record(self) -> dict:
        out = {"class": self.klass, "evidence": list(self.evidence), "confidence": self.confidence}
        if self.devices:
            out["devices"] = [{"rank": d.rank, "host": d.host, "device": d.device} for d in self.devices]
        return out


def growth_of(trail: Sequence[float], fault_norm: Optional[float]) -> tuple[str, ...]:
    """The gradient norm's growth before a fault, in words, or nothing: over the last clean checked
    norms (``trail``, oldest first; at least :data:`GROWTH_STEPS`) the last stands
    :data:`GROWTH_FACTOR` times above the smallest and most steps rose; a finite ``fault_norm`` above
    the last continues it."""
    norms = [n for n in trail if n is not None and math.isfinite(n) and n > 0]
    if len(norms) < GROWTH_STEPS:
        return ()
    rises = sum(1 for a, b in zip(norms, norms[1:]) if b > a)
    smallest = min(norms)
    if norms[-1] < GROWTH_FACTOR * smallest or rises * 4 < (len(norms) - 1) * 3:
        return ()
    said = f"gradient norm rose {norms[-1] / smallest:.3g}x over the {len(norms)} clean checked steps before"
    if fault_norm is not None and math.isfinite(fault_norm) and fault_norm > norms[-1]:
        said += f", to {fault_norm:.4g} at the fault"
    return (said,)


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(set(ranks)))


def classify(signs: Signs, replay: Optional[dict] = None) -> Cause:
    """The cause of an incident from ``signs`` and the replay's verdict (``{"verdict":
    "deterministic"|"transient", "narrowed": bool}`` or None where no replay ran; ``narrowed``: the
    replay reproduced the fault on some of the step's micro-batches only). The first rule that holds
    decides, in the order of the module's list: a corrupt held state explains a deterministic replay
    (the state, not the batch, reproduces it), so it is asked first."""
    verdict = (replay or {}).get("verdict")
    narrowed = bool((replay or {}).get("narrowed"))
    suspects = signs.suspects
    if signs.altered_ranks:
        return Cause("hardware", (f"the state of rank(s) {_ranks(signs.altered_ranks)} changed between two updates "
                                  "with no update in between",), "high", suspects)
    if (signs.held_ranks or signs.off_ranks) and not signs.fed_ranks and not (signs.held_extreme_only and signs.growth):
        evidence = []
        if signs.held_ranks:
            what = "values beyond 2^100" if signs.held_extreme_only else "non-finite values"
            evidence.append(f"{what} in the weights or optimizer state held on rank(s) {_ranks(signs.held_ranks)}")
        if signs.off_ranks:
            evidence.append(f"values far above their previous check in the weights or optimizer state held on "
                            f"rank(s) {_ranks(signs.off_ranks)}")
        if signs.checked_every_step:
            evidence.append("every gradient applied to them was checked finite")
        if verdict == "deterministic":
            evidence.append("the replay reproduced the fault from that state, so the batch is not its cause")
        return Cause("hardware", tuple(evidence), "high" if signs.checked_every_step else "medium", suspects)
    if signs.fed_ranks:
        return Cause("data", (f"rank(s) {_ranks(signs.fed_ranks)} fed token ids outside the vocabulary",), "high")
    if signs.replicas_disagree:
        return Cause("hardware", ("replicas that should agree bit for bit differ",), "high", suspects)
    if signs.growth:
        evidence = list(signs.growth) + (["a held value grew beyond 2^100 and stayed finite"]
                                         if signs.held_extreme_only else [])
        if verdict == "transient":
            evidence.append("the replay was clean (the growth, not one step, led here)")
        return Cause("numerics", tuple(evidence), "high" if verdict != "transient" else "medium")
    if verdict == "transient":
        where = (f"on rank(s) {_ranks(signs.origin_ranks)}" if signs.origin_ranks else "on the same rank(s)")
        return Cause("hardware", (f"a replay of the step {where} from the same state and batch was clean",),
                     "medium", suspects)
    every_replica = signs.replicas <= 1 or signs.origin_replicas >= signs.replicas or not signs.origin_ranks
    if signs.first_checked and every_replica and verdict == "deterministic" and not narrowed:
        return Cause("software", ("non-finite on every replica from the job's first checked step",
                                  "the replay reproduced it on every micro-batch"), "medium")
    if verdict == "deterministic":
        evidence = ["the replay reproduced the fault from the same state and batch"]
        if narrowed:
            evidence.append("on some of the step's micro-batches only")
        if signs.replicas > 1 and signs.origin_replicas == 1:
            evidence.append(f"it entered on one replica (rank(s) {_ranks(signs.origin_ranks)})")
        return Cause("data", tuple(evidence), "high" if narrowed else "medium")
    if signs.first_checked and every_replica:
        return Cause("software", ("non-finite on every replica from the job's first checked step",
                                  "no replay ran"), "low")
    return Cause("unknown", ("no replay ran and no held state, growth or disagreement was seen",)
                 if verdict is None else ("nothing decided it",), "low")
