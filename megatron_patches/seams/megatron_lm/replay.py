"""The forward origin in Megatron-LM's loop when Megatron's own check is off.

With ``--check-for-nan-in-loss-and-grad`` (Megatron's default) a non-finite loss makes Megatron
rerun the step in place, and the guard watches that rerun's forward pass
(:mod:`.rerun_machine`). With ``--no-check-for-nan-in-loss-and-grad`` nothing reruns: every
gradient goes non-finite, the guard skips the step, and which module broke first was unknown.

Here the guard replays the step's forward pass itself, once the skipped ``train_step`` has
returned: Megatron's ``RerunDataIterator`` still holds the step's micro-batches (it keeps them
while the rerun mode is not ``disabled``), so they are rewound and run through Megatron's own
schedule with ``forward_only=True`` under :class:`~megatron_patches.forward_origin.ForwardTrace`;
no backward, no update, and the next step's ``advance()`` drops the micro-batches as usual. The
incident's record waits for the replay and carries its ``forward_origin``. Where the replay's
per-sample loss goes non-finite again on some rows (:class:`.poison.RowWatch`), the
same batch reproduced the fault: the verdict is ``deterministic``, the cause is classed with it
(``data`` where nothing else explains it) and, for data, those samples are blacklisted in the
ledger. A replay whose losses stay finite gives no verdict: a forward pass alone cannot clear a
gradient or a reduction. Only on a step the
guard skipped (a warning): a rollback or a stop ends the process inside the step, before this.
A clean step costs nothing.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from ... import collectives
from ...cause import Signs, classify
from ...decisions import Action, Decision
from ...forward_origin import ForwardTrace, gather_origin
from ...incidents import Outcome
from ...protocols import Guard
from ..parallel import parallel_state
from .poison import RowWatch, reproduced_verdict

log = logging.getLogger("megatron_patches")


def replays_here(args: Any) -> bool:
    """Whether this loop's skipped steps are replayed: Megatron's check off (else its rerun in
    place watches the forward pass) and its rerun machine keeping micro-batches (mode not disabled)."""
    return (not getattr(args, "check_for_nan_in_loss_and_grad", True)
            and getattr(args, "rerun_mode", "validate_results") != "disabled")


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
        if verdict is None:
            self.monitor.resolve(Outcome(forward_origin=forward))
            return
        samples = verdict.pop("samples")
        cause = classify(self._signs or Signs(step=step), verdict)
        blamed = tuple(samples) if cause.klass in ("data", "unknown") else ()
        if blamed and self.blacklist is not None:
            self.blacklist(list(blamed))
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
