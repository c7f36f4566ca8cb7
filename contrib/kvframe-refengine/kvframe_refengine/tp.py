"""Tensor parallelism for the reference engine: the worker processes, seen from the engine.

With ``EngineConfig(tp_size=N)``, N > 1, the engine process keeps the scheduler, the block pool
and the connector's scheduler half, and :class:`TPWorkers` starts N worker processes
(``python -m kvframe_refengine.tp_worker``). Rank ``r`` holds its shard of the model
(:class:`~kvframe_refengine.model.TPShard`), its own KV cache of its KV heads and its own
connector worker half (``build_worker(..., rank=r, ...)``), and runs each step exactly as the
one-process engine's :class:`~kvframe_refengine.runner.ModelRunner` does; the ranks sum their
row-parallel products with ``torch.distributed.all_reduce`` over gloo on loopback.

Process layout::

    engine process                          worker process, rank r (one per rank)
    --------------                          -------------------------------------
    Scheduler, BlockPool,                   TinyLM shard r, KV cache of its heads,
    connector scheduler half                connector worker half (rank r), ModelRunner
    TPWorkers ── socketpair, codec frames ──▶ tp_worker main loop
                                             ◀── gloo all-reduce between the ranks ──▶

**The wire.** Engine and workers exchange only this module's frozen messages, encoded with
:data:`TP_CODEC` (kvframe's codec: never pickle), one per length-prefixed frame (4 bytes,
big-endian) on a ``socketpair`` per rank. The connector's metadata and each rank's
``ConnectorOutput`` travel inside them as the connector's own codec bytes
(:func:`~kvframe.spi.connector.codec_for`); :class:`TPWorkers` combines the ranks' outputs with
:class:`~kvframe.protocol.aggregate.OutputAggregator`, as the SPI says a scheduler must.
torch.distributed carries only tensors (its object collectives pickle; they are not used).

**Failures.** A rank that raises in a step answers with the error, and the step fails (the
engine ends that step's requests: :meth:`Engine.step <kvframe_refengine.engine.Engine.step>`).
A rank that dies (its socket closes), that does not answer within ``timeout_s``, or ranks that
disagree on the sampled tokens break the group: every worker is killed, this step and every
later one raise :class:`WorkerFailed` at once, so the engine ends every live request within two
steps. The collectives time out after ``timeout_s`` too, so a rank whose peer died never waits
longer than that.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import NoReturn, TypeVar

import attrs
import torch

from kvframe.protocol import frames
from kvframe.protocol.aggregate import OutputAggregator
from kvframe.protocol.codec import DEFAULT_CODEC, Codec
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
from kvframe_refengine.model import ModelConfig
from kvframe_refengine.scheduler import ScheduledBatch, ScheduledSeq, StepResult

__all__ = [
    "TP_CODEC",
    "KVData",
    "ReadKV",
    "Shutdown",
    "StepOrder",
    "StepReply",
    "TPWorkers",
    "WorkerFailed",
    "WorkerInit",
    "WorkerReady",
    "recv_frame",
    "send_frame",
]

_T = TypeVar("_T")
_MAX_FRAME = 256 * 1024 * 1024


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker failed: it died, did not answer in time, could not start, or
    raised in a step. The message names the rank and what happened."""


@attrs.frozen(kw_only=True)
class WorkerInit:
    """Engine → rank, once: everything a worker builds itself from."""

    rank: int
    tp_size: int
    model: ModelConfig
    num_blocks: int
    block_size: int
    device: str
    torch_threads: int
    init_file: str
    """The gloo rendezvous file (``file://`` init of torch.distributed), fresh per engine."""
    timeout_s: float
    """The collectives' timeout."""
    engine_model: str
    """``EngineInfo.model`` of the engine (what connectors compare in handshakes)."""
    kv_transfer_config: str | None
    """The connector's configuration as JSON (``KVTransferConfig.to_json``), or ``None``."""
    kv_cache_order: str = "NHD"
    """The KV cache's dimension order (``EngineConfig.kv_cache_order``)."""


@attrs.frozen(kw_only=True)
class WorkerReady:
    """Rank → engine, once, after its KV cache is registered with its connector worker."""

    rank: int
    handshake_metadata: bytes | None
    error: str | None = None
    """Why the worker could not start (it exits after sending this)."""


@attrs.frozen(kw_only=True)
class StepOrder:
    """Engine → every rank: one step (a :class:`ScheduledBatch` with the metadata as bytes)."""

    step: int
    seqs: tuple[ScheduledSeq, ...]
    connector_metadata: bytes | None
    finished_request_ids: frozenset[str]


@attrs.frozen(kw_only=True)
class StepReply:
    """Rank → engine: the step's greedy tokens and the rank's connector output (codec bytes)."""

    rank: int
    sampled: Mapping[str, int]
    connector_output: bytes | None
    error: str | None = None


@attrs.frozen(kw_only=True)
class ReadKV:
    """Engine → every rank: send the KV of these blocks (diagnostics and tests)."""

    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class KVData:
    """Rank → engine: float32 bytes of ``[layers, blocks, 2, block_size, kv_heads, head_dim]``."""

    rank: int
    shape: tuple[int, ...]
    data: bytes


