from __future__ import annotations

from kvframe.testing import TransportConformance


class TestExampleTcp(TransportConformance):
    """Every conformance test, with the second endpoint in a child process."""
