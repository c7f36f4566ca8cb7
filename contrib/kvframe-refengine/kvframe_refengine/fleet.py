"""The reference engine in a fleet: an engine server's registration, and what a router knows
of the fleet (which engines serve, which prefixes each one caches).

Engine side, :class:`FleetMember`: ``python -m kvframe_refengine.server --discovery URL``
registers the engine (role, address, side-channel ports, transport, TP size, its HTTP port,
capabilities) through a discovery backend (:func:`kvframe.discovery.options.parse_discovery_url`),
keeps it alive, withdraws it on a clean shutdown, and wires
:class:`~kvframe.runtime.fleet.FleetLiveness` to the engine's P/D worker: the leases a vanished
decoder claimed are aborted at once, the loads from a vanished prefill engine fail at once.

Router side, :class:`FleetTable`: the prefill and decode engines a discovery watch reports
(added, changed, vanished) with, for each, what the router learned of its prefix cache
(:class:`PrefixIndex`, from the engine's KV events, ``GET /v1/kv_events``), how many requests
it has in flight, and whether a request just found it dead (then it gets no more requests
until discovery reports it again or ``quarantine`` passes). :meth:`FleetTable.pick` chooses an
engine for a request; :class:`KVEventPoller` reads every engine's KV events.

Everything an engine answers is hostile input: a KV-events answer is read up to
:data:`MAX_EVENTS_BYTES`, every field is checked (:func:`parse_kv_events`), and what the router
keeps per engine is bounded (:data:`MAX_PREFIXES` hashes, least recently seen first out).
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvframe.core.fleet import (
    EngineAdded,
    EngineChanged,
    EngineRecord,
    EngineRole,
    EngineVanished,
    FleetEvent,
)
from kvframe.discovery.options import parse_discovery_url
from kvframe.errors import ConfigError
from kvframe.runtime.fleet import FleetLiveness, LivenessTarget
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.discovery import Discovery, DiscoveryParams, FleetWatch
from kvframe.spi.request import block_hashes

if TYPE_CHECKING:
    from kvframe_refengine.server import EngineService

__all__ = [
    "FLEET_ROLES",
    "MAX_EVENTS_BYTES",
    "MAX_EVENTS_PER_ANSWER",
    "MAX_PREFIXES",
    "POLICIES",
    "FleetMember",
    "FleetTable",
    "KVEventPoller",
    "Member",
    "PrefixIndex",
    "kv_events_answer",
    "open_discovery",
    "parse_kv_events",
    "watch_fleet",
]

_log = logging.getLogger(__name__)

FLEET_ROLES = ("prefill", "decode")
"""What an engine serves in a fleet; registered as a capability word."""
POLICIES = ("prefix", "round_robin")
"""The router's fleet policies: ``prefix`` (the engine holding the longest prefix of the
request, among the least loaded) and ``round_robin``."""
MAX_EVENTS_PER_ANSWER = 4096
"""The most KV events (or snapshot hashes) one ``GET /v1/kv_events`` answer carries."""
MAX_EVENTS_BYTES = 1 << 20
"""The largest KV-events answer a router reads (bytes); a larger one is refused."""
MAX_PREFIXES = 65536
"""The most block hashes a router keeps per engine (least recently seen dropped first)."""
_HASH = re.compile(r"[0-9a-f]{64}")
_EPOCH = re.compile(r"[A-Za-z0-9._-]{1,64}")
_BLOCK_SIZE = re.compile(r"block_size:([1-9][0-9]{0,4})")


# -- the engine's side --------------------------------------------------------------------------


def open_discovery(url: str, host: PluginHost | None = None) -> tuple[Discovery, float]:
    """Build the backend a discovery URL names; returns it and its TTL in seconds (the
    ``ttl`` option, else 10: a good :class:`~kvframe.runtime.fleet.FleetLiveness` ``hold``).
    Raises :class:`~kvframe.errors.ConfigError` for a bad URL or option and
    :class:`~kvframe.errors.PluginNotFoundError` for an unknown backend."""
    name, options = parse_discovery_url(url)
    if host is None:
        host = PluginHost()
        host.load()
    backend = host.create_discovery(name, DiscoveryParams(options=options))
    ttl = options.get("ttl", 10)
    return backend, float(ttl) if isinstance(ttl, int | float) else 10.0


def _pd_worker(worker: object) -> LivenessTarget | None:
    from kvframe.connectors.multi import MultiConnectorWorker
    from kvframe.connectors.pd.worker import PDConnectorWorker

    if isinstance(worker, PDConnectorWorker):
        return worker
    if isinstance(worker, MultiConnectorWorker):
        return next((c for c in worker.children if isinstance(c, PDConnectorWorker)), None)
    return None


class _Waking:
    """A liveness target that, after telling the worker (thread-safe; applied at its next
    progress point), wakes the engine loop to make that progress at once: an idle engine
    steps only when a request comes, and a vanished peer's leases must not wait for one."""

    def __init__(self, worker: LivenessTarget, service: EngineService) -> None:
        self._worker = worker
        self._service = service

    def _wake(self) -> None:
        progress = getattr(self._worker, "progress", None)
        if progress is not None:
            self._service.post(progress)

    def engine_gone(self, engine_id: str, reason: str = "it left the fleet") -> None:
        self._worker.engine_gone(engine_id, reason)
        self._wake()

    def fence(self, reason: str) -> None:
        self._worker.fence(reason)
        self._wake()

    def unfence(self) -> None:
        self._worker.unfence()
        self._wake()


