"""What a check file that reruns a cross-process test module over UCX needs: the marks that
skip it where ucxx or the plugin is missing (found, not imported: this interpreter loads
neither ucxx nor NIXL, the nodes do), and the ``transport`` fixture that the imported tests'
fixtures take."""

from __future__ import annotations

import importlib.util

import pytest

MARKS = [
    pytest.mark.ucx,
    pytest.mark.skipif(
        importlib.util.find_spec("ucxx") is None or importlib.util.find_spec("kvframe_ucx") is None,
        reason="the UCX tests need ucxx-cu12 and plugins/kvframe-ucx (./dev installs both)",
    ),
]


@pytest.fixture(scope="module")
def transport() -> str:
    return "ucx"
