"""The HTTP plumbing the engine server and the router share: a server fit for a router's
fan-out, a JSON request handler that answers every failure with a JSON error, and the one
reader of a completion request's body, so both doors refuse the same bodies in the same words.

Limits (the docs' HTTP API section lists them with their status codes):

- :data:`LISTEN_BACKLOG` connections may wait to be accepted; each accepted one gets its own
  daemon thread;
- a body is at most :data:`MAX_BODY_BYTES` bytes (413), sent with a ``Content-Length`` (411
  for a chunked body), and a JSON object nested at most :data:`MAX_JSON_DEPTH` levels (400);
- a connection that sends nothing for :data:`SOCKET_TIMEOUT_S` seconds is closed.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs

from kvframe_refengine.engine import check_request_id
from kvframe_refengine.tokenizer import encode

__all__ = [
    "LISTEN_BACKLOG",
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "Completion",
    "HTTPError",
    "JSONHandler",
    "Server",
    "parse_completion",
    "start",
]

LISTEN_BACKLOG = 1024
"""Connections the kernel queues before ``accept`` (the ``listen`` backlog): a router sends
every request it holds to its engines at once, so this is sized for bursts, not for 5."""
MAX_BODY_BYTES = 1 << 20
"""The largest request body accepted (1 MiB); a prompt of ``max_model_len`` tokens is a few
kilobytes."""
MAX_JSON_DEPTH = 32
"""How deeply a body's JSON may nest (the body object is level 1)."""
SOCKET_TIMEOUT_S = 60.0
"""A connection that sends nothing for this long (mid-request, or idle between keep-alive
requests) is closed, so a stalled client does not hold a thread for ever."""
DEFAULT_MAX_TOKENS = 16
DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 3600.0
_DRAIN_BYTES = 16 * MAX_BODY_BYTES
"""Up to this much of a too-large body is read and dropped, so that the client reads the 413
instead of a reset; beyond it the connection is simply closed."""


