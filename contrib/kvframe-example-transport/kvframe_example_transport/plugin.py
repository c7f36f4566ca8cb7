"""The module the ``kvframe`` entry point names: kvframe's plugin host imports it and calls
its hook implementations."""

from __future__ import annotations

from kvframe.spi.hookspecs import TransportRegistrar, hookimpl
from kvframe_example_transport.transport import CAPABILITIES, TcpTransport

__all__ = ["kvframe_register_transports"]


@hookimpl
def kvframe_register_transports(register: TransportRegistrar) -> None:
    """Register ``example-tcp``. Nothing is created until a connector asks for it."""
    register("example-tcp", TcpTransport.create, capabilities=CAPABILITIES)
