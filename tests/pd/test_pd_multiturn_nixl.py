"""Bidirectional (multi-turn) mode across real processes over NIXL (issue 13, item 6);
``tests/ucx/check_ucx_multiturn.py`` runs these very tests over the ``ucx`` transport (it
imports them with another ``transport``).

Two ``kv_both`` engines, each in its own process (tests/pd/node.py). Turn one: P prefills, D
pulls it with ``keep_for_next_turn``, decodes an answer and keeps the conversation's blocks
under a kept lease, answering with its history ticket. Turn two: P gets the ticket as
``kv_history`` and pulls D's blocks over NIXL. Every way the kept blocks go away (ttl,
eviction, P killed) ends in a recompute or a free by the lease rules, never in a read of
blocks D dropped.

Timings are short so the file runs in seconds: D's lease 1 s (P heartbeats every 0.17 s, each
heartbeat keeps a claimed lease 0.67 s), kept ttls of 3 and 6 s, P's ``ttl_safety_margin``
1.2 s (a window in which D still keeps blocks that P may no longer read). The file's six nodes
start together, before any test: a node takes about 3.5 s of CPU to start, mostly importing
torch, so starting them is most of the file's time on 2 cores. Every node's clock is
``time.monotonic()`` plus its skew, and the nodes' ``times`` are plain ``time.monotonic()``
(one clock for every process on the host): a skewed D's ``kept_until`` minus its skew is a
time the test can compare with them.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.pd.nodes import Node

# find_spec, not importorskip: check_ucx_multiturn.py imports this module, and its process must
# not load NIXL (the nodes load the transport, the test process neither).
pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(
        importlib.util.find_spec("nixl_cu12") is None, reason="the NIXL transport needs nixl-cu12"
    ),
]

P_LEASE = 2.4  # P's leases for D's turn-one reads (as in test_pd_nixl.py)
D_LEASE = 1.0  # D's leases for P's reads of kept blocks
INTERVAL = D_LEASE / 6
EXTENSION = D_LEASE * 2 / 3
TTL = 6.0  # the shared D's decoder_kv_blocks_ttl
SHORT_TTL = 3.0  # the skewed Ds'
MARGIN = 1.2  # P's ttl_safety_margin
PROMPT = 40  # turn one's prompt: 3 blocks of tests/pd/driver.py's 16 tokens
ANSWER = 10  # D's answer: the conversation's 50 tokens fill 4 blocks
NEW = 20  # the next user message: turn two's prompt is 70 tokens, 5 blocks
HISTORY = PROMPT + ANSWER - 1  # tokens whose KV D holds (the last answer token has none)
P_EXTRA: dict[str, Any] = {"kv_recompute_threshold": 16, "ttl_safety_margin": MARGIN}

_n = itertools.count()
_next_block: dict[str, int] = {}


def _blocks(node: Node, n: int) -> list[int]:
    """``n`` blocks of ``node`` no other conversation of this file used (nodes have 64)."""
    first = _next_block.get(node.engine_id, 0)
    assert first + n <= 64, f"{node.engine_id} ran out of blocks"
    _next_block[node.engine_id] = first + n
    return list(range(first, first + n))


def start(*specs: dict[str, Any]) -> list[Node]:
    """Start nodes (``Node`` keyword arguments) in parallel."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(functools.partial(Node, **kw)) for kw in specs]
        nodes, errors = [], []
        for f in futures:
            try:
                nodes.append(f.result())
            except Exception as exc:  # a node that did not start: stop the others
                errors.append(exc)
    if errors:
        for node in nodes:
            node.close()
        raise errors[0]
    return nodes


def p_spec(transport: str, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "engine_id": f"{name}{next(_n)}",
        "role": "kv_both",
        "transport": transport,
        "lease": P_LEASE,
        "extra": {**P_EXTRA, **extra},
    }


def d_spec(transport: str, name: str, ttl: float, skew: float = 0.0) -> dict[str, Any]:
    return {
        "engine_id": f"{name}{next(_n)}",
        "role": "kv_both",
        "transport": transport,
        "lease": D_LEASE,
        "skew": skew,
        "extra": {"_ttl": ttl},
    }


@pytest.fixture(scope="module")
def transport() -> str:
    return "nixl"


