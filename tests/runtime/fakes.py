"""Fake plugins and entry points, so that host tests need no installed distribution."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import attrs

from kvframe.spi.connector import KVConnector
from kvframe.spi.hookspecs import hookimpl
from kvframe.spi.transport import MemoryKind, Transport, TransportCapabilities, TransportParams

CAPS = TransportCapabilities(
    memory_kinds={MemoryKind.HOST},
    read=True,
    write=False,
    notifications=True,
    max_notification_bytes=512,
    cross_process=True,
)


def make_plugin(name: str = "fake_plugin", **hooks: Callable[..., Any]) -> types.ModuleType:
    """A module object whose attributes are ``@hookimpl`` functions named after the hooks."""
    mod = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, hookimpl(fn))
    return mod


def transport_plugin(*names: str, name: str = "fake_transports") -> types.ModuleType:
    """A plugin registering each of ``names`` as a transport built by :class:`FakeTransport`."""

    def kvframe_register_transports(register: Any) -> None:
        for n in names:
            register(n, FakeTransport.factory, capabilities=CAPS)

    return make_plugin(name, kvframe_register_transports=kvframe_register_transports)


@attrs.frozen
class FakeDist:
    name: str
    version: str


@attrs.define
class FakeEntryPoint:
    """Quacks like importlib.metadata.EntryPoint; ``load`` returns ``obj`` or raises it."""

    name: str
    value: str
    dist: FakeDist | None
    obj: Any = None
    loads: int = 0

    def load(self) -> Any:
        self.loads += 1
        if isinstance(self.obj, BaseException):
            raise self.obj
        return self.obj


def ep(name: str, obj: Any, dist: str | None = "fake-dist", version: str = "1.0") -> FakeEntryPoint:
    """An entry point ``name = <dist>_mod.plugin`` of distribution ``dist``."""
    return FakeEntryPoint(
        name=name,
        value=f"{(dist or 'nodist').replace('-', '_')}_{name}.plugin",
        dist=FakeDist(dist, version) if dist is not None else None,
        obj=obj,
    )


class FakeTransport(Transport):
    """A transport that only knows its name and whether it was closed."""

    capabilities = CAPS

    def __init__(self, params: TransportParams) -> None:
        self._name = params.name
        self.closed = False

    @classmethod
    def factory(cls, params: TransportParams) -> FakeTransport:
        return cls(params)

    @property
    def name(self) -> str:
        return self._name

    def register_memory(self, regions: Any) -> None:
        raise NotImplementedError

    def local_metadata(self) -> bytes:
        raise NotImplementedError

    def add_peer(self, metadata: bytes) -> str:
        raise NotImplementedError

    def remove_peer(self, peer: str) -> None:
        raise NotImplementedError

    def prepare_local(self, layout: Any) -> Any:
        raise NotImplementedError

    def prepare_remote(self, peer: str, layout: Any) -> Any:
        raise NotImplementedError

    def post(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def poll(self, handle: Any) -> Any:
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        raise NotImplementedError

    def send_notification(self, peer: str, payload: bytes) -> None:
        raise NotImplementedError

    def drain_notifications(self) -> list[Any]:
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True


class FakeConnector(KVConnector):
    """A concrete connector class; the host only checks the class, never builds it."""

    @classmethod
    def build_scheduler(cls, config: Any, engine: Any, ctx: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def build_worker(cls, config: Any, engine: Any, rank: int, ctx: Any) -> Any:
        raise NotImplementedError


class AbstractConnector(KVConnector):
    """Leaves ``build_worker`` abstract: the host must refuse it."""

    @classmethod
    def build_scheduler(cls, config: Any, engine: Any, ctx: Any) -> Any:
        raise NotImplementedError
