"""Bidirectional (multi-turn) mode across processes (tests/pd/test_pd_multiturn_nixl.py) over
the ``ucx`` transport: the same tests, each of the file's six ``kv_both`` nodes in its own
process with a UcxTransport (this interpreter loads neither ucxx nor NIXL; the nodes do).

Over UCX a READ is two-sided: D serves P's READ of its kept blocks from its own steps, and
checks it against the leases P claimed before any byte moves (access control).
"""

from __future__ import annotations

from tests.pd.nodes import Node
from tests.pd.test_pd_multiturn_nixl import (  # noqa: F401 - the tests and their fixtures
    nodes,
    pd,
    test_evicted_history_fails_the_pull_and_is_never_read,
    test_p_killed_while_d_holds_blocks,
    test_skewed_clocks_pull_and_past_the_cap_never_read,
    test_turn_two_pulls_kept_blocks_and_frees_them_at_read,
)
from tests.ucx.over_ucx import MARKS, transport  # noqa: F401 - the fixture, by name

pytestmark = MARKS


def test_the_reads_were_two_sided(nodes: dict[str, Node]) -> None:  # noqa: F811
    """Collected last: the nodes ran UCX, and each READ was served by its source's own steps
    (``requests_served`` is a UCX statistic; NIXL's one-sided READ has no server side). P
    served D's turn-one reads; D, and each skewed D, served the turn-two read that pulled
    its kept blocks. The killed Ps are gone and not asked."""
    served = {
        name: nodes[name].status()["transport"].get("requests_served")
        for name in ("p", "d", "d+", "d-")
    }
    assert all(v is not None and v >= 1 for v in served.values()), served