@attrs.frozen(kw_only=True)
class Shutdown:
    """Engine → every rank: shut the connector worker down and exit."""

    reason: str = "engine shutdown"


TP_CODEC: Codec = DEFAULT_CODEC.with_types(
    {
        "refengine.tp.init": WorkerInit,
        "refengine.tp.ready": WorkerReady,
        "refengine.tp.step": StepOrder,
        "refengine.tp.reply": StepReply,
        "refengine.tp.read_kv": ReadKV,
        "refengine.tp.kv": KVData,
        "refengine.tp.shutdown": Shutdown,
    }
)
"""The codec of the engine ↔ worker wire (kvframe's default codec plus this module's types)."""


def send_frame(sock: socket.socket, message: object) -> None:
    """Send ``message`` as one frame of :data:`TP_CODEC`
    (:func:`kvframe.protocol.frames.send_frame`)."""
    frames.send_frame(sock, TP_CODEC, message)


def recv_frame(sock: socket.socket) -> object:
    """Receive one frame of :data:`TP_CODEC`. Raises ``EOFError`` when the peer closed the
    socket, ``TimeoutError`` when the socket's timeout passed and
    :class:`~kvframe.errors.CodecError` for bytes that are no message
    (:func:`kvframe.protocol.frames.recv_frame`)."""
    return frames.recv_frame(sock, TP_CODEC, max_bytes=_MAX_FRAME, what="tensor-parallel worker")


