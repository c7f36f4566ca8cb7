"""The in-process transport runs the conformance kit through the plugin host, like a stranger's
plugin: each test gets its own fabric, so endpoints and faults cannot leak between tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kvframe.testing.pytest_plugin import (  # noqa: F401 - fixtures, re-exported for pytest
    kvframe_conformance_timeout,
    kvframe_pair,
    kvframe_pair_factory,
    kvframe_transport_factory,
    kvframe_transport_spec,
)
from kvframe.transports.inprocess import InProcessFabric

# A conftest below the rootdir may not set pytest_plugins (pytest refuses it: it would apply to
# the whole suite), so the kit's fixtures are imported; the two we configure are defined here.


@pytest.fixture
def fabric() -> InProcessFabric:
    return InProcessFabric()


@pytest.fixture
def kvframe_transport_name() -> str:
    return "inprocess"


@pytest.fixture
def kvframe_transport_options(fabric: InProcessFabric) -> Mapping[str, Any]:
    return {"fabric": fabric}
