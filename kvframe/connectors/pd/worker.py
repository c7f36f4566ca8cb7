"""The P/D connector's worker side: moves the bytes, holds the leases, sends the heartbeats.

**Producer (P) rank.** Serves handshakes on the side channel (a background thread that only
answers and queues the requester's transport metadata), holds a lease per finished request
(:class:`~kvframe.core.lease.LeaseTable`), and each step: adds the peers that handshook,
drains notifications (heartbeats renew and are acknowledged, read completions consume,
releases abort; anything for a lease it does not hold is answered with a loss notice and
counted), and reclaims expired leases. Every lease that ended is reported once in
``finished_sending``.

**Consumer (D) rank.** Handshakes with prefill engines in the background, sends the heartbeat
batches the scheduler asks for, and pulls KV with one READ per request — but only under a
*confirmed* lease, and it keeps the result only if the read completed before the confirmed
expiry (see ``docs/pd.md``, "why D never decodes garbage"). Failures of any kind end the load:
its transfer is stopped first, then every local block of the request is reported invalid.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Set
from typing import TYPE_CHECKING, Any

import attrs
import msgpack

from kvframe.config import KVTransferConfig
from kvframe.connectors._reports import WorkerReports
from kvframe.connectors.pd.handshake import (
    HandshakeRequest,
    HandshakeResponse,
    HandshakeServer,
    compat_hash,
)
from kvframe.connectors.pd.metadata import PDLoad, PDMetadata, RemoteEngineAddr
from kvframe.connectors.pd.options import PDOptions
from kvframe.connectors.pd.peers import PeerState, RemoteEngine, RemoteEngines
from kvframe.core import wire
from kvframe.core.heartbeat import SEQ_MODULUS, HeartbeatGuard
from kvframe.core.lease import LeasePolicy, LeaseTable, RenewIgnored
from kvframe.errors import CodecError, KVFrameError, PeerUnreachableError, TransportError
from kvframe.protocol.messages import ConnectorMetadata, KVEvent, Stats
from kvframe.spi.connector import EngineInfo, KVConnectorWorker
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryRegion,
    Op,
    Transport,
    TransportParams,
    XferHandle,
    XferState,
)

if TYPE_CHECKING:
    import torch

    from kvframe.runtime.plugins import PluginHost

__all__ = ["PDConnectorWorker"]


@attrs.define(eq=False)
class _Load:
    spec: PDLoad
    engine: RemoteEngine | None = None
    confirmed: float = float("-inf")
    """Lower bound of the lease's expiry on this worker's clock."""
    handle: XferHandle | None = None
    posted_at: float = 0.0
    urgent_sent: bool = False
    urgent_at: float = 0.0
    nbytes: int = 0


class PDConnectorWorker(WorkerReports, KVConnectorWorker):
    """Worker half of :class:`~kvframe.connectors.pd.PDConnector` (one per rank)."""

    def __init__(
        self,
        config: KVTransferConfig,
        engine: EngineInfo,
        rank: int,
        options: PDOptions,
        *,
        host: PluginHost,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert config.engine_id is not None
        self._config = config
        self._engine = engine
        self._rank = rank
        self._options = options
        self._clock = clock
        self._engine_id = config.engine_id
        self._policy = LeasePolicy.from_duration(config.kv_lease_duration)
        self._margin = options.margin(self._policy)
        self._name = f"{config.engine_id}.{rank}"
        self._transport: Transport = host.create_transport(
            options.transport,
            TransportParams(name=self._name, options=dict(options.transport_options)),
        )
        caps = self._transport.capabilities
        if not (caps.read and caps.notifications):
            self._transport.close()
            raise KVFrameError(
                f"transport {options.transport!r} lacks READ or notifications; PDConnector "
                "needs both"
            )
        self._max_notif = caps.max_notification_bytes
        self._local: LayoutHandle | None = None
        self._layout: BlockLayout | None = None
        self._chash = b""
        self._server: HandshakeServer | None = None
        self._engines: RemoteEngines | None = None
        # P state
        self._leases: LeaseTable[tuple[tuple[int, ...], ...]] = LeaseTable(self._policy)
        self._guard = HeartbeatGuard()
        self._lease_owner: dict[str, str] = {}  # lease id -> local request id
        self._pending_peers: list[tuple[str, bytes]] = []
        self._readers: dict[str, str] = {}  # transport peer name -> remote engine id
        # D state
        self._loads: dict[str, _Load] = {}
        self._seq = 0
        self._sent: dict[int, tuple[float, str | None]] = {}  # seq -> (send time, peer)
        self._pending_done: dict[str, list[tuple[str, wire.DoneReason]]] = {}
        # reporting
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._init_reports()
        self._counters: dict[str, float] = {}
        self._closed = False

    # -- set-up --------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
        """The transport this worker drives (for diagnostics and tests)."""
        return self._transport

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register every layer's KV tensor (block-major: dim 0 is the block id) as one region
        and start the side channel."""
        if not kv_caches:
            raise ValueError("register_kv_caches() got no KV caches")
        regions: list[MemoryRegion] = []
        block_lens: list[int] = []
        num_blocks: int | None = None
        facts: list[Any] = []
        for name, t in kv_caches.items():
            n = int(t.shape[0])
            if num_blocks is None:
                num_blocks = n
            elif n != num_blocks:
                raise ValueError(
                    f"KV cache {name!r} has {n} blocks but the first layer has {num_blocks}; "
                    "PDConnector needs a block-major layout with one block count"
                )
            region = MemoryRegion.from_tensor(t)
            regions.append(region)
            block_lens.append(region.length // n)
            facts.append((name, tuple(t.shape[1:]), str(t.dtype)))
        assert num_blocks is not None
        self._layout = BlockLayout(regions=regions, block_lens=block_lens, num_blocks=num_blocks)
        self._chash = compat_hash(
            kv=tuple(facts),
            block_size=self._engine.block_size,
            model=self._engine.model,
            transport=self._options.transport,
            groups=self._engine.num_kv_groups,
        )
        self._transport.register_memory(regions)
        self._local = self._transport.prepare_local(self._layout)
        if self._config.is_producer:
            port = self._options.side_channel_port
            self._server = HandshakeServer(
                self._options.side_channel_host,
                port + self._rank if port else 0,
                chash=self._chash,
                respond=self._respond,
                clock=self._clock,
            )
        if self._config.is_consumer:
            self._engines = RemoteEngines(
                self._transport,
                engine_id=self._engine_id,
                rank=self._rank,
                transport_name=self._options.transport,
                chash=self._chash,
                timeout=self._options.handshake_timeout,
                idle_ttl=self._options.peer_idle_ttl,
                clock=self._clock,
            )

    def get_handshake_metadata(self) -> bytes | None:
        if self._server is None:
            return None
        out: bytes = msgpack.packb({"host": self._server.host, "port": self._server.port})
        return out

    def _respond(self, request: HandshakeRequest) -> HandshakeResponse:
        # Runs on the handshake thread: no transport calls here, only a queue append (atomic).
        if request.transport != self._options.transport:
            raise ValueError(
                f"this engine uses transport {self._options.transport!r}, not {request.transport!r}"
            )
        assert self._layout is not None
        self._pending_peers.append((request.engine_id, request.transport_metadata))
        return HandshakeResponse(
            engine_id=self._engine_id,
            rank=self._rank,
            tp_size=self._engine.world_size,
            transport=self._options.transport,
            transport_metadata=self._transport_metadata(),
            layout=self._layout,
            kv_lease_duration=self._policy.duration,
        )

    def _transport_metadata(self) -> bytes:
        if not hasattr(self, "_meta_cache"):
            self._meta_cache = self._transport.local_metadata()
        return self._meta_cache

    # -- per step ------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        super().bind_connector_metadata(meta)
        now = self._clock()
        for spec in meta.saves:
            self._grant(spec.request_id, spec.block_ids, now)
        if not isinstance(meta, PDMetadata):
            return
        if self._engines is not None:
            for addr in meta.engines:
                self._ensure(addr, now)
            for load in meta.pd_loads:
                self._loads[load.request_id] = _Load(
                    spec=load, engine=self._ensure(load.remote, now)
                )
                self._count("loads_requested")
            for rid in meta.abort_request_ids:
                self._abort_load(rid)
            for engine_id, hb_ids in meta.heartbeats.items():
                self._heartbeat(engine_id, hb_ids, now)
            releases: dict[str, list[str]] = {}
            for rel in meta.releases:
                self._ensure(rel.remote, now)
                releases.setdefault(rel.remote.engine_id, []).append(rel.remote_request_id)
            for engine_id, ids in releases.items():
                self._send_done(engine_id, [(i, wire.DoneReason.RELEASED) for i in ids], now)

    def start_load_kv(self, forward_context: Any) -> None:
        self._progress()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """P/D loads are asynchronous (whole request, before it is scheduled): nothing to wait
        for layer by layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """P keeps the KV in place for D to read: nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing is saved, so nothing to wait for."""

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._progress()
        sending, recving = self._finished_sending, self._finished_recving
        self._finished_sending, self._finished_recving = set(), set()
        return (sending or None), (recving or None)

    def get_stats(self) -> Stats:
        counters = {k: v for k, v in self._counters.items() if v}
        self._counters.clear()
        gauges: dict[str, float] = {
            "leases_held": self._leases.live_count,
            "loads_in_flight": sum(1 for ld in self._loads.values() if ld.handle is not None),
            "loads_waiting": sum(1 for ld in self._loads.values() if ld.handle is None),
            "remote_engines": len(self._engines) if self._engines is not None else 0,
        }
        return Stats(counters=counters, gauges=gauges)

    def _count(self, name: str, n: float = 1, engine: str | None = None) -> None:
        self._counters[name] = self._counters.get(name, 0) + n
        if engine is not None:
            key = f"{name}.{engine}"
            self._counters[key] = self._counters.get(key, 0) + n

    # -- progress ------------------------------------------------------------------------
    def progress(self) -> None:
        """Make progress without an engine step (for a driver thread or an idle loop)."""
        self._progress()

    def _progress(self) -> None:
        if self._closed:
            return
        now = self._clock()
        self._add_pending_peers()
        try:
            notes = self._transport.drain_notifications()
        except TransportError as exc:
            self._count("drain_errors")
            self._event("pd.drain_error", error=str(exc))
            notes = []
        for note in notes:
            self._on_notification(note.sender, note.payload, now)
        if self._engines is not None:
            for entry in self._engines.poll(now, self._engine_busy):
                if entry.state is PeerState.FAILED:
                    self._event("pd.handshake_failed", engine=entry.engine_id, error=entry.error)
            self._flush_pending_done(now)
            self._drive_loads(now)
        for lease in self._leases.expire(now):
            self._lease_ended(lease.request_id, "expired")

    def _engine_busy(self, engine_id: str) -> bool:
        return any(
            ld.engine is not None and ld.engine.engine_id == engine_id
            for ld in self._loads.values()
        )

    # -- P: leases -----------------------------------------------------------------------
    def _grant(self, lease_id: str, block_ids: tuple[tuple[int, ...], ...], now: float) -> None:
        local_id = lease_id.rsplit("~", 1)[0]
        self._leases.grant(lease_id, now, block_ids)
        self._lease_owner[lease_id] = local_id
        self._count("leases_granted")

    def _lease_ended(self, lease_id: str, how: str) -> None:
        local_id = self._lease_owner.pop(lease_id, None)
        if local_id is not None:
            self._finished_sending.add(local_id)
        self._count(f"leases_{how}")

    def _add_pending_peers(self) -> None:
        while self._pending_peers:
            engine_id, meta = self._pending_peers.pop(0)
            try:
                peer = self._transport.add_peer(meta)
            except TransportError as exc:
                self._count("peer_add_failures")
                self._event("pd.peer_add_failed", engine=engine_id, error=str(exc))
                continue
            self._readers[peer] = engine_id
            self._guard.forget(peer)

    def _on_notification(self, sender: str, payload: bytes, now: float) -> None:
        try:
            msg = wire.decode(payload)
        except CodecError as exc:
            self._count("notifications_rejected")
            self._event("pd.bad_notification", sender=sender, error=str(exc))
            return
        if isinstance(msg, wire.Heartbeat):
            self._on_heartbeat(sender, msg, now)
        elif isinstance(msg, wire.LeaseDone):
            self._on_done(sender, msg, now)
        elif isinstance(msg, wire.LeaseAck):
            self._on_ack(sender, msg, now)
        else:
            self._on_lost(sender, msg, now)

    def _on_heartbeat(self, sender: str, msg: wire.Heartbeat, now: float) -> None:
        self._count("heartbeats_received")
        sent_at = self._guard.accept(sender, msg.seq, msg.sent_at, now)
        if sent_at is None:
            self._count("heartbeats_stale")
            return
        result = self._leases.renew(msg.request_ids, now, sent_at=sent_at)
        self._count("leases_renewed", len(result.renewed))
        if result.renewed:
            self._reply(
                sender,
                wire.LeaseAck(echo_seq=msg.seq, holder_now=now, expiries=result.renewed.items()),
            )
        if result.ignored:
            self._count("heartbeat_ids_ignored", len(result.ignored))
            lost = [
                (rid, _lost_reason(reason.value))
                for rid, reason in result.ignored.items()
                if reason is not RenewIgnored.STALE  # live: a fresher heartbeat will renew it
            ]
            if lost:
                self._reply(sender, wire.LeaseLost(echo_seq=msg.seq, holder_now=now, lost=lost))

    def _on_done(self, sender: str, msg: wire.LeaseDone, now: float) -> None:
        lost: list[tuple[str, wire.LostReason]] = []
        for rid, reason in msg.done:
            state = self._leases.lease(rid)
            if state is None or state.state.ended:
                self._count("done_for_unknown_lease")
                lost.append((rid, _lost_reason(self._leases.state(rid).value)))
                continue
            if reason is wire.DoneReason.READ:
                self._leases.consume(rid, now)
                self._lease_ended(rid, "consumed")
            else:
                self._leases.abort(rid, now)
                self._lease_ended(rid, "aborted")
        if lost:
            self._reply(sender, wire.LeaseLost(echo_seq=msg.seq, holder_now=now, lost=lost))

    def _reply(self, peer: str, msg: wire.Message) -> None:
        for part in wire.split(msg, self._max_notif):
            try:
                self._transport.send_notification(peer, wire.encode(part))
            except TransportError as exc:
                self._count("notify_failures")
                self._event("pd.notify_failed", peer=peer, error=str(exc))
                return

    # -- D: loads ------------------------------------------------------------------------
    def _ensure(self, addr: RemoteEngineAddr, now: float) -> RemoteEngine:
        assert self._engines is not None
        rank = self._rank % max(1, addr.tp_size)
        return self._engines.ensure(addr.engine_id, rank, addr.host, addr.port_for(rank), now)

    def _next_seq(self, now: float, peer: str | None) -> int:
        # Remember when and to whom each numbered message went: an acknowledgement counts
        # only if it comes from that peer and answers a message we really sent.
        self._seq = (self._seq + 1) % SEQ_MODULUS
        self._sent[self._seq] = (now, peer)
        if len(self._sent) > 4096:
            for old in sorted(self._sent, key=lambda k: self._sent[k][0])[:2048]:
                del self._sent[old]
        return self._seq

    def _heartbeat(self, engine_id: str, ids: tuple[str, ...] | list[str], now: float) -> None:
        entry = self._engine_entry(engine_id)
        if entry is None or entry.state is not PeerState.READY or entry.peer is None:
            self._count("heartbeats_deferred")
            return
        msg = wire.Heartbeat(
            seq=self._next_seq(now, entry.peer), sent_at=now, request_ids=tuple(ids)
        )
        self._send(entry, msg)
        self._count("heartbeats_sent", engine=engine_id)

    def _send_done(
        self, engine_id: str, done: list[tuple[str, wire.DoneReason]], now: float
    ) -> None:
        entry = self._engine_entry(engine_id)
        if entry is None or entry.state is PeerState.FAILED:
            # Best effort: without a peer the lease simply expires on P.
            self._count("releases_dropped", len(done))
            return
        if entry.state is not PeerState.READY:
            self._pending_done.setdefault(engine_id, []).extend(done)
            return
        seq = self._next_seq(now, entry.peer)
        self._send(entry, wire.LeaseDone(seq=seq, sent_at=now, done=done))
        self._count("releases_sent", len(done))

    def _flush_pending_done(self, now: float) -> None:
        for engine_id in list(self._pending_done):
            entry = self._engine_entry(engine_id)
            if entry is None or entry.state is not PeerState.CONNECTING:
                self._send_done(engine_id, self._pending_done.pop(engine_id), now)

    def _send(self, entry: RemoteEngine, msg: wire.Message) -> None:
        assert entry.peer is not None
        for part in wire.split(msg, self._max_notif):
            try:
                self._transport.send_notification(entry.peer, wire.encode(part))
            except TransportError as exc:
                self._count("notify_failures", engine=entry.engine_id)
                self._event("pd.notify_failed", engine=entry.engine_id, error=str(exc))
                if isinstance(exc, PeerUnreachableError):
                    # The prefill engine is gone: loads waiting on it fail now instead of
                    # waiting for a lease confirmation that cannot come.
                    assert self._engines is not None
                    self._engines.mark_failed(entry, self._clock(), f"unreachable: {exc}")
                return

    def _engine_entry(self, engine_id: str) -> RemoteEngine | None:
        assert self._engines is not None
        for entry in self._engines.entries():
            if entry.engine_id == engine_id and entry.rank == self._rank % max(
                1, entry.response.tp_size if entry.response else 1
            ):
                return entry
        for entry in self._engines.entries():
            if entry.engine_id == engine_id:
                return entry
        return None

    def _on_ack(self, sender: str, msg: wire.LeaseAck, now: float) -> None:
        record = self._sent.get(msg.echo_seq)
        if record is None or record[1] != sender:
            self._count("acks_unmatched")
            return
        sent = record[0]
        self._count("acks_received")
        by_remote = {ld.spec.remote_request_id: ld for ld in self._loads.values()}
        for rid, expiry in msg.expiries:
            load = by_remote.get(rid)
            if load is not None:
                # P renewed after we sent: sent + remaining is a lower bound on our clock.
                load.confirmed = max(load.confirmed, sent + (expiry - msg.holder_now))

    def _on_lost(self, sender: str, msg: wire.LeaseLost, now: float) -> None:
        by_remote = {ld.spec.remote_request_id: ld for ld in self._loads.values()}
        for rid, reason in msg.lost:
            load = by_remote.get(rid)
            if load is None:
                continue
            if load.handle is not None and reason is wire.LostReason.CONSUMED:
                continue  # our own completion raced ahead of this answer
            self._fail(load, f"prefill engine reports the lease {reason.name.lower()}", now)

    def _drive_loads(self, now: float) -> None:
        for load in list(self._loads.values()):
            if load.handle is not None:
                self._poll_load(load, now)
                continue
            entry = load.engine
            if entry is None:
                continue
            if entry.state is PeerState.FAILED:
                self._fail(load, f"prefill engine {entry.engine_id!r}: {entry.error}", now)
                continue
            if entry.state is not PeerState.READY:
                continue
            if load.confirmed == float("-inf"):
                # The initial lease, from P's clock through the handshake's offset estimate.
                try:
                    load.confirmed = (
                        entry.clock.to_local(load.spec.lease_expires_at) - entry.clock.uncertainty
                    )
                except KVFrameError:
                    load.confirmed = now
            if load.confirmed - now < self._margin:
                if load.urgent_sent and now - load.urgent_at > self._policy.extension:
                    # A live holder answers a heartbeat within milliseconds (an ack, or a
                    # loss notice); silence for a whole extension means it is gone.
                    self._fail(load, "no answer from the prefill engine to confirm the lease", now)
                    continue
                if not load.urgent_sent:
                    load.urgent_sent = True
                    load.urgent_at = now
                    self._heartbeat(entry.engine_id, [load.spec.remote_request_id], now)
                    self._count("urgent_heartbeats")
                continue
            self._post(load, entry, now)

    def _post(self, load: _Load, entry: RemoteEngine, now: float) -> None:
        assert self._local is not None
        assert entry.remote is not None
        assert entry.peer is not None
        spec = load.spec
        local = [b for g in spec.local_block_ids for b in g]
        remote = [b for g in spec.remote_block_ids for b in g]
        if not local:
            self._complete(load, now)
            return
        done = wire.encode(
            wire.LeaseDone(
                seq=self._next_seq(now, entry.peer),
                sent_at=now,
                done=[(spec.remote_request_id, wire.DoneReason.READ)],
            )
        )
        t0 = self._clock()
        try:
            load.handle = self._transport.post(
                Op.READ, self._local, local, entry.remote, remote, notification=done
            )
        except (TransportError, ValueError) as exc:
            self._fail(load, f"posting the read failed: {exc}", now)
            return
        load.posted_at = now
        self._count("post_seconds", self._clock() - t0)
        self._count("descriptors", load.handle.num_descriptors)
        self._engines_touch(entry, now)
        self._poll_load(load, now)

    def _engines_touch(self, entry: RemoteEngine, now: float) -> None:
        assert self._engines is not None
        self._engines.touch(entry, now)

    def _poll_load(self, load: _Load, now: float) -> None:
        assert load.handle is not None
        state = self._transport.poll(load.handle)
        if state is XferState.PENDING:
            return
        if state is XferState.FAILED:
            err = load.handle.error
            if load.engine is not None and isinstance(err, PeerUnreachableError):
                assert self._engines is not None
                self._engines.mark_failed(load.engine, now, str(err))
            self._fail(load, f"transfer failed: {err}", now)
            return
        t_done = self._clock()
        if t_done >= load.confirmed:
            self._fail(
                load,
                "the read completed after the confirmed lease expiry; the prefill engine may "
                "have reused the blocks",
                now,
            )
            return
        self._count("bytes_read", load.handle.nbytes, engine=load.spec.remote.engine_id)
        # The movement itself when the transport knows it; the wait as the engine saw it.
        moved = load.handle.transfer_seconds
        self._count("transfer_seconds", moved if moved is not None else t_done - load.posted_at)
        self._count("load_wait_seconds", t_done - load.posted_at)
        self._count("loads_done", engine=load.spec.remote.engine_id)
        self._complete(load, now)

    def _complete(self, load: _Load, now: float) -> None:
        if load.handle is not None:
            self._transport.release(load.handle)
            load.handle = None
        del self._loads[load.spec.request_id]
        self._finished_recving.add(load.spec.request_id)

    def _fail(self, load: _Load, reason: str, now: float) -> None:
        # Stop the transfer before reporting anything: no byte may land after the engine
        # learns the blocks are invalid and reuses them.
        if load.handle is not None:
            self._transport.release(load.handle)
            load.handle = None
        del self._loads[load.spec.request_id]
        for group in load.spec.local_block_ids:
            self._invalid.update(group)
        self._finished_recving.add(load.spec.request_id)
        self._failures[load.spec.request_id] = reason
        self._count("loads_failed", engine=load.spec.remote.engine_id)
        self._event("pd.load_failed", request_id=load.spec.request_id, reason=reason)
        # Tell P it may free at once (best effort).
        self._send_done(
            load.spec.remote.engine_id,
            [(load.spec.remote_request_id, wire.DoneReason.RELEASED)],
            now,
        )

    def _abort_load(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is not None and load.handle is not None:
            self._transport.release(load.handle)
        # The scheduler parked the blocks until we say the transfer has stopped.
        self._finished_sending.add(request_id)
        self._count("loads_aborted")

    def _event(self, kind: str, **data: Any) -> None:
        self._events.append(KVEvent(kind=kind, data=dict(data)))

    # -- lifetime ------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for load in self._loads.values():
            if load.handle is not None:
                with contextlib.suppress(TransportError):
                    self._transport.release(load.handle)
        self._loads.clear()
        if self._server is not None:
            self._server.close()
        if self._engines is not None:
            self._engines.close()
        self._transport.close()


def _lost_reason(value: str) -> wire.LostReason:
    return {
        "consumed": wire.LostReason.CONSUMED,
        "aborted": wire.LostReason.ABORTED,
        "expired": wire.LostReason.EXPIRED,
    }.get(value, wire.LostReason.UNKNOWN)
