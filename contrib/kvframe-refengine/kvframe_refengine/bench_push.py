"""``kvframe bench push``: D's time to first token in pull mode, push mode and progressive push.

Three reference-engine servers (the HTTP stack of :mod:`kvframe_refengine.server`, the P/D
connector over NIXL, one torch thread each, the model of :data:`MODEL_SHAPE`, prefill in
chunks of 512 tokens: the engine's default) are started once and serve every arm of the run:

- **P** (``kv_producer``) and **P layerwise** (``kv_producer`` with
  ``kv_connector_extra_config.push_layerwise: true``): identical flags otherwise, both pinned to
  the same CPU;
- **D** (``kv_consumer``, ``kv_load_failure_policy: fail``), pinned to another CPU (the same one
  when the benchmark may use only one), shared by every arm.

One D for every arm, and a second P rather than a restart, so that the arms alternate round by
round under the same conditions (a P restart would also change P's incarnation mid-run). The
servers are the reference server's ``EngineService`` and HTTP handler, as they are (this
benchmark found two of their latency bugs, since fixed there: an idle engine spun a CPU, and
Nagle's algorithm held an answer's body up to 40 ms for the client's delayed ACK). Every
thread's CPU affinity is read back from ``/proc/PID/task/*/status`` after the warm-up round and
at the end; the run stops if a thread may run anywhere else. For each prompt length the arms
run in turn on fresh prompts of that length, their order rotated every round (round 0 warms up
and is dropped), and after each one the benchmark waits until the engines are idle (no
request, no pending connector work):

- **pull** — the router's pull contract: P's leg (``do_remote_decode``, ``max_tokens`` 1), then
  D's leg with the ``kv_transfer_params`` P answered; D READs the KV;
- **push** — both legs sent at once (P's first, D's right after it): P's leg with
  ``transfer_mode: push`` and a fresh ``push_id``, D's with the same ``push_id`` and P's address
  from P's ``GET /v1/kv_address``; P WRITEs the whole KV into D's blocks once its prefill ended;
- **progressive push** — the same legs to P layerwise, which writes each layer's blocks as each
  prefill chunk computes them (once D's registration and lease confirmation have reached it);
- **compute alone** — P's leg alone with no ``kv_transfer_params``: the prefill without any KV
  leaving P, through the same HTTP stack.

Figures (seconds):

- **TTFT** (``ttft_s``): the benchmark's client, from sending the first leg to receiving D's
  answer (``max_tokens`` 1: D's answer is its first token), over HTTP/1.1 connections opened
  before the clock starts; **prefill** (``prefill_s``): to P's answer; **tail** (``tail_s``):
  D's answer minus P's, what remains after P's prefill (in pull D's whole leg);
- **compute** (``compute_s``): P's prefill in the push arm (its ``prefill_s``: P writes only
  after it, and D runs its leg meanwhile as in progressive push); **compute alone**
  (``compute_alone_s``): the compute arm's time to P's answer, beside it (P alone, D idle);
- **transfer alone** (``transfer_s``): P's WRITE of the whole KV in the push arm (the
  connector's ``push_seconds`` observation on P, from its ``GET /stats``: posted to seen done,
  after P's prefill, while nothing else runs); **D's READ** (``read_s``): ``transfer_seconds``
  on D in the pull arm;
- **ideal** (``ideal_s``): ``max(compute, transfer)`` of the medians, what progressive push
  would take if the transfer overlapped the compute entirely and nothing else cost time (D's
  own step for the last token and the protocol's round trips are not in it);
  **overlap efficiency**: ``ideal / progressive push``.

Each figure is a median with its p90 over the measured rounds; the ratios (``push_speedup``
``pull / push``, ``progressive_speedup`` ``pull / progressive``, ``overlap_efficiency``) are
ratios of medians.

Every sample checks that KV moved: D's answer counts ``prompt_tokens - 1`` external tokens
(loaded, not computed: D's failure policy is ``fail``, so a failed load is an error, never a
silent recomputation), and P's ``pushes_done`` grew in the push arms; ``moved`` reports the
counters. A failure ends the run with :class:`BenchError` (``kvframe bench push`` prints it
as one line, with the failing engine's log tail, and exits 1).

JSON keys (``--json``)::

    {"benchmark": "push", "version": 1, "quick": bool, "repeats": int,
     "model": {"layers", "kv_heads", "head_dim", "block_size", "kv_bytes_per_token"},
     "pinning": {"P": [cpu, ...], "P_layerwise": [...], "D": [...], "bench": [...],
                 "threads": {"P": int, "P_layerwise": int, "D": int}, "verified": true},
     "load_average": {"start": float, "end": float},
     "cases": [{"prompt_tokens", "kv_bytes",
                "arms": {"pull" | "push" | "progressive": {
                    "ttft_s": S, "prefill_s": S, "tail_s": S,
                    "moved": {"requests", "loads_done", "bytes", "external_tokens",
                              "layer_writes"}}},
                "compute_s": S, "compute_alone_s": S, "transfer_s": S, "read_s": S,
                "ideal_s": float,
                "push_speedup": float, "progressive_speedup": float,
                "overlap_efficiency": float}]}

where ``S`` is ``{"median": float, "p90": float, "samples": [float, ...]}``; ``kv_bytes`` is
one request's KV that crossed (D's READ in the pull arm: the whole blocks of
``prompt_tokens - 1`` tokens); ``moved`` sums over the measured rounds: D's ``loads_done``
and external tokens; ``bytes`` is D's ``bytes_read`` in pull and P's ``bytes_written`` (the
final WRITE only) in the push arms; ``layer_writes`` is P's ``push_layer_writes``. ``pinning``
gives each engine's CPUs, the benchmark's own (its client is not pinned) and each engine's
thread count at the end; ``load_average`` the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs

from kvframe.bench.progress import Progress
from kvframe.runtime.procs import ChildProcesses

if TYPE_CHECKING:
    pass

__all__ = [
    "BLOCK",
    "FULL_CASES",
    "MODEL_SHAPE",
    "QUICK_CASES",
    "BenchError",
    "measure",
    "run",
]

#: The model every engine of the run builds (same seed: same weights): 8 layers, 16 KiB of KV
#: per token, so that a long prompt's KV is tens of MiB.
MODEL_SHAPE: Mapping[str, int] = {
    "num_layers": 8,
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 64,
    "intermediate_size": 256,
}
BLOCK = 16
#: Most tokens in one forward pass (the reference engine's default): a long prompt is prefilled
#: in chunks, and P's connector makes progress between them.
_CHUNK = 512
_MAX_LEN = 4096
_NUM_BLOCKS = 768
_KV_BYTES_PER_TOKEN = (
    MODEL_SHAPE["num_layers"] * 2 * MODEL_SHAPE["num_kv_heads"] * MODEL_SHAPE["head_dim"] * 4
)

#: Prompt lengths of a full run: short (2 MiB of KV) and long (32 MiB).
FULL_CASES = (128, 2048)
QUICK_CASES = (48,)
_FULL_REPEATS = 7
_QUICK_REPEATS = 1
_ARMS = ("pull", "push", "progressive", "compute")
_TTFT_ARMS = ("pull", "push", "progressive")
_ENGINES = ("P", "P_layerwise", "D")


class BenchError(RuntimeError):
    """The benchmark could not measure (an engine failed, refused a leg, or the KV did not
    arrive); the message says what happened, with the engine's log tail where it has one."""


