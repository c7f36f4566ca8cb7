"""The P/D side channel: a pyzmq request/response handshake between engine workers.

Decode (D) asks, prefill (P) answers. One exchange gives D everything it needs to read P's KV
cache and gives P what it needs to talk back (heartbeat acknowledgements and failure notices):

- D → P: :class:`HandshakeRequest` — D's engine id and rank, D's transport name and transport
  metadata.
- P → D: :class:`HandshakeAccept` — a :class:`HandshakeResponse` (P's engine id, rank and
  tensor-parallel size, P's transport metadata, P's KV
  :class:`~kvframe.spi.transport.BlockLayout`, the lease duration, P's incarnation) and P's
  clock reading; or a :class:`HandshakeRefusal` saying why not.
- Later exchanges of the same handshake: :class:`ClockPing` → :class:`ClockPong` (a clock
  reading only).

**Frame.** Every message is ``header + payload``. The header is fixed-size and checked *before*
the payload is decoded, so an incompatible or hostile peer never reaches the decoder::

    offset size  field
    0      4     magic  b"KVFH"
    4      1     side-channel version (HANDSHAKE_VERSION)
    5      16    compatibility hash (blake2b-128 of what both sides must agree on)
    21     ...   payload, at most MAX_PAYLOAD bytes: one message in the envelope of
                 kvframe.protocol.codec (magic, protocol version, type tag, layout
                 checksum, msgpack body)

The payload's messages are frozen attrs values, registered in :data:`HANDSHAKE_CODEC` (which
knows nothing else a hostile peer could make it build). :func:`decode_frame` is the one reader,
used by both sides: a frame of another version or with another compatibility hash raises
:class:`~kvframe.errors.IncompatiblePeerError` before a byte of its payload is parsed; any other
malformed frame raises :class:`~kvframe.errors.HandshakeError`, and nothing else escapes it.
The server answers a refused request with a refusal (and counts it); the client raises
:class:`~kvframe.errors.IncompatiblePeerError` (a refusal for incompatibility, or a frame it
cannot read for the same reason) or :class:`~kvframe.errors.HandshakeError`. A client that gets
no answer in time raises :class:`~kvframe.errors.HandshakeTimeoutError`.

**Clock sample.** The client records ``t_send`` and ``t_recv`` on its own clock around the
exchange and the server puts its clock reading in the answer; together they are one sample for
:class:`kvframe.core.clock.ClockOffsetEstimator`. The client makes ``samples`` exchanges and
returns all of them so the estimator can keep the lowest round trip.
"""

from __future__ import annotations

import hashlib
import math
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from kvframe.errors import (
    CodecError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
)
from kvframe.protocol.codec import Codec
from kvframe.spi.transport import BlockLayout

__all__ = [
    "HANDSHAKE_CODEC",
    "HANDSHAKE_VERSION",
    "MAX_PAYLOAD",
    "REFUSAL_CODES",
    "ClockPing",
    "ClockPong",
    "ClockSample",
    "HandshakeAccept",
    "HandshakeRefusal",
    "HandshakeRequest",
    "HandshakeResponse",
    "HandshakeResult",
    "HandshakeServer",
    "compat_hash",
    "decode_frame",
    "encode_frame",
    "handshake",
]

#: The side-channel protocol version; a peer speaking another one is refused before its
#: payload is decoded. (2: the payload is a codec message; 1 was a bare msgpack map.)
HANDSHAKE_VERSION = 2
#: The largest payload (bytes) either side accepts.
MAX_PAYLOAD = 1 << 20
_MAGIC = b"KVFH"
_HEADER = struct.Struct("!4sB16s")
_MAX_REASON = 2000  # characters of a refusal's message: a refusal always fits in a frame
REFUSAL_CODES = frozenset({"malformed", "incompatible", "refused"})
"""Why a server refused: the request was not a valid frame, the peer speaks another version
or has another compatibility hash, or the responder refused it (wrong transport, ...)."""


