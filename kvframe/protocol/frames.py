"""Codec messages as length-prefixed frames on a stream socket: how two processes of one host
that share a ``socketpair`` or a local connection exchange kvframe messages.

A frame is the message's codec bytes (:meth:`Codec.encode <kvframe.protocol.codec.Codec.encode>`)
preceded by their length, a big-endian uint32. A length over the reader's limit is refused
before the body is read, so a broken or hostile peer cannot make the reader allocate without
bound. The test endpoint's wire (``kvframe.testing``) and the reference engine's
tensor-parallel workers use these two functions; neither pickles.
"""

from __future__ import annotations

import socket
import struct

from kvframe.errors import CodecError
from kvframe.protocol.codec import Codec

__all__ = ["FRAME_HEADER", "recv_frame", "send_frame"]

FRAME_HEADER = struct.Struct(">I")
"""The frame's header: the body's length in bytes, a big-endian uint32."""


def send_frame(sock: socket.socket, codec: Codec, message: object) -> None:
    """Encode ``message`` with ``codec`` and write it as one frame. Raises ``TypeError`` /
    ``ValueError`` for a message the codec refuses (nothing is written then) and ``OSError``
    when the socket fails."""
    data = codec.encode(message)
    sock.sendall(FRAME_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise EOFError(f"the other end closed the {what} connection")
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket, codec: Codec, *, max_bytes: int, what: str) -> object:
    """Read one frame and decode it with ``codec``; ``what`` names the wire in messages.

    Raises ``EOFError`` when the other end closed the connection or announced a frame over
    ``max_bytes`` (its body is not read, so the stream cannot continue),
    :class:`~kvframe.errors.CodecError` for a body that is not a message of ``codec`` (the
    stream stays usable), ``TimeoutError`` when the socket's timeout passed and ``OSError``
    when the socket fails.
    """
    (size,) = FRAME_HEADER.unpack(_recv_exact(sock, FRAME_HEADER.size, what))
    if size > max_bytes:
        raise EOFError(f"{what} frame of {size} bytes is over the {max_bytes}-byte limit")
    body = _recv_exact(sock, size, what)
    try:
        return codec.decode(body)
    except CodecError as exc:
        raise CodecError(f"{what} frame: {exc}") from exc
