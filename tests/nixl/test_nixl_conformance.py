"""kvframe's transport conformance kit against the NIXL transport, found through the plugin
host (the entry point is tested too); the kit's second endpoint runs in a child process."""

from __future__ import annotations

import pytest

from kvframe.testing import TransportConformance
from kvframe.testing.pytest_plugin import (  # noqa: F401  (the kit's fixtures, for this module)
    kvframe_conformance_timeout,
    kvframe_pair,
    kvframe_pair_factory,
    kvframe_transport_factory,
    kvframe_transport_options,
    kvframe_transport_spec,
)

pytestmark = pytest.mark.nixl


@pytest.fixture
def kvframe_transport_name() -> str:
    return "nixl"


class TestNixlConformance(TransportConformance):
    """The whole kit against ``nixl`` with default options (post worker on, small requests
    posted inline)."""
