"""The P/D router: one OpenAI-style endpoint in front of a prefill and a decode engine.

::

    python -m kvframe_refengine.router --port 8100 \\
        --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102

For each ``POST /v1/completions`` it asks the prefill engine for one token with
``kv_transfer_params={"do_remote_decode": true}``, then sends the original request to the decode
engine with the ``kv_transfer_params`` the prefill engine returned, and answers with the decode
engine's response (plus ``router_timing``). This is the contract vLLM's routing proxies follow,
so they work with kvframe's P/D connector too.

The router checks the body as the engines do (400, 411, 413 naming the problem, before
either engine is asked); what only an engine can check (a token outside the vocabulary, a
request longer than ``max_model_len``) comes back with the engine's own 400. A prefill or
decode engine that cannot be reached or that fails the request gives a 502, one that does not
answer in time a 504, each ``{"error": {"message", "type"}}`` naming which side failed.

``GET /metrics`` gives the router's own Prometheus metrics (``kvframe_router_*``: requests by
outcome, requests, failures and answer times per backend, the time per routed request; listed
in docs/metrics.md); ``GET /health`` the routed and failed counts.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvframe.runtime.metrics import CONTENT_TYPE
from kvframe_refengine import _http
from kvframe_refengine._http import HTTPError

__all__ = ["Router", "RouterMetrics", "main", "post_json", "serve"]

_PASSED_THROUGH = frozenset({400, 413})
"""An engine's answers that are about the request itself: the client gets them as they are."""
_UPSTREAM_MARGIN_S = 5.0
"""How much longer than the request's ``timeout_s`` the router waits for an engine (whose own
504 then arrives first)."""


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; returns (status, decoded JSON). Raises ``OSError`` when the server
    cannot be reached (``TimeoutError`` when it does not answer in ``timeout`` seconds) and
    ``ValueError`` when a 2xx answer is not JSON."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {"error": {"message": str(exc), "type": "http_error"}}
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise exc.reason from exc
        raise


_BACKENDS = ("prefill", "decode")
_BACKEND_FAILURES = ("unreachable", "timeout", "failed")
_OUTCOMES = ("routed", "refused", "failed")
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of their own (one per :class:`Router`);
    every series whose labels are known exists from the start, at zero."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvframe_router_requests",
            "Completion requests the router answered, by outcome: routed (200), refused (the "
            "request itself was wrong: 4xx), failed (an engine failed it: 502, 504).",
            ["outcome"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvframe_router_request_seconds",
            "Seconds from a completion request's arrival to its answer, for routed requests "
            "(prefill and decode together).",
            buckets=_SECONDS,
            registry=r,
        )
        self.backend_requests = Counter(
            "kvframe_router_backend_requests",
            "Requests the router sent to an engine, by backend (prefill, decode).",
            ["backend"],
            registry=r,
        )
        self.backend_failures = Counter(
            "kvframe_router_backend_failures",
            "Requests to an engine that failed, by backend and reason: unreachable, timeout, "
            "failed (an error answer other than 400/413, or a 200 that is not JSON).",
            ["backend", "reason"],
            registry=r,
        )
        self.backend_seconds = Histogram(
            "kvframe_router_backend_seconds",
            "Seconds an engine took to answer the router, by backend (every answer, errors "
            "included; not the requests it could not be reached for).",
            ["backend"],
            buckets=_SECONDS,
            registry=r,
        )
        for outcome in _OUTCOMES:
            self.requests.labels(outcome)
        for backend in _BACKENDS:
            self.backend_requests.labels(backend)
            self.backend_seconds.labels(backend)
            for reason in _BACKEND_FAILURES:
                self.backend_failures.labels(backend, reason)

        self._out = CollectorRegistry(auto_describe=False)
        self._out.register(_WithoutCreated(r))

    def render(self) -> str:
        """Prometheus text (format 0.0.4), without ``prometheus_client``'s ``*_created``
        series (a second family per metric that dashboards do not use)."""
        return generate_latest(self._out).decode()


