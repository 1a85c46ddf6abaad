"""How the test vehicles' processes end: without the interpreter's teardown of torch and megatron-core.

Finalizing the modules torch and megatron-core import costs about 2 s of CPU per process on the
development machines (measured: ``import megatron.training.training`` then a normal exit, 2.05 s
after the import; ``os._exit`` at the same point, 0.09 s), and every rank of every test run pays it:
in a two-rank torchrun it is about 2 of the 15 s a six-iteration Megatron-LM run takes.

:func:`run_then_end` keeps what a normal exit does that a run's results depend on (non-daemon
threads joined, ``atexit`` handlers run, logging and the standard streams flushed) and then ends the
process with ``os._exit``. An uncaught exception still ends the normal way, traceback and all. Only
the runners of :mod:`megatron_patches.testing` (``pretrain_cpu``, ``python -m
megatron_patches.tiny_gpt``) end this way; the guard never ends a user's process like this.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Callable, NoReturn


def run_then_end(main: Callable[[], Any]) -> NoReturn:
    """Run ``main()``; end the process with its return value (or its ``SystemExit``) as the exit
    status, as ``sys.exit`` would, minus the module teardown."""
    try:
        result = main()
    except SystemExit as stop:
        result = stop.code
    if isinstance(result, int) and not isinstance(result, bool):
        code = result
    elif result is None or result is False:
        code = 0
    else:  # a message: printed to stderr, status 1, as sys.exit does
        print(result, file=sys.stderr)
        code = 1
    end(code)


def end(code: int) -> NoReturn:
    """End the process with ``code`` once its non-daemon threads finished and ``atexit`` ran."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging.shutdown is one of them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code & 0xFF)
