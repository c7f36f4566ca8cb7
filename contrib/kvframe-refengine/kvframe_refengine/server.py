"""One reference engine behind a small OpenAI-style HTTP API.

::

    python -m kvframe_refengine.server --port 8101 --engine-id P0 --role kv_producer \\
        --transport nixl --side-channel-port 5600

Endpoints (JSON in and out; the limits and error codes are in the docs' HTTP API section):

- ``POST /v1/completions`` — ``{"prompt": str | [int], "max_tokens": int,
  "kv_transfer_params": {...} | null, "request_id": str?, "timeout_s": float?}``; answers
  ``{"id", "choices": [{"text", "token_ids", "finish_reason"}], "kv_transfer_params", "usage",
  "timing"}``. A bad body answers 400 (411, 413) naming the field, and so do
  ``kv_transfer_params`` the connector refuses at admission (its ``check_request``; type
  ``invalid_kv_transfer_params``, nothing allocated); a request that fails in the
  engine (a failed KV load under policy ``fail``, a step that raised) 500; one not done in
  ``timeout_s`` 504 (it is aborted); a dead engine loop 503. Errors are
  ``{"error": {"message", "type"}}``; the engine carries on.
- ``GET /health`` — ``{"ok": true, "engine_id", "role", "step_failures", "last_step_error"}``;
  503 with ``"ok": false`` and the reason once the engine loop has died.
- ``GET /stats`` — the engine's counters; the connector's worker statistics (``connector``:
  counters summed over steps, latest gauges) and its scheduler half's (``connector_scheduler``:
  counters summed over the process's life, gauges of now).
- ``GET /metrics`` — the same connector statistics as Prometheus metrics (text format 0.0.4):
  kvframe's metric catalogue (:data:`kvframe.runtime.metrics.CATALOGUE`, docs/metrics.md),
  every series labelled ``engine_id``.
- ``GET /v1/kv_events?after=SEQ&limit=N`` — the engine's KV events: every block hash its
  prefix cache stored or dropped after ``SEQ`` (``{"engine_id", "epoch", "block_size", "seq",
  "events": [[stored, hash hex], ...], "snapshot": null | [hash hex, ...], "more"}``; a
  snapshot of every cached hash when ``SEQ`` is older than the journal keeps or not this
  instance's; at most 4096 entries). A fleet router learns from it which prefixes each engine
  holds (:mod:`kvframe_refengine.fleet`); a bad ``after`` or ``limit`` is a 400.
- ``GET /leaks`` — the leak oracle: ``{"clean": bool, "problems": str}``.
- ``GET /v1/kv_address`` — this engine's push address (a prefill engine's
  ``PDConnectorScheduler.kv_address()``: ``remote_engine_id``, ``remote_host``,
  ``remote_port``, ...), which a push-mode router merges into every decode leg; 404
  (``no_kv_address``) for an engine that has none (no connector, a ``MultiConnector``
  without a P/D child, a decode engine: ``kv_role`` ``kv_consumer``), 503
  (``kv_address_unknown``) when the connector cannot tell it (its
  :class:`~kvframe.errors.ConfigError`).

The engine runs on its own thread, stepping while it has work — including when the connector
reports pending work with no request to run (an idle prefill engine holding leases), at
:data:`_IDLE_PACE` between steps that ran no tokens — and otherwise waiting for a command as
long as :meth:`Engine.idle_wait` allows (until the connector's ``next_deadline()``, at most
:data:`_IDLE_BLOCK`): an idle engine does not spin. HTTP handler threads only queue commands
to it. A step that raises ends its requests with an error and the loop goes on
(:meth:`Engine.step`); if the loop itself dies, every waiting and later request is answered 503.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import queue
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from http.server import ThreadingHTTPServer
from typing import Any

import attrs

from kvframe.config import KVTransferConfig
from kvframe.connectors.multi import MultiConnectorScheduler
from kvframe.connectors.pd.scheduler import PDConnectorScheduler
from kvframe.errors import ConfigError
from kvframe.protocol.messages import ConnectorOutput, Stats
from kvframe.runtime.metrics import CONTENT_TYPE, StatsAccumulator, to_prometheus
from kvframe_refengine import _http, fleet
from kvframe_refengine._http import Completion, HTTPError
from kvframe_refengine.engine import Engine, EngineConfig, LeakError
from kvframe_refengine.model import ModelConfig
from kvframe_refengine.request import RequestOutput
from kvframe_refengine.tokenizer import decode

__all__ = [
    "EngineLoopDied",
    "EngineService",
    "Finished",
    "build_engine",
    "kv_transfer_config",
    "main",
    "serve",
]

_log = logging.getLogger(__name__)

#: Seconds between two steps that ran no tokens while the connector must keep stepping.
_IDLE_PACE = 0.0005
#: The longest the loop waits for a command when the engine has nothing to do.
_IDLE_BLOCK = 0.1


class EngineLoopDied(RuntimeError):
    """The engine's thread has stopped (or the service was closed): nothing more is served.
    The HTTP API answers 503."""


@attrs.frozen
class Finished:
    """A request's final output and its timing (``ttft_s``, ``total_s``)."""

    output: RequestOutput
    timing: dict[str, float]


