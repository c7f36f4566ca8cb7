"""One reference engine behind a small OpenAI-style HTTP API.

::

    python -m kvframe_refengine.server --port 8101 --engine-id P0 --role kv_producer \\
        --transport nixl --side-channel-port 5600

Endpoints (JSON in and out):

- ``POST /v1/completions`` — ``{"prompt": str | [int], "max_tokens": int,
  "kv_transfer_params": {...} | null, "request_id": str?}``; answers ``{"id", "choices":
  [{"text", "token_ids", "finish_reason"}], "kv_transfer_params", "usage", "timing"}``.
  A request that cannot be served (bad input, a failed KV load under policy ``fail``) answers
  400 or 500 with ``{"error": {"message", "type"}}``; the engine carries on.
- ``GET /health`` — ``{"ok": true, "engine_id", "role"}``.
- ``GET /stats`` — the engine's counters and the connector's accumulated statistics.
- ``GET /metrics`` — the connector's statistics in the Prometheus text format.
- ``GET /leaks`` — the leak oracle: ``{"clean": bool, "problems": str}``.

The engine runs on its own thread, stepping while it has work — including when the connector
reports pending work with no request to run (an idle prefill engine holding leases) — and
sleeping a millisecond otherwise. HTTP handler threads only queue commands to it.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvframe.config import KVTransferConfig
from kvframe.protocol.messages import ConnectorOutput
from kvframe.runtime.metrics import StatsAccumulator, to_prometheus
from kvframe_refengine.engine import Engine, EngineConfig, LeakError
from kvframe_refengine.model import ModelConfig
from kvframe_refengine.request import RequestOutput
from kvframe_refengine.tokenizer import decode, encode

__all__ = ["EngineService", "build_engine", "main", "serve"]


class EngineService:
    """Owns an :class:`Engine` and the thread that steps it; thread-safe front door."""

    def __init__(self, engine: Engine, *, engine_id: str, role: str) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.role = role
        self.connector_stats = StatsAccumulator()
        self._cmds: queue.Queue[Callable[[], None]] = queue.Queue()
        self._waiters: dict[str, tuple[Future[RequestOutput], float]] = {}
        self._first_token: dict[str, float] = {}
        self._timing: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._counter = 0
        self.failed: BaseException | None = None
        sched = engine.connector_scheduler
        if sched is not None:
            # Tap the connector's per-step output for operators (stats, /metrics).
            original = sched.update_connector_output

            def tap(output: ConnectorOutput) -> None:
                self.connector_stats.add(output.stats)
                original(output)

            sched.update_connector_output = tap  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_work()
                try:
                    cmd = self._cmds.get(timeout=0 if busy else 0.001)
                    cmd()
                    while True:
                        self._cmds.get_nowait()()
                except queue.Empty:
                    pass
                if not self.engine.has_unfinished_work():
                    continue
                now = time.monotonic()
                for out in self.engine.step():
                    self._on_output(out, now)
                if not self.engine.last_step_ran_tokens:
                    time.sleep(0.0005)
        except BaseException as exc:  # the engine is unusable: fail every waiter loudly
            self.failed = exc
            for fut, _ in self._waiters.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"engine failed: {exc!r}"))

    def _on_output(self, out: RequestOutput, now: float) -> None:
        if out.new_token_ids and out.request_id not in self._first_token:
            self._first_token[out.request_id] = now
        if not out.finished:
            return
        waiter = self._waiters.pop(out.request_id, None)
        if waiter is None:
            return
        fut, t0 = waiter
        first = self._first_token.pop(out.request_id, now)
        self._timing[out.request_id] = {"ttft_s": first - t0, "total_s": now - t0}
        fut.set_result(out)

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the engine thread and return its result."""
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self._cmds.put(run)
        return fut.result(timeout)

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None,
        request_id: str | None = None,
    ) -> tuple[str, Future[RequestOutput]]:
        """Queue a request; the future resolves with its final output."""
        if self.failed is not None:
            raise RuntimeError(f"engine failed: {self.failed!r}")
        self._counter += 1
        rid = request_id or f"{self.engine_id}-{self._counter}"
        fut: Future[RequestOutput] = Future()

        def add() -> None:
            self.engine.add_request(rid, prompt, max_tokens, kv_transfer_params)
            self._waiters[rid] = (fut, time.monotonic())

        self.call(add)
        return rid, fut

    def timing(self, request_id: str) -> dict[str, float]:
        return self._timing.pop(request_id, {})

    def stats(self) -> dict[str, Any]:
        snap = self.connector_stats.snapshot()

        def describe() -> dict[str, Any]:
            return dict(self.engine.describe())

        return {
            "engine_id": self.engine_id,
            "role": self.role,
            "engine": self.call(describe),
            "connector": {"counters": dict(snap.counters), "gauges": dict(snap.gauges)},
        }

    def leaks(self) -> dict[str, Any]:
        def check() -> dict[str, Any]:
            try:
                self.engine.check_no_leaks()
            except LeakError as exc:
                return {"clean": False, "problems": str(exc)}
            return {"clean": True, "problems": ""}

        result: dict[str, Any] = self.call(check)
        return result

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.engine.shutdown()


