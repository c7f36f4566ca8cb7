"""The etcd backend against a real etcd started by the test: registration and watch, TTL
expiry after SIGKILL, hostile records, etcd restarted, a partitioned engine."""

from __future__ import annotations

import base64
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests
from kvframe_etcd.backend import EtcdWatch

from kvframe.core.fleet import EngineAdded, EngineRole
from kvframe.discovery.keepalive import KeptRegistration
from kvframe.errors import ConfigError
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.discovery import Discovery, DiscoveryParams, Registration
from tests.discovery.helpers import Events, record, start_registered_child, stop_child, wait_for
from tests.etcd.server import EtcdServer, Proxy

Make = Callable[..., Discovery]


def kept(reg: Registration) -> KeptRegistration:
    assert isinstance(reg, KeptRegistration)
    return reg


def test_engines_register_and_a_watch_follows_them(backends: Make, etcd: EtcdServer) -> None:
    engine, watcher = backends(), backends()
    events = Events()
    p = engine.register(record("p0"))
    w = watcher.watch(events)
    wait_for(lambda: [r.engine_id for r in w.live()] == ["p0"], 5, "p0 listed")
    d_rec = record("d0", EngineRole.CONSUMER, port=5700)
    d = engine.register(d_rec)
    wait_for(lambda: len(w.live()) == 2, 5, "d0 watched")
    added = [e for _, e in events.items if isinstance(e, EngineAdded)]
    assert [e.record for e in added][-1] == d_rec  # every field crossed etcd intact
    assert not p.lost
    assert not d.lost
    t0 = time.monotonic()
    d.withdraw()
    wait_for(lambda: events.vanished("d0") != [], 5, "d0 withdrawn")
    assert events.vanished("d0")[0][0] - t0 < 1.0  # a withdrawal is seen at once, not at TTL
    assert events.vanished("d0")[0][1].reason == "deleted"
    assert w.connected


def test_hostile_records_are_skipped_and_counted(backends: Make, etcd: EtcdServer) -> None:
    engine, watcher = backends(), backends()
    w = watcher.watch(Events())
    engine.register(record("p0"))
    wait_for(lambda: len(w.live()) == 1, 5, "p0 watched")
    url = f"{etcd.endpoint}/v3/kv/put"
    for key, value in [
        ("/kvframe/fleet/engines/x1", b"\x80not json"),
        ("/kvframe/fleet/engines/x2", b'{"kvframe_engine": 1, "engine_id": "x2"}'),
        ("/kvframe/fleet/engines/p9", b"[]" * 9000),
    ]:
        body = {
            "key": base64.b64encode(key.encode()).decode(),
            "value": base64.b64encode(value).decode(),
        }
        requests.post(url, json=body, timeout=2).raise_for_status()
    wait_for(lambda: w.malformed >= 3, 5, "three malformed records counted")
    engine.register(record("p1"))
    wait_for(lambda: len(w.live()) == 2, 5, "the watch goes on after them")
    assert w.connected


def test_a_sigkilled_engine_vanishes_within_its_ttl(backends: Make, etcd: EtcdServer) -> None:
    watcher = backends()
    events = Events()
    w = watcher.watch(events)
    child = start_registered_child("etcd", {"endpoint": etcd.endpoint, "ttl": 2}, "d7")
    try:
        wait_for(lambda: [r.engine_id for r in w.live()] == ["d7"], 5, "d7 watched")
        time.sleep(2.5)  # longer than the TTL: the living child keeps it registered
        assert events.vanished("d7") == []
        child.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: events.vanished("d7") != [], 10, "d7 vanished")
        took = events.vanished("d7")[0][0] - killed
        # etcd drops the lease at most ttl (2 s) after the last keep-alive (sent <= 0.67 s
        # before the kill) and checks expiries every 0.5 s.
        print(f"vanished {took:.2f} s after SIGKILL (ttl 2 s)")
        assert took <= 2.0 + 0.6, took
    finally:
        stop_child(child)


