"""``kvframe bench multiturn``: turn two's time to first token, history pulled from D or recomputed.

Two reference-engine servers, started once for the whole run, the same as
:mod:`kvframe_refengine.bench_push`'s (its ``serve``: the HTTP stack of
:mod:`kvframe_refengine.server`, the P/D connector over NIXL, one torch thread each, the model
of :data:`~kvframe_refengine.bench_push.MODEL_SHAPE`, prefill in chunks of 512 tokens, no
prefix cache, ``kv_load_failure_policy: fail``), both ``kv_both`` as bidirectional mode
requires:

- **P**, pinned to one CPU, and **D**, pinned to another (the same one when the benchmark may
  use only one). Every thread's CPU affinity is read back from ``/proc/PID/task/*/status``
  after the warm-up round and at the end; the run stops if a thread may run anywhere else.

The benchmark plays the router. Each sample is a fresh two-turn conversation of a history of
``H`` tokens:

1. **turn one** (not timed): P's leg ``{"do_remote_decode": true}`` with the history,
   ``max_tokens`` 1; then D's leg with P's ticket, ``max_tokens`` :data:`ANSWER_TOKENS`. In the
   pull arm D's leg also carries ``"keep_for_next_turn": true`` and D's answer carries D's
   history ticket (``kept_until``, ``remote_num_tokens`` = ``H + answer - 1``); in the
   recompute arm D is not asked to keep (as the reference router's ``--no-history``: nobody
   would read it). The benchmark then waits until P is idle and D runs nothing (D holds only
   the kept turn).
2. **turn two** (timed): the prompt is the history, D's answer tokens and a new message of
   :data:`MESSAGE_TOKENS` tokens, so that it starts exactly with the tokens D holds.

   - **pull** — P's leg ``{"do_remote_decode": true, "kv_history": <D's ticket, verbatim>}``:
     P READs the ``H + answer - 1`` tokens' KV from D and computes the rest;
   - **recompute** — P's leg ``{"do_remote_decode": true}``: P computes the whole prompt;

   in both, then D's leg with P's new ticket (``max_tokens`` 1), D READing the whole prompt
   but its last token from P. Then the benchmark waits until both engines are idle (P's read
   frees D's kept blocks).

The arms alternate within each round, their order rotated every round (round 0 warms up and is
dropped: the handshakes in both directions, the clock-offset estimate, the first use of a
size).

Figures (seconds):

- **TTFT** (``ttft_s``): from sending P's turn-two leg to receiving D's answer (``max_tokens``
  1: D's first token), on HTTP/1.1 connections opened before the clock starts; **prefill**
  (``prefill_s``): to P's answer; **tail** (``tail_s``): D's answer minus P's (D's leg);
- **history load** (``history_load_s``): P's READ of the history in the pull arm (the
  connector's ``transfer_seconds`` observation on P, from its ``GET /stats``).

Each figure is a median with its p90 over the measured rounds; ``speedup`` is ``recompute /
pull`` of the TTFT medians and ``prefill_speedup`` the same of the prefill medians.

Every sample checks what it claims: D's answers count ``prompt_tokens - 1`` external tokens
(loaded from P); in the pull arm D's turn-one answer carries a kept ticket over ``H + answer -
1`` tokens, P's history counters grew by one (``history_loads``, the scheduler's, and
``loads_done``, the workers'), P's answer counts exactly those tokens as external and none
cached (P's failure policy is ``fail``: a failed history load is an error, never a silent
recomputation), and nothing was refused (``history_refused``); in the recompute arm P loaded
nothing (no external token, no load, no byte read). A failure ends the run with
:class:`~kvframe_refengine.bench_push.BenchError` (``kvframe bench multiturn`` prints it as one
line, with the failing engine's log tail, and exits 1).

JSON keys (``--json``)::

    {"benchmark": "multiturn", "version": 1, "quick": bool, "repeats": int,
     "model": {"layers", "kv_heads", "head_dim", "block_size", "kv_bytes_per_token"},
     "answer_tokens": int, "message_tokens": int,
     "pinning": {"P": [cpu, ...], "D": [...], "bench": [...],
                 "threads": {"P": int, "D": int}, "verified": true},
     "load_average": {"start": float, "end": float},
     "cases": [{"history_tokens", "kept_tokens", "prompt_tokens", "kv_bytes",
                "arms": {"pull" | "recompute": {
                    "ttft_s": S, "prefill_s": S, "tail_s": S,
                    "moved": {"requests", "history_loads", "loads_done", "bytes",
                              "pulled_tokens", "computed_tokens", "d_external_tokens"}}},
                "history_load_s": S, "speedup": float, "prefill_speedup": float}]}

where ``S`` is ``{"median": float, "p90": float, "samples": [float, ...]}``;
``history_tokens`` is ``H``, ``kept_tokens`` the tokens whose KV D kept (``H + answer - 1``),
``prompt_tokens`` turn two's prompt; ``kv_bytes`` is one pull's READ on P (the whole blocks of
the kept tokens); ``moved`` sums over the measured rounds, on P: ``history_loads``,
``loads_done``, ``bytes`` (``bytes_read``), ``pulled_tokens`` (P's external tokens),
``computed_tokens`` (P's prompt tokens less its cached and external ones), and D's external
tokens of turn two.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvframe.bench.progress import Progress
from kvframe.runtime.procs import ChildProcesses
from kvframe_refengine import bench_push as bp
from kvframe_refengine.bench_push import BenchError

__all__ = [
    "ANSWER_TOKENS",
    "ARMS",
    "FULL_CASES",
    "MESSAGE_TOKENS",
    "QUICK_CASES",
    "measure",
    "run",
]

#: History lengths (tokens) of a full run.
FULL_CASES = (256, 1024, 2048)
#: The history of ``--quick``: above the default ``kv_recompute_threshold`` of 64, so that P
#: pulls it.
QUICK_CASES = (96,)
#: D's answer in turn one (tokens).
ANSWER_TOKENS = 16
#: The user's new message in turn two (tokens).
MESSAGE_TOKENS = 32
#: The arms of every round, in round 0's order (rotated by one each round).
ARMS = ("pull", "recompute")
_FULL_REPEATS = 7
_QUICK_REPEATS = 1
_ENGINES = ("P", "D")


# -- the engines -----------------------------------------------------------------------------


def _counters(srv: bp._Server) -> dict[str, float]:
    # The workers' counters (loads_done, bytes_read, transfer_seconds) and the scheduler
    # half's (history_loads, history_refused, history_kept): one namespace.
    stats = srv.ask("GET", "/stats")
    return {**stats["connector"]["counters"], **stats["connector_scheduler"]["counters"]}


def _settled(srv: bp._Server, kept: int) -> bool:
    # Nothing waiting, loading or running; exactly ``kept`` finished requests holding blocks
    # (D's kept turn), and no pending connector work unless something is kept.
    e = srv.ask("GET", "/stats")["engine"]
    if any(e[k] for k in ("waiting", "loading", "running")) or e["held"] != kept:
        return False
    return kept > 0 or not e["connector_pending"]


def _settle(want: Mapping[bp._Server, int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(_settled(s, kept) for s, kept in want.items()):
        if time.monotonic() > deadline:
            states = {s.name: s.ask("GET", "/stats")["engine"] for s in want}
            raise BenchError(
                f"the engines did not settle within {timeout:g} s (wanted held = "
                f"{ {s.name: k for s, k in want.items()} }): {states}"
            )
        time.sleep(0.005)


def _body(prompt: list[int], max_tokens: int, params: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": params}


def _ticket(srv: bp._Server, answer: Mapping[str, Any], what: str) -> dict[str, Any]:
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise BenchError(
            f"engine {srv.name} answered {what} without a ticket (kv_transfer_params "
            f"{params!r}); its log: {srv.log_tail()}"
        )
    return params


def _check_d_loaded(d: bp._Server, answer: Mapping[str, Any], n: int, what: str) -> int:
    got = int(answer["usage"]["external_tokens"])
    if got != n - 1:
        raise BenchError(
            f"{what}: D loaded {got} tokens of a {n}-token prompt from P, not {n - 1}: the KV "
            f"did not arrive; D's log: {d.log_tail()}"
        )
    return got


# -- one sample --------------------------------------------------------------------------------


@attrs.define
class _Sample:
    ttft_s: float
    """Sending P's turn-two leg to D's answer."""
    prefill_s: float
    """Sending P's turn-two leg to P's answer."""
    kept_tokens: int = 0
    prompt_tokens: int = 0
    pulled_tokens: int = 0
    computed_tokens: int = 0
    d_external_tokens: int = 0
    history_loads: float = 0.0
    loads_done: float = 0.0
    bytes: float = 0.0
    load_s: float = 0.0


def _turn_one(
    p: bp._Server, d: bp._Server, history: list[int], keep: bool
) -> tuple[list[int], dict[str, Any] | None]:
    # The router's pull contract; D keeps the turn when asked. Returns D's answer tokens and
    # D's kept ticket (None when not asked to keep).
    answer = p.ask("POST", "/v1/completions", _body(history, 1, {"do_remote_decode": True}))
    params = _ticket(p, answer, "turn one's prefill leg")
    if keep:
        params = {**params, "keep_for_next_turn": True}
    answer = d.ask("POST", "/v1/completions", _body(history, ANSWER_TOKENS, params))
    _check_d_loaded(d, answer, len(history), "turn one")
    tokens = [int(t) for t in answer["choices"][0]["token_ids"]]
    kept = answer.get("kv_transfer_params")
    if not keep:
        if kept:
            raise BenchError(f"D answered a turn it was not asked to keep with a ticket: {kept}")
        _settle({p: 0, d: 0})
        return tokens, None
    n = len(history) + len(tokens) - 1
    if not isinstance(kept, dict) or "kept_until" not in kept:
        raise BenchError(
            f"D kept no history of turn one (keep_for_next_turn; its kv_transfer_params: "
            f"{kept!r}); D's log: {d.log_tail()}"
        )
    if kept.get("remote_num_tokens") != n:
        raise BenchError(
            f"D kept {kept.get('remote_num_tokens')} tokens of turn one, not the "
            f"{len(history)} of the history and {len(tokens)} - 1 of its answer"
        )
    _settle({p: 0, d: 1})
    return tokens, kept


def _turn_two(p: bp._Server, d: bp._Server, history: list[int], seed: int, pull: bool) -> _Sample:
    answer_tokens, kept = _turn_one(p, d, history, keep=pull)
    prompt = history + answer_tokens + bp._prompt(MESSAGE_TOKENS, seed + 100_000)
    p_params: dict[str, Any] = {"do_remote_decode": True}
    if kept is not None:
        p_params["kv_history"] = kept
    before_p = _counters(p)
    t0 = time.perf_counter()
    p.send("POST", "/v1/completions", _body(prompt, 1, p_params))
    p_answer = p.receive("turn two's prefill leg")
    t_p = time.perf_counter()
    d.send("POST", "/v1/completions", _body(prompt, 1, _ticket(p, p_answer, "turn two")))
    d_answer = d.receive("turn two's decode leg")
    t_d = time.perf_counter()
    _settle({p: 0, d: 0})
    after_p = _counters(p)
    usage = p_answer["usage"]
    pulled = int(usage["external_tokens"])
    cached = int(usage["cached_tokens"])
    sample = _Sample(
        t_d - t0,
        prefill_s=t_p - t0,
        kept_tokens=int(kept["remote_num_tokens"]) if kept is not None else 0,
        prompt_tokens=len(prompt),
        pulled_tokens=pulled,
        computed_tokens=len(prompt) - cached - pulled,
        d_external_tokens=_check_d_loaded(d, d_answer, len(prompt), "turn two"),
        history_loads=bp._delta(after_p, before_p, "history_loads"),
        loads_done=bp._delta(after_p, before_p, "loads_done"),
        bytes=bp._delta(after_p, before_p, "bytes_read"),
        load_s=bp._delta(after_p, before_p, "transfer_seconds"),
    )
    refused = bp._delta(after_p, before_p, "history_refused")
    arm = "pull" if pull else "recompute"
    if pull:
        ok = (
            sample.history_loads == 1
            and sample.loads_done == 1
            and sample.bytes > 0
            and pulled == sample.kept_tokens
            and cached == 0
            and not refused
        )
    else:
        ok = not (sample.history_loads or sample.loads_done or sample.bytes or pulled or cached)
    if not ok:
        counters = {
            k: after_p.get(k, 0.0) - before_p.get(k, 0.0)
            for k in ("history_loads", "history_refused", "loads_done", "bytes_read")
        }
        expected = (
            f"P to pull the {sample.kept_tokens} tokens D kept"
            if pull
            else "P to recompute the whole prompt"
        )
        raise BenchError(
            f"{arm}: expected {expected}, but P counted {pulled} external and {cached} cached "
            f"tokens of a {len(prompt)}-token prompt (its counters grew by {counters}); P's "
            f"log: {p.log_tail()}"
        )
    return sample


# -- the run -----------------------------------------------------------------------------------


def measure(
    cases: tuple[int, ...], repeats: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Start P and D, run every history length ``repeats`` rounds (plus a warm-up round) and
    stop them; see the module docstring for the result's shape."""
    if progress is None:
        progress = Progress("multiturn", total=len(cases) * (repeats + 1))
    load_start = os.getloadavg()[0]
    p_cpus, d_cpus = bp._cpus()
    want = {"P": p_cpus, "D": d_cpus}
    children = ChildProcesses()
    logdir = children.mkdtemp(prefix="kvframe-bench-multiturn-")  # removed with the children
    servers: dict[str, bp._Server] = {}
    progress.note(f"starting P (CPU {sorted(p_cpus)}) and D (CPU {sorted(d_cpus)}), kv_both")
    try:
        for name in _ENGINES:
            spec = {"engine_id": f"bench-mt-{name}", "role": "kv_both"}
            servers[name] = bp._start(children, logdir, name, spec, want[name])
        deadline = time.monotonic() + 180
        for srv in servers.values():
            srv.wait_ready(deadline)
        p, d = servers["P"], servers["D"]
        runs: dict[str, Callable[[list[int], int], _Sample]] = {
            "pull": lambda history, seed: _turn_two(p, d, history, seed, pull=True),
            "recompute": lambda history, seed: _turn_two(p, d, history, seed, pull=False),
        }
        threads: dict[str, int] = {}
        out: list[dict[str, Any]] = []
        seed = 0
        for n in cases:
            got: dict[str, list[_Sample]] = {arm: [] for arm in ARMS}
            for i in range(repeats + 1):  # round 0 warms up (handshakes, clock offsets, sizes)
                progress(f"{n}-token histories, round {i}/{repeats}: pull, recompute")
                for k in range(len(ARMS)):
                    arm = ARMS[(i + k) % len(ARMS)]
                    seed += 1
                    sample = runs[arm](bp._prompt(n, seed), seed)
                    if i > 0:
                        got[arm].append(sample)
                if not threads:  # both engines have read from each other: all threads exist
                    threads = bp._check_pinning(servers, want)
            out.append(_case(n, got))
        threads = bp._check_pinning(servers, want)
    finally:
        bp._stop(servers, children)
    return {
        "benchmark": "multiturn",
        "version": 1,
        "repeats": repeats,
        "model": bp._model_facts(),
        "answer_tokens": ANSWER_TOKENS,
        "message_tokens": MESSAGE_TOKENS,
        "pinning": bp._pinning_facts(want, threads),
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "cases": out,
    }


