"""Transports shipped inside the core distribution.

- :mod:`kvframe.transports.inprocess` — the built-in in-process transport (memcpy between
  regions of one process) with fault injection, registered as ``inprocess`` through the same
  ``kvframe_register_transports`` hook third-party plugins use.

Other transports (NIXL, ...) are separate distributions under ``plugins/``.
"""

from __future__ import annotations

__all__: list[str] = []
