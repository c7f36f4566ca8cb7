from __future__ import annotations

import kvframe


def test_version_is_exported() -> None:
    assert kvframe.__version__ == "0.1.0"
