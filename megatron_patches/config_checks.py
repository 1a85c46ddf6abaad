"""The bounds of the configuration's fields: each takes a value and returns what is wrong with
it, or None. A field names its bound in its metadata (``field(metadata={"check": share})``);
``config_load`` applies them and turns an answer into one line naming the key."""

from __future__ import annotations

from typing import Any, Optional

from .safe_mode import KNOWN as KNOWN_FEATURES
from .safe_mode import unknown as unknown_features


def positive(value: Any) -> Optional[str]:
    if value is not None and not value > 0:
        return "must be > 0"
    return None


def at_least_one(value: Any) -> Optional[str]:
    if value is not None and value < 1:
        return "must be >= 1"
    return None


def fraction(value: Any) -> Optional[str]:
    if value is not None and not 0 < value < 1:
        return "must be between 0 and 1 (exclusive)"
    return None


def patterns(value: Any) -> Optional[str]:
    if not value or not all(isinstance(item, str) and item for item in value):
        return "must be a non-empty list of non-empty names or fnmatch patterns"
    return None


def known_features(value: Any) -> Optional[str]:
    names = unknown_features(value or ())
    if names:
        return f"names no feature the guard can switch off ({', '.join(names)}); known: {', '.join(KNOWN_FEATURES)}"
    return None


def known_feature_stages(value: Any) -> Optional[str]:
    return known_features([name for stage in value or () for name in stage])


def above_one(value: Any) -> Optional[str]:
    if value is not None and not value > 1:
        return "must be > 1"
    return None


def share(value: Any) -> Optional[str]:
    if value is not None and not 0 < value <= 1:
        return "must be > 0 and <= 1"
    return None


def non_negative(value: Any) -> Optional[str]:
    if value is not None and value < 0:
        return "must be >= 0"
    return None


def exit_status(value: Any) -> Optional[str]:
    if value is not None and not 3 <= value <= 255:
        return "must be an exit status from 3 to 255 (0 is success, 1 a crash, 2 a refusal)"
    return None


def http_url(value: Any) -> Optional[str]:
    if value is not None and not value.startswith(("http://", "https://")):
        return "must be an http:// or https:// URL"
    return None
