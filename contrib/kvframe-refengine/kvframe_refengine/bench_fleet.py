"""``kvframe bench fleet``: requests through a fleet router, 1 P + 1 D against 2 P + 2 D, and
prefix-aware against round-robin routing, on a workload with shared prefixes, in one run.

It starts a real etcd on loopback and two prefill and two decode engine servers registered in
it (:class:`~kvframe_refengine.fleet_procs.LocalFleet`, NIXL between them), then drives three
routers in this process, each a :class:`~kvframe_refengine.router.Router` on a
:class:`~kvframe_refengine.fleet.FleetTable` fed by the etcd watch and the engines' KV events:

- ``1P+1D``: a table that keeps only ``fleet-P0`` and ``fleet-D0`` (with one engine of each
  role both policies route the same);
- ``2P+2D round_robin`` and ``2P+2D prefix``: every engine.

The workload: ``groups`` shared prefixes of ``prefix_tokens`` tokens, each request one of them
plus ``suffix_tokens`` tokens of its own, groups interleaved at random, ``concurrency``
clients, ``max_tokens`` 2. Every arm gets prefixes of its own (fresh random tokens), so no arm
profits from the cache an earlier one left. Arms run in turn, ``rounds`` times (the order
rotates each round), all samples pooled per arm.

Per arm (JSON ``arms[name]``): ``requests``, ``hit_rate`` (the prefill engines'
``cached_tokens`` over all prompt tokens: the share of prompt tokens P did not compute),
``mean_ttft_s``, ``median_ttft_s``, ``p90_ttft_s`` (time to first token as the router saw it:
the prefill leg plus the decode engine's own time to first token), ``wall_s``. ``ratios``:
``prefix_over_round_robin_mean_ttft`` and ``..._p90_ttft``, ``2p2d_prefix_over_1p1d_mean_ttft``.
Timings on a shared machine vary: read the ratios of one run, side by side.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvframe.bench.progress import Progress
from kvframe.core.fleet import FleetEvent
from kvframe.errors import ConfigError
from kvframe.runtime.procs import ChildProcesses
from kvframe_refengine.demo import _wait_for
from kvframe_refengine.fleet import FleetTable, KVEventPoller, open_discovery
from kvframe_refengine.fleet_procs import LocalEtcd, LocalFleet, etcd_binary
from kvframe_refengine.router import Router

__all__ = ["ARMS", "measure", "run"]

ARMS = ("1P+1D", "2P+2D round_robin", "2P+2D prefix")
"""The arms, in the order of the first round."""

_FULL = {
    "groups": 8,
    "prefix_tokens": 256,
    "suffix_tokens": 16,
    "requests": 64,
    "rounds": 2,
    "concurrency": 4,
}
_QUICK = {
    "groups": 2,
    "prefix_tokens": 64,
    "suffix_tokens": 8,
    "requests": 8,
    "rounds": 1,
    "concurrency": 2,
}


class _Arm:
    """One arm's router: a table fed by the watch (``only``: the engines it keeps)."""

    def __init__(self, url: str, policy: str, only: set[str] | None) -> None:
        self.table = FleetTable(policy=policy)

        def feed(events: Sequence[FleetEvent]) -> None:
            self.table.on_events([e for e in events if only is None or e.record.engine_id in only])

        self.backend, _ttl = open_discovery(url)
        self.watch = self.backend.watch(feed)
        self.poller = KVEventPoller(self.table, interval=0.1)
        self.router = Router(fleet=self.table, retries=0)
        self.size = 2 if only is not None else 4

    def ready(self) -> bool:
        return len(self.table.members()) == self.size

    def close(self) -> None:
        self.poller.close()
        self.watch.cancel()
        self.backend.close()


def _p90(samples: Sequence[float]) -> float:
    """The 90th percentile (inclusive method, as every kvframe benchmark prints it)."""
    if len(samples) < 2:
        return samples[0]
    return statistics.quantiles(samples, n=10, method="inclusive")[8]


def _quiet(message: str) -> None:
    del message  # the engines' start-up lines: the progress lines say enough


def _workload(rng: random.Random, cfg: dict[str, int]) -> list[list[int]]:
    prefixes = [
        [rng.randrange(1, 250) for _ in range(cfg["prefix_tokens"])] for _ in range(cfg["groups"])
    ]
    out = []
    for i in range(cfg["requests"]):
        suffix = [rng.randrange(1, 250) for _ in range(cfg["suffix_tokens"])]
        out.append(prefixes[i % cfg["groups"]] + suffix)
    rng.shuffle(out)
    return out


def _drive(
    router: Router, prompts: list[list[int]], concurrency: int
) -> tuple[list[tuple[float, int, int]], float]:
    def one(prompt: list[int]) -> tuple[float, int, int]:
        code, ans = router.complete({"prompt": prompt, "max_tokens": 2, "timeout_s": 60})
        if code != 200:
            raise RuntimeError(f"a request failed: {code} {ans.get('error')}")
        ttft = ans["router_timing"]["decode_start_s"] + ans["timing"]["ttft_s"]
        usage = ans.get("prefill_usage") or {}
        return ttft, int(usage.get("cached_tokens", 0)), len(prompt)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        samples = list(pool.map(one, prompts))
    return samples, time.monotonic() - t0


