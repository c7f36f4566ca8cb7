"""The P/D router: one OpenAI-style endpoint in front of a prefill and a decode engine.

::

    python -m kvframe_refengine.router --port 8100 \\
        --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102 [--mode push]

**Pull mode** (``--mode pull``, the default). For each ``POST /v1/completions`` it asks the
prefill engine for one token with ``kv_transfer_params={"do_remote_decode": true}``, then sends
the original request to the decode engine with the ``kv_transfer_params`` the prefill engine
returned, and answers with the decode engine's response (plus ``router_timing``). This is the
contract vLLM's routing proxies follow, so they work with kvframe's P/D connector too.

**Push mode** (``--mode push``). The router makes a push id per request
(``secrets.token_urlsafe(16)``) and sends both legs at once, the prefill leg on a thread of
its own:

- prefill leg: the request with ``max_tokens`` 1 and ``kv_transfer_params={"do_remote_decode":
  true, "transfer_mode": "push", "push_id": X}``;
- decode leg: the original request with ``kv_transfer_params={"do_remote_prefill": true,
  "transfer_mode": "push", "push_id": X, **address}``, ``address`` being the prefill engine's
  ``GET /v1/kv_address``. The router fetches it once and keeps it; it forgets it (and fetches
  it again for the next request) after a push request whose leg failed or whose decode engine
  loaded nothing from P (``usage.external_tokens`` 0: for instance a restarted P, whose new
  incarnation the kept address does not name).

It answers with the decode engine's response once both legs answered. When the prefill leg
failed but the decode engine still answered 200 (its push was refused or never came, so it
prefilled the prompt itself, under ``kv_load_failure_policy: recompute``), the answer is that
200 with ``prefill_error`` (``{"status", "message", "type"}``) added and the prefill failure
counted as in pull mode (``kvframe_router_backend_failures_total{backend="prefill"}``, the
``failed`` count of ``/health``). When the decode leg failed, its error is the answer (naming
the prefill leg's failure too, when there was one).

**Conversations** (multi-turn, bidirectional mode). A request may carry ``"conversation_id"``
(1 to 128 characters of ``A-Z a-z 0-9 _ . : -``; anything else is a 400 naming the field). A
turn's prompt is the whole conversation so far (history, answers, the new message), as with
OpenAI-style APIs. With a conversation id the router:

- adds ``"keep_for_next_turn": true`` to D's leg, so that D keeps the conversation's KV after
  it answers and returns a ticket of it in its final ``kv_transfer_params`` (with
  ``kept_until`` on D's clock and ``kept_ttl``);
- keeps that ticket for the conversation (:class:`Conversations`: at most
  :data:`MAX_CONVERSATIONS`, least recently used dropped first; a ticket is dropped
  ``kept_ttl`` seconds after D answered, by the router's own monotonic clock);
- on the conversation's next turn sends P ``{"do_remote_decode": true, "kv_history":
  <the ticket, verbatim>}`` (push mode adds ``transfer_mode`` and ``push_id`` as usual) and
  forgets the ticket (it serves one turn: P's read frees D's kept blocks). P checks that the
  new prompt starts with the tokens the ticket covers (its digest) and recomputes when it does
  not; the router does not compare prompts.

The answer then carries ``conversation``: ``{"id", "history_sent": bool, "kept": bool}``
(whether P got a ticket, whether D returned one for the next turn), and ``prefill_usage``
(P's ``usage``: its ``external_tokens`` are the tokens P pulled from D). With
``history=False`` (``--no-history``, the recompute side of a benchmark) conversations are
served the same way but P never gets ``kv_history`` and D is not asked to keep anything
(nobody would read it).

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
import http.client
import json
import math
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from http.server import ThreadingHTTPServer
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvframe.errors import ConfigError, PluginError
from kvframe.runtime.metrics import CONTENT_TYPE
from kvframe_refengine import _http
from kvframe_refengine._http import HTTPError
from kvframe_refengine.fleet import POLICIES, FleetTable, KVEventPoller, Member, watch_fleet

__all__ = [
    "MAX_CONVERSATIONS",
    "MODES",
    "Conversations",
    "Router",
    "RouterMetrics",
    "check_conversation_id",
    "get_json",
    "main",
    "post_json",
    "serve",
]

MODES = ("pull", "push")
"""The router's modes: ``pull`` (prefill, then decode) and ``push`` (both legs at once)."""

