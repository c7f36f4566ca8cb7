"""Shared test configuration.

Hypothesis profiles are chosen by ``KVFRAME_HYPOTHESIS_PROFILE``: ``dev`` (quick, the default)
or ``ci`` (thorough; ``./dev test`` picks it when ``CI=true``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile(
    "ci",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("KVFRAME_HYPOTHESIS_PROFILE", "dev"))
