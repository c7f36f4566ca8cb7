"""The module kvframe's plugin host loads for this distribution (entry point ``etcd``).

Registering costs nothing: no connection is made until a backend is created.
"""

from __future__ import annotations

from kvframe.spi.hookspecs import DiscoveryRegistrar, hookimpl
from kvframe_etcd.backend import EtcdDiscovery

__all__ = ["kvframe_register_discovery_backends"]


@hookimpl
def kvframe_register_discovery_backends(register: DiscoveryRegistrar) -> None:
    """Register the ``"etcd"`` discovery backend (factory :meth:`EtcdDiscovery.create`)."""
    register("etcd", EtcdDiscovery.create)
