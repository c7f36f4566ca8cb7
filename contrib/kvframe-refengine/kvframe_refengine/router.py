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
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from typing import Any

from kvframe_refengine import _http
from kvframe_refengine._http import HTTPError

__all__ = ["Router", "main", "post_json", "serve"]

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


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


class Router:
    """Routes completions through prefill then decode."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.routed = 0
        self.failed = 0
        self._lock = threading.Lock()

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Run one request through P and D; returns (HTTP status, answer)."""
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
        try:
            code, resp = post_json(f"{base}/v1/completions", body, timeout=timeout)
        except TimeoutError:
            return self._fail(
                504, f"the {side} engine did not answer within {timeout:g} s", f"{side}_timeout"
            )
        except OSError as exc:
            return self._fail(
                502, f"the {side} engine at {base} cannot be reached: {exc}", f"{side}_unreachable"
            )
        except ValueError as exc:
            return self._fail(
                502, f"the {side} engine answered 200 with a body that is not JSON: {exc}",
                f"{side}_failed",
            )  # fmt: skip
        if code == 200:
            return code, resp
        err = resp.get("error")
        if not isinstance(err, dict):
            err = {"message": resp}
        message = err.get("message", resp)
        if code in _PASSED_THROUGH:
            kind = str(err.get("type", "invalid_request"))
            return code, _error(f"the {side} engine refused the request: {message}", kind)
        return self._fail(502, f"the {side} engine answered {code}: {message}", f"{side}_failed")

    def _fail(self, status: int, message: str, kind: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.failed += 1
        return status, _error(message, kind)


def _handler(router: Router) -> type[_http.JSONHandler]:
    class Handler(_http.JSONHandler):
        def get(self) -> None:
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
