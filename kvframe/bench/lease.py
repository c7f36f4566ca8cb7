"""``kvframe bench lease``: the lease table against a naive dict scan, and heartbeat size.

With ``--leases`` live leases (default 100,000) it measures, in one run and side by side:

- **renew**: renewing ``--renew`` leases (default 10,000) picked at random among the live
  ones, as one heartbeat batch: kvframe by handle, in bulk
  (:meth:`~kvframe.core.lease.LeaseTable.renew_handles` on the batch's ``uint64`` array);
- **renew_by_id**: the same batch through the id API (:meth:`~kvframe.core.lease.LeaseTable.renew`);
- **expire_none_due**: one ``expire(now)`` call when no lease is due;
- **expire_due**: one ``expire(now)`` call that reclaims ``--expire`` leases (default 1,000).
  The table returns them as an :class:`~kvframe.core.lease.EndedLeases` (columns of ids,
  handles, payloads; a :class:`~kvframe.core.lease.Lease` row is made only when read), the
  naive side a list of ``(id, payload)`` pairs;
- **expire_due_rows**: the same call plus reading every ended lease as a ``Lease`` row
  (``EndedLeases.rows()``, timed right after the call), what a caller that wants the rows
  pays (the P/D holder does, for its output); the naive side as in ``expire_due``;

each for :class:`kvframe.core.lease.LeaseTable` and for a naive implementation (a dict of
expiries keyed by request id; renew updates it; expire scans every entry), which is what a
reaper without an index costs. ``renew`` also runs the naive dict keyed by the 64-bit handles
(``naive_handle_s``: the same plain dict with int keys), so that the handle's own gain is
visible apart from the bulk path's. Tables are built and the garbage collector run before
each timed call (setup, not timed). Every renewal batch is fresh (new objects, as decoded
from a message), so no side profits from cached hashes. It also encodes one heartbeat of
``--heartbeat-ids`` leases (handles on the wire, 8 bytes each) and reports the bytes per
lease, beside msgpack's encoding of the ids themselves (``--id-length`` bytes; vLLM's ids,
``cmpl-`` + 32 hex digits + ``-0``, are 39).

Human-readable table by default; ``--json`` prints one JSON object::

    {
      "benchmark": "lease",
      "params": {"leases": int, "renew": int, "expire": int, "repeat": int,
                 "heartbeat_ids": int, "id_length": int},
      "results": {
        "renew":           {"kvframe_s": float, "kvframe_p90_s": float, "naive_s": float,
                            "naive_p90_s": float, "ratio": float, "naive_handle_s": float,
                            "ratio_handle": float},
        "renew_by_id":     {...same keys as expire_due...},
        "expire_none_due": {...},
        "expire_due":      {"kvframe_s": float, "kvframe_p90_s": float, "naive_s": float,
                            "naive_p90_s": float, "ratio": float},
        "expire_due_rows": {...same keys as expire_due...}
      },
      "heartbeat": {"ids": int, "id_length": int, "message_bytes": int, "header_bytes": int,
                    "bytes_per_id": float, "msgpack_bytes_per_id": float}
    }

``*_s`` are the median seconds of one operation over ``--repeat`` runs (``*_p90_s`` the 90th
percentile; ``expire_none_due``: per call, of runs of many calls); ``ratio`` is
``naive_s / kvframe_s`` (above 1: kvframe is faster; ``ratio_handle`` against
``naive_handle_s``). The two sides' runs alternate, so drift on a shared machine hits both.
``bytes_per_id`` is ``(message_bytes - header_bytes) / ids``. ``--scale`` multiplies
the three table sizes (``--scale 0.01`` for a quick run).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sized

import msgpack
import numpy as np

from kvframe.bench._stats import p90
from kvframe.bench.progress import Progress
from kvframe.core import wire
from kvframe.core.lease import EndedLeases, LeasePolicy, LeaseTable, lease_handle

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
    parser.add_argument("--repeat", type=int, default=11, help="runs per measurement (11)")
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
    # Both start from the same collector state: a table just built sits in the youngest
    # generation, and the first collection would traverse it inside the timed call.
    gc.collect()
    return table, naive


def _times(fn: Callable[[], object], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def _pair(kvframe: list[float], naive: list[float]) -> dict[str, float]:
    k, n = statistics.median(kvframe), statistics.median(naive)
    return {
        "kvframe_s": k,
        "kvframe_p90_s": p90(kvframe),
        "naive_s": n,
        "naive_p90_s": p90(naive),
        "ratio": n / k if k > 0 else float("inf"),
    }


def _fresh(ids: list[str]) -> list[str]:
    # New str objects (no cached hash), as a decoded message would hold.
    return [x.encode().decode() for x in ids]


def _check_args(args: argparse.Namespace) -> str | None:
    for name in ("leases", "renew", "expire", "repeat", "heartbeat_ids", "id_length"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if not args.scale > 0:
        return f"--scale must be > 0, got {args.scale}"
    if args.id_length > 255:
        return f"--id-length must be <= 255 (the lease id limit), got {args.id_length}"
    return None


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Run the measurements; returns the JSON object described in the module docstring."""
    leases, renew, expire = _sizes(args)
    repeat = args.repeat
    rng = random.Random(args.seed)
    length = args.id_length
    results: dict[str, dict[str, float]] = {}

    progress = Progress("lease", total=4)
    progress(f"renew {renew} among {leases} live leases, {repeat} runs")
    # Renew: one table, renewed `repeat` times at slightly later times (each call extends);
    # the sides alternate run by run. Each run gets a fresh batch of the same size.
    table, naive = _build(leases, expire, length)
    by_handle = NaiveLeases(_POLICY.extension, _POLICY.duration)
    live_ids = _ids(leases, length, "r")[expire:]
    for rid in _ids(leases, length, "r"):
        by_handle.grant(lease_handle(rid), _T_REST)  # type: ignore[arg-type]
    gc.collect()
    handle_of = {rid: lease_handle(rid) for rid in live_ids}
    k_renew: list[float] = []
    k_by_id: list[float] = []
    n_renew: list[float] = []
    n_handle: list[float] = []
    for i in range(repeat):
        now = _T_RENEW + i * 1e-3
        pick = rng.sample(live_ids, renew)
        handles = np.array([handle_of[r] for r in pick], dtype=np.uint64)
        k_renew += _times(lambda: table.renew_handles(handles, now), 1)  # noqa: B023
        batch = _fresh(pick)
        n_renew += _times(lambda: naive.renew(batch, now), 1)  # noqa: B023
        ints = [int(h) for h in handles.tolist()]
        n_handle += _times(lambda: by_handle.renew(ints, now), 1)  # type: ignore[arg-type]  # noqa: B023
        batch = _fresh(pick)
        k_by_id += _times(lambda: table.renew(batch, now + 5e-4), 1)  # noqa: B023
    results["renew"] = _pair(k_renew, n_renew)
    results["renew"]["naive_handle_s"] = statistics.median(n_handle)
    results["renew"]["ratio_handle"] = statistics.median(n_handle) / results["renew"]["kvframe_s"]
    results["renew_by_id"] = _pair(k_by_id, n_renew)

    progress(f"expire with nothing due among {leases}")
    # Expire with nothing due: cheap for the table, so time many calls and divide.
    calls = 1000
    n_calls = max(1, min(calls, 2_000_000 // leases))
    k_quiet: list[float] = []
    n_quiet: list[float] = []
    for _ in range(repeat):
        k_quiet += [
            x / calls for x in _times(lambda: [table.expire(_T_QUIET) for _ in range(calls)], 1)
        ]
        n_quiet += [
            x / n_calls for x in _times(lambda: [naive.expire(_T_QUIET) for _ in range(n_calls)], 1)
        ]
    results["expire_none_due"] = _pair(k_quiet, n_quiet)

    progress(f"expire {expire} due among {leases}, {repeat} runs")
    # Expire `expire` due leases: each run needs a fresh table (setup not timed). Each side
    # starts from a collected heap (the build's garbage would otherwise fall to whichever
    # side runs first), and the order alternates.
    k_due: list[float] = []
    k_rows: list[float] = []
    n_due: list[float] = []
    for i in range(repeat):
        table, naive = _build(leases, expire, length)
        reaps: dict[str, Callable[[], Sized]] = {
            "kvframe": lambda: table.expire(_T_REAP),  # noqa: B023
            "naive": lambda: naive.expire(_T_REAP),  # noqa: B023
        }
        got: dict[str, int] = {}
        for name in list(reaps) if i % 2 == 0 else list(reaps)[::-1]:
            gc.collect()
            t0 = time.perf_counter()
            reaped = reaps[name]()
            t1 = time.perf_counter()
            (k_due if name == "kvframe" else n_due).append(t1 - t0)
            if isinstance(reaped, EndedLeases):
                reaped.rows()
                k_rows.append(time.perf_counter() - t0)
            got[name] = len(reaped)
        if got["kvframe"] != expire or got["naive"] != expire:
            raise AssertionError(f"expected {expire} due, got {got}")
    results["expire_due"] = _pair(k_due, n_due)
    results["expire_due_rows"] = _pair(k_rows, n_due)

    progress("heartbeat bytes per lease")
    # One message's worth: more leases than fit are cut off by split() (the first part kept).
    ids = _ids(args.heartbeat_ids, length, "cmpl-")
    first = wire.split(wire.Heartbeat(seq=0, sent_at=0.0, handles=[lease_handle(r) for r in ids]))[
        0
    ]
    assert isinstance(first, wire.Heartbeat)
    n = len(first.handles)
    message = wire.encode(first)
    packed = msgpack.packb(ids[:n])
    heartbeat = {
        "ids": n,
        "id_length": length,
        "message_bytes": len(message),
        "header_bytes": wire.HEADER_BYTES,
        "bytes_per_id": (len(message) - wire.HEADER_BYTES) / n,
        "msgpack_bytes_per_id": len(packed) / n,
    }
    return {
        "benchmark": "lease",
        "params": {
            "leases": leases,
            "renew": renew,
            "expire": expire,
            "repeat": repeat,
            "heartbeat_ids": n,
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
        f"{'operation':<30}{'kvframe':>11}{'p90':>11}{'naive':>11}{'p90':>11}{'naive/kvframe':>15}",
    ]
    labels = {
        "renew": f"renew {params['renew']:,} (by handle)",
        "renew_by_id": f"renew {params['renew']:,} (by id)",
        "expire_none_due": "expire, nothing due",
        "expire_due": f"expire {params['expire']:,} due",
        "expire_due_rows": "  + reading the Lease rows",
    }
    for key, label in labels.items():
        r = results[key]
        lines.append(
            f"{label:<30}{_fmt(r['kvframe_s']):>11}{_fmt(r['kvframe_p90_s']):>11}"
            f"{_fmt(r['naive_s']):>11}{_fmt(r['naive_p90_s']):>11}{r['ratio']:>14.1f}x"
        )
    r = results["renew"]
    lines.append(
        f"{'  naive dict keyed by handle':<30}{'':>11}{'':>11}{_fmt(r['naive_handle_s']):>11}"
        f"{'':>11}{r['ratio_handle']:>14.1f}x"
    )
    lines.append(
        f"heartbeat: {hb['ids']} leases = {hb['message_bytes']} bytes "
        f"({hb['bytes_per_id']:.2f} bytes/lease + {hb['header_bytes']} header; the ids of "
        f"{hb['id_length']} bytes as a msgpack list: {hb['msgpack_bytes_per_id']:.2f} bytes/id)"
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
