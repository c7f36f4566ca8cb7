"""The HTTP servers answer every bad request with a 4xx JSON error that names the problem, both
the engine server and the router; a long request id is refused at the door; a step that raises
fails its requests and the engine keeps serving; a dead engine loop shows in ``/health`` and in
a prompt 503 for every request; the connector's scheduler-side counters show in ``/stats`` and
``/metrics``."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.refengine._http import Served, complete, engine_server, request, router_server

OK_BODY: dict[str, Any] = {"prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def solo() -> Iterator[Served]:
    """One engine without a connector."""
    with engine_server(None) as served:
        yield served


@pytest.fixture(scope="module")
def routed(solo: Served) -> Iterator[Served]:
    """A router with the solo engine as both its prefill and its decode engine."""
    with router_server(solo.url, solo.url) as served:
        yield served


@pytest.fixture(params=["engine", "router"])
def target(request: pytest.FixtureRequest, solo: Served, routed: Served) -> Served:
    return solo if request.param == "engine" else routed


def _assert_error(answer: tuple[int, Any], status: int, *words: str) -> str:
    code, body = answer
    assert code == status, body
    assert isinstance(body, dict), body
    message = body["error"]["message"]
    assert isinstance(body["error"]["type"], str)
    for word in words:
        assert word in message, message
    return str(message)


DEEP = b'{"prompt": "a", "kv_transfer_params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _nested(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


NESTED_40 = {"prompt": "a", "kv_transfer_params": {"a": _nested(38)}}  # 40 levels in all


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{nope", ["not valid JSON"]),
        (b"\xff\xfe\x00garbage", ["JSON"]),
        (b'{"prompt": NaN}', ["not valid JSON", "NaN"]),
        (b"[1, 2]", ["JSON object", "array"]),
        (b'"text"', ["JSON object", "string"]),
        (DEEP, ["nested", "32"]),
        (NESTED_40, ["nested", "32"]),
    ],
    ids=["not-json", "not-utf8", "nan", "array", "string", "deep-100k", "deep-40"],
)
def test_a_body_that_is_not_a_json_object_is_a_400(
    target: Served, body: bytes | dict[str, Any], words: list[str]
) -> None:
    _assert_error(complete(target, body), 400, *words)
    assert complete(target, OK_BODY)[0] == 200  # and it still serves


_BAD_FIELDS: list[tuple[dict[str, Any], list[str]]] = [
    ({}, ["prompt", "required"]),
    ({"prompt": None}, ["prompt", "required"]),
    ({"prompt": 5}, ["prompt", "int"]),
    ({"prompt": ""}, ["prompt", "empty"]),
    ({"prompt": []}, ["prompt", "empty"]),
    ({"prompt": {"text": "a"}}, ["prompt", "object"]),
    ({"prompt": ["a", "b"]}, ["prompt", "token ids"]),
    ({"prompt": [1, 2.5]}, ["prompt", "2.5"]),
    ({"prompt": [1, True]}, ["prompt", "True"]),
    ({"prompt": [[1, 2]]}, ["prompt", "token ids"]),
    ({"prompt": "a", "max_tokens": "5"}, ["max_tokens", "'5'"]),
    ({"prompt": "a", "max_tokens": 0}, ["max_tokens", ">= 1"]),
    ({"prompt": "a", "max_tokens": 2.0}, ["max_tokens", "2.0"]),
    ({"prompt": "a", "max_tokens": True}, ["max_tokens", "True"]),
    ({"prompt": "a", "request_id": 5}, ["request_id", "string"]),
    ({"prompt": "a", "request_id": ""}, ["request_id", "128"]),
    ({"prompt": "a", "request_id": "a\nb"}, ["request_id", "printable"]),
    ({"prompt": "a", "request_id": ["r"]}, ["request_id", "string"]),
    ({"prompt": "a", "kv_transfer_params": "do_remote_decode"}, ["kv_transfer_params", "object"]),
    ({"prompt": "a", "kv_transfer_params": [1]}, ["kv_transfer_params", "object"]),
    ({"prompt": "a", "stream": "yes"}, ["stream", "true or false"]),
    ({"prompt": "a", "stream": 1}, ["stream", "true or false"]),
    ({"prompt": "a", "stream": True}, ["stream", "not supported"]),
    ({"prompt": "a", "timeout_s": "soon"}, ["timeout_s", "seconds"]),
    ({"prompt": "a", "timeout_s": 0}, ["timeout_s", "seconds"]),
    ({"prompt": "a", "timeout_s": True}, ["timeout_s", "seconds"]),
    ({"prompt": "a", "model": 7}, ["model", "string"]),
]


@pytest.mark.parametrize(
    ("body", "words"),
    _BAD_FIELDS,
    ids=[f"{i}-{'-'.join(sorted(b))}" for i, (b, _) in enumerate(_BAD_FIELDS)],
)
def test_a_wrongly_typed_field_is_a_400_naming_it(
    target: Served, body: dict[str, Any], words: list[str]
) -> None:
    _assert_error(complete(target, body), 400, *words)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": [1, 100_000]}, ["100000", "[0, 512)"]),
        ({"prompt": "a", "max_tokens": 100_000}, ["max_model_len"]),
    ],
    ids=["token-outside-vocab", "too-long"],
)
def test_what_only_the_engine_can_check_is_a_400_through_the_router_too(
    target: Served, body: dict[str, Any], words: list[str]
) -> None:
    _assert_error(complete(target, body), 400, *words)


def test_a_body_over_the_limit_is_a_413(target: Served) -> None:
    big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    _assert_error(complete(target, big), 413, "1048576", "bytes")
    assert complete(target, OK_BODY)[0] == 200


@pytest.mark.parametrize(
    ("headers", "status", "words"),
    [
        ({"Content-Length": "many"}, 400, ["Content-Length", "'many'"]),
        ({"Content-Length": "-3"}, 400, ["Content-Length", "'-3'"]),
        ({"Transfer-Encoding": "chunked"}, 411, ["Content-Length"]),
    ],
    ids=["not-a-number", "negative", "chunked"],
)
def test_a_bad_content_length_is_a_4xx(
    target: Served, headers: dict[str, str], status: int, words: list[str]
) -> None:
    # http.client would fill in a correct Content-Length: send the request line by hand.
    import socket

    with socket.create_connection(("127.0.0.1", target.port), timeout=30) as s:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
        if "Transfer-Encoding" in headers:
            s.sendall(b"5\r\nhello\r\n0\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    import json

    head_text, _, payload = data.partition(b"\r\n\r\n")
    code = int(head_text.split()[1])
    _assert_error((code, json.loads(payload)), status, *words)


def test_unknown_routes_are_a_404_json_error(target: Served) -> None:
    _assert_error(request(target, "GET", "/v2/nothing"), 404, "/v2/nothing")
    _assert_error(request(target, "POST", "/v1/chat", OK_BODY), 404, "/v1/chat")


# -- request ids ------------------------------------------------------------------------------


def test_a_long_request_id_is_a_400_and_the_engine_keeps_serving(target: Served) -> None:
    message = _assert_error(
        complete(target, {**OK_BODY, "request_id": "x" * 240}), 400, "request_id", "128", "240"
    )
    assert "shorter" in message
    code, body = complete(target, {**OK_BODY, "request_id": "r" * 128})
    assert code == 200, body
    assert request(target, "GET", "/health")[0] == 200


def test_request_ids_at_the_limit_travel_from_p_to_d() -> None:
    """The bug this guards: a 240-character id sent to P made P's lease id too long for the
    heartbeat wire format, which killed D's engine thread for good."""
    with engine_server("kv_producer") as p, engine_server("kv_consumer") as d:
        code, body = complete(p, {**OK_BODY, "request_id": "x" * 240})
        assert code == 400, body
        rid = "é" * 64  # 128 UTF-8 bytes
        code, body = complete(
            p, {"prompt": "a prompt of a few tokens", "max_tokens": 1, "request_id": rid,
                "kv_transfer_params": {"do_remote_decode": True}}
        )  # fmt: skip
        assert code == 200, body
        assert body["id"] == rid
        code, body = complete(
            d, {"prompt": "a prompt of a few tokens", "max_tokens": 3, "request_id": rid,
                "kv_transfer_params": body["kv_transfer_params"]}
        )  # fmt: skip
        assert code == 200, body
        assert body["usage"]["external_tokens"] > 0  # the KV came from P
        for side in (p, d):
            assert request(side, "GET", "/health")[0] == 200


