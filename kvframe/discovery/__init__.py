"""kvframe's built-in discovery backends, registered through the same hook a plugin uses.

- ``mem`` (:mod:`kvframe.discovery.mem`): one process; registrations live until withdrawn.
  For tests and for embedding several engines in one process.
- ``file`` (:mod:`kvframe.discovery.file`): one host; each registration is a file in a shared
  directory, rewritten every keep-alive interval, that watchers ignore once its TTL passed.

The etcd backend (many hosts) is its own distribution, ``kvframe-etcd``.
"""

from __future__ import annotations

from kvframe.discovery.file import FileDiscovery
from kvframe.discovery.mem import MemDiscovery
from kvframe.spi.hookspecs import DiscoveryRegistrar, hookimpl

__all__ = ["kvframe_register_discovery_backends"]


@hookimpl
def kvframe_register_discovery_backends(register: DiscoveryRegistrar) -> None:
    """Register ``mem`` and ``file``."""
    register("mem", MemDiscovery.create)
    register("file", FileDiscovery.create)
