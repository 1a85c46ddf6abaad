"""One certification for every rollback target: an in-memory snapshot (:mod:`megatron_patches.snapshots`),
a checkpoint of the tiny-GPT harness (:class:`megatron_patches.checkpoint.Certification`) or of
Megatron-LM's and Megatron-Bridge's loops (:class:`megatron_patches.seams.megatron_lm.checkpoints.CheckpointMarks`).

A target taken after step ``s`` waits. Each checked step after ``s`` that comes out clean counts
once; at ``recovery.certify_steps`` of them the target is certified (by that step). A flagged check
before that drops every target still waiting: whatever broke may have been building when they were
taken. The first check after ``s`` reads the gradients of the very state the target holds, and the
consistency detector compares the data-parallel replicas in the same per-step collective, so a clean
check also says the replicas agreed. Every rank sees the same verdicts, so every rank that keeps
a :class:`Certifier` certifies and drops alike. Pure bookkeeping: what a certified or dropped target
means (a marker rewritten, a snapshot kept) is its owner's.
"""

from __future__ import annotations

from typing import Any


class Certifier:
    """Targets waiting for their clean checks, oldest first; ``certify_steps`` of them certify one."""

    def __init__(self, certify_steps: int):
        self.certify_steps = certify_steps
        self._waiting: list[list] = []
        """[step, target, clean checks so far], oldest first."""

    def add(self, step: int, target: Any) -> None:
        """``target`` (the state after ``step``) waits for the checks after ``step``."""
        self._waiting.append([step, target, 0])

    def discard(self, target: Any) -> None:
        """``target`` waits no longer (gone, or settled by its owner some other way)."""
        self._waiting = [entry for entry in self._waiting if entry[1] is not target]

    def waiting(self) -> list:
        """The targets still waiting, oldest first."""
        return [entry[1] for entry in self._waiting]

    def note_check(self, step: int, flagged: bool) -> tuple[list, list]:
        """A checked step's verdict: returns (certified, dropped), the targets taken before ``step``
        that this check certified (its ``certify_steps``-th clean one) or dropped (a flag)."""
        certified, dropped = [], []
        for entry in [e for e in self._waiting if e[0] < step]:
            if not flagged:
                entry[2] += 1
                if entry[2] < self.certify_steps:
                    continue
            self._waiting.remove(entry)
            (dropped if flagged else certified).append(entry[1])
        return certified, dropped
