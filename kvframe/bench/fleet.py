"""``kvframe bench fleet``: requests through a fleet router (engines found through a real
etcd), 1 P + 1 D against 2 P + 2 D, prefix-aware against round-robin routing, on a workload
with shared prefixes: prefix hit rate, mean and p90 time to first token, in one run.

The benchmark starts reference-engine servers and etcd, so it lives with the reference engine
(:mod:`kvframe_refengine.bench_fleet`, whose docstring describes what is measured and the JSON
keys); this module only hands the command over.
"""

from __future__ import annotations

import argparse
import importlib

from kvframe.bench.push import _positive

__all__ = ["add_arguments", "run"]

_IMPL = "kvframe_refengine.bench_fleet"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``, ``--quick`` (two groups, eight requests per arm, one round: for tests of the
    output's shape) and ``--requests N`` (requests per arm and round, default 64)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a tiny workload; not for figures")
    parser.add_argument(
        "--requests", type=_positive, default=None, help="requests per arm and round (64)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (needs the reference engine, torch, the NIXL plugin, the etcd
    plugin and the ``etcd`` binary). Raises ``ModuleNotFoundError`` naming what is missing."""
    impl = importlib.import_module(_IMPL)
    return int(impl.run(args))
