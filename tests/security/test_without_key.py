"""Without a fleet key: what each attack gets, as docs/security.md says (one test per attack).

P and D are reference-engine processes over NIXL, the attacker another process on loopback.
These are the documented exposures of an unauthenticated fleet: each assertion is a claim of
the docs that would fail if kvframe refused the attack without a key.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.security.attacker import Attacker
from tests.security.fleet import (
    CLIENT,
    LEASE,
    OTHER,
    POISONED,
    VICTIM,
    Fleet,
    counters,
    fleet,
    gauges,
    prompt,
    reference,
    wait_for,
)

Expected = dict[tuple[int, ...], list[int]]


@pytest.fixture(scope="module")
def open_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(tmp_path_factory.mktemp("open-fleet"), None, "open") as f:
        yield f


def _tokens(body: dict[str, Any]) -> list[int]:
    return list(body["choices"][0]["token_ids"])


def _connect(f: Fleet, attacker: Attacker, who: str = "mallory") -> dict[str, Any]:
    host, port = f.side_channel()
    return attacker.call(
        "handshake", host=host, port=port, engine_id=who, rank=0, agent=f"{who}.0", key=None
    )


def test_a_anyone_can_handshake_and_read_and_write_p_kv(
    open_fleet: Fleet, attacker: Attacker, expected: Expected
) -> None:
    params = open_fleet.ticket(POISONED)  # a victim's prompt, prefilled on P, waiting for D
    out = _connect(open_fleet, attacker)
    assert out["ok"], out
    assert out["regions"]
    assert out["num_blocks"] > 0
    blocks = params["remote_block_ids"][0]
    read = attacker.call("read", blocks=blocks)
    assert read["ok"], read
    assert read["nonzero"] > 0  # the victim's KV, read by the attacker
    assert attacker.call("write", blocks=blocks)["ok"]
    assert attacker.call("read", blocks=blocks)["digest"] != read["digest"]  # overwritten
    code, body = open_fleet.complete(open_fleet.d.url, POISONED, kv_transfer_params=params)
    assert code == 200, body
    assert body["usage"]["external_tokens"] > 0  # D loaded the KV the attacker wrote
    assert _tokens(body) != expected[tuple(POISONED)]  # wrong tokens, HTTP 200
    # P's prefix cache keeps the overwritten blocks: the next client of that prompt too.
    code, body = open_fleet.routed(POISONED)
    assert code == 200, body
    assert _tokens(body) != expected[tuple(POISONED)]


def test_b_crafted_kv_transfer_params_make_d_answer_with_another_requests_kv(
    open_fleet: Fleet, expected: Expected
) -> None:
    other = open_fleet.ticket(OTHER)  # another live request on P
    victim = open_fleet.ticket(VICTIM)
    crafted = {**victim, "remote_block_ids": other["remote_block_ids"]}
    code, body = open_fleet.complete(open_fleet.d.url, VICTIM, kv_transfer_params=crafted)
    assert code == 200, body
    assert body["usage"]["external_tokens"] > 0
    assert _tokens(body) != expected[tuple(VICTIM)]  # OTHER's KV under VICTIM's prompt
    # D's prefix cache keeps it: every later client of that prompt gets the wrong tokens.
    code, body = open_fleet.routed(VICTIM)
    assert code == 200, body
    assert _tokens(body) != expected[tuple(VICTIM)]


def test_c_every_handshake_is_answered_with_p_metadata(
    open_fleet: Fleet, attacker: Attacker, expected: Expected
) -> None:
    host, port = open_fleet.side_channel()
    out = attacker.call("flood", host=host, port=port, count=200, seconds=1.0)
    assert out["answered"].get("HandshakeAccept", 0) == 200, out  # no authentication
    code, body = open_fleet.routed(CLIENT)  # a small flood: P still serves
    assert code == 200, body
    assert _tokens(body) == expected[tuple(CLIENT)]


def test_e_a_heartbeat_from_anyone_pins_a_lease_past_its_duration(
    open_fleet: Fleet, attacker: Attacker
) -> None:
    ids = [open_fleet.ticket(prompt(f"pinned {i} " * 4))["remote_request_id"] for i in range(2)]
    assert _connect(open_fleet, attacker)["ok"]
    attacker.call("drain")
    t0 = time.monotonic()
    out = attacker.call("notify", kind="heartbeat", lease_ids=ids, seconds=LEASE + 1.5,
                        interval=0.4)  # fmt: skip
    assert out["ok"], out
    assert time.monotonic() - t0 > LEASE + 1
    assert gauges(open_fleet.p.url).get("leases_held", 0) >= 2  # still held, past their lease
    acks = [n for n in attacker.call("drain")["notes"] if n["type"] == "LeaseAck"]
    assert acks  # P confirmed them to the attacker


def test_f_a_forged_done_ends_an_unclaimed_lease_and_guesses_name_nothing(
    open_fleet: Fleet, attacker: Attacker
) -> None:
    assert _connect(open_fleet, attacker)["ok"]
    assert wait_for(lambda: gauges(open_fleet.p.url).get("leases_held", 0) == 0, 3 * LEASE)
    # P rebuilt its side of the attacker's connection (a repeated handshake) in a step after
    # the handshake; notices sent before that may be lost with the old connection.
    time.sleep(0.5)
    lease_id = open_fleet.ticket(prompt("freed early " * 4))["remote_request_id"]
    before = counters(open_fleet.p.url)
    assert attacker.call("notify", kind="done", guesses=20_000)["sent"] >= 19_990

    def unknown() -> float:
        got = counters(open_fleet.p.url).get("connector.done_for_unknown_lease", 0)
        return got - before.get("connector.done_for_unknown_lease", 0)

    # every guess is counted as naming no lease (the engine reports its stats every step)
    assert wait_for(lambda: unknown() >= 19_990, 10.0), counters(open_fleet.p.url)
    assert gauges(open_fleet.p.url).get("leases_held", 0) == 1  # 20,000 guesses freed nothing
    mid = counters(open_fleet.p.url)
    t0 = time.monotonic()
    attacker.call("notify", kind="done", lease_ids=[lease_id])
    assert wait_for(lambda: gauges(open_fleet.p.url).get("leases_held", 0) == 0, 1.0)
    assert time.monotonic() - t0 < LEASE  # ended by the forged done, not by its expiry
    after = counters(open_fleet.p.url)
    assert after["connector.leases_consumed"] == mid.get("connector.leases_consumed", 0) + 1


def test_d_a_handshake_as_the_real_d_steals_its_acks(
    open_fleet: Fleet, attacker: Attacker, expected: Expected
) -> None:
    # Last in this module: it breaks the real D's connection to P.
    code, body = open_fleet.routed(OTHER)
    assert code == 200, body
    assert body["usage"]["external_tokens"] > 0, body  # D works before
    assert _connect(open_fleet, attacker, open_fleet.d.engine_id)["ok"]
    attacker.call("drain")
    before = counters(open_fleet.d.url)
    asked = prompt("the real D's next request")
    code, body = open_fleet.routed(asked)
    assert code == 200, body
    # P's acknowledgements of the real D's heartbeats now go to the attacker, but the real D
    # proves its lease from P's lease table instead (a one-sided READ P's connection to the
    # attacker does not touch): its load is still remote, and its output right.
    assert body["usage"]["external_tokens"] > 0, body
    assert _tokens(body) == reference([asked])[0]
    notes: list[dict[str, Any]] = []

    def acked() -> bool:
        notes.extend(attacker.call("drain")["notes"])
        return any(n["type"] == "LeaseAck" for n in notes)

    assert wait_for(acked, 5.0), notes  # D's acks came to the attacker
    after = counters(open_fleet.d.url)
    assert after.get("connector.acks_received", 0) == before.get("connector.acks_received", 0)
    proven = after.get("connector.reads_proven_by_table", 0)
    assert proven > before.get("connector.reads_proven_by_table", 0)