class FleetMember:
    """One engine server in a fleet: registered through ``url``'s backend, kept alive,
    withdrawn by :meth:`close`, its P/D worker driven by :class:`FleetLiveness`.

    :param service: the engine server (its engine must run kvframe's ``PDConnector``).
    :param url: the discovery URL (``etcd://127.0.0.1:2379?ttl=5``, ``file:///dir``).
    :param host: the address peers and routers reach this engine at (side channel and HTTP).
    :param api_port: the engine's HTTP port.
    :param fleet_role: ``"prefill"`` or ``"decode"``; default from ``kv_role`` (a
        ``kv_both`` engine must say).
    :raises ConfigError: a bad URL, option or role; an engine without a side channel.

    With ``tp_size`` 1 the engine's worker is driven; with more ranks the workers live in
    other processes and the engine is registered without liveness actions (its leases bound
    everything, as without discovery).
    """

    def __init__(
        self,
        service: EngineService,
        url: str,
        *,
        host: str,
        api_port: int,
        fleet_role: str | None = None,
        plugin_host: PluginHost | None = None,
    ) -> None:
        engine = service.engine
        kv = engine.kv_transfer_config
        if kv is None:
            raise ConfigError("--discovery needs an engine with a connector (give --role)")
        role = EngineRole(kv.kv_role)
        if fleet_role is None:
            if role is EngineRole.BOTH:
                raise ConfigError(
                    "a kv_both engine must say what it serves in the fleet: give --fleet-role "
                    "prefill or --fleet-role decode"
                )
            fleet_role = "prefill" if role is EngineRole.PRODUCER else "decode"
        if fleet_role not in FLEET_ROLES:
            raise ConfigError(f"fleet role {fleet_role!r}: expected prefill or decode")
        ports = engine.side_channel_ports()
        worker = _pd_worker(engine.connector_worker)
        incarnation = getattr(worker, "incarnation", None) or secrets.token_hex(8)
        extra = kv.kv_connector_extra_config
        fields: dict[str, Any] = {
            "engine_id": service.engine_id,
            "role": role,
            "host": host,
            "side_channel_ports": ports,
            "transport": str(extra.get("transport", "nixl")),
            "tp_size": engine.config.tp_size,
            "capabilities": {fleet_role, f"block_size:{engine.config.block_size}", "kv_events"},
            "incarnation": incarnation,
            "api_port": api_port,
        }
        self.record = EngineRecord(**fields)
        """This engine's registration."""
        self.discovery, ttl = open_discovery(url, plugin_host)
        targets: list[LivenessTarget] = []
        if worker is not None and engine.config.tp_size == 1:
            targets.append(_Waking(worker, service))
        try:
            self.liveness = FleetLiveness(self.discovery, self.record, targets, hold=ttl)
        except BaseException:
            self.discovery.close()
            raise

    def close(self) -> None:
        """Withdraw the registration (watchers see the engine vanish at once) and release the
        backend. Safe twice."""
        self.liveness.close()
        self.discovery.close()


