"""Remote engines as D's worker sees them: handshakes in the background, results applied on the
engine thread, idle engines evicted.

The handshake (a blocking pyzmq exchange of a few milliseconds) runs on one background thread
so the forward loop never waits for it. Its result is applied to the transport
(``add_peer``, ``prepare_remote``) on the engine thread, inside :meth:`RemoteEngines.poll`,
because a transport is used from one thread only.

A failed handshake is retried when a request needs the engine again, after a backoff that
doubles per consecutive failure (``retry_after`` × 2**n, at most ``max_retry_after``) with
±50 % jitter, so a fleet of decoders does not hammer a restarting prefill engine in lockstep;
a request naming a new instance of the engine (another incarnation) retries at once.

**Warm-up.** Once a handshake's result is applied (the peer added, its layout prepared), the
connection is warmed before it counts as ready, when the transport can
(``capabilities.warm_up``) and ``warmup_timeout`` is above 0: one
:meth:`~kvframe.spi.transport.Transport.warm_up` posted at once and polled at each
:meth:`RemoteEngines.poll`, so a new connection's set-up (UCX wires an endpoint up with the
peer's help, at the peer's progress pace) is paid here, during the handshake, and not by the
first load's READ. A warm-up reads a buffer each transport registered for warm-ups alone
into this side's own: never a KV block, so it needs no lease and its bytes are never used.
The entry stays ``CONNECTING`` meanwhile (loads wait for it as for the handshake), and:

- done → ``READY`` (counter ``warmups_done``);
- not done after ``warmup_timeout`` → stopped, ``READY`` anyway (``warmups_timed_out``): the
  first READ then finishes the set-up itself, as without a warm-up;
- failed because the peer is unreachable → the handshake failed (``FAILED``, the usual
  backoff): a READ over that connection would fail too;
- any other failure, or a peer that advertised no warm-up buffer → ``READY``
  (``warmups_failed`` / ``warmups_unsupported``).

So a warm-up delays a connection by at most ``warmup_timeout`` and fails a load only where
its READ could not have succeeded.

Remote engines unused for ``idle_ttl`` seconds are forgotten (their transport peer removed)
without waiting for a new handshake to the same engine, so a fleet whose prefill engines come
and go does not accumulate dead peers (vLLM #58063).
"""

from __future__ import annotations

import contextlib
import enum
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvframe.connectors.pd.auth import KeyRing
from kvframe.connectors.pd.handshake import (
    HandshakeRequest,
    HandshakeResponse,
    HandshakeResult,
    KVLayoutFacts,
    compat_hash,
    handshake,
)
from kvframe.core.clock import ClockOffsetEstimator
from kvframe.errors import (
    CapabilityError,
    HandshakeError,
    KVFrameError,
    PeerUnreachableError,
    TransportError,
)
from kvframe.spi.transport import BlockLayout, LayoutHandle, Transport, XferHandle, XferState

__all__ = ["PeerState", "RemoteEngine", "RemoteEngines"]


class PeerState(enum.Enum):
    """Where a remote engine rank is: handshake under way, usable, or failed."""

    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


@attrs.define(eq=False)
class RemoteEngine:
    """One remote engine rank, as this worker knows it."""

    engine_id: str
    rank: int
    host: str
    port: int
    state: PeerState = PeerState.CONNECTING
    peer: str | None = None
    """The transport peer name, once READY."""
    remote: LayoutHandle | None = None
    response: HandshakeResponse | None = None
    clock: ClockOffsetEstimator = attrs.Factory(ClockOffsetEstimator)
    error: str | None = None
    last_used: float = 0.0
    failed_at: float = 0.0
    incarnation: str | None = None
    """The remote worker instance's token from its handshake (``None``: it sent none)."""
    failures: int = 0
    """Consecutive failed handshakes (the retry backoff grows with it)."""
    retry_at: float = 0.0
    """When a failed entry may handshake again."""
    session_key: bytes | None = attrs.field(default=None, repr=False)
    """The session key of the authenticated handshake (tags notifications); ``None`` when
    unauthenticated."""
    started_at: float = 0.0
    """When this entry's handshake started (the clock :meth:`RemoteEngines.ensure` got)."""
    ready_at: float | None = None
    """When it became ``READY`` (after its warm-up, if any); ``None`` before."""
    warmup: XferHandle | None = attrs.field(default=None, repr=False)
    """The warm-up under way (the entry is ``CONNECTING`` until it ends)."""
    warmup_started: float = 0.0
    warmup_outcome: str | None = None
    """How the last warm-up ended: ``"done"``, ``"timed_out"``, ``"failed"``,
    ``"unsupported"``; ``None`` when none was tried."""
    warmup_seconds: float | None = None
    """Seconds from posting the warm-up to the poll that saw it end (``None``: none)."""


