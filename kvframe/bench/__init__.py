"""Benchmarks behind ``kvframe bench NAME``: each prints ratios measured side by side in one
run (against raw NIXL, memcpy, plain files or a naive implementation), never a bare number.

One module per benchmark, each with ``add_arguments(parser)`` and ``run(args) -> int``; the
command's table of them is :data:`kvframe.cli.BENCHMARKS`.
"""

__all__: list[str] = []
