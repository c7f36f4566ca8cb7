"""From vLLM's ``--kv-transfer-config`` to kvframe's :class:`~kvframe.config.KVTransferConfig`.

vLLM loads the adapter with ``kv_connector = "KVFrameConnector"`` and
``kv_connector_module_path = "kvframe_vllm"``. Which kvframe connector runs, and its own
options, live in ``kv_connector_extra_config``:

- ``kvframe_connector`` (str, default ``"PDConnector"``): the kvframe connector's registered
  name (``kvframe plugins`` lists them).
- ``kvframe`` (object, optional, the *nested* form): kvframe ``KVTransferConfig`` keys for that
  connector — ``kv_connector_extra_config``, ``kv_lease_duration``, ``decoder_kv_blocks_ttl``,
  ``kv_load_failure_policy``.
- any other key (the *merged* form, used only when ``kvframe`` is absent): becomes the kvframe
  connector's own ``kv_connector_extra_config`` (``{"transport": "nixl", ...}``).

``kv_role``, ``engine_id`` and ``kv_load_failure_policy`` come from vLLM's own keys (an explicit
``kvframe.kv_load_failure_policy`` wins). Everything is then parsed by kvframe, so an error names
the full key path, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError

__all__ = ["ADAPTER_KEYS", "DEFAULT_CONNECTOR", "AdapterConfig"]

DEFAULT_CONNECTOR: Final = "PDConnector"
"""The kvframe connector run when ``kvframe_connector`` is not given."""

ADAPTER_KEYS: Final = ("kvframe_connector", "kvframe")
"""Keys of vLLM's ``kv_connector_extra_config`` that the adapter itself reads."""

_NESTED_KEYS: Final = (
    "kv_connector_extra_config",
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
    "kv_load_failure_policy",
)
_PATH: Final = "kv_connector_extra_config"


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
        object or holds a key kvframe does not take here, both forms at once, or anything
        :meth:`KVTransferConfig.from_dict` refuses.
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
                    hint = (
                        "it comes from vLLM's own key of that name"
                        if key in ("kv_role", "engine_id", "kv_connector")
                        else f"allowed: {', '.join(_NESTED_KEYS)}"
                    )
                    raise ConfigError(f"{_PATH}.kvframe.{key}: not allowed here; {hint}")
                data[key] = value
        elif extra:
            data["kv_connector_extra_config"] = extra
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