class _WithoutCreated(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


class Router:
    """Routes completions through prefill then decode."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.routed = 0
        self.failed = 0
        self.metrics = RouterMetrics()
        self._lock = threading.Lock()

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Run one request through P and D; returns (HTTP status, answer)."""
        t0 = time.monotonic()
        code, answer = self._complete(body)
        outcome = "routed" if code == 200 else "refused" if code < 500 else "failed"
        self.metrics.requests.labels(outcome).inc()
        if code == 200:
            self.metrics.request_seconds.observe(time.monotonic() - t0)
        return code, answer

    def _complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            checked = _http.parse_completion(body)
        except HTTPError as exc:
            return exc.status, _error(exc.message, exc.kind)
        timeout = checked.timeout_s + _UPSTREAM_MARGIN_S
        t0 = time.monotonic()
        p_body = dict(body)
        p_body["max_tokens"] = 1
        p_body["kv_transfer_params"] = {"do_remote_decode": True}
        p_body.pop("request_id", None)
        code, p_resp = self._ask("prefill", self.prefill, p_body, timeout)
        if code != 200:
            return code, p_resp
        t1 = time.monotonic()
        d_body = dict(body)
        d_body["kv_transfer_params"] = p_resp.get("kv_transfer_params")
        code, d_resp = self._ask("decode", self.decode, d_body, timeout)
        if code != 200:
            return code, d_resp
        t2 = time.monotonic()
        d_resp["router_timing"] = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0}
        d_resp["prefill_id"] = p_resp.get("id")
        with self._lock:
            self.routed += 1
        return 200, d_resp

    def _ask(
        self, side: str, base: str, body: dict[str, Any], timeout: float
    ) -> tuple[int, dict[str, Any]]:
        """(200, the engine's answer), or the (status, error) to give the client."""
        self.metrics.backend_requests.labels(side).inc()
        t0 = time.monotonic()
        try:
            code, resp = post_json(f"{base}/v1/completions", body, timeout=timeout)
        except TimeoutError:
            return self._fail(
                504, f"the {side} engine did not answer within {timeout:g} s", side, "timeout"
            )
        except OSError as exc:
            return self._fail(
                502, f"the {side} engine at {base} cannot be reached: {exc}", side, "unreachable"
            )
        except ValueError as exc:
            self.metrics.backend_seconds.labels(side).observe(time.monotonic() - t0)
            return self._fail(
                502, f"the {side} engine answered 200 with a body that is not JSON: {exc}",
                side, "failed",
            )  # fmt: skip
        self.metrics.backend_seconds.labels(side).observe(time.monotonic() - t0)
        if code == 200:
            return code, resp
        err = resp.get("error")
        if not isinstance(err, dict):
            err = {"message": resp}
        message = err.get("message", resp)
        if code in _PASSED_THROUGH:
            kind = str(err.get("type", "invalid_request"))
            return code, _error(f"the {side} engine refused the request: {message}", kind)
        return self._fail(502, f"the {side} engine answered {code}: {message}", side, "failed")

    def _fail(
        self, status: int, message: str, side: str, reason: str
    ) -> tuple[int, dict[str, Any]]:
        self.metrics.backend_failures.labels(side, reason).inc()
        with self._lock:
            self.failed += 1
        return status, _error(message, f"{side}_{reason}")


def _handler(router: Router) -> type[_http.JSONHandler]:
    class Handler(_http.JSONHandler):
        def get(self) -> None:
            if self.path == "/metrics":
                self.send_json(200, router.metrics.render(), CONTENT_TYPE)
                return
            if self.path != "/health":
                super().get()
                return
            self.send_json(200, {"ok": True, "routed": router.routed, "failed": router.failed})

        def post(self) -> None:
            if self.path != "/v1/completions":
                super().post()
                return
            self.send_json(*router.complete(self.read_json_object()))

    return Handler


def serve(router: Router, host: str, port: int) -> ThreadingHTTPServer:
    """Start the router's HTTP API on a background thread (``port`` 0: a free port)."""
    return _http.start(host, port, _handler(router), "router")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvframe_refengine.router``: route until SIGTERM/SIGINT."""
    ap = argparse.ArgumentParser(prog="kvframe_refengine.router")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="base URL of the prefill engine")
    ap.add_argument("--decode", required=True, help="base URL of the decode engine")
    args = ap.parse_args(argv)
    httpd = serve(Router(args.prefill, args.decode), args.host, args.port)
    import signal

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(json.dumps({"ready": True, "port": args.port}), flush=True)
    done.wait()
    httpd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
