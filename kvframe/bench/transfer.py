"""``kvframe bench transfer``: the transport-level transfer benchmark.

Measured side by side in one run, on the same memory and the same random block sets:

- **kvframe** — a cross-process READ (D pulls from P) through the kvframe NIXL transport with
  its default options, found through the plugin host like any transport (``post`` + ``poll``
  until done + ``release``); **kvframe_inline** — the same with ``post_thread`` off;
- **raw NIXL** — the same READ with NIXL called directly: descriptor lists prepared once with
  ``prep_xfer_dlist``, then ``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state`` per
  request, so the ratio kvframe/raw is kvframe's own overhead;
- **memcpy** — ``np.copyto`` of the same blocks inside one process, the ceiling of any copy.

for block sizes 16 KiB … 2 MiB and 1 … 256 blocks per request. A second table gives the
per-request cost of posting (µs) against the number of descriptors, and a third the overlap
of a large synchronous post with the caller's own work (inline versus ``post_thread``). A
fourth, with host memory, compares tensor-parallel pairings through the P/D connector: P4→D2
and P2→D4 against P2→D2 for one model (:mod:`kvframe.bench.transfer_tp`).

P runs in a child process (this module with ``serve``), which hosts both a kvframe transport
and a raw NIXL agent over one registered pool and drives their progress every 0.5 ms. Commands
and replies are msgpack maps over pipes.

**The P/D connector column** (``pd_connector``): P's and D's engines are minimal loops around
the P/D connector (:class:`_PDEngine`), their transports posting inline as raw NIXL does. P's
engine steps every 0.5 ms; while its worker's
:meth:`~kvframe.connectors.pd.worker.PDConnectorWorker.progress_wanted` is true (a lease held)
the child also drives the worker's ``progress()`` every :data:`FAST_POLL` seconds between
steps, as a driver thread would (``KVFRAME_BENCH_P_FAST_POLL=0.0005`` turns that off). D's
engine steps back to back until the load is reported.

**The protocol floor column** (``pd_floor``): the P/D protocol's own steps for one load
(the metadata and output round trips, the data READ, the heartbeat, the lease-table READ, the
done notice) in straight-line Python with NIXL called directly, nothing else
(:class:`_ProtocolFloorMethod`). ``floor_fixed_cost_us`` (its median less raw NIXL's) is the
least a Python connector speaking this protocol can add to a READ under the same conditions;
``fixed_cost_us`` less it is what the connector's framework costs.

**The cold path** (``cold``): for each of ``cold_trials`` trials, a new decoder's first
request to P (its handshake included, and measured apart) against the median of its later
ones, for raw NIXL and the P/D connector with and without its warm-up
(``warmup_timeout``); ``KVFRAME_BENCH_P_STEP`` sets P's step interval in the child.

**Adding a column** (the lead's "through the P/D connector" column): implement a
:class:`Method` (``name``, ``setup``, ``run_once``, ``close``) and append its factory to
:data:`METHOD_FACTORIES`; the tables, ratios and JSON pick it up, and the JSON shape stays the
same (``results`` is keyed by method name).

**Device memory** (``--device cuda``, ``measure(..., device="cuda")``): both pools (and the
memcpy source) are torch tensors on that CUDA device, registered as ``DEVICE`` memory (NIXL
``VRAM``), and the memcpy column is a torch ``copy_`` per block on the device. The default,
``"cpu"``, is host memory exactly as described above. **Byte checks** (``--verify``): before
each timed transfer the destination blocks are zeroed and after it every byte of them is
compared with its source block (P's pool, rebuilt here from its seed, or the memcpy source),
both outside the timing; the report then has a ``verify`` entry. ``tests/gpu/gpu_check.py``
uses both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import mmap
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import msgpack
import numpy as np
import numpy.typing as npt

from kvframe.bench.progress import Progress
from kvframe.runtime.procs import ChildProcesses
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryKind,
    MemoryRegion,
    Op,
    Transport,
    TransportParams,
    XferState,
)

__all__ = [
    "FAST_POLL",
    "FULL",
    "METHOD_FACTORIES",
    "PD_PHASES",
    "QUICK",
    "STEP_POLL",
    "BenchConfig",
    "BenchEnv",
    "Memory",
    "Method",
    "add_arguments",
    "config_from_args",
    "format_report",
    "measure",
    "run",
    "serve",
]

KiB = 1024
MiB = 1024 * KiB


class BenchConfig:
    """The sweep: block sizes, blocks per request, repetitions, the descriptor counts of the
    post-cost table and the size of each side's memory pool."""

    def __init__(
        self,
        *,
        block_sizes: Sequence[int],
        blocks: Sequence[int],
        repeats: int,
        descriptor_counts: Sequence[int],
        overlap_bytes: int,
        pool_bytes: int,
        scrub_bytes: int = 48 * MiB,
        tp_block_bytes: int = 64 * KiB,
        tp_blocks: Sequence[int] = (1, 16, 64),
        cold_trials: int = 3,
        cold_block_bytes: int = 64 * KiB,
        cold_blocks: int = 16,
        cold_later: int = 10,
    ) -> None:
        self.block_sizes = tuple(block_sizes)
        self.blocks = tuple(blocks)
        self.repeats = repeats
        self.descriptor_counts = tuple(descriptor_counts)
        self.overlap_bytes = overlap_bytes
        self.scrub_bytes = scrub_bytes
        self.tp_block_bytes = tp_block_bytes
        self.tp_blocks = tuple(tp_blocks)
        self.cold_trials = cold_trials
        self.cold_block_bytes = cold_block_bytes
        self.cold_blocks = cold_blocks
        self.cold_later = cold_later
        # The pool must hold the largest request; smaller blocks are drawn from all of it, so
        # a request rarely reuses what the previous one left in the CPU caches.
        self.pool_bytes = max(
            pool_bytes,
            max(self.block_sizes) * max(self.blocks),
            16 * KiB * max(self.descriptor_counts),
            overlap_bytes,
        )

    def as_dict(self) -> dict[str, Any]:
        """The configuration as a JSON-able map."""
        return {
            "block_sizes": list(self.block_sizes),
            "blocks": list(self.blocks),
            "repeats": self.repeats,
            "descriptor_counts": list(self.descriptor_counts),
            "overlap_bytes": self.overlap_bytes,
            "pool_bytes": self.pool_bytes,
            "scrub_bytes": self.scrub_bytes,
            "tp_block_bytes": self.tp_block_bytes,
            "tp_blocks": list(self.tp_blocks),
            "cold_trials": self.cold_trials,
            "cold_block_bytes": self.cold_block_bytes,
            "cold_blocks": self.cold_blocks,
            "cold_later": self.cold_later,
        }


FULL = BenchConfig(
    block_sizes=(16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB),
    blocks=(1, 4, 16, 64, 256),
    repeats=5,
    descriptor_counts=(1, 8, 64, 128, 256, 512),
    overlap_bytes=64 * MiB,
    pool_bytes=256 * MiB,
)
"""The default sweep (about a minute on two cores)."""

QUICK = BenchConfig(
    block_sizes=(16 * KiB, 256 * KiB),
    blocks=(1, 8),
    repeats=2,
    descriptor_counts=(1, 16),
    overlap_bytes=4 * MiB,
    pool_bytes=8 * MiB,
    scrub_bytes=1 * MiB,
    tp_block_bytes=16 * KiB,
    tp_blocks=(1, 4),
    cold_trials=1,
    cold_block_bytes=16 * KiB,
    cold_blocks=4,
    cold_later=3,
)
"""``--quick``: a few seconds; for tests of the output's shape, not for figures."""


class Memory:
    """Where the pools live: ``"cpu"`` (numpy arrays in host memory, the default) or a CUDA
    device such as ``"cuda"`` or ``"cuda:1"`` (torch tensors, registered as ``DEVICE`` memory,
    NIXL ``VRAM``). Raises ``ValueError`` for any other name."""

    def __init__(self, device: str = "cpu") -> None:
        if device != "cpu" and device.partition(":")[0] != "cuda":
            raise ValueError(f"device {device!r}: give 'cpu', 'cuda' or 'cuda:N'")
        self.device = device
        self.cuda = device != "cpu"
        self.kind = MemoryKind.DEVICE if self.cuda else MemoryKind.HOST
        self.nixl = "VRAM" if self.cuda else "DRAM"
        index = device.partition(":")[2]
        self.device_id = int(index) if index else 0

    def place(self, data: npt.NDArray[np.uint8]) -> Any:
        """``data`` itself on the host, or a copy of it on the device."""
        if not self.cuda:
            return data
        import torch

        out = torch.from_numpy(data).to(self.device)
        self.sync()
        return out

    def addr(self, pool: Any) -> int:
        """The address of a pool made by :meth:`place`."""
        return int(pool.data_ptr()) if self.cuda else int(pool.ctypes.data)

    def region(self, addr: int, length: int) -> MemoryRegion:
        """A region of this memory."""
        return MemoryRegion(addr=addr, length=length, kind=self.kind, device_id=self.device_id)

    def tensor(self, pool: Any) -> Any:
        """The pool as a torch tensor (a view, not a copy)."""
        if self.cuda:
            return pool
        import torch

        return torch.from_numpy(pool)

    def index(self, blocks: npt.NDArray[np.int64]) -> Any:
        """Block ids to index a pool with."""
        if not self.cuda:
            return blocks
        import torch

        return torch.as_tensor(blocks, device=self.device)

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to do on the host)."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)


