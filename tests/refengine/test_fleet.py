"""The reference engine in a fleet, in one process: engines register through the ``file``
discovery backend (kvframe_refengine.fleet.FleetMember), serve their KV events, and a router
finds them through discovery, routes on prefixes, drops vanished engines and routes a request
whose engine died again on another (tests/etcd/test_etcd_fleet.py does it across processes
on a real etcd)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from kvframe_refengine.block_pool import CacheJournal
from kvframe_refengine.fleet import (
    MAX_EVENTS_BYTES,
    FleetMember,
    FleetTable,
    KVEventPoller,
    PrefixIndex,
    parse_kv_events,
    watch_fleet,
)
from kvframe_refengine.router import Router

from kvframe.core.fleet import EngineRecord, EngineRole
from kvframe.errors import ConfigError
from kvframe.spi.request import block_hashes
from tests.refengine._http import Served, engine_server, request

pytestmark = pytest.mark.timeout(120)


def _wait(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path}?ttl=2&poll_interval=0.05"


@contextlib.contextmanager
def member(role: str, engine_id: str, url: str) -> Iterator[tuple[Served, FleetMember]]:
    with engine_server(role, engine_id=engine_id) as served:
        assert served.service is not None
        m = FleetMember(served.service, url, host="127.0.0.1", api_port=served.port)
        try:
            yield served, m
        finally:
            m.close()


@contextlib.contextmanager
def fleet_router(url: str, **kw: Any) -> Iterator[Router]:
    table = FleetTable(policy=kw.pop("policy", "prefix"), quarantine=30.0)
    backend, watch = watch_fleet(url, table)
    poller = KVEventPoller(table, interval=0.05)
    try:
        yield Router(fleet=table, **kw)
    finally:
        poller.close()
        watch.cancel()
        backend.close()


def _live(router: Router, role: str) -> list[str]:
    assert router.fleet is not None
    return sorted(m.engine_id for m in router.fleet.members(role))


def test_an_engine_registers_what_a_router_needs_and_withdraws_at_close(url: str) -> None:
    with member("kv_producer", "fp-0", url) as (p, m), fleet_router(url) as router:
        rec = m.record
        assert rec.role is EngineRole.PRODUCER
        assert rec.api_port == p.port
        assert rec.capabilities == {"prefill", "block_size:16", "kv_events"}
        assert len(rec.side_channel_ports) == 1
        assert rec.transport == "inprocess"
        _wait(lambda: _live(router, "prefill") == ["fp-0"])
        m.close()
        _wait(lambda: _live(router, "prefill") == [])


def test_a_kv_both_engine_must_say_what_it_serves(url: str) -> None:
    with engine_server("kv_both", engine_id="fb-0") as served:
        assert served.service is not None
        with pytest.raises(ConfigError, match="--fleet-role"):
            FleetMember(served.service, url, host="127.0.0.1", api_port=served.port)


def test_liveness_is_wired_to_the_engines_worker(url: str) -> None:
    # D's registration withdrawn: P's FleetLiveness reports it gone to P's P/D worker.
    with (
        member("kv_producer", "fl-p", url) as (_p, mp),
        member("kv_consumer", "fl-d", url) as (
            _d,
            md,
        ),
    ):
        _wait(lambda: len(mp.liveness.watch.live()) == 2)
        md.close()
        _wait(lambda: [e.record.engine_id for e in mp.liveness.gone] == ["fl-d"])
        # The idle P applies it without a request: the liveness action wakes its loop.
        service = _p.service
        assert service is not None
        # (Counters reach /stats with the next step's output: read the worker's own.)
        worker = service.engine.connector_worker
        _wait(lambda: service.call(lambda: worker._counters.get("engines_gone")) == 1)


def test_kv_events_name_the_blocks_the_engine_cached(url: str) -> None:
    with engine_server("kv_producer", engine_id="fe-0") as p:
        prompt = list(range(3, 3 + 40))  # two full blocks of 16
        code, _ = request(p, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert code == 200
        code, body = request(p, "GET", "/v1/kv_events")
        assert code == 200
        events = parse_kv_events(json.dumps(body).encode())
        want = block_hashes(prompt, 16)
        assert [h for stored, h in events.events if stored] == list(want)
        assert events.snapshot is None
        assert events.seq == 2
        assert not events.more
        code, body = request(p, "GET", f"/v1/kv_events?after={events.seq}")
        assert code == 200
        assert body["events"] == []
        assert body["seq"] == 2
        code, body = request(p, "GET", "/v1/kv_events?after=999")  # not this instance's
        assert code == 200
        assert sorted(body["snapshot"]) == sorted(h.hex() for h in want)
        code, body = request(p, "GET", "/v1/kv_events?after=1&limit=1")
        assert body["seq"] == 2
        assert len(body["events"]) == 1
        assert not body["more"]
        code, body = request(p, "GET", "/v1/kv_events?after=0&limit=1")
        assert body["seq"] == 1
        assert body["more"]
        for bad in ("after=-1", "after=x", "limit=0", "limit=5000"):
            code, body = request(p, "GET", f"/v1/kv_events?{bad}")
            assert code == 400, bad


def test_the_journal_snapshots_a_reader_that_fell_behind() -> None:
    j = CacheJournal(capacity=3)
    for i in range(5):
        j.add(True, bytes([i]) * 32)
    got = j.since(0, [b"x"], limit=10)  # changes 1 and 2 are gone
    assert got.snapshot == (b"x",)
    assert got.seq == 5
    got = j.since(2, [], limit=10)
    assert got.snapshot is None
    assert [h[0] for _, h in got.events] == [2, 3, 4]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"x" * (MAX_EVENTS_BYTES + 1), "exceeds"),
        (b"[1]", "not a JSON object"),
        (b"{", "not JSON"),
        (b'{"epoch":"e","block_size":16,"seq":-1,"more":false,"events":[]}', "seq"),
        (b'{"epoch":"e e","block_size":16,"seq":1,"more":false,"events":[]}', "epoch"),
        (b'{"epoch":"e","block_size":0,"seq":1,"more":false,"events":[]}', "block_size"),
        (b'{"epoch":"e","block_size":16,"seq":1,"more":0,"events":[]}', "more"),
        (b'{"epoch":"e","block_size":16,"seq":1,"more":false,"events":[[true,"zz"]]}', "hex"),
        (
            b'{"epoch":"e","block_size":16,"seq":1,"more":false,"events":[],"snapshot":[1]}',
            "hex",
        ),
        (
            b'{"epoch":"e","block_size":16,"seq":1,"more":false,"events":'
            + json.dumps([[True, "a" * 64]] * 4097).encode()
            + b"}",
            "at most",
        ),
    ],
)
def test_hostile_kv_events_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_kv_events(data)


def test_the_prefix_index_is_bounded() -> None:
    index = PrefixIndex(capacity=3)
    hashes = [bytes([i]) * 32 for i in range(5)]
    index.add(hashes)
    assert len(index) == 3
    assert index.dropped == 2
    assert index.match(hashes[2:]) == 3
    assert index.match(hashes) == 0


def _record(engine_id: str, role: str, port: int) -> EngineRecord:
    return EngineRecord(
        engine_id=engine_id,
        role=EngineRole.PRODUCER if role == "prefill" else EngineRole.CONSUMER,
        host="127.0.0.1",
        side_channel_ports=(),
        transport="inprocess",
        tp_size=1,
        capabilities={role, "block_size:4"},
        incarnation="i1",
        api_port=port,
    )


def test_the_table_picks_the_longest_prefix_among_the_least_loaded() -> None:
    table = FleetTable(policy="prefix", max_imbalance=1)
    for i in range(3):
        assert table.add(_record(f"p{i}", "prefill", 9000 + i))
    assert not table.add(attrs.evolve(_record("x", "prefill", 9009), api_port=None))
    prompt = list(range(12))
    p1 = table.get("p1")
    assert p1 is not None
    p1.index.add(block_hashes(prompt, 4)[:2])
    first = table.pick("prefill", prompt)
    assert first is p1  # two blocks known there
    second = table.pick("prefill", prompt)
    assert second is p1  # one more in flight: within max_imbalance
    third = table.pick("prefill", prompt)
    assert third is not None
    assert third is not p1
    assert table.pick("prefill", prompt, exclude={"p0", "p1", "p2"}) is None
    table.mark_down(p1)
    for m in (first, second, third):
        table.done(m)
    assert all(table.pick("prefill", prompt) is not p1 for _ in range(6))


def test_round_robin_spreads_requests() -> None:
    table = FleetTable(policy="round_robin")
    for i in range(2):
        table.add(_record(f"p{i}", "prefill", 9000 + i))
    picked = []
    for _ in range(4):
        m = table.pick("prefill", [1, 2, 3, 4])
        assert m is not None
        picked.append(m.engine_id)
        table.done(m)
    assert sorted(picked) == ["p0", "p0", "p1", "p1"]


def _prompt(group: int, i: int) -> list[int]:
    # 48 shared tokens per group (3 blocks), then a request's own tail.
    return [100 + group] * 48 + [7 + i, 8 + i, 9]


def test_two_p_two_d_route_on_prefixes_and_survive_a_vanished_and_a_dead_engine(
    url: str,
) -> None:
    with contextlib.ExitStack() as stack:
        engines = {
            eid: stack.enter_context(member(role, eid, url))
            for eid, role in (
                ("f2-p0", "kv_producer"),
                ("f2-p1", "kv_producer"),
                ("f2-d0", "kv_consumer"),
                ("f2-d1", "kv_consumer"),
            )
        }
        router = stack.enter_context(fleet_router(url))
        _wait(lambda: len(_live(router, "prefill")) == 2 and len(_live(router, "decode")) == 2)
        reference = None
        by_group: dict[int, set[str]] = {0: set(), 1: set()}
        d_of_group: dict[int, set[str]] = {0: set(), 1: set()}
        for i in range(6):
            group = i % 2
            code, ans = router.complete({"prompt": _prompt(group, i), "max_tokens": 3})
            assert code == 200, ans
            by_group[group].add(ans["engines"]["prefill"])
            d_of_group[group].add(ans["engines"]["decode"])
            if i == 0:
                reference = ans["choices"][0]["token_ids"]
        assert reference is not None
        # Each group's shared prefix stays on the P that computed it first.
        assert all(len(engines_seen) == 1 for engines_seen in by_group.values()), by_group
        assert all(len(engines_seen) == 1 for engines_seen in d_of_group.values()), d_of_group
        assert router.fleet is not None
        assert router.fleet.prefix_hits >= 6

        # A P withdraws (a clean shutdown): the router stops routing to it.
        gone = sorted(by_group[0])[0]
        engines[gone][1].close()
        _wait(lambda: gone not in _live(router, "prefill"))
        for i in range(4):
            code, ans = router.complete({"prompt": _prompt(0, 10 + i), "max_tokens": 3})
            assert code == 200
            assert ans["engines"]["prefill"] != gone

        # A D dies without withdrawing (its HTTP API gone, still registered): the request
        # that finds it dead is routed again from the start on the other D.
        dead_d = sorted(d_of_group[1])[0]  # where group 1's prefix lives: tried first
        other_d = ({"f2-d0", "f2-d1"} - {dead_d}).pop()
        dead = engines[dead_d][0]
        assert dead.service is not None
        dead.service.close()  # the engine loop stops: it answers 503
        seen = set()
        for i in range(4):
            code, ans = router.complete({"prompt": _prompt(1, 20 + i), "max_tokens": 3})
            assert code == 200, ans
            seen.add(ans["engines"]["decode"])
        assert seen == {other_d}
        health = router.fleet.describe()
        assert next(e for e in health["engines"] if e["engine_id"] == dead_d)["down"]
        assert router.retried == 1  # only the request that found it dead was routed again


def _recording(router: Router) -> list[tuple[str, Any]]:
    """Record each leg's ``kv_transfer_params`` as the router sends it (the legs still run)."""
    sent: list[tuple[str, Any]] = []
    ask = router._ask

    def recorded(side: str, target: Any, body: dict[str, Any], timeout: float) -> Any:
        sent.append((side, body.get("kv_transfer_params")))
        return ask(side, target, body, timeout)

    router._ask = recorded  # type: ignore[method-assign]
    return sent


