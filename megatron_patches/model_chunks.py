"""The model chunks each optimizer was built for: what names a parameter in a finding.

``get_megatron_optimizer`` sees both the model chunks and the optimizer; its wrapper
(:func:`megatron_patches.hooks.register_model`) records them here, and the check, the seams and
the recovery executor look them up. Keyed weakly: an optimizer that goes away takes its entry.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

_by_optimizer: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def remember(optimizer: Any, chunks: list) -> None:
    """``chunks`` are what ``optimizer`` (and each leaf of a ChainedOptimizer) steps."""
    _by_optimizer[optimizer] = chunks
    for leaf in getattr(optimizer, "chained_optimizers", ()):
        _by_optimizer[leaf] = chunks


def chunks_for(optimizer: Any) -> Optional[list]:
    """The model chunks ``optimizer`` was built for, if recorded."""
    return _by_optimizer.get(optimizer)


def known() -> list[list]:
    """The model-chunk lists of every optimizer recorded, each once."""
    seen, out = set(), []
    for chunks in list(_by_optimizer.values()):
        if id(chunks) not in seen:
            seen.add(id(chunks))
            out.append(chunks)
    return out
