"""Turn the guard on and off in a process: config -> monitor -> patches."""

from __future__ import annotations

import logging
import sys
from typing import Optional

from . import hooks, inject, patching
from .config import Config, load_config
from .monitor import GradMonitor

log = logging.getLogger("megatron_patches")


def _setup_logging(config: Config) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[megatron_patches] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    import os

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
    monitor = hooks.get_monitor()
    if monitor is None:
        # The drills first: a bad spec stops here, before anything is made or patched. Poison
        # drills ask the guard which step and rank a sample is fed on.
        inject.install(config.inject, clock=lambda: (monitor.upcoming_step(), monitor.rank))
        monitor = GradMonitor(config)
        hooks.set_monitor(monitor)
    patching.install()
    return monitor


def uninstall() -> None:
    """Remove the patches and the monitor (tests, or a loop that wants them gone)."""
    patching.uninstall()
    hooks.set_monitor(None)
    inject.uninstall()

