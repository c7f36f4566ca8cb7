"""Fixtures for the reference engine's tests: a plugin host that knows the fake connector."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from kvframe.runtime.plugins import PluginHost
from tests.refengine._refengine_fake import STORES, FakePlugin

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


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The model is tiny: torch's intra-op threads cost far more than they give, and on a
    shared 2-core machine they make every step tens of times slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
