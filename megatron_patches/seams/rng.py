"""Every random-number generator a training step draws from, as one value to save and restore
(checkpoints, fault scenes, replays, in-memory snapshots). A seam: it reads megatron-core's
CUDA RNG tracker."""

from __future__ import annotations

import random

import torch


def rng_state() -> dict:
    """Every RNG a training step draws from, on this rank."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (on the same rank)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
