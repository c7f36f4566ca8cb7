"""Build contexts for tests that build connectors by hand (an engine makes its own)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext


def build_context(*plugins: object, clock: Callable[[], float] = time.monotonic) -> BuildContext:
    """A context over a fresh, loaded plugin host with the built-ins only (no entry points,
    no environment switches), plus ``plugins`` registered by code."""
    host = PluginHost(autoload=False, env={})
    host.load()
    for plugin in plugins:
        host.register(plugin)
    return BuildContext(host=host, clock=clock)
