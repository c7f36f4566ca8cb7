"""``kvframe bench pipeline``: layer-by-layer KV loading overlapped with compute.

The benchmark runs the reference engine (``contrib/kvframe-refengine``, its own distribution),
so it lives there (:mod:`kvframe_refengine.bench_pipeline`, whose docstring describes what is
measured and the JSON keys); this module only hands the command over.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

__all__ = ["add_arguments", "run"]

_IMPL = "kvframe_refengine.bench_pipeline"


def _impl() -> ModuleType | None:
    try:
        return importlib.import_module(_IMPL)
    except ImportError:
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--quick``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="one small case; not for figures")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (needs the reference engine and the NIXL plugin installed)."""
    impl = _impl()
    if impl is None:
        print(
            "kvframe bench pipeline needs the reference engine: "
            "install it with: pip install kvframe-refengine (in a source checkout ./dev does)",
            file=sys.stderr,
        )
        return 1
    return int(impl.run(args))
