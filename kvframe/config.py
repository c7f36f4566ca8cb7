"""``KVTransferConfig``: the KV-transfer configuration engine users already write.

The same JSON users give vLLM's ``--kv-transfer-config``::

    {"kv_connector": "PDConnector", "kv_role": "kv_both", "engine_id": "prefill-0",
     "kv_connector_extra_config": {"transport": "nixl"},
     "kv_load_failure_policy": "recompute", "kv_lease_duration": 30}

Parsing is strict: an unknown key, a value of the wrong type or a value outside what is
allowed raises :class:`~kvframe.errors.ConfigError` whose message names the key with its full
path (``kv_connector_extra_config.connectors[1].kv_role``), the value given, what is allowed and,
for a misspelt key, the closest known key. Every key is documented in ``docs/configuration.md``,
which is generated in part from :func:`reference_table`.
"""

from __future__ import annotations

import difflib
import json
import math
import types
from collections.abc import Mapping
from typing import Any, Final, Literal, cast

import attrs

from kvframe.errors import ConfigError

__all__ = [
    "KV_LOAD_FAILURE_POLICIES",
    "KV_ROLES",
    "MIN_LEASE_DURATION",
    "KVLoadFailurePolicy",
    "KVRole",
    "KVTransferConfig",
    "reference_table",
]

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
"""What an engine does with KV: produce it for others (P), consume it (D), or both."""
KVLoadFailurePolicy = Literal["fail", "recompute"]
"""What happens to a request whose KV could not be loaded."""

KV_ROLES: Final = ("kv_producer", "kv_consumer", "kv_both")
"""The allowed values of ``kv_role``."""
KV_LOAD_FAILURE_POLICIES: Final = ("fail", "recompute")
"""The allowed values of ``kv_load_failure_policy``."""

# vLLM keys that have no meaning for kvframe: named so that a user pasting a vLLM
# configuration learns why the key is refused instead of getting a bare "unknown key".
_VLLM_ONLY: Final = {
    "kv_buffer_device": "kvframe registers the engine's own KV cache and needs no extra buffer",
    "kv_buffer_size": "kvframe registers the engine's own KV cache and needs no extra buffer",
    "kv_rank": "kvframe connectors find peers through the handshake, not by rank",
    "kv_parallel_size": "kvframe connectors find peers through the handshake, not by rank",
    "kv_ip": "put the side-channel address in kv_connector_extra_config for the connector",
    "kv_port": "put the side-channel port in kv_connector_extra_config for the connector",
    "kv_connector_module_path": "install the connector as a kvframe plugin (entry point group "
    "'kvframe') and name it in kv_connector",
    "enable_permute_local_kv": "kvframe connectors negotiate the KV layout in the handshake",
}

_DEFAULT_LEASE: Final = 30.0
_DEFAULT_TTL: Final = 480.0

MIN_LEASE_DURATION: Final = 0.1
"""The shortest ``kv_lease_duration`` accepted, seconds.

D heartbeats every ``duration / 6`` (``duration // 6`` from 6 s on) and each heartbeat keeps the
lease for an extension of ``2/3`` of the duration; D sends them from its engine steps, which
take about 1 ms when idle and tens of milliseconds under load. At 0.1 s the interval is about
17 ms and the extension about 67 ms: a few loaded steps. Below it the extension is shorter than
the gap between two steps, so P would expire the leases of consumers that are alive and reading
(at 0.001 s: a 0.17 ms interval, a 0.67 ms extension). Durations this short are for tests on one
host; deployments want 6 s or more, where heartbeats come in whole seconds as NixlConnector
computes them (``int`` floor division: NixlConnector's 5 s gives an interval of 0, a heartbeat
every step, where kvframe uses the exact fraction below 6 s)."""

# Keys of this configuration that NixlConnector users write inside kv_connector_extra_config
# (NixlConnector reads its lease settings there); kvframe reads them beside kv_connector.
_TOP_LEVEL_ONLY: Final = ("kv_lease_duration", "decoder_kv_blocks_ttl", "kv_load_failure_policy")


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _fail(path: str, value: Any, allowed: str, hint: str = "") -> ConfigError:
    msg = f"{path}: got {_fmt(value)} ({_kind(value)}); expected {allowed}"
    return ConfigError(msg + (f"; {hint}" if hint else ""))


