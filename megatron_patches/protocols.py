"""The typed seams between the guard and what drives it.

:class:`Guard` is what recovery executors, integrations and the hook-side seams may use on the guard
(:class:`~megatron_patches.monitor.GradMonitor` implements it); :class:`Executor` is what the guard
calls on the recovery executor attached to it (:mod:`megatron_patches.recovery`); :class:`Seams`
is what the core pipeline asks of Megatron's side (:class:`megatron_patches.seams.MegatronSeams`),
handed to the monitor when it is made, so the core never imports :mod:`megatron_patches.seams`.
Anything else on the monitor is its own business and may change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager, Iterable, NoReturn, Optional, Protocol

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only
    from .incidents import Outcome, ParamFinding
    from .decisions import Decision
    from .findings import RankReport
    from .callbacks import Callback


class Executor(Protocol):
    """Acts on the guard's decisions."""

    in_process: bool
    """True: it rolls back inside the loop, and calls :meth:`Guard.exit` itself on a stop (or on a
    rollback it cannot make in process). False: the guard ends the process on every stop and
    rollback decision."""

    replays: bool
    """True: it replays an incident's step itself (``TrainingLoop.replay_step``), so a decision may ask for it."""
    ledger_path: Optional[str]
    """Where an exit-and-restart rollback's outcome is written (an incident's record names it); None
    where the executor rolls back in process."""

    def settle_exit(self, decision: "Decision") -> "Decision":
        """Last work before the process ends for ``decision`` (write the ledger); returns the
        decision the exit code is taken from (a critical stop when that work failed)."""


class ModelChunks(Protocol):
    """Optimizer -> model chunks, bucket group -> parameters, as the core reads them
    (:class:`megatron_patches.seams.model_chunks.ModelChunks`)."""

    def chunks_for(self, optimizer: Any) -> Optional[list]:
        """The model chunks ``optimizer`` steps, None when its maker was not seen."""

    def modules(self) -> list:
        """Every module of every known chunk (a forward trace watches them)."""


class PreReduction(Protocol):
    """What one rank knew of its own gradients before the reduction of one step
    (:class:`megatron_patches.seams.origin.PreReduction`)."""

    flag: Any
    """A device tensor, 1.0 where this rank's own gradients held NaN/Inf; None when not checked."""
    findings: list

    def is_origin(self) -> bool:
        """Whether the fault entered here (reads the flag: the slow path only)."""

    def named(self, model_chunks: ModelChunks) -> list["ParamFinding"]:
        """This rank's own faulty gradients, named."""

    def jumped(self, model_chunks: ModelChunks) -> list["ParamFinding"]:
        """This rank's own finite gradients that jumped far above their running mean, named."""

    def bucket_jumped(self) -> bool:
        """Whether one of Megatron's bucket norms of this rank jumped far above its running mean."""


class OriginWatch(Protocol):
    """One run's pre-reduction origin pass (:class:`megatron_patches.seams.origin.OriginWatch`)."""

    peak_ratio: Optional[float]
    """With the peak detector on, its ``min_ratio``: the pass also takes crest factors."""

    def take(self) -> PreReduction:
        """What the step's pre-reduction pass saw, once."""

    def commit(self, accepted: bool) -> None:
        """After the step's check: whether its own norms join the running means."""

    def before_reduction(self, model_chunks: list) -> None:
        """The pass over a model outside Megatron DDP, before its reduction."""

    def note_bucket_check(self) -> None:
        """Megatron's per-bucket check runs: the flag comes from its norms from now on."""

    def note(self, findings: list) -> None:
        """This rank's own gradients were non-finite before the reduction (Megatron's bucket check)."""

    def note_bucket_norms(self, group: object, norms: list, step: int) -> None:
        """Megatron's finite bucket norms of a group on a checked step (no pass of the guard's own)."""


class RerunWatch(Protocol):
    """One run's view of Megatron's reruns in place (:class:`megatron_patches.seams.rerun_machine.RerunWatch`)."""

    def part(self, step: int) -> Optional[dict]:
        """This rank's share of the incident of ``step`` (the loss it rejected, Megatron's verdict), once."""


class LossScaleWatch(Protocol):
    """One run's fp16 loss-scaler watch (:class:`megatron_patches.seams.loss_scale.LossScaleWatch`)."""

    def clear(self) -> None:
        """A step the scaler did not skip."""

    def overflow(self, optimizer: Any) -> Optional[Any]:
        """A skipped step: the event that makes it an incident (a ``ScalerEvent``), or None."""