def _case(n: int, got: Mapping[str, list[_Sample]]) -> dict[str, Any]:
    arms = {
        arm: {
            "ttft_s": bp._summary([s.ttft_s for s in got[arm]]),
            "prefill_s": bp._summary([s.prefill_s for s in got[arm]]),
            "tail_s": bp._summary([s.ttft_s - s.prefill_s for s in got[arm]]),
            "moved": {
                "requests": len(got[arm]),
                "history_loads": sum(s.history_loads for s in got[arm]),
                "loads_done": sum(s.loads_done for s in got[arm]),
                "bytes": sum(s.bytes for s in got[arm]),
                "pulled_tokens": sum(s.pulled_tokens for s in got[arm]),
                "computed_tokens": sum(s.computed_tokens for s in got[arm]),
                "d_external_tokens": sum(s.d_external_tokens for s in got[arm]),
            },
        }
        for arm in ARMS
    }
    pull, rec = arms["pull"], arms["recompute"]
    first = got["pull"][0]
    return {
        "history_tokens": n,
        "kept_tokens": first.kept_tokens,
        "prompt_tokens": first.prompt_tokens,
        "kv_bytes": first.bytes,
        "arms": arms,
        "history_load_s": bp._summary([s.load_s for s in got["pull"]]),
        "speedup": rec["ttft_s"]["median"] / pull["ttft_s"]["median"],
        "prefill_speedup": rec["prefill_s"]["median"] / pull["prefill_s"]["median"],
    }


