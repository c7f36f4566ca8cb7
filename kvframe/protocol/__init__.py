"""The scheduler↔worker metadata protocol.

- :mod:`kvframe.protocol.messages` — the frozen messages: :class:`ConnectorMetadata`
  (scheduler → workers, once per step) and :class:`ConnectorOutput` (each worker → scheduler).
- :mod:`kvframe.protocol.codec` — the one codec that turns them into bytes (msgpack in a
  versioned, tagged envelope; never pickle).
- :mod:`kvframe.protocol.aggregate` — :class:`OutputAggregator`, which combines the outputs of
  several worker ranks.
- :mod:`kvframe.protocol.blocks` — :data:`~kvframe.protocol.blocks.BlockIds`, how messages and
  the SPI name blocks (re-exported by :mod:`kvframe.spi.request`).

The protocol sits below the SPI: it imports nothing from :mod:`kvframe.spi`.
"""

from kvframe.protocol.aggregate import OutputAggregator
from kvframe.protocol.codec import DEFAULT_CODEC, PROTOCOL_VERSION, Codec
from kvframe.protocol.messages import (
    ConnectorMetadata,
    ConnectorOutput,
    KVEvent,
    LoadSpec,
    SaveSpec,
    Stats,
)

__all__ = [
    "DEFAULT_CODEC",
    "PROTOCOL_VERSION",
    "Codec",
    "ConnectorMetadata",
    "ConnectorOutput",
    "KVEvent",
    "LoadSpec",
    "OutputAggregator",
    "SaveSpec",
    "Stats",
]