def kv_events_answer(service: EngineService, query: Mapping[str, str]) -> dict[str, Any]:
    """The body of ``GET /v1/kv_events?after=SEQ&limit=N``: the engine's prefix-cache changes
    after ``after`` (``events``: ``[stored, hash hex]``, ``stored`` false for a dropped hash),
    or ``snapshot`` (every cached hash) when ``after`` is older than the journal keeps or is
    not this instance's; ``seq`` to ask after next, ``more`` when cut at ``limit`` (at most
    :data:`MAX_EVENTS_PER_ANSWER`), ``epoch`` (new at every start), ``block_size``.
    Raises ``ValueError`` for a bad ``after`` or ``limit``."""

    def number(key: str, default: int, low: int, high: int) -> int:
        text = query.get(key)
        if text is None:
            return default
        if not re.fullmatch(r"[0-9]{1,18}", text) or not low <= int(text) <= high:
            raise ValueError(f"{key} = {text!r}; expected an integer from {low} to {high}")
        return int(text)

    after = number("after", 0, 0, 10**18)
    limit = number("limit", MAX_EVENTS_PER_ANSWER, 1, MAX_EVENTS_PER_ANSWER)

    def read() -> dict[str, Any]:
        pool = service.engine.pool
        got = pool.journal.since(after, pool.cached_hashes(), limit)
        return {
            "engine_id": service.engine_id,
            "epoch": service.epoch,
            "block_size": service.engine.config.block_size,
            "seq": got.seq,
            "events": [[stored, h.hex()] for stored, h in got.events],
            "snapshot": None if got.snapshot is None else [h.hex() for h in got.snapshot],
            "more": got.more,
        }

    answer: dict[str, Any] = service.call(read)
    return answer


# -- the router's side --------------------------------------------------------------------------


@attrs.frozen
class KVEvents:
    """A checked KV-events answer (:func:`parse_kv_events`)."""

    epoch: str
    block_size: int
    seq: int
    events: tuple[tuple[bool, bytes], ...]
    snapshot: tuple[bytes, ...] | None
    more: bool


def parse_kv_events(data: bytes) -> KVEvents:
    """Check a ``GET /v1/kv_events`` answer; raises ``ValueError`` naming what is wrong (size,
    JSON, a field's type or range, a hash that is not 64 hex digits, too many entries)."""
    if len(data) > MAX_EVENTS_BYTES:
        raise ValueError(f"answer of {len(data)} bytes exceeds {MAX_EVENTS_BYTES}")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    epoch, size, seq, more = (
        obj.get("epoch"),
        obj.get("block_size"),
        obj.get("seq"),
        obj.get("more"),
    )
    if not isinstance(epoch, str) or not _EPOCH.fullmatch(epoch):
        raise ValueError(f"epoch {epoch!r} is not a token")
    for name, value, high in (("block_size", size, 65536), ("seq", seq, 10**18)):
        if type(value) is not int or not 0 <= value <= high:
            raise ValueError(f"{name} {value!r} is not an integer in 0..{high}")
    if size == 0:
        raise ValueError("block_size 0")
    if type(more) is not bool:
        raise ValueError(f"more {more!r} is not a boolean")
    events, snapshot = obj.get("events"), obj.get("snapshot")
    if not isinstance(events, list) or len(events) > MAX_EVENTS_PER_ANSWER:
        raise ValueError(f"events must be a list of at most {MAX_EVENTS_PER_ANSWER} entries")
    checked: list[tuple[bool, bytes]] = []
    for ev in events:
        if (
            not isinstance(ev, list)
            or len(ev) != 2
            or type(ev[0]) is not bool
            or not isinstance(ev[1], str)
            or not _HASH.fullmatch(ev[1])
        ):
            raise ValueError(f"event {str(ev)[:80]!r} is not [stored, 64 hex digits]")
        checked.append((ev[0], bytes.fromhex(ev[1])))
    snap: tuple[bytes, ...] | None = None
    if snapshot is not None:
        if not isinstance(snapshot, list) or len(snapshot) > MAX_EVENTS_PER_ANSWER:
            raise ValueError(
                f"snapshot must be null or a list of at most {MAX_EVENTS_PER_ANSWER} hashes"
            )
        if not all(isinstance(h, str) and _HASH.fullmatch(h) for h in snapshot):
            raise ValueError("snapshot holds something that is not 64 hex digits")
        snap = tuple(bytes.fromhex(h) for h in snapshot)
    assert isinstance(size, int)
    assert isinstance(seq, int)
    return KVEvents(epoch, size, seq, tuple(checked), snap, more)


