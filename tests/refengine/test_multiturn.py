"""Multi-turn conversations through the router (bidirectional mode).

- :class:`Conversations`, the router's store of D's tickets: one turn each, ``kept_ttl`` by
  the router's clock, at most 10,000 conversations (least recently used out);
- ``conversation_id`` checks (400 naming the field, before any engine is asked);
- the legs the router sends, in front of recording fake engines: ``keep_for_next_turn`` to D,
  D's ticket verbatim as P's ``kv_history`` on the next turn, in pull and push mode, and
  nothing of it with ``history=False`` or without a conversation id.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvframe_refengine import router as router_mod
from kvframe_refengine._http import JSONHandler, start
from kvframe_refengine.router import MAX_CONVERSATIONS, Conversations, Router
from kvframe_refengine.tokenizer import encode

from tests.refengine._http import Served, complete, engine_server, request
from tests.refengine._http import router_server as router_mod_server

TICKET = {
    "do_remote_prefill": True,
    "remote_engine_id": "D0",
    "remote_block_ids": [[3, 4]],
    "remote_num_tokens": 20,
    "kept_until": 1234.5,
    "kept_ttl": 480.0,
}


# -- the store ----------------------------------------------------------------------------------
def test_a_ticket_serves_one_turn() -> None:
    c = Conversations()
    assert c.put("conv", TICKET, now=0.0)
    assert "conv" in c
    assert c.take("conv", now=1.0) == TICKET
    assert c.take("conv", now=1.0) is None  # taken: P's read frees D's blocks
    assert c.take("other", now=1.0) is None


def test_a_ticket_is_dropped_after_its_kept_ttl_by_the_routers_clock() -> None:
    c = Conversations()
    c.put("a", {**TICKET, "kept_ttl": 10}, now=100.0)
    c.put("b", {**TICKET, "kept_ttl": 30}, now=100.0)
    assert c.take("a", now=110.0) is None
    assert c.dropped_expired == 1
    assert c.expire(now=129.9) == 0
    assert c.expire(now=130.0) == 1
    assert len(c) == 0


@pytest.mark.parametrize(
    "params",
    [None, [], {"do_remote_prefill": True}, {**TICKET, "kept_ttl": 0},
     {**TICKET, "kept_ttl": True}, {**TICKET, "kept_ttl": float("inf")},
     {**TICKET, "kept_ttl": "480"}],
)  # fmt: skip
def test_an_answer_without_a_kept_ticket_is_not_stored(params: Any) -> None:
    c = Conversations()
    c.put("conv", TICKET, now=0.0)
    assert not c.put("conv", params, now=1.0)
    assert "conv" not in c  # the older ticket was used by this turn: gone too


def test_the_store_holds_at_most_10000_conversations_least_recently_used_out() -> None:
    assert MAX_CONVERSATIONS == 10_000
    c = Conversations()
    for i in range(MAX_CONVERSATIONS):
        c.put(f"c{i}", TICKET, now=0.0)
    c.put("c0", TICKET, now=0.0)  # used again: the most recent now
    c.put("new", TICKET, now=0.0)
    assert len(c) == MAX_CONVERSATIONS
    assert "c1" not in c
    assert "c0" in c
    assert "new" in c
    assert c.dropped_lru == 1
    assert Router("http://p", "http://d").conversations.capacity == MAX_CONVERSATIONS
    with pytest.raises(ValueError, match="capacity = 0; it must be a positive int"):
        Conversations(0)


# -- conversation_id ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "shown"),
    [("", "''"), ("a b", "'a b'"), ("x" * 129, "'xxx"), ("café", "'café'"), (7, "7"),
     (["a"], "['a']"), ("a/b", "'a/b'")],
)  # fmt: skip
def test_a_bad_conversation_id_is_a_400_naming_it(value: object, shown: str) -> None:
    router = Router("http://127.0.0.1:9", "http://127.0.0.1:9")  # never asked
    code, body = router.complete({"prompt": [1, 2], "conversation_id": value})
    assert code == 400, body
    message = body["error"]["message"]
    assert message.startswith(f"conversation_id = {shown}"), message
    assert "expected 1 to 128 characters of A-Z a-z 0-9 _ . : -" in message
    assert body["error"]["type"] == "invalid_request"
    assert router.metrics.backend_requests.labels("prefill")._value.get() == 0


@pytest.mark.parametrize("value", ["a", "x" * 128, "user-1:chat_2.v3"])
def test_good_conversation_ids(value: str) -> None:
    assert router_mod.check_conversation_id(value) == value


# -- the legs, in front of recording fakes ------------------------------------------------------
class _Fake:
    """An engine that records every body it gets and answers ``answer(body)``."""

    def __init__(self, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer = answer
        self.lock = threading.Lock()


@contextlib.contextmanager
def _fake(answer: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[tuple[str, _Fake]]:
    fake = _Fake(answer)

    class Handler(JSONHandler):
        def get(self) -> None:
            self.send_json(200, {"remote_engine_id": "P0", "remote_host": "h", "remote_port": 1})

        def post(self) -> None:
            body = self.read_json_object()
            with fake.lock:
                fake.bodies.append(body)
            self.send_json(200, fake.answer(body))

    httpd = start("127.0.0.1", 0, Handler, "fake-engine")
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", fake
    finally:
        httpd.shutdown()
        httpd.server_close()


def _answer(params: dict[str, Any] | None, external: int = 0) -> dict[str, Any]:
    return {
        "id": "x",
        "choices": [{"text": "", "token_ids": [1], "finish_reason": "length"}],
        "kv_transfer_params": params,
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "external_tokens": external},
        "timing": {"ttft_s": 0.001, "total_s": 0.002},
    }


@contextlib.contextmanager
def _routed(
    mode: str = "pull", history: bool = True
) -> Iterator[tuple[Served, _Fake, _Fake, list[dict[str, Any]]]]:
    tickets: list[dict[str, Any]] = []

    def decode(body: dict[str, Any]) -> dict[str, Any]:
        keep = (body.get("kv_transfer_params") or {}).get("keep_for_next_turn")
        ticket = {**TICKET, "turn": len(tickets)} if keep else None
        if ticket is not None:
            tickets.append(ticket)
        return _answer(ticket)

    with (
        _fake(lambda b: _answer({"do_remote_prefill": True, "from": "P"}, 7)) as (p_url, p),
        _fake(decode) as (d_url, d),
    ):
        router = Router(p_url, d_url, mode=mode, history=history)
        httpd = router_mod.serve(router, "127.0.0.1", 0)
        port = int(httpd.server_address[1])
        try:
            yield Served(f"http://127.0.0.1:{port}", port), p, d, tickets
        finally:
            httpd.shutdown()
            httpd.server_close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_next_turn_gives_p_the_ticket_d_returned(mode: str) -> None:
    with _routed(mode) as (routed, p, d, tickets):
        turn = {"prompt": [5, 6, 7], "max_tokens": 2, "conversation_id": "conv-1"}
        code, first = complete(routed, turn)
        assert code == 200, first
        assert first["conversation"] == {"id": "conv-1", "history_sent": False, "kept": True}
        assert first["prefill_usage"]["external_tokens"] == 7
        code, second = complete(routed, {**turn, "prompt": [5, 6, 7, 1, 8]})
        assert code == 200, second
        assert second["conversation"] == {"id": "conv-1", "history_sent": True, "kept": True}
        p1, p2 = (b["kv_transfer_params"] for b in p.bodies)
        d1, d2 = (b["kv_transfer_params"] for b in d.bodies)
        assert "kv_history" not in p1
        assert p2["kv_history"] == tickets[0]  # verbatim
        assert p2["do_remote_decode"] is True
        assert d1["keep_for_next_turn"] is True
        assert d2["keep_for_next_turn"] is True
        if mode == "push":
            assert p2["transfer_mode"] == "push"
            assert p2["push_id"] == d2["push_id"]
            assert d2["do_remote_prefill"] is True
            assert d2["remote_engine_id"] == "P0"
        else:
            assert d2 == {"do_remote_prefill": True, "from": "P", "keep_for_next_turn": True}
        assert all("conversation_id" not in b for b in p.bodies + d.bodies)


def test_without_a_conversation_id_nothing_is_kept_or_sent() -> None:
    with _routed() as (routed, p, d, tickets):
        for _ in range(2):
            code, body = complete(routed, {"prompt": [5, 6, 7], "max_tokens": 2})
            assert code == 200, body
            assert "conversation" not in body
        assert tickets == []
        assert all("kv_history" not in b["kv_transfer_params"] for b in p.bodies)
        assert all("keep_for_next_turn" not in b["kv_transfer_params"] for b in d.bodies)


def test_no_history_serves_conversations_without_pulling() -> None:
    with _routed(history=False) as (routed, p, _d, tickets):
        turn = {"prompt": [5, 6, 7], "max_tokens": 2, "conversation_id": "c"}
        for _ in range(2):
            code, body = complete(routed, turn)
            assert code == 200, body
            assert body["conversation"] == {"id": "c", "history_sent": False, "kept": False}
        assert tickets == []  # D was not asked to keep what nobody would read
        assert all("kv_history" not in b["kv_transfer_params"] for b in p.bodies)


def test_conversations_do_not_mix() -> None:
    with _routed() as (routed, p, _d, tickets):
        for cid in ("a", "b", "a", "b"):
            code, body = complete(routed, {"prompt": [1, 2], "conversation_id": cid})
            assert code == 200, body
        histories = [b["kv_transfer_params"].get("kv_history") for b in p.bodies]
        assert histories == [None, None, tickets[0], tickets[1]]


# -- the real thing: two kv_both engines (in-process transport) behind the router ---------------
def _reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from tests.security.fleet import reference

    return reference(prompts, max_tokens)


def _counters(served: Served) -> dict[str, float]:
    _, stats = request(served, "GET", "/stats")
    return {**stats["connector"]["counters"], **stats["connector_scheduler"]["counters"]}


#: The turns are short and P's prefix cache holds the previous prompt's full blocks, so each
#: turn pulls a few dozen tokens from D: below the connector's default threshold (64).
SHORT_PULLS = {"kv_recompute_threshold": 8}

TURNS = [
    encode("Turn one of a conversation: the user asks a question about KV caches. "),
    encode(" And a follow-up question from the user, about leases. "),
    encode(" A third message, which should find its history on D again. "),
]


def test_a_conversation_pulls_its_history_from_d_and_equals_one_engine() -> None:
    with (
        engine_server("kv_both", lease=2.0, decoder_ttl=30.0, kv_extra=SHORT_PULLS) as p,
        engine_server("kv_both", lease=2.0, decoder_ttl=30.0, kv_extra=SHORT_PULLS) as d,
        router_mod_server(p.url, d.url) as routed,
    ):
        prompt: list[int] = []
        prompts, answers, pulled = [], [], []
        for i, message in enumerate(TURNS):
            prompt = prompt + message
            code, body = complete(
                routed, {"prompt": prompt, "max_tokens": 8, "conversation_id": "conv"}
            )
            assert code == 200, body
            assert body["conversation"] == {"id": "conv", "history_sent": i > 0, "kept": True}
            ticket = body["kv_transfer_params"]  # D's, returned as P's are
            assert ticket["remote_num_tokens"] == len(prompt) + 8 - 1
            assert ticket["kept_ttl"] == 30.0
            prompts.append(prompt)
            answers.append(body["choices"][0]["token_ids"])
            usage = body["prefill_usage"]
            pulled.append((usage["cached_tokens"], usage["external_tokens"]))
            prompt = prompt + answers[-1]
        assert answers == _reference(prompts, 8)
        # Turn N+1 had every token whose KV D held (prompt N and answer N but its last): the
        # full blocks of prompt N from P's own prefix cache, the rest pulled from D.
        assert pulled[0] == (0, 0)
        for (cached, external), before in zip(pulled[1:], prompts, strict=False):
            assert external > 0
            assert cached == len(before) // 16 * 16
            assert cached + external == len(before) + 8 - 1
        c = _counters(p)
        assert c.get("history_loads") == 2, c
        assert not c.get("history_refused"), c
        assert _counters(d).get("history_kept") == 3


def test_a_rewritten_history_is_recomputed_by_p() -> None:
    with (
        engine_server("kv_both", lease=2.0, decoder_ttl=30.0, kv_extra=SHORT_PULLS) as p,
        engine_server("kv_both", lease=2.0, decoder_ttl=30.0, kv_extra=SHORT_PULLS) as d,
        router_mod_server(p.url, d.url) as routed,
    ):
        first = {"prompt": TURNS[0] + TURNS[1], "max_tokens": 8, "conversation_id": "c"}
        code, body = complete(routed, first)
        assert code == 200, body
        # The client drops the answer (as a reasoning model's client drops its thinking).
        second = TURNS[1] + TURNS[0] + TURNS[2]
        code, body = complete(routed, {**first, "prompt": second})
        assert code == 200, body
        assert body["conversation"]["history_sent"] is True
        assert body["prefill_usage"]["external_tokens"] == 0
        assert body["choices"][0]["token_ids"] == _reference([second], 8)[0]
        c = _counters(p)
        assert c.get("history_refused") == 1, c
        assert not c.get("history_loads"), c


def test_d_short_of_blocks_gives_back_the_kept_turn_and_p_recomputes() -> None:
    """D's engine, short of blocks for a new request, asks its connector (reclaim_blocks): the
    kept turn goes first; the conversation's next turn is then recomputed on P, never read."""
    with (
        engine_server("kv_both", lease=2.0, decoder_ttl=30.0, kv_extra=SHORT_PULLS) as p,
        engine_server(
            "kv_both", lease=2.0, decoder_ttl=30.0, kv_extra=SHORT_PULLS, num_blocks=16
        ) as d,
        router_mod_server(p.url, d.url) as routed,
    ):
        first = {"prompt": TURNS[0], "max_tokens": 8, "conversation_id": "c"}
        code, body = complete(routed, first)
        assert code == 200, body
        assert body["conversation"]["kept"]
        answer = body["choices"][0]["token_ids"]
        kept = -(-(len(TURNS[0]) + 8 - 1) // 16)
        # A request that needs more than the blocks D has free besides the kept turn.
        big = (TURNS[1] * 4)[: (16 - kept + 1) * 16 - 7]
        code, body = complete(routed, {"prompt": big, "max_tokens": 8})
        assert code == 200, body
        assert body["choices"][0]["token_ids"] == _reference([big], 8)[0]
        assert _counters(d).get("kept_evicted") == 1
        _, stats = request(d, "GET", "/stats")
        assert stats["engine"]["reclaim_promised_blocks"] >= kept
        second = TURNS[0] + answer + TURNS[2]
        code, body = complete(routed, {**first, "prompt": second})
        assert code == 200, body
        assert body["conversation"]["history_sent"]
        assert body["prefill_usage"]["external_tokens"] == 0  # nothing read from D
        c = _counters(p)  # P tried, D answered that the lease is gone: P recomputed
        assert c.get("history_loads") == 1, c
        assert c.get("loads_failed") == 1, c
        assert body["choices"][0]["token_ids"] == _reference([second], 8)[0]


def test_a_decoder_keeping_only_unclaimed_turns_polls_slowly() -> None:
    # The connector's next_deadline (kept_poll_interval, 20 ms) paces an engine whose only
    # work is a kept turn: the engine sleeps that long between steps, not its idle pace.
    with (
        engine_server("kv_both", lease=2.0, decoder_ttl=30.0) as p,
        engine_server("kv_both", lease=2.0, decoder_ttl=30.0) as d,
    ):
        prompt = TURNS[0]
        status, first = complete(
            p, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert status == 200, first
        leg = {**first["kv_transfer_params"], "keep_for_next_turn": True}
        status, kept = complete(d, {"prompt": prompt, "max_tokens": 8, "kv_transfer_params": leg})
        assert status == 200, kept
        assert "kept_until" in kept["kv_transfer_params"]
        assert d.service is not None
        engine = d.service.engine
        assert engine.connector_scheduler is not None
        assert engine.connector_scheduler.has_pending_work()
        end = time.monotonic() + 5.0
        wait = engine.idle_wait(cap=0.1)  # at once until the workers granted the kept lease
        while (wait is None or wait <= engine.config.idle_sleep_s) and time.monotonic() < end:
            time.sleep(0.01)
            wait = engine.idle_wait(cap=0.1)
        assert wait is not None
        assert engine.config.idle_sleep_s < wait <= 0.02
        assert engine.connector_scheduler.has_pending_work()  # still keeping the turn
