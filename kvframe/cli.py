"""The ``kvframe`` command.

Subcommands:

- ``kvframe demo`` — kvframe's main job (the P/D demo).
- ``kvframe plugins`` — installed plugins, their versions, transports and capabilities.
- ``kvframe bench NAME [--json]`` — benchmarks; each prints ratios measured side by side in one
  run. Each benchmark lives in ``kvframe.bench.<NAME>`` and exposes ``add_arguments(parser)``
  and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

#: Benchmarks: name -> (module, one-line help).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "pipeline": (
        "kvframe.bench.pipeline",
        "decode-side KV loads layer by layer vs whole transfer before compute, vs max(c, t)",
    ),
    "transfer": (
        "kvframe.bench.transfer",
        "cross-process READ: kvframe NIXL transport vs raw NIXL vs memcpy, and post cost",
    ),
    "lease": (
        "kvframe.bench.lease",
        "lease table vs naive dict scan (renew, expire), and heartbeat bytes per request id",
    ),
    "codec": (
        "kvframe.bench.codec",
        "metadata codec encode+decode (empty step, 64 P/D loads) vs plain msgspec, and the bar",
    ),
    "offload": (
        "kvframe.bench.offload",
        "offload tiers vs memcpy and os.pwrite/pread, lookup cost, LRU vs ARC hit rates",
    ),
    "vllm": (
        "kvframe.bench.vllm",
        "P/D inside real vLLM engines: vLLM's NixlConnector vs kvframe's PDConnector",
    ),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvframe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run kvframe's main job (the P/D demo; `kvframe demo --help` for its options)",
        add_help=False,
    )
    del demo  # its arguments are the demo's own: main() hands them over unparsed
    from kvframe.runtime import plugin_report

    plugin_report.add_arguments(
        sub.add_parser("plugins", help="list installed plugins, what they register, load errors")
    )
    bench = sub.add_parser("bench", help="run a benchmark")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in sorted(BENCHMARKS.items()):
        p = bench_sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvframe`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    args = _build_parser().parse_args(argv)
    if args.command == "bench":
        module = importlib.import_module(BENCHMARKS[args.bench][0])
        return int(module.run(args))
    if args.command == "plugins":
        from kvframe.runtime import plugin_report

        return plugin_report.run(args)
    raise AssertionError(args.command)  # argparse rejects unknown commands


def _demo(argv: list[str]) -> int:
    try:
        # The demo lives with the reference engine (contrib/kvframe-refengine), its own
        # distribution: the core never depends on it.
        demo = importlib.import_module("kvframe_refengine.demo")
    except ImportError as exc:
        print(
            f"kvframe demo needs the reference engine ({exc}); install it with "
            "`pip install -e contrib/kvframe-refengine` (./dev demo does)",
            file=sys.stderr,
        )
        return 2
    return int(demo.main(argv))


if __name__ == "__main__":
    sys.exit(main())
