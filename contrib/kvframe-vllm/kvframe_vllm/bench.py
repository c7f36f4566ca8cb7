"""``kvframe bench vllm``: the same P/D workload once with vLLM's built-in ``NixlConnector`` and
once with kvframe's ``PDConnector`` (through :class:`~kvframe_vllm.KVFrameConnector`), in one run.

Run it inside the vLLM virtualenv (``kvframe bench vllm`` does) as
``python -m kvframe_vllm.bench [--json] [--quick]``. By default it runs the **servers mode**
(:mod:`kvframe_vllm.bench_servers`: real OpenAI servers, pinned, behind a proxy — what users
run). ``--quick`` runs the **in-process quick mode** described here, labelled "in-process quick
mode, not what users run" in its output (``note`` in the JSON): offline engines hosted in a
process each (:mod:`kvframe_vllm.host`), where ``VLLM_CPU_OMP_THREADS_BIND`` is not applied
(vLLM applies it only in its multiprocess executor), with no serving stack, and a transfer
figure that is a mean. For each connector a prefill engine (P, "core 0") and a decode engine
(D, "core 1") start as separate processes on the tiny local Llama, then:

- **warm-up**: one request end to end (handshakes, compile caches), not measured;
- **TTFT on decode**: ``--requests`` × ``--repeat`` requests one at a time: P prefills
  (``max_tokens=1``, ``do_remote_decode``), then D generates one token with the returned
  ``kv_transfer_params``;
  the time of D's call is its time to first token (pull of the KV included). Median;
- **KV transfer**: from the connector's own stats on D (vLLM's NIXL telemetry for
  ``NixlConnector``; kvframe's ``transfer_seconds``/``bytes_read`` counters): mean seconds per
  request and GB/s;
- **throughput**: all requests prefilled in one batch on P, then decoded in one batch on D
  with ``--decode-tokens`` each: decode tokens per second on D, and requests per second end to
  end (P batch + D batch); beside it the same D serving a batch it prefills itself (no
  transfer), which shows how much of the figure is the machine rather than the connector.
  Medians over ``--repeat`` batches;
- **correctness**: D's outputs equal P's own single-engine outputs for the same prompts;
- **lease on decode death**: P prefills one more request, D accepts it and is SIGKILLed before
  reading; the seconds until P's free block count is back (both connectors run with
  ``kv_lease_duration = --lease``), or ``null`` if not within ``--lease + 20`` seconds.

``--json`` prints one object::

    {"benchmark": "vllm",
     "params": {"requests": int, "prompt_tokens": int, "decode_tokens": int, "lease": float,
                "repeat": int, "loadavg_1min": float},
     "results": {"nixl" | "kvframe": {
         "startup_s": float, "outputs_match_reference": bool,
         "ttft_decode_ms": float, "kv_transfer_ms": float | null, "kv_bytes_per_request": float,
         "kv_transfer_gbps": float | null, "decode_tokens_per_s": float,
         "local_prefill_decode_tokens_per_s": float,
         "e2e_requests_per_s": float,
         "decode_death": {"reclaimed": bool, "seconds": float | null, "blocks": int}}},
     "ratios": {"ttft_decode": float, "decode_tokens_per_s": float}}

(ratios are kvframe / nixl). Progress lines go to stderr, and so does the name of the
temporary directory that holds the model and the engine logs; it is removed at the end unless
an engine failed (the error names the log). Each engine is its own process group: SIGINT,
SIGTERM or SIGHUP stops both engines, removes the directory, prints one line and exits with
``128 + signal`` (:mod:`kvframe.runtime.procs`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvframe.bench.progress import Progress
from kvframe.runtime.procs import ChildProcesses
from kvframe_vllm.host import EngineError, EngineProcess
from kvframe_vllm.tiny import build_in_subprocess, prompt_ids

__all__ = [
    "CONNECTORS",
    "QUICK_NOTE",
    "STEPS_PER_CONNECTOR",
    "add_arguments",
    "check_arguments",
    "kv_config",
    "main",
    "measure",
    "render",
    "run_pair",
]

CONNECTORS = ("nixl", "kvframe")
"""The connectors compared, in run order."""

QUICK_NOTE = "in-process quick mode, not what users run"
"""The label of every ``--quick`` report (its first line; ``note`` in the JSON)."""


def kv_config(connector: str, engine_id: str, lease: float) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``connector`` (``"nixl"`` or ``"kvframe"``).
    Raises ``ValueError`` for another name."""
    if connector == "nixl":
        return {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "engine_id": engine_id,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": int(lease)},
        }
    if connector == "kvframe":
        return {
            "kv_connector": "KVFrameConnector",
            "kv_connector_module_path": "kvframe_vllm",
            "kv_role": "kv_both",
            "engine_id": engine_id,
            "kv_connector_extra_config": {
                "kvframe_connector": "PDConnector",
                "kvframe": {
                    "kv_lease_duration": lease,
                    "kv_connector_extra_config": {"transport": "nixl"},
                },
            },
        }
    raise ValueError(f"connector {connector!r}; expected one of {CONNECTORS}")


