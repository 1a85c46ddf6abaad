"""Turning a YAML file or a mapping into the config dataclasses, and keeping secrets out of it.

``config.py`` holds what a user sets (the dataclasses, their defaults, a docstring and a
bound per field); this module holds the machinery that is the same for every field: where
the file is found, how it is read, and how a mapping is checked and converted against a
dataclass's type hints (``build``), plus the redaction of webhook URLs its messages need.

The dependency runs one way: nothing here imports ``config.py``. ``build`` works on any
frozen dataclass passed to it, so ``Config.from_dict`` calls it with a top-level import and
no cycle; ``load_config`` stays beside ``Config`` because it returns one. ``config.py``
re-exports the public names below, so ``from megatron_patches.config import ...`` is the one
import users need.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
import urllib.parse
from typing import Any, Literal, Optional

from .errors import ConfigError

ENV_VAR = "MEGATRON_PATCHES_CONFIG"


def config_path(path: Optional[str] = None) -> Optional[str]:
    """``path``, else $MEGATRON_PATCHES_CONFIG, else None (the defaults)."""
    return path if path is not None else os.environ.get(ENV_VAR) or None


def read_config_file(path: str) -> dict:
    """The mapping in the YAML file at ``path`` (not yet validated); any file that is not one
    (missing, a directory, unreadable, not UTF-8, not YAML, not a mapping) is a ConfigError."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist (set {ENV_VAR} to a YAML file)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a directory; pass the YAML file inside it") from None
    except OSError as exc:
        raise ConfigError(f"config file {path!r} cannot be read ({exc.strerror or exc}); "
                          f"check its permissions") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {exc.start}); "
                          f"save it as UTF-8 YAML") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping at the top level, got {type(data).__name__}")
    return {} if data is None else data


def redact_url(url: str) -> str:
    """``url`` with only its scheme and host left (``https://hooks.example/…``): webhook URLs
    carry their token in the path, the query or the user part, so nothing else is shown."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme and parts.netloc:
        return f"{parts.scheme}://{parts.hostname or '…'}/…"
    host = url.split("/", 1)[0].split("?", 1)[0].rsplit("@", 1)[-1].strip()
    return f"{host or '…'}/…"


def redacted(data: dict) -> dict:
    """A copy of a config mapping (as ``dataclasses.asdict`` gives) with every webhook URL cut to
    its host, for files and messages a person reads."""
    out = copy.deepcopy(data)
    for hook in (out.get("alerts") or {}).get("webhooks") or []:
        if isinstance(hook, dict) and isinstance(hook.get("url"), str):
            hook["url"] = redact_url(hook["url"])
    return out


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """An instance of the dataclass ``cls`` from ``data``, every key checked and converted.

    Unknown keys, wrong types and values a field's ``metadata["check"]`` refuses are
    ConfigErrors naming the key path (``prefix`` + name); a field marked
    ``metadata["secret"]`` never has its value shown. Nested dataclasses are built the same way.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"`{prefix.rstrip('.') or 'config'}` must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if not isinstance(key, str):
            where = prefix.rstrip(".") or "the top level"
            raise ConfigError(f"config key {key!r} at {where} is not a name (YAML read it as "
                              f"{type(key).__name__}); valid keys: {', '.join(sorted(known))}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = prefix.rstrip(".") or "the top level"
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s} at {where}; valid keys: {', '.join(sorted(known))}"
        )
    values = {}
    for name, value in data.items():
        where = prefix + name
        secret = known[name].metadata.get("secret", False)
        try:
            converted = _convert(hints[name], value, where)
        except ConfigError:
            if not secret:
                raise
            raise ConfigError(f"`{where}` must be {_describe(hints[name])} (the value is not shown: it may "
                              "hold a token)") from None
        check = known[name].metadata.get("check")
        problem = check(converted) if check else None
        if problem:
            shown = redact_url(value) if secret else value  # a webhook URL holds its token
            raise ConfigError(f"`{where}` {problem}, got {shown!r}")
        values[name] = converted
    return cls(**values)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + " or null"
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    wrong = ConfigError(f"`{where}` must be {_describe(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise wrong
        return build(tp, value, where + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner[0], value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise wrong
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise wrong
        item = typing.get_args(tp)[0]
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong
        return value
    if tp is float:
        return _to_float(value, where, wrong)
    if tp is str:
        if not isinstance(value, str):
            raise wrong
        return value
    raise TypeError(f"unsupported config type {tp!r} at {where}")


def _to_float(value: Any, where: str, wrong: ConfigError) -> float:
    """A float key's value as a finite float; ``wrong`` is the type error to raise."""
    if isinstance(value, str):
        # PyYAML reads 1.0e6 (no sign after e) as a string; take it as the number meant.
        try:
            number = float(value)
        except ValueError:
            raise wrong from None
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong
    else:
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            number = math.inf
    if not math.isfinite(number):
        # NaN compares false with every bound, so it would switch a check off silently.
        raise ConfigError(f"`{where}` must be a finite number, got {value!r}; "
                          f"use a finite value (or null where the key allows switching it off)")
    return number