class Seams(Protocol):
    """Megatron's side as the core pipeline sees it: how an optimizer's gradients pair with their
    parameters, what DDP and the rerun machine saw, the loss scaler, and the per-run watches on
    them. One implementation, :class:`megatron_patches.seams.MegatronSeams`; a test passes its own."""

    def build_entries(self, optimizer: Any, model_chunks: list) -> tuple[list, int]:
        """One entry per (gradient, parameter) pair the optimizer steps, and the number of
        per-layer slots (:func:`megatron_patches.seams.optimizer_params.build_entries`)."""

    def current_grads(self, optimizer: Any, entries: list) -> Iterable[tuple[Any, Any]]:
        """``(entry, gradient or None)`` as the optimizer holds them now."""

    def audit_refusal(self, optimizer: Any) -> Optional[str]:
        """Why the state audit cannot run on this optimizer (one line), None where it can."""

    def megatron_norms(self, optimizer: Any) -> list:
        """Per-gradient norms from the kernel calls Megatron's clipping norm will make this step,
        made now and kept for them: ``[(gradients, their norms as one device vector)]`` per call
        (empty: read them yourself)."""

    def covers(self, model_chunks: list) -> bool:
        """True where Megatron DDP's own ``start_grad_sync`` carries the pre-reduction pass."""

    def reduced_in_backward(self, model_chunks: list) -> bool:
        """True where the chunks' gradients are reduce-scattered inside backward (FSDP): there is no
        view of a rank's own gradient before the reduction."""

    def named_grads(self, model_chunks: list) -> list:
        """``(name, order, grad)`` of the chunks' parameters, for models outside Megatron DDP."""

    def unchecked(self) -> ContextManager:
        """A block in which Megatron's ``prepare_grads`` does not pass through the guard again."""

    def undo_prepare_on_skip(self, optimizer: Any) -> Any:
        """Undo what ``prepare_grads`` changed when no update follows (MindSpeed)."""

    def remember_norm(self, optimizer: Any, step: int, total_norm: float, entries: list, grads: list) -> None:
        """Keep the check's total norm for Megatron's ``get_grad_norm`` of the same step (the seams
        hold it: :class:`megatron_patches.seams.served_norm.HeldNorm`)."""

    def rng_state(self) -> dict:
        """Every random-number generator a step draws from on this rank (a fault scene keeps it)."""

    def parallel_state(self) -> Any:
        """megatron-core's ``parallel_state`` module once model parallelism is initialized, else
        None: where :mod:`~megatron_patches.naming` reads ranks, sizes and groups
        (:func:`megatron_patches.seams.parallel.parallel_state`)."""

    def megatron_core_version(self) -> Optional[str]:
        """The megatron-core version this process imports (a scene's ``environment.json``), None without one."""

    def record_fields(self, everyone: list["RankReport"], extra: dict) -> tuple[dict, str]:
        """Rank 0: the record's fields from Megatron's loss check and rerun, and a note for the message."""

    def model_chunks(self) -> ModelChunks:
        """A new run's optimizer -> model chunks and bucket group -> parameters map."""

    def rerun_watch(self) -> RerunWatch:
        """A new run's watch on Megatron's rerun state machine."""

    def origin_watch(self, enabled: bool, peak_ratio: Optional[float] = None) -> OriginWatch:
        """A new run's pre-reduction origin watch (``response.origin_check``)."""

    def loss_scale_watch(self, settings: Any) -> LossScaleWatch:
        """A new run's fp16 loss-scaler watch (``detectors.loss_scale``)."""


class Guard(Protocol):
    """What executors, loop integrations and the hook-side modules (bucket_norms, served_norm,
    forward_origin, the wrappers) may call on the guard: twelve members. The run's objects are read
    on :attr:`state`; only the core writes them (``tests/test_units_house.py``)."""

    state: Any
    """Everything the run keeps (:class:`~megatron_patches.run_state.RunState`): its config, drills,
    model chunks, counters, last incident... Read it; change it through the methods below."""

    def set_step(self, step: int) -> None:
        """Name the optimizer step about to run (1-based); without it the guard counts ``prepare_grads``."""

    def set_batch(self, sample_indices: list, tokens: Optional[list] = None, **info: Any) -> None:
        """The dataset indices (and micro-batches, and fields for the record) of the step being made."""

    def state_dict(self) -> dict:
        """What a checkpoint carries so a restart keeps its baselines and counters."""

    def load_state_dict(self, state: dict) -> None:
        """Take back what :meth:`state_dict` gave."""

    def attach(self, executor: Executor, rollbacks: int) -> None:
        """Make ``executor`` act on the guard's decisions; ``rollbacks`` so far (the ledger's)."""

    def add_callback(self, callback: "Callback") -> None:
        """Let ``callback`` (:class:`~megatron_patches.callbacks.Callback`) hear of the run's events."""

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to ``state.counters[counter]``."""

    def take_decision(self) -> Optional["Decision"]:
        """The last incident's decision (identical on every rank), once."""

    def resolve(self, outcome: "Outcome") -> None:
        """The executor's outcome for the incident held for it; rank 0 publishes the record."""

    def new_episode(self, rollbacks: int) -> None:
        """After an in-process rollback."""

    def exit(self, decision: "Decision") -> NoReturn:
        """End the process for ``decision`` on every rank (SystemExit with its exit code)."""
