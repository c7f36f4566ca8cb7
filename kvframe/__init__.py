"""kvframe: move and keep LLM KV caches between inference-engine instances.

Layers, from the bottom (each may import only the layers below it):

- :mod:`kvframe.core` — the sans-I/O core: leases, heartbeats, clocks, the heartbeat wire
  format. Standard library and attrs only; no clock reads, threads, sockets or logging.
- :mod:`kvframe.spi` and :mod:`kvframe.protocol` — contracts (connector and transport SPIs,
  hookspecs) and the scheduler/worker metadata protocol with its codec.
- :mod:`kvframe.runtime`, :mod:`kvframe.transports`, :mod:`kvframe.connectors`,
  :mod:`kvframe.testing`, :mod:`kvframe.cli` — the shell: plugin loading, clocks, threads,
  sockets, the built-in transport, connectors, the conformance kit and the command line.

Plugins (``plugins/``) and engine adapters (``contrib/``) use public names only.
"""

from kvframe import errors

__version__ = "0.1.0"

__all__ = ["__version__", "errors"]
