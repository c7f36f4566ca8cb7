"""Bidirectional (multi-turn) mode end to end in one process over the in-process transport:
D keeps a finished turn's KV under a kept lease, P pulls it on the next turn, and every way
the kept blocks can go away (ttl, eviction, P gone, another prompt) ends in a recompute,
never in a read of blocks D dropped."""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import pytest
import torch

from tests.pd.driver import Driver, run_until, view

_ids = itertools.count()
PROMPT = 40  # turn 1's prompt
ANSWER = 10  # D generates this many tokens in turn 1
NEW = 20  # the user's next message
TTL = 6.0


def make(skew: float = 0.0, ttl: float = TTL, **p_extra: Any) -> tuple[Driver, Driver]:
    n = next(_ids)
    extra = {"kv_recompute_threshold": 16, **p_extra}
    p = Driver(f"P{n}", "kv_both", lease=3.0, ttl=ttl, extra=extra)

    def d_clock() -> float:
        return time.monotonic() + skew

    d = Driver(f"D{n}", "kv_both", lease=3.0, ttl=ttl, clock=d_clock)
    return p, d


@pytest.fixture
def pd() -> Any:
    p, d = make()
    yield p, d
    d.shutdown()
    p.shutdown()


def counter(drv: Driver, name: str) -> float:
    return sum(o.stats.counters.get(name, 0) for o in drv.outputs)


def ended(drv: Driver, rid: str, field: str) -> bool:
    return any(rid in getattr(o, field) for o in drv.outputs)


def turn_one(p: Driver, d: Driver, tag: str) -> tuple[dict[str, Any], list[int]]:
    """P prefills ``PROMPT`` tokens, D pulls them, decodes ``ANSWER`` tokens and keeps the
    conversation. Returns D's history params and D's blocks."""
    p_blocks = [0, 1, 2]
    p.fill(p_blocks, seed=1)
    _, ticket = p.sched.request_finished(
        view(f"p1{tag}", PROMPT, {"do_remote_decode": True}, finish_reason="stop"),
        (tuple(p_blocks),),
    )
    assert ticket is not None
    d_leg = {**ticket, "keep_for_next_turn": True}
    req = view(f"d1{tag}", PROMPT, d_leg)
    d.sched.on_new_request(req)
    k, _ = d.sched.get_num_new_matched_tokens(req, 0)
    assert k == PROMPT - 1
    d_blocks = [5, 6, 7, 8]  # 50 tokens: the answer's KV goes into the last block
    d.sched.update_state_after_alloc(req, (tuple(d_blocks[:3]),), k)
    run_until([p, d], lambda: ended(d, f"d1{tag}", "finished_recving"))
    d.fill([8], seed=2)  # the answer's KV, computed by D
    tokens = list(range(PROMPT + ANSWER))
    keep, history = d.sched.request_finished(
        view(
            f"d1{tag}",
            PROMPT,
            d_leg,
            finish_reason="stop",
            output_token_ids=tokens[PROMPT:],
        ),
        (tuple(d_blocks),),
    )
    assert keep is True
    assert history is not None
    d.step()  # the workers grant the kept lease
    assert d.worker.holder.kept_count == 1
    return history, d_blocks


def next_turn(history: dict[str, Any], tag: str, prompt: list[int] | None = None) -> Any:
    """P's view of the conversation's next turn (the whole conversation as its prompt)."""
    tokens = prompt if prompt is not None else list(range(PROMPT + ANSWER + NEW))
    return view(
        f"p2{tag}",
        len(tokens),
        {"do_remote_decode": True, "kv_history": history},
        prompt_token_ids=tokens,
    )


def turn_two(
    p: Driver, history: dict[str, Any], tag: str, prompt: list[int] | None = None
) -> tuple[Any, int | None]:
    req = next_turn(history, tag, prompt)
    p.sched.on_new_request(req)
    k, _ = p.sched.get_num_new_matched_tokens(req, 0)
    if k:
        p.sched.update_state_after_alloc(req, ((10, 11, 12, 13, 14),), k)
    return req, k


def test_history_keys_and_pull(pd: Any) -> None:
    p, d = pd
    history, d_blocks = turn_one(p, d, "a")
    n = PROMPT + ANSWER - 1  # the last answer token never went through the model
    assert history["remote_engine_id"] == d.config.engine_id
    assert history["remote_num_tokens"] == n
    assert history["remote_block_ids"] == [d_blocks]
    assert history["kept_ttl"] == TTL
    assert isinstance(history["kept_until"], float)
    _, k = turn_two(p, history, "a")
    assert k == n
    run_until([p, d], lambda: ended(p, "p2a", "finished_recving"))
    assert not any("p2a" in o.failures for o in p.outputs)
    # P has D's KV: the prompt's (pulled from P in turn 1) and the answer's (D's own).
    for got, want in zip(p.blocks([10, 11, 12, 13]), d.blocks(d_blocks), strict=True):
        torch.testing.assert_close(got, want)
    # P's read completion freed D's kept blocks at once.
    run_until([p, d], lambda: ended(d, "d1a", "finished_sending"))
    assert d.worker.holder.live_count == 0
    assert counter(p, "loads_done") >= 1


