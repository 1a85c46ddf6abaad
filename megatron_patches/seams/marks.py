"""How to tell that an object already calls the hooks: a function the source patch decorated
(marked ``__megatron_patches__``), one of our wrappers, bound or not, or a decorator keeping one of
those in its ``__wrapped__`` chain. Plain predicates, importable by the seams without the patcher."""

from __future__ import annotations

from typing import Any

import wrapt

_MARK = "__megatron_patches__"


def _our_wrapper(obj: Any) -> Any:
    """Our ``FunctionWrapper`` when ``obj`` is one, or a ``BoundFunctionWrapper`` made from one
    (what ``getattr(cls, name)`` returns: MindSpeed's patch manager captures originals that way,
    and puts that object back on the class when it removes its patches); else None."""
    if isinstance(obj, wrapt.FunctionWrapper):
        return obj if getattr(obj, "_self_megatron_patches", False) else None
    if isinstance(obj, wrapt.BoundFunctionWrapper):
        return _our_wrapper(getattr(obj, "_self_parent", None))
    return None


def already_hooked(obj: Any) -> bool:
    """True when the object already calls our hooks: a source patch, our own wrapper (bound or
    not), or a decorator that keeps one of those in its ``__wrapped__`` chain."""
    for _ in range(32):
        if obj is None:
            return False
        if getattr(obj, _MARK, False) or _our_wrapper(obj) is not None:
            return True
        obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else getattr(obj, "__wrapped__", None)
    return False
