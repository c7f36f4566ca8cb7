"""The module kvframe's plugin host loads for this distribution (entry point ``ucx``).

Importing it does not import ucxx: the transport module imports it only when a transport is
created, so listing plugins stays cheap.
"""

from __future__ import annotations

from kvframe.spi.hookspecs import TransportRegistrar, hookimpl
from kvframe_ucx.transport import CAPABILITIES, UcxTransport

__all__ = ["kvframe_register_transports"]


@hookimpl
def kvframe_register_transports(register: TransportRegistrar) -> None:
    """Register the ``"ucx"`` transport (factory :meth:`UcxTransport.create`)."""
    register("ucx", UcxTransport.create, capabilities=CAPABILITIES)