@attrs.define
class _Waiter:
    # Touched only by the engine thread.
    future: Future[Finished]
    t0: float
    first_token: float | None = None


class EngineService:
    """Owns an :class:`Engine` and the thread that steps it; thread-safe front door.

    Threads: the engine thread alone touches the engine, ``_waiters`` and ``worker_stats``;
    other threads reach them only through :meth:`call` (a command queue). ``failed`` is set
    once, under ``_gate``, by the dying engine thread; :meth:`call` checks it under the same
    lock before queuing, so no command is queued after the queue was drained.
    """

    def __init__(self, engine: Engine, *, engine_id: str, role: str) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.role = role
        self.epoch = secrets.token_hex(8)
        """A random token of this service's start (the KV events' ``epoch``)."""
        self.worker_stats = StatsAccumulator()
        """The connector worker's statistics, from every step's output."""
        self._cmds: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._waiters: dict[str, _Waiter] = {}
        self._ids = itertools.count(1)
        self._gate = threading.Lock()
        self._stop = threading.Event()
        self.failed: BaseException | None = None
        """Why the engine loop stopped (``None`` while it runs)."""
        sched = engine.connector_scheduler
        if sched is not None:
            # Tap the connector's per-step output for operators (stats, /metrics).
            original = sched.update_connector_output

            def tap(output: ConnectorOutput) -> None:
                self.worker_stats.add(output.stats)
                original(output)

            sched.update_connector_output = tap  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands(wait=self._idle_wait())
                if not self.engine.has_unfinished_work():
                    continue
                outputs = self.engine.step()  # contains what a step raises
                now = time.monotonic()  # after the step that made the outputs
                for out in outputs:
                    self._on_output(out, now)
        except BaseException as exc:  # the engine is unusable: fail every waiter loudly
            self._die(exc)

    def _idle_wait(self) -> float:
        # How long to wait for a command before the next step (a command wakes the loop at
        # once): nothing after a step that ran tokens; the idle pace while the connector must
        # step at once (a P holding leases, a load in flight); until the connector's next
        # deadline when its work is only timed; up to _IDLE_BLOCK with nothing to do.
        wait = self.engine.idle_wait(cap=_IDLE_BLOCK)
        if wait is None:
            return _IDLE_BLOCK
        if 0 < wait <= self.engine.config.idle_sleep_s:
            return _IDLE_PACE
        return wait

    def _run_commands(self, wait: float) -> None:
        try:
            fn, fut = self._cmds.get(timeout=wait)
        except queue.Empty:
            return
        while True:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            try:
                fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _die(self, exc: BaseException) -> None:
        if not self._stop.is_set():
            _log.critical("the engine loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        with self._gate:
            self.failed = exc
        while True:
            try:
                _, fut = self._cmds.get_nowait()
            except queue.Empty:
                break
            if not fut.done():
                fut.set_exception(self._died())
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            if not waiter.future.done():
                waiter.future.set_exception(self._died())

    def _died(self) -> EngineLoopDied:
        exc = self.failed
        if isinstance(exc, _Closed):
            return EngineLoopDied("the engine service was closed")
        return EngineLoopDied(
            f"the engine loop died ({type(exc).__name__}: {exc}); this server can serve "
            "nothing more: restart it"
        )

    def _on_output(self, out: RequestOutput, now: float) -> None:
        waiter = self._waiters.get(out.request_id)
        if waiter is None:
            return
        if out.new_token_ids and waiter.first_token is None:
            waiter.first_token = now
        if not out.finished:
            return
        del self._waiters[out.request_id]
        first = now if waiter.first_token is None else waiter.first_token
        timing = {"ttft_s": first - waiter.t0, "total_s": now - waiter.t0}
        waiter.future.set_result(Finished(out, timing))

    # -- any thread ----------------------------------------------------------------------------
    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the engine thread and return its result (or raise what it raised).
        Raises :class:`EngineLoopDied` when the engine loop is not running, and
        ``TimeoutError`` when it did not get to ``fn`` within ``timeout`` seconds."""
        fut: Future[Any] = Future()
        with self._gate:
            if self.failed is not None:
                raise self._died()
            self._cmds.put((fn, fut))
        return fut.result(timeout)

    def post(self, fn: Callable[[], Any]) -> bool:
        """Queue ``fn`` to run on the engine thread without waiting for it (it wakes an idle
        loop at once); what it raises is logged, not propagated. Returns False when the engine
        loop is not running (nothing was queued)."""
        fut: Future[Any] = Future()
        fut.add_done_callback(_log_failure)
        with self._gate:
            if self.failed is not None:
                return False
            self._cmds.put((fn, fut))
        return True

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None,
        request_id: str | None = None,
    ) -> tuple[str, Future[Finished]]:
        """Queue a request; the future resolves with its :class:`Finished` output, or fails
        with :class:`EngineLoopDied`. Raises what :meth:`Engine.add_request` raises."""
        rid = request_id or f"{self.engine_id}-{next(self._ids)}"
        fut: Future[Finished] = Future()

        def add() -> None:
            self.engine.add_request(rid, prompt, max_tokens, kv_transfer_params)
            self._waiters[rid] = _Waiter(fut, time.monotonic())

        self.call(add)
        return rid, fut

    def abandon(self, request_id: str) -> None:
        """Stop waiting for a request and abort it (a client that gave up)."""

        def drop() -> None:
            self._waiters.pop(request_id, None)
            self.engine.abort(request_id)

        with contextlib.suppress(EngineLoopDied, TimeoutError):
            self.call(drop)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) for ``/health``: 503 once the engine loop is not running."""
        base: dict[str, Any] = {"engine_id": self.engine_id, "role": self.role}
        workers = self.engine.workers
        if workers is not None and workers.broken is not None and self.failed is None:
            return 503, {
                "ok": False,
                **base,
                "error": {
                    "message": f"the tensor-parallel workers stopped: {workers.broken}; every "
                    "request fails: restart this server",
                    "type": "tp_workers_failed",
                },
            }
        if self.failed is not None or not self._thread.is_alive():
            message = str(self._died()) if self.failed is not None else "the engine loop stopped"
            return 503, {
                "ok": False,
                **base,
                "error": {"message": message, "type": "engine_loop_died"},
            }
        return 200, {
            "ok": True,
            **base,
            "step_failures": self.engine.num_failed_steps,
            "last_step_error": self.engine.last_step_error,
        }

    def stats(self) -> dict[str, Any]:
        def collect() -> dict[str, Any]:
            return {
                "engine": dict(self.engine.describe()),
                "connector": _stats_json(self.worker_stats.snapshot()),
                "connector_scheduler": _stats_json(self.engine.connector_scheduler_stats()),
            }

        out: dict[str, Any] = {"engine_id": self.engine_id, "role": self.role}
        out.update(self.call(collect))
        return out

    def metrics(self) -> str:
        """The connector's statistics as Prometheus text: the families of kvframe's metric
        catalogue (``kvframe_*``, from the worker's and the scheduler half's stats), each
        series labelled with the engine id."""
        labels = {"engine_id": self.engine_id}

        def render() -> str:
            worker = self.worker_stats.snapshot()
            return to_prometheus(worker, self.engine.connector_scheduler_stats(), labels=labels)

        text: str = self.call(render)
        return text

    def kv_address(self) -> dict[str, Any]:
        """This engine's push address (``PDConnectorScheduler.kv_address()``, asked on the
        engine thread). Raises :class:`HTTPError`: 404 when the engine has no P/D connector
        (none, or a ``MultiConnector`` without a P/D child) or is a decode engine, 503 when
        the connector raised :class:`~kvframe.errors.ConfigError` (the address is not
        known)."""

        def ask() -> dict[str, Any]:
            pd = _pd_scheduler(self.engine.connector_scheduler)
            if pd is None:
                sched = self.engine.connector_scheduler
                kind = "none" if sched is None else type(sched).__name__
                raise HTTPError(
                    404,
                    f"engine {self.engine_id} has no P/D connector (its connector: {kind}), so "
                    "it has no push address; ask the prefill engine, which runs "
                    "kv_connector PDConnector",
                    "no_kv_address",
                )
            config = self.engine.kv_transfer_config
            if config is not None and config.kv_role == "kv_consumer":
                raise HTTPError(
                    404,
                    f"engine {self.engine_id} is a decode engine (kv_role kv_consumer): it "
                    "serves no KV, so it has no push address; ask the prefill engine",
                    "no_kv_address",
                )
            try:
                return pd.kv_address()
            except ConfigError as exc:
                raise HTTPError(
                    503, f"engine {self.engine_id} cannot tell its push address: {exc}",
                    "kv_address_unknown",
                ) from None  # fmt: skip

        address: dict[str, Any] = self.call(ask)
        return address

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
        if self.failed is None and not self._thread.is_alive():
            self._die(_Closed())
        self.engine.shutdown()


class _Closed(Exception):
    """:meth:`EngineService.close` was called."""


def _log_failure(fut: Future[Any]) -> None:
    exc = fut.exception()
    if exc is not None and not isinstance(exc, EngineLoopDied):
        _log.error("a posted engine command failed: %s: %s", type(exc).__name__, exc)


def _pd_scheduler(sched: object) -> PDConnectorScheduler | None:
    # The P/D connector's scheduler half: the engine's own, or a MultiConnector's first P/D
    # child.
    if isinstance(sched, PDConnectorScheduler):
        return sched
    if isinstance(sched, MultiConnectorScheduler):
        return next((c for c in sched.children if isinstance(c, PDConnectorScheduler)), None)
    return None


def _stats_json(stats: Stats) -> dict[str, dict[str, float]]:
    return {"counters": dict(stats.counters), "gauges": dict(stats.gauges)}


@contextlib.contextmanager
def _engine_reachable() -> Iterator[None]:
    # A dead or stuck engine thread is the server's condition, not the request's: 503.
    try:
        yield
    except EngineLoopDied as exc:
        raise HTTPError(503, str(exc), "engine_loop_died") from None
    except TimeoutError:
        raise HTTPError(
            503, "the engine thread did not take the command within 30 s", "engine_busy"
        ) from None


def _complete(service: EngineService, c: Completion) -> dict[str, Any]:
    try:
        with _engine_reachable():
            rid, fut = service.submit(c.prompt, c.max_tokens, c.kv_transfer_params, c.request_id)
    except ConfigError as exc:  # the connector refused the kv_transfer_params at admission
        raise HTTPError(
            400, f"kv_transfer_params refused: {exc}", "invalid_kv_transfer_params"
        ) from None
    except (ValueError, TypeError) as exc:
        raise HTTPError(400, str(exc)) from None
    try:
        done = fut.result(timeout=c.timeout_s)
    except TimeoutError:
        service.abandon(rid)
        raise HTTPError(
            504,
            f"request {rid} did not finish within timeout_s = {c.timeout_s:g} s and was "
            "aborted; raise timeout_s or lower max_tokens",
            "timeout",
        ) from None
    except EngineLoopDied as exc:
        raise HTTPError(503, str(exc), "engine_loop_died") from None
    out = done.output
    if out.error:
        raise HTTPError(500, f"request {rid} failed: {out.error}", "request_failed")
    return {
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
        "kv_transfer_params": dict(out.kv_transfer_params) if out.kv_transfer_params else None,
        "usage": {
            "prompt_tokens": len(c.prompt),
            "completion_tokens": len(out.token_ids),
            "cached_tokens": out.num_cached_tokens,
            "external_tokens": out.num_external_tokens,
        },
        "timing": done.timing,
    }


def _handler(service: EngineService) -> type[_http.JSONHandler]:
    class Handler(_http.JSONHandler):
        def get(self) -> None:
            path, _, query = self.path.partition("?")
            if path == "/v1/kv_events":
                try:
                    fields = dict(urllib.parse.parse_qsl(query, max_num_fields=4))
                    with _engine_reachable():
                        self.send_json(200, fleet.kv_events_answer(service, fields))
                except ValueError as exc:
                    raise HTTPError(400, f"GET /v1/kv_events: {exc}") from None
                return
            with _engine_reachable():
                if self.path == "/health":
                    self.send_json(*service.health())
                elif self.path == "/stats":
                    self.send_json(200, service.stats())
                elif self.path == "/metrics":
                    self.send_json(200, service.metrics(), CONTENT_TYPE)
                elif self.path == "/leaks":
                    self.send_json(200, service.leaks())
                elif self.path == "/v1/kv_address":
                    self.send_json(200, service.kv_address())
                else:
                    super().get()

        def post(self) -> None:
            if self.path != "/v1/completions":
                super().post()
                return
            completion = _http.parse_completion(self.read_json_object())
            self.send_json(200, _complete(service, completion))

    return Handler


def kv_transfer_config(
    *,
    engine_id: str,
    role: str,
    transport: str = "nixl",
    side_channel_port: int = 0,
    lease: float = 30.0,
    failure_policy: str = "recompute",
    auth_key_file: str | None = None,
    decoder_ttl: float | None = None,
    kv_extra: Mapping[str, Any] | None = None,
) -> KVTransferConfig:
    """The P/D connector's configuration :func:`build_engine` uses (the demo checks its
    options with it before starting anything); ``auth_key_file`` is the fleet key file
    (``kv_connector_extra_config.auth_key_file``, docs/security.md), left out when ``None``;
    ``decoder_ttl`` is ``decoder_kv_blocks_ttl`` (``None``: its default); ``kv_extra`` more
    ``kv_connector_extra_config`` keys (``symmetric_leases``, ``kv_recompute_threshold``, ...:
    docs/configuration.md), over the ones above. Raises
    :class:`~kvframe.errors.ConfigError` naming the key for a bad value."""
    extra: dict[str, Any] = {"transport": transport, "side_channel_port": side_channel_port}
    if auth_key_file is not None:
        extra["auth_key_file"] = auth_key_file
    extra.update(kv_extra or {})
    config: dict[str, Any] = {
        "kv_connector": "PDConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_lease_duration": lease,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": extra,
    }
    if decoder_ttl is not None:
        config["decoder_kv_blocks_ttl"] = decoder_ttl
    return KVTransferConfig.from_dict(config)


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
    auth_key_file: str | None = None,
    decoder_ttl: float | None = None,
    kv_extra: Mapping[str, Any] | None = None,
    tp_size: int = 1,
) -> Engine:
    """An engine for serving; ``role=None`` builds one without a connector (the connector's
    options as in :func:`kv_transfer_config`); ``tp_size`` > 1 runs the model in that many
    worker processes (``EngineConfig.tp_size``)."""
    kv = None
    if role is not None:
        kv = kv_transfer_config(
            engine_id=engine_id,
            role=role,
            transport=transport,
            side_channel_port=side_channel_port,
            lease=lease,
            failure_policy=failure_policy,
            auth_key_file=auth_key_file,
            decoder_ttl=decoder_ttl,
            kv_extra=kv_extra,
        )
    return Engine(
        EngineConfig(
            model=ModelConfig(seed=model_seed),
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            torch_threads=torch_threads,
            tp_size=tp_size,
        ),
        kv,
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


def serve(service: EngineService, host: str, port: int) -> ThreadingHTTPServer:
    """Start the HTTP API on a background thread; returns the server (``shutdown()`` it).
    ``port`` 0 binds a free port (``server_address[1]``)."""
    return _http.start(host, port, _handler(service), "http")


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
    ap.add_argument(
        "--tp-size", type=int, default=1,
        help="tensor-parallel ranks: worker processes, each with its shard of the model, the "
        "KV cache of its KV heads and its own connector worker (default 1: no worker process)",
    )  # fmt: skip
    ap.add_argument(
        "--auth-key-file", default=None, help="the fleet key file (docs/security.md); none: "
        "unauthenticated",
    )  # fmt: skip
    ap.add_argument(
        "--decoder-ttl", type=float, default=None,
        help="decoder_kv_blocks_ttl in seconds: how long a decode engine keeps a conversation's "
        "KV for its next turn (default 480, at least --lease)",
    )  # fmt: skip
    ap.add_argument(
        "--kv-extra", type=_json_object, default=None, metavar="JSON",
        help="more kv_connector_extra_config keys, a JSON object (for instance "
        '\'{"symmetric_leases": true, "kv_recompute_threshold": 32}\')',
    )  # fmt: skip
    ap.add_argument(
        "--discovery", default=None, metavar="URL",
        help="register this engine in a fleet through a discovery backend "
        "(etcd://HOST:PORT?ttl=10, file:///DIRECTORY?ttl=5; docs/fleet.md): kept alive, "
        "withdrawn at shutdown, vanished peers' leases and loads ended at once",
    )  # fmt: skip
    ap.add_argument(
        "--advertise-host", default=None,
        help="the address routers and peers reach this engine at (default --host)",
    )  # fmt: skip
    ap.add_argument(
        "--fleet-role", choices=fleet.FLEET_ROLES, default=None,
        help="what this engine serves in the fleet (default from --role; required for kv_both)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.discovery is not None and args.role in (None, "none"):
        ap.error("--discovery needs --role (an engine with the P/D connector)")
    engine = build_engine(
        engine_id=args.engine_id,
        role=None if args.role in (None, "none") else args.role,
        transport=args.transport,
        side_channel_port=args.side_channel_port,
        lease=args.lease,
        failure_policy=args.failure_policy,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        auth_key_file=args.auth_key_file,
        decoder_ttl=args.decoder_ttl,
        kv_extra=args.kv_extra,
        tp_size=args.tp_size,
    )
    service = EngineService(engine, engine_id=args.engine_id, role=args.role or "none")
    httpd = serve(service, args.host, args.port)
    member: fleet.FleetMember | None = None
    if args.discovery is not None:
        try:
            member = fleet.FleetMember(
                service,
                args.discovery,
                host=args.advertise_host or args.host,
                api_port=int(httpd.server_address[1]),
                fleet_role=args.fleet_role,
            )
        except BaseException:
            httpd.shutdown()
            service.close()
            raise
    import signal

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(json.dumps({"ready": True, "port": int(httpd.server_address[1])}), flush=True)
    done.wait()
    if member is not None:
        member.close()  # withdrawn first: routers stop sending before the API goes away
    httpd.shutdown()
    service.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
