"""In-memory snapshots: each rank's own state copied to host memory every few iterations, kept as
rollback targets once certified.

A snapshot holds copies of this rank's tensors (the model's parameters, the optimizer's main
weights and state) and the small values beside them (scheduler, RNG, loss scaler, the guard's
baselines), as the loop integration hands them over (:class:`SnapshotStore.take`). On a GPU the
copies go to pinned host buffers on a side stream; the host waits for them only when the snapshot
is used or replaced, and the GPU's own stream waits for them (no host sync) before the next
iteration writes those tensors (:meth:`SnapshotStore.fence`); on a CPU they are plain copies.

A snapshot becomes a rollback *target* only once ``certify_steps`` further checked steps came out
clean, and a flagged check before that drops every snapshot still waiting
(:meth:`SnapshotStore.note_check`): the certification every rollback target goes through
(:mod:`megatron_patches.certify`). Every rank sees the same verdicts, so every rank certifies and
drops the same snapshots; a rank that could not take one (memory) is found at the rollback, where
the ranks agree on the newest target they all hold (:func:`common_newest`, :func:`agreed_newest`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import collectives
from .callbacks import Callback
from .certify import Certifier
from .detectors import target_taken

log = logging.getLogger("megatron_patches")


@dataclass
class Snapshot:
    """One rank's state after ``step``."""

    step: int
    tensors: list
    """Host copies, in the order of the live tensors they were taken from."""
    values: dict
    """Everything else, already copied (scheduler, RNG, loss scaler, data position, guard state)."""
    nbytes: int
    certified_at: Optional[int] = None
    """The step whose clean check certified it (None while it waits)."""
    _ready: Any = field(default=None, repr=False)
    """A CUDA event recorded after the copies (None on a CPU: already done)."""

    def wait(self) -> None:
        """Block until the copies are complete (only needed on a GPU)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None


class SnapshotStore(Callback):
    """The snapshots of one run on one rank: taken every ``interval`` steps, the newest ``kept``
    held, certified after ``certify_steps`` clean checked steps (as a callback of the monitor, or
    told each verdict by its owner: :meth:`note_check`)."""

    def __init__(self, interval: int, kept: int, certify_steps: int):
        self.interval = interval
        self.kept = kept
        self.certify_steps = certify_steps
        self.certifier = Certifier(certify_steps)
        """The snapshots still waiting for their clean checks."""
        self.snapshots: list[Snapshot] = []
        """Oldest first; certified ones and at most the newest few still waiting."""
        self.skipped = 0
        """Snapshots not taken (memory), each said in one warning."""
        self.copy_ns = 0
        """Host time spent inside :meth:`take`: the copies on a CPU; on a GPU what blocks the loop
        (waiting for a recycled buffer, pinned buffers allocated the first time, the copies queued)."""
        self.taken = 0
        self._stream: Any = None
        self._unfenced: Any = None
        """The event of copies the training stream has not been told to wait for yet."""

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def take(self, step: int, live: list, values: dict) -> Optional[Snapshot]:
        """Copy ``live`` (tensors) and keep ``values`` (already copies) as the state after ``step``.
        Buffers of the oldest snapshot are reused when it is the one to go. A copy that fails for
        memory is skipped with one warning; the run goes on."""
        started = time.perf_counter_ns()
        recycled = self._evict() if len(self.snapshots) >= self.kept else None
        try:
            snapshot = self._copy(step, live, values, recycled)
        except (RuntimeError, MemoryError) as error:  # torch's out-of-memory is a RuntimeError
            self.skipped += 1
            log.warning("in-memory snapshot of step %d not taken (%s); the rollback targets stay the older ones",
                        step, str(error).splitlines()[0] if str(error) else type(error).__name__)
            return None
        finally:
            self.copy_ns += time.perf_counter_ns() - started
        self.snapshots.append(snapshot)
        self.certifier.add(step, snapshot)
        self.taken += 1
        return snapshot

    def cost_line(self, iterations: int, rank: int) -> str:
        """The time spent inside the snapshot copies per snapshot and per iteration (of ``iterations``
        seen), and one snapshot's size: measured in the process, so other load on the machine
        cannot swamp it as it does a comparison of whole runs."""
        ms = self.copy_ns / 1e6
        size = self.snapshots[-1].nbytes / 2**20 if self.snapshots else 0.0
        return (f"in-memory snapshots: {self.taken} taken in {iterations} iterations, {ms / max(self.taken, 1):.3f} ms "
                f"inside the copy per snapshot, {ms / max(iterations, 1):.4f} ms per iteration, {size:.3f} MiB per "
                f"snapshot on rank {rank}")

    def _evict(self) -> Snapshot:
        """The snapshot to give up for a new one: the oldest, unless it is the newest certified
        target (then the oldest of those still waiting after it), so that a target always remains."""
        certified = [s for s in self.snapshots if s.certified_at is not None]
        keep = certified[-1] if certified else None
        victim = next(s for s in self.snapshots if s is not keep) if len(self.snapshots) > 1 else self.snapshots[0]
        self.snapshots.remove(victim)
        self.certifier.discard(victim)
        return victim

    def _copy(self, step: int, live: list, values: dict, recycled: Optional[Snapshot]) -> Snapshot:
        reuse = recycled is not None and len(recycled.tensors) == len(live) and all(
            a.shape == b.shape and a.dtype == b.dtype for a, b in zip(recycled.tensors, live))
        if reuse:
            recycled.wait()
        on_gpu = any(t.is_cuda for t in live)
        if not on_gpu:
            copies = [dst.copy_(src.detach()) for dst, src in zip(recycled.tensors, live)] if reuse \
                else [src.detach().clone() for src in live]
            return Snapshot(step, copies, values, sum(c.numel() * c.element_size() for c in copies))
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            copies = recycled.tensors if reuse else [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) for t in live]
            for dst, src in zip(copies, live):
                dst.copy_(src.detach(), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        self._unfenced = ready
        return Snapshot(step, copies, values, sum(c.numel() * c.element_size() for c in copies), _ready=ready)

    def fence(self) -> None:
        """Before the next iteration may write the tensors a snapshot is still copying: the
        current stream waits for the copies on the device; the host goes on."""
        if self._unfenced is not None:
            torch.cuda.current_stream().wait_event(self._unfenced)
            self._unfenced = None

    def note_check(self, step: int, flagged: bool) -> None:
        """A checked step's verdict (the same on every rank): certify, or drop those still waiting."""
        certified, dropped = self.certifier.note_check(step, flagged)
        for snapshot in certified:
            snapshot.certified_at = step
        self.snapshots = [s for s in self.snapshots if not any(s is gone for gone in dropped)]

    def after_check(self, step: int, flagged: bool) -> None:
        self.note_check(step, flagged)

    def certified(self) -> list[int]:
        """Steps of the certified snapshots held, oldest first."""
        return [s.step for s in self.snapshots if s.certified_at is not None]

    def get(self, step: int) -> Snapshot:
        snapshot = next(s for s in self.snapshots if s.step == step)
        snapshot.wait()
        return snapshot

    def drop_after(self, step: int) -> None:
        """After a rollback to ``step``: the snapshots of the abandoned future are gone."""
        for snapshot in [s for s in self.snapshots if s.step > step]:
            self.snapshots.remove(snapshot)
            self.certifier.discard(snapshot)

    def bytes_held(self) -> int:
        return sum(s.nbytes for s in self.snapshots)