def _p_content(pool_bytes: int) -> npt.NDArray[np.uint8]:
    """What P's pool holds (the byte checks rebuild it on D's side)."""
    return np.random.default_rng(0).integers(0, 256, pool_bytes, dtype=np.uint8)


# -- the child process (P) -------------------------------------------------------------------


def _as_str(name: str | bytes) -> str:
    # NIXL returns agent names as bytes from some calls and str from others.
    return name.decode() if isinstance(name, bytes) else name


def _quiet_nixl() -> None:
    # NIXL's logger prints INFO lines to stdout, which would corrupt --json output.
    import nixl_cu12  # noqa: F401  (NIXL configures its logger on import)

    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


STEP_POLL = 0.0005
"""P's step interval in the child (seconds): the pace of an idle engine loop;
``KVFRAME_BENCH_P_STEP`` overrides it (a slower engine: the cold row's first READ waits for
P's progress while UCX wires the connection up)."""
FAST_POLL = 0.0001
"""How often the child drives P's P/D worker between steps while
:meth:`~kvframe.connectors.pd.worker.PDConnectorWorker.progress_wanted` is true (seconds);
``KVFRAME_BENCH_P_FAST_POLL`` overrides it (0.0005 or more: steps only, as before)."""


def _send(fd: int, value: Any) -> None:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def serve(reply_fd: int, pool_bytes: int, device: str = "cpu") -> None:
    """The child's main loop: host P's kvframe transport and raw NIXL agent over one pool
    (in ``device``'s memory, see :class:`Memory`).

    Commands come as msgpack maps on stdin (``add_peer``, ``add_raw``, ``exit``); one reply per
    command goes to ``reply_fd``. Progress is driven every 0.5 ms in between.
    """
    os.dup2(2, 1)  # NIXL's logger may print to stdout; keep the parent's pipes clean
    _quiet_nixl()
    import nixl_cu12

    from kvframe.runtime.plugins import PluginHost

    memory = Memory(device)
    pool = memory.place(_p_content(pool_bytes))
    addr = memory.addr(pool)
    host = PluginHost()
    host.load()
    t = host.create_transport("nixl", TransportParams(name=f"bench-P-{os.getpid()}"))
    t.register_memory([memory.region(addr, pool.nbytes)])
    raw: Any = nixl_cu12.nixl_agent(
        f"bench-P-raw-{os.getpid()}", nixl_cu12.nixl_agent_config(enable_prog_thread=False)
    )
    raw.register_memory(
        np.array([[addr, pool.nbytes, memory.device_id]], dtype=np.uint64), memory.nixl
    )
    _send(
        reply_fd,
        {
            "meta": t.local_metadata(),
            "raw_meta": bytes(raw.get_agent_metadata()),
            "raw_name": raw.name,
            "addr": addr,
        },
    )
    unpacker = msgpack.Unpacker(raw=False)
    pd: _PDEngine | None = None
    fast = float(os.environ.get("KVFRAME_BENCH_P_FAST_POLL", FAST_POLL))
    step_poll = float(os.environ.get("KVFRAME_BENCH_P_STEP", STEP_POLL))
    next_step = 0.0
    try:
        while True:
            # P's engine steps every 0.5 ms; while its P/D worker says a decoder may be waiting
            # for it (a lease held, a read under way), the loop also drives the worker's
            # progress every ``fast`` seconds between steps, as a driver thread would.
            busy = pd is not None and fast < step_poll and pd.worker.progress_wanted()
            ready, _, _ = select.select([0], [], [], fast if busy else step_poll)
            t.progress()
            raw.get_new_notifs()
            if pd is not None:
                now = time.perf_counter()
                if not busy or now >= next_step:
                    pd.step()
                    next_step = now + step_poll
                else:
                    pd.worker.progress()
            if not ready:
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return
            unpacker.feed(data)
            for cmd in unpacker:
                if cmd["op"] == "add_peer":
                    _send(reply_fd, t.add_peer(cmd["meta"]))
                elif cmd["op"] == "add_raw":
                    _send(reply_fd, _as_str(raw.add_remote_agent(cmd["meta"])))
                elif cmd["op"] == "pd_setup":
                    if pd is not None:
                        pd.close()
                    pd = _PDEngine(
                        "kv_producer", memory.tensor(pool), cmd["block_size"], cmd["num_blocks"]
                    )
                    _send(reply_fd, None)
                elif cmd["op"] == "pd_grant":
                    assert pd is not None
                    params = pd.grant(cmd["rid"], cmd["blocks"])
                    # The worker holds the lease from its next step (the metadata carries the
                    # grant); an engine's P takes that step while its answer travels to D
                    # through the router, so here it comes before the reply.
                    pd.step()
                    _send(reply_fd, params)
                elif cmd["op"] == "exit":
                    _send(reply_fd, None)
                    return
    finally:
        if pd is not None:
            pd.close()
        t.close()


