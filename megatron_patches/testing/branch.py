"""Branches of one clean training, for the fault campaign (scripts/fault_campaign.py, issue 55).

A warm-up run saves its whole training state after step N (``--branch-snapshot-at N``): per rank,
the model's weights, the optimizer's main weights and Adam state, the scheduler, the sampler, the
guard's baselines and the RNG, in one plain ``torch.save`` file, next to a healthy checkpoint
marker. A branch starts from it (``--branch-from DIR``), so every branch begins at the same clean
state; the same directory is the branch's rollback target (the guard's in-process recovery finds
it through the marker and :meth:`TinyTrainer.load_checkpoint` hands it here). A branch can move
every weight by one unit in the last place first (``--branch-nudge``: the harmless perturbation
that measures the band of a layout), leave some steps without an update (``--branch-skip``: the
clean twin of a run whose guard skipped them) or some samples out (``--branch-blacklist``: the twin
of a run whose guard rolled back to the snapshot and left them out), and write its state at the end
(``--branch-dump``): what the campaign compares with a clean twin, and per step the count of
non-finite values in that state.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator

import torch

from ..errors import UserError

FILE = "branch_rank{rank}.pt"
DUMP = "branch_state_rank{rank}.pt"
NUDGES = ("up", "down")
"""``--branch-nudge`` values besides ``seed:N`` (a random sign per element, drawn with seed N)."""
_PRECISION = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}


def _leaves(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _inner(leaf: Any) -> Any:
    return leaf.__dict__.get("optimizer", leaf)


def main_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """The weights the torch optimizers step on this rank (main weights, or their shards)."""
    for leaf in _leaves(optimizer):
        for group in _inner(leaf).param_groups:
            yield from group["params"]


def _states(optimizer: Any, slot: str) -> Iterator[torch.Tensor]:
    for leaf in _leaves(optimizer):
        inner = _inner(leaf)
        for group in inner.param_groups:
            for param in group["params"]:
                value = inner.state.get(param, {}).get(slot)
                if torch.is_tensor(value):
                    yield value


def state_tensors(trainer: Any) -> dict[str, list[torch.Tensor]]:
    """This rank's training state: model weights, main weights, Adam's two moments."""
    opt = trainer.optimizer
    return {"weights": [p.data for p in trainer.model.parameters()], "main": list(main_params(opt)),
            "exp_avg": list(_states(opt, "exp_avg")), "exp_avg_sq": list(_states(opt, "exp_avg_sq"))}


def nonfinite(trainer: Any) -> int:
    """Non-finite values anywhere in this rank's training state. Counted per tensor only where one
    is there: each tensor's largest magnitude (one foreach call) is finite exactly when all of its
    values are, which on a clean step spares a count per tensor (the campaign probes every step)."""
    tensors = [t for ts in state_tensors(trainer).values() for t in ts if t.numel()]
    if not tensors:
        return 0
    peaks = torch.stack(torch._foreach_norm(tensors, float("inf")))  # promoted to one dtype
    if bool(torch.isfinite(peaks).all()):
        return 0
    return int(sum(int((~torch.isfinite(t)).sum()) for t, p in zip(tensors, peaks.tolist()) if not math.isfinite(p)))


def path_of(directory: str, rank: int) -> str:
    return os.path.join(directory, FILE.format(rank=rank))


def holds(directory: str) -> bool:
    """Whether ``directory`` is a branch snapshot (a rollback target of a branch)."""
    return os.path.isfile(path_of(directory, 0))


def save(trainer: Any, step: int) -> str:
    """Write this rank's state after ``step`` under ``<out>/checkpoints/iter_<step>`` and, on rank
    0, the marker that makes it a healthy, certified checkpoint (the campaign only snapshots a
    warm-up that had no incident). Collective: every rank calls it."""
    from .. import checkpoint
    from ..seams.rng import rng_state

    directory = checkpoint.checkpoint_dir(trainer.checkpoint_root, step)
    os.makedirs(directory, exist_ok=True)
    inners = [_inner(leaf).state_dict() for leaf in _leaves(trainer.optimizer)]
    torch.save({"step": step, "weights": [p.data.clone() for p in trainer.model.parameters()],
                "main": [p.data.clone() for p in main_params(trainer.optimizer)], "inner": inners,
                "scheduler": trainer.scheduler.state_dict(), "sampler": trainer.sampler.state_dict(),
                "monitor": trainer.monitor.state_dict() if trainer.monitor is not None else None,
                "rng": rng_state()}, path_of(directory, trainer.rank))
    torch.distributed.barrier()
    if trainer.rank == 0:
        checkpoint.write_marker(directory, step, True, certified_at=step)
    return directory


def load(trainer: Any, directory: str) -> int:
    """Restore this rank's state from a snapshot; returns its step."""
    from ..seams.rng import set_rng_state

    saved = torch.load(path_of(directory, trainer.rank), weights_only=False)
    with torch.no_grad():
        for param, value in zip(trainer.model.parameters(), saved["weights"], strict=True):
            param.data.copy_(value)
        for param, value in zip(main_params(trainer.optimizer), saved["main"], strict=True):
            param.data.copy_(value)
    for leaf, state in zip(_leaves(trainer.optimizer), saved["inner"], strict=True):
        _inner(leaf).load_state_dict(state)
    trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.sampler.load_state_dict(saved["sampler"])
    if trainer.monitor is not None and saved["monitor"]:
        trainer.monitor.load_state_dict(saved["monitor"])
    set_rng_state(saved["rng"])
    return int(saved["step"])