# -- the engine processes -----------------------------------------------------------------


def serve(spec: Mapping[str, Any]) -> int:
    """One engine behind :mod:`kvframe_refengine.server`'s HTTP API, on a free port; prints
    ``{"ready": true, "port": N}`` and serves until SIGTERM. ``spec``: ``engine_id``, ``role``,
    ``layerwise`` (P's ``push_layerwise``), ``cpus`` (the process's CPUs, set before torch and
    NIXL start a thread: every thread inherits them)."""
    os.sched_setaffinity(0, spec["cpus"])
    import signal
    import threading

    from kvframe.config import KVTransferConfig
    from kvframe_refengine import _http, server
    from kvframe_refengine.engine import Engine, EngineConfig
    from kvframe_refengine.model import ModelConfig

    extra: dict[str, Any] = {"transport": "nixl", "side_channel_port": 0}
    if spec.get("layerwise"):
        extra["push_layerwise"] = True
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": spec["role"],
            "engine_id": spec["engine_id"],
            "kv_lease_duration": 30.0,
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": extra,
        }
    )
    engine = Engine(
        EngineConfig(
            model=ModelConfig(**MODEL_SHAPE),
            num_blocks=_NUM_BLOCKS,
            block_size=BLOCK,
            max_num_batched_tokens=_CHUNK,
            max_model_len=_MAX_LEN,
            enable_prefix_caching=False,
            torch_threads=1,
        ),
        kv,
    )
    service = server.EngineService(engine, engine_id=spec["engine_id"], role=spec["role"])
    handler = server._handler(service)
    httpd = _http.start("127.0.0.1", 0, handler, "http")
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(json.dumps({"ready": True, "port": httpd.server_address[1]}), flush=True)
    done.wait()
    httpd.shutdown()
    service.close()
    return 0


