"""kvframe's transport conformance kit against the UCX transport, found through the plugin host
(the entry point is tested too); the kit's second endpoint runs in a child process. Run by
test_ucx_isolated.py in an interpreter of its own (ucxx must not share a process with NIXL)."""

from __future__ import annotations

import pytest

pytest.importorskip("ucxx", reason="the UCX tests need ucxx-cu12 (./dev installs it)")
pytest.importorskip("kvframe_ucx", reason="install plugins/kvframe-ucx (./dev does)")

from kvframe.testing import TransportConformance
from kvframe.testing.pytest_plugin import (  # noqa: F401  (the kit's fixtures)
    kvframe_conformance_timeout,
    kvframe_pair,
    kvframe_pair_factory,
    kvframe_transport_factory,
    kvframe_transport_options,
    kvframe_transport_spec,
)


@pytest.fixture
def kvframe_transport_name() -> str:
    return "ucx"


class TestUcxConformance(TransportConformance):
    """The whole kit against ``ucx`` with default options."""
