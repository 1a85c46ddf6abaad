"""Install and remove the wrappers declared in :mod:`.registry`.

Wrap, don't replace: each target is wrapped with ``wrapt.FunctionWrapper`` around the raw
object taken from the owner's ``__dict__`` (so staticmethods, classmethods and subclasses keep
working). Installing twice adds nothing; uninstalling restores only what is still ours and
says who patched on top otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import wrapt

from .. import versions
from ..errors import UnsupportedVersionError
from .registry import MEGATRON_CORE_SUPPORTED, TARGETS, TRAINING_TARGETS, PatchTarget

log = logging.getLogger("megatron_patches")

_MARK = "__megatron_patches__"


@dataclass
class _Installed:
    target: PatchTarget
    owner: Any
    name: str
    original: Any
    wrapper: Any


_installed: list[_Installed] = []


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_version(spec: str = MEGATRON_CORE_SUPPORTED, version: Optional[str] = None) -> str:
    """Return the installed megatron-core version, or raise if it is outside ``spec``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = version or megatron_core_version()
    if Version(version) not in SpecifierSet(spec):
        raise UnsupportedVersionError(
            f"megatron-core {version} is not supported by megatron_patches (supported: {spec}, "
            f"that is {versions.supported_lines()}); install a supported release, e.g. "
            f"pip install '{versions.requirement()}'"
        )
    return version


def _resolve(module_name: str, qualname: str) -> tuple[Any, str]:
    owner: Any = importlib.import_module(module_name)
    *parents, name = qualname.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def _already_hooked(obj: Any) -> bool:
    """True when the object already calls our hooks (source patch, or our own wrapper)."""
    return bool(getattr(obj, _MARK, False)) or isinstance(obj, wrapt.FunctionWrapper) and getattr(
        obj, "_self_megatron_patches", False
    )


def install(version: Optional[str] = None) -> list[str]:
    """Wrap every registry target; returns the dotted paths wrapped now. Idempotent."""
    version = check_version(version=version)
    if _installed:
        return []
    done = []
    for target in TARGETS + TRAINING_TARGETS:
        check_version(target.versions, version)
        try:
            owner, name = _resolve(target.module, target.qualname)
        except ImportError as exc:
            if target.required:
                raise
            log.info("%s skipped: %s is not importable here (%s)", target.dotted, target.module, exc)
            continue
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        if original is None:
            log.warning("%s not found in megatron-core %s; nothing patched there",
                        target.dotted, version)
            continue
        raw = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
        if _already_hooked(raw):
            log.info("%s already calls the hooks (source patch); left as is", target.dotted)
            continue
        wrapped = wrapt.FunctionWrapper(original, target.wrapper)
        wrapped._self_megatron_patches = True
        setattr(owner, name, wrapped)
        _installed.append(_Installed(target, owner, name, original, wrapped))
        for alias in target.aliases:
            try:
                mod = importlib.import_module(alias)
            except ImportError:
                log.debug("%s: alias %s not importable; skipped", target.dotted, alias)
                continue
            # Importing the alias just now may already have bound the wrapper: record it as ours.
            if getattr(mod, name, None) in (original, wrapped):
                setattr(mod, name, wrapped)
                _installed.append(_Installed(target, mod, name, original, wrapped))
        log.info("patched %s (%s)", target.dotted, target.why)
        done.append(target.dotted)
    return done


def uninstall() -> None:
    """Restore every original that is still wrapped by us."""
    while _installed:
        item = _installed.pop()
        current = item.owner.__dict__.get(item.name) if isinstance(item.owner, type) else getattr(item.owner, item.name)
        if current is item.wrapper:
            setattr(item.owner, item.name, item.original)
        else:
            log.warning(
                "%s was patched again on top of ours (now %r); leaving it in place",
                item.target.dotted, current,
            )


def installed_targets() -> list[str]:
    return sorted({i.target.dotted for i in _installed})


@contextlib.contextmanager
def patched() -> Iterator[list[str]]:
    """Install for the duration of a block (tests); restores the previous state after."""
    was = bool(_installed)
    names = install()
    try:
        yield names
    finally:
        if not was:
            uninstall()
