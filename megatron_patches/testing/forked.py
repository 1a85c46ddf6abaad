"""A rank forked from a running Python process (pytest, the campaign) made to start as a fresh one would.

A fork inherits its parent's standard streams, logging handlers (pytest's capture, the campaign's
console), ``MEGATRON_PATCHES_CONFIG`` and torch's thread count. The test vehicles fork ranks with
their imports done to save the start-up; :func:`become_fresh` puts back what a new interpreter would
have, so the rank's output and behaviour are those of a launched process.
"""

from __future__ import annotations

import logging
import os
import signal
import sys


def become_fresh(log_fd: int) -> None:
    """Send stdout and stderr to ``log_fd``, take the parent's logging handlers out (the root at
    WARNING, the guard's console handler on the new stderr), forget the parent's guard config file,
    restore SIGTERM's default and run torch on one intra-op thread."""
    import torch

    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for handler in logging.getLogger("megatron_patches").handlers:
        if type(handler) is logging.StreamHandler:
            handler.setStream(sys.stderr)
    os.environ.pop("MEGATRON_PATCHES_CONFIG", None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)
