"""The consistency detector's fingerprint arithmetic (:mod:`.consistency`): each tensor's raw bits
summed as 32-bit integers, and the 80 bits of a fingerprint cut into the 4-bit pieces that ride on
the check's one all-reduce."""

from __future__ import annotations

import torch

_PIECE_BITS = 4
_PIECES = (32 + 48) // _PIECE_BITS  # the squared norm's 32 bits, the checksum's 48


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` read as 32-bit integers and summed modulo 2**32 (0-d int32).

    The result is the exact sum modulo 2**32 whatever the kernel accumulates in, so it does not
    depend on the order of addition, and it runs at the speed of a norm (an int64 sum of the
    same words is several times slower on CPUs). Two-byte tensors are read
    in pairs of elements where aligned (the odd last one alone), eight-byte ones as two halves.
    """
    flat = (t.detach() if t.requires_grad else t).reshape(-1)
    size = flat.dtype.itemsize
    if size in (4, 8):  # eight-byte elements: both 32-bit halves
        return flat.view(torch.int32).sum(dtype=torch.int32)
    if size == 2 and flat.storage_offset() % 2 == 0:  # pairs of elements as 32-bit words
        even = flat.numel() - flat.numel() % 2
        total = flat[:even].view(torch.int32).sum(dtype=torch.int32)
        return total + flat[even:].view(torch.int16).sum(dtype=torch.int32) if even < flat.numel() else total
    if size == 2:  # at an odd offset in a shared buffer: element by element (slower)
        return flat.view(torch.int16).sum(dtype=torch.int32)
    return flat.view(torch.uint8).sum(dtype=torch.int32)


_MASK24 = (1 << 24) - 1


def _pieces(bits: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The fingerprint's 80 bits (``bits``: the squared norm's 32, ``total``: the checksum's 48,
    both int64 0-d) as twenty 4-bit integers."""
    if bits.device not in _SHIFTS:
        shifts = torch.arange(0, 48, _PIECE_BITS, device=bits.device)
        _SHIFTS[bits.device] = (shifts[:32 // _PIECE_BITS], shifts)
    low, shifts = _SHIFTS[bits.device]
    mask = (1 << _PIECE_BITS) - 1
    return torch.cat([(bits >> low) & mask, (total >> shifts) & mask])


_SHIFTS: dict = {}
"""Per device: the pieces' bit offsets (the squared norm's, the checksum's), made once."""


def _tensor_sums(tensors: list) -> torch.Tensor:
    """Per tensor: :func:`_bits_sum`, as int64 (for the weighted sum that follows)."""
    return torch.stack([_bits_sum(t) for t in tensors]).to(torch.int64)
