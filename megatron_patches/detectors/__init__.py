"""Pluggable detectors that ride on the monitor's one collective per checked step.

The monitor always runs the NaN/Inf, saturation and magnitude checks. A :class:`Detector`
adds its own numbers to the same all-reduced vector (``width`` floats, summed over the whole
job), decides from the reduced values, which are identical on every rank, and names
suspects on the slow path. Detectors keep bounded state that checkpoints carry.

Where collectives go: ``local`` may run device collectives of its own that every rank joins
on every check (the consistency check's MAX over each data-parallel group); ``verdict`` reads
the reduced values only; ``suspects`` is the slow path that every rank of a flagged step
runs, so exchanges that name suspects (gathering objects) belong there. ``extra`` runs on
rank 0 alone and must not communicate.
"""

from __future__ import annotations

from typing import Any, Callable

from .activations import ActivationRange
from .audit import StateAudit
from .base import CheckContext, Detector, Rotation
from .consistency import ConsistencyDetector
from .history import HistoryDetector
from .loss import LossSpike
from .peak import PeakDetector
from .peers import PeersDetector
from .state import HeldStateCheck
from .tokens import TokenRange

__all__ = ["CheckContext", "Detector", "Rotation", "build", "target_taken"]


def target_taken(detectors: list) -> None:
    """The loop took a rollback target of this rank's state (a snapshot, a checkpoint): the
    detectors that read the held state read all of it at the next check, which certifies it
    (``detectors``: the guard's, ``monitor.state.detectors``)."""
    for detector in detectors:
        detector.target_taken()


def build(config: Any, parallel_state: Callable[[], Any], step_of: Callable[[], int] = lambda: 0,
          checked: Callable[[int], bool] = lambda step: True) -> list:
    """The detectors ``config`` switches on, in a fixed order (the vector layout depends on it).
    ``parallel_state``: where they read the job's layout (``Seams.parallel_state``); ``step_of``:
    the step being made now and ``checked`` whether a step is checked (for those that watch the
    forward pass)."""
    settings = config.detectors
    detectors: list = []
    if settings.history.enabled:
        detectors.append(HistoryDetector(settings.history))
    if settings.consistency.enabled:
        detectors.append(ConsistencyDetector(settings.consistency, parallel_state))
    if settings.peers.enabled:
        detectors.append(PeersDetector(settings.peers, parallel_state))
    if settings.audit.enabled:
        detectors.append(StateAudit(settings.audit))
    if settings.state.enabled:
        detectors.append(HeldStateCheck(settings.state))
    if settings.peak.enabled:
        detectors.append(PeakDetector(settings.peak))
    if settings.activations.enabled:
        detectors.append(ActivationRange(settings.activations, step_of, checked))
    if settings.tokens.enabled:
        detectors.append(TokenRange(settings.tokens, step_of))
    if settings.loss_spike.enabled:
        detectors.append(LossSpike(settings.loss_spike))
    return detectors
