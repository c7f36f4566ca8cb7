"""``kvframe demo --fleet``: a fleet that discovers itself through a real etcd, loses a
prefill and a decode engine under load, and serves on.

On loopback, each its own process:

1. starts etcd (the ``etcd`` binary: Debian's ``etcd-server``), two prefill and two decode
   engines registered in it (``server --discovery etcd://...?ttl=2``) and a router that finds
   them there (``router --discovery``, ``--policy prefix``);
2. phase 1: sends prompts that share prefixes in two groups; checks every output equals a
   single engine's, that both prefill and both decode engines served, and that the router
   routed on prefixes (picks whose engine held part of the prompt);
3. phase 2: sends a stream of requests from four clients and, once a third of them were
   answered, SIGKILLs one prefill and one decode engine; checks that every request was served
   (a request whose engine died is routed again from a fresh prefill leg: the router's
   ``--retries``) or failed by that policy, that served outputs still equal the single
   engine's, that the router stopped routing to the dead engines within the registrations'
   TTL, that the survivors heard of them through the etcd watch (the prefill engine aborted
   the leases the dead decoder claimed and those granted for it that it had not claimed yet,
   the router having named it in their prefill legs; the decode engine failed its loads from
   the dead prefill engine: their ``engines_gone`` counters), and that every block was
   reclaimed (the leak oracle on both survivors);
4. stops one survivor cleanly (SIGTERM): its registration is withdrawn, and the router drops
   it at once;
5. prints a table and the checks (``--json`` for machines).

Exit status 0 when every check passed, 1 otherwise, 2 for a bad option.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvframe.connectors.pd.auth import KeyRing
from kvframe.errors import ConfigError
from kvframe.runtime.procs import ChildProcesses
from kvframe_refengine.demo import _get, _wait_for, check_options
from kvframe_refengine.fleet_procs import LocalEtcd, LocalFleet, etcd_binary
from kvframe_refengine.router import post_json

__all__ = ["FAILURES_BY_POLICY", "main", "run_fleet_demo"]

#: Error types a request may end with when its engines died and the router's retries ran out
#: (or no engine of a role was left): "failed by policy".
FAILURES_BY_POLICY = frozenset(
    {
        "prefill_unreachable",
        "decode_unreachable",
        "prefill_failed",
        "decode_failed",
        "no_prefill_engine",
        "no_decode_engine",
    }
)

_PREFIXES = [
    "In a disaggregated fleet, prefill engines compute the KV cache of the prompt and decode "
    "engines read it under a lease; the router chooses which engine serves each request. ",
    "An engine that dies vanishes from etcd within its lease's TTL; the survivors abort the "
    "leases it claimed and fail the loads it owed, and the router stops sending it work. ",
]


def _prompt(i: int) -> str:
    return _PREFIXES[i % 2] + f"Question {i}: what happens to request number {i}?"


def run_fleet_demo(
    *,
    prompts: int = 8,
    load: int = 24,
    max_tokens: int = 16,
    lease: float = 6.0,
    ttl: int = 2,
    transport: str = "nixl",
    auth_key_file: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the fleet demo (see the module); returns the results (``--json``). Never raises for
    a failed check. Raises :class:`~kvframe.errors.ConfigError` for a bad option (nothing
    started then)."""
    check_options(num_prompts=prompts, max_tokens=max_tokens, lease=lease, transport=transport)
    if not 4 <= load <= 64:
        raise ConfigError(f"--load {load}: send 4 to 64 requests in phase 2")
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 2 <= ttl < lease * 2 / 3:
        raise ConfigError(
            f"--ttl {ttl}: the registrations' TTL must be a whole number of seconds >= 2 and "
            f"shorter than a lease extension ({lease * 2 / 3:g} s), or discovery accelerates "
            "nothing"
        )
    etcd_binary()
    children = ChildProcesses(grace=10.0)
    try:
        return _run(children, prompts, load, max_tokens, lease, ttl, transport, auth_key_file, log)
    finally:
        children.close()


def _counters(url: str) -> dict[str, float]:
    stats = _get(f"{url}/stats")
    return {**stats["connector"]["counters"], **stats["connector_scheduler"]["counters"]}


