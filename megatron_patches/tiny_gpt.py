"""``python -m megatron_patches.tiny_gpt``: the command line of the tiny-GPT test harness.

The harness (arguments, model, training loop, data) lives in :mod:`megatron_patches.testing`;
this entry keeps the documented command, its flags and its outputs where users, docs and
scripts call them. ``--help`` lists the flags. The installed wheel leaves the harness out
(it is the repository's test vehicle), so there the command says in one line that it needs a
checkout of the repository.
"""

import sys

NEEDS_CHECKOUT = ("the tiny-GPT demo needs a checkout of the repository (its harness, megatron_patches/testing, "
                  "is not part of the installed package): clone the repository and run make demo there")

try:
    from .testing.tiny_gpt import main, parse_args
except ModuleNotFoundError as error:
    if error.name != f"{__package__}.testing":
        raise
    if __name__ == "__main__":
        sys.exit(f"python -m megatron_patches.tiny_gpt: {NEEDS_CHECKOUT}")
    raise ModuleNotFoundError(NEEDS_CHECKOUT, name=error.name) from None

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    from .testing.process_end import run_then_end

    run_then_end(main)