@pytest.fixture(scope="module")
def nodes(transport: str) -> Iterator[dict[str, Node]]:
    """Every node of the file, started at once before any test (a start is seconds of CPU,
    mostly importing torch: none runs beside a test's short leases). ``p`` and ``d`` are the
    plain pair; ``d+`` and ``d-`` are Ds whose clocks run 10,000 s ahead of and behind P's;
    ``psym`` and ``pplain`` are the Ps that test_p_killed_while_d_holds_blocks kills."""
    names = ("p", "d", "d+", "d-", "psym", "pplain")
    started = start(
        p_spec(transport, "Pmt"),
        d_spec(transport, "Dmt", TTL),
        d_spec(transport, "Dahead", SHORT_TTL, 10_000.0),
        d_spec(transport, "Dbehind", SHORT_TTL, -10_000.0),
        {**p_spec(transport, "Psym", symmetric_leases=True), "lease": D_LEASE},
        {**p_spec(transport, "Pplain"), "lease": D_LEASE},
    )
    yield dict(zip(names, started, strict=True))
    for node in started:  # killed: a clean shutdown takes a second or more per node
        if node.proc.poll() is None:
            node.kill()
        node.close()


@pytest.fixture
def pd(nodes: dict[str, Node]) -> tuple[Node, Node]:
    return nodes["p"], nodes["d"]


class Conversation:
    """One conversation between P and D: its turn-one request ids, blocks and D's ticket."""

    def __init__(self, p: Node, d: Node) -> None:
        self.p, self.d = p, d
        n = next(_n)
        self.rid_d = f"d1-{n}"  # D's turn-one request: its blocks are the kept ones
        self.rid_q = f"p2-{n}"  # P's turn-two request
        self.d_blocks = _blocks(d, 4)
        self.q_blocks = _blocks(p, 5)
        self.history: dict[str, Any] = {}

    def turn_one(self) -> dict[str, Any]:
        """P prefills, D pulls with keep_for_next_turn and finishes with its answer; returns
        D's history ticket (D holds the blocks under a kept lease when this returns)."""
        p, d = self.p, self.d
        ticket = p.call(
            "prefill", rid=f"p1-{self.rid_d}", blocks=_blocks(p, 3), tokens=PROMPT, seed=next(_n)
        )["params"]
        leg = {**ticket, "keep_for_next_turn": True}
        d.call("arrive", rid=self.rid_d, tokens=PROMPT, params=leg)
        got = d.call(
            "schedule", rid=self.rid_d, tokens=PROMPT, params=leg, blocks=self.d_blocks[:3]
        )
        assert got["external"] == PROMPT - 1
        st = d.wait(lambda s: self.rid_d in s["finished_recving"])
        assert self.rid_d not in st["failures"], st["failures"]
        out = d.call(
            "keep_finish",
            rid=self.rid_d,
            tokens=PROMPT,
            answer=ANSWER,
            params=leg,
            blocks=self.d_blocks,
            fill=self.d_blocks[3:],  # the answer's KV, D's own
            seed=next(_n),
        )
        assert out["keep"] is True, out
        self.history = out["params"]
        assert self.history["remote_engine_id"] == d.engine_id
        assert self.history["remote_num_tokens"] == HISTORY
        assert self.history["remote_block_ids"] == [self.d_blocks]
        deadline = time.monotonic() + 5
        while self.rid_d not in d.call("kept")["leases"]:  # the workers grant it next step
            assert time.monotonic() < deadline, "D never granted the kept lease"
            time.sleep(0.01)
        return self.history

    def kept_until(self, skew: float = 0.0) -> float:
        """When D's kept lease ends by its ttl, as a ``time.monotonic()`` reading."""
        return float(self.history["kept_until"]) - skew

    def arrive(self) -> dict[str, Any]:
        """Turn two reaches P's scheduler (P busy: it waits there). Returns its params."""
        params = {"do_remote_decode": True, "kv_history": self.history}
        self.p.call("arrive", rid=self.rid_q, tokens=PROMPT + ANSWER + NEW, params=params)
        return params

    def turn_two(self) -> None:
        """Turn two arrives at P and gets its blocks: P loads the history from D."""
        params = self.arrive()
        got = self.p.call(
            "schedule",
            rid=self.rid_q,
            tokens=PROMPT + ANSWER + NEW,
            params=params,
            blocks=self.q_blocks,
        )
        assert got["external"] == HISTORY

    def pulled(self) -> dict[str, Any]:
        """P's status once turn two's load ended."""
        return self.p.wait(lambda s: self.rid_q in s["finished_recving"], timeout=15)

    def same_kv(self) -> bool:
        src = self.d.call("digest", blocks=self.d_blocks)["digest"]
        return bool(self.p.call("digest", blocks=self.q_blocks[:4])["digest"] == src)


