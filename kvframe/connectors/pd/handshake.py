"""The P/D side channel: a pyzmq request/response handshake between engine workers.

Decode (D) asks, prefill (P) answers. One exchange gives D everything it needs to read P's KV
cache and gives P what it needs to talk back (heartbeat acknowledgements and failure notices):

- D → P: :class:`HandshakeRequest` — D's engine id, rank and tensor-parallel size, D's
  transport name and transport metadata, D's KV layout facts (:class:`KVLayoutFacts`).
- P → D: :class:`HandshakeAccept` — a :class:`HandshakeResponse` (P's engine id, rank and
  tensor-parallel size, P's transport metadata, P's KV
  :class:`~kvframe.spi.transport.BlockLayout` and layout facts, the lease duration, P's
  incarnation) and P's clock reading; or a :class:`HandshakeRefusal` saying why not.
- Both sides compare the layout facts field by field (:func:`check_kv_layout`): P refuses a
  mismatch (``"incompatible"``) and D refuses an answer whose facts differ, naming every
  differing field with both values; nothing is prepared for reading then. One exception: an
  NHD/HND order difference alone (equal tensor-parallel sizes, everything else equal) passes
  P, and D accepts it only with ``allow_layout_permute`` (it then reads into a staging area
  and permutes on arrival, :mod:`kvframe.connectors.pd.permute`).
- Later exchanges of the same handshake: :class:`ClockPing` → :class:`ClockPong` (a clock
  reading only).

**Authentication.** With a fleet key (:class:`~kvframe.connectors.pd.auth.KeyRing`) on both
sides, the request is preceded by one more exchange, and P reveals nothing before D proved it
holds the key:

- D → P: :class:`AuthHello` — D's engine id, rank and a fresh nonce.
- P → D: :class:`AuthChallenge` — P's key id, engine id, rank, a fresh nonce, P's clock, and
  P's proof (an HMAC over both nonces and P's identity): D refuses a P that cannot prove it
  holds the key, or that is not the engine the ticket named.
- D → P: the :class:`HandshakeRequest` with D's proof over both nonces, D's identity and its
  transport metadata; P answers with the accept only when the proof matches the challenge it
  sent on that connection.

Both sides then hold the same session key (:func:`kvframe.connectors.pd.auth.session_key`),
which tags the connection's notifications. A P without a key refuses a hello, a P with a key
refuses a request without a proof (code ``"unauthenticated"``): both sides must be configured
alike. A challenge is one HMAC; P keeps at most :data:`MAX_PENDING` unanswered challenges
(the oldest is forgotten first) for at most ``challenge_ttl`` seconds.

**Bounds.** P answers at most ``rate`` messages per second per source address (with a burst
of ``burst``); the rest are dropped unanswered and counted in
:attr:`HandshakeServer.rate_limited`, so a flood costs its sender, not P's engine. Frames are at
most ``MAX_PAYLOAD`` bytes, refused by ZeroMQ before they are read.

**Frame.** Every message is ``header + payload``. The header is fixed-size and checked *before*
the payload is decoded, so an incompatible or hostile peer never reaches the decoder::

    offset size  field
    0      4     magic  b"KVFH"
    4      1     side-channel version (HANDSHAKE_VERSION)
    5      16    compatibility hash (blake2b-128 of what both sides must agree on
                 besides the KV layout, which the messages carry as fields)
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

import collections
import hashlib
import math
import secrets
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from kvframe.connectors.pd.auth import NONCE_BYTES, KeyRing
from kvframe.core.blocksize import block_size_problem, token_axis
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
    "LAYOUT_ORDERS",
    "MAX_PAYLOAD",
    "MAX_PENDING",
    "REFUSAL_CODES",
    "AuthChallenge",
    "AuthHello",
    "ClockPing",
    "ClockPong",
    "ClockSample",
    "HandshakeAccept",
    "HandshakeRefusal",
    "HandshakeRequest",
    "HandshakeResponse",
    "HandshakeResult",
    "HandshakeServer",
    "KVLayerFacts",
    "KVLayoutFacts",
    "RateLimiter",
    "check_kv_layout",
    "compat_hash",
    "decode_frame",
    "encode_frame",
    "handshake",
    "layout_digest",
    "layout_mismatches",
]

#: The side-channel protocol version; a peer speaking another one is refused before its
#: payload is decoded. (5: both sides carry their KV layout as fields, :class:`KVLayoutFacts`,
#: compared field by field; 4: D's request carries its tensor-parallel size, bound in its
#: proof; 3: authentication; 2: the payload is a codec message; 1 was a bare msgpack map.)
HANDSHAKE_VERSION = 5
#: The most unanswered challenges P keeps (the oldest is forgotten first).
MAX_PENDING = 1024
#: The longest engine id either side accepts in a handshake message.
_MAX_ID = 255
#: The largest payload (bytes) either side accepts.
MAX_PAYLOAD = 1 << 20
_MAGIC = b"KVFH"
_HEADER = struct.Struct("!4sB16s")
_MAX_REASON = 2000  # characters of a refusal's message: a refusal always fits in a frame
REFUSAL_CODES = frozenset({"malformed", "incompatible", "refused", "unauthenticated"})
"""Why a server refused: the request was not a valid frame, the peer speaks another version
or has another compatibility hash, the responder refused it (wrong transport, busy, ...), or
authentication failed or is configured on one side only."""


def compat_hash(**facts: Any) -> bytes:
    """A 16-byte hash of what both sides must agree on that the handshake does not carry as
    fields (the P/D connector: the model, the transport name, the KV groups; the KV layout
    travels as :class:`KVLayoutFacts` and is compared field by field). Keys are sorted, values
    stringified with ``repr``, so the hash is stable across processes and hosts."""
    text = ";".join(f"{k}={facts[k]!r}" for k in sorted(facts))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _non_empty(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_ID:
        raise ValueError(
            f"{attribute.name} = {str(value)[:40]!r}; it must be a non-empty str of at most "
            f"{_MAX_ID} characters"
        )


def _nonce(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise ValueError(f"{attribute.name} must be {NONCE_BYTES} bytes")


def _proof(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bytes) or len(value) not in (0, 32):
        raise ValueError(f"{attribute.name} must be 32 bytes (or empty: no proof)")


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


#: The KV cache orders a :class:`KVLayoutFacts` may name, with the per-layer shape each means
#: (dim 0 is always the block id: the P/D connector moves whole blocks).
LAYOUT_ORDERS: dict[str, str] = {
    "NHD": "[blocks, 2, block_size, heads, head_size] (K/V, tokens, then heads)",
    "HND": "[blocks, 2, heads, block_size, head_size] (K/V, heads, then tokens)",
    "block-major": "[blocks, ...] (not interpreted: every layer's shape must be equal)",
}
_MAX_LAYERS = 4096
_MAX_DIMS = 8
_MAX_DIM = 1 << 40
_MAX_SMALL = 1 << 20
_DTYPE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")


def _dtype(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= 32 or not _DTYPE_CHARS.issuperset(value):
        raise ValueError(
            f"{attribute.name} = {str(value)[:40]!r}; it must be a dtype name of at most 32 "
            "letters, digits, '_' or '.' (torch.float16)"
        )


def _shape(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if (
        not isinstance(value, tuple)
        or len(value) > _MAX_DIMS
        or not all(type(x) is int and 0 < x <= _MAX_DIM for x in value)
    ):
        raise ValueError(
            f"{attribute.name} = {str(value)[:80]}; it must be at most {_MAX_DIMS} positive "
            f"ints of at most {_MAX_DIM}"
        )


def _small(lowest: int) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if type(value) is not int or not lowest <= value <= _MAX_SMALL:
            raise ValueError(
                f"{attribute.name} = {str(value)[:40]}; it must be an int from {lowest} to "
                f"{_MAX_SMALL}"
            )

    return check


def _order(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in LAYOUT_ORDERS:
        raise ValueError(
            f"{attribute.name} = {str(value)[:40]!r}; it must be one of {sorted(LAYOUT_ORDERS)}"
        )


def _layers(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not 0 < len(value) <= _MAX_LAYERS:
        raise ValueError(f"{attribute.name} must hold 1 to {_MAX_LAYERS} layers")
    if not all(isinstance(x, KVLayerFacts) for x in value):
        raise ValueError(f"{attribute.name} must hold KVLayerFacts values")


@attrs.frozen(kw_only=True)
class KVLayerFacts:
    """One layer of a :class:`KVLayoutFacts`: its name, its shape after the block dimension
    as this rank's cache holds it, and its dtype."""

    name: str = attrs.field(validator=_non_empty)
    shape: tuple[int, ...] = attrs.field(validator=_shape)
    dtype: str = attrs.field(validator=_dtype)


