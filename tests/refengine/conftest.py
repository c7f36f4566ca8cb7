"""Fixtures for the reference engine's tests: a plugin host that knows the fake connector."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from _refengine_fake import STORES, FakePlugin

from kvframe.runtime.plugins import PluginHost

_names = itertools.count()


@pytest.fixture
def host() -> PluginHost:
    """A host with only the built-ins and the fake connector (no entry points)."""
    h = PluginHost(autoload=False, env={})
    h.load()
    h.register(FakePlugin(), name="refengine-fake")
    return h


@pytest.fixture
def store() -> Iterator[str]:
    """A fresh store name, dropped after the test."""
    name = f"store-{next(_names)}"
    yield name
    STORES.pop(name, None)
