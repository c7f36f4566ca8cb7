"""``kv_connector_extra_config`` of the offloading connector, validated.

::

    {"tiers": [{"tier": "cpu", "capacity_bytes": 4294967296},
               {"tier": "disk", "capacity_bytes": 68719476736, "path": "/var/cache/kv"}],
     "eviction_policy": "arc", "io_threads": 2, "max_wait_steps": 32, "namespace": ""}
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import attrs

from kvframe.errors import ConfigError

__all__ = ["OffloadOptions", "TierOptions"]

_PATH = "kv_connector_extra_config"
_KNOWN = (
    "tiers",
    "eviction_policy",
    "eviction_options",
    "io_threads",
    "max_wait_steps",
    "namespace",
)


@attrs.frozen(kw_only=True)
class TierOptions:
    """One entry of ``tiers``: the tier's registered name, its size and its own options."""

    tier: str
    capacity_bytes: int
    options: Mapping[str, Any] = attrs.field(factory=dict)
    path: str = f"{_PATH}.tiers[0]"


@attrs.frozen(kw_only=True)
class OffloadOptions:
    """The offloading connector's options (every key is described in ``docs/offloading.md``)."""

    tiers: tuple[TierOptions, ...]
    eviction_policy: str = "lru"
    eviction_options: Mapping[str, Any] = attrs.field(factory=dict)
    io_threads: int = 2
    max_wait_steps: int = 32
    namespace: str = ""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> OffloadOptions:
        """Parse ``kv_connector_extra_config``. Raises :class:`~kvframe.errors.ConfigError`
        naming the key path, the value given and what is allowed (and the closest known key
        for a typo). Tier and policy *names* are checked later, against the plugin host."""
        for key in extra:
            if key not in _KNOWN:
                close = difflib.get_close_matches(str(key), _KNOWN, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{_PATH}.{key}: unknown option for OffloadingConnector{hint} "
                    f"(known: {', '.join(_KNOWN)})"
                )
        raw = extra.get("tiers")
        if not isinstance(raw, (list, tuple)) or not raw:
            raise ConfigError(
                f"{_PATH}.tiers: got {raw!r}; expected a non-empty list of tier objects, "
                'e.g. [{"tier": "cpu", "capacity_bytes": 1073741824}]'
            )
        tiers = tuple(_tier(i, t) for i, t in enumerate(raw))
        policy = extra.get("eviction_policy", "lru")
        if not isinstance(policy, str) or not policy:
            raise ConfigError(
                f"{_PATH}.eviction_policy: got {policy!r}; expected a policy name such as "
                "'lru' or 'arc'"
            )
        popts = extra.get("eviction_options", {})
        if not isinstance(popts, Mapping):
            raise ConfigError(f"{_PATH}.eviction_options: got {popts!r}; expected an object")
        threads = _int(extra, "io_threads", 2, 1, 64)
        wait = _int(extra, "max_wait_steps", 32, 0, 1_000_000)
        namespace = extra.get("namespace", "")
        if not isinstance(namespace, str):
            raise ConfigError(f"{_PATH}.namespace: got {namespace!r}; expected a string")
        return cls(
            tiers=tiers,
            eviction_policy=policy,
            eviction_options=dict(popts),
            io_threads=threads,
            max_wait_steps=wait,
            namespace=namespace,
        )


def _int(extra: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{_PATH}.{key}: got {value!r}; expected an integer {lo}..{hi}")
    return value


def _tier(i: int, raw: Any) -> TierOptions:
    path = f"{_PATH}.tiers[{i}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{path}: got {raw!r}; expected an object with 'tier' and 'capacity_bytes'"
        )
    name = raw.get("tier")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{path}.tier: got {name!r}; expected a tier name such as 'cpu' or 'disk'"
        )
    cap = raw.get("capacity_bytes")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ConfigError(
            f"{path}.capacity_bytes: got {cap!r}; expected a positive integer number of bytes "
            "(sizes are plain integers: 4 GiB is 4294967296)"
        )
    others = {k: v for k, v in raw.items() if k not in ("tier", "capacity_bytes")}
    return TierOptions(tier=name, capacity_bytes=cap, options=others, path=path)