@attrs.frozen(kw_only=True)
class KVLayoutFacts:
    """A worker's KV cache layout as the handshake carries it (both directions, version 5).

    Each side compares the other's facts with its own (:func:`check_kv_layout`) and refuses a
    mismatch with an :class:`~kvframe.errors.IncompatiblePeerError` that names every differing
    field with both values and what would work: P before it answers (a refusal of code
    ``"incompatible"``), D again on P's answer, before it prepares anything to read. Every
    field is validated on decoding (a hostile value is a
    :class:`~kvframe.errors.HandshakeError`).
    """

    order: str = attrs.field(validator=_order)
    """The cache's dimension order, one of :data:`LAYOUT_ORDERS`."""
    block_size: int = attrs.field(validator=_small(1))
    """Tokens per block. The peer's may differ when one is a whole multiple of the other and
    both orders are NHD or HND (D regroups the blocks in pull mode,
    :mod:`kvframe.core.blocksize`); the layers' token dimension must then say the same."""
    head_size: int = attrs.field(default=0, validator=_small(0))
    """Elements per head (``0``: not interpreted, the ``block-major`` order)."""
    num_kv_heads: int = attrs.field(default=0, validator=_small(0))
    """The model's KV heads, all ranks together (``0``: the engine does not say)."""
    kv_heads_per_rank: int = attrs.field(default=0, validator=_small(0))
    """The KV heads this rank holds (``0``: the engine does not say)."""
    tp_size: int = attrs.field(default=1, validator=_small(1))
    """The engine's tensor-parallel size."""
    layers: tuple[KVLayerFacts, ...] = attrs.field(validator=_layers)
    """Every layer, in registration order."""

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The layers' distinct dtypes, in order of first appearance."""
        return tuple(dict.fromkeys(x.dtype for x in self.layers))