_Key = tuple[str, int]


class RemoteEngines:
    """D's table of remote engine ranks.

    Call :meth:`ensure` as soon as a request names a remote engine (the handshake starts at
    once, proactively, so heartbeats can flow while the request still waits), :meth:`poll` once
    per engine step (applies finished handshakes, ends warm-ups, evicts idle engines),
    :meth:`get` to find a READY one, :meth:`take_counts` for the warm-up counters since the
    last call. :meth:`close` stops the background thread; safe twice. ``warmup_timeout`` 0
    (the default) or a transport without ``capabilities.warm_up``: no warm-ups.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        engine_id: str,
        rank: int,
        transport_name: str,
        chash: bytes,
        timeout: float,
        idle_ttl: float,
        retry_after: float = 0.05,
        max_retry_after: float = 2.0,
        clock: Callable[[], float],
        local_metadata: bytes | None = None,
        rng: random.Random | None = None,
        keys: KeyRing | None = None,
        layout: BlockLayout | None = None,
        tp_size: int = 1,
        kv_layout: KVLayoutFacts | None = None,
        allow_permute: bool = False,
        warmup_timeout: float = 0.0,
    ) -> None:
        self._transport = transport
        self._allow_permute = allow_permute
        self._warmup_timeout = warmup_timeout if transport.capabilities.warm_up else 0.0
        self._counts: dict[str, int] = {}
        self._in_flight = 0  # handshakes queued or running (engine thread only)
        self._keys = keys
        self._request = HandshakeRequest(
            engine_id=engine_id,
            rank=rank,
            transport=transport_name,
            transport_metadata=(
                local_metadata if local_metadata is not None else transport.local_metadata()
            ),
            layout=layout,
            tp_size=tp_size,
            kv_layout=kv_layout,
        )
        self._max_retry_after = max_retry_after
        self._rng = rng or random.Random()
        self._chash = chash
        self._timeout = timeout
        self._idle_ttl = idle_ttl
        self._retry_after = retry_after
        self._clock = clock
        self._engines: dict[_Key, RemoteEngine] = {}
        self._jobs: queue.Queue[RemoteEngine | None] = queue.Queue()
        self._done: queue.Queue[tuple[RemoteEngine, HandshakeResult | KVFrameError]] = queue.Queue()
        self.evicted = 0
        self.handshakes = 0
        self.handshake_failures = 0
        self._thread = threading.Thread(target=self._work, name="kvframe-handshake", daemon=True)
        self._thread.start()
        self._closed = False

    @staticmethod
    def compat(**facts: Any) -> bytes:
        """The compatibility hash of ``facts`` (see :func:`~.handshake.compat_hash`)."""
        return compat_hash(**facts)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                result: HandshakeResult | KVFrameError = handshake(
                    job.host,
                    job.port,
                    self._request,
                    chash=self._chash,
                    timeout=self._timeout,
                    clock=self._clock,
                    keys=self._keys,
                    expect_engine=job.engine_id,
                    allow_permute=self._allow_permute,
                )
            except KVFrameError as exc:
                result = exc
            except Exception as exc:  # never let the thread die silently
                result = HandshakeError(f"{type(exc).__name__}: {exc}")
            self._done.put((job, result))

    def ensure(
        self,
        engine_id: str,
        rank: int,
        host: str,
        port: int,
        now: float,
        *,
        incarnation: str | None = None,
    ) -> RemoteEngine:
        """The entry for ``(engine_id, rank)``, starting a handshake when there is none, when
        the address changed, or when the last one failed and its backoff has passed (at once
        when ``incarnation`` names another instance than the failed one)."""
        key = (engine_id, rank)
        entry = self._engines.get(key)
        stale = entry is not None and (entry.host, entry.port) != (host, port)
        failed = entry is not None and entry.state is PeerState.FAILED
        retry = (
            failed
            and entry is not None
            and (
                now >= entry.retry_at
                or (incarnation is not None and incarnation != entry.incarnation)
            )
        )
        if entry is None or stale or retry:
            self._start(key, host, port, now, entry)
            entry = self._engines[key]
        entry.last_used = now
        return entry

    def _start(self, key: _Key, host: str, port: int, now: float, old: RemoteEngine | None) -> None:
        if old is not None and old.peer is not None:
            self._forget(old)
        entry = RemoteEngine(key[0], key[1], host, port, last_used=now, started_at=now)
        if old is not None and old.state is PeerState.FAILED:
            entry.failures = old.failures
            entry.incarnation = old.incarnation
        self._engines[key] = entry
        self._in_flight += 1
        self._jobs.put(entry)

    def reconnect(self, entry: RemoteEngine, now: float, *, incarnation: str | None) -> None:
        """Drop ``entry``'s connection (the engine was replaced by instance ``incarnation``)
        and handshake again at once."""
        key = (entry.engine_id, entry.rank)
        if self._engines.get(key) is not entry or entry.state is PeerState.CONNECTING:
            return
        self._start(key, entry.host, entry.port, now, None)
        self._forget(entry)

    def find(self, engine_id: str) -> RemoteEngine | None:
        """The entry of ``engine_id`` (any rank: each worker talks to one rank per engine)."""
        for (eid, _rank), entry in self._engines.items():
            if eid == engine_id:
                return entry
        return None

    def find_all(self, engine_id: str) -> list[RemoteEngine]:
        """Every entry of ``engine_id`` (several ranks when this worker reads from several:
        heterogeneous tensor parallelism)."""
        return [entry for (eid, _rank), entry in self._engines.items() if eid == engine_id]

    def get(self, engine_id: str, rank: int) -> RemoteEngine | None:
        """The entry for ``(engine_id, rank)``, or ``None``."""
        return self._engines.get((engine_id, rank))

    def by_peer(self, peer: str) -> RemoteEngine | None:
        """The entry whose transport peer is ``peer``, or ``None``."""
        for e in self._engines.values():
            if e.peer == peer:
                return e
        return None

    def touch(self, entry: RemoteEngine, now: float) -> None:
        """Mark ``entry`` used at ``now`` (postpones its idle eviction)."""
        entry.last_used = now

    def poll(self, now: float, busy: Callable[[str], bool]) -> list[RemoteEngine]:
        """Apply finished handshakes; evict engines idle past the TTL for which ``busy(engine_id)``
        is false. Returns the entries whose state changed this call."""
        changed: list[RemoteEngine] = []
        if self._in_flight:
            # The handshake thread needs the GIL at each step of its exchange, and an engine
            # thread that steps back to back would hold it for a whole switch interval (5 ms)
            # each time: release it once per progress point while a handshake is under way
            # (measured: from a request naming P to the connection ready took 7-9 ms, mostly
            # such waits; 1.5-3 ms with this, when the transport adds the peer quickly).
            time.sleep(0)
        while True:
            try:
                entry, result = self._done.get_nowait()
            except queue.Empty:
                break
            self._in_flight -= 1
            if self._engines.get((entry.engine_id, entry.rank)) is not entry:
                continue  # superseded by a newer handshake
            if isinstance(result, KVFrameError):
                self._fail(entry, now, f"handshake with {entry.host}:{entry.port}: {result}")
            else:
                self._apply(entry, result, now)
            if entry.warmup is None:
                changed.append(entry)
        for entry in list(self._engines.values()):
            if entry.warmup is not None and self._warmed(entry, now):
                changed.append(entry)
        for key, entry in list(self._engines.items()):
            if entry.state is PeerState.FAILED and now >= entry.retry_at and busy(entry.engine_id):
                # Loads wait for this engine: handshake again once the backoff has passed.
                self._start(key, entry.host, entry.port, now, entry)
                continue
            if (
                entry.state is not PeerState.CONNECTING
                and now - entry.last_used > self._idle_ttl
                and not busy(entry.engine_id)
            ):
                self._forget(entry)
                del self._engines[key]
                self.evicted += 1
        return changed

    def _apply(self, entry: RemoteEngine, result: HandshakeResult, now: float) -> None:
        resp = result.response
        if resp.engine_id != entry.engine_id:
            self._fail(
                entry,
                now,
                f"{entry.host}:{entry.port} is engine {resp.engine_id!r}, not {entry.engine_id!r}",
            )
            return
        try:
            entry.peer = self._transport.add_peer(resp.transport_metadata)
            entry.remote = self._transport.prepare_remote(entry.peer, resp.layout)
        except (TransportError, ValueError) as exc:
            self._fail(entry, now, f"adding peer {entry.engine_id!r}: {exc}")
            return
        for s in result.samples:
            entry.clock.add(s.t_send, s.remote_now, s.t_recv)
        entry.response = resp
        entry.session_key = result.session_key
        entry.incarnation = resp.incarnation or None
        if self._warmup_timeout > 0:
            try:
                entry.warmup = self._transport.warm_up(entry.peer)
            except CapabilityError:
                self._warm_end(entry, "unsupported", now)
            except PeerUnreachableError as exc:
                self._warm_end(entry, "failed", now)
                self._fail(entry, now, f"warming the connection to {entry.engine_id!r}: {exc}")
                return
            except (TransportError, ValueError):
                self._warm_end(entry, "failed", now)
            else:
                entry.warmup_started = now
                return  # CONNECTING until the warm-up ends (poll)
        self._ready(entry, now)

    def _ready(self, entry: RemoteEngine, now: float) -> None:
        entry.state = PeerState.READY
        entry.ready_at = now
        entry.error = None
        entry.failures = 0
        self.handshakes += 1

    def _warm_end(self, entry: RemoteEngine, outcome: str, now: float) -> None:
        """Release the warm-up (if any) and count how it ended."""
        if entry.warmup is not None:
            with contextlib.suppress(TransportError):
                self._transport.release(entry.warmup)
            entry.warmup = None
            entry.warmup_seconds = now - entry.warmup_started
        entry.warmup_outcome = outcome
        name = f"warmups_{outcome}"
        self._counts[name] = self._counts.get(name, 0) + 1

    def _warmed(self, entry: RemoteEngine, now: float) -> bool:
        """Poll ``entry``'s warm-up; ``True`` when it ended (the entry changed state)."""
        assert entry.warmup is not None
        try:
            status = self._transport.poll(entry.warmup)
        except TransportError as exc:  # the transport closed under us: nothing to warm
            entry.warmup = None
            self._fail(entry, now, f"warming the connection to {entry.engine_id!r}: {exc}")
            return True
        if status.state is XferState.PENDING:
            if now - entry.warmup_started < self._warmup_timeout:
                return False
            self._warm_end(entry, "timed_out", now)
        elif status.state is XferState.DONE:
            self._warm_end(entry, "done", now)
        elif isinstance(status.error, PeerUnreachableError):
            self._warm_end(entry, "failed", now)
            self._fail(entry, now, f"warming the connection to {entry.engine_id!r}: {status.error}")
            return True
        else:
            self._warm_end(entry, "failed", now)
        self._ready(entry, now)
        return True

    def take_counts(self) -> dict[str, int]:
        """The warm-up counters since the last call (``warmups_done``, ``warmups_timed_out``,
        ``warmups_failed``, ``warmups_unsupported``), then reset."""
        out, self._counts = self._counts, {}
        return out

    def _fail(self, entry: RemoteEngine, now: float, reason: str) -> None:
        entry.state = PeerState.FAILED
        entry.error = reason
        entry.failed_at = now
        entry.failures += 1
        backoff = min(self._max_retry_after, self._retry_after * 2 ** (entry.failures - 1))
        entry.retry_at = now + backoff * self._rng.uniform(0.5, 1.5)
        self.handshake_failures += 1
        if entry.peer is not None:
            self._forget(entry)

    def mark_failed(self, entry: RemoteEngine, now: float, reason: str) -> None:
        """The peer broke (a transfer said so): forget it; the next request handshakes again."""
        if entry.state is PeerState.READY:
            self._fail(entry, now, reason)

    def _forget(self, entry: RemoteEngine) -> None:
        if entry.warmup is not None:
            with contextlib.suppress(TransportError):
                self._transport.release(entry.warmup)
            entry.warmup = None
        if entry.peer is not None:
            with contextlib.suppress(TransportError):
                self._transport.remove_peer(entry.peer)
        entry.peer = None
        entry.remote = None
        entry.session_key = None

    def __len__(self) -> int:
        return len(self._engines)

    def entries(self) -> list[RemoteEngine]:
        """Every known remote engine rank."""
        return list(self._engines.values())

    def close(self) -> None:
        """Stop the handshake thread. Safe twice. Does not touch the transport (its owner
        closes it)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=self._timeout + 1.0)
