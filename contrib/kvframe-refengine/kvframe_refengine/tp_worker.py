"""One tensor-parallel worker process of the reference engine (started by
:class:`~kvframe_refengine.tp.TPWorkers`, never by hand)::

    python -m kvframe_refengine.tp_worker FD

``FD`` is this worker's end of the engine's socketpair. The worker reads a
:class:`~kvframe_refengine.tp.WorkerInit`, joins the gloo group (``file://`` rendezvous),
builds its model shard, its KV cache and its connector worker half (from its own
:class:`~kvframe.runtime.plugins.PluginHost`: entry points and built-ins), answers
:class:`~kvframe_refengine.tp.WorkerReady`, then serves steps with a
:class:`~kvframe_refengine.runner.ModelRunner` until :class:`~kvframe_refengine.tp.Shutdown` or
until the engine's end of the socket closes (the engine died): then it shuts its connector
down and exits.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import sys
import traceback

# torch before anything that may load NIXL (docs: FACTS, "torch must be imported first").
import torch
import torch.distributed as dist

from kvframe.config import KVTransferConfig
from kvframe.protocol.codec import DEFAULT_CODEC, Codec
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext, EngineInfo, KVConnectorWorker, codec_for
from kvframe_refengine.model import TinyLM, TPShard
from kvframe_refengine.runner import ModelRunner
from kvframe_refengine.scheduler import ScheduledBatch
from kvframe_refengine.tp import (
    KVData,
    ReadKV,
    Shutdown,
    StepOrder,
    StepReply,
    WorkerInit,
    WorkerReady,
    recv_frame,
    send_frame,
)

__all__ = ["main"]


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def _build_connector(init: WorkerInit) -> tuple[KVConnectorWorker | None, Codec]:
    if init.kv_transfer_config is None:
        return None, DEFAULT_CODEC
    kv = KVTransferConfig.from_json(init.kv_transfer_config)
    host = PluginHost()
    host.load()
    ctx = BuildContext(host=host)
    cls = host.connector(kv.kv_connector)
    info = EngineInfo(
        block_size=init.block_size,
        world_size=init.tp_size,
        model=init.engine_model,
        num_kv_heads=init.model.num_kv_heads,
        kv_cache_order=init.kv_cache_order,
    )
    return cls.build_worker(kv, info, init.rank, ctx), codec_for(cls, kv)


def _serve(sock: socket.socket, init: WorkerInit) -> None:
    torch.set_num_threads(init.torch_threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init.init_file}",
        rank=init.rank,
        world_size=init.tp_size,
        timeout=datetime.timedelta(seconds=init.timeout_s),
    )
    connector: KVConnectorWorker | None = None
    try:
        model = TinyLM(
            init.model,
            device=init.device,
            shard=TPShard(rank=init.rank, size=init.tp_size),
            all_reduce=_all_reduce,
        )
        connector, codec = _build_connector(init)
        runner = ModelRunner(
            model,
            num_blocks=init.num_blocks,
            block_size=init.block_size,
            kv_cache_order=init.kv_cache_order,
            connector=connector,
            decode_metadata=lambda sent: codec.decode_as(sent, ConnectorMetadata),
            encode_output=lambda out: out,
        )
        blob = connector.get_handshake_metadata() if connector is not None else None
        send_frame(sock, WorkerReady(rank=init.rank, handshake_metadata=blob))
        while True:
            try:
                msg = recv_frame(sock)
            except EOFError:
                return  # the engine is gone
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, ReadKV):
                ids = torch.tensor(msg.block_ids, dtype=torch.long)
                kv = torch.stack([c[ids].cpu() for c in runner.kv_caches])
                send_frame(
                    sock,
                    KVData(rank=init.rank, shape=tuple(kv.shape), data=kv.numpy().tobytes()),
                )
                continue
            if not isinstance(msg, StepOrder):
                raise TypeError(f"unexpected message {type(msg).__name__} from the engine")
            batch = ScheduledBatch(
                step=msg.step,
                seqs=msg.seqs,
                connector_metadata=msg.connector_metadata,
                finished_request_ids=msg.finished_request_ids,
            )
            try:
                result = runner.execute(batch)
            except Exception as exc:
                traceback.print_exc()
                send_frame(
                    sock,
                    StepReply(
                        rank=init.rank,
                        sampled={},
                        connector_output=None,
                        error=f"{type(exc).__name__}: {exc}",
                    ),
                )
                continue
            out: ConnectorOutput | None = result.connector_output
            send_frame(
                sock,
                StepReply(
                    rank=init.rank,
                    sampled=dict(result.sampled),
                    connector_output=None if out is None else codec.encode(out),
                ),
            )
    finally:
        if connector is not None:
            connector.shutdown()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Serve one rank on the socket whose file descriptor is ``argv[0]``."""
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    init = recv_frame(sock)
    if not isinstance(init, WorkerInit):
        return 2
    try:
        _serve(sock, init)
    except Exception as exc:
        traceback.print_exc()
        with contextlib.suppress(OSError):
            send_frame(
                sock,
                WorkerReady(
                    rank=init.rank, handshake_metadata=None, error=f"{type(exc).__name__}: {exc}"
                ),
            )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
