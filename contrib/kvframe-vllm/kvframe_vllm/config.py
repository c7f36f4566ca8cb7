"""From vLLM's ``--kv-transfer-config`` to kvframe's :class:`~kvframe.config.KVTransferConfig`.

vLLM loads the adapter with ``kv_connector = "KVFrameConnector"`` and
``kv_connector_module_path = "kvframe_vllm"``. Which kvframe connector runs, and its own
options, live in ``kv_connector_extra_config``:

- ``kvframe_connector`` (str, default ``"PDConnector"``): the kvframe connector's registered
  name (``kvframe plugins`` lists them).
- NixlConnector's flat keys, as NixlConnector users write them (see :data:`NIXL_KEYS`):
  ``kv_lease_duration``, ``decoder_kv_blocks_ttl`` and ``kv_load_failure_policy`` become the
  kvframe keys of those names; with ``PDConnector``, ``engine_ttl``, ``backends`` and
  ``num_threads`` become its ``peer_idle_ttl`` and its NIXL transport's ``backends`` and
  ``num_threads``. NixlConnector keys with no kvframe meaning are refused with the reason,
  unless they hold the value kvframe behaves as anyway.
- ``kvframe`` (object, optional, the *nested* form): kvframe ``KVTransferConfig`` keys for that
  connector — ``kv_connector_extra_config``, ``kv_lease_duration``, ``decoder_kv_blocks_ttl``,
  ``kv_load_failure_policy``.
- any other key (the *merged* form, used only when ``kvframe`` is absent): becomes the kvframe
  connector's own ``kv_connector_extra_config`` (``{"transport": "nixl", ...}``).

``kv_role`` and ``engine_id`` come from vLLM's own keys. vLLM's scheduler applies vLLM's own
``kv_load_failure_policy`` (top level, default ``"fail"``), so one given in
``kv_connector_extra_config`` (flat or nested) must agree with it. Everything is then parsed by
kvframe, so an error names the full key path, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any, Final

import attrs

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError

__all__ = ["ADAPTER_KEYS", "DEFAULT_CONNECTOR", "NIXL_KEYS", "AdapterConfig"]

DEFAULT_CONNECTOR: Final = "PDConnector"
"""The kvframe connector run when ``kvframe_connector`` is not given."""

ADAPTER_KEYS: Final = ("kvframe_connector", "kvframe")
"""Keys of vLLM's ``kv_connector_extra_config`` that the adapter itself reads."""

NIXL_KEYS: Final = {
    "kv_lease_duration": "kv_lease_duration",
    "decoder_kv_blocks_ttl": "decoder_kv_blocks_ttl",
    "kv_load_failure_policy": "kv_load_failure_policy (must agree with vLLM's own key)",
    "engine_ttl": "PDConnector's peer_idle_ttl",
    "backends": "PDConnector's transport_options.backends (NIXL transport)",
    "num_threads": "PDConnector's transport_options.num_threads (NIXL transport)",
    "enforce_handshake_compat": "accepted as true only: kvframe always checks model and layout",
    "bidirectional_kv_xfer": "accepted as false only: no bidirectional mode through the adapter",
    "kv_recompute_threshold": "refused: no bidirectional mode through the adapter",
    "push_registration_timeout": "refused: PDConnector pulls (no push mode)",
}
"""The flat keys NixlConnector (vLLM 0.32) reads from ``kv_connector_extra_config``, and what
the adapter makes of each (the table in ``docs/vllm.md``)."""

_PATH: Final = "kv_connector_extra_config"
_LIFTED: Final = ("kv_lease_duration", "decoder_kv_blocks_ttl", "kv_load_failure_policy")
_NESTED_KEYS: Final = ("kv_connector_extra_config", *_LIFTED)
# NixlConnector key -> (PD option path, NixlConnector's meaning in words).
_PD_MAPPED: Final = {
    "engine_ttl": (("peer_idle_ttl",), "seconds before an unused remote engine is forgotten"),
    "backends": (("transport_options", "backends"), "the NIXL backends to create"),
    "num_threads": (("transport_options", "num_threads"), "the UCX backend's worker threads"),
}
# NixlConnector key -> (the value kvframe behaves as, why no other value is accepted).
_NOOP: Final = {
    "enforce_handshake_compat": (
        True,
        "kvframe always refuses a peer with another model or KV layout (its handshake "
        "compares the served model name and a layout checksum); remove the key",
    ),
    "bidirectional_kv_xfer": (
        False,
        "kvframe's bidirectional (multi-turn) mode is not offered through the vLLM adapter "
        "yet (docs/multiturn.md), so KV moves from P to D only; remove the key",
    ),
}
_REFUSED: Final = {
    "kv_recompute_threshold": "it belongs to bidirectional (multi-turn) mode, which the vLLM "
    "adapter does not offer yet (docs/multiturn.md); remove the key",
    "push_registration_timeout": "it belongs to NixlPushConnector; PDConnector pulls (D reads "
    "from P under a lease); remove the key",
}