@attrs.define(eq=False)
class _Server:
    name: str
    proc: subprocess.Popen[str]
    log: IO[bytes]
    port: int = 0
    conn: http.client.HTTPConnection | None = None

    def wait_ready(self, deadline: float) -> None:
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(
                    f"the benchmark's engine {self.name!r} exited with status "
                    f"{self.proc.returncode}: {self.log_tail()}"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if '"ready": true' in line:
                    self.port = int(json.loads(line)["port"])
                    self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                    self.conn.connect()
                    return
        raise BenchError(f"the benchmark's engine {self.name!r} did not start in time")

    def log_tail(self) -> str:
        self.log.flush()
        text = Path(self.log.name).read_bytes()[-1500:].decode(errors="replace")
        return text.strip() or "(nothing on its stderr)"

    def send(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> None:
        assert self.conn is not None
        data = None if body is None else json.dumps(body).encode()
        headers = {} if data is None else {"Content-Type": "application/json"}
        self.conn.request(method, path, body=data, headers=headers)

    def receive(self, what: str) -> dict[str, Any]:
        assert self.conn is not None
        resp = self.conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise BenchError(
                f"engine {self.name} answered {what} with {resp.status}: "
                f"{raw[:500].decode(errors='replace')}; its log: {self.log_tail()}"
            )
        out: dict[str, Any] = json.loads(raw)
        return out

    def ask(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        self.send(method, path, body)
        return self.receive(f"{method} {path}")


def _affinity(pid: int) -> dict[int, frozenset[int]]:
    # Every thread's allowed CPUs, from /proc (what the kernel enforces, not what was asked).
    out: dict[int, frozenset[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = _cpu_list(line.split(":", 1)[1].strip())
    return out


def _cpu_list(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def _check_pinning(
    servers: Mapping[str, _Server], want: Mapping[str, frozenset[int]]
) -> dict[str, int]:
    threads: dict[str, int] = {}
    for name, srv in servers.items():
        seen = _affinity(srv.proc.pid)
        stray = {tid: sorted(c) for tid, c in seen.items() if c != want[name]}
        if stray:
            raise BenchError(
                f"engine {name} should run on CPUs {sorted(want[name])} only, but threads "
                f"{stray} may run elsewhere (from /proc/{srv.proc.pid}/task/*/status)"
            )
        threads[name] = len(seen)
    return threads


# -- one sample of each arm -----------------------------------------------------------------


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31 + (i * i) % 97) % 512 for i in range(n)]


def _counters(srv: _Server) -> dict[str, float]:
    stats = srv.ask("GET", "/stats")
    counters: dict[str, float] = stats["connector"]["counters"]
    return counters


def _idle(srv: _Server) -> bool:
    e = srv.ask("GET", "/stats")["engine"]
    busy = any(e[k] for k in ("waiting", "loading", "running", "held"))
    return not busy and not e["connector_pending"]


def _settle(servers: list[_Server], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(_idle(s) for s in servers):
        if time.monotonic() > deadline:
            states = {s.name: s.ask("GET", "/stats")["engine"] for s in servers}
            raise BenchError(f"the engines did not become idle within {timeout:g} s: {states}")
        time.sleep(0.005)


@attrs.define
class _Sample:
    ttft_s: float
    """Sending the first leg to D's answer."""
    prefill_s: float = 0.0
    """Sending the first leg to P's answer."""
    external_tokens: int = 0
    transfer_s: float = 0.0
    loads_done: float = 0.0
    bytes: float = 0.0
    layer_writes: float = 0.0


def _delta(after: Mapping[str, float], before: Mapping[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _body(prompt: list[int], params: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params}


def _answers(p: _Server, d: _Server) -> dict[str, tuple[dict[str, Any], float]]:
    # Both legs are out: take each answer as it arrives, with the time it did.
    assert p.conn is not None
    assert d.conn is not None
    pending = {p.conn.sock: p, d.conn.sock: d}
    out: dict[str, tuple[dict[str, Any], float]] = {}
    while pending:
        ready, _, _ = select.select(list(pending), [], [], 120)
        if not ready:
            raise BenchError(f"no answer from {', '.join(s.name for s in pending.values())}")
        now = time.perf_counter()
        for sock in ready:
            srv = pending.pop(sock)
            out[srv.name] = (srv.receive("its leg of a push-mode request"), now)
    return out


def _pull(p: _Server, d: _Server, prompt: list[int]) -> _Sample:
    before_d = _counters(d)
    t0 = time.perf_counter()
    p.send("POST", "/v1/completions", _body(prompt, {"do_remote_decode": True}))
    params = p.receive("the prefill leg").get("kv_transfer_params")
    t_p = time.perf_counter()
    d.send("POST", "/v1/completions", _body(prompt, params))
    answer = d.receive("the decode leg")
    t_d = time.perf_counter()
    _settle([p, d])
    after_d = _counters(d)
    return _Sample(
        t_d - t0,
        prefill_s=t_p - t0,
        external_tokens=int(answer["usage"]["external_tokens"]),
        transfer_s=_delta(after_d, before_d, "transfer_seconds"),
        loads_done=_delta(after_d, before_d, "loads_done"),
        bytes=_delta(after_d, before_d, "bytes_read"),
    )


def _push(p: _Server, d: _Server, prompt: list[int], address: Mapping[str, Any]) -> _Sample:
    before_p, before_d = _counters(p), _counters(d)
    push_id = secrets.token_urlsafe(16)
    p_params = {"do_remote_decode": True, "transfer_mode": "push", "push_id": push_id}
    d_params = {"do_remote_prefill": True, "transfer_mode": "push", "push_id": push_id, **address}
    t0 = time.perf_counter()
    p.send("POST", "/v1/completions", _body(prompt, p_params))
    d.send("POST", "/v1/completions", _body(prompt, d_params))
    got = _answers(p, d)
    (answer, t_d), (_, t_p) = got[d.name], got[p.name]
    _settle([p, d])
    after_p, after_d = _counters(p), _counters(d)
    if _delta(after_p, before_p, "pushes_done") < 1:
        pushes = {k: v for k, v in after_p.items() if k.startswith("push")}
        raise BenchError(
            f"engine {p.name} counted no finished push for a push-mode request (its push "
            f"counters: {pushes}); its log: {p.log_tail()}"
        )
    return _Sample(
        t_d - t0,
        prefill_s=t_p - t0,
        external_tokens=int(answer["usage"]["external_tokens"]),
        transfer_s=_delta(after_p, before_p, "push_seconds"),
        loads_done=_delta(after_d, before_d, "loads_done"),
        bytes=_delta(after_p, before_p, "bytes_written"),
        layer_writes=_delta(after_p, before_p, "push_layer_writes"),
    )


def _compute(p: _Server, prompt: list[int]) -> _Sample:
    t0 = time.perf_counter()
    p.ask("POST", "/v1/completions", _body(prompt, None))
    seconds = time.perf_counter() - t0
    _settle([p])
    return _Sample(seconds, prefill_s=seconds)


# -- the run ----------------------------------------------------------------------------------


def _summary(samples: list[float]) -> dict[str, Any]:
    # p90 as every kvframe benchmark computes it (inclusive method: never extrapolated beyond
    # the largest sample; one sample is its own p90).
    import statistics

    p90 = (
        samples[0]
        if len(samples) < 2
        else statistics.quantiles(samples, n=10, method="inclusive")[8]
    )
    return {"median": statistics.median(samples), "p90": p90, "samples": samples}


def _cpus() -> tuple[frozenset[int], frozenset[int]]:
    allowed = sorted(os.sched_getaffinity(0))
    p_cpu = allowed[0]
    d_cpu = allowed[1] if len(allowed) > 1 else allowed[0]
    return frozenset({p_cpu}), frozenset({d_cpu})


def _start(
    children: ChildProcesses, logdir: Path, name: str, spec: Mapping[str, Any], cpus: frozenset[int]
) -> _Server:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    log = (logdir / f"{name}.log").open("w+b")  # closed when the run ends

    proc = children.popen(
        [
            sys.executable,
            "-m",
            "kvframe_refengine.bench_push",
            "serve",
            json.dumps({**spec, "cpus": sorted(cpus)}),
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        env=env,
        text=True,
    )
    return _Server(name, proc, log)


def measure(
    cases: tuple[int, ...], repeats: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Start the three engines, run every prompt length ``repeats`` rounds (plus a warm-up
    round) and stop them; see the module docstring for the result's shape."""
    if progress is None:
        progress = Progress("push", total=len(cases) * (repeats + 1))
    load_start = os.getloadavg()[0]
    p_cpus, d_cpus = _cpus()
    want = {"P": p_cpus, "P_layerwise": p_cpus, "D": d_cpus}
    children = ChildProcesses()
    logdir = children.mkdtemp(prefix="kvframe-bench-push-")  # removed with the children
    servers: dict[str, _Server] = {}
    progress.note(f"starting P, P layerwise (CPU {sorted(p_cpus)}) and D (CPU {sorted(d_cpus)})")
    try:
        specs: dict[str, dict[str, Any]] = {
            "P": {"engine_id": "bench-P", "role": "kv_producer"},
            "P_layerwise": {"engine_id": "bench-PL", "role": "kv_producer", "layerwise": True},
            "D": {"engine_id": "bench-D", "role": "kv_consumer"},
        }
        for name in _ENGINES:
            servers[name] = _start(children, logdir, name, specs[name], want[name])
        deadline = time.monotonic() + 180
        for srv in servers.values():
            srv.wait_ready(deadline)
        p, pl, d = servers["P"], servers["P_layerwise"], servers["D"]
        address = {
            "P": p.ask("GET", "/v1/kv_address"),
            "P_layerwise": pl.ask("GET", "/v1/kv_address"),
        }
        runs: dict[str, Callable[[list[int]], _Sample]] = {
            "pull": lambda prompt: _pull(p, d, prompt),
            "push": lambda prompt: _push(p, d, prompt, address["P"]),
            "progressive": lambda prompt: _push(pl, d, prompt, address["P_layerwise"]),
            "compute": lambda prompt: _compute(p, prompt),
        }
        threads: dict[str, int] = {}
        out: list[dict[str, Any]] = []
        seed = 0
        for n in cases:
            got: dict[str, list[_Sample]] = {arm: [] for arm in _ARMS}
            for i in range(repeats + 1):  # round 0 warms up (handshakes, first use of a size)
                progress(
                    f"{n}-token prompts, round {i}/{repeats}: pull, push, progressive, compute"
                )
                for k in range(len(_ARMS)):
                    arm = _ARMS[(i + k) % len(_ARMS)]
                    seed += 1
                    sample = runs[arm](_prompt(n, seed))
                    if arm in _TTFT_ARMS and sample.external_tokens != n - 1:
                        raise BenchError(
                            f"{arm}: D loaded {sample.external_tokens} tokens of a {n}-token "
                            f"prompt, not {n - 1}: the KV did not arrive"
                        )
                    if i > 0:
                        got[arm].append(sample)
                if not threads:  # every engine has done its first transfer: all threads exist
                    threads = _check_pinning(servers, want)
            out.append(_case(n, got))
        threads = _check_pinning(servers, want)
    finally:
        _stop(servers, children)
    return {
        "benchmark": "push",
        "version": 1,
        "repeats": repeats,
        "model": _model_facts(),
        "pinning": _pinning_facts(want, threads),
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "cases": out,
    }


def _stop(servers: Mapping[str, _Server], children: Any) -> None:
    # Close the benchmark's connections and logs, then stop the engines.
    for srv in servers.values():
        if srv.conn is not None:
            srv.conn.close()
    for srv in servers.values():
        srv.log.close()
    children.close()


def _model_facts() -> dict[str, Any]:
    return {
        "layers": MODEL_SHAPE["num_layers"],
        "kv_heads": MODEL_SHAPE["num_kv_heads"],
        "head_dim": MODEL_SHAPE["head_dim"],
        "block_size": BLOCK,
        "kv_bytes_per_token": _KV_BYTES_PER_TOKEN,
    }


def _pinning_facts(want: Mapping[str, Any], threads: Any) -> dict[str, Any]:
    # Only ever called once _check_pinning verified every thread.
    return {
        **{name: sorted(c) for name, c in want.items()},
        "bench": sorted(os.sched_getaffinity(0)),
        "threads": threads,
        "verified": True,
    }


def _case(n: int, got: Mapping[str, list[_Sample]]) -> dict[str, Any]:
    arms = {
        arm: {
            "ttft_s": _summary([s.ttft_s for s in got[arm]]),
            "prefill_s": _summary([s.prefill_s for s in got[arm]]),
            "tail_s": _summary([s.ttft_s - s.prefill_s for s in got[arm]]),
            "moved": {
                "requests": len(got[arm]),
                "loads_done": sum(s.loads_done for s in got[arm]),
                "bytes": sum(s.bytes for s in got[arm]),
                "external_tokens": sum(s.external_tokens for s in got[arm]),
                "layer_writes": sum(s.layer_writes for s in got[arm]),
            },
        }
        for arm in _TTFT_ARMS
    }
    compute = arms["push"]["prefill_s"]
    transfer = _summary([s.transfer_s for s in got["push"]])
    ideal = max(compute["median"], transfer["median"])
    pull, push, prog = (arms[a]["ttft_s"]["median"] for a in _TTFT_ARMS)
    return {
        "prompt_tokens": n,
        "kv_bytes": got["pull"][0].bytes,
        "arms": arms,
        "compute_s": compute,
        "compute_alone_s": _summary([s.ttft_s for s in got["compute"]]),
        "transfer_s": transfer,
        "read_s": _summary([s.transfer_s for s in got["pull"]]),
        "ideal_s": ideal,
        "push_speedup": pull / push,
        "progressive_speedup": pull / prog,
        "overlap_efficiency": ideal / prog,
    }


def _ms(s: Mapping[str, Any]) -> str:
    return f"{s['median'] * 1e3:.1f} / {s['p90'] * 1e3:.1f}"


def _table(report: dict[str, Any]) -> str:
    pin, load = report["pinning"], report["load_average"]
    lines = [
        "D's time to first token, P/D over NIXL on the reference engine (ms, median / p90 of "
        f"{report['repeats']} rounds; P on CPU {pin['P']}, D on CPU {pin['D']}; load average "
        f"{load['start']:.2f} -> {load['end']:.2f})",
        "",
        "| prompt | KV | pull | push | progressive push | compute (P's prefill in push) "
        "| transfer alone (P's WRITE) | ideal max(c, t) | push speed-up "
        "| progressive speed-up | overlap efficiency | compute alone (P only) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        a = c["arms"]
        lines.append(
            f"| {c['prompt_tokens']} tokens | {c['kv_bytes'] / 2**20:.1f} MiB "
            f"| {_ms(a['pull']['ttft_s'])} | {_ms(a['push']['ttft_s'])} "
            f"| {_ms(a['progressive']['ttft_s'])} | {_ms(c['compute_s'])} "
            f"| {_ms(c['transfer_s'])} | {c['ideal_s'] * 1e3:.1f} | {c['push_speedup']:.2f}x "
            f"| {c['progressive_speedup']:.2f}x | {100 * c['overlap_efficiency']:.0f} % "
            f"| {_ms(c['compute_alone_s'])} |"
        )
    lines += [
        "",
        "After P's answer: D's answer minus P's (ms, median / p90), and the layer WRITEs per "
        "request",
        "",
        "| prompt | pull (D's whole leg) | push | progressive push | layer WRITEs "
        "| D's READ (pull) |",
        "|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        a = c["arms"]
        prog = a["progressive"]["moved"]
        lines.append(
            f"| {c['prompt_tokens']} tokens | {_ms(a['pull']['tail_s'])} "
            f"| {_ms(a['push']['tail_s'])} | {_ms(a['progressive']['tail_s'])} "
            f"| {prog['layer_writes'] / prog['requests']:.1f} | {_ms(c['read_s'])} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table, or JSON with ``--json``."""
    repeats = args.repeats
    if repeats is None:
        repeats = _QUICK_REPEATS if args.quick else _FULL_REPEATS
    try:
        report = measure(QUICK_CASES if args.quick else FULL_CASES, repeats)
    except BenchError as exc:
        print(f"kvframe bench push: {exc}", file=sys.stderr)
        return 1
    report["quick"] = bool(args.quick)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        raise SystemExit(serve(json.loads(sys.argv[2])))
    from kvframe.bench.push import add_arguments

    ap = argparse.ArgumentParser(prog="kvframe bench push")
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
