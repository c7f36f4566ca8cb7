"""The in-process transport runs the conformance kit through the plugin host, like a stranger's
plugin: each test gets its own fabric, so endpoints and faults cannot leak between tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kvframe.transports.inprocess import InProcessFabric

pytest_plugins = ["kvframe.testing.pytest_plugin"]


@pytest.fixture
def fabric() -> InProcessFabric:
    return InProcessFabric()


@pytest.fixture
def kvframe_transport_name() -> str:
    return "inprocess"


@pytest.fixture
def kvframe_transport_options(fabric: InProcessFabric) -> Mapping[str, Any]:
    return {"fabric": fabric}
