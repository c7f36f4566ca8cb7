"""codec_for: the one codec of a connector comes from its metadata_types, and a connector
whose types cannot be registered is named."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import pytest

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError
from kvframe.protocol.codec import DEFAULT_CODEC
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
from kvframe.spi.connector import KVConnector, KVConnectorScheduler, KVConnectorWorker, codec_for


@attrs.frozen(kw_only=True)
class _TaggedMeta(ConnectorMetadata):
    hint: str = ""


@attrs.frozen(kw_only=True)
class _TaggedOutput(ConnectorOutput):
    notes: tuple[str, ...] = ()


class _TypedConnector(KVConnector):
    @classmethod
    def metadata_types(cls, config: KVTransferConfig) -> Mapping[str, type[Any]]:
        return {"tests.tagged_meta": _TaggedMeta, "tests.tagged_output": _TaggedOutput}

    @classmethod
    def build_scheduler(cls, config: Any, engine: Any, ctx: Any) -> KVConnectorScheduler:
        raise NotImplementedError

    @classmethod
    def build_worker(cls, config: Any, engine: Any, rank: int, ctx: Any) -> KVConnectorWorker:
        raise NotImplementedError


class _BadTagConnector(_TypedConnector):
    @classmethod
    def metadata_types(cls, config: KVTransferConfig) -> Mapping[str, type[Any]]:
        return {"kvframe.mine": _TaggedMeta}


_TYPED_CONFIG = KVTransferConfig(kv_connector="Typed", kv_role="kv_both")


def test_codec_for_carries_every_message_class_the_connector_names() -> None:
    codec = codec_for(_TypedConnector, _TYPED_CONFIG)
    assert {"tests.tagged_meta", "tests.tagged_output"} <= set(codec.tags)
    for msg in (_TaggedMeta(hint="h"), _TaggedOutput(notes=("n",)), ConnectorOutput()):
        assert codec.decode(codec.encode(msg)) == msg
    assert set(codec_for(KVConnector, _TYPED_CONFIG).tags) == set(DEFAULT_CODEC.tags)


def test_codec_for_names_the_connector_whose_types_cannot_be_registered() -> None:
    with pytest.raises(ConfigError, match=r"'Typed' \(_BadTagConnector\).*'kvframe\.' prefix"):
        codec_for(_BadTagConnector, _TYPED_CONFIG)
