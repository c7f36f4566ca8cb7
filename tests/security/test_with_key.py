"""With the fleet key on P and D: every attack of issue 16 is refused and counted, and the
victim's output still equals a single-engine run (one test per attack).

P and D are reference-engine processes over NIXL (``--auth-key-file``), the attacker another
process on loopback using only documented interfaces (tests/security/attacker.py). "Counted"
means at least one of P's or D's refusal counters moved (:data:`~tests.security.fleet.REFUSAL`).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.security.attacker import Attacker
from tests.security.fleet import (
    CLIENT,
    LEASE,
    OTHER,
    VICTIM,
    Fleet,
    counters,
    fleet,
    gauges,
    prompt,
    refusals,
    wait_for,
    write_key_file,
)

Expected = dict[tuple[int, ...], list[int]]

#: What the attacker tries: no key, and a guessed one under the fleet's key id.
GUESSES: list[str | None] = [None, f"k1 {secrets.token_hex(32)}\n"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("keyed-fleet")
    with fleet(tmp, write_key_file(tmp / "fleet.key"), "key") as f:
        yield f


def _tokens(body: dict[str, Any]) -> list[int]:
    return list(body["choices"][0]["token_ids"])


def _victim_served(f: Fleet, expected: Expected, tokens: list[int] = CLIENT) -> None:
    code, body = f.routed(tokens)
    assert code == 200, body
    assert _tokens(body) == expected[tuple(tokens)]
    assert body["usage"]["external_tokens"] > 0  # still pulled from P


def _both(f: Fleet) -> dict[str, float]:
    return {**{f"P.{k}": v for k, v in counters(f.p.url).items()},
            **{f"D.{k}": v for k, v in counters(f.d.url).items()}}  # fmt: skip


def _refused_handshakes(
    f: Fleet, attacker: Attacker, who: str = "mallory", agent: str | None = None
) -> None:
    host, port = f.side_channel()
    for key in GUESSES:
        out = attacker.call(
            "handshake", host=host, port=port, engine_id=who, rank=0,
            agent=agent or f"{who}.0", key=key,
        )  # fmt: skip
        assert not out["ok"], f"P accepted a handshake with key {key!r}: {out}"
    assert not attacker.call("read", blocks=[0])["ok"]  # no connection, no rkeys


def test_a_a_handshake_without_the_key_gets_no_memory_and_no_access(
    keyed: Fleet, attacker: Attacker, expected: Expected
) -> None:
    before = _both(keyed)
    _refused_handshakes(keyed, attacker)
    moved = refusals(before, _both(keyed))
    assert moved, "the refused handshakes were not counted"
    _victim_served(keyed, expected)


def test_b_crafted_kv_transfer_params_are_a_400_from_d(keyed: Fleet, expected: Expected) -> None:
    other = keyed.ticket(OTHER)  # another live request on P
    victim = keyed.ticket(VICTIM)
    assert "kvframe_ticket" in victim
    crafted = [
        {**victim, "remote_block_ids": other["remote_block_ids"]},  # altered ticket
        {k: v for k, v in victim.items() if k != "kvframe_ticket"},  # no ticket
        other,  # a valid ticket of another prompt (of the same length)
        {**victim, "tp_size": 10**9},  # out of bounds
    ]
    before = _both(keyed)
    for params in crafted:
        code, body = keyed.complete(keyed.d.url, VICTIM, kv_transfer_params=params)
        assert 400 <= code < 500, (params, body)
        assert "kv_transfer_params" in body["error"]["message"], body
    moved = refusals(before, _both(keyed))
    assert moved, "the refused requests were not counted"
    code, body = keyed.complete(keyed.d.url, VICTIM, kv_transfer_params=victim)
    assert code == 200, body  # the untouched ticket still works
    assert _tokens(body) == expected[tuple(VICTIM)]
    _victim_served(keyed, expected)


def test_c_p_serves_real_requests_during_10000_handshakes_in_10_s(
    keyed: Fleet, attacker: Attacker, expected: Expected
) -> None:
    host, port = keyed.side_channel()
    _victim_served(keyed, expected)  # connected before the flood
    before = _both(keyed)
    answers: list[tuple[int, bool, float]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            code, body = keyed.routed(CLIENT)
            ok = code == 200 and _tokens(body) == expected[tuple(CLIENT)]
            answers.append((code, ok, time.monotonic() - t0))

    t = threading.Thread(target=client)
    t.start()
    try:
        out = attacker.call("flood", host=host, port=port, count=10_000, seconds=10.0)
    finally:
        stop.set()
        t.join(timeout=60)
    served = sum(1 for _, ok, _ in answers if ok)
    print(f"\nflood: {out}; real requests served during it: {served} of {len(answers)}")
    assert out["sent"] == 10_000, out
    assert out["seconds"] < 12, out
    assert "HandshakeAccept" not in out["answered"], out
    assert all(ok for _, ok, _ in answers), answers  # every real request served, correctly
    assert served >= 5, answers
    assert max(s for _, _, s in answers) < 10, answers
    assert refusals(before, _both(keyed)), "the flood was not counted"
    _victim_served(keyed, expected)


def test_d_a_handshake_as_the_real_d_leaves_the_real_d_working(
    keyed: Fleet, attacker: Attacker, expected: Expected
) -> None:
    _victim_served(keyed, expected)
    before = _both(keyed)
    _refused_handshakes(keyed, attacker, keyed.d.engine_id, f"{keyed.d.engine_id}.0")
    assert refusals(before, _both(keyed))
    acks = counters(keyed.d.url).get("connector.acks_received", 0)
    _victim_served(keyed, expected)  # loads still remote, outputs correct
    assert counters(keyed.d.url).get("connector.acks_received", 0) > acks  # heartbeats acked


def test_e_a_lease_the_attacker_saw_expires_on_time(
    keyed: Fleet, attacker: Attacker, expected: Expected
) -> None:
    ids = [keyed.ticket(prompt(f"pinned {i} " * 4))["remote_request_id"] for i in range(2)]
    before = _both(keyed)
    _refused_handshakes(keyed, attacker)
    out = attacker.call("notify", kind="heartbeat", lease_ids=ids)
    assert not out["ok"], out
    assert out["sent"] == 0, out
    assert refusals(before, _both(keyed))
    t0 = time.monotonic()
    assert wait_for(lambda: gauges(keyed.p.url).get("leases_held", 0) == 0, 2 * LEASE)
    assert time.monotonic() - t0 <= 2 * LEASE
    after = counters(keyed.p.url)
    assert after["connector.leases_expired"] - before.get("P.connector.leases_expired", 0) >= 2
    _victim_served(keyed, expected)


def test_f_no_forged_or_guessed_completion_reaches_p(
    keyed: Fleet, attacker: Attacker, expected: Expected
) -> None:
    lease_id = keyed.ticket(prompt("freed early " * 4))["remote_request_id"]
    before = _both(keyed)
    _refused_handshakes(keyed, attacker)
    assert attacker.call("notify", kind="done", lease_ids=[lease_id])["sent"] == 0
    assert attacker.call("notify", kind="done", guesses=20_000)["sent"] == 0
    assert refusals(before, _both(keyed))
    assert gauges(keyed.p.url).get("leases_held", 0) >= 1  # not freed early
    assert counters(keyed.p.url).get("connector.leases_consumed", 0) == before.get(
        "P.connector.leases_consumed", 0
    )
    _victim_served(keyed, expected)
