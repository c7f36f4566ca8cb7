"""The P/D router: one OpenAI-style endpoint in front of a prefill and a decode engine.

::

    python -m kvframe_refengine.router --port 8100 \\
        --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102

For each ``POST /v1/completions`` it asks the prefill engine for one token with
``kv_transfer_params={"do_remote_decode": true}``, then sends the original request to the decode
engine with the ``kv_transfer_params`` the prefill engine returned, and answers with the decode
engine's response (plus ``router_timing``). This is the contract vLLM's routing proxies follow,
so they work with kvframe's P/D connector too.

Errors: a prefill or decode engine that cannot be reached or that fails the request gives a
502 with ``{"error": {"message", "type"}}`` naming which side failed.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Router", "main", "post_json"]


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; returns (status, decoded JSON). Raises ``OSError`` when the server
    cannot be reached."""
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


class Router:
    """Routes completions through prefill then decode."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.routed = 0
        self.failed = 0
        self._lock = threading.Lock()

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Run one request through P and D."""
        t0 = time.monotonic()
        p_body = dict(body)
        p_body["max_tokens"] = 1
        p_body["kv_transfer_params"] = {"do_remote_decode": True}
        p_body.pop("request_id", None)
        try:
            code, p_resp = post_json(f"{self.prefill}/v1/completions", p_body)
        except OSError as exc:
            return self._fail(f"prefill engine unreachable: {exc}", "prefill_unreachable")
        if code != 200:
            msg = p_resp.get("error", {}).get("message", p_resp)
            return self._fail(f"prefill engine answered {code}: {msg}", "prefill_failed")
        t1 = time.monotonic()
        d_body = dict(body)
        d_body["kv_transfer_params"] = p_resp.get("kv_transfer_params")
        try:
            code, d_resp = post_json(f"{self.decode}/v1/completions", d_body)
        except OSError as exc:
            return self._fail(f"decode engine unreachable: {exc}", "decode_unreachable")
        if code != 200:
            msg = d_resp.get("error", {}).get("message", d_resp)
            return self._fail(f"decode engine answered {code}: {msg}", "decode_failed")
        t2 = time.monotonic()
        d_resp["router_timing"] = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0}
        d_resp["prefill_id"] = p_resp.get("id")
        with self._lock:
            self.routed += 1
        return 200, d_resp

    def _fail(self, message: str, kind: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.failed += 1
        return 502, {"error": {"message": message, "type": kind}}


def _handler(router: Router) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"ok": True, "routed": router.routed, "failed": router.failed})
            else:
                self._send(
                    404, {"error": {"message": f"no route {self.path}", "type": "not_found"}}
                )

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._send(
                    404, {"error": {"message": f"no route {self.path}", "type": "not_found"}}
                )
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the request body must be a JSON object")
            except ValueError as exc:
                self._send(400, {"error": {"message": str(exc), "type": "invalid_request"}})
                return
            self._send(*router.complete(body))

    return Handler


def serve(router: Router, host: str, port: int) -> ThreadingHTTPServer:
    """Start the router's HTTP API on a background thread."""
    httpd = ThreadingHTTPServer((host, port), _handler(router))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="router", daemon=True).start()
    return httpd


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
