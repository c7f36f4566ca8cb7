from __future__ import annotations

from kvframe.testing import TransportConformance


class TestInProcessConformance(TransportConformance):
    """The whole kit, against the built-in transport found through the plugin host."""