def test_the_prefill_leg_names_the_decode_engine_chosen_for_it(url: str) -> None:
    with contextlib.ExitStack() as stack:
        for eid, role in (
            ("fd-p", "kv_producer"),
            ("fd-d0", "kv_consumer"),
            ("fd-d1", "kv_consumer"),
        ):
            stack.enter_context(member(role, eid, url))
        router = stack.enter_context(fleet_router(url, policy="round_robin"))
        _wait(lambda: len(_live(router, "prefill")) == 1 and len(_live(router, "decode")) == 2)
        sent = _recording(router)
        chosen = set()
        for i in range(2):
            sent.clear()
            code, ans = router.complete({"prompt": [5, 6, 7 + i], "max_tokens": 2})
            assert code == 200, ans
            decoder = ans["engines"]["decode"]
            chosen.add(decoder)
            # P learns which decoder the ticket is for: it aborts the lease at once if that
            # decoder leaves the fleet before claiming it.
            assert sent[0] == ("prefill", {"do_remote_decode": True, "decode_engine_id": decoder})
            assert sent[1][0] == "decode"
            assert "decode_engine_id" not in sent[1][1]
        assert chosen == {"fd-d0", "fd-d1"}


def test_a_router_of_one_p_and_one_d_names_no_decode_engine() -> None:
    # It knows D by address only (not its engine id); P's lease then runs as before.
    router = Router("http://127.0.0.1:9", "http://127.0.0.1:9")
    sent: list[tuple[str, Any]] = []

    def refuse(side: str, target: Any, body: dict[str, Any], timeout: float) -> Any:
        sent.append((side, body.get("kv_transfer_params")))
        return 502, {"error": {"message": "not reached", "type": "unreachable"}}

    router._ask = refuse  # type: ignore[method-assign]
    code, _ = router.complete({"prompt": [1, 2, 3], "max_tokens": 2})
    assert code == 502
    assert sent == [("prefill", {"do_remote_decode": True})]