MAX_CONVERSATIONS = 10_000
"""The most conversations whose D ticket the router keeps at once (least recently used first
out)."""
_CONVERSATION_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

_PASSED_THROUGH = frozenset({400, 413})
"""An engine's answers that are about the request itself: the client gets them as they are."""
_UPSTREAM_MARGIN_S = 5.0
"""How much longer than the request's ``timeout_s`` the router waits for an engine (whose own
504 then arrives first)."""


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON; returns (status, decoded JSON). Raises ``OSError`` when the server
    cannot be reached, closes the connection before its answer is complete (it died while
    answering) or answers something that is not HTTP (``TimeoutError`` when it does not answer
    in ``timeout`` seconds) and ``ValueError`` when a 2xx answer is not JSON."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return _send(req, timeout)


def get_json(url: str, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    """GET ``url``; returns (status, decoded JSON), raising as :func:`post_json` does."""
    return _send(urllib.request.Request(url), timeout)


def _send(req: urllib.request.Request, timeout: float) -> tuple[int, dict[str, Any]]:
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
    except http.client.IncompleteRead as exc:
        # The server died (or closed) between its headers and the end of its body: a broken
        # connection, like one that closed before the headers (RemoteDisconnected, an OSError).
        raise ConnectionError(
            f"the connection closed in the middle of the answer ({len(exc.partial)} bytes "
            f"of the body came, {exc.expected} more were announced)"
        ) from exc
    except http.client.HTTPException as exc:
        raise ConnectionError(
            f"the answer is not HTTP ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc


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


def check_conversation_id(value: object) -> str | None:
    """``value`` if it is a usable conversation id (1 to 128 characters of ``A-Z a-z 0-9 _ .
    : -``), ``None`` for ``None``; raises :class:`~kvframe_refengine._http.HTTPError` (400)
    naming the field, its value and what is expected."""
    if value is None:
        return None
    if isinstance(value, str) and _CONVERSATION_ID.fullmatch(value):
        return value
    shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:60]}..."
    kind = "string" if isinstance(value, str) else type(value).__name__
    raise HTTPError(
        400,
        f"conversation_id = {shown} (a {kind}); expected 1 to 128 characters of A-Z a-z 0-9 "
        "_ . : - (or leave it out for a single-turn request)",
    )


def _ttl(params: Mapping[str, Any]) -> float | None:
    ttl = params.get("kept_ttl")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        return None
    return float(ttl) if math.isfinite(ttl) and ttl > 0 else None


