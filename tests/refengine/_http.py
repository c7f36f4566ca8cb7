"""Real HTTP servers for the reference engine's tests, on loopback, inside the test process.

``engine_server`` serves one :class:`~kvframe_refengine.server.EngineService` (no connector, or
kvframe's P/D connector over the in-process transport, so a prefill and a decode engine in one
process reach each other); ``router_server`` puts a router in front of two of them. Each binds
an ephemeral port and is shut down, engine and all, when its ``with`` block ends. ``request``
sends raw bytes with ``http.client`` (so a test can send what ``json.dumps`` never would).
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
from collections.abc import Iterator
from typing import Any

import attrs
from kvframe_refengine import router as router_mod
from kvframe_refengine.server import EngineService, build_engine, serve

_ids = itertools.count()


@attrs.frozen
class Served:
    """A running server: its base URL, port and (for an engine) its service."""

    url: str
    port: int
    service: EngineService | None = None


@contextlib.contextmanager
def engine_server(
    role: str | None = None, *, engine_id: str | None = None, **engine_kw: Any
) -> Iterator[Served]:
    """One engine behind its HTTP API (``role`` None: no connector; else the P/D connector over
    the in-process transport)."""
    eid = engine_id or f"http-{role or 'solo'}-{next(_ids)}"
    engine_kw.setdefault("num_blocks", 256)
    engine = build_engine(engine_id=eid, role=role, transport="inprocess", **engine_kw)
    service = EngineService(engine, engine_id=eid, role=role or "none")
    httpd = serve(service, "127.0.0.1", 0)
    port = int(httpd.server_address[1])
    try:
        yield Served(f"http://127.0.0.1:{port}", port, service)
    finally:
        httpd.shutdown()
        httpd.server_close()
        service.close()


@contextlib.contextmanager
def router_server(prefill: str, decode: str) -> Iterator[Served]:
    """The P/D router in front of ``prefill`` and ``decode`` (base URLs)."""
    httpd = router_mod.serve(router_mod.Router(prefill, decode), "127.0.0.1", 0)
    port = int(httpd.server_address[1])
    try:
        yield Served(f"http://127.0.0.1:{port}", port)
    finally:
        httpd.shutdown()
        httpd.server_close()


def request(
    served: Served,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, Any]:
    """Send one request on a fresh connection; returns (status, body: JSON when it parses,
    else text)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=timeout)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode(errors="replace")


def complete(served: Served, body: bytes | dict[str, Any], **kw: Any) -> tuple[int, Any]:
    """``POST /v1/completions``."""
    return request(served, "POST", "/v1/completions", body, **kw)
