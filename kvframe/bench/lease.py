"""``kvframe bench lease``: the lease table against a naive dict scan, and heartbeat size.

With ``--leases`` live leases (default 100,000) it measures, in one run and side by side:

- **renew**: renewing ``--renew`` ids (default 10,000) picked at random among the live ones;
- **expire_none_due**: one ``expire(now)`` call when no lease is due;
- **expire_due**: one ``expire(now)`` call that reclaims ``--expire`` leases (default 1,000);

each for :class:`kvframe.core.lease.LeaseTable` and for a naive implementation (a dict of
expiries; renew updates it; expire scans every entry), which is what a reaper without an index
costs. It also encodes one heartbeat of ``--heartbeat-ids`` request ids of ``--id-length``
bytes (vLLM's ids, ``cmpl-`` + 32 hex digits + ``-0``, are 39) and reports the bytes per id,
beside msgpack's encoding of the same id list.

Human-readable table by default; ``--json`` prints one JSON object::

    {
      "benchmark": "lease",
      "params": {"leases": int, "renew": int, "expire": int, "repeat": int,
                 "heartbeat_ids": int, "id_length": int},
      "results": {
        "renew":           {"kvframe_s": float, "naive_s": float, "ratio": float},
        "expire_none_due": {"kvframe_s": float, "naive_s": float, "ratio": float},
        "expire_due":      {"kvframe_s": float, "naive_s": float, "ratio": float}
      },
      "heartbeat": {"ids": int, "id_length": int, "message_bytes": int, "header_bytes": int,
                    "bytes_per_id": float, "msgpack_bytes_per_id": float}
    }

``*_s`` are the median seconds of one operation over ``--repeat`` runs (``expire_none_due``:
the median of many calls); ``ratio`` is ``naive_s / kvframe_s`` (above 1: kvframe is
faster). ``bytes_per_id`` is ``(message_bytes - header_bytes) / ids``. ``--scale`` multiplies
the three table sizes (``--scale 0.01`` for a quick run).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable

import msgpack

from kvframe.core import wire
from kvframe.core.lease import LeasePolicy, LeaseTable

__all__ = ["NaiveLeases", "add_arguments", "measure", "run"]

_POLICY = LeasePolicy.from_duration(30.0)  # interval 5, extension 20
# Timeline (seconds): the leases to reclaim are granted at 0 (expiry 30), the rest at 10
# (expiry 40); renewals happen at 25 and later (new expiry 45+); nothing is due at 20; the
# `expire` leases and only those are due at 35.
_T_DUE, _T_REST, _T_QUIET, _T_RENEW, _T_REAP = 0.0, 10.0, 20.0, 25.0, 35.0


class NaiveLeases:
    """The baseline: expiries in a dict, reaped by scanning every entry.

    Same semantics as :class:`~kvframe.core.lease.LeaseTable` for what is measured (renew
    returns the new expiry per live id; expire returns the due ids with their payloads),
    without an index, counters or snapshots.
    """

    def __init__(self, extension: float, duration: float) -> None:
        self.extension = extension
        self.duration = duration
        self.expiry: dict[str, float] = {}
        self.payload: dict[str, object] = {}

    def grant(self, request_id: str, now: float, payload: object = None) -> None:
        """Add a lease expiring at ``now + duration``."""
        self.expiry[request_id] = now + self.duration
        self.payload[request_id] = payload

    def renew(self, request_ids: list[str], now: float) -> dict[str, float]:
        """``max(expiry, now + extension)`` for each live id; returns the new expiries."""
        out: dict[str, float] = {}
        exp = self.expiry
        candidate = now + self.extension
        for rid in request_ids:
            e = exp.get(rid)
            if e is not None and e > now:
                e = exp[rid] = max(e, candidate)
                out[rid] = e
        return out

    def expire(self, now: float) -> list[tuple[str, object]]:
        """Remove and return every ``(id, payload)`` whose expiry is ``<= now`` (a full
        scan)."""
        due = [rid for rid, e in self.expiry.items() if e <= now]
        for rid in due:
            del self.expiry[rid]
        return [(rid, self.payload.pop(rid)) for rid in due]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (see the module docstring)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--leases", type=int, default=100_000, help="live leases (100000)")
    parser.add_argument("--renew", type=int, default=10_000, help="ids per renewal (10000)")
    parser.add_argument("--expire", type=int, default=1_000, help="leases to reclaim (1000)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the three sizes")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (5)")
    parser.add_argument("--heartbeat-ids", type=int, default=100, help="ids in one heartbeat")
    parser.add_argument("--id-length", type=int, default=39, help="request id length in bytes")
    parser.add_argument("--seed", type=int, default=0, help="random seed for picking ids")


def _sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    leases = max(2, round(args.leases * args.scale))
    renew = max(1, min(round(args.renew * args.scale), leases - 1))
    expire = max(1, min(round(args.expire * args.scale), leases - 1))
    return leases, renew, expire


def _ids(n: int, length: int, prefix: str) -> list[str]:
    return [(prefix + format(i, "x")).rjust(length, "0")[-length:] for i in range(n)]


def _build(leases: int, expire: int, length: int) -> tuple[LeaseTable[None], NaiveLeases]:
    table: LeaseTable[None] = LeaseTable(_POLICY)
    naive = NaiveLeases(_POLICY.extension, _POLICY.duration)
    ids = _ids(leases, length, "r")
    for i, rid in enumerate(ids):
        t = _T_DUE if i < expire else _T_REST
        table.grant(rid, t, None)
        naive.grant(rid, t)
    return table, naive


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _pair(kvframe_s: float, naive_s: float) -> dict[str, float]:
    return {
        "kvframe_s": kvframe_s,
        "naive_s": naive_s,
        "ratio": naive_s / kvframe_s if kvframe_s > 0 else float("inf"),
    }


def _check_args(args: argparse.Namespace) -> str | None:
    for name in ("leases", "renew", "expire", "repeat", "heartbeat_ids", "id_length"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if not args.scale > 0:
        return f"--scale must be > 0, got {args.scale}"
    if args.id_length > wire.MAX_ID_BYTES:
        return f"--id-length must be <= {wire.MAX_ID_BYTES} (the wire limit), got {args.id_length}"
    return None


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Run the measurements; returns the JSON object described in the module docstring."""
    leases, renew, expire = _sizes(args)
    repeat = args.repeat
    rng = random.Random(args.seed)
    length = args.id_length
    results: dict[str, dict[str, float]] = {}

    # Renew: one table, renewed `repeat` times at slightly later times (each call extends).
    table, naive = _build(leases, expire, length)
    live_ids = _ids(leases, length, "r")[expire:]
    picks = [rng.sample(live_ids, renew) for _ in range(repeat)]
    clock = iter([_T_RENEW + i * 1e-3 for i in range(repeat)])
    k_renew = _median_time(lambda: table.renew(picks.pop(), next(clock)), repeat)
    picks = [rng.sample(live_ids, renew) for _ in range(repeat)]
    clock = iter([_T_RENEW + i * 1e-3 for i in range(repeat)])
    n_renew = _median_time(lambda: naive.renew(picks.pop(), next(clock)), repeat)
    results["renew"] = _pair(k_renew, n_renew)

    # Expire with nothing due: cheap for the table, so time many calls and divide.
    calls = 1000
    k_quiet = _median_time(lambda: [table.expire(_T_QUIET) for _ in range(calls)], repeat) / calls
    n_calls = max(1, min(calls, 2_000_000 // leases))
    n_quiet = _median_time(lambda: [naive.expire(_T_QUIET) for _ in range(n_calls)], repeat)
    results["expire_none_due"] = _pair(k_quiet, n_quiet / n_calls)

    # Expire `expire` due leases: each run needs a fresh table (setup not timed).
    k_due: list[float] = []
    n_due: list[float] = []
    for _ in range(repeat):
        table, naive = _build(leases, expire, length)
        t0 = time.perf_counter()
        got = table.expire(_T_REAP)
        k_due.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got_naive = naive.expire(_T_REAP)
        n_due.append(time.perf_counter() - t0)
        if len(got) != expire or len(got_naive) != expire:
            raise AssertionError(f"expected {expire} due, got {len(got)} and {len(got_naive)}")
    results["expire_due"] = _pair(statistics.median(k_due), statistics.median(n_due))

    # One message's worth: more ids than fit are cut off by split() (the first part is kept).
    first = wire.split(
        wire.Heartbeat(seq=0, sent_at=0.0, request_ids=_ids(args.heartbeat_ids, length, "cmpl-"))
    )[0]
    assert isinstance(first, wire.Heartbeat)
    hb_ids = first.request_ids
    message = wire.encode(first)
    packed = msgpack.packb(list(hb_ids))
    heartbeat = {
        "ids": len(hb_ids),
        "id_length": length,
        "message_bytes": len(message),
        "header_bytes": wire.HEADER_BYTES,
        "bytes_per_id": (len(message) - wire.HEADER_BYTES) / len(hb_ids),
        "msgpack_bytes_per_id": len(packed) / len(hb_ids),
    }
    return {
        "benchmark": "lease",
        "params": {
            "leases": leases,
            "renew": renew,
            "expire": expire,
            "repeat": repeat,
            "heartbeat_ids": len(hb_ids),
            "id_length": length,
        },
        "results": results,
        "heartbeat": heartbeat,
    }


def _human(report: dict[str, object]) -> str:
    params: dict[str, int] = report["params"]  # type: ignore[assignment]
    results: dict[str, dict[str, float]] = report["results"]  # type: ignore[assignment]
    hb: dict[str, float] = report["heartbeat"]  # type: ignore[assignment]
    lines = [
        f"lease table vs naive dict scan, {params['leases']:,} live leases "
        f"(median of {params['repeat']})",
        f"{'operation':<34}{'kvframe':>12}{'naive':>12}{'naive/kvframe':>15}",
    ]
    labels = {
        "renew": f"renew {params['renew']:,} ids",
        "expire_none_due": "expire, nothing due",
        "expire_due": f"expire {params['expire']:,} due",
    }
    for key, label in labels.items():
        r = results[key]
        lines.append(
            f"{label:<34}{_fmt(r['kvframe_s']):>12}{_fmt(r['naive_s']):>12}{r['ratio']:>14.1f}x"
        )
    lines.append(
        f"heartbeat: {hb['ids']} ids of {hb['id_length']} bytes = {hb['message_bytes']} bytes "
        f"({hb['bytes_per_id']:.2f} bytes/id + {hb['header_bytes']} header; "
        f"msgpack list {hb['msgpack_bytes_per_id']:.2f} bytes/id)"
    )
    return "\n".join(lines)


def _fmt(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.2f} us"
    return f"{seconds * 1e9:.0f} ns"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the report; returns the exit status (2 for bad options)."""
    problem = _check_args(args)
    if problem is not None:
        print(f"kvframe bench lease: {problem}", file=sys.stderr)
        return 2
    report = measure(args)
    print(json.dumps(report, indent=2) if args.json else _human(report))
    return 0
