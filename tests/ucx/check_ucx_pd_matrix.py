"""The cross-process P/D matrix (tests/pd/test_pd_matrix_nixl.py) over the ``ucx`` transport:
the same tests, P and D each in its own process with a UcxTransport (this interpreter loads
neither ucxx nor NIXL; the nodes do).

One difference is the transport's: a UCX WRITE is two-sided (P asks D for receive slots and
sends the blocks from its own progress), so a P that stalls right after posting sends nothing
(``WRITE_LANDS_WITHOUT_WRITER_PROGRESS`` is False), and D queues the completion notice itself
once the bytes landed, so "after the WRITE, before the notice" cannot happen over UCX: the
test where P dies stalled after its post is a death mid-WRITE here.
"""

from __future__ import annotations

from typing import Any

import pytest

import tests.pd.test_pd_matrix_nixl as matrix
from tests.pd.test_pd_matrix_nixl import (  # noqa: F401 - the tests and the pair, collected here too
    pair,
    test_d_aborts_before_registration,
    test_d_aborts_registered_before_the_transfer,
    test_d_aborts_with_the_transfer_in_flight,
    test_happy_path_byte_exact,
    test_p_killed_before_registration_and_mid_transfer,
    test_p_killed_mid_write_with_d_stalled,
)
from tests.ucx.over_ucx import MARKS, transport  # noqa: F401 - the fixture, by name

pytestmark = MARKS


@pytest.fixture(scope="module", autouse=True)
def _two_sided_write() -> object:
    # the module's tests read this flag at call time
    saved = matrix.WRITE_LANDS_WITHOUT_WRITER_PROGRESS
    matrix.WRITE_LANDS_WITHOUT_WRITER_PROGRESS = False
    yield None
    matrix.WRITE_LANDS_WITHOUT_WRITER_PROGRESS = saved


def test_p_stalled_mid_write_past_the_lease(pair: Any) -> None:  # noqa: F811
    """Over UCX, D posts its receives for the WRITE when P asks (the access check passes,
    the lease is live). When D's lease then expires, D cuts P off (``Fence``: the peer is
    removed, which cancels those receives) before it reports the blocks free, so P's resumed
    progress lands nothing in them. (Found by this matrix: without the fence, it did.)"""
    matrix.test_p_stalled_mid_write_past_the_lease(pair)


@pytest.mark.parametrize(
    "mode",
    [
        "push",
        # Last: it kills the shared P. Found by this matrix: when D died while P served its
        # READ (P's rendezvous tag sends to D pending), P segfaulted in UCX's worker progress
        # while the transport turned UCX's memory hooks off (no registration cache: UCX
        # aborting the sends dereferenced it). The transport now refuses that setting.
        "pull",
    ],
)
def test_d_killed_before_registration_and_mid_transfer(
    pair: Any,  # noqa: F811 - the imported fixture, requested by name
    transport: str,  # noqa: F811 - the imported fixture, requested by name
    mode: str,
) -> None:
    matrix.test_d_killed_before_registration_and_mid_transfer(pair, transport, mode)
