"""The built-in ``mem`` and ``file`` discovery backends through the plugin host, and
:class:`~kvframe.runtime.fleet.FleetLiveness` driving workers from them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvframe.core.fleet import EngineRole
from kvframe.discovery.mem import MemFleet
from kvframe.errors import ConfigError, PluginNotFoundError
from kvframe.runtime.fleet import FleetLiveness
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.discovery import Discovery, DiscoveryParams
from kvframe.spi.hookspecs import hookimpl
from tests.discovery.helpers import Events, record, start_registered_child, stop_child, wait_for


@pytest.fixture
def host() -> PluginHost:
    h = PluginHost(env={})
    h.load(strict=True)
    return h


def test_the_builtins_register_through_the_hook(host: PluginHost) -> None:
    assert {"mem", "file"} <= set(host.discovery_backend_names())
    info = host.discovery_backend_info("mem")
    assert info.plugin == "discovery"
    with pytest.raises(PluginNotFoundError, match="Did you mean 'mem'"):
        host.create_discovery("men", DiscoveryParams())


def test_a_plugin_registers_a_backend_through_kvframe_register_discovery_backends(
    host: PluginHost,
) -> None:
    class Plugin:
        @hookimpl
        def kvframe_register_discovery_backends(self, register: Any) -> None:
            register("mine", lambda params: "not a backend")

    host.register(Plugin(), name="mine-plugin")
    with pytest.raises(Exception, match=r"not a kvframe\.spi\.discovery\.Discovery"):
        host.create_discovery("mine", DiscoveryParams())


def test_mem_registers_watches_and_withdraws(host: PluginHost) -> None:
    fleet = MemFleet()
    a = host.create_discovery("mem", DiscoveryParams(options={"fleet": fleet}))
    b = host.create_discovery("mem", DiscoveryParams(options={"fleet": fleet}))
    try:
        p = a.register(record("p0"))
        events = Events()
        w = b.watch(events)
        a.register(record("d0", EngineRole.CONSUMER))
        assert [r.engine_id for r in w.live()] == ["d0", "p0"]
        assert events.kinds("p0") == ["EngineAdded"]
        fleet.put("/kvframe/engines/x", b"{not json")
        assert w.malformed == 1
        assert [r.engine_id for r in w.live()] == ["d0", "p0"]
        p.withdraw()
        p.withdraw()
        assert events.kinds("p0") == ["EngineAdded", "EngineVanished"]
        a.close()
        assert w.live() == ()
    finally:
        a.close()
        b.close()


def test_options_are_checked(host: PluginHost, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown option 'fleat'; did you mean 'fleet'"):
        host.create_discovery("mem", DiscoveryParams(options={"fleat": 1}))
    with pytest.raises(ConfigError, match="option 'directory' is required"):
        host.create_discovery("file", DiscoveryParams(options={}))
    with pytest.raises(ConfigError, match=r"interval .* must be shorter than ttl"):
        host.create_discovery(
            "file", DiscoveryParams(options={"directory": str(tmp_path), "ttl": 1, "interval": 2})
        )
    with pytest.raises(ConfigError, match="'ttl' must be a number of seconds"):
        host.create_discovery("file", DiscoveryParams(options={"directory": "x", "ttl": "10"}))


def test_file_a_sigkilled_engine_vanishes_within_its_ttl(host: PluginHost, tmp_path: Path) -> None:
    opts = {"directory": str(tmp_path), "ttl": 1.0, "poll_interval": 0.05}
    watcher: Discovery = host.create_discovery("file", DiscoveryParams(options=opts))
    child = start_registered_child("file", opts, "d7")
    events = Events()
    try:
        w = watcher.watch(events)
        wait_for(lambda: [r.engine_id for r in w.live()] == ["d7"], 5, "d7 registered")
        time.sleep(1.5)  # over a TTL: the live child keeps it alive
        assert events.kinds("d7") == ["EngineAdded"]
        child.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        child.wait()
        wait_for(lambda: events.vanished("d7") != [], 5, "d7 vanished")
        ((at, ev),) = events.vanished("d7")
        assert ev.reason == "missing"
        # within ttl (1 s) of its last rewrite, plus one poll
        assert at - killed <= 1.0 + 0.05 + 0.2
    finally:
        stop_child(child)
        watcher.close()
    assert os.path.exists(tmp_path / "d7.json")  # a dead process leaves its file; it expired


def test_file_counts_a_malformed_file_once_however_many_polls(
    host: PluginHost, tmp_path: Path
) -> None:
    opts = {"directory": str(tmp_path), "ttl": 1.0, "poll_interval": 0.02}
    watcher: Discovery = host.create_discovery("file", DiscoveryParams(options=opts))
    (tmp_path / "x.json").write_bytes(b"{not json")  # no expiry line: never expires
    try:
        w = watcher.watch(Events())
        wait_for(lambda: w.malformed == 1, 5, "the bad file counted")
        time.sleep(0.3)  # about 15 polls of the same directory
        assert w.malformed == 1
        (tmp_path / "x.json").write_bytes(b"{still not json")
        wait_for(lambda: w.malformed == 2, 5, "new bytes counted again")
    finally:
        watcher.close()


class FakeWorker:
    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def engine_gone(self, engine_id: str, reason: str = "") -> None:
        self.calls.append(("gone", engine_id))

    def fence(self, reason: str) -> None:
        self.calls.append(("fence",))

    def unfence(self) -> None:
        self.calls.append(("unfence",))


def test_fleet_liveness_reports_vanished_engines_and_fences_on_a_lapse(
    host: PluginHost, tmp_path: Path
) -> None:
    opts = {"directory": str(tmp_path), "ttl": 0.6, "poll_interval": 0.05}
    backend = host.create_discovery("file", DiscoveryParams(options=opts))
    other = host.create_discovery("file", DiscoveryParams(options=opts))
    worker = FakeWorker()
    live = FleetLiveness(backend, record("p1"), [worker], hold=0.2)
    try:
        reg = other.register(record("d1", EngineRole.CONSUMER))
        wait_for(lambda: len(live.watch.live()) == 2, 5, "both registered")
        reg.withdraw()
        wait_for(lambda: ("gone", "d1") in worker.calls, 5, "d1 reported gone")
        assert [e.record.engine_id for e in live.gone] == ["d1"]
        # This engine's own directory disappears: its keep-alive fails, it fences itself
        # before anyone could see it vanish, and unfences once registered again.
        moved = tmp_path.with_name(tmp_path.name + "-away")
        tmp_path.rename(moved)
        wait_for(lambda: ("fence",) in worker.calls, 5, "fenced")
        assert live.fenced
        moved.rename(tmp_path)
        wait_for(lambda: ("unfence",) in worker.calls, 5, "unfenced")
        assert not live.fenced
        assert not live.registration.lost
    finally:
        live.close()
        other.close()
        backend.close()


def test_fleet_liveness_leaves_a_replaced_engine_to_its_leases(host: PluginHost) -> None:
    # A restarted decoder (another incarnation under the same id) may already have claimed
    # leases over the same peer names: only deleted or missing engines are reported gone.
    fleet = MemFleet()
    mine = host.create_discovery("mem", DiscoveryParams(options={"fleet": fleet}))
    other = host.create_discovery("mem", DiscoveryParams(options={"fleet": fleet}))
    worker = FakeWorker()
    live = FleetLiveness(mine, record("p1"), [worker], hold=0.1)
    try:
        other.register(record("d1", EngineRole.CONSUMER))
        other.register(record("d1", EngineRole.CONSUMER))  # restarted: a new incarnation
        assert worker.calls == []
        fleet.drop("d1")
        assert worker.calls == [("gone", "d1")]
    finally:
        live.close()
        other.close()
        mine.close()
