"""kvframe: move and keep LLM KV caches between inference-engine instances.

Layers, from the bottom (each unit imports only units on lower layers; ``docs/architecture.md``
and ``tests/test_layering.py`` hold the table):

- :mod:`kvframe.errors`; then this package itself and :mod:`kvframe.core` — the sans-I/O core:
  leases, heartbeats, clocks, the P/D machines, the heartbeat wire format. Standard library and
  attrs only; no clock reads, threads, sockets or logging.
- :mod:`kvframe.config`, then :mod:`kvframe.protocol` (the scheduler/worker messages with their
  codec), then :mod:`kvframe.spi` (connector and transport SPIs, hookspecs).
- :mod:`kvframe.transports` and :mod:`kvframe.connectors` — the built-in plugins; then
  :mod:`kvframe.runtime` — the plugin host, which registers them.
- :mod:`kvframe.testing` and :mod:`kvframe.bench` — the conformance kit and the benchmarks;
  then :mod:`kvframe.cli` — the command line.

Plugins (``plugins/``) and engine adapters (``contrib/``) use public names only.
"""

from kvframe import errors

__version__ = "0.1.0"

__all__ = ["__version__", "errors"]
