"""The P/D side channel: a pyzmq request/response handshake between engine workers.

Decode (D) asks, prefill (P) answers. One exchange gives D everything it needs to read P's KV
cache and gives P what it needs to talk back (heartbeat acknowledgements and failure notices):

- D → P: D's engine id and rank, D's transport name and transport metadata, D's send time.
- P → D: P's engine id, rank and tensor-parallel size, P's transport metadata, P's KV
  :class:`~kvframe.spi.transport.BlockLayout`, the lease duration, and P's clock reading.

**Frame.** Every message is ``header + payload``. The header is fixed-size and checked *before*
the payload is decoded, so an incompatible or hostile peer never reaches the msgpack decoder::

    offset size  field
    0      4     magic  b"KVFH"
    4      1     protocol version (HANDSHAKE_VERSION)
    5      1     kind: 1 = request, 2 = response, 3 = error
    6      16    compatibility hash (blake2b-128 of what both sides must agree on)
    22     ...   msgpack payload (a map), at most MAX_PAYLOAD bytes

A version or hash mismatch is answered with an error frame naming both values; the client
raises :class:`~kvframe.errors.IncompatiblePeerError`. A client that gets no answer in time
raises :class:`~kvframe.errors.HandshakeTimeoutError`. Malformed frames raise
:class:`~kvframe.errors.HandshakeError` on the client and are counted and dropped on the server.

**Clock sample.** The client records ``t_send`` and ``t_recv`` on its own clock around the
exchange and the server puts its clock reading in the answer; together they are one sample for
:class:`kvframe.core.clock.ClockOffsetEstimator`. The client makes ``samples`` exchanges and
returns all of them so the estimator can keep the lowest round trip.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import msgpack
import zmq

from kvframe.errors import (
    HandshakeError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
)
from kvframe.spi.transport import BlockLayout, MemoryKind, MemoryRegion

__all__ = [
    "HANDSHAKE_VERSION",
    "MAX_PAYLOAD",
    "ClockSample",
    "HandshakeRequest",
    "HandshakeResponse",
    "HandshakeResult",
    "HandshakeServer",
    "compat_hash",
    "handshake",
    "layout_from_wire",
    "layout_to_wire",
]

#: The side-channel protocol version; a peer speaking another one is refused before its
#: payload is decoded.
HANDSHAKE_VERSION = 1
#: The largest payload (bytes) either side accepts.
MAX_PAYLOAD = 1 << 20
_MAGIC = b"KVFH"
_HEADER = struct.Struct("!4sBB16s")
_REQUEST, _RESPONSE, _ERROR = 1, 2, 3


def compat_hash(**facts: Any) -> bytes:
    """A 16-byte hash of what both sides must agree on (KV dtype, block size in tokens, number of
    layers, bytes per block per region, transport name, ...). Keys are sorted, values
    stringified with ``repr``, so the hash is stable across processes and hosts."""
    text = ";".join(f"{k}={facts[k]!r}" for k in sorted(facts))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def layout_to_wire(layout: BlockLayout) -> dict[str, Any]:
    """A :class:`BlockLayout` as plain msgpack-able values."""
    return {
        "regions": [[r.addr, r.length, r.kind.value, r.device_id] for r in layout.regions],
        "block_lens": list(layout.block_lens),
        "num_blocks": layout.num_blocks,
    }


def layout_from_wire(obj: Any) -> BlockLayout:
    """Inverse of :func:`layout_to_wire`; raises :class:`HandshakeError` for malformed input."""
    try:
        regions = tuple(
            MemoryRegion(addr=int(a), length=int(n), kind=MemoryKind(k), device_id=int(d))
            for a, n, k, d in obj["regions"]
        )
        return BlockLayout(
            regions=regions,
            block_lens=tuple(int(b) for b in obj["block_lens"]),
            num_blocks=int(obj["num_blocks"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise HandshakeError(f"malformed KV layout in handshake: {exc}") from exc


@attrs.frozen(kw_only=True)
class HandshakeRequest:
    """What D sends."""

    engine_id: str
    rank: int
    transport: str
    transport_metadata: bytes


@attrs.frozen(kw_only=True)
class HandshakeResponse:
    """What P answers."""

    engine_id: str
    rank: int
    tp_size: int
    transport: str
    transport_metadata: bytes
    layout: BlockLayout
    kv_lease_duration: float
    extra: Mapping[str, Any] = attrs.field(factory=dict)
    """Connector-specific facts (plain msgpack types)."""


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


def _frame(kind: int, chash: bytes, payload: Mapping[str, Any]) -> bytes:
    body: bytes = msgpack.packb(payload, use_bin_type=True)
    return _HEADER.pack(_MAGIC, HANDSHAKE_VERSION, kind, chash) + body


def _unframe(data: bytes) -> tuple[int, int, bytes, bytes]:
    if len(data) < _HEADER.size:
        raise HandshakeError(f"handshake frame of {len(data)} bytes is shorter than its header")
    magic, version, kind, chash = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise HandshakeError(f"not a kvframe handshake frame (magic {magic!r})")
    if len(data) - _HEADER.size > MAX_PAYLOAD:
        raise HandshakeError(f"handshake payload over {MAX_PAYLOAD} bytes")
    return version, kind, chash, data[_HEADER.size :]


def _decode_map(body: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=MAX_PAYLOAD)
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise HandshakeError(f"undecodable handshake payload: {exc}") from exc
    if not isinstance(obj, dict):
        raise HandshakeError(f"handshake payload is a {type(obj).__name__}, not a map")
    return obj


def _field(obj: Mapping[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    value = obj.get(key)
    if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
        raise HandshakeError(f"handshake field {key!r} is {value!r}, expected {typ}")
    return value


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
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    deadline = clock() + timeout
    got: list[ClockSample] = []
    response: HandshakeResponse | None = None
    payload = {
        "engine_id": request.engine_id,
        "rank": request.rank,
        "transport": request.transport,
        "transport_metadata": request.transport_metadata,
    }
    try:
        sock.connect(f"tcp://{host}:{port}")
        for i in range(max(1, samples)):
            t_send = clock()
            sock.send(_frame(_REQUEST, chash, payload if i == 0 else {"ping": True}))
            remaining = deadline - clock()
            if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                raise HandshakeTimeoutError(
                    f"no handshake answer from {host}:{port} within {timeout:g} s; is the "
                    "prefill engine running and is its side-channel port reachable?"
                )
            data = sock.recv()
            t_recv = clock()
            version, kind, their_hash, body = _unframe(data)
            obj = _decode_map(body) if version == HANDSHAKE_VERSION else {}
            if kind == _ERROR or version != HANDSHAKE_VERSION:
                reason = obj.get("message", "") if isinstance(obj, dict) else ""
                if version != HANDSHAKE_VERSION or obj.get("code") == "incompatible":
                    raise IncompatiblePeerError(
                        f"{host}:{port} refused the handshake: {reason or 'version mismatch'} "
                        f"(our version {HANDSHAKE_VERSION}, theirs {version}; our hash "
                        f"{chash.hex()}, theirs {their_hash.hex()})"
                    )
                raise HandshakeError(f"{host}:{port} refused the handshake: {reason}")
            if kind != _RESPONSE:
                raise HandshakeError(f"unexpected handshake frame kind {kind} from {host}:{port}")
            got.append(
                ClockSample(
                    t_send=t_send, t_recv=t_recv, remote_now=float(_field(obj, "now", (int, float)))
                )
            )
            if i == 0:
                response = HandshakeResponse(
                    engine_id=_field(obj, "engine_id", str),
                    rank=_field(obj, "rank", int),
                    tp_size=_field(obj, "tp_size", int),
                    transport=_field(obj, "transport", str),
                    transport_metadata=_field(obj, "transport_metadata", bytes),
                    layout=layout_from_wire(_field(obj, "layout", dict)),
                    kv_lease_duration=float(_field(obj, "kv_lease_duration", (int, float))),
                    extra=_field(obj, "extra", dict),
                )
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
    with an error frame when possible and counted in :attr:`rejected`; the server keeps
    serving. :meth:`close` stops the thread and releases the socket; safe twice.
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
        return _frame(_ERROR, self._chash, {"code": code, "message": message})

    def _answer(self, data: bytes) -> bytes:
        try:
            version, kind, their_hash, body = _unframe(data)
        except HandshakeError as exc:
            return self._reject("malformed", str(exc))
        if version != HANDSHAKE_VERSION:
            return self._reject(
                "incompatible",
                f"handshake version {version} is not supported (this side speaks "
                f"{HANDSHAKE_VERSION})",
            )
        if their_hash != self._chash:
            return self._reject(
                "incompatible",
                f"compatibility hash mismatch: the engines disagree on KV layout, dtype, block "
                f"size or transport (ours {self._chash.hex()}, yours {their_hash.hex()})",
            )
        if kind != _REQUEST:
            return self._reject("malformed", f"unexpected frame kind {kind}")
        try:
            obj = _decode_map(body)
            if obj.get("ping") is True:
                return _frame(_RESPONSE, self._chash, {"now": self._clock()})
            request = HandshakeRequest(
                engine_id=_field(obj, "engine_id", str),
                rank=_field(obj, "rank", int),
                transport=_field(obj, "transport", str),
                transport_metadata=_field(obj, "transport_metadata", bytes),
            )
            response = self._respond(request)
        except HandshakeError as exc:
            return self._reject("malformed", str(exc))
        except Exception as exc:  # the responder refused (e.g. wrong transport name)
            return self._reject("refused", f"{type(exc).__name__}: {exc}")
        with self._lock:
            self.served += 1
        return _frame(
            _RESPONSE,
            self._chash,
            {
                "engine_id": response.engine_id,
                "rank": response.rank,
                "tp_size": response.tp_size,
                "transport": response.transport,
                "transport_metadata": response.transport_metadata,
                "layout": layout_to_wire(response.layout),
                "kv_lease_duration": response.kv_lease_duration,
                "extra": dict(response.extra),
                "now": self._clock(),
            },
        )

    def close(self) -> None:
        """Stop serving and release the socket. Safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(linger=0)