class TPWorkers:
    """The engine's side of N worker processes: start them, run steps on them, stop them.

    Args:
        model: the model's configuration (every rank builds its shard from it).
        tp_size: the number of ranks (> 1; checked by ``EngineConfig``).
        num_blocks, block_size, device: each rank's KV cache.
        torch_threads: ``torch.set_num_threads`` in each worker.
        timeout_s: the longest a step (and each collective in it) may take before the group
            is declared broken; the start-up gets ``4 * timeout_s``.
        engine_model: ``EngineInfo.model``.
        kv_transfer_config: the connector's configuration as JSON, or ``None``.
        codec: the connector's codec (what its metadata and outputs are encoded with).

    Raises :class:`WorkerFailed` when a worker cannot start (its error is in the message);
    every started worker is stopped then.

    Threads: one thread (the engine's) calls every method; :attr:`broken` may be read from any
    thread (a server's health check): it is one reference, set once from ``None`` to a str.
    """

    def __init__(
        self,
        *,
        model: ModelConfig,
        tp_size: int,
        num_blocks: int,
        block_size: int,
        device: str,
        torch_threads: int,
        timeout_s: float,
        engine_model: str,
        kv_transfer_config: str | None,
        codec: Codec,
        kv_cache_order: str = "NHD",
    ) -> None:
        self.tp_size = tp_size
        self._codec = codec
        self._timeout = timeout_s
        self._broken: str | None = None
        self._aggregator = OutputAggregator(tp_size)
        self._dir = tempfile.mkdtemp(prefix="kvframe-tp-")
        self._procs: list[subprocess.Popen[bytes]] = []
        self._socks: list[socket.socket] = []
        self.handshake_metadata: dict[int, bytes] = {}
        """Rank → its connector worker's handshake metadata (ranks that returned ``None`` are
        absent), for ``set_xfer_handshake_metadata``."""
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the collectives stay on loopback
        try:
            for rank in range(tp_size):
                ours, theirs = socket.socketpair()
                self._socks.append(ours)
                with theirs:
                    self._procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "kvframe_refengine.tp_worker",
                             str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),),
                            env=env,
                            stdin=subprocess.DEVNULL,
                            # Libraries write to stdout (UCX, NIXL); the engine's stdout may
                            # be a pipe that a parent reads (a server's "ready" line).
                            stdout=2,
                        )
                    )  # fmt: skip
                send_frame(
                    ours,
                    WorkerInit(
                        rank=rank,
                        tp_size=tp_size,
                        model=model,
                        num_blocks=num_blocks,
                        block_size=block_size,
                        device=device,
                        torch_threads=torch_threads,
                        init_file=os.path.join(self._dir, "rendezvous"),
                        timeout_s=timeout_s,
                        engine_model=engine_model,
                        kv_transfer_config=kv_transfer_config,
                        kv_cache_order=kv_cache_order,
                    ),
                )
            for reply in self._gather(WorkerReady, "start", 4 * timeout_s):
                if reply.handshake_metadata is not None:
                    self.handshake_metadata[reply.rank] = reply.handshake_metadata
        except BaseException:
            self._kill()
            raise

    @property
    def broken(self) -> str | None:
        """Why the worker group stopped serving (``None`` while it serves)."""
        return self._broken

    def pids(self) -> list[int]:
        """The worker processes' ids, in rank order (for tests and operators)."""
        return [p.pid for p in self._procs]

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step on every rank and combine the replies: the greedy tokens (every rank
        samples the same logits: checked) and the ranks' connector outputs, aggregated.

        Raises :class:`WorkerFailed` when a rank raised (the group goes on), or when the group
        is broken (see the module docstring).
        """
        meta = batch.connector_metadata
        if isinstance(meta, ConnectorMetadata):
            meta = self._codec.encode(meta)
        order = StepOrder(
            step=batch.step,
            seqs=batch.seqs,
            connector_metadata=meta,
            finished_request_ids=batch.finished_request_ids,
        )
        replies = self._all(order, StepReply, f"step {batch.step}")
        errors = [f"rank {r.rank}: {r.error}" for r in replies if r.error is not None]
        if errors:
            if len(errors) < self.tp_size:
                # The others went on past the failing rank's collectives (or wait on them):
                # the ranks are out of step for good.
                self._break(f"step {batch.step} failed on some ranks only ({'; '.join(errors)})")
            raise WorkerFailed(f"step {batch.step} failed: {'; '.join(errors)}")
        sampled = dict(replies[0].sampled)
        for r in replies[1:]:
            if dict(r.sampled) != sampled:
                self._break(
                    f"step {batch.step}: rank {r.rank} sampled {dict(r.sampled)} but rank 0 "
                    f"sampled {sampled}; the shards disagree"
                )
        reported = [r for r in replies if r.connector_output is not None]
        for r in reported:
            assert r.connector_output is not None
            self._aggregator.add(r.rank, self._codec.decode_as(r.connector_output, ConnectorOutput))
        output = self._aggregator.take() if reported else None
        return StepResult(sampled=sampled, connector_output=output)

    def read_kv(self, block_ids: tuple[int, ...]) -> list[torch.Tensor]:
        """Each rank's KV of ``block_ids``, ``[layers, blocks, 2, block_size, kv_heads,
        head_dim]`` (float32, CPU), in rank order. Raises :class:`WorkerFailed` as
        :meth:`execute` does."""
        replies = self._all(ReadKV(block_ids=block_ids), KVData, "read_kv")
        return [
            torch.frombuffer(bytearray(r.data), dtype=torch.float32).reshape(r.shape)
            for r in replies
        ]

    def shutdown(self) -> None:
        """Ask every worker to shut its connector down and exit; kill those still running
        after a grace period. Safe to call twice; never raises."""
        if self._broken is None:
            self._broken = "the engine was shut down"
            for sock in self._socks:
                with contextlib.suppress(OSError):
                    send_frame(sock, Shutdown())
            end = time.monotonic() + 10.0
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, end - time.monotonic()))
        self._kill()

    # -- internals ---------------------------------------------------------------------------
    def _all(self, message: object, kind: type[_T], what: str) -> list[_T]:
        if self._broken is not None:
            raise WorkerFailed(f"the tensor-parallel workers are not serving: {self._broken}")
        for rank, sock in enumerate(self._socks):
            try:
                send_frame(sock, message)
            except OSError as exc:
                self._break(f"{what}: worker rank {rank} {self._how_gone(rank)} ({exc})")
        return self._gather(kind, what, self._timeout)

    def _how_gone(self, rank: int) -> str:
        # One wording whichever side sees a dead rank first: sending the order (broken pipe) or
        # reading the reply (end of stream).
        code = self._procs[rank].poll()
        return "stopped answering" if code is None else f"exited with status {code}"

    def _gather(self, kind: type[_T], what: str, timeout: float) -> list[_T]:
        # One reply per rank, waiting on all at once: a rank that dies is seen at once (its
        # socket closes) even while the others wait for it in a collective.
        replies: dict[int, _T] = {}
        deadline = time.monotonic() + timeout
        waiting = {sock: rank for rank, sock in enumerate(self._socks)}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                self._break(
                    f"{what}: rank(s) {sorted(waiting.values())} did not answer within "
                    f"{timeout:g} s"
                )
            ready, _, _ = select.select(list(waiting), [], [], left)
            for sock in ready:
                rank = waiting.pop(sock)
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    msg = recv_frame(sock)
                except (EOFError, OSError) as exc:
                    self._break(
                        f"{what}: worker rank {rank} {self._how_gone(rank)} "
                        f"({type(exc).__name__}: {exc})"
                    )
                except Exception as exc:  # a CodecError: the wire is not to be trusted
                    self._break(f"{what}: rank {rank} sent a malformed message ({exc})")
                if isinstance(msg, WorkerReady) and msg.error is not None:
                    if kind is WorkerReady:
                        self._break(f"worker rank {rank} could not start: {msg.error}")
                    self._break(f"{what}: worker rank {rank} failed: {msg.error}")
                if not isinstance(msg, kind):
                    self._break(
                        f"{what}: rank {rank} answered a {type(msg).__name__}, expected a "
                        f"{kind.__name__}"
                    )
                replies[rank] = msg
        return [replies[r] for r in range(self.tp_size)]

    def _break(self, reason: str) -> NoReturn:
        self._broken = reason
        self._kill()
        raise WorkerFailed(reason)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10.0)
        for sock in self._socks:
            sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