def test_other_prompt_is_recomputed(pd: Any) -> None:
    p, d = pd
    history, _ = turn_one(p, d, "b")
    # A reasoning model that strips its thinking: the new prompt differs inside the history.
    tokens = list(range(PROMPT + ANSWER + NEW))
    tokens[PROMPT + 2] = 999
    _, k = turn_two(p, history, "b", prompt=tokens)
    assert k == 0
    counters = p.sched.get_stats().counters
    assert counters.get("history_refused") == 1
    assert any(e.kind == "pd.history_refused" for e in p.sched.take_events())
    # The ticket is authentic but useless to this prompt: D frees the kept turn now, not at
    # its ttl (6 s), and nothing was read.
    assert counters.get("history_released") == 1
    started = time.monotonic()
    run_until([p, d], lambda: ended(d, "d1b", "finished_sending"))
    assert time.monotonic() - started < TTL / 2
    assert d.worker.holder.live_count == 0
    assert counter(p, "loads_done") == 0


def test_a_ticket_that_fails_its_checks_releases_nothing(pd: Any) -> None:
    """Only an authentic kept-blocks ticket can make P tell a decoder to free: one that fails
    P's checks (here: not a kept-blocks ticket) is recomputed and D keeps its turn."""
    p, d = pd
    history, _ = turn_one(p, d, "f")
    bad = {k: v for k, v in history.items() if k != "kept_until"}
    _, k = turn_two(p, bad, "f")
    assert k == 0
    counters = p.sched.get_stats().counters
    assert counters.get("history_refused") == 1
    assert not counters.get("history_released")
    for _ in range(20):
        p.step()
        d.step()
    assert d.worker.holder.kept_count == 1
    assert not ended(d, "d1f", "finished_sending")


def test_short_history_is_recomputed() -> None:
    p, d = make(kv_recompute_threshold=1000)
    try:
        history, _ = turn_one(p, d, "c")
        _, k = turn_two(p, history, "c")
        assert k == 0
        events = [e for e in p.sched.take_events() if e.kind == "pd.history_refused"]
        assert "kv_recompute_threshold" in events[0].data["error"]
        run_until([p, d], lambda: ended(d, "d1c", "finished_sending"))  # freed, not kept
        assert d.worker.holder.live_count == 0
    finally:
        d.shutdown()
        p.shutdown()


def test_evicted_history_is_never_read(pd: Any) -> None:
    p, d = pd
    history, d_blocks = turn_one(p, d, "e")
    assert d.sched.reclaim_blocks(1, 0.0) == len(d_blocks)
    run_until([d], lambda: ended(d, "d1e", "finished_sending"))
    d.fill(d_blocks, seed=77)  # the engine reused the blocks
    _, k = turn_two(p, history, "e")
    assert k == PROMPT + ANSWER - 1
    run_until([p, d], lambda: ended(p, "p2e", "finished_recving"))
    failures = [o.failures["p2e"] for o in p.outputs if "p2e" in o.failures]
    assert failures, "the pull of evicted blocks must fail (and the engine recompute)"
    assert counter(d, "access_refused") == 0  # P never even tried to read them


def test_skewed_clocks_still_pull() -> None:
    for skew in (10_000.0, -10_000.0):
        p, d = make(skew=skew)
        try:
            history, d_blocks = turn_one(p, d, "s")
            turn_two(p, history, "s")
            run_until([p, d], lambda p=p: ended(p, "p2s", "finished_recving"))  # type: ignore[misc]
            assert not any("p2s" in o.failures for o in p.outputs), skew
            for got, want in zip(p.blocks([10, 11, 12, 13]), d.blocks(d_blocks), strict=True):
                torch.testing.assert_close(got, want)
        finally:
            d.shutdown()
            p.shutdown()