def measure(
    cfg: dict[str, int], *, lease: float = 6.0, transport: str = "nixl", seed: int = 0
) -> dict[str, Any]:
    """Run every arm (see the module); returns the report."""
    etcd_binary()
    progress = Progress("fleet", total=2 + cfg["rounds"] * len(ARMS))
    children = ChildProcesses(grace=10.0)
    arms: dict[str, _Arm] = {}
    try:
        tmp = children.mkdtemp("kvframe-bench-fleet-")
        etcd = LocalEtcd(tmp / "etcd", children)
        progress("starting etcd")
        etcd.start()
        fleet = LocalFleet(
            children, etcd, _quiet, num_prefill=2, num_decode=2,
            server_args=["--transport", transport, "--lease", str(lease)],
        )  # fmt: skip
        progress(f"starting 2 prefill and 2 decode engines ({fleet.pids()})")
        fleet.wait_ready()
        arms = {
            "1P+1D": _Arm(fleet.discovery, "prefix", {"fleet-P0", "fleet-D0"}),
            "2P+2D round_robin": _Arm(fleet.discovery, "round_robin", None),
            "2P+2D prefix": _Arm(fleet.discovery, "prefix", None),
        }
        if not _wait_for(lambda: all(a.ready() for a in arms.values()), 20):
            raise RuntimeError("the routers did not see every engine through etcd in 20 s")
        rng = random.Random(seed)
        # Warm-up: every engine runs once (first-call costs), on prefixes no arm uses.
        _drive(arms["2P+2D round_robin"].router, _workload(rng, {**cfg, "requests": 8}), 4)
        samples: dict[str, list[tuple[float, int, int]]] = {name: [] for name in ARMS}
        walls: dict[str, float] = dict.fromkeys(ARMS, 0.0)
        for r in range(cfg["rounds"]):
            order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
            for name in order:
                progress(f"round {r + 1}: {name}, {cfg['requests']} requests")
                got, wall = _drive(arms[name].router, _workload(rng, cfg), cfg["concurrency"])
                samples[name] += got
                walls[name] += wall
    finally:
        for arm in arms.values():
            arm.close()
        children.close()
    report: dict[str, Any] = {"benchmark": "fleet", "config": cfg, "transport": transport}
    out: dict[str, dict[str, float]] = {}
    for name in ARMS:
        ttfts = [t for t, _, _ in samples[name]]
        out[name] = {
            "requests": len(ttfts),
            "hit_rate": sum(c for _, c, _ in samples[name]) / sum(n for _, _, n in samples[name]),
            "mean_ttft_s": statistics.fmean(ttfts),
            "median_ttft_s": statistics.median(ttfts),
            "p90_ttft_s": _p90(ttfts),
            "wall_s": walls[name],
        }
    report["arms"] = out
    pre, rr, one = out["2P+2D prefix"], out["2P+2D round_robin"], out["1P+1D"]
    report["ratios"] = {
        "prefix_over_round_robin_mean_ttft": pre["mean_ttft_s"] / rr["mean_ttft_s"],
        "prefix_over_round_robin_p90_ttft": pre["p90_ttft_s"] / rr["p90_ttft_s"],
        "2p2d_prefix_over_1p1d_mean_ttft": pre["mean_ttft_s"] / one["mean_ttft_s"],
    }
    return report


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"{'arm':<20} {'requests':>8} {'hit rate':>9} {'mean TTFT':>10} {'median':>9} "
        f"{'p90 TTFT':>9} {'wall':>7}"
    ]
    for name, a in report["arms"].items():
        lines.append(
            f"{name:<20} {a['requests']:>8} {100 * a['hit_rate']:>8.1f}% "
            f"{a['mean_ttft_s'] * 1e3:>8.1f}ms {a['median_ttft_s'] * 1e3:>7.1f}ms "
            f"{a['p90_ttft_s'] * 1e3:>7.1f}ms {a['wall_s']:>6.1f}s"
        )
    r = report["ratios"]
    lines.append("")
    lines.append(
        f"prefix / round-robin (2P+2D): mean TTFT {r['prefix_over_round_robin_mean_ttft']:.2f}, "
        f"p90 TTFT {r['prefix_over_round_robin_p90_ttft']:.2f}"
    )
    lines.append(f"2P+2D prefix / 1P+1D: mean TTFT {r['2p2d_prefix_over_1p1d_mean_ttft']:.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table, or JSON with ``--json``."""
    cfg = dict(_QUICK if args.quick else _FULL)
    if args.requests is not None:
        cfg["requests"] = args.requests
    try:
        report = {**measure(cfg), "quick": bool(args.quick)}
    except (ConfigError, RuntimeError) as exc:
        print(f"kvframe bench fleet: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0
