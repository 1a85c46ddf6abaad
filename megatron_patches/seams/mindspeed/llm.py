"""MindSpeed-LLM's training loop: a rollback's ``iterations_to_skip`` taken effect in ``train_step``.

A rollback restart asks Megatron-LM to skip the incident iterations through
``args.iterations_to_skip`` (:mod:`megatron_patches.seams.megatron_lm.rollback`). Megatron-LM's own
loop reads that list and never calls ``train_step`` for a listed iteration: it drains the
iteration's micro-batches from the data iterator (``dummy_train_step``), counts the iteration and
adds its global batch to ``consumed_train_samples`` and ``skipped_train_samples``, and goes on.

MindSpeed-LLM replaces that loop (``mindspeed_llm.training.training.train``, read at its tag 26.0.0,
megatron-core 0.12.1) with one that does not read ``iterations_to_skip``: for every iteration it sets
``args.curr_iteration``, calls the ``train_step`` it bound by name, then counts the iteration and adds
the global batch to ``consumed_train_samples`` itself, and logs ``(skipped_iter, loss_dict)`` through
its ``training_log``.

So a ``train_step`` call for a listed iteration means the calling loop did not skip it, whichever loop
that is; :func:`listed` says so, and :func:`skip` does what Megatron-LM's loop would have done that
the calling loop does not: drain the micro-batches, count the skipped samples, and return what
``train_step`` returns for a skipped update (no loss, ``skipped_iter`` 1, no norm), so that the loop
counts and logs the iteration as skipped. Under Megatron-LM's own loop neither ever runs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("megatron_patches")


def listed(args: Any, core_version: tuple) -> bool:
    """Whether the iteration ``train_step`` is called for (``args.curr_iteration``, 0-based) is one
    Megatron-LM's loop would have skipped: up to core 0.16 it tests the 0-based index, from 0.17
    on the number it logs (``iteration + 1``)."""
    skips = getattr(args, "iterations_to_skip", None)
    if not skips:
        return False
    index = int(args.curr_iteration)
    return (index + 1 if core_version >= (0, 17) else index) in skips


def skip(args: Any, data_iterator: Any, core_version: tuple) -> tuple:
    """Skip the listed iteration as Megatron-LM's loop does, from inside ``train_step``; returns
    ``train_step``'s result for a skipped update (7 values up to core 0.15, 8 from 0.16)."""
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training.training import dummy_train_step

    dummy_train_step(data_iterator)
    batch = mpu.get_data_parallel_world_size() * int(args.micro_batch_size) * get_num_microbatches()
    args.skipped_train_samples = int(getattr(args, "skipped_train_samples", 0) or 0) + batch
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        log.warning("iteration %d skipped (iterations_to_skip, from the rollback): the training loop "
                    "calling train_step does not read iterations_to_skip (MindSpeed-LLM's), so "
                    "megatron_patches drained its %d micro-batches and returned a skipped step",
                    int(args.curr_iteration) + 1, get_num_microbatches())
    # loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad
    result: tuple = ({}, 1, False, False, 0, None, None)
    return result + (None,) if core_version >= (0, 16) else result  # + log_max_attention_logit
