"""The ``poison:sample=I`` drill in Megatron-LM's loop, and the rows a replay finds non-finite.

Megatron-LM's loop computes its own loss, so the guard cannot poison it there as the tiny-GPT
harness does. What the guard knows instead is which dataset positions this rank reads in each
iteration (the ``single`` data loader: :func:`.megatron_lm.sample_positions`, micro-batch after
micro-batch, ``micro_batch_size`` rows each). :class:`PoisonFeed` turns a poisoned position into a
NaN in the output of the word embedding for exactly that row of that micro-batch, every time the
row is fed: in the step, in Megatron's rerun in place, in the guard's forward replay, and in the
redo after an in-process rollback. The loss of that sample, and so every gradient, goes NaN; the
other rows of the batch stay as they were. A loop whose positions are unknown (another data loader)
never asks, and the drill is refused at the first step (:meth:`megatron_patches.monitor.GradMonitor`).

:class:`RowWatch` is the replay's half: the per-token loss the last pipeline stage returns (one row
per sample) is checked row by row in a forward-only replay, which names the positions whose loss
went non-finite again (the samples that reproduce the fault).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ... import naming

log = logging.getLogger("megatron_patches")


def _microbatches() -> int:
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return max(int(get_num_microbatches()), 1)


def _by_microbatch(positions: list, per_micro: int) -> dict[int, list[int]]:
    """{micro-batch: [rows]} of ``positions`` (this rank's, in the order the loop feeds them)."""
    out: dict[int, list[int]] = {}
    for index, position in enumerate(positions):
        if position is not None:
            out.setdefault(index // per_micro, []).append(index % per_micro)
    return out


class PoisonFeed:
    """Feeds NaN for poisoned samples through the word embedding of this rank's first-stage chunks."""

    def __init__(self, monitor: Any, micro_batch_size: int):
        self.monitor = monitor
        self.micro_batch_size = micro_batch_size
        self._rows: dict[int, list[int]] = {}
        self._calls = 0
        self._hooked: list = []

    def before_iteration(self, positions: list) -> None:
        """The positions this rank reads now (empty where unknown: the drill is then never asked)."""
        self._calls = 0
        if not positions:
            self._rows = {}
            return
        hit = self.monitor.state.drills.poisoned(positions)
        self._rows = _by_microbatch([p if p in hit else None for p in positions], self.micro_batch_size)
        if hit and not self._hooked:
            self._hook()

    def _hook(self) -> None:
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

        for chunk in self.monitor.state.model_chunks.modules():
            for module in chunk.modules():
                if isinstance(module, LanguageModelEmbedding):
                    self._hooked.append(module.register_forward_hook(self._corrupt))

    def _corrupt(self, module: Any, inputs: Any, output: Any) -> Any:
        """Megatron's embedding output is [sequence, batch, hidden]: the poisoned rows times NaN
        (multiplied, so the NaN flows on into the backward pass as well)."""
        micro = self._calls % _microbatches()  # a rerun or replay feeds the same micro-batches again
        self._calls += 1
        rows = self._rows.get(micro)
        if not rows or not torch.is_tensor(output):
            return output
        mask = torch.ones(output.shape[1], dtype=output.dtype, device=output.device)
        mask[rows] = float("nan")
        return output * mask.view(1, -1, *([1] * (output.dim() - 2)))


class RowWatch:
    """During a forward-only replay: which of this rank's positions gave a non-finite per-token loss."""

    def __init__(self, chunks: list, positions: list, micro_batch_size: int):
        self.positions = list(positions)
        self.micro_batch_size = micro_batch_size
        self.bad: set = set()
        self.seen = False
        """Whether a per-sample loss was seen at all (the last pipeline stage, a model given labels)."""
        self._calls = 0
        self._handles = [chunk.register_forward_hook(self._watch) for chunk in chunks
                         if getattr(naming.unwrap(chunk), "post_process", False)]

    def _watch(self, module: Any, inputs: Any, output: Any) -> None:
        micro, self._calls = self._calls % _microbatches(), self._calls + 1
        if not torch.is_tensor(output) or output.dim() != 2:  # not the [batch, sequence] loss
            return
        self.seen = True
        rows = (~torch.isfinite(output.detach().float())).any(dim=1).nonzero().flatten().tolist()
        for row in rows:
            index = micro * self.micro_batch_size + row
            if index < len(self.positions):
                self.bad.add(self.positions[index])

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def reproduced_verdict(bad: list, fed: int) -> Optional[dict]:
    """The replay's verdict for :func:`megatron_patches.cause.classify` from the positions whose loss
    went non-finite again (every rank's) out of ``fed`` positions fed: None where none did (a
    forward-only replay tells nothing of a fault born in the backward pass or the reduction)."""
    if not bad:
        return None
    return {"verdict": "deterministic", "narrowed": len(set(bad)) < fed, "samples": sorted(set(bad))}


def reading(consumed: dict, blacklist: list, iterations: range) -> list:
    """The ``iterations`` that read a blacklisted position, from ``consumed`` (the samples consumed
    before each taped iteration; the last one reads a current global batch)."""
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size

    banned, out = set(blacklist), []
    for iteration in iterations:
        start = consumed.get(iteration)
        if start is None or not banned:
            continue
        end = consumed.get(iteration + 1, start + int(get_current_global_batch_size()))
        if any(start <= sample < end for sample in banned):
            out.append(iteration)
    return out