def posted(node: Node) -> float:
    """The KV transfers ``node``'s transport posted so far (its endpoint flush READs, a few
    bytes into a scratch buffer after notifications, not counted)."""
    st = node.status()
    flushes = float(st["counters"].get("endpoint_flushes", 0))
    return float(st["transport"].get("transfers_posted", 0)) - flushes


def count(st: dict[str, Any], name: str) -> float:
    return float(st["counters"].get(name, 0))


def test_turn_two_pulls_kept_blocks_and_frees_them_at_read(pd: tuple[Node, Node]) -> None:
    p, d = pd
    conv = Conversation(p, d)
    history = conv.turn_one()
    assert history["kept_ttl"] == TTL
    consumed = count(d.status(), "leases_consumed")
    conv.turn_two()
    st = conv.pulled()
    assert conv.rid_q not in st["failures"], st["failures"]
    assert not set(conv.q_blocks) & set(st["invalid"])
    # P has D's KV: the prompt's (pulled from P in turn one) and the answer's (D's own)
    assert conv.same_kv()
    # P's read completion freed D's kept blocks at once, not the ttl
    sd = d.wait(lambda s: conv.rid_d in s["finished_sending"], timeout=5)
    freed = sd["times"][f"sent:{conv.rid_d}"]
    assert abs(freed - st["times"][f"recv:{conv.rid_q}"]) < 1.0
    assert freed < conv.kept_until() - 2.0
    assert count(sd, "leases_consumed") == consumed + 1
    assert conv.rid_d not in d.call("kept")["leases"]


def test_evicted_history_fails_the_pull_and_is_never_read(pd: tuple[Node, Node]) -> None:
    p, d = pd
    conv = Conversation(p, d)
    conv.turn_one()
    assert d.call("reclaim", blocks=1)["given"] == len(conv.d_blocks)
    sd = d.wait(lambda s: conv.rid_d in s["finished_sending"], timeout=5)
    assert sd["times"][f"sent:{conv.rid_d}"] < conv.kept_until() - 2.0  # evicted, not expired
    d.call("poke", blocks=conv.d_blocks, seed=next(_n))  # D's engine reused the blocks
    before, refused, consumed = posted(p), count(sd, "access_refused"), count(sd, "leases_consumed")
    conv.turn_two()  # P does not know yet
    st = conv.pulled()
    assert conv.rid_q in st["failures"], "the pull of evicted blocks must fail (recompute)"
    assert "aborted" in st["failures"][conv.rid_q], st["failures"]  # D's answer: ABORTED
    assert set(conv.q_blocks[:4]) <= set(st["invalid"])
    # P never even tried to read them
    assert posted(p) == before
    sd = d.status()
    assert count(sd, "access_refused") == refused
    assert count(sd, "leases_consumed") == consumed


def refused_at_cap(conv: Conversation, skew: float) -> None:
    """Turn two of ``conv`` after P's cap on D's kept blocks passed: the load fails at once
    by the cap (D's ``kept_until`` mapped onto P's clock, less the safety margin), and P posts
    no READ."""
    p, d = conv.p, conv.d
    before, consumed = posted(p), count(d.status(), "leases_consumed")
    conv.turn_two()
    st = conv.pulled()
    assert conv.rid_q in st["failures"], skew
    why = st["failures"][conv.rid_q]
    cap = re.search(r"kept only until (-?\d+\.\d+) on this clock", why)
    assert cap is not None, why
    assert abs(float(cap[1]) - (conv.kept_until(skew) - MARGIN)) < 0.1, (skew, why)
    assert set(conv.q_blocks[:4]) <= set(st["invalid"])
    assert posted(p) == before, "P read blocks past its cap"
    sd = d.status()
    assert count(sd, "access_refused") == 0
    assert count(sd, "leases_consumed") == consumed, skew