def _transfer(reports: list[dict[str, Any]]) -> tuple[float, float, int]:
    """(seconds, bytes, transfers) summed over stats reports of either connector."""
    seconds = 0.0
    nbytes = 0.0
    count = 0
    for data in reports:
        if "counters" in data:  # kvframe
            c = data["counters"]
            seconds += float(c.get("transfer_seconds", 0.0))
            nbytes += float(c.get("bytes_read", 0.0))
            count += int(c.get("loads_done", 0))
        else:  # vLLM's NixlKVConnectorStats
            seconds += float(sum(data.get("transfer_duration", [])))
            nbytes += float(sum(data.get("bytes_transferred", [])))
            count += len(data.get("transfer_duration", []))
    return seconds, nbytes, count


#: Progress steps per connector (start, warm-up, TTFT, throughput, decode death).
STEPS_PER_CONNECTOR = 5


def run_pair(
    connector: str,
    model: Path,
    logs: Path,
    args: argparse.Namespace,
    *,
    children: ChildProcesses | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Start P and D with ``connector``, run the workload, and return its figures.

    The engines' processes are registered with ``children`` (stopped with it on a signal);
    ``progress`` gets :data:`STEPS_PER_CONNECTOR` steps. Raises
    :class:`~kvframe_vllm.host.EngineError` when an engine fails (its log is named); both
    engines are ended either way.
    """
    step = progress if progress is not None else Progress("vllm", enabled=False)
    n, plen, dtok, lease = args.requests, args.prompt_tokens, args.decode_tokens, args.lease
    ports = {"nixl": (25601, 25611), "kvframe": (None, None)}[connector]
    t0 = time.perf_counter()
    step(f"{connector}: starting the prefill and decode engines")
    p = EngineProcess(
        f"{connector}-P",
        model=model,
        kv_transfer_config=kv_config(connector, f"{connector}-prefill", lease),
        log_dir=logs,
        core=0,
        side_port=ports[0],
    )
    d = EngineProcess(
        f"{connector}-D",
        model=model,
        kv_transfer_config=kv_config(connector, f"{connector}-decode", lease),
        log_dir=logs,
        core=1,
        side_port=ports[1],
    )
    if children is not None:
        children.adopt(p.proc)
        children.adopt(d.proc)
    try:
        p.wait_ready(300)
        d.wait_ready(300)
        startup = time.perf_counter() - t0

        def prefill(prompts: list[list[int]]) -> tuple[list[Any], float]:
            out = p.call(
                "generate",
                prompts=prompts,
                max_tokens=1,
                params=[{"do_remote_decode": True}] * len(prompts),
            )
            return [o["kv_transfer_params"] for o in out["outputs"]], float(out["seconds"])

        step(f"{connector}: warm-up request")
        warm = [prompt_ids(1000, plen)]
        d.call("generate", prompts=warm, max_tokens=2, params=prefill(warm)[0])
        d.call("take_stats")

        step(f"{connector}: time to first token on decode, {n * args.repeat} requests")
        ttft: list[float] = []
        for i in range(n * args.repeat):
            prompt = [prompt_ids(i, plen)]
            params, _ = prefill(prompt)
            out = d.call("generate", prompts=prompt, max_tokens=1, params=params)
            ttft.append(float(out["seconds"]))
        xfer_s, xfer_b, xfer_n = _transfer(d.call("take_stats")["reports"])

        step(f"{connector}: throughput, {args.repeat} batches of {n}")
        matches = True
        p_times: list[float] = []
        d_times: list[float] = []
        local_times: list[float] = []
        for r in range(args.repeat):
            batch = [prompt_ids(100 + 50 * r + i, plen) for i in range(n)]
            reference = p.call("generate", prompts=batch, max_tokens=dtok, params=[None] * n)
            params, p_seconds = prefill(batch)
            out = d.call("generate", prompts=batch, max_tokens=dtok, params=params)
            p_times.append(p_seconds)
            d_times.append(float(out["seconds"]))
            matches = matches and [o["token_ids"] for o in out["outputs"]] == [
                o["token_ids"] for o in reference["outputs"]
            ]
            # The same engine prefilling locally: how fast this D is without any transfer.
            local = [prompt_ids(700 + 50 * r + i, plen) for i in range(n)]
            out = d.call("generate", prompts=local, max_tokens=dtok, params=[None] * n)
            local_times.append(float(out["seconds"]))
        p_seconds = statistics.median(p_times)
        d_seconds = statistics.median(d_times)

        step(f"{connector}: decode killed while P holds a lease ({lease:g} s)")
        base = _wait_idle(p)
        victim = [prompt_ids(999, plen)]
        params, _ = prefill(victim)
        held = base - int(p.call("state")["free_blocks"])
        t_grant = time.monotonic()
        # The engine kills itself once the request is accepted, so the call fails.
        with contextlib.suppress(EngineError):
            d.call("submit", prompt=victim[0], max_tokens=dtok, params=params[0], die=True)
        reclaimed_at: float | None = None
        while time.monotonic() - t_grant < lease + 20:
            if int(p.call("state")["free_blocks"]) >= base:
                reclaimed_at = time.monotonic() - t_grant
                break
            time.sleep(0.05)
        return {
            "startup_s": round(startup, 2),
            "outputs_match_reference": matches,
            "ttft_decode_ms": round(statistics.median(ttft) * 1e3, 2),
            "kv_transfer_ms": round(xfer_s / xfer_n * 1e3, 3) if xfer_n else None,
            "kv_bytes_per_request": xfer_b / xfer_n if xfer_n else 0.0,
            "kv_transfer_gbps": round(xfer_b / xfer_s / 1e9, 3) if xfer_s > 0 else None,
            "decode_tokens_per_s": round(n * dtok / d_seconds, 1),
            "local_prefill_decode_tokens_per_s": round(
                n * dtok / statistics.median(local_times), 1
            ),
            "e2e_requests_per_s": round(n / (p_seconds + d_seconds), 2),
            "decode_death": {
                "reclaimed": reclaimed_at is not None,
                "seconds": None if reclaimed_at is None else round(reclaimed_at, 2),
                "blocks": held,
            },
        }
    finally:
        d.close()
        p.close()


def _wait_idle(p: EngineProcess, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        st = p.call("state")
        if not st["has_requests"] or time.monotonic() > deadline:
            return int(st["free_blocks"])
        time.sleep(0.05)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (this module's and :mod:`kvframe_vllm.bench_servers`')."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the in-process quick mode (offline engines, not what users run)",
    )
    parser.add_argument("--decode-tokens", type=int, default=None, help="tokens decoded (16)")
    parser.add_argument("--lease", type=float, default=6.0, help="kv_lease_duration s (6)")
    parser.add_argument(
        "--only", choices=CONNECTORS, default=None, help="run one connector only (for tests)"
    )
    servers = parser.add_argument_group("servers mode (the default)")
    servers.add_argument("--prompts", type=int, default=None, help="requests measured (16)")
    servers.add_argument("--min-prompt-tokens", type=int, default=None, help="(64)")
    servers.add_argument("--max-prompt-tokens", type=int, default=None, help="(256)")
    servers.add_argument("--idle-window", type=float, default=None, help="idle CPU window, s (5)")
    quick = parser.add_argument_group("--quick mode")
    quick.add_argument("--requests", type=int, default=None, help="requests per phase (8)")
    quick.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (256)")
    quick.add_argument(
        "--repeat", type=int, default=None, help="repetitions of each phase; medians (3)"
    )


_QUICK_ONLY = ("requests", "prompt_tokens", "repeat")
_SERVERS_ONLY = ("prompts", "min_prompt_tokens", "max_prompt_tokens", "idle_window")


def check_arguments(args: argparse.Namespace) -> str | None:
    """Fill in the mode's defaults; the error message for bad options, else ``None``."""
    mine, other = (_QUICK_ONLY, _SERVERS_ONLY) if args.quick else (_SERVERS_ONLY, _QUICK_ONLY)
    wrong = [o for o in other if getattr(args, o) is not None]
    if wrong:
        flags = ", ".join("--" + o.replace("_", "-") for o in wrong)
        return (
            f"{flags}: only for the {'servers mode' if args.quick else '--quick mode'}"
            f" ({'drop --quick' if args.quick else 'add --quick'} or leave them out)"
        )
    defaults = {
        "requests": 8,
        "prompt_tokens": 256,
        "repeat": 3,
        "prompts": 16,
        "min_prompt_tokens": 64,
        "max_prompt_tokens": 256,
        "idle_window": 5.0,
    }
    for name in mine:
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.decode_tokens is None:
        args.decode_tokens = 32 if args.quick else 16
    if args.decode_tokens < 1 or args.lease <= 0:
        return "--decode-tokens and --lease must be > 0"
    if args.quick:
        if args.requests < 1 or args.repeat < 1:
            return "--requests and --repeat must be > 0"
        if not 32 <= args.prompt_tokens <= 400:
            return (
                "--prompt-tokens must be 32..400 (at least one 32-token block; the engines "
                "allow 512 tokens)"
            )
        return None
    if args.lease < 6:
        return (
            f"--lease {args.lease:g}: at least 6 s in the servers mode (at 5 s NixlConnector's "
            "heartbeat interval, lease // 6, is 0)"
        )
    if args.prompts < 1 or args.idle_window <= 0:
        return "--prompts and --idle-window must be > 0"
    if not 32 <= args.min_prompt_tokens <= args.max_prompt_tokens <= 900:
        return (
            "--min-prompt-tokens and --max-prompt-tokens must satisfy 32 <= min <= max <= 900 "
            "(at least one 32-token block; the servers allow 1024 tokens)"
        )
    return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every connector and return the report (see the module docstring)."""
    connectors = [c for c in CONNECTORS if args.only in (None, c)]
    progress = Progress("vllm", total=STEPS_PER_CONNECTOR * len(connectors))
    with ChildProcesses() as children:
        logs = children.mkdtemp("kvframe-bench-vllm-")
        progress.note(f"model and engine logs in {logs} (removed at the end)")
        model = build_in_subprocess(logs / "model", seed=0)
        try:
            results = {
                c: run_pair(c, model, logs, args, children=children, progress=progress)
                for c in connectors
            }
        except EngineError:
            children.keep(logs)
            raise
    ratios: dict[str, float] = {}
    if len(results) == 2:
        k, v = results["kvframe"], results["nixl"]
        ratios = {
            "ttft_decode": round(k["ttft_decode_ms"] / v["ttft_decode_ms"], 3),
            "decode_tokens_per_s": round(k["decode_tokens_per_s"] / v["decode_tokens_per_s"], 3),
        }
    return {
        "benchmark": "vllm",
        "mode": "quick",
        "note": QUICK_NOTE,
        "params": {
            "requests": args.requests,
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "lease": args.lease,
            "repeat": args.repeat,
            # Other work on the machine moves every figure; this says how much there was.
            "loadavg_1min": round(os.getloadavg()[0], 2),
        },
        "results": results,
        "ratios": ratios,
    }


def render(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    rows = [
        ("engine pair start-up (s)", "startup_s"),
        ("decode output == single engine", "outputs_match_reference"),
        ("TTFT on decode, median (ms)", "ttft_decode_ms"),
        ("KV transfer per request (ms)", "kv_transfer_ms"),
        ("KV bytes per request", "kv_bytes_per_request"),
        ("KV transfer (GB/s)", "kv_transfer_gbps"),
        ("decode throughput (tokens/s)", "decode_tokens_per_s"),
        ("  same D, local prefill (tokens/s)", "local_prefill_decode_tokens_per_s"),
        ("end to end (requests/s)", "e2e_requests_per_s"),
    ]
    res = report["results"]
    names = list(res)
    lines = [QUICK_NOTE, f"{'':34}" + "".join(f"{n:>16}" for n in names)]
    for label, key in rows:
        lines.append(f"{label:34}" + "".join(f"{_fmt(res[n][key]):>16}" for n in names))
    death = "".join(
        f"{_fmt(res[n]['decode_death']['seconds']) + ' s':>16}"
        if res[n]["decode_death"]["reclaimed"]
        else f"{'not reclaimed':>16}"
        for n in names
    )
    lines.append(f"{'decode killed: blocks freed after':34}{death}")
    p = report["params"]
    lines.append(
        f"({p['requests']} requests, {p['prompt_tokens']}-token prompts, {p['decode_tokens']} "
        f"decode tokens, kv_lease_duration {p['lease']} s, medians of {p['repeat']}, "
        f"load average {p['loadavg_1min']})"
    )
    for k, v in report["ratios"].items():
        lines.append(f"kvframe / nixl {k}: {v}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvframe_vllm.bench``; returns the exit status (2 for bad options)."""
    parser = argparse.ArgumentParser(prog="python -m kvframe_vllm.bench")
    add_arguments(parser)
    args = parser.parse_args(argv)
    problem = check_arguments(args)
    if problem is not None:
        print(f"kvframe bench vllm: {problem}", file=sys.stderr)
        return 2
    try:
        if args.quick:
            report = measure(args)
        else:
            from kvframe_vllm import bench_servers

            report = bench_servers.measure(args)
    except EngineError as exc:
        print(f"kvframe bench vllm: {exc}", file=sys.stderr)
        return 1
    if not args.quick:
        print(json.dumps(report, indent=2) if args.json else bench_servers.render(report))
        return 0
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    from kvframe.cli import run_command

    raise SystemExit(run_command("kvframe bench vllm", main))
