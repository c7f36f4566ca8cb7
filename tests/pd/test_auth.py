"""Issue 16: the fleet key, signed tickets, the authenticated side channel, tagged notifications
and the handshake server's bounds (unit level and P/D in one process)."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kvframe.connectors.pd.auth import TAG_BYTES, TICKET_FIELD, KeyRing, tag, untag
from kvframe.connectors.pd.handshake import (
    MAX_PENDING,
    AuthHello,
    HandshakeRequest,
    HandshakeResponse,
    HandshakeServer,
    RateLimiter,
    decode_frame,
    encode_frame,
    handshake,
)
from kvframe.connectors.pd.params import RemotePrefillParams
from kvframe.core import wire
from kvframe.core.lease import lease_handle
from kvframe.errors import ConfigError, HandshakeError
from kvframe.spi.transport import BlockLayout, MemoryRegion
from tests.pd.driver import Driver, run_until, view

CHASH = bytes(16)
KEY_A = "a" * 64
KEY_B = "b" * 64


def _key_file(tmp_path: Path, text: str, name: str = "fleet.key") -> str:
    path = tmp_path / name
    path.write_text(text)
    os.chmod(path, 0o600)
    return str(path)


# -- the key file --------------------------------------------------------------------------
def test_key_file_round_trip_and_repr_hides_secrets(tmp_path: Path) -> None:
    path = tmp_path / "k"
    KeyRing.generate_file(path, "first")
    assert (path.stat().st_mode & 0o777) == 0o600
    ring = KeyRing.from_file(path)
    assert ring.signing_id == "first"
    secret = ring.key("first")
    assert secret is not None
    assert len(secret) == 32
    assert secret.hex() not in repr(ring)
    with pytest.raises(FileExistsError):
        KeyRing.generate_file(path)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "holds no key"),
        ("# only a comment\n", "holds no key"),
        ("k1\n", "two fields"),
        ("k1 " + "zz" * 32, "not hex"),
        ("k1 " + "ab" * 16, "at least 32 are needed"),
        ("bad/id " + KEY_A, "1-16 characters"),
        (f"k1 {KEY_A}\nk1 {KEY_B}\n", "distinct"),
    ],
)
def test_bad_key_files_name_the_line(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        KeyRing.from_file(_key_file(tmp_path, text))
    assert KEY_B not in str(info.value)
    assert KEY_A not in str(info.value)


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = _key_file(tmp_path, f"k1 {KEY_A}\n")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        KeyRing.from_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        KeyRing.from_file(tmp_path / "missing")


# -- tickets -------------------------------------------------------------------------------
def _params(**kw: Any) -> RemotePrefillParams:
    base: dict[str, Any] = {
        "remote_engine_id": "P",
        "remote_request_id": "0" * 32,
        "remote_host": "127.0.0.1",
        "remote_port": 5555,
        "remote_block_ids": ((1, 2, 3),),
        "remote_num_tokens": 40,
        "tp_size": 1,
        "transport": "nixl",
        "lease_duration": 30.0,
        "lease_expires_at": 1234.5678,
    }
    base.update(kw)
    return RemotePrefillParams(**base)


def test_a_ticket_survives_a_router_that_reserialises_the_json() -> None:
    ring = KeyRing.parse(f"k1 {KEY_A}")
    sent = _params().signed(ring).to_dict()
    # another key order, 30 for 30.0, other spacing: the same fields
    text = json.dumps(dict(reversed(list(sent.items()))), indent=2).replace("30.0", "30")
    got = RemotePrefillParams.from_dict(json.loads(text))
    got.verify(ring)


@pytest.mark.parametrize(
    "change",
    [
        {"remote_block_ids": [[1, 2, 4]]},
        {"remote_request_id": "1" * 32},
        {"remote_num_tokens": 41},
        {"remote_host": "10.0.0.1"},
        {"lease_expires_at": 1234.5679},
    ],
)
def test_an_altered_ticket_is_refused(change: dict[str, Any]) -> None:
    ring = KeyRing.parse(f"k1 {KEY_A}")
    sent = {**_params().signed(ring).to_dict(), **change}
    with pytest.raises(ConfigError, match="does not match its fields"):
        RemotePrefillParams.from_dict(sent).verify(ring)


def test_tickets_of_another_fleet_or_none_are_refused_and_rotation_works() -> None:
    old = KeyRing.parse(f"k1 {KEY_A}")
    new_first = KeyRing.parse(f"k2 {KEY_B}\nk1 {KEY_A}")
    other = KeyRing.parse(f"k1 {KEY_B}")
    ticket = RemotePrefillParams.from_dict(_params().signed(old).to_dict())
    ticket.verify(new_first)  # rotation: the old key still verifies
    with pytest.raises(ConfigError, match="does not match"):
        ticket.verify(other)
    with pytest.raises(ConfigError, match="which this engine does not hold"):
        RemotePrefillParams.from_dict(_params().signed(new_first).to_dict()).verify(old)
    with pytest.raises(ConfigError, match="is missing"):
        RemotePrefillParams.from_dict(_params().to_dict()).verify(old)
    for bad in ("nocolon", "k1:!!!", "k1:a:b", 7, "k1:" + "A" * 200):
        with pytest.raises(ConfigError, match=TICKET_FIELD):
            RemotePrefillParams.from_dict({**_params().to_dict(), TICKET_FIELD: bad}).verify(old)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"tp_size": 10**9}, "tp_size"),
        ({"remote_block_ids": [[1]] * 1000}, "KV groups"),
        ({"remote_block_ids": [list(range(200_000))]}, "block ids"),
        ({"remote_num_tokens": 1 << 40}, "remote_num_tokens"),
        ({"remote_engine_id": "x" * 300}, "remote_engine_id"),
        ({"remote_ports": [1] * 5000}, "remote_ports"),
    ],
)
def test_fields_out_of_bounds_are_refused_before_use(change: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        RemotePrefillParams.from_dict({**_params().to_dict(), **change})


# -- tags ----------------------------------------------------------------------------------
@given(st.binary(min_size=1, max_size=200), st.integers(0, 8 * 200 + 63))
def test_tags_verify_and_any_flipped_bit_is_caught(payload: bytes, bit: int) -> None:
    key = b"k" * 32
    sealed = tag(key, payload)
    assert len(sealed) == len(payload) + TAG_BYTES
    assert untag(key, sealed) == payload
    i = bit % (8 * len(sealed))
    flipped = bytearray(sealed)
    flipped[i // 8] ^= 1 << (i % 8)
    assert untag(key, bytes(flipped)) is None
    assert untag(b"j" * 32, sealed) is None
    assert untag(key, sealed[:TAG_BYTES]) is None


# -- the rate limiter ----------------------------------------------------------------------
@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.sampled_from("ab"), st.floats(0, 0.5)), min_size=1, max_size=300),
    st.floats(1, 100),
    st.integers(1, 20),
)
def test_a_source_never_gets_more_than_burst_plus_rate_times_time(
    events: list[tuple[str, float]], rate: float, burst: int
) -> None:
    limiter = RateLimiter(rate=rate, burst=burst)
    now = 0.0
    allowed = {"a": 0, "b": 0}
    for source, dt in events:
        now += dt
        allowed[source] += limiter.allow(source, now)
    for n in allowed.values():
        assert n <= burst + rate * now + 1e-9


def test_the_limiter_forgets_the_least_recent_source_first() -> None:
    limiter = RateLimiter(rate=1, burst=1, max_sources=2)
    assert limiter.allow("a", 0)
    assert limiter.allow("b", 0)
    assert not limiter.allow("a", 0)
    assert limiter.allow("c", 0)  # forgets b
    assert limiter.allow("b", 0)  # a fresh bucket again


# -- the authenticated side channel --------------------------------------------------------
LAYOUT = BlockLayout(
    regions=(MemoryRegion(addr=4096, length=1 << 16),), block_lens=(1024,), num_blocks=64
)
REQ = HandshakeRequest(engine_id="D", rank=0, transport="inprocess", transport_metadata=b"meta-D")


class _Responder:
    def __init__(self) -> None:
        self.sessions: list[bytes | None] = []

    def __call__(self, req: HandshakeRequest, session: bytes | None) -> HandshakeResponse:
        self.sessions.append(session)
        return HandshakeResponse(
            engine_id="P",
            rank=0,
            tp_size=1,
            transport="inprocess",
            transport_metadata=b"meta-P",
            layout=LAYOUT,
            kv_lease_duration=30.0,
        )


@pytest.fixture
def keyed() -> Any:
    responder = _Responder()
    srv = HandshakeServer(
        "127.0.0.1",
        0,
        chash=CHASH,
        respond=responder,
        engine_id="P",
        keys=KeyRing.parse(f"k1 {KEY_A}"),
    )
    yield srv, responder
    srv.close()


def test_an_authenticated_handshake_gives_both_sides_one_session_key(keyed: Any) -> None:
    srv, responder = keyed
    result = handshake(
        "127.0.0.1",
        srv.port,
        REQ,
        chash=CHASH,
        keys=KeyRing.parse(f"k1 {KEY_A}"),
        expect_engine="P",
    )
    assert result.response.transport_metadata == b"meta-P"
    assert result.session_key is not None
    assert responder.sessions == [result.session_key]
    assert len(result.samples) == 3  # the challenge is a clock sample too
    again = handshake("127.0.0.1", srv.port, REQ, chash=CHASH, keys=KeyRing.parse(f"k1 {KEY_A}"))
    assert again.session_key != result.session_key  # fresh nonces, a fresh key


def test_no_key_or_another_key_learns_nothing(keyed: Any) -> None:
    srv, responder = keyed
    with pytest.raises(HandshakeError, match="requires an authenticated handshake"):
        handshake("127.0.0.1", srv.port, REQ, chash=CHASH)
    with pytest.raises(HandshakeError, match="failed to prove it holds the fleet key"):
        handshake("127.0.0.1", srv.port, REQ, chash=CHASH, keys=KeyRing.parse(f"k1 {KEY_B}"))
    with pytest.raises(HandshakeError, match="not an engine of this fleet"):
        # P cannot tell; D holds another key id: P's proof cannot be checked
        handshake("127.0.0.1", srv.port, REQ, chash=CHASH, keys=KeyRing.parse(f"k9 {KEY_A}"))
    assert responder.sessions == []  # P revealed nothing
    assert srv.rejected >= 1


def test_d_refuses_a_p_that_is_not_the_ticket_s_engine(keyed: Any) -> None:
    srv, _ = keyed
    with pytest.raises(HandshakeError, match="not 'Q' named in the ticket"):
        handshake(
            "127.0.0.1",
            srv.port,
            REQ,
            chash=CHASH,
            keys=KeyRing.parse(f"k1 {KEY_A}"),
            expect_engine="Q",
        )


def test_a_keyless_p_refuses_an_authenticating_d() -> None:
    srv = HandshakeServer("127.0.0.1", 0, chash=CHASH, respond=_Responder())
    try:
        with pytest.raises(HandshakeError, match="has no fleet key"):
            handshake("127.0.0.1", srv.port, REQ, chash=CHASH, keys=KeyRing.parse(f"k1 {KEY_A}"))
    finally:
        srv.close()


def test_a_request_must_follow_its_own_challenge(keyed: Any) -> None:
    srv, responder = keyed
    hello = AuthHello(engine_id="D", rank=0, nonce=b"n" * 16)
    decode_frame(srv._answer(b"conn-1", encode_frame(hello, CHASH)), CHASH)
    # the proof is checked against the challenge sent on *this* connection
    forged = HandshakeRequest(
        engine_id="D", rank=0, transport="inprocess", transport_metadata=b"x", proof=b"p" * 32
    )
    for ident in (b"conn-2", b"conn-1"):
        answer = decode_frame(srv._answer(ident, encode_frame(forged, CHASH)), CHASH)
        assert type(answer).__name__ == "HandshakeRefusal"
    assert responder.sessions == []


def test_pending_challenges_are_bounded(keyed: Any) -> None:
    srv, _ = keyed
    hello = encode_frame(AuthHello(engine_id="D", rank=0, nonce=b"n" * 16), CHASH)
    for i in range(MAX_PENDING + 50):
        srv._answer(i.to_bytes(4, "big"), hello)
    assert len(srv._pending) == MAX_PENDING


def test_a_flood_from_one_address_is_dropped_past_its_rate() -> None:
    srv = HandshakeServer(
        "127.0.0.1",
        0,
        chash=CHASH,
        respond=_Responder(),
        engine_id="P",
        keys=KeyRing.parse(f"k1 {KEY_A}"),
        rate=1.0,
        burst=3.0,
    )
    try:
        ok = 0
        for _ in range(6):
            try:
                handshake(
                    "127.0.0.1",
                    srv.port,
                    REQ,
                    chash=CHASH,
                    keys=KeyRing.parse(f"k1 {KEY_A}"),
                    timeout=0.3,
                    samples=1,
                )
                ok += 1
            except HandshakeError:
                pass
        assert ok <= 2  # each handshake is two messages: burst 3 allows one, maybe two
        assert srv.rate_limited >= 4
    finally:
        srv.close()


# -- P/D in one process --------------------------------------------------------------------
_ids = itertools.count()


def _pair(tmp_path: Path, p_key: str | None, d_key: str | None) -> tuple[Driver, Driver]:
    n = next(_ids)

    def extra(key: str | None, name: str) -> dict[str, Any]:
        return {} if key is None else {"auth_key_file": _key_file(tmp_path, f"k1 {key}\n", name)}

    return (
        Driver(f"P{n}", "kv_producer", extra=extra(p_key, f"p{n}")),
        Driver(f"D{n}", "kv_consumer", extra=extra(d_key, f"d{n}")),
    )


def _prefill(p: Driver, rid: str, blocks: list[int], tokens: int) -> dict[str, Any]:
    p.fill(blocks, seed=7)
    delay, params = p.sched.request_finished(
        view(rid, tokens, {"do_remote_decode": True}, finish_reason="length"), (tuple(blocks),)
    )
    assert delay is True
    assert params is not None
    return params


def test_keyed_p_and_d_move_the_kv_with_tagged_notifications(tmp_path: Path) -> None:
    p, d = _pair(tmp_path, KEY_A, KEY_A)
    try:
        params = _prefill(p, "r1", [3, 4, 5, 6], tokens=60)
        assert params[TICKET_FIELD].startswith("k1:")
        p.step()
        req = view("d1", 60, params)
        d.sched.check_request(req)
        d.sched.on_new_request(req)
        n, _ = d.sched.get_num_new_matched_tokens(req, 0)
        assert n == 59
        d.sched.update_state_after_alloc(req, ((10, 11, 12, 13),), n)
        run_until([p, d], lambda: any("d1" in o.finished_recving for o in d.outputs))
        for a, b in zip(p.blocks([3, 4, 5, 6]), d.blocks([10, 11, 12, 13]), strict=True):
            assert torch.equal(a, b)
        run_until([p, d], lambda: any("r1" in o.finished_sending for o in p.outputs))
        # A forged, untagged heartbeat of a live lease from the real D's peer name is dropped.
        params2 = _prefill(p, "r2", [7, 8], tokens=20)
        p.step()
        lease = RemotePrefillParams.from_dict(params2)
        hb = wire.encode(
            wire.Heartbeat(seq=1, sent_at=0.0, handles=(lease_handle(lease.remote_request_id),))
        )
        sender = next(iter(p.worker._readers))
        p.worker._on_notification(sender, hb, time.monotonic())
        p.worker._on_notification(sender, hb + b"\0" * TAG_BYTES, time.monotonic())
        assert p.worker._counters.get("notifications_unauthenticated") == 2
    finally:
        d.shutdown()
        p.shutdown()


def test_a_forged_ticket_is_refused_at_admission_and_prefilled_locally(tmp_path: Path) -> None:
    p, d = _pair(tmp_path, KEY_A, KEY_A)
    try:
        params = _prefill(p, "r1", [3, 4, 5, 6], tokens=60)
        forged = {**params, "remote_block_ids": [[0, 1, 2, 3]]}  # another request's blocks
        req = view("d1", 60, forged)
        with pytest.raises(ConfigError, match="does not match its fields"):
            d.sched.check_request(req)
        d.sched.on_new_request(req)
        assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        unsigned = {k: v for k, v in params.items() if k != TICKET_FIELD}
        with pytest.raises(ConfigError, match="is missing"):
            d.sched.check_request(view("d2", 60, unsigned))
    finally:
        d.shutdown()
        p.shutdown()


def test_p_and_d_with_different_keys_never_connect(tmp_path: Path) -> None:
    p, d = _pair(tmp_path, KEY_A, KEY_B)
    try:
        params = _prefill(p, "r1", [3, 4], tokens=20)
        req = view("d1", 20, params)
        with pytest.raises(ConfigError, match="does not match"):
            d.sched.check_request(req)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_valid_ticket_of_another_prompt_is_refused(tmp_path: Path) -> None:
    # Attack b with a real ticket: issued for prompt OTHER, sent with prompt VICTIM of the
    # same length. Loading it would put OTHER's KV under VICTIM's block hashes on D.
    for keys in ((KEY_A, KEY_A), (None, None)):
        p, d = _pair(tmp_path, *keys)
        try:
            params = _prefill(p, "r1", [3, 4, 5, 6], tokens=60)
            assert params["remote_prompt_digest"]
            assert d.sched.check_request(view("d1", 60, params)) is None
            victim = view("d2", 60, params, prompt_token_ids=[7] * 60)
            with pytest.raises(ConfigError, match="names another prompt"):
                d.sched.check_request(victim)
            d.sched.on_new_request(victim)
            assert d.sched.get_num_new_matched_tokens(victim, 0) == (0, False)
        finally:
            d.shutdown()
            p.shutdown()


def test_a_keyed_d_needs_the_prompt_bound(tmp_path: Path) -> None:
    p, d = _pair(tmp_path, KEY_A, KEY_A)
    try:
        # P's engine gave no token ids: its ticket names no prompt, which a keyed D refuses
        _, params = p.sched.request_finished(
            view("r1", 20, {"do_remote_decode": True}, finish_reason="length", prompt_token_ids=()),
            ((3, 4),),
        )
        assert params is not None
        assert "remote_prompt_digest" not in params
        with pytest.raises(ConfigError, match="remote_prompt_digest is missing"):
            d.sched.check_request(view("d1", 20, params))
        good = _prefill(p, "r2", [5, 6], tokens=20)
        with pytest.raises(ConfigError, match="gives its connector no prompt token ids"):
            d.sched.check_request(view("d2", 20, good, prompt_token_ids=()))
    finally:
        d.shutdown()
        p.shutdown()