def test_skewed_clocks_pull_and_past_the_cap_never_read(nodes: dict[str, Node]) -> None:
    """D's clock 10,000 s ahead of P's, and behind: turn two pulls; once P's cap passed
    (D still keeps the blocks) or D's ttl did, P recomputes without reading."""
    p = nodes["p"]
    skews = (10_000.0, -10_000.0)
    ds = [nodes["d+"], nodes["d-"]]
    # per D: conversation A is continued at once, B once P's cap passed, C once D's ttl did
    later = []
    for d, skew in zip(ds, skews, strict=True):
        a = Conversation(p, d)
        a.turn_one()
        a.turn_two()
        st = a.pulled()
        assert a.rid_q not in st["failures"], (skew, st["failures"])
        assert a.same_kv(), skew
        sd = d.wait(lambda s, a=a: a.rid_d in s["finished_sending"], timeout=5)
        assert sd["times"][f"sent:{a.rid_d}"] < a.kept_until(skew) - 1.0, skew
        b, c = Conversation(p, d), Conversation(p, d)
        b.turn_one()
        c.turn_one()
        assert c.history["kept_ttl"] == SHORT_TTL
        later.append((b, c))
    for (b, _), skew in zip(later, skews, strict=True):
        # P's cap passed, D's ttl has not: D would still serve a read, P must not try
        time.sleep(max(0.0, b.kept_until(skew) - MARGIN + 0.2 - time.monotonic()))
        assert b.rid_d in b.d.call("kept")["leases"], "D no longer keeps B: the test was late"
        refused_at_cap(b, skew)
    for (_, c), skew in zip(later, skews, strict=True):
        # D frees C at its ttl (nobody claimed it), on D's skewed clock
        sd = c.d.wait(lambda s, c=c: c.rid_d in s["finished_sending"], timeout=SHORT_TTL + 3)
        freed = sd["times"][f"sent:{c.rid_d}"]
        assert c.kept_until(skew) - 0.05 <= freed <= c.kept_until(skew) + 1.0, skew
        assert count(sd, "leases_expired") >= 1
        refused_at_cap(c, skew)
        assert count(c.d.status(), "leases_consumed") == 1, skew  # A's read only


def test_p_killed_while_d_holds_blocks(nodes: dict[str, Node]) -> None:
    """Turn two waits in P's queue; P dies. With symmetric leases P heartbeated D's kept lease
    from arrival, so D frees within one extension of P's last heartbeat; without, P has not
    contacted D yet and D frees at the ttl."""
    d, sym, plain = nodes["d"], nodes["psym"], nodes["pplain"]
    s, n = Conversation(sym, d), Conversation(plain, d)
    s.turn_one()
    n.turn_one()
    s.arrive()
    n.arrive()
    deadline = time.monotonic() + 5
    while d.call("kept")["leases"][s.rid_d]["kept"]:  # the first heartbeat claims it
        assert time.monotonic() < deadline, "the symmetric P never claimed D's lease"
        time.sleep(0.01)
    time.sleep(EXTENSION + 2 * INTERVAL)  # heartbeats keep the claimed lease past its extension
    leases = d.call("kept")["leases"]
    assert leases[s.rid_d]["renewals"] >= 2, leases
    assert leases[s.rid_d]["expiry"] <= EXTENSION + 0.05, leases  # P's, not the ttl
    # the plain P has not contacted D's lease: it still runs on its ttl
    assert leases[n.rid_d]["kept"], leases
    assert leases[n.rid_d]["renewals"] == 0, leases
    assert count(plain.status(), "heartbeats_sent") == 0
    sent = d.status()["finished_sending"]
    assert s.rid_d not in sent
    assert n.rid_d not in sent
    killed_at = sym.kill()
    plain.kill()
    st = d.wait(lambda st: s.rid_d in st["finished_sending"], timeout=5)
    freed = st["times"][f"sent:{s.rid_d}"]
    # the last heartbeat was at most one interval before the kill, its extension then ran
    # out (2 s: a loaded 2-core machine may delay a step by a few hundred milliseconds)
    assert freed - killed_at <= 2.0, freed - killed_at
    assert freed < s.kept_until() - 2.0
    st = d.wait(lambda st: n.rid_d in st["finished_sending"], timeout=TTL + 3)
    freed = st["times"][f"sent:{n.rid_d}"]
    assert n.kept_until() - 0.05 <= freed <= n.kept_until() + 1.0, freed - n.kept_until()
