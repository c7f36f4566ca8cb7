"""``kv_connector_extra_config`` of the P/D connector, validated."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

import attrs

from kvframe.connectors.pd.auth import KeyRing
from kvframe.core.clock import DecoderBlocksTTL
from kvframe.core.lease import LeasePolicy
from kvframe.core.slots import MAX_SLOTS
from kvframe.errors import ConfigError

__all__ = ["PDOptions"]

_PATH = "kv_connector_extra_config"


@attrs.frozen(kw_only=True)
class PDOptions:
    """The P/D connector's options (see the table in ``docs/pd.md``)."""

    transport: str = "nixl"
    transport_options: Mapping[str, Any] = attrs.field(factory=dict)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    handshake_timeout: float = 5.0
    read_margin: float | None = None
    peer_idle_ttl: float = 600.0
    push_layerwise: bool = False
    """Push mode, P: write each layer's finished blocks as the prefill computes them (the
    transfer overlaps the prefill), not the whole KV once the request finished."""
    symmetric_leases: bool = False
    """Bidirectional mode, P: heartbeat a decoder's kept blocks from the moment a next-turn
    request that pulls them enters the scheduler (they then stay while P is busy and go within
    one extension when P is gone), not only once the load is allocated."""
    kv_recompute_threshold: int = 64
    """Bidirectional mode, P: pull a conversation's history from D only when the shared prefix
    is at least this many tokens (a shorter one is recomputed)."""
    warmup_timeout: float = 1.0
    """D: after a handshake, warm the new connection (a tiny READ between two buffers the
    transports registered for it, :meth:`~kvframe.spi.transport.Transport.warm_up`) before it
    counts as ready, for at most this many seconds; ``0`` turns warm-ups off. Transports
    without ``capabilities.warm_up`` skip it. At most ``handshake_timeout`` (the default is
    1 s or ``handshake_timeout`` if that is shorter)."""
    optimistic_read: bool = True
    """Pull mode, D: post a load's READ in the same progress point as the heartbeat that asks
    P to confirm its lease, and keep the bytes only once P's acknowledgement confirms a bound
    later than the READ's completion (``kvframe.core.reader``, "Optimistic reads"); ``false``
    posts only after the acknowledgement (one more round trip to P per load)."""
    flush_endpoints: bool = True
    """Pull mode, D: after a heartbeat batch naming a request that waits for its load, post a
    tiny READ from that prefill engine (64 bytes of its first region into a scratch buffer; no
    lease involved) so that the load's READ, posted later, is not held behind the heartbeat:
    NIXL sees a READ posted after a notification complete only at the peer's next progress
    point, one posted on a flushed endpoint inside the post. Ignored on transports with
    ``access_control``; ``false``: no flush READs."""
    lease_table_slots: int = 65536
    """Pull mode, on transports without ``access_control`` (NIXL): P keeps a table of this
    many 8-byte slots (a power of two, at most 4,194,304; 512 KiB by default) in registered
    host memory with a tag of each live pull lease, and D, once an optimistic READ landed
    before P's acknowledgement, READs the lease's slot: the tag still there proves the blocks
    were leased until after the bytes landed, and the load ends without waiting for P
    (``kvframe.core.slots``). D uses a prefill engine's table when its handshake advertises
    one; ``0`` keeps no table (P) and reads none (D)."""
    kept_poll_interval: float = 0.02
    """Bidirectional mode, D: while the only leases held are kept turns, step this often (a
    prefill engine's first heartbeat of a kept turn waits at most this long for its answer)
    instead of at the engine's idle pace."""
    ttl_safety_margin: float | None = None
    """Bidirectional mode, P: seconds subtracted from D's kept-blocks expiry (after the clock
    offset correction and its uncertainty) before P relies on it; ``None``:
    ``min(30, decoder_kv_blocks_ttl / 4)``."""
    allow_layout_permute: bool = False
    """Pull mode, D: read from a prefill engine whose KV cache order is the other of NHD and
    HND (everything else equal, at one tensor-parallel size) into a staging area and permute
    the blocks into this engine's order before the load is reported done
    (:mod:`kvframe.connectors.pd.permute`); ``false`` refuses the handshake, naming both
    orders. A block-major cache is never permuted."""
    permute_staging_blocks: int = 64
    """With :attr:`allow_layout_permute`, D: the staging area's size in blocks (each slot one
    block of every layer, allocated next to the KV cache when it is registered). A load of more
    blocks fails at once; a load that finds too few free slots waits in arrival order, until
    the reader's deadline of a posted load."""
    auth_key_file: str | None = None
    """The fleet key file (see :mod:`kvframe.connectors.pd.auth`); ``None``: unauthenticated."""
    keys: KeyRing | None = attrs.field(default=None, repr=False)
    """The keys read from :attr:`auth_key_file` when the options were parsed."""

    def decoder_ttl(self, decoder_kv_blocks_ttl: float) -> DecoderBlocksTTL:
        """The kept-blocks rule for ``decoder_kv_blocks_ttl``: the ttl with
        :attr:`ttl_safety_margin` (default ``min(30, ttl / 4)``). Raises
        :class:`~kvframe.errors.ConfigError` for a margin at or above the ttl."""
        ttl = decoder_kv_blocks_ttl
        margin = self.ttl_safety_margin
        return DecoderBlocksTTL.from_config(ttl, min(30.0, ttl / 4) if margin is None else margin)

    def margin(self, policy: LeasePolicy) -> float:
        """Seconds of confirmed lease D requires before it posts a read."""
        return self.read_margin if self.read_margin is not None else policy.extension / 4

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any], kv_lease_duration: float | None = None
    ) -> PDOptions:
        """Parse ``kv_connector_extra_config``. Raises :class:`ConfigError` naming the key path,
        the value and what is allowed (and the closest known key for a typo); with
        ``kv_lease_duration``, also a ``read_margin`` at or above the lease extension (D could
        never post a read: a heartbeat confirms at most one extension ahead)."""
        known = {f.name for f in attrs.fields(cls)} - {"keys"}
        for key in extra:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{_PATH}.{key}: unknown option for PDConnector{hint} "
                    f"(known: {', '.join(sorted(known))})"
                )

        def text(key: str, default: str) -> str:
            value = extra.get(key, default)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{_PATH}.{key} = {value!r}; expected a non-empty string")
            return value

        def seconds(key: str, default: float | None) -> float | None:
            value = extra.get(key, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{_PATH}.{key} = {value!r}; expected a number of seconds")
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{_PATH}.{key} = {value!r}; expected a finite number > 0")
            return float(value)

        port = extra.get("side_channel_port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(
                f"{_PATH}.side_channel_port = {port!r}; expected an integer 0..65535 "
                "(0 picks a free port per worker)"
            )
        topts = extra.get("transport_options", {})
        if not isinstance(topts, Mapping):
            raise ConfigError(f"{_PATH}.transport_options = {topts!r}; expected a mapping")
        timeout = seconds("handshake_timeout", 5.0)
        ttl = seconds("peer_idle_ttl", 600.0)
        assert timeout is not None
        assert ttl is not None
        margin = seconds("read_margin", None)
        if margin is not None and kv_lease_duration is not None:
            policy = LeasePolicy.from_duration(kv_lease_duration)
            if margin >= policy.extension:
                raise ConfigError(
                    f"{_PATH}.read_margin = {margin:g}; expected less than the lease extension, "
                    f"{policy.extension:g} s for kv_lease_duration {kv_lease_duration:g} (a "
                    "heartbeat confirms a lease at most one extension ahead, so D could never "
                    f"read): leave it out (default extension / 4 = {policy.extension / 4:g} s) "
                    "or raise kv_lease_duration"
                )
        key_file = extra.get("auth_key_file")
        if key_file is not None and (not isinstance(key_file, str) or not key_file):
            raise ConfigError(
                f"{_PATH}.auth_key_file = {key_file!r}; expected the path of a key file "
                "(`kvframe keygen PATH` writes one)"
            )
        layerwise = extra.get("push_layerwise", False)
        if not isinstance(layerwise, bool):
            raise ConfigError(f"{_PATH}.push_layerwise = {layerwise!r}; expected true or false")
        symmetric = extra.get("symmetric_leases", False)
        if not isinstance(symmetric, bool):
            raise ConfigError(f"{_PATH}.symmetric_leases = {symmetric!r}; expected true or false")
        threshold = extra.get("kv_recompute_threshold", 64)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(
                f"{_PATH}.kv_recompute_threshold = {threshold!r}; expected a whole number of "
                "tokens >= 0 (0 pulls any shared prefix)"
            )
        safety = extra.get("ttl_safety_margin")
        if safety is not None and (
            isinstance(safety, bool)
            or not isinstance(safety, int | float)
            or not math.isfinite(safety)
            or safety < 0
        ):
            raise ConfigError(
                f"{_PATH}.ttl_safety_margin = {safety!r}; expected a finite number of seconds "
                ">= 0, smaller than decoder_kv_blocks_ttl (leave it out for min(30, ttl / 4))"
            )
        warmup = extra.get("warmup_timeout", min(1.0, timeout))
        if (
            isinstance(warmup, bool)
            or not isinstance(warmup, int | float)
            or not math.isfinite(warmup)
            or not 0 <= warmup <= timeout
        ):
            raise ConfigError(
                f"{_PATH}.warmup_timeout = {warmup!r}; expected a number of seconds from 0 (no "
                f"warm-ups) to handshake_timeout ({timeout:g})"
            )
        optimistic = extra.get("optimistic_read", True)
        if not isinstance(optimistic, bool):
            raise ConfigError(f"{_PATH}.optimistic_read = {optimistic!r}; expected true or false")
        permute = extra.get("allow_layout_permute", False)
        if not isinstance(permute, bool):
            raise ConfigError(f"{_PATH}.allow_layout_permute = {permute!r}; expected true or false")
        staging = extra.get("permute_staging_blocks", 64)
        if isinstance(staging, bool) or not isinstance(staging, int) or not 1 <= staging <= 65536:
            raise ConfigError(
                f"{_PATH}.permute_staging_blocks = {staging!r}; expected a whole number of "
                "blocks from 1 to 65536 (the most blocks of permuting loads read at once)"
            )
        table_slots = extra.get("lease_table_slots", 65536)
        if (
            isinstance(table_slots, bool)
            or not isinstance(table_slots, int)
            or table_slots < 0
            or table_slots & (table_slots - 1)
            or table_slots > MAX_SLOTS
        ):
            raise ConfigError(
                f"{_PATH}.lease_table_slots = {table_slots!r}; expected 0 (no lease table) or a "
                f"power of two up to {MAX_SLOTS}"
            )
        flush = extra.get("flush_endpoints", True)
        if not isinstance(flush, bool):
            raise ConfigError(f"{_PATH}.flush_endpoints = {flush!r}; expected true or false")
        poll = seconds("kept_poll_interval", 0.02)
        assert poll is not None
        if poll > 1.0:
            raise ConfigError(
                f"{_PATH}.kept_poll_interval = {poll:g}; expected at most 1 second (a next "
                "turn's first heartbeat waits up to this long for its answer)"
            )
        return cls(
            kept_poll_interval=poll,
            optimistic_read=optimistic,
            allow_layout_permute=permute,
            permute_staging_blocks=staging,
            warmup_timeout=float(warmup),
            flush_endpoints=flush,
            lease_table_slots=table_slots,
            symmetric_leases=symmetric,
            kv_recompute_threshold=threshold,
            ttl_safety_margin=None if safety is None else float(safety),
            push_layerwise=layerwise,
            auth_key_file=key_file,
            keys=KeyRing.from_file(key_file) if key_file else None,
            transport=text("transport", "nixl"),
            transport_options=dict(topts),
            side_channel_host=text("side_channel_host", "127.0.0.1"),
            side_channel_port=port,
            handshake_timeout=timeout,
            read_margin=margin,
            peer_idle_ttl=ttl,
        )
