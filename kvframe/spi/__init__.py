"""Contracts: what connectors, transports and plugins implement, and what engines call.

- :mod:`kvframe.spi.connector` — the connector SPI (scheduler and worker halves).
- :mod:`kvframe.spi.request` — kvframe's own request view and chained block hashes.
- :mod:`kvframe.spi.transport` — the transport SPI.
- :mod:`kvframe.spi.hookspecs` — the pluggy hooks plugins implement.
- :mod:`kvframe.spi.offload` — offload tiers and eviction policies.
"""

__all__: list[str] = []
