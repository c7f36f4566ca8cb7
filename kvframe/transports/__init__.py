"""Transports shipped inside the core distribution.

- :mod:`kvframe.transports.inprocess` — the built-in in-process transport (memcpy between
  regions of one process), registered as ``inprocess`` through the same
  ``kvframe_register_transports`` hook third-party plugins use. It asks its fabric's hooks
  before it acts; fault injection through them is :mod:`kvframe.testing.faults`.

The code every transport shares (options, the closed guard, payload checks, descriptor
pairing, the peer table, transfer records) is :mod:`kvframe.spi.transport_kit`.

Other transports (NIXL, ...) are separate distributions under ``plugins/``.
"""

from __future__ import annotations

__all__: list[str] = []