def test_etcd_restarted_mid_run_frees_nothing_and_keeps_registrations(
    backends: Make, etcd: EtcdServer
) -> None:
    engine = backends(ttl=4)
    watcher = backends(ttl=4, watch_timeout=1.0)
    events = Events()
    regs = [engine.register(record("p0")), engine.register(record("d0", EngineRole.CONSUMER))]
    w = watcher.watch(events)
    assert isinstance(w, EtcdWatch)
    wait_for(lambda: len(w.live()) == 2, 5, "both watched")
    resyncs = w.resyncs
    etcd.stop(signal.SIGKILL)
    time.sleep(1.0)
    etcd.start()
    wait_for(lambda: w.resyncs > resyncs and w.connected, 10, "the watch relisted")
    time.sleep(1.5)  # a few keep-alives on the restarted etcd
    assert [type(e).__name__ for _, e in events.items] == ["EngineAdded", "EngineAdded"]
    assert not any(r.lost for r in regs)
    assert [kept(r).grants for r in regs] == [1, 1]


def test_etcd_restarted_without_its_data_gets_every_engine_back(
    backends: Make, etcd: EtcdServer
) -> None:
    engine = backends(ttl=3)
    watcher = backends(ttl=3, watch_timeout=1.0)
    events = Events()
    regs = [engine.register(record("p0")), engine.register(record("d0", EngineRole.CONSUMER))]
    w = watcher.watch(events)
    wait_for(lambda: len(w.live()) == 2, 5, "both watched")
    etcd.stop(signal.SIGKILL)
    shutil.rmtree(etcd.data_dir)
    etcd.start()
    # The engines' leases are unknown to the new etcd: they register again...
    wait_for(lambda: all(kept(r).grants == 2 for r in regs), 15, "registered again")
    wait_for(lambda: len(w.live()) == 2 and w.connected, 10, "watched again")
    # ...and the watcher, seeing another cluster, waited a TTL before trusting its listing:
    # nobody saw them vanish.
    time.sleep(1.0)
    assert events.vanished("p0") == []
    assert events.vanished("d0") == []
    assert isinstance(w, EtcdWatch)
    assert w.resets == 1


def test_a_partitioned_engine_vanishes_after_its_ttl_and_registers_again(
    backends: Make, etcd: EtcdServer
) -> None:
    proxy = Proxy(etcd.client_port)
    lost: list[str] = []
    try:
        engine = backends(endpoint=proxy.endpoint, ttl=2, request_timeout=0.5)
        watcher = backends()
        events = Events()
        w = watcher.watch(events)
        reg = engine.register(record("d3", EngineRole.CONSUMER), on_lost=lost.append)
        wait_for(lambda: len(w.live()) == 1, 5, "d3 watched")
        proxy.cut()
        cut = time.monotonic()
        wait_for(lambda: lost != [], 5, "the registrant noticed")
        noticed = time.monotonic()
        wait_for(lambda: events.vanished("d3") != [], 5, "d3 vanished")
        gone = events.vanished("d3")[0][0]
        # The registrant knows before the fleet does (it stops reading first), and the
        # fleet knows within the TTL.
        assert noticed <= gone
        assert gone - cut <= 2.0 + 0.6
        assert reg.lost
        proxy.restore()
        wait_for(lambda: not reg.lost, 10, "registered again")
        wait_for(lambda: len(w.live()) == 1, 5, "d3 back in the fleet")
        assert events.kinds("d3") == ["EngineAdded", "EngineVanished", "EngineAdded"]
        assert kept(reg).grants == 2
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ttl": 1}, "whole number of seconds >= 2"),
        ({"ttl": 2.5}, "whole number of seconds >= 2"),
        ({"endpoint": "127.0.0.1:2379"}, "must be an http:// or https:// URL"),
        ({"prefix": "/kvframe"}, "must end with '/'"),
        ({"ttl": 3, "interval": 5}, "must be shorter than ttl"),
        ({"ttl_seconds": 5}, "unknown option 'ttl_seconds'"),
    ],
)
def test_bad_options_name_what_to_fix(options: dict[str, Any], message: str) -> None:
    host = PluginHost(env={})
    host.load(strict=True)
    with pytest.raises(ConfigError, match=message):
        host.create_discovery("etcd", DiscoveryParams(options=options))


def test_an_unreachable_etcd_does_not_raise_but_stays_lost(etcd: EtcdServer) -> None:
    host = PluginHost(env={})
    host.load(strict=True)
    d = host.create_discovery(
        "etcd",
        DiscoveryParams(
            options={"endpoint": "http://127.0.0.1:1", "ttl": 2, "request_timeout": 0.2}
        ),
    )
    try:
        t0 = time.monotonic()
        reg = d.register(record("p0"))
        assert time.monotonic() - t0 < 1.0  # bounded by request_timeout
        assert reg.lost
    finally:
        d.close()