def layout_mismatches(mine: KVLayoutFacts, theirs: KVLayoutFacts) -> list[str]:
    """Every field on which ``theirs`` (the peer's) differs from ``mine``, one sentence each
    naming both values and what would work; empty when KV can move between them unchanged.

    The per-rank head count is compared only at equal tensor-parallel sizes (at different
    sizes each rank holds its own share, :mod:`kvframe.core.tp`); layer shapes only where the
    fields above do not already explain them (the ``block-major`` order, or equal facts), and
    without their token dimension. Block sizes may differ when one is a whole multiple of the
    other and both caches can be cut into token ranges (NHD or HND): D then regroups the blocks
    as it reads (:mod:`kvframe.core.blocksize`, pull mode only; a push between different block
    sizes is refused when it starts); any other pair of sizes is refused naming both and what
    would work (:func:`kvframe.core.blocksize.block_size_problem`)."""
    out: list[str] = []

    def differ(field: str, a: object, b: object, fix: str) -> None:
        if a != b:
            out.append(f"{field}: this engine {a}, the peer {b}; {fix}")

    differ(
        "cache order",
        f"{mine.order} {LAYOUT_ORDERS[mine.order].split(' (')[0]}",
        f"{theirs.order} {LAYOUT_ORDERS[theirs.order].split(' (')[0]}",
        "configure both engines' KV cache layout alike, or (NHD and HND only) set "
        "allow_layout_permute on the decoder to permute blocks on arrival",
    )
    sizes = block_size_problem(mine.block_size, theirs.block_size, mine.order, theirs.order)
    if sizes is not None:
        out.append(sizes)
    elif mine.block_size != theirs.block_size:
        # Blocks will be regrouped by the token dimension: it must say what block_size says.
        for facts, whose in ((mine, "this engine's"), (theirs, "the peer's")):
            axis = token_axis(facts.order)
            bad = [x for x in facts.layers if axis is None or len(x.shape) <= axis]
            bad += [
                x
                for x in facts.layers
                if axis is not None and x not in bad and x.shape[axis] != facts.block_size
            ]
            if bad:
                out.append(
                    f"layer {bad[0].name[:40]!r}: {whose} shape {list(bad[0].shape)[:8]} does "
                    f"not hold blocks of {facts.block_size} tokens in the {facts.order} order; "
                    "serve the same model with a consistent KV cache on both engines"
                )
    differ(
        "dtype",
        "/".join(mine.dtypes),
        "/".join(theirs.dtypes),
        "run both engines with one KV cache dtype",
    )
    differ(
        "head size",
        mine.head_size or "unknown",
        theirs.head_size or "unknown",
        "serve the same model on both engines",
    )
    differ(
        "KV heads",
        mine.num_kv_heads or "unknown",
        theirs.num_kv_heads or "unknown",
        "serve the same model on both, and give both connectors EngineInfo.num_kv_heads or neither",
    )
    if mine.tp_size == theirs.tp_size:
        differ(
            "KV heads per rank",
            mine.kv_heads_per_rank or "unknown",
            theirs.kv_heads_per_rank or "unknown",
            "shard the heads alike on both engines",
        )
    names = [x.name for x in mine.layers], [x.name for x in theirs.layers]
    if names[0] != names[1]:
        differ(
            "layers",
            f"{len(names[0])} ({_names(names[0])})",
            f"{len(names[1])} ({_names(names[1])})",
            "serve the same model on both engines",
        )
    elif not out and mine.layers != theirs.layers:
        for a, b in zip(mine.layers, theirs.layers, strict=True):
            if _per_token(a, mine.order) != _per_token(b, theirs.order):
                differ(
                    f"layer {a.name!r}",
                    f"{list(a.shape)} {a.dtype}",
                    f"{list(b.shape)} {b.dtype}",
                    "serve the same model with the same KV cache shape on both engines",
                )
                break
    return out


