"""The harness's data: a synthetic corpus (default) or real text, each with a stable index per sample.

:class:`TinyCorpus`: sample ``i`` is an arithmetic sequence modulo the vocabulary: a start token and a stride
drawn from ``hash(seed, i)``. After two tokens the rest of the sequence is determined, so
loss falls quickly from ln(vocab) and a stalled or poisoned run is easy to see.

:class:`TextCorpus` reads real text instead (``--data text:PATH``): byte-level tokens.

Samples are drawn in index order; blacklisted indices are skipped. The sampler's whole
state is one integer (the next index to consider), which checkpoints carry.
"""

from __future__ import annotations

import os
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


class TextCorpus:
    """Byte-level tokens (vocabulary 256) of the UTF-8 text files under a path.

    ``path`` is a file or a directory walked in sorted order (names compared as strings,
    directories and files alike), so the same tree always gives the same bytes. A file counts
    as text when it decodes as UTF-8 and holds no NUL byte; others are passed over. At most
    ``max_bytes`` are read: the walk stops there and the last file is cut (``truncated`` says
    so). The bytes are concatenated and split into windows of ``seq_length + 1``; sample ``i``
    is window ``order[i % windows]``, ``order`` a permutation drawn from ``seed``, so a sample
    index always names the same tokens (blacklists and batch records keep their meaning) and
    neighbouring indices come from different places in the text.
    """

    vocab_size = 256

    def __init__(self, path: str, seq_length: int, seed: int = 0, max_bytes: int = 32 * 2**20):
        from ..errors import UserError

        if not os.path.exists(path):
            raise UserError(f"--data text:{path}: no such file or directory")
        self.path, self.seq_length, self.seed, self.max_bytes = path, seq_length, seed, max_bytes
        chunks, size, self.files, self.truncated = [], 0, 0, False
        for name in _walk_sorted(path):
            if size >= max_bytes:
                self.truncated = True
                break
            data = _read_text(name)
            if data is None:
                continue
            if size + len(data) > max_bytes:
                data, self.truncated = data[:max_bytes - size], True
            chunks.append(data)
            size += len(data)
            self.files += 1
        if not self.files:
            raise UserError(f"--data text:{path}: no UTF-8 text files there")
        self.size = size
        self.windows = size // (seq_length + 1)
        if self.windows < 1:
            raise UserError(f"--data text:{path}: {size} bytes of text, fewer than one sample needs "
                            f"(--seq {seq_length} + 1 = {seq_length + 1})")
        self.tokens = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
        self.order = torch.randperm(self.windows, generator=torch.Generator().manual_seed(seed))

    def describe(self) -> str:
        """One line for the log: what was read, and whether the size bound cut it."""
        mib = self.size / 2**20
        line = f"data: {mib:.1f} MiB of text from {self.files} file(s) under {self.path}, {self.windows} samples"
        if self.truncated:
            line += f"; cut at the --data-max-mib bound ({self.max_bytes / 2**20:g} MiB), the rest is not read"
        return line

    def sample(self, index: int) -> torch.Tensor:
        start = int(self.order[index % self.windows]) * (self.seq_length + 1)
        return self.tokens[start:start + self.seq_length + 1].long()

    def batch(self, indices: Iterable[int]) -> dict[str, torch.Tensor]:
        seqs = torch.stack([self.sample(i) for i in indices])
        return {"tokens": seqs[:, :-1].contiguous(), "labels": seqs[:, 1:].contiguous()}


def _walk_sorted(path: str):
    """Files under ``path`` (or ``path`` itself) in a fixed order; symlinked directories are not followed."""
    if not os.path.isdir(path):
        yield path
        return
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            yield os.path.join(root, name)


def _read_text(name: str):
    """The file's bytes if it is UTF-8 text without NUL bytes, else None (unreadable files too)."""
    try:
        with open(name, "rb") as handle:
            data = handle.read()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if b"\0" in data else data
