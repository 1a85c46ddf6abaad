"""Install and remove the wrappers declared in :mod:`.targets`.

Wrap, don't replace: each target is wrapped with ``wrapt.FunctionWrapper`` around the raw
object taken from the owner's ``__dict__`` (so staticmethods, classmethods and subclasses keep
working). Installing twice adds nothing; uninstalling restores only what is still ours and
says who patched on top otherwise.

Beside a patch manager that replaces functions after us (MindSpeed's, see
:mod:`megatron_patches.seams.mindspeed`), the first call of any of our wrappers checks
that every target still calls the hooks and wraps again what was replaced, saying so in one line;
MindSpeed's ``apply_patches`` (run again by its ``repatch()``) is followed by the same check.
Copies of a target bound by name in the modules of :data:`~.mindspeed.BINDING_MODULES`
are found by identity and wrapped too.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import wrapt

from .. import versions
from ..errors import UnsupportedVersionError
from . import mindspeed, start_line
from .marks import _our_wrapper, already_hooked
from .parallel import megatron_core_version
from .targets import BRIDGE_TARGETS, MEGATRON_CORE_SUPPORTED, TARGETS, TRAINING_TARGETS, PatchTarget

log = logging.getLogger("megatron_patches")

@dataclass
class _Installed:
    target: PatchTarget
    owner: Any
    name: str
    original: Any
    wrapper: Any


_installed: list[_Installed] = []
_first_call_seen = False
_unwatch: list[Any] = []


def check_version(spec: str = MEGATRON_CORE_SUPPORTED, version: Optional[str] = None) -> str:
    """Return the installed megatron-core version, or raise if it is outside ``spec``."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = version or megatron_core_version()
    if Version(version) not in SpecifierSet(spec):
        named = versions.refusal(version)
        if named:
            raise UnsupportedVersionError(named)
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


def _current(owner: Any, name: str) -> Any:
    return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)


def _wrap(target: PatchTarget, owner: Any, name: str, original: Any) -> Any:
    wrapped = wrapt.FunctionWrapper(original, _checked(target.resolve()))
    wrapped._self_megatron_patches = True
    setattr(owner, name, wrapped)
    _installed.append(_Installed(target, owner, name, original, wrapped))
    return wrapped


def _checked(wrapper: Any) -> Any:
    """``wrapper`` preceded, on the first call of any of ours, by :func:`rewrap_replaced`."""
    def call(wrapped, instance, args, kwargs):
        global _first_call_seen
        if not _first_call_seen:
            _first_call_seen = True
            _unwatch.extend(filter(None, [mindspeed.watch_patch_manager(_after_patch_manager)]))
            rewrap_replaced("after megatron_patches.apply: " + mindspeed.ORDER_HINT)
        return wrapper(wrapped, instance, args, kwargs)

    call.__name__ = call.__qualname__ = getattr(wrapper, "__name__", "wrapper")
    return call


def _after_patch_manager() -> None:
    rewrap_replaced("by MindSpeed's patch manager (apply_patches, e.g. from repatch())")


def _where(item: _Installed) -> str:
    owner = item.owner
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{item.name}"
    return f"{getattr(owner, '__name__', owner)}.{item.name}"


def replaced_targets() -> list[str]:
    """Where a binding of ours no longer calls the hooks (``module.Class.name``), in install order."""
    return [_where(item) for item in _installed if not already_hooked(_current(item.owner, item.name))]


def rewrap_replaced(when: str) -> list[str]:
    """Wrap again every target replaced since we installed (one warning line naming them and
    who replaced them); returns the dotted paths wrapped again."""
    redone, by = [], set()
    fresh: dict[int, Any] = {}
    for item in list(_installed):
        current = _current(item.owner, item.name)
        if current is None or already_hooked(current):
            continue
        by.add(getattr(current, "__module__", None) or type(current).__module__)
        _installed.remove(item)
        if id(current) in fresh:  # an alias bound to the same replacement: share its wrapper
            setattr(item.owner, item.name, fresh[id(current)])
            _installed.append(_Installed(item.target, item.owner, item.name, current, fresh[id(current)]))
        else:
            fresh[id(current)] = _wrap(item.target, item.owner, item.name, current)
        redone.append(item.target.dotted)
    if redone:
        log.warning("%s replaced (by %s); wrapped again around the replacement (%s)",
                    ", ".join(sorted(set(redone))), " ".join(sorted(b for b in by if b)) or "?", when)
    return redone


def _bind_copies(target: PatchTarget, original: Any, wrapped: Any) -> None:
    """Rebind copies of ``original`` held, under any name, by the modules of BINDING_MODULES
    that are imported (an identity scan of a few named modules, never all of sys.modules)."""
    for module_name in mindspeed.BINDING_MODULES:
        mod = sys.modules.get(module_name)
        if mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, attr, wrapped)
                _installed.append(_Installed(target, mod, attr, original, wrapped))
                log.info("%s: rebound %s.%s too", target.dotted, module_name, attr)


