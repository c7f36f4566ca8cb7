"""PushSource (P's matching of D's registrations with its finished prefills) on explicit clock
readings: both orders, every refusal, keepalives while a registration waits, the tick bounds,
``revoked``, ``peer_gone``, and that no order of calls raises.

``test_push_model.py`` drives it inside the whole push protocol over a lossy network."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.core.lease import lease_handle
from kvframe.core.push import (
    EndSource,
    Keepalive,
    PushAction,
    PushRegister,
    PushSource,
    Refuse,
    RefuseReason,
    StartWrite,
)
from kvframe.errors import ConfigError, LeaseError

WAIT = 6.0
BEAT = 1.0
DIGEST = "0123456789abcdef" * 2
OTHER = "fedcba9876543210" * 2
BLOCKS = ((1, 2, 3, 4),)


def make(**kw: Any) -> PushSource:
    return PushSource(wait_timeout=WAIT, heartbeat_interval=BEAT, **kw)


def reg(
    push_id: str = "p1",
    lease_id: str = "L1",
    *,
    first: int = 0,
    tokens: int = 40,
    digest: str = DIGEST,
    groups: tuple[tuple[int, ...], ...] = ((10, 11, 12, 13),),
) -> PushRegister:
    return PushRegister(
        push_id=push_id,
        lease_id=lease_id,
        first_block=first,
        num_tokens=tokens,
        prompt_digest=digest,
        groups=groups,
    )


def offer(
    src: PushSource,
    now: float,
    request_id: str = "r1",
    push_id: str = "p1",
    *,
    blocks: tuple[tuple[int, ...], ...] = BLOCKS,
    tokens: int = 40,
    digest: str = DIGEST,
) -> list[PushAction]:
    return src.offer(request_id, push_id, blocks, tokens, digest, now)


def refused(lease_id: str, reason: RefuseReason, engine: str = "D") -> Refuse:
    return Refuse(engine=engine, lease_id=lease_id, reason=reason)


def start(
    local: tuple[tuple[int, ...], ...] = BLOCKS,
    remote: tuple[tuple[int, ...], ...] = ((10, 11, 12, 13),),
    *,
    request_id: str = "r1",
    lease_id: str = "L1",
    engine: str = "D",
    first: int = 0,
) -> StartWrite:
    kw: dict[str, Any] = {}
    if "first_block" in attrs.fields_dict(StartWrite):  # progressive push names P's offset
        kw["first_block"] = first
    return StartWrite(
        request_id=request_id,
        engine=engine,
        lease_id=lease_id,
        local_block_ids=local,
        remote_block_ids=remote,
        **kw,
    )


# -- both orders --------------------------------------------------------------------------------
def test_an_offer_then_its_registration_starts_the_write() -> None:
    src = make()
    assert offer(src, 0.0) == []
    assert len(src) == 1
    assert src.next_deadline() == WAIT
    assert src.register("D", reg(), 2.0) == [start()]
    assert len(src) == 0
    assert src.next_deadline() is None
    assert src.take_counts() == {"push_matched": 1}


def test_a_registration_then_its_offer_starts_the_write_after_keepalives() -> None:
    src = make()
    assert src.register("D", reg(), 0.0) == [Keepalive(engine="D", lease_ids=("L1",))]
    assert len(src) == 1
    assert src.next_deadline() == BEAT
    assert src.tick(1.0) == [Keepalive(engine="D", lease_ids=("L1",))]
    assert offer(src, 1.5) == [start()]
    assert len(src) == 0
    assert src.next_deadline() is None
    assert src.tick(100.0) == []


def test_the_write_covers_the_blocks_from_first_block_on_in_every_group() -> None:
    src = make()
    p = ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10))
    d = ((20, 21), (30, 31))
    offer(src, 0.0, blocks=p)
    [w] = src.register("D", reg(first=3, groups=d), 0.0)
    assert w == start(local=((4, 5), (9, 10)), remote=d, first=3)
    # D may register fewer blocks than P has past first_block (it has the rest).
    offer(src, 0.0, "r2", "p2", blocks=p)
    [w] = src.register("D", reg("p2", "L2", first=1, groups=((40,), (50,))), 0.0)
    assert w == start(
        local=((2,), (7,)), remote=((40,), (50,)), request_id="r2", lease_id="L2", first=1
    )


def test_a_registration_of_no_blocks_starts_an_empty_write() -> None:
    src = make()
    offer(src, 0.0)
    [w] = src.register("D", reg(first=4, groups=((),)), 0.0)
    assert w == start(local=((),), remote=((),), first=4)


# -- refusals -----------------------------------------------------------------------------------
def test_a_registration_nobody_offers_for_is_refused_unknown_at_wait_timeout() -> None:
    src = make()
    src.register("D", reg(), 0.0)
    assert refused("L1", RefuseReason.UNKNOWN) not in src.tick(WAIT - 1e-9)
    assert src.tick(WAIT) == [refused("L1", RefuseReason.UNKNOWN)]
    assert len(src) == 0
    assert src.next_deadline() is None
    assert src.take_counts() == {"push_refused": 1}
    # the offer that comes too late is freed: at once, or when it has waited in its turn
    out = offer(src, WAIT + 1) or src.tick(2 * WAIT + 1)
    assert [type(a) for a in out] == [EndSource]
    assert len(src) == 0


def test_an_offer_nobody_registers_for_is_freed_at_wait_timeout_and_refused_after() -> None:
    src = make()
    offer(src, 0.0)
    assert src.tick(WAIT - 1e-9) == []
    [end] = src.tick(WAIT)
    assert isinstance(end, EndSource)
    assert end.request_id == "r1"
    assert "p1" in end.reason
    assert "6 s" in end.reason
    assert src.take_counts() == {"push_unregistered": 1}
    assert src.register("D", reg(), WAIT + 1) == [refused("L1", RefuseReason.GAVE_UP)]


def test_a_registration_for_an_abandoned_push_is_refused_abandoned_before_and_after() -> None:
    src = make()
    assert src.abandon("p1", 0.0) == []
    assert src.register("D", reg(), 1.0) == [refused("L1", RefuseReason.ABANDONED)]
    # after: the registration waits, then P's request ends without KV
    src.register("D", reg("p2", "L2"), 2.0)
    assert src.abandon("p2", 3.0) == [refused("L2", RefuseReason.ABANDONED)]
    assert len(src) == 0
    # and an offer for an abandoned push id is freed at once
    [end] = offer(src, 4.0, "r2", "p2")
    assert isinstance(end, EndSource)
    assert end.request_id == "r2"


def test_an_engine_abort_of_a_waiting_offer_frees_it_and_abandons_its_push_id() -> None:
    src = make()
    offer(src, 0.0)
    [end] = src.abort("r1", 1.0)
    assert end == EndSource(request_id="r1", reason="aborted by the engine")
    assert len(src) == 0
    assert src.abort("r1", 1.0) == []
    assert src.abort("nope", 1.0) == []
    assert src.register("D", reg(), 2.0) == [refused("L1", RefuseReason.ABANDONED)]


@pytest.mark.parametrize("order", ["offer first", "registration first"])
@pytest.mark.parametrize(
    ("offered", "registered"),
    [
        ({"digest": OTHER}, {}),
        ({"tokens": 41}, {}),
        ({}, {"tokens": 39}),
    ],
)
def test_another_prompt_is_refused_and_the_offer_freed(
    order: str, offered: dict[str, Any], registered: dict[str, Any]
) -> None:
    src = make()
    r = reg(**registered)
    if order == "offer first":
        offer(src, 0.0, **offered)
        out = src.register("D", r, 1.0)
    else:
        src.register("D", r, 0.0)
        out = offer(src, 1.0, **offered)
    assert out[0] == refused("L1", RefuseReason.PROMPT)
    assert isinstance(out[1], EndSource)
    assert out[1].request_id == "r1"
    assert len(out) == 2
    assert len(src) == 0
    # the push id is spent: a second registration is refused the same way
    assert src.register("D", reg(lease_id="L9"), 2.0) == [refused("L9", RefuseReason.PROMPT)]


@pytest.mark.parametrize("require", [False, True])
@pytest.mark.parametrize(("p_digest", "d_digest"), [("", DIGEST), (DIGEST, ""), ("", "")])
def test_a_missing_digest_matches_unless_digests_are_required(
    require: bool, p_digest: str, d_digest: str
) -> None:
    src = make(require_digest=require)
    offer(src, 0.0, digest=p_digest)
    out = src.register("D", reg(digest=d_digest), 0.0)
    if require:
        assert out[0] == refused("L1", RefuseReason.PROMPT)
        assert isinstance(out[1], EndSource)
    else:
        assert out == [start()]


@pytest.mark.parametrize("order", ["offer first", "registration first"])
@pytest.mark.parametrize(
    ("first", "groups"),
    [
        (0, ((10, 11, 12, 13, 14),)),  # more blocks than P has
        (2, ((10, 11, 12),)),  # past the end from first_block
        (5, ((),)),  # first_block past the end
        (0, ((10,), (11,))),  # another group count
    ],
)
def test_blocks_that_do_not_fit_are_refused_and_the_offer_freed(
    order: str, first: int, groups: tuple[tuple[int, ...], ...]
) -> None:
    src = make()
    r = reg(first=first, groups=groups)
    if order == "offer first":
        offer(src, 0.0)
        out = src.register("D", r, 1.0)
    else:
        src.register("D", r, 0.0)
        out = offer(src, 1.0)
    assert out[0] == refused("L1", RefuseReason.BLOCKS)
    assert isinstance(out[1], EndSource)
    assert out[1].request_id == "r1"
    assert out[1].reason == RefuseReason.BLOCKS.text()


def test_a_push_id_is_single_use_for_registrations() -> None:
    src = make()
    offer(src, 0.0)
    assert src.register("D", reg(), 0.0) == [start()]
    # another decoder (or the router's retry) registers the same push id
    assert src.register("D2", reg(lease_id="L2"), 1.0) == [
        refused("L2", RefuseReason.DUPLICATE, "D2")
    ]
    # a second registration while the first waits is refused; the first still matches
    src.register("D", reg("p2", "L3"), 2.0)
    assert src.register("D2", reg("p2", "L4"), 2.0) == [refused("L4", RefuseReason.DUPLICATE, "D2")]
    assert offer(src, 3.0, "r2", "p2") == [start(request_id="r2", lease_id="L3")]
    assert src.take_counts() == {"push_matched": 2, "push_refused": 2}


def test_a_push_id_is_single_use_for_offers() -> None:
    src = make()
    offer(src, 0.0)
    [end] = offer(src, 0.5, "r2")
    assert end == EndSource(request_id="r2", reason="push id 'p1' used twice")
    assert src.register("D", reg(), 1.0) == [start()]  # the first offer still matches
    [end] = offer(src, 2.0, "r3")
    assert isinstance(end, EndSource)
    assert end.request_id == "r3"


def test_registrations_past_capacity_are_refused_and_old_push_ids_forgotten() -> None:
    src = make(capacity=2)
    src.register("D", reg("p1", "L1"), 0.0)
    src.register("D", reg("p2", "L2"), 0.0)
    assert src.register("D", reg("p3", "L3"), 0.0) == [refused("L3", RefuseReason.UNKNOWN)]
    assert len(src) == 2
    # remembered ended push ids are capped too: the oldest is forgotten first
    for pid in ("a1", "a2", "a3"):
        src.abandon(pid, 1.0)
    src.abandon("p1", 1.0)
    src.abandon("p2", 1.0)
    assert len(src) == 0
    assert src.register("D", reg("a1", "L5"), 2.0) == [Keepalive(engine="D", lease_ids=("L5",))]
    assert src.register("D", reg("p2", "L6"), 2.0) == [refused("L6", RefuseReason.ABANDONED)]


# -- keepalives ---------------------------------------------------------------------------------
def test_a_waiting_registration_is_heartbeated_every_interval_until_refused() -> None:
    src = make()
    beats: list[float] = []
    src.register("D", reg(), 0.0)
    while (t := src.next_deadline()) is not None:
        for action in src.tick(t):
            if isinstance(action, Keepalive):
                beats.append(t)
            else:
                assert action == refused("L1", RefuseReason.UNKNOWN)
                assert t == WAIT
    assert beats == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_keepalives_are_batched_per_engine_and_late_ticks_do_not_burst() -> None:
    src = make()
    src.register("D", reg("p1", "L1"), 0.0)
    src.register("D", reg("p2", "L2"), 0.2)
    src.register("E", reg("p3", "L3"), 0.4)
    out = src.tick(1.5)
    assert sorted(out, key=lambda a: a.engine) == [  # type: ignore[union-attr]
        Keepalive(engine="D", lease_ids=("L1", "L2")),
        Keepalive(engine="E", lease_ids=("L3",)),
    ]
    assert src.next_deadline() == 2.5  # from the late tick, not from the schedule
    assert src.tick(2.0) == []


# -- revoked and peer_gone ----------------------------------------------------------------------
def test_revoked_drops_the_named_waiting_registrations_of_that_engine_only() -> None:
    src = make()
    src.register("D", reg("p1", "L1"), 0.0)
    src.register("D", reg("p2", "L2"), 0.0)
    src.register("E", reg("p3", "L1"), 0.0)  # the same lease id from another decoder
    handles = [lease_handle("L1"), lease_handle("nope")]
    assert src.revoked("D", handles, 1.0) == ["L1"]
    assert src.revoked("D", handles, 1.0) == []
    assert len(src) == 2
    # the revoked push id is spent: its offer is freed at once
    [end] = offer(src, 2.0, "r1", "p1")
    assert isinstance(end, EndSource)
    assert end.request_id == "r1"
    assert src.register("D", reg("p1", "L7"), 2.0) == [refused("L7", RefuseReason.ABANDONED)]
    assert offer(src, 2.0, "r2", "p2") == [start(request_id="r2", lease_id="L2")]
    assert offer(src, 2.0, "r3", "p3") == [start(request_id="r3", engine="E")]


def test_peer_gone_drops_its_registrations_and_the_offers_wait_for_a_new_one() -> None:
    src = make()
    src.register("D", reg("p1", "L1"), 0.0)
    src.register("E", reg("p2", "L2"), 0.0)
    assert src.peer_gone("D", 1.0) == []
    assert len(src) == 1
    assert [a.engine for a in src.tick(1.0)] == ["E"]  # type: ignore[union-attr]
    assert offer(src, 2.0) == []  # p1 waits again
    assert src.register("D#2", reg("p1", "L9"), 3.0) == [
        start(lease_id="L9", engine="D#2", remote=((10, 11, 12, 13),))
    ]
    assert src.peer_gone("nobody", 3.0) == []


# -- bad orders and bad input -------------------------------------------------------------------
def test_nothing_raises_on_calls_in_a_bad_order() -> None:
    src = make()
    assert src.tick(0.0) == []
    assert src.abandon("never", 0.0) == []
    assert src.abort("never", 0.0) == []
    assert src.revoked("D", [], 0.0) == []
    assert src.revoked("nobody", [lease_handle("L1")], 0.0) == []
    assert src.peer_gone("nobody", 0.0) == []
    assert src.abandon("never", 0.0) == []  # twice
    # an earlier time than before changes nothing and raises nothing
    offer(src, 10.0)
    assert src.tick(5.0) == []
    assert src.register("D", reg(), 3.0) == [start()]


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, "1", None, True])
def test_a_time_that_is_not_finite_seconds_is_refused(now: Any) -> None:
    src = make()
    for call in (
        lambda: src.tick(now),
        lambda: src.register("D", reg(), now),
        lambda: offer(src, now),
        lambda: src.abandon("p1", now),
        lambda: src.abort("r1", now),
        lambda: src.revoked("D", [], now),
        lambda: src.peer_gone("D", now),
    ):
        with pytest.raises(LeaseError, match="finite number of seconds"):
            call()
    assert len(src) == 0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True])
def test_bad_timing_is_refused_naming_the_setting(bad: Any) -> None:
    with pytest.raises(ConfigError, match="wait_timeout"):
        PushSource(wait_timeout=bad, heartbeat_interval=1.0)
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        PushSource(wait_timeout=1.0, heartbeat_interval=bad)


# -- the tick bounds, for any sequence of calls -------------------------------------------------
PIDS = st.sampled_from(["p1", "p2", "p3", "p4"])
ENGINES = st.sampled_from(["D", "E"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), PIDS, st.sampled_from(["fits", "prompt", "blocks"])),
        st.tuples(st.just("register"), PIDS, ENGINES),
        st.tuples(st.just("abandon"), PIDS),
        st.tuples(st.just("abort"), PIDS),
        st.tuples(st.just("revoked"), PIDS, ENGINES),
        st.tuples(st.just("peer_gone"), ENGINES),
        st.tuples(st.just("tick"), st.just("")),
        st.tuples(st.just("wait"), st.floats(0.0, 8.0)),
    ),
    max_size=40,
)


@given(ops=OPS, capacity=st.integers(1, 5))
def test_every_offer_and_registration_ends_once_within_wait_timeout(
    ops: list[tuple[Any, ...]], capacity: int
) -> None:
    """Whatever the order of calls, each offer ends exactly once (freed or written) and no
    later than ``wait_timeout`` after it was made; each registration is answered exactly once
    (a write, a refusal, or dropped by ``revoked``/``peer_gone``) no later than
    ``wait_timeout`` after it arrived, and heartbeated only while it waits; ``next_deadline``
    is never later than any of those bounds, and a tick at it always moves it."""
    src = make(capacity=capacity)
    now = 0.0
    offers: dict[str, tuple[float, int]] = {}  # request id -> (offered at, times ended)
    regs: dict[str, tuple[float, int, str]] = {}  # lease id -> (arrived, answers, engine)
    waiting: set[str] = set()  # lease ids waiting (the model)
    pid_of: dict[str, str] = {}  # request id -> push id
    n = 0

    def apply(actions: list[PushAction]) -> None:
        for a in actions:
            if isinstance(a, StartWrite | EndSource):
                at, ends = offers[a.request_id]
                assert ends == 0, f"offer {a.request_id} ended twice"
                assert now <= at + WAIT, f"offer {a.request_id} ended late"
                offers[a.request_id] = (at, 1)
            if isinstance(a, StartWrite | Refuse):
                answer(a.lease_id)
            if isinstance(a, Keepalive):
                for lid in a.lease_ids:
                    assert lid in waiting, f"keepalive for {lid}, which does not wait"

    def answer(lid: str) -> None:
        at, answers, engine = regs[lid]
        assert answers == 0, f"registration {lid} answered twice"
        assert now <= at + WAIT, f"registration {lid} answered late"
        regs[lid] = (at, 1, engine)
        waiting.discard(lid)

    def check_deadline() -> None:
        d = src.next_deadline()
        open_bounds = [at + WAIT for at, ends in offers.values() if not ends]
        open_bounds += [at + WAIT for at, answers, _ in regs.values() if not answers]
        assert (d is None) == (not open_bounds)
        if d is not None:
            assert d <= min(open_bounds)
        assert len(src) == len(open_bounds)

    for op in ops:
        kind = op[0]
        if kind == "offer":
            n += 1
            rid = f"r{n}"
            offers[rid] = (now, 0)
            pid_of[rid] = op[1]
            blocks = ((1, 2),) if op[2] != "blocks" else ((1,),)
            tokens = 40 if op[2] != "prompt" else 41
            apply(src.offer(rid, op[1], blocks, tokens, DIGEST, now))
        elif kind == "register":
            n += 1
            lid = f"L{n}"
            regs[lid] = (now, 0, op[2])
            out = src.register(op[2], reg(op[1], lid, groups=((7, 8),)), now)
            if any(isinstance(a, Keepalive) for a in out):
                waiting.add(lid)
            apply(out)
        elif kind == "abandon":
            apply(src.abandon(op[1], now))
        elif kind == "abort":
            rids = [r for r, p in pid_of.items() if p == op[1]]
            apply(src.abort(rids[-1] if rids else "none", now))
        elif kind == "revoked":
            handles = [lease_handle(lid) for lid, r in regs.items() if r[2] == op[2]]
            for lid in src.revoked(op[2], handles[-2:], now):
                answer(lid)
        elif kind == "peer_gone":
            assert src.peer_gone(op[1], now) == []
            for lid in [lid for lid in waiting if regs[lid][2] == op[1]]:
                answer(lid)
        elif kind == "tick":
            apply(src.tick(now))
        else:
            # time passes; the caller wakes it at every deadline on the way
            target = now + op[1]
            while (d := src.next_deadline()) is not None and d <= target:
                now = max(now, d)
                apply(src.tick(now))
                d2 = src.next_deadline()
                assert d2 is None or d2 > now, "a tick at next_deadline left it due"
            now = target
        check_deadline()
    while (d := src.next_deadline()) is not None:
        now = max(now, d)
        apply(src.tick(now))
    assert all(ends == 1 for _, ends in offers.values())
    assert all(answers == 1 for _, answers, _ in regs.values())
    assert len(src) == 0
