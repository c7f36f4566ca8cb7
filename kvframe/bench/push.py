"""``kvframe bench push``: D's time to first token in pull mode, push mode and progressive push.

The benchmark starts reference-engine servers (``contrib/kvframe-refengine``, its own
distribution), so it lives there (:mod:`kvframe_refengine.bench_push`, whose docstring
describes what is measured and the JSON keys); this module only hands the command over.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_arguments", "run"]

_IMPL = "kvframe_refengine.bench_push"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``, ``--quick`` (one short prompt, one round: for tests of the output's shape)
    and ``--repeats N`` (measured rounds per prompt length, default 7)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="one short prompt; not for figures")
    parser.add_argument(
        "--repeats", type=_positive, default=None, help="measured rounds per prompt length (7)"
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of rounds >= 1")
    return value


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (needs the reference engine, torch and the NIXL plugin installed).

    Raises ``ModuleNotFoundError`` naming what is missing (``kvframe`` turns it into a line with
    the install command, :data:`kvframe.cli.OPTIONAL_DEPENDENCIES`).
    """
    impl = importlib.import_module(_IMPL)
    return int(impl.run(args))
