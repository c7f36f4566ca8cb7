"""``kvframe bench multiturn``: turn two's time to first token in a multi-turn conversation,
its history pulled from the decode engine (bidirectional mode) or recomputed by the prefill
engine, for several history lengths.

The benchmark starts reference-engine servers (``contrib/kvframe-refengine``, its own
distribution), so it lives there (:mod:`kvframe_refengine.bench_multiturn`, whose docstring
describes what is measured and the JSON keys); this module only hands the command over.
"""

from __future__ import annotations

import argparse
import importlib

from kvframe.bench.push import _positive

__all__ = ["add_arguments", "run"]

_IMPL = "kvframe_refengine.bench_multiturn"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``, ``--quick`` (one short history, one round: for tests of the output's shape)
    and ``--repeats N`` (measured rounds per history length, default 7)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="one short history; not for figures")
    parser.add_argument(
        "--repeats", type=_positive, default=None, help="measured rounds per history length (7)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (needs the reference engine, torch and the NIXL plugin installed).

    Raises ``ModuleNotFoundError`` naming what is missing (``kvframe`` turns it into a line with
    the install command, :data:`kvframe.cli.OPTIONAL_DEPENDENCIES`).
    """
    impl = importlib.import_module(_IMPL)
    return int(impl.run(args))