def _table(report: dict[str, Any]) -> str:
    pin, load = report["pinning"], report["load_average"]
    lines = [
        "Turn two's time to first token, history pulled from D or recomputed on P, P/D over "
        f"NIXL on the reference engine (ms, median / p90 of {report['repeats']} rounds; "
        f"answer {report['answer_tokens']} tokens, new message {report['message_tokens']}; "
        f"P on CPU {pin['P']}, D on CPU {pin['D']}; load average {load['start']:.2f} -> "
        f"{load['end']:.2f})",
        "",
        "| history | KV pulled | TTFT pull | TTFT recompute | speed-up | P's prefill pull "
        "| P's prefill recompute | prefill speed-up | P's READ of the history | D's leg pull "
        "| D's leg recompute |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        pull, rec = c["arms"]["pull"], c["arms"]["recompute"]
        lines.append(
            f"| {c['history_tokens']} tokens | {c['kv_bytes'] / 2**20:.1f} MiB "
            f"| {bp._ms(pull['ttft_s'])} | {bp._ms(rec['ttft_s'])} | {c['speedup']:.2f}x "
            f"| {bp._ms(pull['prefill_s'])} | {bp._ms(rec['prefill_s'])} "
            f"| {c['prefill_speedup']:.2f}x | {bp._ms(c['history_load_s'])} "
            f"| {bp._ms(pull['tail_s'])} | {bp._ms(rec['tail_s'])} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table, or JSON with ``--json``."""
    quick = bool(args.quick)
    repeats = args.repeats or (_QUICK_REPEATS if quick else _FULL_REPEATS)
    try:
        report = {**measure(QUICK_CASES if quick else FULL_CASES, repeats), "quick": quick}
    except BenchError as exc:
        print(f"kvframe bench multiturn: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0
