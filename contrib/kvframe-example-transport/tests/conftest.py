"""Run kvframe's transport conformance kit against ``example-tcp``.

The kit's pytest plugin is enabled in pyproject.toml (``-p kvframe.testing.pytest_plugin``);
all it needs from us is the registered name. The kit builds the transport through kvframe's
plugin host, so this also proves the entry point works.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def kvframe_transport_name() -> str:
    return "example-tcp"
