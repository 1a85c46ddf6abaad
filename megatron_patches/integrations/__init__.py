"""Glue for training loops that are not ours: each module holds the wrappers and state for one.

- :mod:`.megatron_lm`: Megatron-LM's ``pretrain_gpt.py`` loop (``megatron.training``): the
  wrappers and the per-process session; :mod:`.megatron_lm_rollback` applies the ledger at a
  restart, :mod:`.megatron_lm_checkpoints` marks the checkpoints and keeps the guard's state in them.
- :mod:`.mindspeed`: MindSpeed's optimizer variants (undoing ``--reuse-fp32-param`` on a skip).

Importing this package changes nothing; the wrappers are installed through the patch registry.
"""