def _ulp(tensor: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each value, in its own dtype (zero stays zero's smallest step)."""
    values = tensor.detach().double()
    _, exponent = torch.frexp(values)
    ulp = torch.ldexp(torch.ones_like(values), exponent - _PRECISION[tensor.dtype])
    tiny = torch.finfo(tensor.dtype).tiny
    return torch.where(values == 0, torch.full_like(values, tiny), ulp)


def nudge(trainer: Any, mode: str) -> None:
    """Move every weight (model weights and main weights) by one unit in the last place: ``up``,
    ``down``, or ``seed:N`` (a random sign per element)."""
    generator = None
    if mode.startswith("seed:"):
        generator = torch.Generator().manual_seed(int(mode.split(":", 1)[1]) * 1000 + trainer.rank)
    with torch.no_grad():
        for param in [*trainer.model.parameters(), *main_params(trainer.optimizer)]:
            if mode == "up":
                sign = torch.ones(param.shape, dtype=torch.float64)
            elif mode == "down":
                sign = -torch.ones(param.shape, dtype=torch.float64)
            else:
                sign = torch.randint(0, 2, param.shape, generator=generator).double() * 2 - 1
            param.data.copy_((param.data.double() + sign * _ulp(param.data)).to(param.dtype))


class Probe:
    """Per step (its last execution, after a rollback's redo): whether the update was skipped and
    how many non-finite values this rank's state holds; written with the state by :meth:`dump`."""

    def __init__(self) -> None:
        self.skipped: dict[int, bool] = {}
        self.nonfinite: dict[int, int] = {}

    def after_step(self, trainer: Any, step: int, skipped: bool) -> None:
        self.skipped[step] = bool(skipped)
        self.nonfinite[step] = nonfinite(trainer)

    def dump(self, trainer: Any, out: str) -> None:
        state = {key: torch.cat([t.detach().float().flatten() for t in ts]) if ts else torch.zeros(0)
                 for key, ts in state_tensors(trainer).items()}
        torch.save({**state, "skipped": self.skipped, "nonfinite": self.nonfinite},
                   os.path.join(out, DUMP.format(rank=trainer.rank)))
        if trainer.rank == 0:
            with open(os.path.join(out, "branch.json"), "w", encoding="utf-8") as handle:
                json.dump({"skipped": sorted(s for s, v in self.skipped.items() if v)}, handle)


def add_arguments(p: Any) -> None:
    """The harness's branch flags (``python -m megatron_patches.tiny_gpt``)."""
    p.add_argument("--branch-snapshot-at", type=int, default=0, metavar="STEP",
                   help="save the whole training state after STEP for branches (testing/branch.py; 0: never)")
    p.add_argument("--branch-from", metavar="DIR", help="start from a --branch-snapshot-at directory")
    p.add_argument("--branch-nudge", metavar="MODE",
                   help="with --branch-from: move every weight by one unit in the last place (up, down, seed:N)")
    p.add_argument("--branch-skip", default="", metavar="STEPS",
                   help="comma-separated steps trained without an update (the twin of a run that skipped them)")
    p.add_argument("--branch-blacklist", default="", metavar="SAMPLES",
                   help="comma-separated samples never fed (the twin of a run that rolled back and left them out)")
    p.add_argument("--branch-dump", action="store_true",
                   help="write the training state at the end and non-finite counts per step (testing/branch.py)")


def check_arguments(args: Any) -> None:
    """One line naming the value and the fix where a branch flag is wrong; the step and sample
    lists parsed into sets."""
    if args.branch_nudge and not (args.branch_from and (args.branch_nudge in ("up", "down")
                                                        or args.branch_nudge.startswith("seed:"))):
        raise UserError(f"--branch-nudge must be up, down or seed:N, with --branch-from, got {args.branch_nudge!r}")
    for name in ("branch_skip", "branch_blacklist"):
        try:
            setattr(args, name, frozenset(int(s) for s in getattr(args, name).split(",") if s.strip()))
        except ValueError:
            raise UserError(f"--{name.replace('_', '-')} must be comma-separated integers, "
                            f"got {getattr(args, name)!r}") from None
