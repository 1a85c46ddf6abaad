"""A skipped step's replay in Megatron-LM's loop: which samples reproduce the fault, and its cause.

With ``--no-check-for-nan-in-loss-and-grad`` nothing reruns: every gradient goes non-finite, the
guard skips the step, and which module broke first was unknown. :class:`ForwardReplay` replays
the step's forward pass itself, once the skipped ``train_step`` has returned: Megatron's
``RerunDataIterator`` still holds the step's micro-batches (it keeps them while the rerun mode is
not ``disabled``), so they are rewound and run through Megatron's own schedule with
``forward_only=True`` under :class:`~megatron_patches.forward_origin.ForwardTrace`; no backward, no
update, and the next step's ``advance()`` drops the micro-batches as usual. The incident's record
waits for the replay and carries its ``forward_origin``.

With ``--check-for-nan-in-loss-and-grad`` (Megatron's default) a non-finite loss or bucket norm
makes Megatron rerun the step in place before the guard's check (:mod:`..rerun_machine`): that
rerun is the replay, and a second one would only repeat it. :class:`RerunRows` watches its
per-sample losses (the guard's events ``before_rerun``/``after_rerun``), and after the skipped
step turns what the rerun saw into the same verdict: rows non-finite again -> ``deterministic``;
none, and Megatron found what it rejected finite on rerunning -> ``transient`` (a replay of the
step on the same ranks from the same state and batch was clean).

Either way, where the per-sample loss went non-finite again on some rows (:class:`.poison.RowWatch`)
the same batch reproduced the fault: the cause is classed with that verdict (``data`` where nothing
else explains it) and, for data, those samples are blacklisted in the ledger. A forward pass whose
losses stay finite gives no ``deterministic`` verdict: it cannot clear a gradient or a reduction.
Only on a step the guard skipped: a rollback or a stop ends the process inside the step, before
this. A clean step costs nothing.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ... import collectives
from ...callbacks import Callback
from ...cause import Signs, classify
from ...decisions import Action, Decision
from ...forward_origin import ForwardTrace, gather_origin
from ...incidents import Outcome
from ...protocols import Guard
from ..parallel import parallel_state
from ..rerun_machine import TRANSIENT
from .poison import RowWatch, reproduced_verdict

log = logging.getLogger("megatron_patches")


def replay_for(args: Any, monitor: Guard, blacklist: Callable[[list], None],
               positions: Callable[[], tuple]) -> Optional["ForwardReplay"]:
    """This loop's replay of skipped steps, or None: none where Megatron's rerun machine keeps no
    micro-batches (``--rerun-mode disabled``) or does not rerun them (another mode with its check
    on); ``positions()``: the dataset positions this rank reads in the iteration running."""
    mode = getattr(args, "rerun_mode", "validate_results")
    if not getattr(args, "check_for_nan_in_loss_and_grad", True):
        return ForwardReplay(monitor, blacklist) if mode != "disabled" else None
    return RerunRows(monitor, blacklist, positions) if mode == "validate_results" else None


class ForwardReplay:
    """One Megatron-LM process's replays: which step waits for one, and running it."""

    def __init__(self, monitor: Guard, blacklist: Optional[Callable[[list], None]] = None):
        """``blacklist(samples)``: every rank, where a data cause blames samples (the ledger's side)."""
        self.monitor = monitor
        self.blacklist = blacklist
        self.pending: Optional[int] = None
        """The step whose incident record waits for a replay (every rank alike: the decision is)."""
        self._signs: Optional[Signs] = None

    def wants(self, decision: Decision) -> bool:
        """For the session's ``wants_replay``: a skipped step is replayed after it returns."""
        if decision.action != Action.SKIP_STEP:
            return False
        self.pending, self._signs = int(decision.step), decision.signs
        return True

    def run(self, bound: dict, positions: tuple = ()) -> None:
        """After the skipped ``train_step`` (its bound arguments; ``positions``: the dataset positions
        this rank fed in it, where known): replay its forward pass on every rank, then publish the
        held record with the forward origin found (or none) and the cause the replay supports."""
        step, self.pending = self.pending, None
        forward, verdict = None, None
        try:
            forward, verdict = self._replay(step, bound, list(positions))
        except Exception as error:  # the record still goes out, without an origin
            log.warning("step %d: the forward replay failed (%s: %s); the record names no forward origin",
                        step, type(error).__name__, error)
        self.resolve(step, verdict, forward)

    def resolve(self, step: int, verdict: Optional[dict], forward: Optional[dict] = None) -> None:
        """Every rank: the held record of ``step`` published with the replay's ``verdict`` (its
        ``samples``: the positions that reproduced it) and the cause it supports; samples a data or
        unknown cause blames go to ``blacklist``."""
        if verdict is None:
            self.monitor.resolve(Outcome(forward_origin=forward))
            return
        samples = verdict.pop("samples")
        cause = classify(self._signs or Signs(step=step), verdict)
        blamed = tuple(samples) if cause.klass in ("data", "unknown") else ()
        if blamed and self.blacklist is not None:
            self.blacklist(list(blamed))
        if blamed and collectives.rank() == 0:
            log.warning("step %d: sample(s) %s reproduced the fault in the replay: cause %s (%s), blacklisted",
                        step, list(blamed), cause.klass, cause.confidence)
        self.monitor.resolve(Outcome(forward_origin=forward, replay=verdict, cause=cause, blacklisted=blamed))

    def _replay(self, step: int, bound: dict, positions: list) -> tuple[Optional[dict], Optional[dict]]:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.training import get_args

        args = get_args()
        data_iterator = bound["data_iterator"]
        iterators = [d for d in (data_iterator if isinstance(data_iterator, list) else [data_iterator]) if d is not None]
        if collectives.any_rank(any(not hasattr(d, "rewind") for d in iterators)):
            log.warning("step %d: no forward replay: the data iterator keeps no micro-batches to rewind", step)
            return None, None
        for iterator in iterators:
            iterator.rewind()
        schedule = bound.get("forward_backward_func") or get_forward_backward_func()
        extra = {name: bound[name] for name in ("p2p_communicator", "pg_collection") if bound.get(name) is not None}
        self.monitor.set_step(step)  # drills of that step act in its replay as in the step
        rows = RowWatch(self.monitor.state.model_chunks.modules(), positions, int(args.micro_batch_size))
        try:
            with ForwardTrace(self.monitor.state.model_chunks.modules(), parallel_state()) as trace, torch.no_grad():
                schedule(forward_step_func=bound["forward_step_func"], data_iterator=data_iterator,
                         model=bound["model"], num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
                         micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
                         forward_only=True, **extra)
        finally:
            rows.close()
        forward, _ = gather_origin(trace, self.monitor.state.peers)
        everyone = collectives.gather_to_zero((sorted(rows.bad), positions), self.monitor.state.peers)
        verdict = None
        if everyone:  # rank 0: every rank's reproducing positions out of all those fed
            verdict = reproduced_verdict([p for bad, _ in everyone for p in bad],
                                         len({p for _, fed in everyone for p in fed}))
        return forward, collectives.broadcast_from_zero(verdict, self.monitor.state.peers)


