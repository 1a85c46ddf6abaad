"""Glue for training loops that are not ours: each module holds the wrappers and state for one.

- :mod:`.megatron_lm`: Megatron-LM's ``pretrain_gpt.py`` loop (``megatron.training``).
- :mod:`.mindspeed`: MindSpeed's optimizer variants (undoing ``--reuse-fp32-param`` on a skip).

Importing this package changes nothing; the wrappers are installed through the patch registry.
"""