def _handler(service: EngineService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str) -> None:
            self._send(code, {"error": {"message": message, "type": kind}})

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"ok": True, "engine_id": service.engine_id, "role": service.role})
            elif self.path == "/stats":
                self._send(200, service.stats())
            elif self.path == "/metrics":
                labels = {"engine_id": service.engine_id}
                text = to_prometheus(service.connector_stats.snapshot(), labels=labels)
                self._send(200, text, "text/plain; version=0.0.4")
            elif self.path == "/leaks":
                self._send(200, service.leaks())
            else:
                self._error(404, f"no route {self.path}", "not_found")

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._error(404, f"no route {self.path}", "not_found")
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the request body must be a JSON object")
                prompt = body.get("prompt")
                tokens = encode(prompt) if isinstance(prompt, str) else prompt
                if not isinstance(tokens, list):
                    raise ValueError("prompt must be a string or a list of token ids")
                max_tokens = body.get("max_tokens", 16)
                params = body.get("kv_transfer_params")
                rid, fut = service.submit(tokens, max_tokens, params, body.get("request_id"))
            except (ValueError, TypeError) as exc:
                self._error(400, str(exc), "invalid_request")
                return
            except RuntimeError as exc:
                self._error(503, str(exc), "engine_unavailable")
                return
            try:
                out = fut.result(timeout=float(body.get("timeout_s", 120)))
            except Exception as exc:
                self._error(500, str(exc), "engine_error")
                return
            if out.error:
                self._error(500, f"request {rid} failed: {out.error}", "kv_load_failed")
                return
            self._send(
                200,
                {
                    "id": rid,
                    "object": "text_completion",
                    "choices": [
                        {
                            "index": 0,
                            "text": decode(out.token_ids),
                            "token_ids": list(out.token_ids),
                            "finish_reason": out.finish_reason.value if out.finish_reason else None,
                        }
                    ],
                    "kv_transfer_params": dict(out.kv_transfer_params)
                    if out.kv_transfer_params
                    else None,
                    "usage": {
                        "prompt_tokens": len(tokens),
                        "completion_tokens": len(out.token_ids),
                        "cached_tokens": out.num_cached_tokens,
                        "external_tokens": out.num_external_tokens,
                    },
                    "timing": service.timing(rid),
                },
            )

    return Handler


def build_engine(
    *,
    engine_id: str,
    role: str | None,
    transport: str = "nixl",
    side_channel_port: int = 0,
    lease: float = 30.0,
    failure_policy: str = "recompute",
    num_blocks: int = 512,
    max_num_seqs: int = 16,
    torch_threads: int = 1,
    model_seed: int = 0,
) -> Engine:
    """An engine for serving; ``role=None`` builds one without a connector."""
    kv = None
    if role is not None:
        kv = KVTransferConfig.from_dict(
            {
                "kv_connector": "PDConnector",
                "kv_role": role,
                "engine_id": engine_id,
                "kv_lease_duration": lease,
                "kv_load_failure_policy": failure_policy,
                "kv_connector_extra_config": {
                    "transport": transport,
                    "side_channel_port": side_channel_port,
                },
            }
        )
    return Engine(
        EngineConfig(
            model=ModelConfig(seed=model_seed),
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            torch_threads=torch_threads,
        ),
        kv,
    )


def serve(service: EngineService, host: str, port: int) -> ThreadingHTTPServer:
    """Start the HTTP API on a background thread; returns the server (``shutdown()`` it)."""
    httpd = ThreadingHTTPServer((host, port), _handler(service))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    return httpd


def main(argv: list[str] | None = None) -> int:
    """``python -m kvframe_refengine.server``: serve one engine until SIGTERM/SIGINT."""
    ap = argparse.ArgumentParser(
        prog="kvframe_refengine.server", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--role", choices=["kv_producer", "kv_consumer", "kv_both", "none"])
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--side-channel-port", type=int, default=0)
    ap.add_argument("--lease", type=float, default=30.0)
    ap.add_argument("--failure-policy", choices=["fail", "recompute"], default="recompute")
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args(argv)
    engine = build_engine(
        engine_id=args.engine_id,
        role=None if args.role in (None, "none") else args.role,
        transport=args.transport,
        side_channel_port=args.side_channel_port,
        lease=args.lease,
        failure_policy=args.failure_policy,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
    )
    service = EngineService(engine, engine_id=args.engine_id, role=args.role or "none")
    httpd = serve(service, args.host, args.port)
    import signal

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(json.dumps({"ready": True, "port": args.port}), flush=True)
    done.wait()
    httpd.shutdown()
    service.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
