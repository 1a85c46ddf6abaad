"""megatron-core's process-wide facts the core asks about: the parallel layout (its
``parallel_state`` module: ranks, sizes, groups) and which megatron-core this is.

A seam: :mod:`megatron_patches.naming` and the stages read ranks and layouts from the module
:func:`parallel_state` gives them (through :meth:`~megatron_patches.protocols.Seams.parallel_state`),
so the core imports no ``megatron`` module. Importing this module imports no megatron either.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional


def parallel_state() -> Optional[ModuleType]:
    """megatron-core's ``parallel_state`` once model parallelism is initialized; None before
    ``initialize_model_parallel``, or without a megatron-core that has it (every rank is then
    one rank of each parallel group)."""
    try:
        from megatron.core import parallel_state as ps

        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # pragma: no cover - megatron-core missing or too old
        return None


def megatron_core_version() -> str:
    """The version of the megatron-core that ``import megatron.core`` loads (a source checkout's
    own); ImportError without one."""
    from megatron.core import package_info

    return package_info.__version__


def megatron_core_version_or_none() -> Optional[str]:
    """:func:`megatron_core_version`, None where megatron-core does not import."""
    try:
        return megatron_core_version()
    except ImportError:
        return None