def install(version: Optional[str] = None, say_now: bool = True) -> list[str]:
    """Wrap every registry target; returns the dotted paths wrapped now. Idempotent.
    ``say_now``: log the one start line now; False holds it until the training has built its
    optimizer (:mod:`.start_line`: what the guard's runtime does)."""
    version = check_version(version=version)
    if _installed:
        return []
    global _first_call_seen
    _first_call_seen = False
    hint = mindspeed.order_problem()
    if hint:
        log.warning("%s", hint)
    _unwatch.extend(filter(None, [mindspeed.watch_patch_manager(_after_patch_manager)]))
    done, absent = [], []
    for target in TARGETS + TRAINING_TARGETS:
        check_version(target.versions, version)
        try:
            wrapped = _install_target(target, version)
        except ImportError as exc:
            if target.required:
                raise
            log.debug("%s skipped: %s is not importable here (%s)", target.dotted, target.module, exc)
            absent.append(target.module)
            continue
        if wrapped:
            done.append(target.dotted)
    for target in BRIDGE_TARGETS:
        _after_import(target.module, lambda target=target: _install_lazy(target, version))
    if done:
        packages = sorted({module.rsplit(".", 1)[0] for module in absent})
        start_line.hold(start_line.wrapped_text(version, len(done), packages))
        if say_now:
            start_line.say(final=True)
    return done


def _install_target(target: PatchTarget, version: str) -> bool:
    """Wrap one target (and its aliases); False where it is already hooked or absent."""
    owner, name = _resolve(target.module, target.qualname)
    original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
    if original is None:
        log.warning("%s not found in megatron-core %s; nothing patched there", target.dotted, version)
        return False
    raw = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
    if any(item.wrapper is raw for item in _installed):  # bound by name from a module wrapped before
        return False
    leftover = _our_wrapper(raw)
    if leftover is not None:  # ours from an earlier install, put back by another patcher
        original = leftover.__wrapped__
    elif already_hooked(raw):
        log.info("%s already calls the hooks (source patch); left as is", target.dotted)
        return False
    wrapped = _wrap(target, owner, name, original)
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
    _bind_copies(target, original, wrapped)
    log.debug("patched %s (%s)", target.dotted, target.why)
    return True


def _install_lazy(target: PatchTarget, version: str) -> None:
    """A lazy target, once its module is imported (a failure is said and the run goes on unwrapped there)."""
    try:
        _install_target(target, version)
    except (ImportError, AttributeError) as exc:
        log.warning("%s not wrapped (%s): this loop's %s runs unguarded", target.dotted, exc, target.qualname)


class LoaderAround(importlib.abc.Loader):
    """A module's own loader, with its execution handed to ``around(module, execute)``, which must
    call ``execute()`` once: what runs before and after it is the caller's."""

    def __init__(self, loader: Any, around: Any) -> None:
        self._loader, self._around = loader, around

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._around(module, lambda: self._loader.exec_module(module))


def spec_around(fullname: str, path: Any, around: Any) -> Any:
    """The module's spec from the path, its loader wrapped in :class:`LoaderAround`; None if not found."""
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return None
    spec.loader = LoaderAround(spec.loader, around)
    return spec


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module is executed, never importing it itself."""

    def __init__(self) -> None:
        self.waiting: dict[str, list] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        callbacks = self.waiting.pop(fullname, None)
        if callbacks is None:
            return None

        def then(module: Any, execute: Any) -> None:
            execute()
            for callback in callbacks:
                callback()

        return spec_around(fullname, path, then)


def _after_import(module: str, callback: Any) -> None:
    """``callback()`` now if ``module`` is imported, else once it is."""
    if module in sys.modules:
        callback()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    if finder is None:
        finder = _AfterImport()
        sys.meta_path.insert(0, finder)
    finder.waiting.setdefault(module, []).append(callback)


def uninstall() -> None:
    """Restore every original that is still wrapped by us (bound through getattr or not)."""
    for finder in [f for f in sys.meta_path if isinstance(f, _AfterImport)]:
        sys.meta_path.remove(finder)
    while _unwatch:
        _unwatch.pop()()
    while _installed:
        item = _installed.pop()
        current = _current(item.owner, item.name)
        ours = _our_wrapper(current)
        if current is item.wrapper or ours is item.wrapper:
            setattr(item.owner, item.name, item.original)
        elif ours is not None:  # an earlier wrapper of ours that another patcher's removal put back
            setattr(item.owner, item.name, ours.__wrapped__)
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