class RerunRows(ForwardReplay, Callback):
    """With Megatron's check on: its rerun in place of a checked step is the replay. Every rank
    watches the per-sample losses of that rerun (:class:`.poison.RowWatch`) and keeps Megatron's
    verdict on what it rejected; a skipped step's held record is then published with the verdict
    of all ranks together (:func:`rerun_verdict`), no step run again."""

    def __init__(self, monitor: Guard, blacklist: Callable[[list], None], positions: Callable[[], tuple]):
        super().__init__(monitor, blacklist)
        self.positions = positions
        self._watch: Optional[tuple[int, RowWatch]] = None
        self._seen: Optional[tuple[int, tuple]] = None
        """(step, (this rank's positions non-finite in the rerun, positions fed, Megatron's verdict))."""
        monitor.add_callback(self)

    def before_rerun(self, step: int) -> None:
        from megatron.training import get_args

        self._seen = None
        chunks = self.monitor.state.model_chunks.modules()
        self._watch = (step, RowWatch(chunks, list(self.positions()), int(get_args().micro_batch_size)))

    def after_rerun(self, step: int, verdict: Optional[str]) -> None:
        if self._watch is None:
            return
        (started, rows), self._watch = self._watch, None
        rows.close()
        if started == step:
            self._seen = (step, (sorted(rows.bad), list(rows.positions), verdict))

    def wants(self, decision: Decision) -> bool:
        """A skipped step that Megatron reran in place (every rank alike: its rerun is agreed on)."""
        return self._seen is not None and self._seen[0] == decision.step and super().wants(decision)

    def run(self, bound: dict, positions: tuple = ()) -> None:
        step, self.pending = self.pending, None
        seen, self._seen = self._seen[1], None
        verdict = None
        try:
            everyone = collectives.gather_to_zero(seen, self.monitor.state.peers)
            verdict = collectives.broadcast_from_zero(rerun_verdict(everyone) if everyone else None,
                                                      self.monitor.state.peers)
        except Exception as error:  # the record still goes out, without a verdict
            log.warning("step %d: the rows of Megatron's rerun could not be gathered (%s: %s); the record has no "
                        "replay verdict", step, type(error).__name__, error)
        self.resolve(step, verdict)


def rerun_verdict(everyone: list) -> Optional[dict]:
    """Rank 0: the replay verdict of Megatron's rerun in place from every rank's (positions whose
    loss was non-finite in the rerun, positions fed, Megatron's verdict there or None): rows that
    reproduced it make it ``deterministic`` (:func:`.poison.reproduced_verdict`); none, and Megatron
    found on rerunning that what it rejected was finite, ``transient``; else None (a rerun that
    reproduced a gradient, never a sample's loss, names no sample)."""
    bad = [p for rows, _, _ in everyone for p in rows]
    fed = {p for _, positions, _ in everyone for p in positions}
    found = reproduced_verdict(bad, len(fed))
    verdicts = {verdict for _, _, verdict in everyone if verdict}
    if found is None and verdicts == {TRANSIENT}:
        return {"verdict": "transient", "narrowed": False, "samples": []}
    return found
