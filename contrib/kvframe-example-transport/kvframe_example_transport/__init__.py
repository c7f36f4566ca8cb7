"""kvframe-example-transport: a complete third-party kvframe transport plugin.

It registers ``example-tcp`` (:class:`~kvframe_example_transport.transport.TcpTransport`), a
cross-process transport over TCP sockets, through the ``kvframe`` entry-point group. Read the
README for how it is put together; it doubles as the how-to for writing a plugin.
"""

from __future__ import annotations

from kvframe_example_transport.transport import CAPABILITIES, TcpTransport

__all__ = ["CAPABILITIES", "TcpTransport"]