def _run(
    children: ChildProcesses,
    num_prompts: int,
    load: int,
    max_tokens: int,
    lease: float,
    ttl: int,
    transport: str,
    auth_key_file: str | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    t_start = time.monotonic()
    checks: dict[str, bool] = {}
    result: dict[str, Any] = {
        "transport": transport,
        "lease_duration_s": lease,
        "registration_ttl_s": ttl,
        "checks": checks,
    }
    tmp = children.mkdtemp("kvframe-fleet-demo-")
    if auth_key_file is None:
        auth_key_file = os.path.join(tmp, "fleet.key")
        KeyRing.generate_file(auth_key_file, "demo")
    etcd = LocalEtcd(tmp / "etcd", children)
    log(f"starting etcd on {etcd.endpoint} ...")
    etcd.start()
    fleet = LocalFleet(
        children,
        etcd,
        log,
        num_prefill=2,
        num_decode=2,
        ttl=ttl,
        server_args=[
            "--transport", transport, "--lease", str(lease), "--auth-key-file", auth_key_file,
        ],
    )  # fmt: skip
    router = fleet.start_router("--policy", "prefix")
    log(f"starting 2 prefill and 2 decode engines and a router (pids {fleet.pids()}) ...")
    fleet.wait_ready()
    everyone = set(fleet.engines)
    checks["the router found every engine through etcd"] = _wait_for(
        lambda: fleet.routed_engines() == everyone, 15
    )
    log(f"  up in {time.monotonic() - t_start:.1f} s; the router routes to {sorted(everyone)}")

    texts = [_prompt(i) for i in range(max(num_prompts, load))]
    log("  reference: the same prompts on one engine, no disaggregation")
    from kvframe_refengine.server import build_engine
    from kvframe_refengine.tokenizer import encode

    ref_engine = build_engine(engine_id="fleet-ref", role=None)
    try:
        ref = {
            i: list(out.token_ids)
            for i, out in enumerate(ref_engine.generate([encode(t) for t in texts], max_tokens))
        }
    finally:
        ref_engine.shutdown()

    def send(i: int) -> tuple[int, dict[str, Any]]:
        try:
            return post_json(
                f"{router}/v1/completions",
                {"prompt": texts[i], "max_tokens": max_tokens, "timeout_s": 60},
                timeout=120,
            )
        except OSError as exc:
            return 599, {"error": {"message": str(exc), "type": "router_unreachable"}}

    # -- phase 1 ---------------------------------------------------------------------------
    log(f"phase 1: {num_prompts} prompts sharing two prefixes, through the router")
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        phase1 = list(pool.map(send, range(num_prompts)))
    served1 = [(i, b) for i, (c, b) in enumerate(phase1) if c == 200]
    used = {b["engines"]["prefill"] for _, b in served1} | {
        b["engines"]["decode"] for _, b in served1
    }
    health = fleet.router_health()["fleet"]
    result["phase1"] = {
        "requests": num_prompts,
        "served": len(served1),
        "equal_outputs": sum(1 for i, b in served1 if b["choices"][0]["token_ids"] == ref[i]),
        "engines_used": sorted(used),
        "router_picks": health["picks"],
        "prefix_hits": health["prefix_hits"],
    }
    checks["phase 1: every request served, equal to a single engine"] = (
        result["phase1"]["equal_outputs"] == num_prompts
    )
    checks["phase 1: both prefill and both decode engines served"] = used == everyone
    checks["phase 1: the router routed on cached prefixes"] = health["prefix_hits"] > 0

    # -- phase 2 ---------------------------------------------------------------------------
    victims = ["fleet-P0", "fleet-D0"]
    log(f"phase 2: {load} requests from 4 clients; {' and '.join(victims)} killed under load")
    answered = threading.Semaphore(0)
    kill_at = max(1, load // 3)
    results: dict[int, tuple[int, dict[str, Any], float]] = {}

    def one(i: int) -> None:
        code, body = send(i)
        results[i] = (code, body, time.monotonic())
        answered.release()

    killed_at = 0.0
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(one, i) for i in range(load)]
        for _ in range(kill_at):
            answered.acquire()
        for v in victims:
            fleet.engines[v][0].kill()
        killed_at = time.monotonic()
        log(f"  killed {' and '.join(victims)} (SIGKILL) after {kill_at} answers")
        dropped = _wait_for(lambda: not fleet.routed_engines() & set(victims), ttl + 10, 0.02)
        dropped_after = time.monotonic() - killed_at
        vanished = _wait_for(lambda: not fleet.listed_engines() & set(victims), ttl + 10, 0.02)
        vanished_after = time.monotonic() - killed_at
        concurrent.futures.wait(futures)
    served = {i: b for i, (c, b, _) in results.items() if c == 200}
    by_policy = {
        i: b["error"]["type"]
        for i, (c, b, _) in results.items()
        if c != 200 and b.get("error", {}).get("type") in FAILURES_BY_POLICY
    }
    other = {i: (c, b) for i, (c, b, _) in results.items() if c != 200 and i not in by_policy}
    late_to_dead = [
        i
        for i, b in served.items()
        if results[i][2] > killed_at + dropped_after + 0.5
        and {b["engines"]["prefill"], b["engines"]["decode"]} & set(victims)
    ]
    health = fleet.router_health()
    log(
        f"  {len(served)} served, {len(by_policy)} failed by policy, {len(other)} otherwise; "
        f"the router stopped routing to the dead engines after {dropped_after:.2f} s, etcd "
        f"reported them gone after {vanished_after:.2f} s; "
        f"{health.get('retried', 0)} requests routed again"
    )
    for i, (c, b) in sorted(other.items()):
        log(f"  request {i}: {c} {b.get('error')}")
    # The survivors heard of the dead through the watch, and reclaim every block.
    p_url, d_url = fleet.engines["fleet-P1"][1], fleet.engines["fleet-D1"][1]
    bound = lease + ttl + 5
    clean = _wait_for(lambda: all(_get(f"{u}/leaks")["clean"] for u in (p_url, d_url)), bound, 0.1)
    clean_after = time.monotonic() - killed_at
    # A vanish is applied at once (the liveness action wakes the engine loop), but a
    # worker's counters reach /stats with a step's output: one more request gives both
    # survivors a step (and shows the fleet still serves).
    probe, _ = send(0)
    p_c, d_c = _counters(p_url), _counters(d_url)
    result["phase2"] = {
        "requests": load,
        "served": len(served),
        "failed_by_policy": len(by_policy),
        "failed_otherwise": len(other),
        "failure_types": sorted(set(by_policy.values())),
        # What each request that failed otherwise got back (status, error), so a failed
        # check names its cause in --json output too.
        "failed_otherwise_answers": [
            {"request": i, "status": c, "error": b.get("error", b)}
            for i, (c, b) in sorted(other.items())
        ],
        "equal_outputs": sum(
            1 for i, b in served.items() if b["choices"][0]["token_ids"] == ref[i]
        ),
        "retried": int(health.get("retried", 0)),
        "killed": victims,
        "router_dropped_after_s": dropped_after,
        "etcd_vanished_after_s": vanished_after,
        "probe_after_reclaim": probe,
        "routed_to_dead_after_drop": len(late_to_dead),
        "reclaimed_after_s": clean_after,
        "reclaim_bound_s": bound,
        "prefill_engines_gone": int(p_c.get("engines_gone", 0)),
        "prefill_leases_aborted_engine_gone": int(p_c.get("leases_aborted_engine_gone", 0)),
        "decode_engines_gone": int(d_c.get("engines_gone", 0)),
    }
    p2 = result["phase2"]
    checks["phase 2: every request served or failed by the retry policy"] = not other
    checks["phase 2: every served output equal to a single engine"] = p2["equal_outputs"] == len(
        served
    )
    checks[f"phase 2: the dead engines left the router's fleet within the TTL ({ttl} s) + 1 s"] = (
        dropped and vanished and vanished_after <= ttl + 1.0
    )
    checks["phase 2: nothing routed to a dead engine after it was dropped"] = not late_to_dead
    checks["phase 2: the survivors heard of the dead engines through the etcd watch"] = (
        p2["prefill_engines_gone"] >= 1 and p2["decode_engines_gone"] >= 1
    )
    checks["phase 2: every block reclaimed on both survivors (leak oracle)"] = clean
    checks["phase 2: the survivors serve on"] = probe == 200

    # -- phase 3: a clean shutdown withdraws ------------------------------------------------
    log("phase 3: fleet-D1 stopped cleanly (SIGTERM): its registration is withdrawn")
    d1 = fleet.engines["fleet-D1"][0]
    t0 = time.monotonic()
    d1.proc.terminate()
    gone = _wait_for(lambda: "fleet-D1" not in fleet.listed_engines(), ttl + 5, 0.02)
    result["phase3"] = {"withdrawn_after_s": time.monotonic() - t0}
    d1.stop()
    checks[
        "phase 3: a stopped engine left the router's fleet within 1 s (withdrawn, not expired)"
    ] = gone and result["phase3"]["withdrawn_after_s"] < 1.0
    code, body = send(0)
    result["phase3"]["no_decode_engine_answer"] = code
    checks["phase 3: with no decode engine left the router answers 503 no_decode_engine"] = (
        code == 503 and body.get("error", {}).get("type") == "no_decode_engine"
    )
    fleet.stop()
    result["elapsed_s"] = time.monotonic() - t_start
    result["ok"] = all(checks.values())
    return result


def _table(result: dict[str, Any]) -> str:
    p1, p2, p3 = result["phase1"], result["phase2"], result["phase3"]
    rows = [
        ("phase 1 requests (served / equal to single engine)",
         f"{p1['requests']} ({p1['served']} / {p1['equal_outputs']})"),
        ("engines that served", ", ".join(p1["engines_used"])),
        ("router picks on a cached prefix", f"{p1['prefix_hits']} of {p1['router_picks']}"),
        ("phase 2 requests", str(p2["requests"])),
        ("killed (SIGKILL) under load", ", ".join(p2["killed"])),
        ("served / failed by policy / otherwise",
         f"{p2['served']} / {p2['failed_by_policy']} / {p2['failed_otherwise']}"),
        ("routed again from a fresh prefill leg", str(p2["retried"])),
        ("router stopped routing to the dead after", f"{p2['router_dropped_after_s']:.2f} s"),
        ("etcd reported the dead gone after", f"{p2['etcd_vanished_after_s']:.2f} s "
         f"(TTL {result['registration_ttl_s']} s)"),
        ("P1: engines gone / leases aborted for them",
         f"{p2['prefill_engines_gone']} / {p2['prefill_leases_aborted_engine_gone']}"),
        ("D1: engines gone", str(p2["decode_engines_gone"])),
        ("every block reclaimed after", f"{p2['reclaimed_after_s']:.2f} s "
         f"(bound {p2['reclaim_bound_s']:.0f} s)"),
        ("a SIGTERMed engine left the fleet after", f"{p3['withdrawn_after_s']:.2f} s"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
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
    """``kvframe demo --fleet``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="kvframe demo --fleet", description=__doc__.split("\n")[0])
    ap.add_argument("--fleet", action="store_true", help="this demo (required)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    ap.add_argument("--prompts", type=int, default=8, help="phase-1 requests (8)")
    ap.add_argument("--load", type=int, default=24, help="phase-2 requests, 4..64 (24)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per request (16)")
    ap.add_argument("--lease", type=float, default=6.0, help="kv_lease_duration, seconds (6)")
    ap.add_argument("--ttl", type=int, default=2, help="registrations' etcd TTL, seconds (2)")
    ap.add_argument("--transport", default="nixl", help="a cross-process transport (nixl)")
    ap.add_argument("--auth-key-file", default=None, help="the fleet key (default: a fresh one)")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        if not args.json:
            print(msg, flush=True)

    try:
        result = run_fleet_demo(
            prompts=args.prompts,
            load=args.load,
            max_tokens=args.max_tokens,
            lease=args.lease,
            ttl=args.ttl,
            transport=args.transport,
            auth_key_file=args.auth_key_file,
            log=log,
        )
    except ConfigError as exc:
        print(f"kvframe demo --fleet: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else "\n" + _table(result))
    return 0 if result["ok"] else 1
