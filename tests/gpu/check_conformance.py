"""The transport conformance kit with every buffer a torch tensor on ``KVFRAME_KIT_DEVICE``.

Run by ``gpu_check.py`` in an interpreter of its own (the file is named ``check_*`` so the main
test run does not collect it), with ``KVFRAME_KIT_TRANSPORT`` naming the transport (``nixl`` or
``ucx``: ucxx and NIXL must not share a process) and ``KVFRAME_KIT_DEVICE`` the device
(``cuda:0`` on a GPU machine, ``cpu`` in the dry run)::

    KVFRAME_KIT_TRANSPORT=nixl KVFRAME_KIT_DEVICE=cuda:0 python -m pytest \\
        -p no:cacheprovider -o python_files='check_*.py' tests/gpu/check_conformance.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from torch_endpoint import install, kit_device

from kvframe.spi.transport import MemoryKind
from kvframe.testing import TransportConformance
from kvframe.testing import pytest_plugin as kit_fixtures
from kvframe.testing.endpoint import TransportSpec
from kvframe.testing.pair import Pair, PairFactory, pair_factory

# The kit's fixtures, for this module (all but the pair factory, which is replaced below).
kvframe_conformance_timeout = kit_fixtures.kvframe_conformance_timeout
kvframe_pair = kit_fixtures.kvframe_pair
kvframe_transport_factory = kit_fixtures.kvframe_transport_factory
kvframe_transport_options = kit_fixtures.kvframe_transport_options
kvframe_transport_spec = kit_fixtures.kvframe_transport_spec


@pytest.fixture
def kvframe_transport_name() -> str:
    return os.environ.get("KVFRAME_KIT_TRANSPORT", "nixl")


@pytest.fixture
def kvframe_pair_factory(
    kvframe_transport_spec: TransportSpec,
    kvframe_conformance_timeout: float,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[PairFactory]:
    """The kit's pair factory, building endpoints whose buffers are tensors on the device."""
    install(monkeypatch)
    with pair_factory(kvframe_transport_spec, timeout=kvframe_conformance_timeout) as factory:
        yield factory


def test_the_pair_buffers_are_on_the_device(kvframe_pair: Pair) -> None:
    """The kit really runs on the device: both endpoints' buffers are of its memory kind."""
    want = MemoryKind.DEVICE if kit_device().startswith("cuda") else MemoryKind.HOST
    assert kvframe_pair.a_buffer.kind is want
    assert kvframe_pair.b_buffer.kind is want
    assert all(r.kind is want for r in kvframe_pair.a_layout.regions)


class TestConformanceOnDevice(TransportConformance):
    """The whole kit, buffers on ``KVFRAME_KIT_DEVICE``."""