def _typo_hint(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return f"did you mean {close[0]!r}?" if close else ""


@attrs.frozen(kw_only=True)
class AdapterConfig:
    """What the adapter runs: the kvframe connector's name and its kvframe configuration."""

    connector: str
    """The kvframe connector's registered name."""
    config: KVTransferConfig
    """The configuration the kvframe connector is built with."""

    @classmethod
    def from_fields(
        cls,
        *,
        kv_role: str | None,
        engine_id: str | None,
        extra: Mapping[str, Any] | None,
        kv_load_failure_policy: str | None = None,
    ) -> AdapterConfig:
        """Build from the fields of vLLM's ``KVTransferConfig`` (passed as plain values, so
        that this parsing is testable without vLLM).

        Raises :class:`~kvframe.errors.ConfigError` naming the key: a missing ``kv_role``, a
        ``kvframe_connector`` that is not a non-empty string, a ``kvframe`` that is not an
        object or holds a key kvframe does not take here, both forms at once, a flat key given
        in the nested form too, a ``kv_load_failure_policy`` that disagrees with vLLM's, a
        NixlConnector key kvframe has no use for, a near miss of a key the adapter reads, or
        anything :meth:`KVTransferConfig.from_dict` refuses.
        """
        extra = dict(extra or {})
        if kv_role is None:
            raise ConfigError(
                "kv_role: missing; KVFrameConnector needs one of 'kv_producer', 'kv_consumer', "
                "'kv_both' in vLLM's --kv-transfer-config"
            )
        name = extra.pop("kvframe_connector", DEFAULT_CONNECTOR)
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(
                f"{_PATH}.kvframe_connector = {name!r}; expected a kvframe connector name such "
                "as 'PDConnector' (run `kvframe plugins` to list them)"
            )
        data: dict[str, Any] = {"kv_connector": name, "kv_role": kv_role}
        if engine_id is not None:
            data["engine_id"] = engine_id
        if kv_load_failure_policy is not None:
            data["kv_load_failure_policy"] = kv_load_failure_policy
        flat: dict[str, Any] = {k: extra.pop(k) for k in _LIFTED if k in extra}
        nixl = {k: extra.pop(k) for k in (*_PD_MAPPED, *_NOOP, *_REFUSED) if k in extra}
        for key in extra:
            if key in ADAPTER_KEYS:
                continue
            hint = _typo_hint(str(key), (*ADAPTER_KEYS, *NIXL_KEYS))
            if hint:
                raise ConfigError(f"{_PATH}.{key}: not a key the adapter reads; {hint}")
        inner: dict[str, Any] = {}
        if "kvframe" in extra:
            nested = extra.pop("kvframe")
            if not isinstance(nested, Mapping):
                raise ConfigError(
                    f"{_PATH}.kvframe = {nested!r}; expected an object with kvframe keys "
                    f"({', '.join(_NESTED_KEYS)})"
                )
            if extra:
                raise ConfigError(
                    f"{_PATH}: keys {sorted(extra)} next to 'kvframe'; put the connector's "
                    f"options in {_PATH}.kvframe.kv_connector_extra_config (nested form) or drop "
                    "'kvframe' and give them directly (merged form), not both"
                )
            for key, value in nested.items():
                if key not in _NESTED_KEYS:
                    if key in ("kv_role", "engine_id", "kv_connector"):
                        hint = "it comes from vLLM's own key of that name"
                    else:
                        typo = _typo_hint(str(key), _NESTED_KEYS)
                        hint = (typo + " " if typo else "") + f"allowed: {', '.join(_NESTED_KEYS)}"
                    raise ConfigError(f"{_PATH}.kvframe.{key}: not allowed here; {hint}")
                if key in flat:
                    raise ConfigError(
                        f"{_PATH}.{key} and {_PATH}.kvframe.{key} are both given; keep one "
                        f"(the flat {_PATH}.{key}, as NixlConnector reads it, or the nested one)"
                    )
                if key == "kv_connector_extra_config":
                    if not isinstance(value, Mapping):
                        raise ConfigError(
                            f"{_PATH}.kvframe.kv_connector_extra_config = {value!r}; expected "
                            "an object (the kvframe connector's own options)"
                        )
                    inner = dict(value)
                else:
                    flat[key] = value
            where = f"{_PATH}.kvframe.kv_connector_extra_config"
        else:
            inner = extra
            where = _PATH
        if "kv_load_failure_policy" in flat and kv_load_failure_policy is not None:
            given = flat["kv_load_failure_policy"]
            if given != kv_load_failure_policy:
                raise ConfigError(
                    f"{_PATH}.kv_load_failure_policy = {given!r}, but vLLM's own "
                    f"kv_load_failure_policy is {kv_load_failure_policy!r} (its default is "
                    "'fail') and vLLM's scheduler applies that one: write "
                    f'"kv_load_failure_policy": {json.dumps(given)} at the top level of '
                    "--kv-transfer-config, next to kv_role, and remove this one"
                )
        data.update(flat)
        if nixl:
            inner = _nixl_options(name, nixl, inner, where)
        if inner:
            data["kv_connector_extra_config"] = inner
        try:
            config = KVTransferConfig.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{_PATH} (as kvframe configuration): {exc}") from exc
        return cls(connector=name, config=config)

    @classmethod
    def from_vllm(cls, kv_transfer_config: Any) -> AdapterConfig:
        """Build from vLLM's ``KVTransferConfig`` object; raises as :meth:`from_fields`."""
        return cls.from_fields(
            kv_role=kv_transfer_config.kv_role,
            engine_id=kv_transfer_config.engine_id,
            extra=kv_transfer_config.kv_connector_extra_config,
            kv_load_failure_policy=getattr(kv_transfer_config, "kv_load_failure_policy", None),
        )


def _nixl_options(
    connector: str, nixl: Mapping[str, Any], inner: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """NixlConnector's own keys onto the kvframe connector's options (``where`` is the path of
    those options); raises :class:`ConfigError` for a key kvframe has no use for."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in inner.items()}
    for key, value in nixl.items():
        if key in _REFUSED:
            raise ConfigError(
                f"{_PATH}.{key} = {value!r}: a NixlConnector option kvframe does not use "
                f"({_REFUSED[key]})"
            )
        if key in _NOOP:
            expected, why = _NOOP[key]
            if value is not expected:
                raise ConfigError(
                    f"{_PATH}.{key} = {value!r}: only {json.dumps(expected)} is accepted ({why})"
                )
            continue
        target, meaning = _PD_MAPPED[key]
        dotted = ".".join(target)
        if connector != DEFAULT_CONNECTOR:
            raise ConfigError(
                f"{_PATH}.{key} = {value!r}: NixlConnector's option for {meaning} maps onto "
                f"PDConnector's {dotted}, but kvframe_connector is {connector!r}: give that "
                f"connector's own option in {_PATH}.kvframe.kv_connector_extra_config "
                "(for a MultiConnector, in its PDConnector entry of 'connectors')"
            )
        if target[0] == "transport_options":
            transport = out.get("transport", "nixl")
            if transport != "nixl":
                raise ConfigError(
                    f"{_PATH}.{key} = {value!r}: an option of the NIXL transport, but "
                    f"{where}.transport is {transport!r}; remove it or set the transport's own "
                    f"options in {where}.transport_options"
                )
            topts = out.get("transport_options", {})
            if not isinstance(topts, Mapping):
                continue  # kvframe's parser names the bad transport_options
            out["transport_options"] = topts = dict(topts)
            holder: dict[str, Any] = topts
        else:
            holder = out
        if target[-1] in holder:
            raise ConfigError(
                f"{_PATH}.{key} and {where}.{dotted} are both given (the first is "
                f"NixlConnector's name for the second); keep one"
            )
        holder[target[-1]] = value
    return out