class PrefixIndex:
    """The block hashes one engine is known to cache, at most ``capacity`` (least recently
    stored or matched dropped first). Not thread-safe (the table's lock guards it)."""

    def __init__(self, capacity: int = MAX_PREFIXES) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()
        self.dropped = 0
        """Hashes dropped to stay within ``capacity``."""

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)
            self.dropped += 1

    def remove(self, h: bytes) -> None:
        self._hashes.pop(h, None)

    def replace(self, hashes: Iterable[bytes]) -> None:
        self._hashes.clear()
        self.add(hashes)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` (chained block hashes) are cached."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        for h in hashes[:n]:
            self._hashes.move_to_end(h)
        return n


@attrs.define(eq=False)
class Member:
    """One engine as the router knows it."""

    record: EngineRecord
    fleet_role: str
    url: str
    block_size: int | None
    index: PrefixIndex = attrs.field(factory=PrefixIndex)
    inflight: int = 0
    down_until: float = 0.0
    """While the router's clock is before this, it routes nothing here (a request found the
    engine unreachable or dead)."""
    seq: int = 0
    epoch: str | None = None
    routed: int = 0

    @property
    def engine_id(self) -> str:
        return self.record.engine_id


def _fleet_role(record: EngineRecord) -> str | None:
    roles = [r for r in FLEET_ROLES if r in record.capabilities]
    return roles[0] if len(roles) == 1 else None


class FleetTable:
    """The fleet's prefill and decode engines for a router (thread-safe; see the module).

    :param policy: ``"prefix"`` or ``"round_robin"`` (:data:`POLICIES`).
    :param max_imbalance: with ``prefix``, an engine is a candidate only while it has at most
        this many requests in flight more than the least loaded one (a shared prefix would
        otherwise send everything to one engine).
    :param quarantine: seconds an engine a request found dead gets nothing (unless discovery
        reports it again, as a new incarnation, sooner).
    """

    def __init__(
        self,
        *,
        policy: str = "prefix",
        max_imbalance: int = 2,
        quarantine: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"routing policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.max_imbalance = max_imbalance
        self.quarantine = quarantine
        self._clock = clock
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._turns = {role: itertools.count() for role in FLEET_ROLES}
        self.ignored = 0
        """Registrations skipped: no ``api_port``, or not exactly one of prefill/decode."""
        self.malformed_events = 0
        """KV-events answers refused (:func:`parse_kv_events`)."""
        self.prefix_hits = 0
        """Picks whose engine held at least one block of the request's prefix."""
        self.picks = 0

    # -- what discovery says ---------------------------------------------------------------
    def on_events(self, events: Sequence[FleetEvent]) -> None:
        """A discovery watch's callback."""
        for ev in events:
            if isinstance(ev, EngineAdded | EngineChanged):
                self.add(ev.record)
            elif isinstance(ev, EngineVanished):
                self.remove(ev.record)

    def add(self, record: EngineRecord) -> bool:
        """Route to ``record``'s engine (a new incarnation replaces the old); returns whether
        it was taken (it needs an ``api_port`` and one fleet role)."""
        role = _fleet_role(record)
        if record.api_port is None or role is None:
            with self._lock:
                self.ignored += 1
            return False
        size = next(
            (int(m.group(1)) for c in record.capabilities if (m := _BLOCK_SIZE.fullmatch(c))),
            None,
        )
        host = f"[{record.host}]" if ":" in record.host else record.host
        url = f"http://{host}:{record.api_port}"
        with self._lock:
            old = self._members.get(record.engine_id)
            if old is not None and old.record.incarnation == record.incarnation:
                old.record, old.url, old.fleet_role = record, url, role  # EngineChanged
                return True
            self._members[record.engine_id] = Member(record, role, url, size)
        return True

    def remove(self, record: EngineRecord) -> None:
        """Stop routing to ``record``'s engine (only that incarnation)."""
        with self._lock:
            old = self._members.get(record.engine_id)
            if old is not None and old.record.incarnation == record.incarnation:
                del self._members[record.engine_id]

    def members(self, fleet_role: str | None = None) -> list[Member]:
        with self._lock:
            return [m for m in self._members.values() if fleet_role in (None, m.fleet_role)]

    def get(self, engine_id: str) -> Member | None:
        with self._lock:
            return self._members.get(engine_id)

    # -- routing ---------------------------------------------------------------------------
    def pick(
        self, fleet_role: str, prompt: Sequence[int], exclude: Iterable[str] = ()
    ) -> Member | None:
        """The engine to send a request for ``prompt`` to (its in-flight count taken: call
        :meth:`done`), or ``None`` when no live engine of that role is left."""
        skip = set(exclude)
        now = self._clock()
        with self._lock:
            live = [
                m
                for m in self._members.values()
                if m.fleet_role == fleet_role and m.engine_id not in skip and m.down_until <= now
            ]
            if not live:
                return None
            live.sort(key=lambda m: m.engine_id)
            turn = next(self._turns[fleet_role])  # one turn per role: a request picks both
            order = live[turn % len(live) :] + live[: turn % len(live)]
            chosen = order[0]
            matched = 0
            if self.policy == "prefix":
                least = min(m.inflight for m in live)
                best: tuple[int, int] | None = None
                for m in order:
                    if m.inflight > least + self.max_imbalance:
                        continue
                    n = self._match(m, prompt)
                    key = (n, -m.inflight)
                    if best is None or key > best:
                        best, chosen, matched = key, m, n
            self.picks += 1
            if matched:
                self.prefix_hits += 1
            if self.policy == "prefix" and chosen.block_size is not None:
                # The engine is about to compute these blocks: requests with the same prefix
                # that arrive meanwhile go there too, not to an engine that would compute them
                # again. (If this request fails, the engine may not hold them: a later miss,
                # never a wrong answer; its KV events and the LRU correct it.)
                chosen.index.add(block_hashes(prompt, chosen.block_size))
            chosen.inflight += 1
            chosen.routed += 1
            return chosen

    @staticmethod
    def _match(member: Member, prompt: Sequence[int]) -> int:
        if member.block_size is None or not len(member.index):
            return 0
        return member.index.match(block_hashes(prompt, member.block_size))

    def done(self, member: Member, *, served: Sequence[int] | None = None) -> None:
        """A request picked for ``member`` ended; ``served``: its prompt, when the engine
        answered it (the engine computed and cached its full blocks: remember them now,
        before its KV events say so)."""
        hashes = (
            block_hashes(served, member.block_size)
            if served is not None and member.block_size is not None
            else ()
        )
        with self._lock:
            member.inflight -= 1
            if hashes:
                member.index.add(hashes)

    def mark_down(self, member: Member) -> None:
        """A request found ``member`` unreachable or dead: route nothing to it for
        ``quarantine`` seconds (discovery removes it meanwhile if it is gone)."""
        with self._lock:
            member.down_until = self._clock() + self.quarantine

    # -- what the engines' KV events say -----------------------------------------------------
    def apply_events(self, member: Member, events: KVEvents) -> None:
        with self._lock:
            if member.epoch != events.epoch:
                member.index.replace(())
                member.epoch = events.epoch
            member.block_size = events.block_size
            if events.snapshot is not None:
                member.index.replace(events.snapshot)
            for stored, h in events.events:
                if stored:
                    member.index.add((h,))
                else:
                    member.index.remove(h)
            member.seq = events.seq

    def describe(self) -> dict[str, Any]:
        """For ``/health``: every engine with its role, URL, load and known prefixes."""
        now = self._clock()
        with self._lock:
            return {
                "policy": self.policy,
                "engines": [
                    {
                        "engine_id": m.engine_id,
                        "role": m.fleet_role,
                        "url": m.url,
                        "inflight": m.inflight,
                        "routed": m.routed,
                        "down": m.down_until > now,
                        "known_blocks": len(m.index),
                    }
                    for m in sorted(self._members.values(), key=lambda m: m.engine_id)
                ],
                "picks": self.picks,
                "prefix_hits": self.prefix_hits,
                "ignored": self.ignored,
                "malformed_events": self.malformed_events,
            }


class KVEventPoller:
    """Reads every engine's KV events into ``table`` every ``interval`` seconds, on a thread
    of its own (each request bounded by ``timeout``). An engine that does not answer keeps
    what was known of it; a malformed answer is counted (``table.malformed_events``) and
    skipped."""

    def __init__(self, table: FleetTable, *, interval: float = 0.2, timeout: float = 2.0) -> None:
        self._table = table
        self._interval = interval
        self._timeout = timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._timeout + 1)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for member in self._table.members():
                self.poll(member)

    def poll(self, member: Member) -> None:
        """Read ``member``'s events until it has no more (at most 8 answers)."""
        for _ in range(8):
            url = f"{member.url}/v1/kv_events?after={member.seq}"
            try:
                with urllib.request.urlopen(url, timeout=self._timeout) as resp:
                    data = resp.read(MAX_EVENTS_BYTES + 1)
                events = parse_kv_events(data)
            except (OSError, urllib.error.URLError, http.client.HTTPException):
                # Unreachable, or it died while answering: discovery or a request decides.
                return
            except ValueError as exc:
                with self._table._lock:
                    self._table.malformed_events += 1
                _log.warning("engine %s: KV events refused: %s", member.engine_id, exc)
                return
            self._table.apply_events(member, events)
            if not events.more:
                return


def watch_fleet(
    url: str, table: FleetTable, host: PluginHost | None = None
) -> tuple[Discovery, FleetWatch]:
    """Open ``url``'s backend and feed its watch into ``table``; returns both (cancel the
    watch, close the backend)."""
    backend, _ttl = open_discovery(url, host)
    try:
        return backend, backend.watch(table.on_events)
    except BaseException:
        backend.close()
        raise