# -- a step that raises, a loop that dies -------------------------------------------------------


def test_a_step_that_raises_fails_its_request_and_the_engine_keeps_serving() -> None:
    with engine_server(None) as served:
        assert served.service is not None
        runner = served.service.engine.runner
        real = runner.execute
        calls = {"n": 0}

        def execute_once_broken(batch: Any) -> Any:
            if batch.seqs and calls["n"] == 0:
                calls["n"] += 1
                raise RuntimeError("injected fault in the forward pass")
            return real(batch)

        runner.execute = execute_once_broken  # type: ignore[method-assign]
        message = _assert_error(complete(served, OK_BODY), 500, "injected fault", "step")
        assert "RuntimeError" in message
        code, body = complete(served, OK_BODY)
        assert code == 200, body
        code, health = request(served, "GET", "/health")
        assert code == 200, health
        assert health["step_failures"] == 1
        assert request(served, "GET", "/leaks")[1]["clean"]


class _Fatal(BaseException):
    """Not an Exception: nothing but the thread's own handler sees it."""


@pytest.mark.parametrize("fault", [RuntimeError, _Fatal], ids=["exception", "base-exception"])
def test_a_dead_engine_loop_shows_in_health_and_every_request_gets_503(
    fault: type[BaseException],
) -> None:
    with engine_server(None) as served:
        service = served.service
        assert service is not None
        engine = service.engine
        real = engine.has_unfinished_work
        armed = threading.Event()

        def broken() -> bool:
            if armed.is_set():
                raise fault("injected: the loop's own code broke")
            return real()

        engine.has_unfinished_work = broken  # type: ignore[method-assign]
        # A request already waiting when the loop dies is answered too, not left hanging.
        waiting: dict[str, Any] = {}

        def send() -> None:
            waiting["answer"] = complete(served, {"prompt": "a", "max_tokens": 2000 - 2})

        t = threading.Thread(target=send)
        t.start()
        time.sleep(0.3)
        armed.set()
        t.join(timeout=30)
        assert not t.is_alive(), "a request in flight when the loop died was never answered"
        _assert_error(waiting["answer"], 503, "engine loop died", "injected")
        t0 = time.monotonic()
        _assert_error(complete(served, OK_BODY), 503, "engine loop died", "injected")
        assert time.monotonic() - t0 < 5
        code, health = request(served, "GET", "/health")
        assert code == 503, health
        assert health["ok"] is False
        assert "engine loop died" in health["error"]["message"]
        assert "injected" in health["error"]["message"]
        engine.has_unfinished_work = real  # type: ignore[method-assign]