def _choice(path: str, value: Any, allowed: tuple[str, ...]) -> str:
    options = ", ".join(repr(a) for a in allowed)
    if not isinstance(value, str):
        raise _fail(path, value, f"one of {options}")
    if value not in allowed:
        close = difflib.get_close_matches(value, allowed, n=1)
        hint = f"did you mean {close[0]!r}?" if close else ""
        raise _fail(path, value, f"one of {options}", hint)
    return value


def _name(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(path, value, "a non-empty string")
    return value


def _seconds(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, value, "a number of seconds > 0")
    if not math.isfinite(value) or value <= 0:
        raise _fail(path, value, "a finite number of seconds > 0")
    return float(value)


def _is_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _default_ttl(lease: float) -> float:
    return max(_DEFAULT_TTL, lease)


def _lease(path: str, value: Any) -> float:
    seconds = _seconds(path, value)
    if seconds < MIN_LEASE_DURATION:
        raise _fail(
            path,
            value,
            f"at least {MIN_LEASE_DURATION:g} seconds (6 or more outside tests)",
            f"D would heartbeat every {seconds / 6:.2g} s and each heartbeat would keep the "
            f"lease only {seconds * 2 / 3:.2g} s, less than an engine step, so live consumers "
            "would lose their leases; see MIN_LEASE_DURATION in docs/configuration.md",
        )
    return seconds


def _check_timing(prefix: str, lease: float, ttl: float) -> None:
    """Cross-key rules: a kept turn lives at least as long as a lease."""
    if ttl < lease:
        raise ConfigError(
            f"{prefix}decoder_kv_blocks_ttl: got {ttl:g} with {prefix}kv_lease_duration "
            f"{lease:g}; expected at least the lease duration (the ttl covers the time between "
            "a conversation's turns, minutes; a value below the seconds a prefill engine waits "
            f"for its decoder is almost surely the two keys swapped): raise it to {lease:g} "
            f"or more (the default is {_DEFAULT_TTL:g}) or lower kv_lease_duration"
        )


def _json_value(path: str, value: Any) -> Any:
    """Check a JSON-like value and return a read-only copy (lists → tuples)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _fail(path, value, "a finite number (NaN and infinity do not round-trip)")
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_json_value(f"{path}[{i}]", v) for i, v in enumerate(value))
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _fail(f"{path} key", k, "string keys (JSON object keys are strings)")
            out[k] = _json_value(f"{path}.{k}", v)
        return types.MappingProxyType(out)
    raise _fail(path, value, "a JSON value: null, bool, number, string, list or object")


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    return value


def _unknown_key(path: str, key: str, value: Any, known: tuple[str, ...]) -> ConfigError:
    where = f"{path}.{key}" if path else key
    if key in _VLLM_ONLY:
        return ConfigError(
            f"{where}: {_fmt(value)} is a vLLM option kvframe does not use "
            f"({_VLLM_ONLY[key]}); remove it"
        )
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(
        f"{where}: unknown key (value {_fmt(value)}); {hint}known keys: {', '.join(known)}"
    )


def _extra_config(path: str, value: Any, parent: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(path, value, "an object (a mapping of connector-specific options)")
    frozen = cast(Mapping[str, Any], _json_value(path, value))
    for key in _TOP_LEVEL_ONLY:
        if key in frozen:
            outer = path.rsplit(".", 1)[0] + "." if "." in path else ""
            raise ConfigError(
                f"{path}.{key}: {_fmt(_thaw(frozen[key]))} is a key of the configuration "
                f"itself, not of kv_connector_extra_config (NixlConnector reads it there; "
                f"kvframe reads it beside kv_connector): write it as {outer}{key}, e.g. "
                f'{{"kv_connector": ..., "{key}": {json.dumps(_thaw(frozen[key]))}}}; inside '
                "vLLM's --kv-transfer-config the kvframe adapter accepts it in "
                "kv_connector_extra_config"
            )
    if "transport_options" in frozen and not isinstance(frozen["transport_options"], Mapping):
        raise _fail(
            f"{path}.transport_options",
            value["transport_options"],
            "an object (options for the transport plugin)",
        )
    if "connectors" in frozen:
        subs = frozen["connectors"]
        if not isinstance(subs, tuple) or not subs:
            raise _fail(
                f"{path}.connectors",
                value["connectors"],
                "a non-empty list of connector configurations (objects)",
            )
        for i, sub in enumerate(subs):
            _sub_config(f"{path}.connectors[{i}]", sub, parent)
    return frozen


def _sub_config(path: str, sub: Any, parent: Mapping[str, Any]) -> KVTransferConfig:
    if not isinstance(sub, Mapping):
        raise _fail(path, _thaw(sub), "an object (a connector configuration)")
    inherited = {k: parent[k] for k in _INHERITED if k in parent and k not in sub}
    lease = sub.get("kv_lease_duration")
    if "decoder_kv_blocks_ttl" in inherited and _is_seconds(lease):
        # A sub-connector's own longer lease raises the inherited bound with it, as the
        # default does at the top level.
        inherited["decoder_kv_blocks_ttl"] = max(inherited["decoder_kv_blocks_ttl"], lease)
    return KVTransferConfig._parse({**inherited, **sub}, path)


_INHERITED: Final = (
    "kv_role",
    "engine_id",
    "kv_load_failure_policy",
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
)


def _check_role(instance: KVTransferConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    _choice(attribute.name, value, KV_ROLES)


def _check_policy(instance: KVTransferConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    _choice(attribute.name, value, KV_LOAD_FAILURE_POLICIES)


def _check_name(instance: KVTransferConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    _name(attribute.name, value)


def _check_engine_id(
    instance: KVTransferConfig, attribute: attrs.Attribute[Any], value: Any
) -> None:
    if value is not None:
        _name(attribute.name, value)


def _lease_seconds(value: Any) -> float:
    return _lease("kv_lease_duration", value)


def _ttl_seconds(value: Any) -> float:
    return _seconds("decoder_kv_blocks_ttl", value)


def _freeze_extra(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail("kv_connector_extra_config", value, "an object")
    return cast(Mapping[str, Any], _json_value("kv_connector_extra_config", value))


@attrs.frozen(kw_only=True)
class KVTransferConfig:
    """One engine's KV-transfer configuration (frozen).

    Build it with :meth:`from_json` or :meth:`from_dict` (which report errors with key paths);
    the constructor validates too. Raises :class:`~kvframe.errors.ConfigError` for any bad
    key or value; nothing is built then.
    """

    kv_connector: str = attrs.field(validator=_check_name)
    """The registered name of the connector to use (``kvframe plugins`` lists them)."""
    kv_role: KVRole = attrs.field(validator=_check_role)
    """``"kv_producer"`` (P: computes KV for others), ``"kv_consumer"`` (D: loads KV computed
    elsewhere) or ``"kv_both"``."""
    engine_id: str | None = attrs.field(default=None, validator=_check_engine_id)
    """This engine's id as peers see it. ``None``: left to the engine integration (vLLM makes a
    random one); connectors that name their engine to peers (``PDConnector``) refuse ``None``."""
    kv_connector_extra_config: Mapping[str, Any] = attrs.field(
        factory=dict, converter=_freeze_extra, hash=False
    )
    """Connector-specific options (read-only). Two keys have a fixed meaning: ``connectors``
    (sub-connector configurations of a multi-connector, see :attr:`connectors`) and
    ``transport_options`` (an object passed to the transport plugin)."""
    kv_load_failure_policy: KVLoadFailurePolicy = attrs.field(
        default="recompute", validator=_check_policy
    )
    """``"recompute"``: a request whose KV load failed recomputes the missing tokens locally.
    ``"fail"``: the request ends with an error."""
    kv_lease_duration: float = attrs.field(default=_DEFAULT_LEASE, converter=_lease_seconds)
    """Seconds a producer keeps a request's blocks for a consumer without hearing from it
    (each heartbeat renews the lease for this long)."""
    decoder_kv_blocks_ttl: float = attrs.field(
        default=attrs.Factory(lambda self: _default_ttl(self.kv_lease_duration), takes_self=True),
        converter=_ttl_seconds,
    )
    """Bidirectional (multi-turn) mode: seconds a decoder keeps a finished turn's blocks for
    the conversation's next turn while no prefill engine has claimed them (the first claim
    makes them an ordinary heartbeated lease). It bounds nothing else: a prefill engine's
    lease for a decoder ends one extension after the decoder's last heartbeat. At least
    ``kv_lease_duration``; the default is 480, or ``kv_lease_duration`` when that is
    longer."""

    def __attrs_post_init__(self) -> None:
        _check_timing("", self.kv_lease_duration, self.decoder_kv_blocks_ttl)
        if "connectors" in self.kv_connector_extra_config:
            # Validates the sub-configurations (raises ConfigError with their paths).
            _extra_config("kv_connector_extra_config", self.kv_connector_extra_config, self._own())

    def _own(self) -> dict[str, Any]:
        return {
            "kv_role": self.kv_role,
            "engine_id": self.engine_id,
            "kv_load_failure_policy": self.kv_load_failure_policy,
            "kv_lease_duration": self.kv_lease_duration,
            "decoder_kv_blocks_ttl": self.decoder_kv_blocks_ttl,
        }

    # -- parsing ----------------------------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes) -> KVTransferConfig:
        """Parse the JSON text of a configuration (an object; UTF-8 when bytes).

        Raises :class:`~kvframe.errors.ConfigError` for invalid JSON (with line and column), a
        duplicate key, or anything :meth:`from_dict` refuses.
        """
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"kv_transfer_config is not UTF-8 text: {exc}") from exc
        if not isinstance(text, str):
            raise ConfigError(
                f"kv_transfer_config: got {_kind(text)}; expected JSON text (str or bytes)"
            )
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"kv_transfer_config is not valid JSON: {exc.msg} at line {exc.lineno} "
                f"column {exc.colno}"
            ) from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVTransferConfig:
        """Build a configuration from a mapping (what ``json.loads`` gives).

        Raises :class:`~kvframe.errors.ConfigError` naming the key path, the value given, what
        is allowed and the closest known key for a typo.
        """
        return cls._parse(data, "")

    @classmethod
    def _parse(cls, data: Any, path: str) -> KVTransferConfig:
        if not isinstance(data, Mapping):
            raise _fail(path or "kv_transfer_config", _thaw(data), "a JSON object")
        known = tuple(f.name for f in attrs.fields(cls))
        for key, value in data.items():
            if key not in known:
                raise _unknown_key(path, str(key), _thaw(value), known)
        prefix = f"{path}." if path else ""
        for key in ("kv_connector", "kv_role"):
            if key not in data:
                allowed = (
                    "one of " + ", ".join(repr(r) for r in KV_ROLES)
                    if key == "kv_role"
                    else "a connector name"
                )
                raise ConfigError(f"{prefix}{key}: missing; this key is required ({allowed})")
        kwargs: dict[str, Any] = {
            "kv_connector": _name(prefix + "kv_connector", data["kv_connector"]),
            "kv_role": _choice(prefix + "kv_role", data["kv_role"], KV_ROLES),
        }
        if "engine_id" in data and data["engine_id"] is not None:
            kwargs["engine_id"] = _name(prefix + "engine_id", data["engine_id"])
        if "kv_load_failure_policy" in data:
            kwargs["kv_load_failure_policy"] = _choice(
                prefix + "kv_load_failure_policy",
                data["kv_load_failure_policy"],
                KV_LOAD_FAILURE_POLICIES,
            )
        if "kv_lease_duration" in data:
            kwargs["kv_lease_duration"] = _lease(
                prefix + "kv_lease_duration", data["kv_lease_duration"]
            )
        if "decoder_kv_blocks_ttl" in data:
            kwargs["decoder_kv_blocks_ttl"] = _seconds(
                prefix + "decoder_kv_blocks_ttl", data["decoder_kv_blocks_ttl"]
            )
        _check_timing(
            prefix,
            kwargs.get("kv_lease_duration", _DEFAULT_LEASE),
            kwargs.get(
                "decoder_kv_blocks_ttl",
                _default_ttl(kwargs.get("kv_lease_duration", _DEFAULT_LEASE)),
            ),
        )
        if "kv_connector_extra_config" in data:
            parent = {**cls._defaults(), **kwargs}
            parent.setdefault("decoder_kv_blocks_ttl", _default_ttl(parent["kv_lease_duration"]))
            kwargs["kv_connector_extra_config"] = _extra_config(
                prefix + "kv_connector_extra_config", data["kv_connector_extra_config"], parent
            )
        return cls(**kwargs)

    @staticmethod
    def _defaults() -> dict[str, Any]:
        return {
            "engine_id": None,
            "kv_load_failure_policy": "recompute",
            "kv_lease_duration": _DEFAULT_LEASE,
        }

    # -- views --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-compatible dict with every key (defaults included);
        ``KVTransferConfig.from_dict(c.to_dict()) == c``. Never raises."""
        return {
            "kv_connector": self.kv_connector,
            "kv_role": self.kv_role,
            "engine_id": self.engine_id,
            "kv_connector_extra_config": _thaw(self.kv_connector_extra_config),
            "kv_load_failure_policy": self.kv_load_failure_policy,
            "kv_lease_duration": self.kv_lease_duration,
            "decoder_kv_blocks_ttl": self.decoder_kv_blocks_ttl,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as compact JSON text (keys in a fixed order). Never raises."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @property
    def is_producer(self) -> bool:
        """True for ``kv_producer`` and ``kv_both``: this engine keeps KV for others."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """True for ``kv_consumer`` and ``kv_both``: this engine loads KV computed elsewhere."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def connectors(self) -> tuple[KVTransferConfig, ...]:
        """The sub-connector configurations of a multi-connector
        (``kv_connector_extra_config["connectors"]``), empty when there are none.

        A sub-configuration that omits ``kv_role``, ``engine_id``, ``kv_load_failure_policy``,
        ``kv_lease_duration`` or ``decoder_kv_blocks_ttl`` inherits this configuration's value.
        Already validated at construction, so it does not raise.
        """
        subs = self.kv_connector_extra_config.get("connectors", ())
        own = self._own()
        return tuple(
            _sub_config(f"kv_connector_extra_config.connectors[{i}]", _thaw(s), own)
            for i, s in enumerate(subs)
        )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(
                f"{key}: given twice in the same JSON object ({_fmt(out[key])} and "
                f"{_fmt(value)}); keep one"
            )
        out[key] = value
    return out


def reference_table() -> str:
    """The configuration keys as a markdown table (embedded in ``docs/configuration.md``)."""
    rows = [
        ("kv_connector", "string", "required", "a registered connector name"),
        ("kv_role", "string", "required", ", ".join(f"`{r}`" for r in KV_ROLES)),
        ("engine_id", "string or null", "`null` (left to the engine)", "non-empty"),
        ("kv_connector_extra_config", "object", "`{}`", "connector-specific; JSON values"),
        (
            "kv_load_failure_policy",
            "string",
            "`recompute`",
            ", ".join(f"`{p}`" for p in KV_LOAD_FAILURE_POLICIES),
        ),
        (
            "kv_lease_duration",
            "number (seconds)",
            f"`{_DEFAULT_LEASE:g}`",
            f"finite, ≥ {MIN_LEASE_DURATION:g} ([why](#the-timing-rules)); 6 or more outside tests",
        ),
        (
            "decoder_kv_blocks_ttl",
            "number (seconds)",
            f"`{_DEFAULT_TTL:g}`, or `kv_lease_duration` when longer",
            "finite, ≥ `kv_lease_duration`",
        ),
    ]
    fields = {f.name for f in attrs.fields(KVTransferConfig)}
    if fields != {r[0] for r in rows}:
        raise RuntimeError("reference_table is out of date with KVTransferConfig's fields")
    lines = ["| key | type | default | allowed |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | {d} | {a} |" for k, t, d, a in rows]
    return "\n".join(lines) + "\n"