class _Child:
    """The P process, seen from D."""

    def __init__(self, pool_bytes: int, device: str = "cpu") -> None:
        r, w = os.pipe()
        # Its own process group, stopped with this one on a signal (kvframe.runtime.procs).
        self._children = ChildProcesses()
        self.proc = self._children.popen(
            [
                sys.executable,
                "-m",
                "kvframe.bench.transfer",
                "serve",
                str(w),
                str(pool_bytes),
                device,
            ],
            stdin=subprocess.PIPE,
            pass_fds=[w],
        )
        os.close(w)
        self._fd = r
        self._unpacker = msgpack.Unpacker(raw=False)
        self.hello: dict[str, Any] = self.result(None, timeout=60.0)

    def call(self, drive: Callable[[], object] | None, op: str, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgpack.packb({"op": op, **kw}, use_bin_type=True))
        self.proc.stdin.flush()
        return self.result(drive)

    def result(self, drive: Callable[[], object] | None, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            for value in self._unpacker:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"benchmark child exited with status {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"benchmark child did not answer within {timeout} s")
            ready, _, _ = select.select([self._fd], [], [], 0.0005)
            if drive is not None:
                drive()
            if ready:
                self._unpacker.feed(os.read(self._fd, 1 << 16))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(None, "exit")
                self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            os.close(self._fd)
            self._children.close()


# -- methods (the table's columns) ------------------------------------------------------------


class BenchEnv:
    """What a :class:`Method` factory receives: ``pool`` (D's registered-once destination
    memory, ``config.pool_bytes`` bytes), ``remote_addr`` (the address of P's pool in the child),
    ``child`` (the P process: ``child.hello`` holds P's kvframe transport metadata under
    ``"meta"`` and its raw NIXL agent metadata under ``"raw_meta"``), ``source`` (a local copy
    source for in-process methods), ``config``, and ``memory`` (where both pools live, see
    :class:`Memory`; ``pool`` and ``source`` are torch tensors on a CUDA device) with ``addr``
    (the address of ``pool``)."""

    def __init__(
        self, child: _Child, pool: Any, config: BenchConfig, memory: Memory | None = None
    ) -> None:
        self.child = child
        self.pool = pool
        self.memory = memory if memory is not None else Memory()
        self.addr = self.memory.addr(pool)
        self.remote_addr: int = child.hello["addr"]
        self.config = config
        self.source = self.memory.place(
            np.random.default_rng(1).integers(0, 256, pool.nbytes, dtype=np.uint8)
        )


class Method(Protocol):
    """One column of the throughput table.

    ``setup(block_size, num_blocks)`` is called once per block size (prepare what a real user
    prepares once); ``run_once(dst, src)`` moves blocks ``src`` of P's pool into blocks ``dst``
    of D's pool and returns when every byte landed; ``close()`` releases everything.
    """

    name: str

    def setup(self, block_size: int, num_blocks: int) -> None:
        """Prepare for requests of ``block_size``-byte blocks over pools of ``num_blocks``
        blocks (called once per block size, before any ``run_once``)."""

    def run_once(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> None:
        """Move P's blocks ``src`` into D's blocks ``dst``; return when every byte landed.
        Raise ``RuntimeError`` when the transfer fails."""

    def close(self) -> None:
        """Release everything the method created."""


class _KvframeMethod:
    """The kvframe NIXL transport with its default options (``name="kvframe"``) or with
    ``options`` (another column)."""

    def __init__(
        self, env: BenchEnv, *, name: str = "kvframe", options: dict[str, Any] | None = None
    ) -> None:
        from kvframe.runtime.plugins import PluginHost

        host = PluginHost()
        host.load()
        self.name = name
        self.t: Transport = host.create_transport(
            "nixl", TransportParams(name=f"bench-D-{name}-{os.getpid()}", options=options or {})
        )
        self.env = env
        self.t.register_memory([env.memory.region(env.addr, env.pool.nbytes)])
        self.peer = self.t.add_peer(env.child.hello["meta"])
        env.child.call(self.t.progress, "add_peer", meta=self.t.local_metadata())
        self.local: LayoutHandle | None = None
        self.remote: LayoutHandle | None = None

    def setup(self, block_size: int, num_blocks: int) -> None:
        self.local = self.t.prepare_local(
            _layout(self.env.memory, self.env.addr, block_size, num_blocks)
        )
        self.remote = self.t.prepare_remote(
            self.peer, _layout(self.env.memory, self.env.remote_addr, block_size, num_blocks)
        )

    def post(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> Any:
        assert self.local is not None
        assert self.remote is not None
        return self.t.post(Op.READ, self.local, dst, self.remote, src)

    def wait(self, h: Any) -> None:
        while (status := self.t.poll(h)).state is XferState.PENDING:
            pass
        self.t.release(h)
        if status.state is not XferState.DONE:
            raise RuntimeError(f"kvframe READ failed: {status.error}")

    def run_once(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> None:
        self.wait(self.post(dst, src))

    def close(self) -> None:
        self.t.close()


def _layout(memory: Memory, addr: int, block_size: int, num_blocks: int) -> BlockLayout:
    return BlockLayout(
        regions=[memory.region(addr, block_size * num_blocks)],
        block_lens=[block_size],
        num_blocks=num_blocks,
    )


def _descs(
    addr: int, block_size: int, num_blocks: int, device_id: int = 0
) -> npt.NDArray[np.uint64]:
    starts = np.uint64(addr) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_size)
    return np.stack(
        [
            starts,
            np.full(num_blocks, block_size, np.uint64),
            np.full(num_blocks, device_id, np.uint64),
        ],
        axis=1,
    )


class _RawNixlMethod:
    name = "raw_nixl"

    def __init__(self, env: BenchEnv, agent: str = "raw") -> None:
        import nixl_cu12

        self.env = env
        self.agent: Any = nixl_cu12.nixl_agent(
            f"bench-D-{agent}-{os.getpid()}", nixl_cu12.nixl_agent_config(enable_prog_thread=False)
        )
        mem = env.memory
        self.reg = self.agent.register_memory(
            np.array([[env.addr, env.pool.nbytes, mem.device_id]], dtype=np.uint64), mem.nixl
        )
        self.peer = _as_str(self.agent.add_remote_agent(env.child.hello["raw_meta"]))
        env.child.call(
            self.agent.get_new_notifs, "add_raw", meta=bytes(self.agent.get_agent_metadata())
        )
        self.lists: list[Any] = []

    def setup(self, block_size: int, num_blocks: int) -> None:
        for h in self.lists:
            h.release()
        mem = self.env.memory
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            _descs(self.env.addr, block_size, num_blocks, mem.device_id),
            mem.nixl,
        )
        self.remote = self.agent.prep_xfer_dlist(
            self.peer, _descs(self.env.remote_addr, block_size, num_blocks, mem.device_id), mem.nixl
        )
        self.lists = [self.local, self.remote]

    def run_once(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> None:
        self.read(self.local, dst.astype(np.int32), self.remote, src.astype(np.int32))

    def read(self, local: Any, dst: Any, remote: Any, src: Any) -> None:
        """READ ``remote``'s entries ``src`` into ``local``'s ``dst`` (prepared lists, int32
        indices); return when done. Raise ``RuntimeError`` when it fails."""
        h = self.agent.make_prepped_xfer("READ", local, dst, remote, src)
        state = self.agent.transfer(h)
        while state == "PROC":
            state = self.agent.check_xfer_state(h)
        h.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {state}")

    def close(self) -> None:
        for h in self.lists:
            h.release()
        self.agent.deregister_memory(self.reg)
        self.agent.remove_remote_agent(self.peer)


class _MemcpyMethod:
    name = "memcpy"

    def __init__(self, env: BenchEnv) -> None:
        self.env = env

    def setup(self, block_size: int, num_blocks: int) -> None:
        n = block_size * num_blocks
        self.dst = self.env.pool[:n].reshape(num_blocks, block_size)
        self.src = self.env.source[:n].reshape(num_blocks, block_size)

    def run_once(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> None:
        if self.env.memory.cuda:  # torch copy_ per block on the device
            for d, s in zip(dst.tolist(), src.tolist(), strict=True):
                self.dst[d].copy_(self.src[s])
            self.env.memory.sync()
            return
        for d, s in zip(dst.tolist(), src.tolist(), strict=True):
            np.copyto(self.dst[d], self.src[s])

    def close(self) -> None:
        pass


class _PDEngine:
    """A minimal engine around :class:`~kvframe.connectors.pd.PDConnector` over a byte pool
    (a uint8 torch tensor, on the host or a CUDA device): one region, ``block_size``-byte
    blocks, one token per block. Metadata and outputs cross between its scheduler and worker
    halves as codec bytes, as in a real engine."""

    def __init__(
        self,
        role: str,
        pool: Any,
        block_size: int,
        num_blocks: int,
        *,
        name: str = "",
        extra: dict[str, Any] | None = None,
    ) -> None:
        from kvframe.config import KVTransferConfig
        from kvframe.connectors.pd import PDConnector
        from kvframe.runtime.plugins import PluginHost
        from kvframe.spi.connector import BuildContext, EngineInfo, codec_for

        config = KVTransferConfig.from_dict(
            {
                "kv_connector": "PDConnector",
                "kv_role": role,
                "engine_id": f"bench-{role}-{os.getpid()}-{block_size}{name}",
                # Inline posting, as raw NIXL posts: this engine has no forward pass for a
                # post worker to overlap, and a loop spinning beside the worker's copy on two
                # cores made large loads 1.5x slower (docs/demo.md, fixed-cost section).
                "kv_connector_extra_config": {
                    "transport": "nixl",
                    "transport_options": {"post_thread": False},
                    **(extra or {}),
                },
            }
        )
        self.codec = codec_for(PDConnector, config)
        info = EngineInfo(block_size=1, model="bench")
        host = PluginHost()
        host.load()
        ctx = BuildContext(host=host)
        self.sched = PDConnector.build_scheduler(config, info, ctx)
        self.worker = PDConnector.build_worker(config, info, 0, ctx)
        kv = pool[: block_size * num_blocks].view(num_blocks, block_size)
        self.worker.register_kv_caches({"pool": kv})
        blob = self.worker.get_handshake_metadata()
        if blob is not None:
            self.sched.set_xfer_handshake_metadata({0: blob})
        self.n = 0
        self.finished_recving: set[str] = set()
        self.failures: dict[str, str] = {}
        self.counters: dict[str, float] = {}  # the worker's counters, summed over steps
        self.events: list[Any] = []  # the worker's events (KVEvent), in order
        # Seconds per part of the engine's work (PD_PHASES), summed while not None.
        self.phases: dict[str, float] | None = None

    def step(self, timed: bool = False) -> float:
        """One engine step; returns the seconds ``start_load_kv`` took (the launch cost)."""
        from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
        from kvframe.spi.connector import SchedulerStep

        clock = time.perf_counter
        t0 = clock()
        meta = self.sched.build_connector_meta(SchedulerStep(step=self.n, now=time.monotonic()))
        self.n += 1
        t1 = clock()
        wire = self.codec.decode_as(self.codec.encode(meta), ConnectorMetadata)
        t2 = clock()
        self.worker.bind_connector_metadata(wire)
        t3 = clock()
        self.worker.start_load_kv(None)
        t4 = clock()
        out = self.worker.build_connector_worker_output()
        self.worker.clear_connector_metadata()
        t5 = clock()
        out = self.codec.decode_as(self.codec.encode(out), ConnectorOutput)
        t6 = clock()
        self.sched.update_connector_output(out)
        t7 = clock()
        if self.phases is not None:
            for name, a, b in zip(
                PD_PHASES[1:-1], (t0, t1, t2, t4, t5, t6), (t1, t2, t4, t5, t6, t7), strict=True
            ):
                self.phases[name] += b - a
            self.phases["steps"] += 1
        launch = t4 - t3
        self.finished_recving |= out.finished_recving
        self.failures.update(out.failures)
        for name, value in out.stats.counters.items():
            self.counters[name] = self.counters.get(name, 0) + value
        self.events.extend(out.events)
        return launch

    def grant(self, rid: str, blocks: list[int]) -> dict[str, Any]:
        from kvframe.spi.request import RequestView

        view = RequestView(
            request_id=rid,
            num_prompt_tokens=len(blocks) + 1,
            kv_transfer_params={"do_remote_decode": True},
            finish_reason="length",
        )
        _, params = self.sched.request_finished(view, (tuple(blocks),))
        assert params is not None
        return params

    def schedule(self, rid: str, params: dict[str, Any], blocks: list[int]) -> None:
        from kvframe.spi.request import RequestView

        t0 = time.perf_counter()
        view = RequestView(
            request_id=rid,
            num_prompt_tokens=len(blocks) + 1,
            kv_transfer_params=params,
            arrival_time=time.monotonic(),
        )
        self.sched.on_new_request(view)
        n, _ = self.sched.get_num_new_matched_tokens(view, 0)
        self.sched.update_state_after_alloc(view, (tuple(blocks),), n or 0)
        if self.phases is not None:
            self.phases["schedule"] += time.perf_counter() - t0

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


class _PDConnectorMethod:
    """Through the P/D connector: P grants a lease (outside the timing, as when prefill ends;
    P's worker applies the grant before D hears of it), then D's scheduler plans the load, its
    worker posts the READ and the heartbeat, and once the READ landed proves the lease (a READ
    of P's lease table, or P's acknowledgement), sends the completion notice and reports the
    request received."""

    name = "pd_connector"

    def __init__(self, env: BenchEnv) -> None:
        self.env = env
        self.engine: _PDEngine | None = None
        self.params: dict[str, Any] | None = None
        self.ids = 0
        self.phases: list[dict[str, float]] = []  # per timed load: seconds per PD_PHASES

    def setup(self, block_size: int, num_blocks: int) -> None:
        if self.engine is not None:
            self.engine.close()
        self.env.child.call(None, "pd_setup", block_size=block_size, num_blocks=num_blocks)
        self.engine = _PDEngine(
            "kv_consumer", self.env.memory.tensor(self.env.pool), block_size, num_blocks
        )

    def prepare(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> None:
        """Untimed: P finishes a request and grants its lease."""
        assert self.engine is not None
        self.ids += 1
        self.rid = f"r{self.ids}"
        self.params = self.env.child.call(
            self.engine.step, "pd_grant", rid=self.rid, blocks=src.tolist()
        )

    def run_once(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> None:
        assert self.engine is not None
        self.engine.phases = dict.fromkeys(PD_PHASES, 0.0)
        try:
            self._load(dst)
            self.phases.append(self.engine.phases)
        finally:
            self.engine.phases = None

    def take_phases(self) -> list[dict[str, float]]:
        """The timed loads' phases since the last call (seconds, ``steps`` a count)."""
        out, self.phases = self.phases, []
        return out

    def _load(self, dst: npt.NDArray[np.int64]) -> float:
        assert self.engine is not None
        assert self.params is not None
        rid = f"d{self.ids}"
        self.engine.schedule(rid, self.params, dst.tolist())
        launch = 0.0
        deadline = time.monotonic() + 30
        while rid not in self.engine.finished_recving:
            launch = max(launch, self.engine.step())
            if time.monotonic() > deadline:
                raise RuntimeError(f"P/D connector load {rid} did not finish in 30 s")
        if rid in self.engine.failures:
            raise RuntimeError(f"P/D connector load failed: {self.engine.failures[rid]}")
        return launch

    def launch_us(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> float:
        """Microseconds from ``start_load_kv`` to the READ posted (the step that posts it)."""
        self.prepare(dst, src)
        return self._load(dst) * 1e6

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _kvframe_inline(env: BenchEnv) -> _KvframeMethod:
    return _KvframeMethod(env, name="kvframe_inline", options={"post_thread": False})


class _ProtocolFloorMethod:
    """The P/D protocol's own steps for one load, written as straight-line Python with NIXL
    called directly and nothing else (``name="pd_floor"``): the lower bound of any Python
    connector that speaks this protocol, not a connector.

    Per request, as the P/D connector does them (unauthenticated, as the benchmark's engines
    run): the step's metadata (one load: request id, lease handle, block ids) through a msgpack
    round trip; the data READ with raw NIXL (as :class:`_RawNixlMethod`); the heartbeat naming
    the lease, sent from a second agent (the NIXL transport's notification agent, so that no
    notification precedes a READ on the data endpoint); the 8-byte READ of the lease's slot
    in P's memory (the lease-table check) into a registered scratch word; the done notice; the
    worker's output (the request received) through a msgpack round trip. No request admission,
    no validation of the ticket, no lease state machine, no bound, no statistics: what the
    connector adds beyond this floor is its framework, and what this floor adds beyond raw
    NIXL is the protocol. P drains the notifications and answers none (the connector's P
    answers off D's path too, since D proves the lease from the table)."""

    name = "pd_floor"

    def __init__(self, env: BenchEnv) -> None:
        import nixl_cu12

        self.raw = _RawNixlMethod(env, agent="floor")
        self.agent = self.raw.agent
        pid = os.getpid()
        self.notify: Any = nixl_cu12.nixl_agent(
            f"bench-D-floor-notify-{pid}", nixl_cu12.nixl_agent_config(enable_prog_thread=False)
        )
        self.notify_peer = _as_str(self.notify.add_remote_agent(env.child.hello["raw_meta"]))
        env.child.call(
            self.notify.get_new_notifs, "add_raw", meta=bytes(self.notify.get_agent_metadata())
        )
        mem = env.memory
        self.scratch = mem.place(np.zeros(mmap.PAGESIZE, dtype=np.uint8))
        addr = mem.addr(self.scratch)
        self.scratch_reg = self.agent.register_memory(
            np.array([[addr, mmap.PAGESIZE, mem.device_id]], dtype=np.uint64), mem.nixl
        )
        self.word_local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(addr, 8, 1, mem.device_id), mem.nixl
        )
        self.slots = 1024
        self.word_remote = self.agent.prep_xfer_dlist(
            self.raw.peer, _descs(env.remote_addr, 8, self.slots, mem.device_id), mem.nixl
        )
        self.word = np.zeros(1, dtype=np.int32)  # the scratch word's index, every time
        self.seq = 0

    def setup(self, block_size: int, num_blocks: int) -> None:
        self.raw.setup(block_size, num_blocks)

    def run_once(self, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]) -> None:
        self.seq += 1
        seq = self.seq
        handle = 0x5DEECE66D * seq & 0xFFFF_FFFF_FFFF_FFFF
        meta = msgpack.unpackb(
            msgpack.packb(
                {
                    "step": seq,
                    "loads": [
                        {
                            "request_id": f"d{seq}",
                            "engine": self.raw.peer,
                            "handle": handle,
                            "local": dst.tolist(),
                            "remote": src.tolist(),
                        }
                    ],
                }
            )
        )
        load = meta["loads"][0]
        self.raw.read(
            self.raw.local,
            np.asarray(load["local"], dtype=np.int32),
            self.raw.remote,
            np.asarray(load["remote"], dtype=np.int32),
        )
        now = time.monotonic()
        self.notify.send_notif(self.notify_peer, msgpack.packb([1, seq, now, [load["handle"]]]))
        slot = np.array([load["handle"] % self.slots], dtype=np.int32)
        self.raw.read(self.word_local, self.word, self.word_remote, slot)
        self.notify.send_notif(self.notify_peer, msgpack.packb([2, seq, now, [load["handle"]]]))
        out = msgpack.unpackb(
            msgpack.packb({"finished_recving": [load["request_id"]], "failures": {}})
        )
        if out["finished_recving"] != [f"d{seq}"]:
            raise RuntimeError("protocol floor: the output lost the request")

    def close(self) -> None:
        for h in (self.word_local, self.word_remote):
            h.release()
        self.agent.deregister_memory(self.scratch_reg)
        self.notify.remove_remote_agent(self.notify_peer)
        self.raw.close()


#: The parts of one P/D connector load that the benchmark times (``pd_phases_us`` in its
#: report), in order: D's scheduler taking the request (``on_new_request``, matched tokens,
#: allocation); then per engine step, summed over the load's steps: the step's metadata built
#: (``build_connector_meta``), its codec round trip, the worker's ``bind_connector_metadata`` +
#: ``start_load_kv`` (the READ and the lease traffic are posted here), its output
#: (``build_connector_worker_output``, with ``get_finished`` and the statistics), the output's
#: codec round trip, and the scheduler's ``update_connector_output``; ``steps`` counts the
#: engine steps. Their sum is the load's time less the loop around them.
PD_PHASES: tuple[str, ...] = (
    "schedule",
    "metadata",
    "metadata_codec",
    "start_load",
    "output",
    "output_codec",
    "update",
    "steps",
)


#: The throughput table's columns, in order. The first is the subject of the ratios.
#: The lead's "through the P/D connector" column is appended here (see the module docstring).
METHOD_FACTORIES: list[Callable[[BenchEnv], Method]] = [
    _KvframeMethod,
    _kvframe_inline,
    _RawNixlMethod,
    _MemcpyMethod,
    _PDConnectorMethod,
    _ProtocolFloorMethod,
]


# -- measurements ----------------------------------------------------------------------------


class _Scrub:
    """Evicts the CPU caches between measurements (writes a buffer larger than the L3), so
    the method measured second does not find the first one's blocks cached."""

    def __init__(self, nbytes: int) -> None:
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.value = 0

    def __call__(self) -> None:
        self.value = (self.value + 1) % 256
        self.buf.fill(self.value)


class _ByteCheck:
    """``verify``: zeroes the destination blocks before each timed transfer and compares every
    byte of them with the source blocks after it (both untimed). The source is P's pool,
    rebuilt here from its seed, or the local source for memcpy."""

    def __init__(self, env: BenchEnv) -> None:
        self.env = env
        self.remote = env.memory.place(_p_content(env.config.pool_bytes))
        self.transfers = 0
        self.bytes = 0
        self.mismatches: list[str] = []

    def _blocks(self, pool: Any, block_size: int) -> Any:
        n = self.env.config.pool_bytes // block_size
        return pool[: n * block_size].reshape(n, block_size)

    def clear(self, block_size: int, dst: npt.NDArray[np.int64]) -> None:
        self._blocks(self.env.pool, block_size)[self.env.memory.index(dst)] = 0
        self.env.memory.sync()

    def check(
        self, m: Method, block_size: int, dst: npt.NDArray[np.int64], src: npt.NDArray[np.int64]
    ) -> None:
        mem = self.env.memory
        source = self.env.source if isinstance(m, _MemcpyMethod) else self.remote
        got = self._blocks(self.env.pool, block_size)[mem.index(dst)]
        want = self._blocks(source, block_size)[mem.index(src)]
        if not bool((got == want).all()):
            self.mismatches.append(f"{m.name}: {len(dst)} x {_fmt_size(block_size)}")
        self.transfers += 1
        self.bytes += block_size * len(dst)

    def report(self) -> dict[str, Any]:
        return {"transfers": self.transfers, "bytes": self.bytes, "mismatches": self.mismatches}


def _rounds(methods: Sequence[Method], repeats: int) -> Iterator[list[tuple[int, Method]]]:
    """``repeats + 1`` rounds (the first is a warm-up the caller drops); each round runs every
    method once, and the order rotates so no method is always first."""
    k = len(methods)
    for i in range(repeats + 1):
        yield [(i, methods[(i + j) % k]) for j in range(k)]


def _throughput(
    methods: Sequence[Method],
    config: BenchConfig,
    rng: np.random.Generator,
    scrub: _Scrub,
    check: _ByteCheck | None = None,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for bs in config.block_sizes:
        pool_blocks = config.pool_bytes // bs
        for m in methods:
            m.setup(bs, pool_blocks)
        for n in config.blocks:
            if progress is not None:
                progress(f"throughput, {n} × {_fmt_size(bs)} blocks")
            times: dict[str, list[float]] = {m.name: [] for m in methods}
            for m in methods:
                if isinstance(m, _PDConnectorMethod):
                    m.take_phases()  # only this row's loads below
            for order in _rounds(methods, config.repeats):
                dst = rng.permutation(pool_blocks)[:n].astype(np.int64)
                src = rng.permutation(pool_blocks)[:n].astype(np.int64)
                for _, m in order:
                    prepare = getattr(m, "prepare", None)
                    if prepare is not None:
                        prepare(dst, src)  # untimed set-up (the P/D method's lease grant)
                    if check is not None:
                        check.clear(bs, dst)
                    scrub()
                    t0 = time.perf_counter()
                    m.run_once(dst, src)
                    times[m.name].append(time.perf_counter() - t0)
                    if check is not None:
                        check.check(m, bs, dst, src)
            nbytes = bs * n
            results = {}
            for name, ts in times.items():
                kept = ts[1:]  # the first round warmed up
                med = statistics.median(kept)
                results[name] = {"median_s": med, "p90_s": _p90(kept), "gbps": nbytes / med / 1e9}
            first = methods[0].name
            ratios = {
                f"{first}/{m.name}": results[first]["gbps"] / results[m.name]["gbps"]
                for m in methods[1:]
            }
            if "pd_connector" in results:
                # The whole connector path (scheduler plan, metadata codec, lease check, READ,
                # completion) against the bare transfer and the copy ceiling.
                for other in ("raw_nixl", "memcpy"):
                    if other in results:
                        ratios[f"pd_connector/{other}"] = (
                            results["pd_connector"]["gbps"] / results[other]["gbps"]
                        )
            if "pd_floor" in results and "raw_nixl" in results:
                # The protocol's own steps in straight-line Python against the bare READ.
                ratios["pd_floor/raw_nixl"] = (
                    results["pd_floor"]["gbps"] / results["raw_nixl"]["gbps"]
                )
            row = {
                "block_bytes": bs,
                "blocks": n,
                "bytes": nbytes,
                "results": results,
                "ratios": ratios,
            }
            for m in methods:
                if isinstance(m, _PDConnectorMethod):
                    kept_phases = m.take_phases()[1:]  # the first round warmed up
                    if kept_phases:
                        for key, stat in (
                            ("pd_phases_us", statistics.median),
                            ("pd_phases_p90_us", _p90),
                        ):
                            row[key] = {
                                name: stat([p[name] for p in kept_phases])
                                * (1 if name == "steps" else 1e6)
                                for name in PD_PHASES
                            }
            if "pd_connector" in results and "raw_nixl" in results:
                # What the connector adds per request over the bare READ of the same blocks,
                # measured in the same rounds.
                row["fixed_cost_us"] = (
                    results["pd_connector"]["median_s"] - results["raw_nixl"]["median_s"]
                ) * 1e6
            if "pd_floor" in results and "raw_nixl" in results:
                # What the protocol's steps alone add, in the same rounds: the least any Python
                # connector's fixed cost can be here.
                row["floor_fixed_cost_us"] = (
                    results["pd_floor"]["median_s"] - results["raw_nixl"]["median_s"]
                ) * 1e6
            rows.append(row)
    return rows


def _p90(samples: Sequence[float]) -> float:
    """The 90th percentile (nearest rank) of ``samples``."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, -(-9 * len(ordered) // 10) - 1))]


def _post_cost(
    inline: _KvframeMethod,
    threaded: _KvframeMethod,
    raw: _RawNixlMethod,
    config: BenchConfig,
    rng: np.random.Generator,
    scrub: _Scrub,
    pd: _PDConnectorMethod | None = None,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    bs = 16 * KiB
    pool_blocks = config.pool_bytes // bs
    for m in (inline, threaded, raw):
        m.setup(bs, pool_blocks)
    if pd is not None:
        pd.setup(bs, pool_blocks)
    rows = []
    for n in config.descriptor_counts:
        if progress is not None:
            progress(f"post cost, descriptors per request: {n}")
        samples: dict[str, list[float]] = {
            "kvframe_inline_post_us": [],
            "kvframe_post_thread_us": [],
            "raw_make_us": [],
            "raw_make_transfer_us": [],
        }
        for i in range(2 * config.repeats + 1):
            dst = rng.permutation(pool_blocks)[:n].astype(np.int64)
            src = rng.permutation(pool_blocks)[:n].astype(np.int64)
            for j in range(3):
                scrub()
                which = (i + j) % 3
                if which < 2:
                    key, m = (
                        ("kvframe_inline_post_us", inline),
                        ("kvframe_post_thread_us", threaded),
                    )[which]
                    t0 = time.perf_counter()
                    h = m.post(dst, src)
                    samples[key].append((time.perf_counter() - t0) * 1e6)
                    m.wait(h)
                    continue
                d32, s32 = dst.astype(np.int32), src.astype(np.int32)
                t0 = time.perf_counter()
                xh = raw.agent.make_prepped_xfer("READ", raw.local, d32, raw.remote, s32)
                t1 = time.perf_counter()
                state = raw.agent.transfer(xh)
                t2 = time.perf_counter()
                while state == "PROC":
                    state = raw.agent.check_xfer_state(xh)
                xh.release()
                samples["raw_make_us"].append((t1 - t0) * 1e6)
                samples["raw_make_transfer_us"].append((t2 - t0) * 1e6)
        if pd is not None:
            launches = []
            for _ in range(config.repeats + 1):
                dst = rng.permutation(pool_blocks)[:n].astype(np.int64)
                src = rng.permutation(pool_blocks)[:n].astype(np.int64)
                scrub()
                launches.append(pd.launch_us(dst, src))
            samples["pd_connector_launch_us"] = launches
        row: dict[str, Any] = {"descriptors": n}
        row.update({k: statistics.median(v[1:]) for k, v in samples.items()})
        rows.append(row)
    return rows


def _cold_raw(env: BenchEnv, trial: int, bs: int, n: int, later: int) -> dict[str, Any]:
    """Raw NIXL's cold path to P: a new agent (created outside the timing, as at start-up);
    the "handshake" is the metadata exchange (P loads this agent's metadata, as NixlConnector's
    side channel does), ``add_remote_agent`` and ``prep_xfer_dlist`` of P's blocks; then the
    first READ, then ``later`` READs."""
    import nixl_cu12

    mem = env.memory
    pool_blocks = env.config.pool_bytes // bs
    agent: Any = nixl_cu12.nixl_agent(
        f"bench-D-cold-{os.getpid()}-{trial}", nixl_cu12.nixl_agent_config(enable_prog_thread=False)
    )
    reg = agent.register_memory(
        np.array([[env.addr, env.pool.nbytes, mem.device_id]], dtype=np.uint64), mem.nixl
    )
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", _descs(env.addr, bs, pool_blocks, mem.device_id), mem.nixl
    )
    rng = np.random.default_rng(trial)
    try:
        t0 = time.perf_counter()
        env.child.call(agent.get_new_notifs, "add_raw", meta=bytes(agent.get_agent_metadata()))
        peer = _as_str(agent.add_remote_agent(env.child.hello["raw_meta"]))
        remote = agent.prep_xfer_dlist(
            peer, _descs(env.remote_addr, bs, pool_blocks, mem.device_id), mem.nixl
        )
        handshake = time.perf_counter() - t0
        times = []
        for _ in range(later + 1):
            dst = rng.permutation(pool_blocks)[:n].astype(np.int32)
            src = rng.permutation(pool_blocks)[:n].astype(np.int32)
            t1 = time.perf_counter()
            h = agent.make_prepped_xfer("READ", local, dst, remote, src)
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            h.release()
            times.append(time.perf_counter() - t1)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ ended in state {state}")
        remote.release()
        agent.remove_remote_agent(peer)
    finally:
        local.release()
        agent.deregister_memory(reg)
    return {
        "handshake_s": handshake,
        "first_s": handshake + times[0],
        "later_median_s": statistics.median(times[1:]),
        "warmup_s": None,
    }


def _cold_pd(
    env: BenchEnv, trial: int, bs: int, n: int, later: int, *, warmup: bool
) -> dict[str, Any]:
    """The P/D connector's cold path: a new decode engine (its transport created outside the
    timing); P grants the first request's lease and steps once (untimed, as when prefill
    ends some time before the request reaches D), then D's
    scheduler takes the request, which starts the handshake, and the first load runs to its
    report; ``handshake_s`` is the handshake's own part (from the request naming P to the
    connection READY, the warm-up included), read from D's connection entry. Then ``later``
    loads on the same connection."""
    pool_blocks = env.config.pool_bytes // bs
    p_step = float(os.environ.get("KVFRAME_BENCH_P_STEP", STEP_POLL))
    extra = {} if warmup else {"warmup_timeout": 0}
    engine = _PDEngine(
        "kv_consumer",
        env.memory.tensor(env.pool),
        bs,
        pool_blocks,
        name=f"-cold{trial}{'w' if warmup else 'n'}",
        extra=extra,
    )
    rng = np.random.default_rng(trial)
    times = []
    handshake = warm_s = None
    try:
        for i in range(later + 1):
            dst = rng.permutation(pool_blocks)[:n].astype(np.int64)
            src = rng.permutation(pool_blocks)[:n].astype(np.int64)
            params = env.child.call(
                engine.step, "pd_grant", rid=f"c{trial}-{i}", blocks=src.tolist()
            )
            # P's worker learns of a lease at its engine's next step: let one pass (untimed),
            # as when a request reaches D some time after its prefill ended; else every load
            # here would also wait for P's step, and the cold row would compare that.
            time.sleep(p_step)
            rid = f"cd{trial}-{i}"
            t0 = time.perf_counter()
            engine.schedule(rid, params, dst.tolist())
            deadline = time.monotonic() + 30
            while rid not in engine.finished_recving:
                engine.step()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cold P/D load {rid} did not finish in 30 s")
            times.append(time.perf_counter() - t0)
            if rid in engine.failures:
                raise RuntimeError(f"cold P/D load failed: {engine.failures[rid]}")
            if i == 0:
                entry = engine.worker.remote_engines[0]
                assert entry.ready_at is not None
                handshake = entry.ready_at - entry.started_at
                warm_s = entry.warmup_seconds
    finally:
        engine.close()
    return {
        "handshake_s": handshake,
        "first_s": times[0],
        "later_median_s": statistics.median(times[1:]),
        "warmup_s": warm_s,
    }


def _cold(env: BenchEnv, config: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """The cold row: the first request to a new peer (handshake included, and measured
    apart) against the median of the later ones on the same connection, for raw NIXL and the
    P/D connector with and without its warm-up, trial by trial in rotating order."""
    bs, n, later = config.cold_block_bytes, config.cold_blocks, config.cold_later
    env.child.call(None, "pd_setup", block_size=bs, num_blocks=config.pool_bytes // bs)
    methods: dict[str, Callable[[int], dict[str, Any]]] = {
        "raw_nixl": lambda t: _cold_raw(env, t, bs, n, later),
        "pd_connector": lambda t: _cold_pd(env, t, bs, n, later, warmup=True),
        "pd_connector_no_warmup": lambda t: _cold_pd(env, t, bs, n, later, warmup=False),
    }
    names = list(methods)
    trials: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
    for t in range(config.cold_trials):
        if progress is not None:
            progress(f"cold first request, trial {t + 1} of {config.cold_trials}")
        for j in range(len(names)):
            name = names[(t + j) % len(names)]
            trials[name].append(methods[name](t))
    out: dict[str, Any] = {
        "block_bytes": bs,
        "blocks": n,
        "later": later,
        "p_step_s": float(os.environ.get("KVFRAME_BENCH_P_STEP", STEP_POLL)),
        "results": {},
    }
    for name, rows in trials.items():
        first = [r["first_s"] for r in rows]
        hs = [r["handshake_s"] for r in rows]
        lat = [r["later_median_s"] for r in rows]
        excess = [r["first_s"] - r["handshake_s"] - r["later_median_s"] for r in rows]
        warm = [r["warmup_s"] for r in rows if r["warmup_s"] is not None]
        out["results"][name] = {
            "trials": rows,
            "first_median_s": statistics.median(first),
            "first_p90_s": _p90(first),
            "handshake_median_s": statistics.median(hs),
            "later_median_s": statistics.median(lat),
            "excess_median_s": statistics.median(excess),
            "excess_p90_s": _p90(excess),
            "excess_max_s": max(excess),
            "warmup_median_s": statistics.median(warm) if warm else None,
        }
    return out


def _busy_work(seconds: float) -> None:
    # Stands in for the engine's forward pass: numpy work that releases the GIL.
    a = np.ones((256, 256), dtype=np.float32)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = np.tanh(a @ a.T * 1e-3)


def _overlap(
    inline: _KvframeMethod, threaded: _KvframeMethod, config: BenchConfig, rng: np.random.Generator
) -> dict[str, Any]:
    bs = 2 * MiB if config.overlap_bytes >= 2 * MiB else 16 * KiB
    n = max(1, config.overlap_bytes // bs)
    pool_blocks = config.pool_bytes // bs
    for m in (inline, threaded):
        m.setup(bs, pool_blocks)
    dst = rng.permutation(pool_blocks)[:n].astype(np.int64)
    src = rng.permutation(pool_blocks)[:n].astype(np.int64)
    transfer_s = statistics.median(
        _timed(lambda: inline.run_once(dst, src)) for _ in range(config.repeats + 1)
    )
    work_s = transfer_s  # as much of the caller's own work as the transfer takes
    out: dict[str, Any] = {"bytes": bs * n, "transfer_s": transfer_s, "work_s": work_s}
    for key, m in (("inline", inline), ("post_thread", threaded)):

        def step(m: _KvframeMethod = m) -> tuple[float, float]:
            t0 = time.perf_counter()
            h = m.post(dst, src)
            posted = time.perf_counter() - t0
            _busy_work(work_s)
            m.wait(h)
            return posted, time.perf_counter() - t0

        runs = [step() for _ in range(config.repeats + 1)][1:]
        out[key] = {
            "post_s": statistics.median(r[0] for r in runs),
            "step_s": statistics.median(r[1] for r in runs),
        }
    return out


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(
    config: BenchConfig, *, seed: int = 0, device: str = "cpu", verify: bool = False
) -> dict[str, Any]:
    """Run the whole benchmark and return the JSON-able report (see :func:`run` for its
    shape), with both pools in ``device``'s memory (see :class:`Memory`) and, with
    ``verify``, every byte of every timed transfer checked. Raises ``RuntimeError`` when the
    child process or a transfer fails, ``ValueError`` for an unknown device."""
    memory = Memory(device)
    _quiet_nixl()
    host_pool = np.zeros(config.pool_bytes, dtype=np.uint8)
    host_pool[:] = 1  # touch every page before timing anything
    pool = memory.place(host_pool)
    steps = len(config.block_sizes) * len(config.blocks) + len(config.descriptor_counts) + 1
    steps += 0 if memory.cuda else len(config.tp_blocks)
    steps += config.cold_trials
    progress = Progress("transfer", total=steps)
    progress.note(f"starting P's process ({_fmt_size(config.pool_bytes)} pool, {device})")
    child = _Child(config.pool_bytes, device)
    methods: list[Method] = []
    check: _ByteCheck | None = None
    try:
        env = BenchEnv(child, pool, config, memory)
        for factory in METHOD_FACTORIES:
            methods.append(factory(env))
        rng = np.random.default_rng(seed)
        scrub = _Scrub(config.scrub_bytes)
        check = _ByteCheck(env) if verify else None
        throughput = _throughput(methods, config, rng, scrub, check, progress)
        kv = {m.name: m for m in methods if isinstance(m, _KvframeMethod)}
        inline, threaded = kv["kvframe_inline"], kv["kvframe"]
        raw = next(m for m in methods if isinstance(m, _RawNixlMethod))
        pd = next((m for m in methods if isinstance(m, _PDConnectorMethod)), None)
        post_cost = _post_cost(inline, threaded, raw, config, rng, scrub, pd, progress)
        progress(f"overlap of a {_fmt_size(config.overlap_bytes)} post with the caller's work")
        overlap = _overlap(inline, threaded, config, rng)
        tp = None
        if not memory.cuda:
            from kvframe.bench.transfer_tp import measure_tp

            tp = measure_tp(config.tp_block_bytes, config.tp_blocks, config.repeats, rng, progress)
        cold = _cold(env, config, progress)
    finally:
        for m in methods:
            m.close()
        child.close()
    report: dict[str, Any] = {
        "benchmark": "transfer",
        "version": 1,
        "config": config.as_dict(),
        "methods": [m.name for m in methods],
        "throughput": throughput,
        "post_cost": post_cost,
        "overlap": overlap,
        "cold": cold,
    }
    if tp is not None:
        report["tp"] = tp
    if memory.cuda:
        report["device"] = device
    if check is not None:
        report["verify"] = check.report()
    return report


# -- command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--json`` and ``--quick`` to the ``kvframe bench transfer`` parser."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="a few seconds; checks the output, not for figures"
    )
    parser.add_argument("--seed", type=int, default=0, help="block-set seed (default 0)")
    parser.add_argument(
        "--device", default="cpu", help="where the pools live: cpu (default), cuda or cuda:N"
    )
    parser.add_argument(
        "--verify", action="store_true", help="check every byte of every timed transfer"
    )
    parser.add_argument(
        "--block-sizes",
        type=_size_list,
        default=None,
        metavar="SIZES",
        help="comma-separated block sizes for the throughput table, e.g. 16K,1M,2M "
        "(default: the full sweep's 16K,64K,256K,1M,2M)",
    )
    parser.add_argument(
        "--blocks",
        type=_int_list,
        default=None,
        metavar="COUNTS",
        help="comma-separated blocks per request, e.g. 1,64 (default: 1,4,16,64,256)",
    )
    parser.add_argument(
        "--cold-trials",
        type=int,
        default=None,
        help="new decoders per method in the cold-path table (default 3; 1 with --quick)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed rounds per row (default 5; the p90 of 5 is the slowest)",
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers such as 1,64, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every count must be at least 1, got {text!r}")
    return values


def _size_list(text: str) -> tuple[int, ...]:
    units = {"K": KiB, "M": MiB}
    out = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("IB").removesuffix("B")
        scale = units.get(part[-1:], 1) if part else 1
        digits = part[:-1] if part[-1:] in units else part
        if not digits.isdigit() or int(digits) * scale < 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated sizes such as 16K,1M,2M, got {text!r}"
            )
        out.append(int(digits) * scale)
    return tuple(out)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """``--quick`` or the full sweep, with ``--block-sizes``, ``--blocks`` and ``--repeats``
    replacing the throughput table's sweep (the post-cost and overlap parts keep theirs) and
    ``--cold-trials`` the cold-path table's number of new decoders per method.

    :raises ValueError: ``--repeats`` or ``--cold-trials`` below 1.
    """
    base = QUICK if getattr(args, "quick", False) else FULL
    sizes = getattr(args, "block_sizes", None)
    blocks = getattr(args, "blocks", None)
    repeats = getattr(args, "repeats", None)
    cold = getattr(args, "cold_trials", None)
    if repeats is not None and repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if cold is not None and cold < 1:
        raise ValueError(f"--cold-trials must be at least 1, got {cold}")
    if sizes is None and blocks is None and repeats is None and cold is None:
        return base
    return BenchConfig(
        block_sizes=sizes or base.block_sizes,
        blocks=blocks or base.blocks,
        repeats=repeats or base.repeats,
        descriptor_counts=base.descriptor_counts,
        overlap_bytes=base.overlap_bytes,
        pool_bytes=base.pool_bytes,
        scrub_bytes=base.scrub_bytes,
        cold_trials=cold or base.cold_trials,
        cold_block_bytes=base.cold_block_bytes,
        cold_blocks=base.cold_blocks,
        cold_later=base.cold_later,
    )


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // KiB} KiB"


def format_report(report: dict[str, Any]) -> str:
    """The report as tables for people."""
    methods: list[str] = report["methods"]
    where = f" ({report['device']} memory)" if "device" in report else ""
    lines = [
        f"READ P->D across processes{where}, GB/s (median); ratios: kvframe / other",
        "",
        "| block | blocks | "
        + " | ".join(methods)
        + " | "
        + " | ".join(report["throughput"][0]["ratios"])
        + " |",
        "|---|---|" + "---|" * (len(methods) + len(report["throughput"][0]["ratios"])),
    ]
    for row in report["throughput"]:
        cells = [f"{row['results'][m]['gbps']:.2f}" for m in methods]
        cells += [f"{v:.2f}" for v in row["ratios"].values()]
        lines.append(
            f"| {_fmt_size(row['block_bytes'])} | {row['blocks']} | " + " | ".join(cells) + " |"
        )
    if any("fixed_cost_us" in row for row in report["throughput"]):
        lines += [
            "",
            "The P/D connector against raw NIXL, per request (µs): median and p90 of each; fixed "
            "cost = connector median - raw median; ratio = raw median / connector median; the "
            "protocol floor is the protocol's own steps in straight-line Python (pd_floor), its "
            "fixed cost the least any Python connector's can be",
            "",
            "| block | blocks | raw NIXL median | raw NIXL p90 | connector median "
            "| connector p90 | fixed cost | connector / raw | floor median | floor p90 "
            "| floor fixed cost |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in report["throughput"]:
            if "fixed_cost_us" not in row:
                continue
            raw, pdc = row["results"]["raw_nixl"], row["results"]["pd_connector"]
            floor = row["results"].get("pd_floor")
            floor_cells = (
                f"{floor['median_s'] * 1e6:.0f} | {floor['p90_s'] * 1e6:.0f} | "
                f"{row['floor_fixed_cost_us']:.0f}"
                if floor is not None
                else "- | - | -"
            )
            lines.append(
                f"| {_fmt_size(row['block_bytes'])} | {row['blocks']} | "
                f"{raw['median_s'] * 1e6:.0f} | {raw['p90_s'] * 1e6:.0f} | "
                f"{pdc['median_s'] * 1e6:.0f} | {pdc['p90_s'] * 1e6:.0f} | "
                f"{row['fixed_cost_us']:.0f} | {row['ratios']['pd_connector/raw_nixl']:.2f} | "
                f"{floor_cells} |"
            )
    if any("pd_phases_us" in row for row in report["throughput"]):
        lines += [
            "",
            "Where the P/D connector's time goes, per request (µs, medians over the rounds, "
            "p90 in the JSON; each step's parts summed over the load's steps)",
            "",
            "| block | blocks | " + " | ".join(n.replace("_", " ") for n in PD_PHASES) + " |",
            "|---|---|" + "---|" * len(PD_PHASES),
        ]
        for row in report["throughput"]:
            if "pd_phases_us" not in row:
                continue
            ph = row["pd_phases_us"]
            lines.append(
                f"| {_fmt_size(row['block_bytes'])} | {row['blocks']} | "
                + " | ".join(f"{ph[n]:.0f}" for n in PD_PHASES)
                + " |"
            )
    lines += [
        "",
        "Per-request post cost (µs, 16 KiB blocks) against descriptors",
        "",
        "| descriptors | kvframe post (inline) | kvframe post (post_thread) "
        "| raw make_prepped_xfer | raw make + transfer | P/D connector launch |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["post_cost"]:
        launch = row.get("pd_connector_launch_us")
        lines.append(
            f"| {row['descriptors']} | {row['kvframe_inline_post_us']:.1f} | "
            f"{row['kvframe_post_thread_us']:.1f} | {row['raw_make_us']:.1f} | "
            f"{row['raw_make_transfer_us']:.1f} | "
            + (f"{launch:.1f}" if launch is not None else "-")
            + " |"
        )
    ov = report["overlap"]
    lines += [
        "",
        f"Overlap: one {_fmt_size(ov['bytes'])} READ ({ov['transfer_s'] * 1e3:.1f} ms) with "
        f"{ov['work_s'] * 1e3:.1f} ms of the caller's own work",
        "",
        "| mode | post returns after (ms) | post + work + wait (ms) |",
        "|---|---|---|",
    ]
    for key in ("inline", "post_thread"):
        lines.append(f"| {key} | {ov[key]['post_s'] * 1e3:.2f} | {ov[key]['step_s'] * 1e3:.1f} |")
    if "cold" in report:
        cold = report["cold"]
        lines += [
            "",
            f"Cold path: the first request to a new peer ({cold['blocks']} × "
            f"{_fmt_size(cold['block_bytes'])}, P stepping every {cold['p_step_s'] * 1e3:g} ms), "
            f"ms over trials: medians, and median / p90 (max) for the first request and the "
            f"excess; excess = first - handshake - later (the first request's cost beyond a "
            f"warm one's)",
            "",
            "| method | handshake | first request (handshake included) | later requests "
            "| excess | warm-up |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in cold["results"].items():
            warm = r["warmup_median_s"]
            lines.append(
                f"| {name} | {r['handshake_median_s'] * 1e3:.2f} "
                f"| {r['first_median_s'] * 1e3:.2f} / {r['first_p90_s'] * 1e3:.2f} "
                f"| {r['later_median_s'] * 1e3:.2f} | {r['excess_median_s'] * 1e3:.2f} / "
                f"{r['excess_p90_s'] * 1e3:.2f} ({r['excess_max_s'] * 1e3:.2f}) | "
                + (f"{warm * 1e3:.2f}" if warm is not None else "-")
                + " |"
            )
    if "tp" in report:
        tp = report["tp"]
        base = tp["pairings"][0]
        others = tp["pairings"][1:]
        lines += [
            "",
            f"Tensor parallel: one request through the P/D connector, P's and D's ranks in this "
            f"process ({tp['heads']} KV heads, {_fmt_size(tp['block_bytes'])} blocks of the "
            f"whole model), ms per request (median / p90); ratio = median / {base} median; "
            f"{tp['loads_checked']} loads byte-checked",
            "",
            "| blocks | "
            + " | ".join(tp["pairings"])
            + " | "
            + " | ".join(f"{o} / {base}" for o in others)
            + " |",
            "|---|" + "---|" * (2 * len(tp["pairings"]) - 1),
        ]
        for row in tp["rows"]:
            res = row["results"]
            cells = [
                f"{res[p]['median_s'] * 1e3:.2f} / {res[p]['p90_s'] * 1e3:.2f}"
                for p in tp["pairings"]
            ]
            cells += [f"{row['ratios'][f'{o}/{base}']:.2f}" for o in others]
            lines.append(f"| {row['blocks']} | " + " | ".join(cells) + " |")
    if "verify" in report:
        v = report["verify"]
        bad = ", ".join(v["mismatches"]) or "none"
        lines += ["", f"Byte checks: {v['transfers']} transfers, {v['bytes']} bytes; wrong: {bad}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print tables, or with ``--json`` one object::

        {"benchmark": "transfer", "version": 1, "config": {...}, "methods": [names],
         "throughput": [{"block_bytes", "blocks", "bytes",
                         "results": {method: {"median_s", "p90_s", "gbps"}},
                         "ratios": {"kvframe/<method>": float,
                                    "pd_connector/raw_nixl": float,
                                    "pd_floor/raw_nixl": float, ...},
                         "fixed_cost_us": float,  # pd_connector - raw_nixl medians
                         "floor_fixed_cost_us": float,  # pd_floor - raw_nixl medians
                         "pd_phases_us": {phase: float},  # PD_PHASES, medians
                         "pd_phases_p90_us": {phase: float}}],  # and their p90
         "post_cost": [{"descriptors", "kvframe_inline_post_us", "kvframe_post_thread_us",
                        "raw_make_us", "raw_make_transfer_us",
                        "pd_connector_launch_us"}],
         "overlap": {"bytes", "transfer_s", "work_s",
                     "inline": {"post_s", "step_s"}, "post_thread": {"post_s", "step_s"}},
         "cold": {"block_bytes", "blocks", "later", "p_step_s",
                  "results": {"raw_nixl" | "pd_connector" | "pd_connector_no_warmup":
                              {"first_median_s", "first_p90_s", "handshake_median_s",
                               "later_median_s", "excess_median_s", "excess_p90_s",
                               "excess_max_s", "warmup_median_s",
                               "trials": [{"handshake_s", "first_s", "later_median_s",
                                           "warmup_s"}]}}},
         "tp": {"heads", "head_dim", "block_tokens", "block_bytes",   # host memory only
                "pairings": ["P2->D2", "P4->D2", "P2->D4"], "loads_checked",
                "rows": [{"blocks", "bytes",
                          "results": {pairing: {"median_s", "p90_s"}},
                          "ratios": {"P4->D2/P2->D2": float, "P2->D4/P2->D2": float}}]},
         "device": "cuda",  # only with --device other than cpu
         "verify": {"transfers", "bytes", "mismatches": [str]}}  # only with --verify

    Returns 0. Raises ``ModuleNotFoundError`` naming ``nixl_cu12`` or ``kvframe_nixl`` when
    NIXL or its plugin is missing, before starting anything (``kvframe`` turns it into a line
    with the install command, :data:`kvframe.cli.OPTIONAL_DEPENDENCIES`).
    """
    for module in ("nixl_cu12", "kvframe_nixl"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)
    report = measure(config_from_args(args), seed=args.seed, device=args.device, verify=args.verify)
    report["quick"] = bool(args.quick)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
    else:
        print("usage: kvframe bench transfer [--json] [--quick]", file=sys.stderr)
        sys.exit(2)
