"""``kvframe bench pipeline``: layer-by-layer KV loading overlapped with compute.

The benchmark runs the reference engine (``contrib/kvframe-refengine``, its own distribution),
so it lives there (:mod:`kvframe_refengine.bench_pipeline`, whose docstring describes what is
measured and the JSON keys); this module only hands the command over.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_arguments", "run"]

_IMPL = "kvframe_refengine.bench_pipeline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--quick``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="one small case; not for figures")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (needs the reference engine, torch and the NIXL plugin installed).

    Raises ``ModuleNotFoundError`` naming what is missing (``kvframe`` turns it into a line with
    the install command, :data:`kvframe.cli.OPTIONAL_DEPENDENCIES`).
    """
    impl = importlib.import_module(_IMPL)
    return int(impl.run(args))
