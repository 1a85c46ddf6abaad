"""The response that follows an incident's cause (:mod:`megatron_patches.cause`), as steps of the
in-process recovery chain (:data:`megatron_patches.recovery.IN_PROCESS_STEPS`) and as the functions
the exit-and-restart executor shares with it.

* ``data``: the samples the replay reproduced the fault with are blacklisted (recovery's ``blacklist``);
* ``hardware``: no sample is blacklisted; a corrupt held state is rolled back at once (skipping the
  step would leave it corrupt); the device is counted in the ledger, and the
  ``response.hardware_repeat``-th incident on it in the job fences it: every rank exits with
  ``response.exit_codes.fence`` after one line names the host and device to exclude;
* ``numerics``: the rollback's learning-rate cut and safe mode, as graded;
* ``software``: stop with the evidence (a rollback would meet the bug again);
* ``unknown``: as graded, samples blacklisted as configured.

A rollback target whose redo met a fault of the same cause before passing the step the rollback
left from is disqualified in the ledger: it and every newer checkpoint are passed over for an
older one (:func:`healthy_target`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

from . import checkpoint, collectives
from .cause import Cause, Signs, classify
from .decisions import Action, Decision, Severity
from .incidents import IN_MEMORY
from .ledger import Ledger

Episode = Any
"""A :class:`megatron_patches.recovery.Episode` (recovery imports this module, not the reverse)."""
InProcessRecovery = Any
"""The executor running the chain (:class:`megatron_patches.recovery.InProcessRecovery` or Megatron-LM's)."""
log = logging.getLogger("megatron_patches")

BLACKLISTING = ("data", "unknown")
"""The cause classes whose samples are blacklisted; the others' samples are innocent."""


def cause_of(episode: Episode) -> str:
    """The class of the episode's cause (``unknown`` before it is classed)."""
    return episode.cause.klass if episode.cause is not None else "unknown"


def blames_samples(episode: Episode) -> bool:
    """Whether the episode's samples may be blacklisted: its cause is data or unknown."""
    return cause_of(episode) in BLACKLISTING


def classify_step(run: InProcessRecovery, episode: Episode) -> Episode:
    """Class the incident from the decision's signs and the replay's verdict (the same on every rank)."""
    signs = episode.decision.signs
    if signs is None:
        return episode
    found = classify(signs, episode.outcome.replay)
    return replace(episode, cause=found, outcome=replace(episode.outcome, cause=found))


def _decided(episode: Episode, decision: Decision) -> Episode:
    return replace(episode, decision=decision, outcome=replace(episode.outcome, decision=decision))


def follow_cause(run: InProcessRecovery, episode: Episode) -> Episode:
    """software: stop with the evidence. hardware with a corrupt held state graded a skip: roll back
    now (within the retry budget; a critical stop past it)."""
    decision, cause = episode.decision, episode.cause
    if cause is None or decision.action in (Action.STOP, Action.FENCE):
        return episode
    if cause.klass == "software":
        return _decided(episode, decision.escalated(f"cause software ({'; '.join(cause.evidence)}): a rollback "
                                                    "would meet it again; fix the code or the setup"))
    signs = decision.signs
    held = tuple(sorted(set(signs.held_ranks) | set(signs.off_ranks))) if signs is not None else ()
    if cause.klass == "hardware" and held and decision.action == Action.SKIP_STEP:
        why = (f"cause hardware: the state held on rank(s) {list(held)} is corrupt and a skipped step would "
               "leave it so")
        if run.monitor.state.config.response.on_error != "rollback":
            return _decided(episode, Decision(Severity.ERROR, Action.STOP, f"{decision.reason}; {why}", decision.step,
                                              origins=decision.origins, signs=decision.signs))
        if run.ledger.rollbacks >= run.config.max_rollbacks:
            return _decided(episode, decision.escalated(f"{why}; retry budget of {run.config.max_rollbacks} "
                                                        "rollbacks spent"))
        return _decided(episode, Decision(Severity.ERROR, Action.ROLLBACK, f"{decision.reason}; {why}",
                                          decision.step, origins=decision.origins, signs=decision.signs))
    return episode


def fence_decision(ledger: Ledger, cause: Optional[Cause], decision: Decision, repeat: int, code: int,
                   rank: int, interval: int = 1) -> Decision:
    """Count a hardware-class incident against each device it points at (in ``ledger``); the
    ``repeat``-th on one device turns ``decision`` into a fence, names the device in ``ledger.fenced``
    and logs (rank 0) the one line that names the host and device to exclude. Incidents on
    consecutive checked steps (``interval`` apart) are one fault, counted once. Every rank calls it
    with the same ledger and cause, so every rank decides alike."""
    if cause is None or cause.klass != "hardware" or not cause.devices or decision.action == Action.FENCE:
        return decision
    counted = ledger.count_hardware(cause.devices, decision.step, interval)
    device, count = max(counted, key=lambda pair: pair[1])
    if count < repeat:
        return decision
    steps = [e["step"] for e in ledger.hardware if (e["host"], e["device"]) == (device.host, device.device)]
    ledger.fenced = {"host": device.host, "device": device.device, "rank": device.rank, "step": decision.step,
                     "incidents": count}
    if rank == 0:
        log.error("fence: exclude host %s device %s (rank %d): %d hardware-class incidents in this job, at steps %s; "
                  "every rank exits with %d", device.host, device.device, device.rank, count, steps, code)
    return decision.escalated(f"fence: {count} hardware-class incidents on host {device.host} device "
                              f"{device.device} (rank {device.rank}) in this job, at steps {steps}: exclude it",
                              Action.FENCE)


def count_device(run: InProcessRecovery, episode: Episode) -> Episode:
    """hardware: count the device in the ledger (saved); the ``response.hardware_repeat``-th fences it."""
    response = run.monitor.state.config.response
    fenced = fence_decision(run.ledger, episode.cause, episode.decision, response.hardware_repeat,
                            response.exit_codes.fence, collectives.rank(), run.monitor.state.config.check_interval)
    if episode.cause is not None and episode.cause.klass == "hardware" and episode.cause.devices:
        run.save_ledger()
    return episode if fenced is episode.decision else _decided(episode, fenced)


def disqualify(ledger: Ledger, step: int, klass: str) -> Optional[int]:
    """The last rollback's target, disqualified (added to ``ledger.disqualified``) when the fault of
    ``step`` came back before its redo passed the step it left from, with the same cause; else None."""
    last = ledger.events[-1] if ledger.events else None
    if (last is None or "rolled_back_to" not in last or last.get("cause") != klass or klass == "data"
            or step > last["step"] or last["rolled_back_to"] in ledger.disqualified):
        return None
    ledger.disqualified.append(last["rolled_back_to"])
    return last["rolled_back_to"]


def healthy_target(root: str, disqualified: list) -> Optional[tuple[int, str]]:
    """The newest healthy checkpoint under ``root`` older than every disqualified target."""
    floor = min(disqualified) if disqualified else None
    healthy = [(step, path) for step, path, ok in checkpoint.list_checkpoints(root)
               if ok and (floor is None or step < floor)]
    return max(healthy) if healthy else None


def restore_target(run: InProcessRecovery, episode: Episode) -> Episode:
    """Restore the newest target not disqualified (:func:`disqualify`): the newest in-memory
    snapshot every rank holds certified (``run.snapshots``), or the newest healthy checkpoint where
    that is newer; with neither the rollback becomes a critical stop."""
    if not episode.rolls_back:
        return episode
    passed = disqualify(run.ledger, episode.step, cause_of(episode))
    if passed is not None and collectives.rank() == 0:
        log.warning("rollback target step %d disqualified: its redo met the fault again (cause %s) at step %d; "
                    "an older one is taken", passed, cause_of(episode), episode.step)
    target = healthy_target(run.loop.checkpoint_root, run.ledger.disqualified)
    in_memory = run.snapshots.newest(below=min(run.ledger.disqualified, default=None))
    if in_memory is not None and (target is None or in_memory >= target[0]):
        snapshot = run.snapshots.restore(in_memory)
        outcome = replace(episode.outcome, rolled_back_to=in_memory, checkpoint=IN_MEMORY,
                          certified_at=snapshot.certified_at)
        return replace(episode, outcome=outcome, resume_at=in_memory + 1)
    if target is None:
        return _decided(episode, episode.decision.escalated("no certified in-memory snapshot and no healthy checkpoint "
                                                            "to roll back to" + (f" older than the disqualified step "
                                                                                 f"{passed}" if passed is not None else "")))
    healthy_step, path = target
    run.snapshots.store.drop_after(healthy_step)  # those of the abandoned future
    resumed = run.loop.load_checkpoint(path)
    outcome = replace(episode.outcome, rolled_back_to=healthy_step, checkpoint=path)
    return replace(episode, outcome=outcome, resume_at=resumed + 1)


def settle_cause(ledger: Ledger, decision: Decision, config: Any, rank: int) -> tuple[Decision, Cause, bool]:
    """The exit-and-restart executor's share (no replay): the cause from the signs, the device
    counted (a fence where due), and whether the episode's samples are to be blacklisted."""
    found = classify(decision.signs or Signs(step=decision.step))
    response = config.response
    decision = fence_decision(ledger, found, decision, response.hardware_repeat, response.exit_codes.fence, rank,
                              config.check_interval)
    return decision, found, found.klass in BLACKLISTING