class HTTPError(Exception):
    """Answer the request with ``status`` and ``{"error": {"message", "type"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class Server(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a listen backlog of :data:`LISTEN_BACKLOG` and daemon
    threads (a stuck client never keeps the process alive)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True
    block_on_close = False


def start(host: str, port: int, handler: type[BaseHTTPRequestHandler], name: str) -> Server:
    """Bind ``host:port`` (0: any free port) and serve on a daemon thread named ``name``."""
    httpd = Server((host, port), handler)
    threading.Thread(target=httpd.serve_forever, name=name, daemon=True).start()
    return httpd


def _json_kind(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _too_deep(value: object) -> bool:
    # Iterative: a body may be nested just under json's own recursion limit.
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_object(data: bytes) -> dict[str, Any]:
    """The body as a JSON object; raises :class:`HTTPError` (400) saying what is wrong."""
    deep = HTTPError(
        400, f"the JSON body is nested too deeply; at most {MAX_JSON_DEPTH} levels are accepted"
    )
    if not data.strip():
        return {}
    try:
        body = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise deep from None
    except UnicodeDecodeError as exc:
        raise HTTPError(400, f"the body is not valid JSON: it is not UTF-8 text ({exc})") from None
    except ValueError as exc:
        raise HTTPError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(
            400, f"the body must be a JSON object ({{...}}), not a JSON {_json_kind(body)}"
        )
    if _too_deep(body):
        raise deep
    return body


class JSONHandler(BaseHTTPRequestHandler):
    """Routes ``GET`` and ``POST`` to :meth:`get` and :meth:`post`, which answer with
    :meth:`send_json` or raise :class:`HTTPError`; any other exception is answered 500 with
    its type and message, never with a dropped connection."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm the body waited for
    # the client's delayed ACK (up to 40 ms per answer, measured by kvframe bench push).
    disable_nagle_algorithm = True
    timeout = SOCKET_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def get(self) -> None:
        raise HTTPError(404, f"no route GET {self.path}", "not_found")

    def post(self) -> None:
        raise HTTPError(404, f"no route POST {self.path}", "not_found")

    def do_GET(self) -> None:
        self._answer(self.get)

    def do_POST(self) -> None:
        self._answer(self.post)

    def _answer(self, route: Callable[[], None]) -> None:
        self._sent = False
        try:
            route()
        except HTTPError as exc:
            self.send_error_json(exc.status, exc.message, exc.kind)
        except Exception as exc:
            self.close_connection = True
            self.send_error_json(
                500, f"internal error: {type(exc).__name__}: {exc}", "internal_error"
            )

    def send_json(self, code: int, body: Any, ctype: str = "application/json") -> None:
        """Answer ``body`` (a str is sent as it is, anything else as JSON)."""
        if self._sent:  # an error after the answer went out: nothing more can be said
            self.close_connection = True
            return
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self._sent = True
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, code: int, message: str, kind: str) -> None:
        self.send_json(code, {"error": {"message": message, "type": kind}})

    def read_json_object(self) -> dict[str, Any]:
        """The request's body as a JSON object. Raises :class:`HTTPError`: 411 for a chunked
        body, 400 for a bad ``Content-Length`` or a body that is not a JSON object (or nests
        too deeply), 413 for one over :data:`MAX_BODY_BYTES`."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise HTTPError(
                411,
                "chunked request bodies are not accepted; send the body with a Content-Length "
                "header",
                "length_required",
            )
        declared = self.headers.get("Content-Length")
        length = 0
        if declared is not None:
            try:
                length = int(declared)
                if length < 0:
                    raise ValueError
            except ValueError:
                self.close_connection = True
                raise HTTPError(
                    400, f"Content-Length {declared!r} is not a byte count (an integer >= 0)"
                ) from None
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._drain(length)
            raise HTTPError(
                413,
                f"the request body is {length} bytes; at most {MAX_BODY_BYTES} bytes are "
                "accepted; send a shorter prompt",
                "body_too_large",
            )
        data = self.rfile.read(length) if length else b""
        if len(data) < length:
            self.close_connection = True
            raise HTTPError(
                400, f"the body ended after {len(data)} of the {length} bytes in Content-Length"
            )
        return parse_json_object(data)

    def _drain(self, length: int) -> None:
        if length > _DRAIN_BYTES:
            return
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 16))
            if not chunk:
                return
            length -= len(chunk)


@attrs.frozen(kw_only=True)
class Completion:
    """A checked ``POST /v1/completions`` body."""

    prompt: list[int]
    max_tokens: int
    request_id: str | None
    kv_transfer_params: dict[str, Any] | None
    timeout_s: float


def _bad(field: str, value: object, expected: str) -> HTTPError:
    shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:60]}..."
    return HTTPError(400, f"{field} = {shown} (a JSON {_json_kind(value)}); expected {expected}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_completion(body: dict[str, Any]) -> Completion:
    """Check every field this API reads; raises :class:`HTTPError` (400) naming the first bad
    one, its value and what is expected. Fields it does not read (``temperature``, ...) are
    ignored, as OpenAI clients send them."""
    prompt = body.get("prompt")
    expected = "a non-empty string or a non-empty list of token ids (ints >= 0)"
    if prompt is None:
        raise HTTPError(400, f"prompt is required: {expected}")
    if isinstance(prompt, str):
        if not prompt:
            raise HTTPError(400, f"prompt is empty; expected {expected}")
        tokens = encode(prompt)
    elif isinstance(prompt, list):
        if not prompt:
            raise HTTPError(400, f"prompt is empty; expected {expected}")
        bad = next((t for t in prompt if not _is_int(t) or t < 0), None)
        if bad is not None:
            raise HTTPError(
                400,
                f"prompt holds {bad!r} (a JSON {_json_kind(bad)}); expected {expected} "
                "(one prompt per request: batches of prompts are not accepted)",
            )
        tokens = list(prompt)
    else:
        raise _bad("prompt", prompt, expected)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise _bad("max_tokens", max_tokens, "an integer >= 1")
    request_id = body.get("request_id")
    if request_id is not None:
        if not isinstance(request_id, str):
            raise _bad("request_id", request_id, "a string (or leave it out)")
        try:
            check_request_id(request_id)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise _bad("kv_transfer_params", params, "a JSON object or null")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", stream, "true or false")
    if stream:
        raise HTTPError(
            400,
            "stream = true is not supported: the answer comes once, when the completion is "
            "done; send stream = false or leave it out",
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", model, "a string (it is not used: one model is served)")
    timeout_s = body.get("timeout_s")
    if timeout_s is None:
        timeout_s = DEFAULT_TIMEOUT_S
    elif (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or not 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise _bad("timeout_s", timeout_s, f"seconds, a number in (0, {MAX_TIMEOUT_S:g}]")
    return Completion(
        prompt=tokens,
        max_tokens=max_tokens,
        request_id=request_id,
        kv_transfer_params=params,
        timeout_s=float(timeout_s),
    )
