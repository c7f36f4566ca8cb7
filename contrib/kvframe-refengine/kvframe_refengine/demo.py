"""kvframe's main job, end to end: disaggregated prefill/decode over NIXL, checked and measured.

``kvframe demo`` (or ``python -m kvframe_refengine.demo``) does this, on loopback:

1. starts a prefill engine (P), a decode engine (D) and a router, each its own process,
   P and D connected by kvframe's P/D connector over the NIXL transport;
2. sends a batch of prompts through the router and checks that every disaggregated greedy
   output equals a single-engine run of the same model token for token and that every
   request's KV came from P, then runs the leak oracle on both engines (no live lease, every
   block free, no transfer left);
3. sends a second batch, kills D with SIGKILL while P holds KV for requests D had queued,
   and shows P freeing it by the rules of the mode, then runs the leak oracle on P;
4. prints a table (``--json`` for machines).

``--mode pull`` (the default): the router asks P, then D, and D READs the KV from P under a
lease P holds; after the kill P reclaims the leased blocks within one heartbeat interval plus
one extension of D's last heartbeat. ``--mode push``: the router sends both legs at once, D
registers its blocks with P under a lease of D's own and P WRITEs the KV into them (the
evidence that it did: D's ``loads_done``, P's ``pushes_done`` and ``bytes_written``); after the
kill P frees the KV of requests whose D died within ``kv_lease_duration`` (P waits that long
for a registration, and that long for D to confirm a registered lease).

``--multi-turn`` (bidirectional mode, with either mode): both engines ``kv_both`` with
``decoder_kv_blocks_ttl`` three leases (:func:`decoder_ttl`); one conversation of
:data:`MULTI_TURNS` turns through the router, each with ``conversation_id`` and the whole
conversation so far as its prompt. D keeps each turn's KV and P pulls it on the next turn. It
prints per turn whether P pulled its history (P's ``history_loads`` and ``history_refused``
counters), the tokens pulled from D and those P had cached, P's leg and the time to first
token; it checks every turn's output against a single engine, that turns 2.. pulled from D,
the leak oracle on P, and (unless ``--no-kill``) that D frees the last turn's KV at its ttl.

Every option is checked before any process starts (:func:`check_options`); a bad one is
refused with exit status 2 and a message naming it. Each process starts in its own process
group (:class:`kvframe.runtime.procs.ChildProcesses`): SIGINT, SIGTERM or SIGHUP stops all
three, prints one line and exits with ``128 + signal``. The first progress line names the
three processes' pids.

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import attrs

from kvframe.connectors.pd.auth import KeyRing
from kvframe.connectors.pd.options import PDOptions
from kvframe.core.lease import LeasePolicy
from kvframe.errors import ConfigError, PluginError
from kvframe.runtime.plugins import PluginHost
from kvframe.runtime.procs import ChildProcesses
from kvframe_refengine.router import post_json
from kvframe_refengine.tokenizer import encode

__all__ = [
    "DEMO_RECOMPUTE_THRESHOLD",
    "MAX_PROMPTS",
    "MODES",
    "MULTI_TURNS",
    "PHASE2_MAX_TOKENS",
    "check_options",
    "decoder_ttl",
    "main",
    "run_demo",
]

#: The demo's modes: the router's (:data:`kvframe_refengine.router.MODES`).
MODES = ("pull", "push")

#: The most prompts the demo takes: phase 2 sends twice as many requests at once, one client
#: thread each, to engines that run 16 (P) and 2 (D) at a time.
MAX_PROMPTS = 64

#: Tokens each phase-2 request asks for (long enough to be running when D is killed).
PHASE2_MAX_TOKENS = 1000

_PROMPTS = [
    "Disaggregated serving splits prefill and decode across machines.",
    "The prefill engine computes the KV cache of the whole prompt in one pass, "
    "and the decode engine pulls it over the network before generating.",
    "A lease keeps the blocks alive while the decoder is queued.",
    "Heartbeats renew the lease; a completion frees it at once; silence lets it expire.",
    "kvframe moves and keeps LLM KV caches between inference-engine instances, "
    "engine-independent, with transports loaded as plugins.",
    "NIXL reads host memory across processes through UCX.",
    "Every end-to-end test ends with a leak check on both engines.",
    "Greedy decoding on the same weights gives the same tokens, wherever the KV came from, "
    "as long as the bytes are exactly right.",
]


#: Turns of the ``--multi-turn`` conversation, and what the user says in each.
MULTI_TURNS = 3
_MESSAGES = [
    "User: In disaggregated serving, where does the KV cache of a conversation live between "
    "two turns?\nAssistant:",
    "\nUser: And when the next turn comes, who computes the history's KV again?\nAssistant:",
    "\nUser: What if the decode engine needs its memory back before then?\nAssistant:",
]
_CONVERSATION_ID = "demo-conversation"


#: ``kv_recompute_threshold`` of the ``--multi-turn`` demo's engines. The demo's answers are
#: short and P's own prefix cache holds the previous prompt's full blocks, so each turn pulls
#: a few dozen tokens from D; the connector's default (64) would recompute them instead.
DEMO_RECOMPUTE_THRESHOLD = 8


def decoder_ttl(lease: float) -> float:
    """The ``decoder_kv_blocks_ttl`` of the ``--multi-turn`` demo: three leases (D keeps a
    turn's KV that long for the next turn; the last turn's is freed then)."""
    return 3 * lease


def _prompt(i: int) -> list[int]:
    return encode(_PROMPTS[i % len(_PROMPTS)] + f" [{i}]")


def _max_model_len() -> int:
    from kvframe_refengine.engine import EngineConfig

    default = attrs.fields(EngineConfig).max_model_len.default
    assert isinstance(default, int)
    return default


def check_options(
    *,
    num_prompts: int,
    max_tokens: int,
    lease: float,
    transport: str,
    auth_key_file: str | None = None,
    mode: str = "pull",
    multi_turn: bool = False,
    tp_size: int = 1,
) -> None:
    """Check the demo's options before anything starts: the same checks the engines would make
    (the P/D connector's configuration, its lease floor and timing, from :mod:`kvframe.config`,
    :class:`~kvframe.core.lease.LeasePolicy` and
    :class:`~kvframe.connectors.pd.options.PDOptions`; the transport from the installed
    plugins) and the demo's own.

    Raises :class:`~kvframe.errors.ConfigError` whose message names the option, the value and
    what would work.
    """
    if mode not in MODES:
        raise ConfigError(f"--mode {mode}: expected one of {', '.join(MODES)}")
    if isinstance(num_prompts, bool) or not 1 <= num_prompts <= MAX_PROMPTS:
        raise ConfigError(
            f"--prompts {num_prompts}: expected 1..{MAX_PROMPTS} (phase 2 sends twice as "
            "many requests at once)"
        )
    limit = _max_model_len()
    longest = max(len(_prompt(i)) for i in range(num_prompts))
    if longest + PHASE2_MAX_TOKENS > limit:  # cannot happen with the built-in prompts
        raise ConfigError(f"--prompts {num_prompts}: a prompt is too long for phase 2")
    if isinstance(max_tokens, bool) or not 1 <= max_tokens <= limit - longest:
        raise ConfigError(
            f"--max-tokens {max_tokens}: expected 1..{limit - longest} (the engines' "
            f"max_model_len is {limit} and the longest prompt has {longest} tokens)"
        )
    if multi_turn:
        words = sum(len(encode(m)) for m in _MESSAGES)
        most = (limit - words) // MULTI_TURNS
        if max_tokens > most:
            raise ConfigError(
                f"--max-tokens {max_tokens}: expected 1..{most} with --multi-turn (the last "
                f"turn's prompt holds every message and answer; max_model_len is {limit})"
            )
    from kvframe_refengine.model import ModelConfig, check_tp_size

    try:
        check_tp_size(ModelConfig(), tp_size)
    except ValueError as exc:
        raise ConfigError(f"--tp-size {tp_size}: {exc}") from None
    host = PluginHost()
    host.load()
    try:
        info = host.transport_info(transport)
    except PluginError as exc:
        raise ConfigError(f"--transport {transport}: {exc}") from exc
    if not info.capabilities.cross_process:
        usable = [
            n for n in host.transport_names() if host.transport_info(n).capabilities.cross_process
        ]
        raise ConfigError(
            f"--transport {transport}: the demo runs P and D as separate processes and this "
            f"transport works within one process only; use one of: {', '.join(usable)}"
        )
    from kvframe_refengine.server import kv_transfer_config

    roles = ("kv_both", "kv_both") if multi_turn else ("kv_producer", "kv_consumer")
    ttl = decoder_ttl(lease) if multi_turn else None
    try:
        for engine_id, role in zip(("demo-P", "demo-D"), roles, strict=True):
            config = kv_transfer_config(
                engine_id=engine_id, role=role, transport=transport, lease=lease,
                decoder_ttl=ttl,
            )  # fmt: skip
            if auth_key_file is not None:
                keyed = kv_transfer_config(
                    engine_id=engine_id, role=role, transport=transport, lease=lease,
                    auth_key_file=auth_key_file,
                )  # fmt: skip
                try:
                    PDOptions.from_extra(keyed.kv_connector_extra_config)
                except ConfigError as exc:
                    raise ConfigError(f"--auth-key-file {auth_key_file}: {exc}") from exc
            LeasePolicy.from_duration(config.kv_lease_duration)
            options = PDOptions.from_extra(
                config.kv_connector_extra_config, config.kv_lease_duration
            )
            if ttl is not None:
                options.decoder_ttl(config.decoder_kv_blocks_ttl)
    except ConfigError as exc:
        raise ConfigError(f"--lease {lease:g}: {exc}") from exc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


class _Proc:
    def __init__(
        self, name: str, args: list[str], log: Callable[[str], None], children: ChildProcesses
    ) -> None:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        self.name = name
        # Its stderr, kept (an anonymous file, gone with this object) so that a process that
        # exits early says why.
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = children.popen(
            [sys.executable, "-m", *args],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            text=True,
        )
        self.log = log

    def wait_ready(self, timeout: float) -> None:
        """Wait for the ``{"ready": true, ...}`` line; raises ``RuntimeError`` when the process
        exits first (quoting the end of its stderr) or does not start within ``timeout``
        seconds."""
        assert self.proc.stdout is not None
        import select

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode}; the end of its "
                    f"stderr: {self.stderr_tail()!r}"
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if '"ready": true' in line:
                    return
        raise RuntimeError(f"{self.name} did not start within {timeout:.0f} s")

    def stderr_tail(self, limit: int = 600) -> str:
        """The last ``limit`` characters the process wrote to stderr."""
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - limit))
        return self.stderr.read().decode(errors="replace")

    def kill(self) -> float:
        self.proc.send_signal(signal.SIGKILL)
        t = time.monotonic()
        self.proc.wait(timeout=10)
        return t

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.stderr.close()


def _wait_for(pred: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def run_demo(
    *,
    num_prompts: int = 8,
    max_tokens: int = 16,
    lease: float = 6.0,
    transport: str = "nixl",
    kill: bool = True,
    log: Callable[[str], None] = print,
    auth_key_file: str | None = None,
    mode: str = "pull",
    multi_turn: bool = False,
    tp_size: int = 1,
) -> dict[str, Any]:
    """Run the demo (``multi_turn``: a conversation, see the module's docstring; ``tp_size``:
    both engines tensor-parallel, ``server --tp-size``); returns the
    results (what ``--json`` prints). Never raises for a failed
    check: ``result["ok"]`` says whether everything passed and ``result["checks"]`` which.

    Raises :class:`~kvframe.errors.ConfigError` for a bad option (:func:`check_options`),
    before starting anything, and :class:`~kvframe.runtime.procs.Stopped` when a signal
    stopped it (under :func:`~kvframe.runtime.procs.stop_on_signals`; every process it
    started is stopped by then).
    """
    check_options(
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        lease=lease,
        transport=transport,
        auth_key_file=auth_key_file,
        mode=mode,
        multi_turn=multi_turn,
        tp_size=tp_size,
    )
    children = ChildProcesses(grace=10.0)

    def quiet_when_stopping(msg: str) -> None:  # what fails as the demo stops is not news
        if not children.stopping:
            log(msg)

    try:
        return _run(
            children, num_prompts, max_tokens, lease, transport, kill, quiet_when_stopping,
            auth_key_file, mode, multi_turn, tp_size,
        )  # fmt: skip
    finally:
        children.close()


def _run(
    children: ChildProcesses,
    num_prompts: int,
    max_tokens: int,
    lease: float,
    transport: str,
    kill: bool,
    log: Callable[[str], None],
    auth_key_file: str | None = None,
    mode: str = "pull",
    multi_turn: bool = False,
    tp_size: int = 1,
) -> dict[str, Any]:
    interval, extension = lease / 6, lease * 2 / 3
    ports = {k: _free_port() for k in ("prefill", "decode", "router")}
    base = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    common = ["--transport", transport, "--lease", str(lease)]
    if auth_key_file is not None:  # the same fleet key for both engines
        common += ["--auth-key-file", auth_key_file]
    ttl = decoder_ttl(lease)
    # Multi-turn: each engine holds KV for the other and reads the other's (kv_both).
    roles = ("kv_both", "kv_both") if multi_turn else ("kv_producer", "kv_consumer")
    if tp_size != 1:
        common += ["--tp-size", str(tp_size)]
    if multi_turn:
        common += ["--decoder-ttl", str(ttl)]
        common += ["--kv-extra", json.dumps({"kv_recompute_threshold": DEMO_RECOMPUTE_THRESHOLD})]
    procs = {
        "prefill": _Proc(
            "prefill engine",
            [
                "kvframe_refengine.server",
                "--port",
                str(ports["prefill"]),
                "--engine-id",
                "demo-P",
                "--role",
                roles[0],
                *common,
            ],
            log,
            children,
        ),
        "decode": _Proc(
            "decode engine",
            [
                "kvframe_refengine.server",
                "--port",
                str(ports["decode"]),
                "--engine-id",
                "demo-D",
                "--role",
                roles[1],
                "--max-num-seqs",
                "2",
                *common,
            ],
            log,
            children,
        ),
        "router": _Proc(
            "router",
            [
                "kvframe_refengine.router",
                "--port",
                str(ports["router"]),
                "--prefill",
                base["prefill"],
                "--decode",
                base["decode"],
                "--mode",
                mode,
            ],
            log,
            children,
        ),
    }
    checks: dict[str, bool] = {}
    result: dict[str, Any] = {
        "mode": mode,
        "multi_turn": multi_turn,
        "tp_size": tp_size,
        "transport": transport,
        "lease_duration_s": lease,
        "authenticated": auth_key_file is not None,
        "checks": checks,
    }
    t_start = time.monotonic()
    try:
        pids = ", ".join(f"{k} {p.proc.pid}" for k, p in procs.items())
        log(
            f"starting prefill, decode and router on 127.0.0.1:{ports['prefill']}, "
            f"{ports['decode']}, {ports['router']} (transport {transport}, {mode} mode"
            f"{', multi-turn' if multi_turn else ''}"
            f"{f', tensor-parallel {tp_size} ranks each' if tp_size > 1 else ''}; pids "
            f"{pids}) ..."
        )
        for p in procs.values():
            p.wait_ready(120)
        log(f"  up in {time.monotonic() - t_start:.1f} s")

        if multi_turn:
            result["decoder_kv_blocks_ttl_s"] = ttl
            result["conversation"] = _conversation(base, max_tokens, ttl, kill, checks, log)
        else:
            prompts = [_prompt(i) for i in range(num_prompts)]
            log(f"phase 1: {num_prompts} prompts through the router, max_tokens={max_tokens}")
            responses = _send_batch(base["router"], prompts, max_tokens, log)
            ok_resps = [r for r in responses if r[0] == 200]
            checks["all requests served"] = len(ok_resps) == num_prompts
            from_p = sum(1 for _, b in ok_resps if b["usage"]["external_tokens"] > 0)

            log("  reference: the same prompts on one engine, no disaggregation")
            from kvframe_refengine.server import build_engine

            ref_engine = build_engine(engine_id="demo-ref", role=None)
            try:
                ref = ref_engine.generate(prompts, max_tokens)
            finally:
                ref_engine.shutdown()
            matches = sum(
                1
                for (code, body), r in zip(responses, ref, strict=True)
                if code == 200 and body["choices"][0]["token_ids"] == list(r.token_ids)
            )
            checks["outputs equal single-engine greedy outputs"] = matches == num_prompts
            log(f"  token-for-token equal: {matches}/{num_prompts}")

            def both_clean() -> bool:
                return all(_get(f"{base[k]}/leaks")["clean"] for k in ("prefill", "decode"))

            checks["leak oracle after phase 1 (P and D)"] = _wait_for(both_clean, 5 * lease)
            p_stats = _get(f"{base['prefill']}/stats")["connector"]
            d_stats = _get(f"{base['decode']}/stats")["connector"]
            # D's time to first token counts from D's leg; the router says when that leg started
            # (after P's answer in pull mode, at once in push mode).
            ttfts = [b["timing"].get("ttft_s", 0.0) for c, b in ok_resps]
            starts = [b["router_timing"]["decode_start_s"] for c, b in ok_resps]
            d_c, p_c = d_stats["counters"], p_stats["counters"]
            # The workers' counters add over the ranks, and every rank of a TP engine moves
            # its own heads of each request: per request, divide by the ranks.
            loads = int(d_c.get("loads_done", 0)) // tp_size
            if mode == "push":  # P WRITEs into D's blocks: P measures the transfers
                moved = int(p_c.get("bytes_written", 0))
                transfer_s = float(p_c.get("push_seconds", 0.0))
                pushed = int(p_c.get("pushes_done", 0)) // tp_size
                checks["every request's KV was pushed by P (D's loads, P's pushes)"] = (
                    from_p == loads == pushed == num_prompts and moved > 0
                )
            else:
                moved = int(d_c.get("bytes_read", 0))
                transfer_s = float(d_c.get("transfer_seconds", 0.0))
                checks["every request's KV was pulled from P"] = from_p == num_prompts
            totals = sorted(s + t for s, t in zip(starts, ttfts, strict=True))
            mean_ttft = sum(totals) / len(totals) if totals else 0.0
            median_ttft = statistics.median(totals) if totals else 0.0
            p90_ttft = totals[max(0, math.ceil(0.9 * len(totals)) - 1)] if totals else 0.0
            result["phase1"] = {
                "requests": num_prompts,
                "served": len(ok_resps),
                "equal_outputs": matches,
                "kv_bytes_moved": moved,
                "kv_loads": loads,
                "transfer_time_s": transfer_s,
                "load_wait_s": float(d_c.get("load_wait_seconds", 0.0)),
                "mean_transfer_s": transfer_s / loads if loads else 0.0,
                "mean_ttft_s": mean_ttft,
                "median_ttft_s": median_ttft,
                "p90_ttft_s": p90_ttft,
                "transfer_share_of_ttft": (transfer_s / loads) / median_ttft
                if loads and median_ttft
                else 0.0,
            }
            if mode == "push":
                result["phase1"]["pushes"] = _push_counts(p_c, d_c)
            else:
                result["phase1"]["leases"] = _lease_counts(p_c)

            if kill and mode == "push":
                result["phase2"] = _kill_phase_push(base, procs, prompts, lease, checks, log)
            elif kill:
                result["phase2"] = _kill_phase(
                    base, procs, prompts, lease, interval, extension, checks, log
                )
    except Exception as exc:  # a demo reports, it does not crash
        checks[f"no unexpected error ({type(exc).__name__}: {exc})"] = False
    finally:
        for p in procs.values():
            p.stop()
    result["elapsed_s"] = time.monotonic() - t_start
    result["ok"] = bool(checks) and all(checks.values())
    return result


def _conversation(
    base: dict[str, str],
    max_tokens: int,
    ttl: float,
    wait_ttl: bool,
    checks: dict[str, bool],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """``--multi-turn``: one conversation of :data:`MULTI_TURNS` turns through the router, each
    prompt the conversation so far; then (``wait_ttl``) D's kept KV of the last turn, freed at
    ``ttl``."""
    log(
        f"conversation: {MULTI_TURNS} turns through the router (conversation_id "
        f"{_CONVERSATION_ID!r}), each prompt the whole conversation so far, max_tokens="
        f"{max_tokens}"
    )

    def p_counters() -> dict[str, float]:
        stats = _get(f"{base['prefill']}/stats")
        return {**stats["connector"]["counters"], **stats["connector_scheduler"]["counters"]}

    def pulls(c: dict[str, float]) -> float:
        # history_pulled: P's loads of a history that completed; history_loads: planned.
        return c.get("history_pulled", c.get("history_loads", 0.0))

    history: list[int] = []
    prompts: list[list[int]] = []
    turns: list[dict[str, Any]] = []
    answered_at = time.monotonic()
    for i, message in enumerate(_MESSAGES):
        prompt = history + encode(message)
        before = p_counters()
        code, body = post_json(
            f"{base['router']}/v1/completions",
            {"prompt": prompt, "max_tokens": max_tokens, "conversation_id": _CONVERSATION_ID},
            timeout=120,
        )
        answered_at = time.monotonic()
        if code != 200:
            log(f"  [{code}] turn {i + 1}: {body.get('error', body)}")
            turns.append({"turn": i + 1, "status": code})
            break
        after = p_counters()
        usage = body.get("prefill_usage") or {}
        conv = body.get("conversation") or {}
        timing = body["router_timing"]
        answer: list[int] = list(body["choices"][0]["token_ids"])
        turn: dict[str, Any] = {
            "turn": i + 1,
            "status": code,
            "prompt_tokens": len(prompt),
            "history_sent": bool(conv.get("history_sent")),
            "history_pulled": pulls(after) - pulls(before) > 0,
            "history_refused": after.get("history_refused", 0) - before.get("history_refused", 0)
            > 0,
            "tokens_pulled": int(usage.get("external_tokens", 0)),
            "tokens_cached_on_p": int(usage.get("cached_tokens", 0)),
            "kept_by_d": bool(conv.get("kept")),
            "prefill_s": float(timing["prefill_s"]),
            "ttft_s": float(timing["decode_start_s"]) + float(body["timing"].get("ttft_s", 0)),
            "token_ids": answer,
        }
        turns.append(turn)
        prompts.append(prompt)
        how = (
            f"pulled its history from D: {turn['tokens_pulled']} tokens (and "
            f"{turn['tokens_cached_on_p']} from its own prefix cache)"
            if turn["history_pulled"]
            else "refused the history and recomputed it"
            if turn["history_refused"]
            else "had no history to pull"
        )
        log(
            f"  turn {i + 1}: {len(prompt)} prompt tokens; P {how}; P's leg "
            f"{turn['prefill_s'] * 1e3:.1f} ms, TTFT {turn['ttft_s'] * 1e3:.1f} ms"
        )
        history = prompt + answer
    served = [t for t in turns if t["status"] == 200]
    checks[f"all {MULTI_TURNS} turns served"] = len(served) == MULTI_TURNS

    log("  reference: each turn's prompt on one engine, no disaggregation")
    from kvframe_refengine.server import build_engine

    ref_engine = build_engine(engine_id="demo-ref", role=None)
    try:
        ref = ref_engine.generate(prompts, max_tokens) if prompts else []
    finally:
        ref_engine.shutdown()
    for t, r in zip(served, ref, strict=True):
        t["equal_to_single_engine"] = t["token_ids"] == list(r.token_ids)
    equal = sum(1 for t in served if t["equal_to_single_engine"])
    log(f"  token-for-token equal: {equal}/{len(served)}")
    checks["every turn's output equals a single-engine run of its prompt"] = (
        equal == len(served) == MULTI_TURNS
    )
    checks["turns 2.. pulled their history from D (kept by D the turn before)"] = (
        len(served) == MULTI_TURNS
        and all(t["kept_by_d"] for t in served)
        and all(t["history_pulled"] and t["tokens_pulled"] > 0 for t in served[1:])
    )
    checks["leak oracle on P after the conversation"] = _wait_for(
        lambda: bool(_get(f"{base['prefill']}/leaks")["clean"]), 10
    )
    out: dict[str, Any] = {"turns": turns}
    if not wait_ttl:
        return out

    def d_clean() -> bool:
        return bool(_get(f"{base['decode']}/leaks")["clean"])

    kept_then = not d_clean()
    log(f"  D keeps the last turn's KV for a next turn; waiting for its ttl ({ttl:g} s)")
    freed = _wait_for(d_clean, ttl + 5, 0.05)
    freed_s = time.monotonic() - answered_at
    log(f"  D freed it {freed_s:.2f} s after its answer (decoder_kv_blocks_ttl {ttl:g} s)")
    checks["D kept the last turn's KV and freed it at decoder_kv_blocks_ttl"] = (
        kept_then and freed and freed_s <= ttl + 2.0
    )
    out["kept_freed_after_s"] = freed_s
    return out


def _send_batch(
    router: str, prompts: list[list[int]], max_tokens: int, log: Callable[[str], None]
) -> list[tuple[int, dict[str, Any]]]:
    def one(i: int) -> tuple[int, dict[str, Any]]:
        try:
            code, body = post_json(
                f"{router}/v1/completions",
                {"prompt": prompts[i], "max_tokens": max_tokens},
                timeout=120,
            )
        except OSError as exc:
            return 599, {"error": {"message": str(exc)}}
        mark = "ok " if code == 200 else f"{code}"
        log(f"  [{mark}] request {i}: {len(prompts[i])} prompt tokens")
        return code, body

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _lease_counts(c: dict[str, float]) -> dict[str, int]:
    return {
        k: int(c.get(f"leases_{k}", 0))
        for k in ("granted", "renewed", "consumed", "aborted", "expired")
    }


def _push_counts(p: dict[str, float], d: dict[str, float]) -> dict[str, int]:
    # P's offers (finished prefills), D's registrations, P's WRITEs done and failed, P's KV
    # freed with no registration, P's heartbeats of D's leases.
    return {
        "offered": int(p.get("push_sources", 0)),
        "registered": int(d.get("push_registrations", 0)),
        "registrations_received": int(p.get("push_registrations_received", 0)),
        "done": int(p.get("pushes_done", 0)),
        "failed": int(p.get("pushes_failed", 0)),
        "unsent": int(p.get("push_unsent", 0)),
        "heartbeats": int(p.get("push_heartbeats_sent", 0)),
    }


@attrs.frozen
class _Kill:
    held_before: bool  # P held KV (two requests' or more) once the batch was under way
    held_at_kill: int
    freed: bool  # nothing held any more, within 3 leases + 5 s of the kill
    freed_after_s: float


def _kill_while_held(
    base: dict[str, str],
    procs: dict[str, _Proc],
    prompts: list[list[int]],
    held: Callable[[], int],
    settle_s: float,
    lease: float,
    say_held: Callable[[int], str],
    log: Callable[[str], None],
) -> _Kill:
    # Twice the prompts, long generations: D (two at a time) keeps most of them queued.
    batch = prompts * 2
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(batch))
    futs = [
        pool.submit(
            post_json,
            f"{base['router']}/v1/completions",
            {"prompt": p, "max_tokens": PHASE2_MAX_TOKENS},
            120,
        )
        for p in batch
    ]
    got = _wait_for(lambda: held() >= 2, 30, 0.02)
    time.sleep(settle_s)
    # Kill right after seeing KV held (D reads a queued request as soon as a slot frees).
    got = got and _wait_for(lambda: held() >= 1, 30, 0.005)
    n_held = held()
    log(say_held(n_held))
    killed_at = procs["decode"].kill()
    freed = _wait_for(lambda: held() == 0, 3 * lease + 5, 0.02)
    freed_s = time.monotonic() - killed_at
    for f in futs:
        with contextlib.suppress(Exception):  # requests D was running died with it
            f.result(timeout=30)
    pool.shutdown(wait=True)
    return _Kill(got, n_held, freed, freed_s)


def _kill_phase_push(
    base: dict[str, str],
    procs: dict[str, _Proc],
    prompts: list[list[int]],
    lease: float,
    checks: dict[str, bool],
    log: Callable[[str], None],
) -> dict[str, Any]:
    log("phase 2: a long batch; D runs two at a time, P keeps the KV of the rest for D")

    def p_counters() -> dict[str, float]:
        c: dict[str, float] = _get(f"{base['prefill']}/stats")["connector"]["counters"]
        return c

    def held() -> int:
        # Requests whose KV P keeps for D (offered, not yet pushed or given up).
        gauges = _get(f"{base['prefill']}/stats")["connector_scheduler"]["gauges"]
        return int(gauges.get("scheduler_leases_held", 0))

    before = _push_counts(p_counters(), {})
    # Settle: let D run its first two and P heartbeat what D registered.
    k = _kill_while_held(
        base, procs, prompts, held, lease / 3, lease,
        lambda n: f"  P keeps the KV of {n} requests for D; killing D (SIGKILL)", log,
    )  # fmt: skip
    log(
        f"  P freed the KV of every request whose D died {k.freed_after_s:.2f} s after the "
        f"kill (push rule: within kv_lease_duration {lease:.2f} s: P's wait for a "
        "registration, and for D to confirm a registered lease)"
    )
    after = _push_counts(p_counters(), {})
    checks["P kept KV for D's queue when D died"] = k.held_before and k.held_at_kill > 0
    checks["P freed the KV of every request whose D died by the push rules"] = (
        k.freed and k.freed_after_s <= lease + 1.0
    )
    checks["leak oracle on P after D died"] = _wait_for(
        lambda: bool(_get(f"{base['prefill']}/leaks")["clean"]), 5
    )
    delta = {k: after[k] - before[k] for k in after if k != "registered"}
    return {
        "kv_held_at_kill": k.held_at_kill,
        "freed_after_kill_s": k.freed_after_s,
        "freed_bound_s": lease,
        **delta,
    }


def _kill_phase(
    base: dict[str, str],
    procs: dict[str, _Proc],
    prompts: list[list[int]],
    lease: float,
    interval: float,
    extension: float,
    checks: dict[str, bool],
    log: Callable[[str], None],
) -> dict[str, Any]:
    log("phase 2: a long batch; D runs two at a time, the rest wait in its queue, heartbeating")
    before = _lease_counts(_get(f"{base['prefill']}/stats")["connector"]["counters"])

    def held() -> int:
        return int(_get(f"{base['prefill']}/stats")["connector"]["gauges"].get("leases_held", 0))

    # Settle: let heartbeats flow for a while.
    k = _kill_while_held(
        base, procs, prompts, held, 2 * interval, lease,
        lambda n: f"  P holds {n} leases for requests queued on D; killing D (SIGKILL)", log,
    )  # fmt: skip
    got_leases, n_held, reclaimed, reclaim_s = (
        k.held_before,
        k.held_at_kill,
        k.freed,
        k.freed_after_s,
    )
    bound = extension + interval
    log(
        f"  P reclaimed every leased block {reclaim_s:.2f} s after the kill "
        f"(lease rule: within extension {extension:.2f} s + interval {interval:.2f} s "
        f"of D's last heartbeat)"
    )
    after = _lease_counts(_get(f"{base['prefill']}/stats")["connector"]["counters"])
    checks["P held leases for D's queue when D died"] = got_leases and n_held > 0
    checks["P reclaimed all leased blocks by the lease rules"] = (
        reclaimed and reclaim_s <= bound + 1.0
    )
    checks["leak oracle on P after D died"] = _wait_for(
        lambda: bool(_get(f"{base['prefill']}/leaks")["clean"]), 5
    )
    return {
        "leases_held_at_kill": n_held,
        "reclaim_after_kill_s": reclaim_s,
        "reclaim_bound_s": bound,
        "expired": after["expired"] - before["expired"],
        "consumed": after["consumed"] - before["consumed"],
    }


def _table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = [("mode", str(result.get("mode", "pull")))]
    conv = result.get("conversation")
    if conv:
        rows[0] = ("mode", f"{rows[0][1]}, multi-turn")
        for t in conv["turns"]:
            if t["status"] != 200:
                rows.append((f"turn {t['turn']}", f"failed ({t['status']})"))
                continue
            pulled = (
                f"pulled {t['tokens_pulled']} tokens from D"
                if t["history_pulled"]
                else "recomputed (history refused)"
                if t["history_refused"]
                else "no history"
            )
            same = "equal" if t.get("equal_to_single_engine") else "DIFFERENT"
            rows.append(
                (
                    f"turn {t['turn']} ({t['prompt_tokens']} prompt tokens)",
                    f"{pulled}; TTFT {t['ttft_s'] * 1e3:.1f} ms; {same} to single engine",
                )
            )
        if "kept_freed_after_s" in conv:
            rows.append(
                (
                    "D freed the last turn's kept KV after (ttl)",
                    f"{conv['kept_freed_after_s']:.2f} s ({result['decoder_kv_blocks_ttl_s']:g} s)",
                )
            )
    p1 = result.get("phase1")
    if p1:
        rows += [
            (
                "requests (served / equal to single engine)",
                f"{p1['requests']} ({p1['served']} / {p1['equal_outputs']})",
            ),
            ("KV bytes moved P→D", f"{p1['kv_bytes_moved']:,}"),
            (
                "KV transfer time, total / per request",
                f"{p1['transfer_time_s'] * 1e3:.2f} ms / {p1['mean_transfer_s'] * 1e3:.3f} ms",
            ),
        ]
        if "leases" in p1:
            rows.append(
                (
                    "KV loads as D's engine saw them (post → seen done)",
                    f"{p1['load_wait_s'] * 1e3:.2f} ms in all",
                )
            )
        rows += [
            (
                "time to first token (router), median / p90",
                f"{p1['median_ttft_s'] * 1e3:.1f} ms / {p1['p90_ttft_s'] * 1e3:.1f} ms",
            ),
            (
                "mean transfer as a share of median TTFT",
                f"{100 * p1['transfer_share_of_ttft']:.2f} %",
            ),
        ]
        if "leases" in p1:
            rows.append(
                (
                    "leases granted / renewed / consumed / expired",
                    "{granted} / {renewed} / {consumed} / {expired}".format(**p1["leases"]),
                )
            )
        if "pushes" in p1:
            rows.append(
                (
                    "pushes offered / registered / done / failed / unsent",
                    "{offered} / {registered} / {done} / {failed} / {unsent}".format(
                        **p1["pushes"]
                    ),
                )
            )
    p2 = result.get("phase2")
    if p2 and "kv_held_at_kill" in p2:
        rows += [
            ("requests whose KV P kept when D was killed", str(p2["kv_held_at_kill"])),
            (
                "freed after the kill (bound)",
                f"{p2['freed_after_kill_s']:.2f} s ({p2['freed_bound_s']:.2f} s)",
            ),
            (
                "phase 2 on P: offered / registered / done / failed / unsent",
                "{offered} / {registrations_received} / {done} / {failed} / {unsent}".format(**p2),
            ),
        ]
    elif p2:
        rows += [
            ("leases held by P when D was killed", str(p2["leases_held_at_kill"])),
            (
                "reclaimed after the kill (bound)",
                f"{p2['reclaim_after_kill_s']:.2f} s ({p2['reclaim_bound_s']:.2f} s)",
            ),
            ("leases expired / consumed in phase 2", f"{p2['expired']} / {p2['consumed']}"),
        ]
    width = max((len(k) for k, _ in rows), default=10)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    for name, ok in result["checks"].items():
        lines.append(f"[{'PASS' if ok else 'FAIL'}] {name}")
    lines.append(
        f"\n{'all checks passed' if result['ok'] else 'SOME CHECKS FAILED'} "
        f"in {result['elapsed_s']:.1f} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvframe demo`` / ``python -m kvframe_refengine.demo``; returns the exit status (2 for
    a bad option, with a message naming it; nothing was started then). ``--fleet`` runs the
    fleet demo instead (:mod:`kvframe_refengine.demo_fleet`, its own options)."""
    args_in = sys.argv[1:] if argv is None else argv
    if "--fleet" in args_in:
        from kvframe_refengine import demo_fleet

        return demo_fleet.main(args_in)
    ap = argparse.ArgumentParser(prog="kvframe demo", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    ap.add_argument(
        "--fleet", action="store_true",
        help="run the fleet demo instead: 2 P + 2 D + router on a real etcd, one P and one D "
        "killed under load (`kvframe demo --fleet --help`)",
    )  # fmt: skip
    ap.add_argument(
        "--prompts", type=int, default=8, help=f"requests per batch, 1..{MAX_PROMPTS} (8)"
    )
    ap.add_argument(
        "--max-tokens", type=int, default=16, help="tokens decoded per phase-1 request (16)"
    )
    ap.add_argument("--lease", type=float, default=6.0, help="kv_lease_duration in seconds (6)")
    ap.add_argument(
        "--transport", default="nixl", help="a transport that works across processes (nixl)"
    )
    ap.add_argument(
        "--mode", default="pull",
        help="pull: D reads P's KV after P answered (default); push: both legs at once, P "
        "writes into D's blocks",
    )  # fmt: skip
    ap.add_argument(
        "--multi-turn", action="store_true",
        help=f"run a {MULTI_TURNS}-turn conversation instead: P pulls each turn's history "
        "from D, which kept it (bidirectional mode; both engines kv_both)",
    )  # fmt: skip
    ap.add_argument(
        "--tp-size", type=int, default=1,
        help="tensor-parallel ranks of each engine (worker processes: server --tp-size; 1)",
    )  # fmt: skip
    ap.add_argument(
        "--no-kill", action="store_true",
        help="skip the D-killed phase (with --multi-turn: the wait for D's ttl)",
    )  # fmt: skip
    ap.add_argument(
        "--auth-key-file", default=None,
        help="a fleet key file for both engines (docs/security.md); default: a fresh one",
    )  # fmt: skip
    ap.add_argument(
        "--no-auth", action="store_true",
        help="run both engines unauthenticated (no fleet key: see docs/security.md)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    quiet = args.json
    if args.no_auth and args.auth_key_file is not None:
        print("kvframe demo: --no-auth and --auth-key-file exclude each other", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    try:
        with tempfile.TemporaryDirectory(prefix="kvframe-demo-key-") as keydir:
            key_file = args.auth_key_file
            if key_file is None and not args.no_auth:
                # Secure by default: a fresh fleet key for this run, removed with it (after
                # the options are checked: a bad one is refused before anything happens).
                check_options(
                    num_prompts=args.prompts,
                    max_tokens=args.max_tokens,
                    lease=args.lease,
                    transport=args.transport,
                    mode=args.mode,
                    multi_turn=args.multi_turn,
                    tp_size=args.tp_size,
                )
                key_file = os.path.join(keydir, "fleet.key")
                KeyRing.generate_file(key_file, "demo")
                log("fleet key: a fresh one for this run (--auth-key-file PATH for yours)")
            result = run_demo(
                num_prompts=args.prompts,
                max_tokens=args.max_tokens,
                lease=args.lease,
                transport=args.transport,
                kill=not args.no_kill,
                log=log,
                auth_key_file=key_file,
                mode=args.mode,
                multi_turn=args.multi_turn,
                tp_size=args.tp_size,
            )
    except ConfigError as exc:
        print(f"kvframe demo: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else "\n" + _table(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    from kvframe.cli import run_command

    raise SystemExit(run_command("kvframe demo", main))
