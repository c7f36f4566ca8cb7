"""Argument checks shared by the core's modules (private).

The core's callers are engine integrations that pass times from a monotonic clock; a NaN or an
infinity would poison a heap or a ``max()`` silently, so every time is checked where it enters.
"""

from __future__ import annotations

import math
from typing import NoReturn

from kvframe.errors import ConfigError, LeaseError

__all__ = ["check_config_seconds", "check_now", "is_real"]


def is_real(value: object) -> bool:
    """True for an ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_now(value: object, name: str = "now") -> float:
    """``value`` as a float if it is a finite number of seconds; else :class:`LeaseError`."""
    if not is_real(value) or not math.isfinite(value):  # type: ignore[arg-type]
        _bad_time(name, value)
    return float(value)  # type: ignore[arg-type]


def _bad_time(name: str, value: object) -> NoReturn:
    raise LeaseError(
        f"{name} must be a finite number of seconds on the caller's monotonic clock, "
        f"got {value!r} ({type(value).__name__})"
    )


def check_config_seconds(key: str, value: object, *, allow_zero: bool = False) -> float:
    """``value`` as a float if it is a finite, positive number of seconds (or zero when
    ``allow_zero``); else :class:`ConfigError` naming ``key`` and the value."""
    if not is_real(value):
        raise ConfigError(
            f"{key} must be a number of seconds (int or float, not bool), "
            f"got {value!r} ({type(value).__name__})"
        )
    f = float(value)  # type: ignore[arg-type]
    if not math.isfinite(f):
        raise ConfigError(f"{key} must be finite, got {value!r}")
    if f < 0 or (f == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key} must be {bound} seconds, got {value!r}")
    return f
