"""A deterministic synthetic corpus a tiny GPT can learn, with a stable index per sample.

Sample ``i`` is an arithmetic sequence modulo the vocabulary: a start token and a stride
drawn from ``hash(seed, i)``. After two tokens the rest of the sequence is determined, so
loss falls quickly from ln(vocab) and a stalled or poisoned run is easy to see.

Samples are drawn in index order; blacklisted indices are skipped. The sampler's whole
state is one integer (the next index to consider), which checkpoints carry.
"""

from __future__ import annotations

from typing import Iterable

import torch

STRIDES = (1, 2, 3, 5)


class TinyCorpus:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0):
        if vocab_size < 8:
            raise ValueError(f"vocab_size must be >= 8, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed

    def sample(self, index: int) -> torch.Tensor:
        """Tokens of sample ``index``: ``seq_length + 1`` ints (inputs and shifted labels)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.vocab_size, (1,), generator=gen))
        stride = STRIDES[int(torch.randint(0, len(STRIDES), (1,), generator=gen))]
        return (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size

    def batch(self, indices: Iterable[int]) -> dict[str, torch.Tensor]:
        seqs = torch.stack([self.sample(i) for i in indices])
        return {"tokens": seqs[:, :-1].contiguous(), "labels": seqs[:, 1:].contiguous()}


class Sampler:
    """Hands out the sample indices of each global batch, skipping blacklisted ones."""

    def __init__(self, global_batch: int, blacklist: Iterable[int] = ()):
        self.global_batch = global_batch
        self.blacklist = set(blacklist)
        self.position = 0

    def next_global_batch(self) -> list[int]:
        picked = []
        while len(picked) < self.global_batch:
            if self.position not in self.blacklist:
                picked.append(self.position)
            self.position += 1
        return picked

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