class StepClock:
    """A clock both engines share that moves 0.1 ms per reading (and jumps on demand)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1e-4
        return self.t


@pytest.mark.parametrize("past", ["cap", "ttl"])
def test_expired_history_is_never_read(past: str) -> None:
    clock = StepClock()
    n = next(_ids)
    extra = {"kv_recompute_threshold": 16}
    p = Driver(f"P{n}", "kv_both", lease=3.0, ttl=TTL, extra=extra, clock=clock)
    d = Driver(f"D{n}", "kv_both", lease=3.0, ttl=TTL, clock=clock)
    try:
        history, d_blocks = turn_one(p, d, "x")
        if past == "cap":
            # D still keeps the blocks for 1 s, but P's corrected deadline (1.5 s safety
            # margin for a 6 s ttl) has passed: P must not even try.
            clock.t += TTL - 1.0
        else:
            clock.t += TTL + 1.0
            d.step()
            assert ended(d, "d1x", "finished_sending")
            d.fill(d_blocks, seed=78)  # reused
        _, k = turn_two(p, history, "x")
        assert k
        run_until([p, d], lambda: ended(p, "p2x", "finished_recving"), timeout=5)
        failures = [o.failures["p2x"] for o in p.outputs if "p2x" in o.failures]
        assert failures
        assert "kept only until" in failures[0], failures
        assert counter(d, "access_refused") == 0
        run_until([p, d], lambda: d.worker.holder.live_count == 0)
    finally:
        d.shutdown()
        p.shutdown()


def claimed_expiry(d: Driver) -> float:
    (lease,) = list(d.worker.holder.table.leases())
    return lease.expiry


@pytest.mark.parametrize("symmetric", [False, True])
def test_symmetric_leases_claim_on_arrival(symmetric: bool) -> None:
    p, d = make(symmetric_leases=symmetric)
    try:
        history, _ = turn_one(p, d, "y")
        ttl_end = claimed_expiry(d)
        req = next_turn(history, "y")
        p.sched.on_new_request(req)  # P is busy: the request waits in P's queue
        if symmetric:
            # P heartbeats from arrival: D's lease now lives by P's heartbeats (one
            # extension, 2 s for a 3 s lease), no longer by the 6 s ttl.
            run_until([p, d], lambda: d.worker.holder.kept_count == 0)
            assert claimed_expiry(d) < ttl_end
            d.step()  # the workers report the claimed lease (leases_active)
            assert d.sched.next_deadline() == -math.inf  # a reader is at work: step at once
        else:
            end = time.monotonic() + 0.5  # P handshakes with D at once, but sends nothing
            while time.monotonic() < end:
                p.step()
                d.step()
                time.sleep(0.001)
            assert d.worker.holder.kept_count == 1
            assert claimed_expiry(d) == ttl_end
            assert counter(p, "heartbeats_sent") == 0
            # Only an unclaimed kept turn: D polls every kept_poll_interval (20 ms).
            deadline = d.sched.next_deadline()
            assert deadline is not None
            assert deadline == pytest.approx(d.sched._now + 0.02)
    finally:
        d.shutdown()
        p.shutdown()


def test_decode_only_engine_does_not_keep() -> None:
    n = next(_ids)
    p = Driver(f"P{n}", "kv_producer")
    d = Driver(f"D{n}", "kv_consumer")
    try:
        keep, params = d.sched.request_finished(
            view(
                "k",
                PROMPT,
                {"keep_for_next_turn": True},
                finish_reason="stop",
                output_token_ids=[1, 2, 3],
            ),
            ((1, 2, 3),),
        )
        assert (keep, params) == (False, None)
        (event,) = [e for e in d.sched.take_events() if e.kind == "pd.history_not_kept"]
        assert "kv_both" in event.data["error"]
        # And a producer-only P refuses a history rather than pulling it.
        req = view("h", 70, {"do_remote_decode": True, "kv_history": {"x": 1}})
        p.sched.on_new_request(req)
        assert p.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert p.sched.get_stats().counters.get("history_refused") == 1
    finally:
        d.shutdown()
        p.shutdown()


def test_a_history_mostly_in_ps_cache_is_not_pulled(pd: Any) -> None:
    p, d = pd
    history, _ = turn_one(p, d, "t")
    req = next_turn(history, "t")
    p.sched.on_new_request(req)
    # P's own prefix cache has all but 9 of the 49 tokens D kept: fewer than the threshold
    # (16), so P computes them and tells D it may free its kept turn at once.
    assert p.sched.get_num_new_matched_tokens(req, PROMPT) == (0, False)
    assert p.sched.get_num_new_matched_tokens(req, PROMPT) == (0, False)  # asked again
    (event,) = [e for e in p.sched.take_events() if e.kind == "pd.history_refused"]
    assert "only 9 tokens" in event.data["error"]
    run_until([p, d], lambda: ended(d, "d1t", "finished_sending"))
    assert d.worker.holder.live_count == 0