def restore(snapshot: Snapshot, live: list) -> None:
    """Copy ``snapshot``'s tensors back into ``live`` (the same tensors, in the same order, that
    it was taken from), in place: every view of them (DDP's buffers) sees the restored values."""
    if len(live) != len(snapshot.tensors):
        raise RuntimeError(f"snapshot of step {snapshot.step} holds {len(snapshot.tensors)} tensors, "
                           f"the run has {len(live)} now")
    snapshot.wait()
    with torch.no_grad():
        for dst, src in zip(live, snapshot.tensors):
            dst.copy_(src, non_blocking=False)


def common_newest(held: list[list[int]]) -> Optional[int]:
    """The newest step every rank holds a certified snapshot of (``held``: each rank's steps)."""
    common = set(held[0]) if held else set()
    for steps in held[1:]:
        common &= set(steps)
    return max(common) if common else None


def agreed_newest(store: SnapshotStore, peers: Any, below: Optional[int] = None) -> Optional[int]:
    """Every rank: the newest step all ranks hold a certified snapshot of (older than ``below`` when
    given), or None. Collective over the guard's bounded group ``peers``: every rank calls it."""
    held = collectives.gather_to_zero([s for s in store.certified() if below is None or s < below], peers)
    return collectives.broadcast_from_zero(common_newest(held) if held else None, peers)


class LoopSnapshots:
    """The in-memory snapshots of a loop that hands its state over (the tiny-GPT harness, through
    :class:`~megatron_patches.recovery.TrainingLoop`'s ``live_tensors``, ``state_values`` and
    ``restore_values``): a store certified by the monitor's checks, one snapshot every
    ``recovery.snapshot_interval`` steps, and the restore of the newest one every rank holds."""

    def __init__(self, monitor: Any, loop: Any):
        recovery = monitor.state.config.recovery
        self.monitor = monitor
        self.loop = loop
        self.store = SnapshotStore(recovery.snapshot_interval, recovery.snapshots_kept, recovery.certify_steps)
        monitor.add_callback(self.store)

    def after_step(self, step: int) -> None:
        """After ``step``'s update (and its decision, if any): a snapshot when one is due."""
        if self.store.due(step):
            self.store.take(step, self.loop.live_tensors(), self.loop.state_values())
            target_taken(self.monitor.state.detectors)  # the check that certifies it reads all of the held state

    def newest(self, below: Optional[int] = None) -> Optional[int]:
        """Every rank: the newest step every rank holds certified (older than ``below``), or None."""
        return agreed_newest(self.store, self.monitor.state.peers, below)

    def restore(self, step: int) -> Snapshot:
        """Every rank: the loop's state back to the snapshot of ``step``; the newer ones are dropped."""
        snapshot = self.store.get(step)
        restore(snapshot, self.loop.live_tensors())
        self.loop.restore_values(snapshot.values)
        self.store.drop_after(step)
        return snapshot
