"""Turn the guard on and off in a process: config -> monitor -> patches."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from .config import Config, load_config
from .errors import UserError, exit_refused
from .monitor import GradMonitor
from .seams import build_monitor, patching, wrappers

log = logging.getLogger("megatron_patches")


def _setup_logging(config: Config) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[megatron_patches] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    import torch

    # apply runs before torch.distributed starts: the launcher's RANK says who we are then.
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))
    level = getattr(logging, config.log_level.upper())
    # One copy of the informational lines per job, not one per rank.
    log.setLevel(level if rank == 0 else max(level, logging.WARNING))


def install(config: Optional[Config] = None) -> Optional[GradMonitor]:
    """Validate ``config`` (default: $MEGATRON_PATCHES_CONFIG or built-in defaults), install
    the patches and activate a monitor. Returns the monitor, or None when disabled."""
    config = config if config is not None else load_config()
    _setup_logging(config)
    if not config.enabled:
        log.info("disabled by config (enabled: false); nothing patched")
        return None
    monitor = wrappers.get_monitor()
    if monitor is None:
        monitor = build_monitor(config)  # a bad drill spec stops here, before anything is patched
        wrappers.set_monitor(monitor)
    patching.install(say_now=False)  # said once the optimizer is built (seams.start_line)
    return monitor


def install_from_environment() -> Optional[GradMonitor]:
    """What ``import megatron_patches.apply`` runs: :func:`install` with the config
    $MEGATRON_PATCHES_CONFIG names. Input the user must fix (a misspelled key, a bad value or
    drill, an unsupported megatron-core) ends every rank with exit code 2 and one line on rank 0:
    never a traceback per rank, and a restart would meet the same input."""
    try:
        return install()
    except UserError as error:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"[megatron_patches] {error}", file=sys.stderr, flush=True)
        exit_refused(rank)


def uninstall() -> None:
    """Remove the patches and the monitor, and with it everything the run kept (tests, or a loop
    that wants them gone)."""
    patching.uninstall()
    wrappers.set_monitor(None)

