"""Option checking shared by discovery backends (the built-ins and ``kvframe-etcd``), and
discovery URLs (:func:`parse_discovery_url`: one string for a command line's ``--discovery``).

Every bad option raises :class:`~kvframe.errors.ConfigError` naming the backend, the key and
what to write instead.
"""

from __future__ import annotations

import difflib
import math
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from kvframe.errors import ConfigError

__all__ = ["check_options", "parse_discovery_url", "seconds", "text"]


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


#: Query values of a discovery URL that read as numbers become numbers.
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_discovery_url(url: str) -> tuple[str, dict[str, Any]]:
    """A discovery URL as ``(backend name, options)`` for
    :meth:`~kvframe.runtime.plugins.PluginHost.create_discovery` (one string for a command
    line's ``--discovery``).

    The scheme names the backend; the query gives its options (``?ttl=2&poll_interval=0.05``:
    values that read as numbers become numbers); the rest of the URL, per backend:

    - ``etcd://HOST:PORT[/PREFIX/]`` — ``endpoint`` ``http://HOST:PORT`` (``etcd+https://``:
      ``https``), ``prefix`` the path when given (it must end with ``/``);
    - ``file:///DIRECTORY`` — ``directory``;
    - any other backend (a plugin's) — options from the query only (``consul:?addr=...``).

    ``mem`` lives inside one process and has no URL. Raises
    :class:`~kvframe.errors.ConfigError` naming what is wrong; the backend checks its options
    itself when it is built.
    """
    if not isinstance(url, str) or ":" not in url:
        raise ConfigError(
            f"discovery URL {url!r} has no scheme: write BACKEND://... (for instance "
            "etcd://127.0.0.1:2379 or file:///var/run/kvframe-fleet)"
        )
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if not scheme:
        raise ConfigError(f"discovery URL {url!r} has no scheme: write BACKEND://...")
    if parts.fragment:
        raise ConfigError(f"discovery URL {url!r}: a fragment (#...) means nothing here")
    options: dict[str, Any] = {}
    try:
        query = urllib.parse.parse_qsl(
            parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)
        )
    except ValueError as exc:
        raise ConfigError(f"discovery URL {url!r}: malformed query ({exc})") from None
    for key, value in query:
        if key in options:
            raise ConfigError(f"discovery URL {url!r}: option {key!r} is given twice")
        options[key] = _query_value(value)
    if scheme in ("etcd", "etcd+https", "etcd+http"):
        if not parts.netloc:
            raise ConfigError(
                f"discovery URL {url!r}: give etcd's client address, etcd://HOST:PORT"
            )
        options["endpoint"] = f"{'https' if scheme == 'etcd+https' else 'http'}://{parts.netloc}"
        if parts.path not in ("", "/"):
            options["prefix"] = parts.path
        return "etcd", options
    if scheme == "file":
        if parts.netloc or not parts.path.startswith("/"):
            raise ConfigError(
                f"discovery URL {url!r}: write the directory as an absolute path, "
                "file:///DIRECTORY (three slashes)"
            )
        options["directory"] = parts.path
        return "file", options
    if scheme == "mem":
        raise ConfigError(
            "the mem discovery backend lives inside one process and has no URL: use file:/// "
            "for one host or etcd:// for many"
        )
    if parts.netloc or parts.path:
        raise ConfigError(
            f"discovery URL {url!r}: backend {scheme!r} takes its options from the query only "
            f"({scheme}:?key=value&...)"
        )
    return scheme, options


def _query_value(value: str) -> Any:
    if _NUMBER.fullmatch(value):
        number = float(value)
        if number.is_integer() and re.fullmatch(r"-?\d+", value):
            return int(value)
        return number
    return value
