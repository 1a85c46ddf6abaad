"""``python -m megatron_patches.tiny_gpt``: the command line of the tiny-GPT test harness.

The harness (arguments, model, training loop, data) lives in :mod:`megatron_patches.testing`;
this entry keeps the documented command, its flags and its outputs where users, docs and
scripts call them. ``--help`` lists the flags.
"""

from .testing.tiny_gpt import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    from .testing.process_end import run_then_end

    run_then_end(main)
