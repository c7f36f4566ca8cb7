"""The module kvframe's plugin host loads for this distribution (entry point ``nixl``).

Importing it does not import NIXL: the transport module imports ``nixl_cu12`` only when a
transport is created, so listing plugins stays cheap.
"""

from __future__ import annotations

from kvframe.spi.hookspecs import TransportRegistrar, hookimpl
from kvframe_nixl.transport import CAPABILITIES, NixlTransport

__all__ = ["kvframe_register_transports"]


@hookimpl
def kvframe_register_transports(register: TransportRegistrar) -> None:
    """Register the ``"nixl"`` transport (factory :meth:`NixlTransport.create`)."""
    register("nixl", NixlTransport.create, capabilities=CAPABILITIES)
