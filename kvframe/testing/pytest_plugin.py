"""The conformance kit's pytest plugin. Enable it explicitly::

    pytest -p kvframe.testing.pytest_plugin
    # or, in the plugin's conftest.py:
    pytest_plugins = ["kvframe.testing.pytest_plugin"]

Then override ``kvframe_transport_name`` (required) and, if needed,
``kvframe_transport_options``, ``kvframe_transport_factory`` and ``kvframe_conformance_timeout``
in your conftest, and subclass :class:`kvframe.testing.TransportConformance` in a test module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from kvframe.spi.transport import Transport, TransportParams
from kvframe.testing.endpoint import TransportSpec
from kvframe.testing.pair import Pair, PairFactory, pair_factory

__all__ = [
    "kvframe_conformance_timeout",
    "kvframe_pair",
    "kvframe_pair_factory",
    "kvframe_transport_factory",
    "kvframe_transport_name",
    "kvframe_transport_options",
    "kvframe_transport_spec",
]


@pytest.fixture
def kvframe_transport_name() -> str:
    """The registered name of the transport under test. **Override this fixture.**"""
    raise pytest.UsageError(
        "kvframe.testing: define a fixture 'kvframe_transport_name' returning the name your "
        "plugin registers (for example in conftest.py: "
        "@pytest.fixture\\ndef kvframe_transport_name(): return 'fastwire')"
    )


@pytest.fixture
def kvframe_transport_options() -> Mapping[str, Any]:
    """``TransportParams.options`` for every endpoint the kit builds (default: none). For a
    cross-process transport they are sent to the child, so they must be msgpack-able."""
    return {}


@pytest.fixture
def kvframe_transport_factory() -> str | Callable[[TransportParams], Transport] | None:
    """How to build the transport: ``None`` (default) asks kvframe's plugin host for
    ``kvframe_transport_name``, as an engine does, so the entry point is tested too. A
    ``"module:callable"`` string or (in-process transports only) a callable bypass the host."""
    return None


@pytest.fixture
def kvframe_conformance_timeout() -> float:
    """Seconds the kit waits for a transfer, a notification or a child's answer. For a pair
    in this process they are fake seconds: rounds of progress of
    :data:`~kvframe.testing.pair.POLL_INTERVAL` each, with no real sleep."""
    return 10.0


@pytest.fixture
def kvframe_transport_spec(
    kvframe_transport_name: str,
    kvframe_transport_options: Mapping[str, Any],
    kvframe_transport_factory: str | Callable[[TransportParams], Transport] | None,
) -> TransportSpec:
    """The :class:`~kvframe.testing.TransportSpec` built from the fixtures above."""
    return TransportSpec(
        name=kvframe_transport_name,
        options=dict(kvframe_transport_options),
        factory=kvframe_transport_factory,
    )


@pytest.fixture
def kvframe_pair_factory(
    kvframe_transport_spec: TransportSpec, kvframe_conformance_timeout: float
) -> Iterator[PairFactory]:
    """Builds connected :class:`~kvframe.testing.Pair` objects; all are shut down after the
    test (transports closed, child processes stopped)."""
    with pair_factory(kvframe_transport_spec, timeout=kvframe_conformance_timeout) as factory:
        yield factory


@pytest.fixture
def kvframe_pair(kvframe_pair_factory: PairFactory) -> Pair:
    """A fresh connected pair; ``b`` runs in a child process for cross-process transports."""
    return kvframe_pair_factory()
