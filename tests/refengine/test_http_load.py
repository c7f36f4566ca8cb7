"""Ordinary load on the HTTP servers: a router in front of a prefill and a decode engine (kvframe's
P/D connector over the in-process transport), all on loopback, 96 clients at once, every one
connecting at the same moment. Nothing is killed, so every request must be answered 200: no
connection reset, no refused or dropped connection, every output equal to a single engine's."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time

from kvframe_refengine.server import build_engine

from tests.refengine._http import engine_server, router_server

CLIENTS = 96
"""Concurrent clients; each sends ``PER_CLIENT`` requests, one after the other."""
PER_CLIENT = 2
MAX_TOKENS = 2


def _prompt(i: int) -> list[int]:
    return [(i * 7 + j * 3) % 250 + 1 for j in range(12 + i % 9)]


def test_router_and_pd_pair_answer_every_concurrent_request() -> None:
    barrier = threading.Barrier(CLIENTS)

    def client(c: int) -> list[tuple[int, object]]:
        results: list[tuple[int, object]] = []
        for k in range(PER_CLIENT):
            i = c * PER_CLIENT + k
            body = json.dumps({"prompt": _prompt(i), "max_tokens": MAX_TOKENS}).encode()
            conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=90)
            try:
                if k == 0:
                    barrier.wait(timeout=30)  # every client connects at the same moment
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                results.append((resp.status, json.loads(resp.read())))
            except OSError as exc:  # ConnectionResetError, RemoteDisconnected, refused, ...
                results.append((-1, f"{type(exc).__name__}: {exc}"))
            finally:
                conn.close()
        return results

    with (
        engine_server("kv_producer", max_num_seqs=16) as p,
        engine_server("kv_consumer", max_num_seqs=16) as d,
        router_server(p.url, d.url) as router,
    ):
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            answers = [a for r in pool.map(client, range(CLIENTS)) for a in r]
        elapsed = time.monotonic() - t0

    failures = [(i, a) for i, a in enumerate(answers) if a[0] != 200]
    resets = [f for f in failures if f[1][0] == -1]
    total = CLIENTS * PER_CLIENT
    summary = (
        f"{total} requests, {CLIENTS} concurrent: {len(resets)} connection errors, "
        f"{len(failures)} not 200, {elapsed:.1f} s"
    )
    print(f"\nload: {summary}")
    shown = "; ".join(f"#{i}: {a[0]} {str(a[1])[:160]}" for i, a in failures[:5])
    assert not failures, f"{summary}: {shown}"
    # The KV really came from P, and the tokens are a single engine's.
    assert all(a[1]["usage"]["external_tokens"] > 0 for a in answers)  # type: ignore[index]
    ref = build_engine(engine_id="http-ref", role=None)
    try:
        expected = [
            list(o.token_ids) for o in ref.generate([_prompt(i) for i in range(total)], MAX_TOKENS)
        ]
    finally:
        ref.shutdown()
    got = [a[1]["choices"][0]["token_ids"] for a in answers]  # type: ignore[index]
    assert got == expected
