"""``kvframe bench handshake``: what authentication costs on the side channel, and a flood.

Two measurements in one run, both on loopback in this process (P's handshake server on its
background thread, as in an engine; the clients on others):

- **cost**: one complete D handshake (:func:`~kvframe.connectors.pd.handshake.handshake` with
  its default three exchanges, connect to close) against a P server **with** a fleet key
  (challenge, request, clock ping: two HMAC proofs per side) and **without** (request, two
  clock pings). Same number of round trips, same responder, samples alternating between the
  two so load on the machine hits both alike (these two servers have no rate limit: the
  benchmark's client makes hundreds of handshakes a second). Reported: median and p90 of
  each, and the ratio ``authenticated / unauthenticated``.
- **flood**: while ``--attackers`` threads make ``--flood`` attempts at ``--rate`` per second
  in all (default 10,000 in 10 s), each a hello and a forged request on the thread's
  connection from source address 127.0.0.2, the legitimate D handshakes with the keyed P from
  127.0.0.1 once every ``--interval`` seconds. Reported: the attack's duration and attempts
  per second, how many messages P answered (a challenge, a refusal or an accept, the
  legitimate handshakes' included) and how many it dropped over the per-address rate, the
  legitimate handshakes that succeeded out of those tried, and their median and p90 during the flood
  against the cost measurement's (quiet) median.

Both sides of each comparison run in this one process, on the same threads, under the same
CPU affinity (whatever the process was started with; no engine runs here to re-pin anything),
against servers built the same way: the only difference is the key. Every figure is a median
or a 90th percentile of wall-clock seconds per handshake (``time.perf_counter``), never a mean.

Human-readable table by default; ``--json`` prints one JSON object::

    {
      "benchmark": "handshake",
      "params": {"samples": int, "flood": int, "rate": float, "attackers": int,
                 "interval_s": float},
      "cost": {"auth_median_s": float, "auth_p90_s": float, "plain_median_s": float,
               "plain_p90_s": float, "ratio_median": float, "ratio_p90": float},
      "flood": {"seconds": float, "sent": int, "sent_per_s": float, "answered": int,
                "rate_limited": int, "legit_tried": int, "legit_ok": int,
                "legit_median_s": float | null, "legit_p90_s": float | null}
    }

``legit_*_s`` are ``null`` when no legitimate handshake succeeded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvframe.bench._stats import p90
from kvframe.bench.progress import Progress
from kvframe.connectors.pd.auth import KeyRing
from kvframe.connectors.pd.handshake import (
    AuthHello,
    HandshakeRequest,
    HandshakeResponse,
    HandshakeServer,
    encode_frame,
    handshake,
)
from kvframe.errors import HandshakeError
from kvframe.spi.transport import BlockLayout, MemoryRegion

__all__ = ["add_arguments", "measure", "run"]

_CHASH = bytes(16)
_LAYOUT = BlockLayout(
    regions=tuple(MemoryRegion(addr=(i + 1) << 30, length=1 << 28) for i in range(64)),
    block_lens=(1 << 16,) * 64,
    num_blocks=4096,
)
_RESPONSE = HandshakeResponse(
    engine_id="P",
    rank=0,
    tp_size=1,
    transport="nixl",
    transport_metadata=b"m" * 4096,
    layout=_LAYOUT,
    kv_lease_duration=30.0,
)
_REQUEST = HandshakeRequest(engine_id="D", rank=0, transport="nixl", transport_metadata=b"d" * 4096)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (see the module docstring)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--samples", type=int, default=400, help="handshakes per side (400)")
    parser.add_argument(
        "--flood", type=int, default=10_000, help="attack attempts, two messages each (10000)"
    )
    parser.add_argument(
        "--rate", type=float, default=1000.0, help="attempts per second, all threads (1000)"
    )
    parser.add_argument("--attackers", type=int, default=4, help="attacker threads (4)")
    parser.add_argument(
        "--interval", type=float, default=0.05, help="seconds between legitimate handshakes"
    )


def _respond(request: HandshakeRequest, session: bytes | None) -> HandshakeResponse:
    return _RESPONSE


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cost(samples: int, ring: KeyRing, progress: Progress) -> dict[str, float]:
    # The cost alone: no per-address rate limit (this client makes hundreds per second).
    unlimited: dict[str, Any] = {"rate": 1e9, "burst": 1e9}
    keyed = HandshakeServer(
        "127.0.0.1", 0, chash=_CHASH, respond=_respond, engine_id="P", keys=ring, **unlimited
    )
    plain = HandshakeServer("127.0.0.1", 0, chash=_CHASH, respond=_respond, **unlimited)
    try:
        progress(f"cost: {samples} handshakes with a key and {samples} without, alternating")
        auth: list[float] = []
        bare: list[float] = []
        for i in range(samples):
            pair = [
                (
                    auth,
                    lambda: handshake("127.0.0.1", keyed.port, _REQUEST, chash=_CHASH, keys=ring),
                ),
                (bare, lambda: handshake("127.0.0.1", plain.port, _REQUEST, chash=_CHASH)),
            ]
            for out, fn in pair if i % 2 == 0 else reversed(pair):
                out.append(_timed(fn))
    finally:
        keyed.close()
        plain.close()
    a, b = statistics.median(auth), statistics.median(bare)
    return {
        "auth_median_s": a,
        "auth_p90_s": p90(auth),
        "plain_median_s": b,
        "plain_p90_s": p90(bare),
        "ratio_median": a / b,
        "ratio_p90": p90(auth) / p90(bare),
    }


def _attack(port: int, count: int, rate: float, sent: list[int], stop: threading.Event) -> None:
    # Each attempt: a hello and a forged request on the thread's connection, paced at ``rate``;
    # answers are read and thrown away.
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")
    hello = encode_frame(AuthHello(engine_id="D", rank=0, nonce=b"n" * 16), _CHASH)
    forged = encode_frame(
        HandshakeRequest(
            engine_id="D", rank=0, transport="nixl", transport_metadata=b"x", proof=b"p" * 32
        ),
        _CHASH,
    )
    t0 = time.perf_counter()
    n = 0
    try:
        while n < count and not stop.is_set():
            sock.send(hello)
            sock.send(forged)
            n += 1
            while sock.poll(0, zmq.POLLIN):
                sock.recv()
            ahead = t0 + n / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
        time.sleep(0.2)  # let the last messages go out
    finally:
        sent.append(n)
        sock.close(linger=0)


def _attack_process(port: int, count: int, rate: float, threads: int, out: Any) -> None:
    # The attacker runs in its own process, so its CPU is not P's GIL.
    stop = threading.Event()
    sent: list[int] = []
    per = max(1, count // threads)
    workers = [
        threading.Thread(target=_attack, args=(port, per, rate / threads, sent, stop))
        for _ in range(threads)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    out.put(sum(sent))


def _flood(args: argparse.Namespace, ring: KeyRing, progress: Progress) -> dict[str, Any]:
    import multiprocessing

    srv = HandshakeServer("127.0.0.1", 0, chash=_CHASH, respond=_respond, engine_id="P", keys=ring)
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    attacker = mp.Process(
        target=_attack_process,
        args=(srv.port, args.flood, args.rate, args.attackers, out),
        daemon=True,
    )
    progress(f"flood: {args.flood} attempts at {args.rate:g}/s from another process")
    legit: list[float] = []
    tried = 0
    try:
        attacker.start()
        while srv.rejected + srv.rate_limited + srv.challenged == 0 and attacker.is_alive():
            time.sleep(0.001)  # the attack has begun (the process took a while to start)
        t0 = time.perf_counter()
        while attacker.is_alive():
            tried += 1
            with contextlib.suppress(HandshakeError):
                legit.append(
                    _timed(
                        lambda: handshake(
                            "127.0.0.1", srv.port, _REQUEST, chash=_CHASH, keys=ring, timeout=2.0
                        )
                    )
                )
            time.sleep(args.interval)
        seconds = time.perf_counter() - t0
        sent = int(out.get(timeout=10))
        attacker.join(timeout=10)
        time.sleep(0.2)
    finally:
        if attacker.is_alive():
            attacker.kill()
        answered = srv.rejected + srv.served + srv.challenged
        limited = srv.rate_limited
        srv.close()
    return {
        "seconds": seconds,
        "sent": sent,
        "sent_per_s": sent / seconds,
        "answered": answered,
        "rate_limited": limited,
        "legit_tried": tried,
        "legit_ok": len(legit),
        "legit_median_s": statistics.median(legit) if legit else None,
        "legit_p90_s": p90(legit) if legit else None,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run both measurements; the JSON object of the module docstring."""
    ring = KeyRing.parse("bench " + "ab" * 32)
    progress = Progress("handshake", total=2)
    cost = _cost(args.samples, ring, progress)
    flood = _flood(args, ring, progress)
    return {
        "benchmark": "handshake",
        "params": {
            "samples": args.samples,
            "flood": args.flood,
            "rate": args.rate,
            "attackers": args.attackers,
            "interval_s": args.interval,
        },
        "cost": cost,
        "flood": flood,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def run(args: argparse.Namespace) -> int:
    """Print the report (``--json``: the JSON object); returns the exit status."""
    for name in ("samples", "flood", "attackers"):
        if getattr(args, name) < 1:
            print(f"kvframe bench handshake: --{name} must be at least 1", file=sys.stderr)
            return 2
    for name in ("interval", "rate"):
        if not getattr(args, name) > 0:
            print(f"kvframe bench handshake: --{name} must be > 0", file=sys.stderr)
            return 2
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    c, f = report["cost"], report["flood"]
    print(f"one D handshake, connect to close, 3 exchanges ({args.samples} samples each)")
    print(
        f"  with a fleet key    median {_ms(c['auth_median_s'])}  p90 {_ms(c['auth_p90_s'])}\n"
        f"  without             median {_ms(c['plain_median_s'])}  p90 {_ms(c['plain_p90_s'])}\n"
        f"  ratio               median {c['ratio_median']:.2f}  p90 {c['ratio_p90']:.2f}"
    )
    print(
        f"flood of the keyed P: {f['sent']} attempts in {f['seconds']:.1f} s "
        f"({f['sent_per_s']:.0f}/s) from 127.0.0.2; P answered {f['answered']} messages, dropped "
        f"{f['rate_limited']} over the per-address rate\n"
        f"  legitimate handshakes from 127.0.0.1 meanwhile: {f['legit_ok']}/{f['legit_tried']} "
        f"ok, median {_ms(f['legit_median_s'])}, p90 {_ms(f['legit_p90_s'])} "
        f"(quiet median {_ms(c['auth_median_s'])})"
    )
    return 0