def test_no_live_engine_is_a_503_naming_the_side(url: str) -> None:
    with member("kv_consumer", "fn-d", url), fleet_router(url) as router:
        _wait(lambda: _live(router, "decode") == ["fn-d"])
        code, ans = router.complete({"prompt": [1, 2, 3], "max_tokens": 2})
        assert code == 503
        assert ans["error"]["type"] == "no_prefill_engine"


def test_a_router_takes_engines_or_a_fleet_not_both() -> None:
    with pytest.raises(ValueError, match="either"):
        Router("http://a", "http://b", fleet=FleetTable())
    with pytest.raises(ValueError, match="either"):
        Router("http://a")


def test_engines_join_and_leave_while_traffic_runs(url: str) -> None:
    import threading

    answers: list[tuple[int, dict[str, Any]]] = []
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        stack.enter_context(member("kv_producer", "fj-p0", url))
        stack.enter_context(member("kv_consumer", "fj-d0", url))
        router = stack.enter_context(fleet_router(url, policy="round_robin"))
        _wait(lambda: len(_live(router, "prefill")) == 1 and len(_live(router, "decode")) == 1)

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                answers.append(router.complete({"prompt": _prompt(i % 2, i), "max_tokens": 2}))
                i += 1

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            _, p1 = stack.enter_context(member("kv_producer", "fj-p1", url))
            stack.enter_context(member("kv_consumer", "fj-d1", url))
            _wait(lambda: {a["engines"]["prefill"] for c, a in answers if c == 200} >= {"fj-p1"})
            _wait(lambda: {a["engines"]["decode"] for c, a in answers if c == 200} >= {"fj-d1"})
            p1.close()  # leaves while requests run
            _wait(lambda: "fj-p1" not in _live(router, "prefill"))
            n = len(answers)
            _wait(lambda: len(answers) >= n + 4)
        finally:
            stop.set()
            thread.join(timeout=30)
        assert answers
        assert all(code == 200 for code, _ in answers), [a for c, a in answers if c != 200][:3]
        assert all(a["engines"]["prefill"] != "fj-p1" for _, a in answers[n + 1 :])


def test_push_mode_in_a_fleet_fetches_each_prefill_engines_address(url: str) -> None:
    with contextlib.ExitStack() as stack:
        for eid, role in (
            ("fpu-p0", "kv_producer"),
            ("fpu-p1", "kv_producer"),
            ("fpu-d0", "kv_consumer"),
        ):
            stack.enter_context(member(role, eid, url))
        router = stack.enter_context(fleet_router(url, policy="round_robin", mode="push"))
        _wait(lambda: len(_live(router, "prefill")) == 2 and len(_live(router, "decode")) == 1)
        used = set()
        for i in range(4):
            code, ans = router.complete({"prompt": _prompt(i % 2, i), "max_tokens": 3})
            assert code == 200, ans
            assert ans["usage"]["external_tokens"] > 0  # D's KV came from the chosen P's push
            used.add(ans["engines"]["prefill"])
        assert used == {"fpu-p0", "fpu-p1"}
        assert router.address_fetches == 2  # one per prefill engine, kept after
