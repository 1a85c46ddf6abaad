"""The guard's one line at the default log level: what it wraps, and what a rollback may hold.

:func:`megatron_patches.seams.patching.install` composes the line when the patches go in, but it
is said when the training has built its optimizer, so that it can carry what only the built
state tells: in Megatron-LM's loop under ``recovery.mode: in_process`` the host memory the
in-memory snapshots may take. Said once per installation, on rank 0 (the logger's level there):

    install            hold(text)
    any loop           get_megatron_optimizer returned -> say()
    Megatron-LM's loop setup_model_and_optimizer starts -> defer(): the optimizer's say() waits;
                       get_optimizer_param_scheduler (the executor of rollbacks made) -> say(detail)
                       setup_model_and_optimizer returns -> say() if nothing said it yet
"""

from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("megatron_patches")

_held: Optional[str] = None
_deferred = False


def wrapped_text(version: str, wrapped: int, absent: list[str]) -> str:
    """The line's first part: ``guarding megatron-core 0.19.2: 24 targets wrapped; ...``;
    ``absent``: the packages whose targets were skipped (not importable)."""
    skipped = f", {', '.join(absent)} absent (its targets skipped)" if absent else ""
    return f"guarding megatron-core {version}: {wrapped} targets wrapped{skipped}; log_level debug lists each and why"


def memory_text(interval: int, kept: int, largest_bytes: float) -> str:
    """What the in-process rollback adds: how often snapshots are taken and the host memory they may
    hold on the rank holding most (``kept`` copies of its largest state)."""
    return (f"; in-memory snapshots every {interval} iterations, {kept} kept: at most "
            f"{kept * largest_bytes / 2**20:.1f} MiB of host memory per rank")


def hold(text: str) -> None:
    """The line to say once the optimizer is built."""
    global _held, _deferred
    _held, _deferred = text, False


def defer() -> None:
    """Megatron-LM's setup is building the model and optimizer: wait for its scheduler hook."""
    global _deferred
    _deferred = True


def say(detail: str = "", *, final: bool = False) -> None:
    """Say the held line (with ``detail`` after it), once; ``final``: even while deferred."""
    global _held
    if _held is None or (_deferred and not final):
        return
    text, _held = _held, None
    log.info("%s%s", text, detail)


def held() -> Optional[str]:
    """The line not said yet (None once said, or before the patches went in)."""
    return _held
