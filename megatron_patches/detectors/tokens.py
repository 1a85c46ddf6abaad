"""Token ids outside the vocabulary: a corrupted batch caught at the model's door.

A token id is an index into the word embedding. One that is negative or at least the embedding's
row count (a flipped high bit in a data file, a tokenizer of another vocabulary, a sign error in a
packing script) does different harm by layout: without tensor parallelism the lookup fails (an
IndexError on the CPU, a device-side assert on CUDA that leaves the process unusable, so every
other rank waits for it until its collective times out); with it, megatron-core's
``VocabParallelEmbedding`` masks ids outside each rank's slice and one outside all of them becomes a
zero vector, silently. Neither touches a gradient's numbers in a way the gradient checks could name.

A forward pre-hook on each word embedding (a module named ``...word_embeddings`` with
``num_embeddings``) counts, on the device, the ids of every micro-batch outside ``[0,
num_embeddings)`` and hands the embedding those ids replaced by 0, so the lookup cannot fail (the
step is an incident and is not applied; under tensor parallelism the row differs from the zero
vector Megatron would have made, which no update keeps). The count joins the check's reduced vector
(one float): no host read, no extra collective, no gradient read; the compare costs one pass over the
micro-batch's ids (``b x s`` integers). Kind ``vocab``. The rank that fed the ids is the origin: it
reports its word-embedding weight with the reason ``input:vocab`` (held findings, so strict scoring
and the record name it, whichever rank's optimizer shard steps that weight).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import naming
from ..incidents import ParamFinding
from .base import CheckContext, Detector

VOCAB = "vocab"
"""The kind flagged."""
REASON = "input:vocab"
"""The reason the word-embedding weight of the rank that fed the ids carries."""
SUFFIX = "word_embeddings"


class TokenRange(Detector):
    """Counts the token ids outside the vocabulary that each word embedding was fed (kind ``vocab``)."""

    name = "tokens"

    def __init__(self, cfg: Any, step_of: Callable[[], int]):
        """``step_of``: the step being made now (the hooks run in the forward pass)."""
        self.cfg = cfg
        self._step_of = step_of
        self._step: Optional[int] = None
        self._bad: dict[str, torch.Tensor] = {}  # module name -> ids outside its vocabulary this step
        self._sizes: dict[str, int] = {}
        self._weights: dict[str, tuple] = {}  # module name -> (ParamInfo, shape) of its weight
        self._hooked: set[int] = set()
        self._flags = 0

    def attach(self, model_chunks: list, ps: Any) -> int:
        infos = naming.name_parameters(model_chunks, ps)
        hooked = 0
        for name, _, module in naming.name_modules(model_chunks, ps):
            size = getattr(module, "num_embeddings", None)
            if not name.endswith(SUFFIX) or not isinstance(size, int) or id(module) in self._hooked:
                continue
            self._hooked.add(id(module))
            self._sizes[name] = size
            weight = getattr(module, "weight", None)
            if weight is not None and infos.get(id(weight)) is not None:
                self._weights[name] = (infos[id(weight)], list(weight.shape))
            module.register_forward_pre_hook(self._hook(name, size))
            hooked += 1
        return hooked

    def _hook(self, name: str, size: int):
        def hook(module, args):
            if not args or not torch.is_tensor(args[0]) or args[0].is_floating_point():
                return None
            ids = args[0]
            step = self._step_of()
            if step != self._step:
                self._step, self._bad = step, {}
            with torch.no_grad():
                bad = (ids < 0) | (ids >= size)
                count = bad.sum()
                held = self._bad.get(name)
                self._bad[name] = count if held is None else held + count
                ids = torch.where(bad, torch.zeros_like(ids), ids)
            return (ids, *args[1:])
        return hook

    def width(self) -> int:
        return 1

    def _counts(self, step: int) -> dict[str, torch.Tensor]:
        return self._bad if self._step == step else {}

    def local(self, ctx: CheckContext, out: torch.Tensor) -> None:
        counts = self._counts(ctx.step)
        if counts:
            out[0] = torch.stack([c.to(out.device) for c in counts.values()]).sum()

    def verdict(self, ctx: CheckContext, reduced: list) -> list:
        self._flags = int(reduced[0]) if reduced else 0
        return [VOCAB] if self._flags > 0 else []

    def held(self, ctx: CheckContext, ranks: dict) -> list:
        if not self._flags:
            return []
        host, device = naming.host(), naming.device_name()
        found = []
        for name, count in self._counts(ctx.step).items():
            bad = int(count)
            if bad and name in self._weights:
                info, shape = self._weights[name]
                found.append(ParamFinding.located(info, ranks, shape=shape, nan=0, inf=0, overflow=0,
                                                  norm=None, host=host, device=device, reasons=[REASON]))
        return found

    def extra(self, ctx: CheckContext, reduced: list) -> dict:
        if not self._flags:
            return {}
        return {"vocab": {"ids_outside": self._flags, "vocab_size": sorted(set(self._sizes.values()))}}

    def commit(self, ctx: CheckContext, accepted: bool) -> None:
        if self._step == ctx.step:  # a replay or a rollback's redo of the step counts afresh
            self._step, self._bad = None, {}

    def forget(self) -> None:
        self._step, self._bad = None, {}