def test_a_request_that_outlives_its_timeout_is_a_504_and_is_aborted() -> None:
    with engine_server(None) as served:
        message = _assert_error(
            complete(served, {"prompt": "a", "max_tokens": 1500, "timeout_s": 0.05}),
            504,
            "0.05",
        )
        assert "aborted" in message
        deadline = time.monotonic() + 30
        while not request(served, "GET", "/leaks")[1]["clean"]:
            assert time.monotonic() < deadline, "the timed-out request was never aborted"
            time.sleep(0.05)


# -- connector statistics ---------------------------------------------------------------------


def test_scheduler_side_connector_counters_show_in_stats_and_metrics() -> None:
    """``remote_requests`` is counted by the P/D connector's scheduler half: it must accumulate
    in ``/stats`` and ``/metrics`` however often they are read."""
    with engine_server("kv_producer") as p, engine_server("kv_consumer") as d:
        for n in (1, 2):
            text_prompt = f"a prompt of a few tokens, number {n}"
            code, body = complete(
                p, {"prompt": text_prompt, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}
            )  # fmt: skip
            assert code == 200, body
            code, body = complete(
                d, {"prompt": text_prompt, "max_tokens": 2,
                    "kv_transfer_params": body["kv_transfer_params"]}
            )  # fmt: skip
            assert code == 200, body
            for _ in range(2):  # reading twice must not reset the counter
                stats = request(d, "GET", "/stats")[1]
                assert stats["connector_scheduler"]["counters"]["remote_requests"] == n, stats
                assert "scheduler_leases_held" in stats["connector_scheduler"]["gauges"]
                code, text = request(d, "GET", "/metrics")
                assert code == 200
                eid = stats["engine_id"]
                line = f'kvframe_scheduler_remote_requests_total{{engine_id="{eid}"}} {n}.0'
                assert line in text.splitlines(), text
        assert "connector" in stats  # the worker's, as before


