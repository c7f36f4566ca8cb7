"""Option checking shared by discovery backends (the built-ins and ``kvframe-etcd``).

Every bad option raises :class:`~kvframe.errors.ConfigError` naming the backend, the key and
what to write instead.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from kvframe.errors import ConfigError

__all__ = ["check_options", "seconds", "text"]


def check_options(
    backend: str, options: Mapping[str, Any], allowed: Iterable[str]
) -> Mapping[str, Any]:
    """Refuse unknown keys (with the closest known one); return ``options`` unchanged."""
    known = sorted(allowed)
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{backend} discovery: unknown option {key!r}{hint} (options: {', '.join(known)})"
            )
    return options


def seconds(
    backend: str, options: Mapping[str, Any], key: str, default: float, *, minimum: float = 0.0
) -> float:
    """Option ``key`` as a finite number of seconds ``> minimum`` (``default`` when absent)."""
    value = options.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= minimum
    ):
        raise ConfigError(
            f"{backend} discovery: option {key!r} must be a number of seconds greater than "
            f"{minimum:g}, got {value!r}"
        )
    return float(value)


def text(backend: str, options: Mapping[str, Any], key: str, default: str | None) -> str:
    """Option ``key`` as a non-empty string; ``default`` when absent (``None``: required)."""
    value = options.get(key, default)
    if value is None:
        raise ConfigError(f"{backend} discovery: option {key!r} is required")
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{backend} discovery: option {key!r} must be a non-empty string, got {value!r}"
        )
    return value
