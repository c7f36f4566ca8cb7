"""A prefill engine replaced at the same address with the same engine id (issue 20, defect 2).

Before: D kept its connection to the dead P, read from it, learnt it was unreachable, and waited
a fixed second before a new handshake: the first requests after the restart failed. Now the
new P's tickets name its incarnation, so D reconnects *before* it posts; and a ticket without
one (an engine that does not forward its workers' handshake metadata) is read once more on a
new connection when the old one turns out dead. Every request after the restart is served.
"""

from __future__ import annotations

import itertools
import socket

import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from tests.pd.nodes import Node

LEASE = 2.4
_n = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _serve(p: Node, d: Node, blocks: list[int], local: list[int], *, strip: bool = False) -> str:
    rid = f"r{next(_n)}"
    params = p.call("prefill", rid=rid, blocks=blocks, tokens=16 * len(blocks), seed=next(_n))[
        "params"
    ]
    if strip:
        params.pop("remote_incarnations", None)
    else:
        assert params["remote_incarnations"], params
    rid_d = f"d{next(_n)}"
    n = params["remote_num_tokens"]
    d.call("arrive", rid=rid_d, tokens=n, params=params)
    assert d.call("schedule", rid=rid_d, tokens=n, params=params, blocks=local)["external"] > 0
    return rid_d


@pytest.mark.parametrize("strip", [False, True], ids=["with-incarnation", "without"])
def test_prefill_engine_restarted_under_traffic_loses_no_request(strip: bool) -> None:
    port = _free_port()
    extra = {"side_channel_port": port}
    d = Node(f"Drs{next(_n)}", "kv_consumer", lease=LEASE, extra={"handshake_timeout": 2.0})
    p = Node("Prestart", "kv_producer", lease=LEASE, extra=extra)
    try:
        before = [_serve(p, d, [1 + i], [10 + i], strip=strip) for i in range(3)]
        st = d.wait(lambda s: all(r in s["finished_recving"] for r in before))
        assert not set(before) & set(st["failures"]), st["failures"]
        p.kill()
        p.close()
        p = Node("Prestart", "kv_producer", lease=LEASE, extra=extra)  # same id, same port
        after = [
            _serve(p, d, [1 + i, 5 + i], [20 + 2 * i, 21 + 2 * i], strip=strip) for i in range(4)
        ]
        st = d.wait(lambda s: all(r in s["finished_recving"] for r in after), timeout=20)
        failed = {r: st["failures"][r] for r in after if r in st["failures"]}
        assert not failed, failed
        for i, r in enumerate(after):
            src = p.call("digest", blocks=[1 + i, 5 + i])["digest"]
            dst = d.call("digest", blocks=[20 + 2 * i, 21 + 2 * i])["digest"]
            assert src == dst, r
        d.wait(lambda s: not s["pending"], timeout=10)
        p.wait(lambda s: s["gauges"]["leases_held"] == 0, timeout=10)
        if not strip:
            # D noticed the new instance (from the ticket, or from the dead connection when it
            # heartbeated) before it posted: no read went to the dead P.
            assert st["counters"].get("reads_retried", 0) == 0, st["counters"]
    finally:
        d.close()
        p.close()