def _per_token(layer: KVLayerFacts, order: str) -> KVLayerFacts:
    # A layer's facts without its token dimension: blocks of different sizes (refused above
    # unless they can be regrouped, kvframe.core.blocksize) differ there and nowhere else.
    axis = token_axis(order)
    if axis is None or axis >= len(layer.shape):
        return layer
    return attrs.evolve(layer, shape=(*layer.shape[:axis], 1, *layer.shape[axis + 1 :]))


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n[:40]) for n in names[:3])
    return shown + (", ..." if len(names) > 3 else "")


def check_kv_layout(
    mine: KVLayoutFacts | None,
    theirs: KVLayoutFacts | None,
    peer: str,
    *,
    permute: bool = False,
) -> None:
    """Raise :class:`~kvframe.errors.IncompatiblePeerError` when ``peer`` (``"the decoder"``,
    ``"the prefill engine"``) sent no layout while this side has one, or one that differs
    (:func:`layout_mismatches`, every field named). Nothing to check when ``mine`` is
    ``None``.

    With ``permute``, facts that differ in the NHD/HND order alone at equal tensor-parallel
    sizes pass (:func:`kvframe.connectors.pd.permute.permutable`: the reader permutes on
    arrival); any other difference is refused with every field named. An HND cache is refused
    at a different tensor-parallel size whatever ``permute`` says (heterogeneous tensor
    parallelism reads head runs of NHD caches only)."""
    if mine is None:
        return
    if theirs is None:
        raise IncompatiblePeerError(
            f"{peer} sent no KV layout; run the same kvframe version on both engines"
        )
    # Imported here: the permutation module builds on this one.
    from kvframe.connectors.pd.permute import order_refusal, permute_refusal

    if permute and mine.order != theirs.order:
        wrong = permute_refusal(mine, theirs)
    else:
        wrong = layout_mismatches(mine, theirs)
    wrong += order_refusal(mine, theirs)
    if wrong:
        raise IncompatiblePeerError(
            f"KV layout mismatch with {peer}, nothing is read: " + "; and ".join(wrong)
        )


