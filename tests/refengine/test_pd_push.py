"""Push mode through the reference engine's HTTP API and the router.

- ``GET /v1/kv_address``: a prefill engine's push address (200), none on an engine without the
  P/D connector or on a decode engine (404), an address the connector cannot tell (503);
- the router in push mode in front of two engines in this process (in-process transport):
  both legs at once, D's answer, and a prefill leg that fails while D prefills the prompt
  itself (reported in ``prefill_error`` and the router's counters), or while D fails too;
- the same over real NIXL with P and D as server processes: outputs equal a single engine's
  token for token, the counters show that every request's KV was pushed by P, the leak oracle
  is clean on both engines.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvframe_refengine import router as router_mod
from kvframe_refengine._http import JSONHandler, start
from kvframe_refengine.router import Router, get_json, post_json
from kvframe_refengine.tokenizer import encode

from kvframe.errors import ConfigError
from tests.refengine._http import Served, complete, engine_server, request

LEASE = 1.0
PROMPTS = [
    encode("Push mode: D allocates first and P writes into its blocks. [0]"),
    encode("The router sends both legs at once, with one push id. [1]"),
    encode("A lease of D's own fences every WRITE P makes into D's memory. [2]"),
]


@contextlib.contextmanager
def push_router(prefill: str, decode: str) -> Iterator[tuple[Served, Router]]:
    router = Router(prefill, decode, mode="push")
    httpd = router_mod.serve(router, "127.0.0.1", 0)
    port = int(httpd.server_address[1])
    try:
        yield Served(f"http://127.0.0.1:{port}", port), router
    finally:
        httpd.shutdown()
        httpd.server_close()


def _reference(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from tests.security.fleet import reference

    return reference(prompts, max_tokens)


def _counter(served: Served, name: str) -> float:
    _, stats = request(served, "GET", "/stats")
    return float(stats["connector"]["counters"].get(name, 0.0))


# -- GET /v1/kv_address -------------------------------------------------------------------------
def test_kv_address_of_a_prefill_engine_and_404_elsewhere() -> None:
    with (
        engine_server("kv_producer", engine_id="addrP") as p,
        engine_server("kv_consumer") as d,
        engine_server(None) as solo,
    ):
        code, address = request(p, "GET", "/v1/kv_address")
        assert code == 200, address
        assert address["remote_engine_id"] == "addrP"
        assert address["transport"] == "inprocess"
        assert address["tp_size"] == 1
        assert {"remote_host", "remote_port"} <= set(address)
        assert request(p, "GET", "/v1/kv_address") == (200, address)  # static per instance
        for served, words in ((solo, "no P/D connector (its connector: none)"),
                              (d, "decode engine (kv_role kv_consumer)")):  # fmt: skip
            code, body = request(served, "GET", "/v1/kv_address")
            assert code == 404, body
            assert body["error"]["type"] == "no_kv_address"
            assert words in body["error"]["message"], body


def test_kv_address_the_connector_cannot_tell_is_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    with engine_server("kv_producer") as p:
        assert p.service is not None
        sched = p.service.engine.connector_scheduler

        def unknown() -> dict[str, Any]:
            raise ConfigError("side_channel_port is 0 and no handshake metadata")

        monkeypatch.setattr(sched, "kv_address", unknown)
        code, body = request(p, "GET", "/v1/kv_address")
        assert code == 503, body
        assert body["error"]["type"] == "kv_address_unknown"
        assert "side_channel_port is 0" in body["error"]["message"]


def test_a_push_router_in_front_of_an_engine_without_an_address_is_a_502() -> None:
    with engine_server(None) as solo, push_router(solo.url, solo.url) as (routed, _):
        code, body = complete(routed, {"prompt": PROMPTS[0], "max_tokens": 2})
        assert code == 502, body
        assert body["error"]["type"] == "prefill_failed"
        assert "GET /v1/kv_address" in body["error"]["message"]
        assert "--mode pull" in body["error"]["message"]


def test_router_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="mode 'pusher': expected one of pull, push"):
        Router("http://p", "http://d", mode="pusher")


# -- the router in push mode, engines in this process -------------------------------------------
def test_push_through_the_router_in_process() -> None:
    with (
        engine_server("kv_producer", lease=LEASE) as p,
        engine_server("kv_consumer", lease=LEASE, failure_policy="fail") as d,
        push_router(p.url, d.url) as (routed, router),
    ):
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(
                pool.map(lambda t: complete(routed, {"prompt": t, "max_tokens": 6}), PROMPTS)
            )
        expected = _reference(PROMPTS, 6)
        for (code, body), want in zip(answers, expected, strict=True):
            assert code == 200, body
            assert body["choices"][0]["token_ids"] == want
            assert body["usage"]["external_tokens"] > 0
            assert body["prefill_id"]
            assert "prefill_error" not in body
            timing = body["router_timing"]
            assert timing["decode_start_s"] == 0.0
            assert 0 < timing["prefill_s"] <= timing["total_s"]
            assert 0 < timing["decode_s"] <= timing["total_s"]
        assert len({body["push_id"] for _, body in answers}) == len(PROMPTS)
        assert router.address_fetches == 1  # fetched once, kept
        assert _counter(d, "loads_done") == len(PROMPTS)
        assert _counter(p, "pushes_done") == len(PROMPTS)
        for served in (p, d):
            assert _leaks_clean(served)
        _, health = request(routed, "GET", "/health")
        assert health == {"ok": True, "mode": "push", "routed": len(PROMPTS), "failed": 0}


def _leaks_clean(served: Served, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        _, leaks = request(served, "GET", "/leaks")
        if leaks["clean"] or time.monotonic() > deadline:
            return bool(leaks["clean"])
        time.sleep(0.05)


@contextlib.contextmanager
def failing_prefill(real: Served) -> Iterator[str]:
    """A prefill engine whose completions fail (500) but which tells the real P's push
    address: D registers with the real P, which never gets the prefill leg."""

    class Handler(JSONHandler):
        def get(self) -> None:
            self.send_json(*get_json(f"{real.url}/v1/kv_address"))

        def post(self) -> None:
            self.send_json(500, {"error": {"message": "prefill broke", "type": "internal"}})

    httpd = start("127.0.0.1", 0, Handler, "failing-prefill")
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_prefill_leg_is_reported(policy: str) -> None:
    """P's leg fails; D's registration waits for a prefill that never comes and is refused
    (within one lease), then D prefills the prompt itself (``recompute``: the client gets D's
    200 with ``prefill_error``) or fails the request (``fail``: a 502 naming both legs)."""
    with (
        engine_server("kv_producer", lease=LEASE) as p,
        engine_server("kv_consumer", lease=LEASE, failure_policy=policy) as d,
        failing_prefill(p) as broken,
        push_router(broken, d.url) as (routed, router),
    ):
        t0 = time.monotonic()
        code, body = complete(routed, {"prompt": PROMPTS[0], "max_tokens": 4})
        took = time.monotonic() - t0
        if policy == "recompute":
            assert code == 200, body
            assert body["choices"][0]["token_ids"] == _reference(PROMPTS[:1], 4)[0]
            assert body["usage"]["external_tokens"] == 0  # D prefilled it itself
            assert body["prefill_id"] is None
            assert body["prefill_error"] == {
                "status": 502,
                "message": "the prefill engine answered 500: prefill broke",
                "type": "prefill_failed",
            }
        else:
            assert code == 502, body
            message = body["error"]["message"]
            assert body["error"]["type"] == "decode_failed"
            assert "the prefill leg failed too: the prefill engine answered 500" in message
        assert took < 3 * LEASE + 2, took
        assert _counter(d, "loads_failed") == 1
        text = router.metrics.render()
        assert 'kvframe_router_backend_failures_total{backend="prefill",reason="failed"} 1.0' in (
            text
        )
        outcome = "routed" if policy == "recompute" else "failed"
        assert f'kvframe_router_requests_total{{outcome="{outcome}"}} 1.0' in text
        # the failed leg makes the router ask for P's address again next time
        assert router.kv_address()[0] == 200
        assert router.address_fetches == 2
        for served in (p, d):
            assert _leaks_clean(served, 3 * LEASE)


# -- over NIXL, P and D as server processes -----------------------------------------------------
def test_push_through_the_router_over_nixl(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")
    from tests.security.fleet import EngineProcess, counters, get

    p = EngineProcess("pushP", "kv_producer", key_file=None, log_dir=tmp_path)
    d = EngineProcess("pushD", "kv_consumer", key_file=None, log_dir=tmp_path, max_num_seqs=2)
    try:
        p.wait_ready()
        d.wait_ready()
        router = Router(p.url, d.url, mode="push")
        httpd = router_mod.serve(router, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/completions"
        try:
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                answers = list(
                    pool.map(
                        lambda t: post_json(url, {"prompt": t, "max_tokens": 8}, timeout=60),
                        PROMPTS,
                    )
                )
        finally:
            httpd.shutdown()
            httpd.server_close()
        expected = _reference(PROMPTS, 8)
        for (code, body), want in zip(answers, expected, strict=True):
            assert code == 200, body
            assert body["choices"][0]["token_ids"] == want
            assert body["usage"]["external_tokens"] > 0
        n = len(PROMPTS)
        pc, dc = counters(p.url), counters(d.url)
        assert dc["connector.loads_done"] == n
        assert dc["connector.push_registrations"] == n
        assert pc["connector.pushes_done"] == n
        assert pc["connector.bytes_written"] > 0
        assert pc.get("connector.pushes_failed", 0) == 0
        assert pc.get("connector.push_unsent", 0) == 0
        for e in (p, d):
            deadline = time.monotonic() + 10
            while not get(f"{e.url}/leaks")["clean"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert get(f"{e.url}/leaks") == {"clean": True, "problems": ""}
    finally:
        p.stop()
        d.stop()
