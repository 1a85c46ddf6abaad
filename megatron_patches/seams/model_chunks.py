"""The model chunks each optimizer was built for: what names a parameter in a finding.

``get_megatron_optimizer`` sees both the model chunks and the optimizer; its wrapper
(:func:`megatron_patches.seams.wrappers.register_model`) records them in the run's :class:`ModelChunks`
(``monitor.state.model_chunks``), and the check, the seams and the recovery executor look them up
there. Keyed weakly: an optimizer or bucket group that goes away takes its entry.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional


class ModelChunks:
    """One run's optimizers -> model chunks, and its DDP bucket groups -> parameters."""

    def __init__(self) -> None:
        self._by_optimizer: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()
        self._by_bucket_group: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()

    def remember(self, optimizer: Any, chunks: list) -> None:
        """``chunks`` are what ``optimizer`` (and each leaf of a ChainedOptimizer) steps."""
        self._by_optimizer[optimizer] = chunks
        for leaf in getattr(optimizer, "chained_optimizers", ()):
            self._by_optimizer[leaf] = chunks

    def chunks_for(self, optimizer: Any) -> Optional[list]:
        """The model chunks ``optimizer`` was built for, if recorded."""
        return self._by_optimizer.get(optimizer)

    def known(self) -> list[list]:
        """The model-chunk lists of every optimizer recorded, each once."""
        seen, out = set(), []
        for chunks in list(self._by_optimizer.values()):
            if id(chunks) not in seen:
                seen.add(id(chunks))
                out.append(chunks)
        return out

    def modules(self) -> list:
        """Every model chunk recorded, flat."""
        return [chunk for chunks in self.known() for chunk in chunks]

    def group_params(self, group: Any) -> list:
        """The parameters of a DDP bucket group's buckets in bucket order, listed once per group
        (they are fixed for the group's life)."""
        params = self._by_bucket_group.get(group)
        if params is None:
            params = self._by_bucket_group[group] = [p for bucket in group.buckets for p in bucket.params_list]
        return params