@attrs.frozen(kw_only=True)
class AuthHello:
    """D opens an authenticated handshake (tag ``pd.handshake.hello``)."""

    engine_id: str = attrs.field(validator=_non_empty)
    rank: int = attrs.field(validator=_rank)
    nonce: bytes = attrs.field(validator=_nonce)


@attrs.frozen(kw_only=True)
class AuthChallenge:
    """P's answer to an :class:`AuthHello` (tag ``pd.handshake.challenge``)."""

    key_id: str = attrs.field(validator=_non_empty)
    engine_id: str = attrs.field(validator=_non_empty)
    rank: int = attrs.field(validator=_rank)
    nonce: bytes = attrs.field(validator=_nonce)
    proof: bytes = attrs.field(validator=_proof)
    """P's proof: HMAC over D's nonce, P's nonce, P's engine id and rank."""
    now: float = attrs.field(validator=_finite)
    """P's clock when it answered (a clock sample, as :class:`ClockPong`)."""


@attrs.frozen(kw_only=True)
class HandshakeRequest:
    """What D sends (tag ``pd.handshake.request``)."""

    engine_id: str = attrs.field(validator=_non_empty)
    rank: int = attrs.field(validator=_rank)
    transport: str
    transport_metadata: bytes
    tp_size: int = attrs.field(default=1, validator=_positive_int)
    """D's tensor-parallel size: P works out which of D's ranks read from it (heterogeneous
    tensor parallelism, :mod:`kvframe.core.tp`)."""
    proof: bytes = attrs.field(default=b"", validator=_proof)
    """D's proof (authenticated handshakes; empty otherwise): HMAC over P's nonce, D's nonce,
    D's engine id, rank, transport, transport metadata and layout."""
    layout: BlockLayout | None = None
    """D's own KV layout (push mode: P writes into D's blocks with it); ``None``: D takes no
    pushed KV."""
    kv_layout: KVLayoutFacts | None = None
    """D's KV layout facts (a kvframe D always sends them); a P with its own refuses other
    facts, and a push request (``layout`` given) without facts."""


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
    kv_layout: KVLayoutFacts | None = None
    """P's KV layout facts (a :class:`HandshakeServer` given ``kv_layout`` fills them in); a D
    with its own refuses an answer without them or with others."""
    lease_table: BlockLayout | None = None
    """P's lease table (``lease_table_slots`` 8-byte slots in one host region:
    :mod:`kvframe.core.slots`), or ``None`` when it keeps none. D reads a slot of it only to
    prove a lease; one of another shape is ignored."""


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
        "pd.handshake.hello": AuthHello,
        "pd.handshake.challenge": AuthChallenge,
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
    session_key: bytes | None = attrs.field(default=None, repr=False)
    """The connection's session key (authenticated handshakes), ``None`` otherwise."""


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


def _p_binds(d_nonce: bytes, p_nonce: bytes, engine_id: str, rank: int) -> tuple[bytes, ...]:
    return (d_nonce, p_nonce, engine_id.encode(), str(rank).encode())


def _d_binds(p_nonce: bytes, d_nonce: bytes, request: HandshakeRequest) -> tuple[bytes, ...]:
    meta = hashlib.sha256(request.transport_metadata).digest()
    fields = (request.engine_id, str(request.rank), request.transport, str(request.tp_size))
    binds = (p_nonce, d_nonce, *(f.encode() for f in fields), meta)
    if request.kv_layout is not None:
        binds = (*binds, hashlib.sha256(repr(request.kv_layout).encode()).digest())
    if request.layout is None:
        return binds
    return (*binds, layout_digest(request.layout))


