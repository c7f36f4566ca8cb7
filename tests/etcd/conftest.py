"""Fixtures of the etcd tests: a real etcd per test module, a plugin host, backends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvframe.runtime.plugins import PluginHost
from kvframe.spi.discovery import Discovery, DiscoveryParams
from tests.etcd.server import EtcdServer


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def backends(etcd: EtcdServer) -> Iterator[Callable[..., Discovery]]:
    """Builds ``etcd`` backends through the plugin host (closed after the test)."""
    host = PluginHost(env={})
    host.load(strict=True)
    made: list[Discovery] = []

    def make(**options: Any) -> Discovery:
        opts = {"endpoint": etcd.endpoint, "ttl": 2, "watch_timeout": 2.0, **options}
        d = host.create_discovery("etcd", DiscoveryParams(options=opts))
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()