class Conversations:
    """The D ticket of each conversation's latest turn, until its next turn takes it.

    Sans-I/O: every call takes ``now`` (the router's monotonic clock). At most ``capacity``
    conversations; putting one more drops the least recently used (put or taken). A ticket is
    dropped ``kept_ttl`` seconds (its own field) after ``now`` of its :meth:`put`: D frees its
    blocks by then, and the router cannot read D's clock (``kept_until``). Not thread-safe:
    the router calls it under its lock.
    """

    def __init__(self, capacity: int = MAX_CONVERSATIONS) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity = {capacity!r}; it must be a positive int")
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[dict[str, Any], float]] = OrderedDict()
        self.dropped_lru = 0
        """Tickets dropped to make room."""
        self.dropped_expired = 0
        """Tickets dropped because their ``kept_ttl`` had passed."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, conversation_id: object) -> bool:
        return conversation_id in self._entries

    def put(self, conversation_id: str, params: object, now: float) -> bool:
        """Keep ``params`` (D's final ``kv_transfer_params``) for the conversation's next turn;
        returns whether it was kept: only a mapping with a positive finite ``kept_ttl`` is (D
        kept nothing otherwise), and the conversation's older ticket is dropped either way."""
        self._entries.pop(conversation_id, None)
        if not isinstance(params, Mapping):
            return False
        ttl = _ttl(params)
        if ttl is None:
            return False
        self._entries[conversation_id] = (dict(params), now + ttl)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.dropped_lru += 1
        return True

    def take(self, conversation_id: str, now: float) -> dict[str, Any] | None:
        """The conversation's ticket, removed (it serves one turn), or ``None`` when there is
        none or it expired."""
        entry = self._entries.pop(conversation_id, None)
        if entry is None:
            return None
        params, expires = entry
        if now >= expires:
            self.dropped_expired += 1
            return None
        return params

    def expire(self, now: float) -> int:
        """Drop every ticket whose ``kept_ttl`` has passed; returns how many."""
        gone = [cid for cid, (_, expires) in self._entries.items() if now >= expires]
        for cid in gone:
            del self._entries[cid]
        self.dropped_expired += len(gone)
        return len(gone)


@attrs.frozen
class _Turn:
    """What a request's conversation adds to its legs."""

    conversation_id: str | None
    history: dict[str, Any] | None = None
    """D's ticket of the previous turn, for P's ``kv_history``."""

    def prefill_params(self, params: dict[str, Any]) -> dict[str, Any]:
        return params if self.history is None else {**params, "kv_history": self.history}

    def decode_params(self, params: Any, keep: bool) -> Any:
        if self.conversation_id is None or not keep:
            return params
        return {**(params if isinstance(params, dict) else {}), "keep_for_next_turn": True}


@attrs.define
class _Target:
    """One engine a request's leg goes to, and what became of it."""

    url: str
    member: Member | None = None
    """In fleet mode, the engine as the fleet table knows it."""
    ok: bool = False
    """It answered 200."""
    down: bool = False
    """It could not be reached, or answered 503 (its engine loop died): retry elsewhere."""


class _NoEngine(Exception):
    def __init__(self, status: int, answer: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.answer = answer


class Router:
    """Routes completions through prefill and decode: one after the other (``mode="pull"``)
    or both at once (``mode="push"``, see the module's docstring).

    ``history`` False: conversations get no ``kv_history`` pull (see the module's docstring);
    ``max_conversations``: :class:`Conversations`' capacity; ``clock``: the router's
    monotonic clock for the tickets' ``kept_ttl``."""

    def __init__(
        self,
        prefill: str | None = None,
        decode: str | None = None,
        *,
        fleet: FleetTable | None = None,
        retries: int | None = None,
        mode: str = "pull",
        history: bool = True,
        max_conversations: int = MAX_CONVERSATIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if (fleet is None) != (prefill is not None and decode is not None) or (
            fleet is not None and (prefill is not None or decode is not None)
        ):
            raise ValueError(
                "give either prefill and decode (one engine each) or fleet (engines found "
                "through discovery), not both"
            )
        if retries is None:
            retries = 0 if fleet is None else 2
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries = {retries!r}; it must be an int >= 0")
        self.prefill = "" if prefill is None else prefill.rstrip("/")
        self.decode = "" if decode is None else decode.rstrip("/")
        self.fleet = fleet
        """In fleet mode, the engines discovery reported (``None``: one P and one D)."""
        self.retries = retries
        """How many more times a request whose engine was unreachable or dead is routed
        again from the start (fleet mode; default 2; 0 with one P and one D)."""
        self.retried = 0
        """Requests routed again after an engine was found dead."""
        self.mode = mode
        self.history = history
        self.conversations = Conversations(max_conversations)
        """Each conversation's D ticket between turns (touched under ``_lock``)."""
        self._clock = clock
        self.routed = 0
        self.failed = 0
        self.metrics = RouterMetrics()
        self._lock = threading.Lock()
        self._addresses: dict[str, dict[str, Any]] = {}
        self._fetching = threading.Lock()
        self.address_fetches = 0
        """How many times push mode fetched the prefill engine's ``/v1/kv_address``."""

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
            conversation_id = check_conversation_id(body.get("conversation_id"))
        except HTTPError as exc:
            return exc.status, _error(exc.message, exc.kind)
        body = {k: v for k, v in body.items() if k != "conversation_id"}
        turn = self._turn(conversation_id)
        timeout = checked.timeout_s + _UPSTREAM_MARGIN_S
        dead: set[str] = set()
        for attempt in range(1 + self.retries):
            try:
                p, d = self._targets(checked.prompt, dead)
            except _NoEngine as exc:
                return exc.status, exc.answer
            try:
                if self.mode == "push":
                    code, d_resp, p_resp = self._complete_push(body, timeout, turn, p, d)
                else:
                    code, d_resp, p_resp = self._complete_pull(body, timeout, turn, p, d)
            finally:
                self._release(p, d, checked.prompt)
            down = [t.member for t in (p, d) if t.down and t.member is not None]
            if not down or attempt == self.retries:
                break
            # An engine died or could not be reached before answering: nothing of this
            # request was served. Route it again from the start (a fresh prefill leg: a dead
            # decoder's ticket is never reused) on other engines.
            dead.update(m.engine_id for m in down)
            with self._lock:
                self.retried += 1
        if code == 200:
            self._end_turn(turn, d_resp, p_resp)
        return code, d_resp

    # -- choosing engines --------------------------------------------------------------------
    def _targets(self, prompt: list[int], dead: set[str]) -> tuple[_Target, _Target]:
        # Raises _NoEngine when the fleet has no live engine for a leg.
        if self.fleet is None:
            return _Target(self.prefill), _Target(self.decode)
        p = self.fleet.pick("prefill", prompt, dead)
        if p is None:
            raise self._no_engine("prefill", dead)
        d = self.fleet.pick("decode", prompt, dead)
        if d is None:
            self.fleet.done(p)
            raise self._no_engine("decode", dead)
        return _Target(p.url, p), _Target(d.url, d)

    def _no_engine(self, side: str, dead: set[str]) -> _NoEngine:
        self.metrics.backend_failures.labels(side, "unreachable").inc()
        with self._lock:
            self.failed += 1
        also = f" (found dead: {', '.join(sorted(dead))})" if dead else ""
        return _NoEngine(
            503,
            _error(
                f"no live {side} engine in the fleet{also}; start one registered with the same "
                "discovery URL (--discovery)",
                f"no_{side}_engine",
            ),
        )

    def _release(self, p: _Target, d: _Target, prompt: list[int]) -> None:
        if self.fleet is None:
            return
        for t in (p, d):
            if t.member is None:
                continue
            if t.down:
                self.fleet.mark_down(t.member)
            self.fleet.done(t.member, served=prompt if t.ok else None)

    def _complete_pull(
        self, body: dict[str, Any], timeout: float, turn: _Turn, p: _Target, d: _Target
    ) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        t0 = time.monotonic()
        p_body = dict(body)
        p_body["max_tokens"] = 1
        p_params: dict[str, Any] = {"do_remote_decode": True}
        if d.member is not None:
            # Fleet mode: P aborts the lease at once if this decoder leaves before claiming it.
            p_params["decode_engine_id"] = d.member.engine_id
        p_body["kv_transfer_params"] = turn.prefill_params(p_params)
        p_body.pop("request_id", None)
        code, p_resp = self._ask("prefill", p, p_body, timeout)
        if code != 200:
            return code, p_resp, None
        t1 = time.monotonic()
        d_body = dict(body)
        d_body["kv_transfer_params"] = turn.decode_params(
            p_resp.get("kv_transfer_params"), self.history
        )
        code, d_resp = self._ask("decode", d, d_body, timeout)
        if code != 200:
            return code, d_resp, None
        t2 = time.monotonic()
        d_resp["router_timing"] = {
            "prefill_s": t1 - t0,
            "decode_s": t2 - t1,
            "decode_start_s": t1 - t0,
            "total_s": t2 - t0,
        }
        d_resp["prefill_id"] = p_resp.get("id")
        self._name_engines(d_resp, p, d, p_resp)
        with self._lock:
            self.routed += 1
        return 200, d_resp, p_resp

    @staticmethod
    def _name_engines(
        d_resp: dict[str, Any], p: _Target, d: _Target, p_resp: dict[str, Any] | None
    ) -> None:
        # Fleet mode: which engines served, and P's usage (its cached_tokens: prefix hits).
        if p.member is not None and d.member is not None:
            d_resp["engines"] = {"prefill": p.member.engine_id, "decode": d.member.engine_id}
            d_resp.setdefault("prefill_usage", None if p_resp is None else p_resp.get("usage"))

    # -- conversations ---------------------------------------------------------------------
    def _turn(self, conversation_id: str | None) -> _Turn:
        if conversation_id is None:
            return _Turn(None)
        with self._lock:
            now = self._clock()
            self.conversations.expire(now)
            ticket = self.conversations.take(conversation_id, now)
        return _Turn(conversation_id, ticket if self.history else None)

    def _end_turn(self, turn: _Turn, d_resp: dict[str, Any], p_resp: dict[str, Any] | None) -> None:
        if turn.conversation_id is None:
            return
        kept = False
        if self.history:
            with self._lock:
                kept = self.conversations.put(
                    turn.conversation_id, d_resp.get("kv_transfer_params"), self._clock()
                )
        d_resp["conversation"] = {
            "id": turn.conversation_id,
            "history_sent": turn.history is not None,
            "kept": kept,
        }
        d_resp["prefill_usage"] = None if p_resp is None else p_resp.get("usage")

    # -- push mode -------------------------------------------------------------------------
    def kv_address(
        self, timeout: float = 30.0, target: _Target | None = None
    ) -> tuple[int, dict[str, Any]]:
        """(200, the prefill engine's push address), kept after the first fetch; or the
        (status, error) to give the client (502/504 naming the prefill engine). One fetch at
        a time: requests that arrive meanwhile wait for it and use what it got. ``target``:
        which prefill engine (fleet mode; default the one prefill engine)."""
        target = target or _Target(self.prefill)
        with self._fetching:
            with self._lock:
                kept = self._addresses.get(target.url)
                if kept is not None:
                    return 200, kept
            return self._fetch_address(timeout, target)

    def _fetch_address(self, timeout: float, target: _Target) -> tuple[int, dict[str, Any]]:
        self.metrics.backend_requests.labels("prefill").inc()
        url = f"{target.url}/v1/kv_address"
        t0 = time.monotonic()
        try:
            code, resp = get_json(url, timeout=timeout)
        except TimeoutError:
            return self._fail(
                504, f"the prefill engine did not tell its push address within {timeout:g} s",
                "prefill", "timeout",
            )  # fmt: skip
        except OSError as exc:
            target.down = True
            return self._fail(
                502, f"the prefill engine at {target.url} cannot be reached: {exc}",
                "prefill", "unreachable",
            )  # fmt: skip
        except ValueError as exc:
            code, resp = 200, {"error": {"message": f"not JSON: {exc}"}}
        self.metrics.backend_seconds.labels("prefill").observe(time.monotonic() - t0)
        if code != 200 or "remote_engine_id" not in resp:
            err = resp.get("error")
            message = err.get("message", resp) if isinstance(err, dict) else resp
            return self._fail(
                502,
                f"the prefill engine answered GET /v1/kv_address with {code}: {message}; a "
                "push-mode router needs a prefill engine with the P/D connector (or run the "
                "router with --mode pull)",
                "prefill", "failed",
            )  # fmt: skip
        with self._lock:
            self._addresses[target.url] = dict(resp)
            self.address_fetches += 1
        return 200, dict(resp)

    def forget_address(self, url: str | None = None) -> None:
        """Drop the kept push address (of the prefill engine at ``url``; default every one):
        the next push request fetches it again."""
        with self._lock:
            if url is None:
                self._addresses.clear()
            else:
                self._addresses.pop(url, None)

    def _complete_push(
        self, body: dict[str, Any], timeout: float, turn: _Turn, p: _Target, d: _Target
    ) -> tuple[int, dict[str, Any], dict[str, Any] | None]:
        code, address = self.kv_address(target=p)
        if code != 200:
            return code, address, None
        push_id = secrets.token_urlsafe(16)
        p_body = dict(body)
        p_body["max_tokens"] = 1
        p_body["kv_transfer_params"] = turn.prefill_params(
            {"do_remote_decode": True, "transfer_mode": "push", "push_id": push_id}
        )
        p_body.pop("request_id", None)
        d_body = dict(body)
        d_body["kv_transfer_params"] = turn.decode_params(
            {"do_remote_prefill": True, "transfer_mode": "push", "push_id": push_id, **address},
            self.history,
        )
        t0 = time.monotonic()
        p_leg: Future[tuple[int, dict[str, Any], float]] = Future()

        def prefill() -> None:
            try:
                pc, pr = self._ask("prefill", p, p_body, timeout)
                p_leg.set_result((pc, pr, time.monotonic()))
            except BaseException as exc:  # handed over to the request's thread
                p_leg.set_exception(exc)

        threading.Thread(target=prefill, name="router-prefill-leg", daemon=True).start()
        d_code, d_resp = self._ask("decode", d, d_body, timeout)
        t_d = time.monotonic()
        p_code, p_resp, t_p = p_leg.result()
        t2 = time.monotonic()
        landed = d_code == 200 and (d_resp.get("usage") or {}).get("external_tokens", 0) > 0
        if p_code != 200 or not landed:
            self.forget_address(p.url)  # P may have restarted (a new incarnation): ask again
        if d_code != 200:
            if p_code != 200:
                err = dict(d_resp["error"])
                also = p_resp["error"]["message"]
                err["message"] = f"{err['message']} (the prefill leg failed too: {also})"
                return d_code, {"error": err}, None
            return d_code, d_resp, None
        d_resp["router_timing"] = {
            "prefill_s": t_p - t0,
            "decode_s": t_d - t0,
            "decode_start_s": 0.0,
            "total_s": t2 - t0,
        }
        d_resp["push_id"] = push_id
        self._name_engines(d_resp, p, d, p_resp if p_code == 200 else None)
        if p_code == 200:
            d_resp["prefill_id"] = p_resp.get("id")
        else:
            d_resp["prefill_id"] = None
            d_resp["prefill_error"] = {"status": p_code, **p_resp["error"]}
        with self._lock:
            self.routed += 1
        return 200, d_resp, p_resp if p_code == 200 else None

    def _ask(
        self, side: str, target: _Target, body: dict[str, Any], timeout: float
    ) -> tuple[int, dict[str, Any]]:
        """(200, the engine's answer), or the (status, error) to give the client; marks
        ``target`` ok (200) or down (unreachable, or 503: its engine loop died)."""
        base = target.url
        self.metrics.backend_requests.labels(side).inc()
        t0 = time.monotonic()
        try:
            code, resp = post_json(f"{base}/v1/completions", body, timeout=timeout)
        except TimeoutError:
            return self._fail(
                504, f"the {side} engine did not answer within {timeout:g} s", side, "timeout"
            )
        except OSError as exc:
            target.down = True
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
            target.ok = True
            return code, resp
        if code == 503:
            target.down = True
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
            health: dict[str, Any] = {
                "ok": True,
                "mode": router.mode,
                "routed": router.routed,
                "failed": router.failed,
            }
            if router.fleet is not None:
                health["retried"] = router.retried
                health["fleet"] = router.fleet.describe()
            self.send_json(200, health)

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
    ap.add_argument("--prefill", help="base URL of the prefill engine (one P and one D)")
    ap.add_argument("--decode", help="base URL of the decode engine (one P and one D)")
    ap.add_argument(
        "--discovery", metavar="URL",
        help="find the prefill and decode engines through this discovery backend instead "
        "(etcd://HOST:PORT, file:///DIRECTORY; the engines' --discovery)",
    )  # fmt: skip
    ap.add_argument(
        "--policy", choices=POLICIES, default="prefix",
        help="with --discovery: prefix (the engine that caches the longest prefix of the "
        "request, among the least loaded; default) or round_robin",
    )  # fmt: skip
    ap.add_argument(
        "--retries", type=int, default=None,
        help="with --discovery: how many more times a request whose engine was unreachable or "
        "dead is routed again from the start (default 2)",
    )  # fmt: skip
    ap.add_argument(
        "--max-imbalance", type=int, default=2,
        help="with --policy prefix: an engine is chosen for its prefix only while it has at "
        "most this many requests in flight more than the least loaded one (default 2)",
    )  # fmt: skip
    ap.add_argument(
        "--quarantine", type=float, default=10.0,
        help="seconds an engine a request found dead gets no request unless discovery "
        "reports it again (default 10)",
    )  # fmt: skip
    ap.add_argument(
        "--mode", choices=MODES, default="pull",
        help="pull: prefill, then decode (default); push: both legs at once, P writes into "
        "D's blocks",
    )  # fmt: skip
    ap.add_argument(
        "--no-history", action="store_true",
        help="serve conversations (conversation_id) without pulling their history from D: P "
        "recomputes every turn (the recompute side of a benchmark)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    static = args.prefill is not None and args.decode is not None
    with_fleet = args.discovery is not None and args.prefill is None and args.decode is None
    if not (static and args.discovery is None) and not with_fleet:
        ap.error("give --prefill and --decode (one engine each), or --discovery URL")
    table: FleetTable | None = None
    closers: list[Callable[[], None]] = []
    if args.discovery is not None:
        try:
            table = FleetTable(
                policy=args.policy, max_imbalance=args.max_imbalance, quarantine=args.quarantine
            )
            backend, watch = watch_fleet(args.discovery, table)
        except (ConfigError, PluginError) as exc:
            ap.error(f"--discovery {args.discovery}: {exc}")
        poller = KVEventPoller(table)
        closers = [poller.close, watch.cancel, backend.close]
    try:
        router = Router(
            args.prefill,
            args.decode,
            fleet=table,
            retries=args.retries,
            mode=args.mode,
            history=not args.no_history,
        )
    except ValueError as exc:
        ap.error(str(exc))
    httpd = serve(router, args.host, args.port)
    import signal

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(json.dumps({"ready": True, "port": int(httpd.server_address[1])}), flush=True)
    done.wait()
    httpd.shutdown()
    for close in closers:
        close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