def layout_digest(layout: BlockLayout) -> bytes:
    """SHA-256 over a layout's regions (address, length, kind, device), block lengths and
    block count: what an authenticated request's proof binds."""
    h = hashlib.sha256(b"layout")
    for r in layout.regions:
        h.update(f"{r.addr}:{r.length}:{r.kind.value}:{r.device_id};".encode())
    h.update(repr((tuple(layout.block_lens), layout.num_blocks)).encode())
    return h.digest()


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
    keys: KeyRing | None = None,
    expect_engine: str | None = None,
    allow_permute: bool = False,
) -> HandshakeResult:
    """Ask the P worker listening at ``host:port``; blocks up to ``timeout`` seconds in all.

    Makes ``samples`` exchanges (the first carries the request; all give clock samples); with
    ``keys``, an authenticated one (see the module docs) whose challenge is one of them, and P
    must prove it holds the fleet key and, with ``expect_engine``, that it is that engine.
    With ``request.kv_layout``, P's answer must carry equal layout facts
    (:func:`check_kv_layout`), or with ``allow_permute`` facts that differ in the NHD/HND
    order alone (the caller then permutes what it reads, :mod:`kvframe.connectors.pd.permute`).
    Raises :class:`HandshakeTimeoutError`, :class:`IncompatiblePeerError` or
    :class:`HandshakeError`. Nothing is left open after it returns or raises.
    """
    d_nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        if keys is None:
            first = encode_frame(request, chash)
        else:
            first = encode_frame(
                AuthHello(engine_id=request.engine_id, rank=request.rank, nonce=d_nonce), chash
            )
    except (TypeError, ValueError) as exc:
        raise HandshakeError(f"cannot send the handshake request to {host}:{port}: {exc}") from exc
    ping = encode_frame(ClockPing(), chash)
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, _HEADER.size + MAX_PAYLOAD)
    deadline = clock() + timeout
    got: list[ClockSample] = []
    response: HandshakeResponse | None = None
    session: bytes | None = None
    exchanges = max(2 if keys is not None else 1, samples)
    try:
        sock.connect(f"tcp://{host}:{port}")
        nxt = first
        for i in range(exchanges):
            t_send = clock()
            sock.send(nxt)
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
            if keys is not None and i == 0:
                if not isinstance(answer, AuthChallenge):
                    raise HandshakeError(
                        f"{host}:{port} answered a {type(answer).__name__}; expected an "
                        "AuthChallenge (is the prefill engine configured without a fleet key?)"
                    )
                binds = _p_binds(d_nonce, answer.nonce, answer.engine_id, answer.rank)
                if not keys.check_proof(answer.key_id, b"P", answer.proof, *binds):
                    raise HandshakeError(
                        f"{host}:{port} failed to prove it holds the fleet key (key id "
                        f"{answer.key_id[:16]!r}); it is not an engine of this fleet, or the "
                        "engines have different auth_key_file contents"
                    )
                if expect_engine is not None and answer.engine_id != expect_engine:
                    raise HandshakeError(
                        f"{host}:{port} is engine {answer.engine_id[:64]!r}, not "
                        f"{expect_engine[:64]!r} named in the ticket"
                    )
                proof = keys.proof(answer.key_id, b"D", *_d_binds(answer.nonce, d_nonce, request))
                session = keys.session(answer.key_id, d_nonce, answer.nonce)
                assert proof is not None
                nxt = encode_frame(attrs.evolve(request, proof=proof), chash)
                got.append(ClockSample(t_send=t_send, t_recv=t_recv, remote_now=answer.now))
                continue
            expected = HandshakeAccept if response is None else ClockPong
            if not isinstance(answer, expected):
                raise HandshakeError(
                    f"{host}:{port} answered a {type(answer).__name__}; expected a "
                    f"{expected.__name__}"
                )
            got.append(ClockSample(t_send=t_send, t_recv=t_recv, remote_now=answer.now))
            if isinstance(answer, HandshakeAccept):
                response = answer.response
                try:
                    check_kv_layout(
                        request.kv_layout,
                        response.kv_layout,
                        "the prefill engine",
                        permute=allow_permute,
                    )
                except IncompatiblePeerError as exc:
                    raise IncompatiblePeerError(f"{host}:{port}: {exc}") from None
            nxt = ping
    except zmq.ZMQError as exc:
        raise HandshakeError(f"handshake with {host}:{port} failed: {exc}") from exc
    finally:
        sock.close(linger=0)
    assert response is not None
    return HandshakeResult(response=response, samples=tuple(got), session_key=session)