def compat_hash(**facts: Any) -> bytes:
    """A 16-byte hash of what both sides must agree on (KV dtype, block size in tokens, number of
    layers, bytes per block per region, transport name, ...). Keys are sorted, values
    stringified with ``repr``, so the hash is stable across processes and hosts."""
    text = ";".join(f"{k}={facts[k]!r}" for k in sorted(facts))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _non_empty(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a non-empty str")


def _rank(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a non-negative int")


def _positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a positive int")


def _finite(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} = {value!r}; it must be a finite number of seconds")


def _positive_seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{attribute.name} = {value!r}; it must be a positive number of seconds")


def _refusal_code(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in REFUSAL_CODES:
        raise ValueError(f"code = {value!r}; it must be one of {sorted(REFUSAL_CODES)}")


@attrs.frozen(kw_only=True)
class HandshakeRequest:
    """What D sends (tag ``pd.handshake.request``)."""

    engine_id: str = attrs.field(validator=_non_empty)
    rank: int = attrs.field(validator=_rank)
    transport: str
    transport_metadata: bytes


@attrs.frozen(kw_only=True)
class HandshakeResponse:
    """What P's responder answers (inside a :class:`HandshakeAccept`)."""

    engine_id: str = attrs.field(validator=_non_empty)
    rank: int = attrs.field(validator=_rank)
    tp_size: int = attrs.field(validator=_positive_int)
    transport: str
    transport_metadata: bytes
    layout: BlockLayout
    kv_lease_duration: float = attrs.field(validator=_positive_seconds)
    incarnation: str | None = None
    """A random token naming the P worker instance (``None``: it sends none); D drops a
    connection whose peer's incarnation changed."""


@attrs.frozen(kw_only=True)
class HandshakeAccept:
    """P's answer to a :class:`HandshakeRequest` (tag ``pd.handshake.accept``)."""

    response: HandshakeResponse
    now: float = attrs.field(validator=_finite)
    """P's clock when it answered."""


@attrs.frozen(kw_only=True)
class ClockPing:
    """D asks for another clock reading (tag ``pd.handshake.ping``)."""


@attrs.frozen(kw_only=True)
class ClockPong:
    """P's answer to a :class:`ClockPing` (tag ``pd.handshake.pong``)."""

    now: float = attrs.field(validator=_finite)
    """P's clock when it answered."""


@attrs.frozen(kw_only=True)
class HandshakeRefusal:
    """P refused the request (tag ``pd.handshake.refusal``)."""

    code: str = attrs.field(validator=_refusal_code)
    """One of :data:`REFUSAL_CODES`."""
    message: str
    """Why, in a sentence naming the values involved."""


HANDSHAKE_CODEC = Codec(max_message_bytes=MAX_PAYLOAD).with_types(
    {
        "pd.handshake.request": HandshakeRequest,
        "pd.handshake.accept": HandshakeAccept,
        "pd.handshake.ping": ClockPing,
        "pd.handshake.pong": ClockPong,
        "pd.handshake.refusal": HandshakeRefusal,
    }
)
"""The codec of the side channel's payloads (at most :data:`MAX_PAYLOAD` bytes). The
side channel runs between two engines, not between a connector's halves, so these classes are
not in ``PDConnector.metadata_types``."""


@attrs.frozen(kw_only=True)
class ClockSample:
    """One round trip: ``t_send``/``t_recv`` on the client's clock, ``remote_now`` on the
    server's."""

    t_send: float
    t_recv: float
    remote_now: float

    @property
    def rtt(self) -> float:
        """The round trip, in seconds on the client's clock."""
        return self.t_recv - self.t_send

    @property
    def offset(self) -> float:
        """Server clock minus client clock, assuming a symmetric path."""
        return self.remote_now - (self.t_send + self.t_recv) / 2


@attrs.frozen(kw_only=True)
class HandshakeResult:
    """What :func:`handshake` returns."""

    response: HandshakeResponse
    samples: tuple[ClockSample, ...]


def encode_frame(message: object, chash: bytes) -> bytes:
    """``message`` (one of the classes of :data:`HANDSHAKE_CODEC`) as a frame under this
    side's compatibility hash ``chash``.

    Raises ``TypeError`` for a message the codec does not carry and ``ValueError`` for one
    whose payload would exceed :data:`MAX_PAYLOAD`; nothing is returned then.
    """
    if not isinstance(chash, bytes) or len(chash) != 16:
        raise ValueError(f"chash = {chash!r}; a compatibility hash is 16 bytes (compat_hash)")
    return _HEADER.pack(_MAGIC, HANDSHAKE_VERSION, chash) + HANDSHAKE_CODEC.encode(message)


def decode_frame(data: bytes, chash: bytes) -> object:
    """The message in the frame ``data``, checked against this side's compatibility hash.

    In order, before any of the payload is parsed: the length, the magic, the payload's size,
    the version and the compatibility hash. Raises
    :class:`~kvframe.errors.IncompatiblePeerError` for another version or hash (the payload is
    never decoded then) and :class:`~kvframe.errors.HandshakeError` for anything else wrong
    (the message says what); nothing else, for any bytes.
    """
    if len(data) < _HEADER.size:
        raise HandshakeError(
            f"handshake frame of {len(data)} bytes is shorter than its {_HEADER.size}-byte header"
        )
    magic, version, their_hash = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise HandshakeError(f"not a kvframe handshake frame (magic {magic!r})")
    size = len(data) - _HEADER.size
    if size > MAX_PAYLOAD:
        raise HandshakeError(
            f"handshake payload of {size} bytes is over the limit of {MAX_PAYLOAD} bytes"
        )
    if version != HANDSHAKE_VERSION:
        raise IncompatiblePeerError(
            f"handshake version {version} is not supported (this side speaks "
            f"{HANDSHAKE_VERSION}); run the same kvframe version on both engines"
        )
    if their_hash != chash:
        raise IncompatiblePeerError(
            f"compatibility hash mismatch: the engines disagree on KV layout, dtype, block "
            f"size or transport (ours {chash.hex()}, theirs {their_hash.hex()})"
        )
    try:
        return HANDSHAKE_CODEC.decode(data[_HEADER.size :])
    except CodecError as exc:
        raise HandshakeError(f"undecodable handshake payload: {exc}") from exc


def handshake(
    host: str,
    port: int,
    request: HandshakeRequest,
    *,
    chash: bytes,
    timeout: float = 5.0,
    samples: int = 3,
    clock: Callable[[], float] = time.monotonic,
    context: zmq.Context[Any] | None = None,
) -> HandshakeResult:
    """Ask the P worker listening at ``host:port``; blocks up to ``timeout`` seconds in all.

    Makes ``samples`` exchanges (the first carries the request; all give clock samples).
    Raises :class:`HandshakeTimeoutError`, :class:`IncompatiblePeerError` or
    :class:`HandshakeError`. Nothing is left open after it returns or raises.
    """
    try:
        first = encode_frame(request, chash)
    except (TypeError, ValueError) as exc:
        raise HandshakeError(f"cannot send the handshake request to {host}:{port}: {exc}") from exc
    ping = encode_frame(ClockPing(), chash)
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    deadline = clock() + timeout
    got: list[ClockSample] = []
    response: HandshakeResponse | None = None
    try:
        sock.connect(f"tcp://{host}:{port}")
        for i in range(max(1, samples)):
            t_send = clock()
            sock.send(first if i == 0 else ping)
            remaining = deadline - clock()
            if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                raise HandshakeTimeoutError(
                    f"no handshake answer from {host}:{port} within {timeout:g} s; is the "
                    "prefill engine running and is its side-channel port reachable?"
                )
            data = sock.recv()
            t_recv = clock()
            try:
                answer = decode_frame(data, chash)
            except IncompatiblePeerError as exc:
                raise IncompatiblePeerError(
                    f"{host}:{port} is incompatible with this engine: {exc}"
                ) from exc
            except HandshakeError as exc:
                raise HandshakeError(f"bad handshake answer from {host}:{port}: {exc}") from exc
            if isinstance(answer, HandshakeRefusal):
                error = IncompatiblePeerError if answer.code == "incompatible" else HandshakeError
                raise error(f"{host}:{port} refused the handshake: {answer.message}")
            expected = HandshakeAccept if i == 0 else ClockPong
            if not isinstance(answer, expected):
                raise HandshakeError(
                    f"{host}:{port} answered a {type(answer).__name__}; expected a "
                    f"{expected.__name__}"
                )
            got.append(ClockSample(t_send=t_send, t_recv=t_recv, remote_now=answer.now))
            if isinstance(answer, HandshakeAccept):
                response = answer.response
    except zmq.ZMQError as exc:
        raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from exc
    finally:
        sock.close(linger=0)
    assert response is not None
    return HandshakeResult(response=response, samples=tuple(got))


class HandshakeServer:
    """P's side: answers handshakes on ``tcp://host:port`` from a background thread.

    ``respond(request) -> HandshakeResponse`` builds the answer (it must be thread-safe: it runs
    on the server thread; typically it returns a prepared value and queues the requester's
    transport metadata for the engine thread). ``port=0`` binds an ephemeral port; read
    :attr:`port` after construction. Malformed, incompatible or oversized requests are answered
    with a :class:`HandshakeRefusal` when possible and counted in :attr:`rejected` (the reason
    in :attr:`last_error`); the server keeps serving. :meth:`close` stops the thread and
    releases the socket; safe twice.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        chash: bytes,
        respond: Callable[[HandshakeRequest], HandshakeResponse],
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._chash = chash
        self._respond = respond
        self._clock = clock
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _HEADER.size + MAX_PAYLOAD)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise HandshakeError(
                f"cannot listen for handshakes on {host}:{port}: {exc}; choose another "
                "side_channel_port in kv_connector_extra_config"
            ) from exc
        self.host = host
        self.served = 0
        self.rejected = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._serve, name=f"kvframe-handshake-{self.port}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                ident, data = self._sock.recv_multipart()
            except (zmq.ZMQError, ValueError):
                continue
            reply = self._answer(data)
            try:
                self._sock.send_multipart([ident, reply])
            except zmq.ZMQError:
                continue

    def _reject(self, code: str, message: str) -> bytes:
        with self._lock:
            self.rejected += 1
            self.last_error = message
        refusal = HandshakeRefusal(code=code, message=message[:_MAX_REASON])
        return encode_frame(refusal, self._chash)

    def _answer(self, data: bytes) -> bytes:
        # The version and the compatibility hash are checked before the payload is decoded.
        try:
            message = decode_frame(data, self._chash)
        except IncompatiblePeerError as exc:
            return self._reject("incompatible", str(exc))
        except HandshakeError as exc:
            return self._reject("malformed", str(exc))
        if isinstance(message, ClockPing):
            return encode_frame(ClockPong(now=self._clock()), self._chash)
        if not isinstance(message, HandshakeRequest):
            return self._reject(
                "malformed",
                f"unexpected handshake message {type(message).__name__}; expected a "
                "HandshakeRequest or a ClockPing",
            )
        try:
            response = self._respond(message)
            reply = encode_frame(HandshakeAccept(response=response, now=self._clock()), self._chash)
        except HandshakeError as exc:
            return self._reject("malformed", str(exc))
        except Exception as exc:  # the responder refused (e.g. wrong transport name)
            return self._reject("refused", f"{type(exc).__name__}: {exc}")
        with self._lock:
            self.served += 1
        return reply

    def close(self) -> None:
        """Stop serving and release the socket. Safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(linger=0)