# -- admission: the connector's check_request -------------------------------------------------


def test_kv_transfer_params_the_connector_refuses_are_a_400_at_admission() -> None:
    """An engine asks its connector (``check_request``) before it allocates anything: refused
    ``kv_transfer_params`` are a 400 naming the problem, directly and through the router
    (never a 502, never a 200), and the engine keeps serving."""
    from kvframe.errors import ConfigError

    with engine_server("kv_producer") as p, engine_server("kv_consumer") as d:
        assert d.service is not None
        sched = d.service.engine.connector_scheduler
        assert sched is not None
        seen: list[str] = []

        def refuse(view: Any) -> None:
            seen.append(view.request_id)
            if view.kv_transfer_params and "kvframe_test_refuse" in view.kv_transfer_params:
                raise ConfigError("kv_transfer_params.kvframe_test_refuse: refused by the test")

        sched.check_request = refuse  # type: ignore[method-assign,assignment]
        bad = {**OK_BODY, "kv_transfer_params": {"kvframe_test_refuse": True}}
        message = _assert_error(complete(d, bad), 400, "kvframe_test_refuse", "refused")
        assert message.startswith("kv_transfer_params refused")
        assert complete(d, bad)[1]["error"]["type"] == "invalid_kv_transfer_params"
        stats = request(d, "GET", "/stats")[1]
        assert stats["engine"]["requests_refused"] == 2, stats
        assert request(d, "GET", "/leaks")[1]["clean"]  # nothing was allocated or kept
        # Through the router: D's 400 reaches the client as a 400.
        real = sched.check_request

        def refuse_all(view: Any) -> None:
            if view.kv_transfer_params and view.kv_transfer_params.get("do_remote_prefill"):
                raise ConfigError("kv_transfer_params.kvframe_ticket: refused by the test")
            real(view)

        sched.check_request = refuse_all  # type: ignore[method-assign,assignment]
        with router_server(p.url, d.url) as routed:
            _assert_error(complete(routed, OK_BODY), 400, "decode engine", "kvframe_ticket")
        assert complete(d, OK_BODY)[0] == 200  # and it still serves
        assert seen


class _BrokenEngine:
    """A TCP server that reads one request and answers with ``reply`` (raw bytes), then closes
    the connection: an engine that dies while it answers."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            b'{"id": ',
            "closed in the middle of the answer (7 bytes of the body came, 93 more",
        ),
        (b"SSH-2.0-OpenSSH\r\n", "the answer is not HTTP (BadStatusLine"),
    ],
    ids=["died-mid-body", "not-http"],
)
def test_an_engine_that_breaks_off_its_answer_is_unreachable_not_a_router_error(
    reply: bytes, why: str
) -> None:
    from kvframe_refengine import router as router_mod

    broken = _BrokenEngine(reply)
    try:
        with pytest.raises(ConnectionError, match=re.escape(why)):
            router_mod.post_json(f"{broken.url}/v1/completions", OK_BODY, timeout=10)
        with router_server(broken.url, broken.url) as routed:
            message = _assert_error(complete(routed, OK_BODY), 502, "cannot be reached", why)
            assert message.startswith("the prefill engine at "), message
            code, body = request(routed, "GET", "/health")
            assert code == 200, body
    finally:
        broken.close()