@attrs.define
class RateLimiter:
    """Token buckets per source: ``rate`` per second, at most ``burst`` at once, for at most
    ``max_sources`` sources (the least recently seen is forgotten first). Sans-I/O: every call
    takes ``now``."""

    rate: float
    burst: float
    max_sources: int = 4096
    _buckets: collections.OrderedDict[str, tuple[float, float]] = attrs.field(
        factory=collections.OrderedDict, init=False
    )

    def allow(self, source: str, now: float) -> bool:
        """Take one token of ``source``'s bucket; False when it is empty."""
        tokens, last = self._buckets.pop(source, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
        ok = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_sources:
            self._buckets.popitem(last=False)
        return ok


class HandshakeServer:
    """P's side: answers handshakes on ``tcp://host:port`` from a background thread.

    ``respond(request, session_key) -> HandshakeResponse`` builds the answer (it must be
    thread-safe: it runs on the server thread; typically it returns a prepared value and queues
    the requester's transport metadata and session key for the engine thread); ``session_key``
    is ``None`` unless the handshake was authenticated. With ``keys`` every request must be
    authenticated (see the module docs); without, none can be. ``port=0`` binds an ephemeral
    port; read :attr:`port` after construction. Malformed, incompatible, unauthenticated or
    oversized requests are answered with a :class:`HandshakeRefusal` when possible and counted
    in :attr:`rejected` (the reason in :attr:`last_error`); messages over the per-source rate
    are dropped unanswered and counted in :attr:`rate_limited`; challenges sent are counted in
    :attr:`challenged` and accepted handshakes in :attr:`served`; the server keeps serving.
    With ``kv_layout``, a request (once authenticated, with ``keys``) whose
    :class:`KVLayoutFacts` differ is refused as ``"incompatible"``, naming every differing
    field (:func:`check_kv_layout`; a difference in the NHD/HND order alone passes: the
    decoder decides whether it permutes on arrival), before ``respond`` is called, and so is a
    push request (one with a ``layout``: P would write into it) without facts; a pull request
    without facts is answered, its reader checks the answer's facts; an answer ``respond``
    built without layout facts gets ``kv_layout``.
    :meth:`close` stops the thread and releases the socket; safe twice.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        chash: bytes,
        respond: Callable[[HandshakeRequest, bytes | None], HandshakeResponse],
        engine_id: str = "",
        rank: int = 0,
        keys: KeyRing | None = None,
        rate: float = 200.0,
        burst: float = 400.0,
        challenge_ttl: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context[Any] | None = None,
        kv_layout: KVLayoutFacts | None = None,
    ) -> None:
        if keys is not None and not engine_id:
            raise ValueError("an authenticating HandshakeServer needs its engine_id")
        self._ctx = context or zmq.Context.instance()
        self._chash = chash
        self._respond = respond
        self._kv_layout = kv_layout
        self._clock = clock
        self._keys = keys
        self._engine_id = engine_id
        self._rank = rank
        self._limiter = RateLimiter(rate=rate, burst=burst)
        self._challenge_ttl = challenge_ttl
        # ROUTER identity -> (D's nonce, P's nonce, key id, D engine, D rank, sent at)
        self._pending: collections.OrderedDict[bytes, tuple[bytes, bytes, str, str, int, float]] = (
            collections.OrderedDict()
        )
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
        self.rate_limited = 0
        self.challenged = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._serve, name=f"kvframe-handshake-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def authenticated(self) -> bool:
        """True when every handshake must prove the fleet key."""
        return self._keys is not None

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                frames = self._sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                continue
            if len(frames) != 2:
                continue
            ident, frame = frames[0].bytes, frames[1]
            try:
                source = str(frame.get("Peer-Address"))
            except zmq.ZMQError:
                source = "?"
            if not self._limiter.allow(source, self._clock()):
                with self._lock:
                    self.rate_limited += 1
                continue
            reply = self._answer(ident, frame.bytes)
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

    def _challenge(self, ident: bytes, hello: AuthHello) -> bytes:
        if self._keys is None:
            return self._reject(
                "unauthenticated",
                "this engine has no fleet key (auth_key_file) but the requester authenticates; "
                "give both engines the same auth_key_file, or neither",
            )
        now = self._clock()
        p_nonce = secrets.token_bytes(NONCE_BYTES)
        kid = self._keys.signing_id
        proof = self._keys.proof(
            kid, b"P", *_p_binds(hello.nonce, p_nonce, self._engine_id, self._rank)
        )
        assert proof is not None
        self._pending.pop(ident, None)
        self._pending[ident] = (hello.nonce, p_nonce, kid, hello.engine_id, hello.rank, now)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
        with self._lock:
            self.challenged += 1
        challenge = AuthChallenge(
            key_id=kid,
            engine_id=self._engine_id,
            rank=self._rank,
            nonce=p_nonce,
            proof=proof,
            now=now,
        )
        return encode_frame(challenge, self._chash)

    def _authenticate(self, ident: bytes, request: HandshakeRequest) -> tuple[bytes | None, str]:
        """The session key of an authenticated request, or ``None`` and why not."""
        assert self._keys is not None
        pending = self._pending.pop(ident, None)
        if pending is None:
            return None, (
                "this engine requires an authenticated handshake (it has a fleet key, "
                "auth_key_file) and got a request without a challenge; give both engines the "
                "same auth_key_file"
            )
        d_nonce, p_nonce, kid, engine_id, rank, sent = pending
        if self._clock() - sent > self._challenge_ttl:
            return None, "the challenge expired before the request came; handshake again"
        if (request.engine_id, request.rank) != (engine_id, rank):
            return None, "the request names another engine than its hello"
        if not self._keys.check_proof(
            kid, b"D", request.proof, *_d_binds(p_nonce, d_nonce, request)
        ):
            return None, (
                "the requester failed to prove it holds the fleet key; it is not an engine of "
                "this fleet, or the engines have different auth_key_file contents"
            )
        return self._keys.session(kid, d_nonce, p_nonce), ""

    def _answer(self, ident: bytes, data: bytes) -> bytes:
        # The version and the compatibility hash are checked before the payload is decoded.
        try:
            message = decode_frame(data, self._chash)
        except IncompatiblePeerError as exc:
            return self._reject("incompatible", str(exc))
        except HandshakeError as exc:
            return self._reject("malformed", str(exc))
        if isinstance(message, ClockPing):
            return encode_frame(ClockPong(now=self._clock()), self._chash)
        if isinstance(message, AuthHello):
            return self._challenge(ident, message)
        if not isinstance(message, HandshakeRequest):
            return self._reject(
                "malformed",
                f"unexpected handshake message {type(message).__name__}; expected an AuthHello, "
                "a HandshakeRequest or a ClockPing",
            )
        session: bytes | None = None
        if self._keys is not None:
            session, why = self._authenticate(ident, message)
            if session is None:
                return self._reject("unauthenticated", why)
        elif message.proof:
            return self._reject(
                "unauthenticated",
                "this engine has no fleet key (auth_key_file) but the request carries a proof",
            )
        try:
            if message.kv_layout is not None or message.layout is not None:
                # A pull request without facts is not refused here: its reader checks the
                # facts of the answer (a kvframe D always does, and sends its own).
                # An NHD/HND order difference alone passes: the decoder refuses it unless it
                # permutes on arrival (allow_layout_permute), and this engine never writes
                # into a layout it does not match (the responder drops a differing
                # decoder's layout, so nothing is pushed into it).
                check_kv_layout(self._kv_layout, message.kv_layout, "the decoder", permute=True)
        except IncompatiblePeerError as exc:
            return self._reject("incompatible", str(exc))
        try:
            response = self._respond(message, session)
            if response.kv_layout is None and self._kv_layout is not None:
                response = attrs.evolve(response, kv_layout=self._kv_layout)
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
