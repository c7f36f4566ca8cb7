"""The benchmark's P/D environment for tests through real NIXL: P in ``kvframe bench
transfer``'s child process (progress every 0.5 ms), its seeded pool, D's engines built on it
in the test's process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from kvframe.bench import transfer as bench

BLOCK = 16 * 1024
"""The block size the NIXL P/D test modules use."""
POOL = 4 * 1024 * 1024
"""Their pool's bytes (on both sides)."""


@contextlib.contextmanager
def bench_env(block: int = BLOCK, pool_bytes: int = POOL) -> Iterator[bench.BenchEnv]:
    """A one-block-size benchmark environment (``pool_bytes`` of ``block``-byte blocks); the
    child is closed on exit."""
    bench._quiet_nixl()
    memory = bench.Memory("cpu")
    pool = memory.place(np.ones(pool_bytes, dtype=np.uint8))
    child = bench._Child(pool_bytes)
    config = bench.BenchConfig(
        block_sizes=(block,),
        blocks=(1,),
        repeats=1,
        descriptor_counts=(1,),
        overlap_bytes=block,
        pool_bytes=pool_bytes,
        scrub_bytes=block,
    )
    try:
        yield bench.BenchEnv(child, pool, config, memory)
    finally:
        child.close()
