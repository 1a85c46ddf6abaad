"""The publish stage: everything the guard hands out of the process, written once.

Rank 0 writes each incident's record (``incidents.jsonl``) and the gradient history
(``grad_history.jsonl``, rotated to ``.1`` past ``grad_history_max_lines``); every rank queues its
fault scene for the scene thread; error and critical records go to the alert sinks. An
incident waiting for its replay's verdict is held (:meth:`Publisher.hold`) and published with
the executor's :class:`~megatron_patches.incidents.Outcome` (:meth:`Publisher.resolve`), or
as it stands when the process ends (:meth:`Publisher.close`).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Optional

from .naming import slot_names
from .incidents import HISTORY_FILE, HISTORY_SCHEMA, INCIDENTS_FILE, Incident, JsonlWriter, Outcome, finite_or_none
from .decisions import Severity
from .protocols import Seams

log = logging.getLogger("megatron_patches")


class Publisher:
    """Owns the guard's output files, scene writer and alert dispatcher (made on first use)."""

    def __init__(self, config: Any, report_dir: str, seams: Seams):
        """``seams``: Megatron's side, for the job's layout and megatron-core's version in a scene's
        ``environment.json``."""
        self.config = config
        self.report_dir = report_dir
        self.seams = seams
        self.incidents: Optional[JsonlWriter] = None
        self.history: Optional[JsonlWriter] = None
        self.scenes = None
        """The :class:`~megatron_patches.scene.SceneWriter`, once a scene was queued."""
        self._alerts = None
        self._history_lines = 0
        self._held: Optional[tuple[Incident, Optional[tuple]]] = None

    def writers(self) -> list[JsonlWriter]:
        """The record files opened so far (their ``lost_writes`` count what the disk refused)."""
        return [w for w in (self.incidents, self.history) if w is not None]

    # --- incidents -------------------------------------------------------------------------

    def publish(self, incident: Optional[Incident], scene: Optional[tuple] = None,
                outcome: Optional[Outcome] = None) -> None:
        """Rank 0: the record, made once from ``incident`` and ``outcome``, to its file, with
        ``scene`` (this rank's captured one) and to the alert sinks."""
        if incident is None:  # nothing could be assembled: nothing to hand on
            return
        record = incident.record(outcome)
        if scene is not None:
            self.submit_scene(scene, record)
        self.write_incident(record)
        if Severity(record["severity"]).at_least(Severity.ERROR):
            if self._alerts is None:
                from .alerts import AlertDispatcher

                self._alerts = AlertDispatcher(self.config.alerts, self.report_dir)
            self._alerts.submit(record)

    def hand_off(self, incident: Optional[Incident], captured: Optional[tuple], wait_for_outcome: bool,
                 rank: int) -> None:
        """An incident just decided, on every rank: rank 0 publishes it (or holds it for the
        executor's outcome when ``wait_for_outcome``); the others queue their scenes alone."""
        if rank != 0:
            if captured is not None:
                self.submit_scene(captured, None)
        elif wait_for_outcome:
            self.hold(incident, captured)
        else:
            self.publish(incident, captured)

    def hold(self, incident: Optional[Incident], scene: Optional[tuple]) -> None:
        """Keep ``incident`` until the executor's outcome is known (a replay runs first)."""
        self._held = (incident, scene) if incident is not None else None

    def resolve(self, outcome: Optional[Outcome]) -> None:
        """Publish the held incident with ``outcome`` (no-op when none is held)."""
        held, self._held = self._held, None
        if held is not None:
            self.publish(*held, outcome=outcome)

    def write_incident(self, record: dict) -> None:
        if self.incidents is None:
            self.incidents = JsonlWriter(os.path.join(self.report_dir, INCIDENTS_FILE))
        self.incidents.write(record)

    # --- scenes ----------------------------------------------------------------------------

    def submit_scene(self, captured: tuple, record: Optional[dict]) -> None:
        """Queue a captured scene; rank 0 adds the environment and the complete ``record``."""
        from . import naming, scene

        if self.scenes is None:
            self.scenes = scene.SceneWriter(self.config.scene.queue_size, self.config.scene.max_bytes)
        path, payload = captured
        files = {}
        if record is not None:
            environment = scene.environment(self.seams.megatron_core_version())
            files = {"environment.json": {**environment, "world": naming.world_layout(self.seams.parallel_state())},
                     "incident.json": record}
        self.scenes.submit(path, payload, files)  # the writer deep-copies what it is given

    # --- history ---------------------------------------------------------------------------

    def write_history(self, step: int, total_norm: float, layer_sq: list[float]) -> None:
        """Rank 0: one line of world-wide norms; the file is rotated past its line limit."""
        if not self.config.grad_history:
            return
        if self.history is None:
            self.history = JsonlWriter(os.path.join(self.report_dir, HISTORY_FILE), fsync=False)
        if self._history_lines >= self.config.grad_history_max_lines:
            try:
                os.replace(self.history.path, self.history.path + ".1")
            except OSError as exc:  # a failing disk must not stop training: keep appending
                log.warning("cannot rotate %s (%s); it keeps growing", self.history.path, exc)
            self._history_lines = 0
        written = self.history.write({
            "schema": HISTORY_SCHEMA, "step": step, "total_norm": finite_or_none(total_norm),
            "layers": {n: finite_or_none(math.sqrt(v)) if v >= 0 else None
                       for n, v in zip(slot_names(len(layer_sq)), layer_sq)},
        })
        self._history_lines += int(written)

    def close(self) -> None:
        """Write what is queued: the held incident as it stands, scenes, alerts."""
        self.resolve(None)
        if self.scenes is not None:
            self.scenes.close()
            self.scenes = None
        if self._alerts is not None:
            self._alerts.close()
            self._alerts = None
