"""The other endpoint of the cross-process UCX tests: a child process hosting a UcxTransport.

Run as ``python ucx_peer.py REPLY_FD NAME SPEC_JSON``. It reads msgpack commands (maps with an
``"op"`` key) from stdin and writes one msgpack reply per command to ``REPLY_FD`` (UCX may write
warnings to stdout/stderr). Between commands it drives progress every 0.5 ms, as the transport's
progress rule asks (the parent's READs are served from here), and keeps received notifications
until ``drain``. Nothing here is pickled.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any

import msgpack
import numpy as np

__all__ = ["region_bytes"]


def region_bytes(seed: int, region: int, nbytes: int) -> np.ndarray[Any, Any]:
    """The deterministic content a peer fills region ``region`` with."""
    return np.random.default_rng([seed, region]).integers(0, 256, nbytes, dtype=np.uint8)


def _main() -> None:
    reply_fd, name, spec = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    os.dup2(2, 1)
    from kvframe_ucx import UcxTransport

    from kvframe.spi.transport import BlockLayout, MemoryRegion, Op, TransportParams, XferState

    block_lens: list[int] = spec["block_lens"]
    num_blocks: int = spec["num_blocks"]
    bufs = [region_bytes(spec["seed"], r, b * num_blocks) for r, b in enumerate(block_lens)]
    t = UcxTransport.create(TransportParams(name=name, options=spec.get("options", {})))
    regions = [MemoryRegion(addr=b.ctypes.data, length=b.nbytes) for b in bufs]
    t.register_memory(regions)
    layout = BlockLayout(regions=regions, block_lens=block_lens, num_blocks=num_blocks)
    local = t.prepare_local(layout)
    remotes: dict[str, Any] = {}
    inbox: list[list[Any]] = []
    out = os.fdopen(reply_fd, "wb", buffering=0)
    unpacker = msgpack.Unpacker(raw=False)

    def reply(value: Any) -> None:
        out.write(msgpack.packb(value, use_bin_type=True))

    def pump() -> None:
        inbox.extend([n.sender, n.payload] for n in t.drain_notifications())

    reply(
        {
            "meta": t.local_metadata(),
            "regions": [[r.addr, r.length] for r in regions],
            "pid": os.getpid(),
        }
    )
    while True:
        ready, _, _ = select.select([0], [], [], 0.0005)
        pump()
        if not ready:
            continue
        data = os.read(0, 1 << 20)
        if not data:
            break
        unpacker.feed(data)
        for cmd in unpacker:
            op = cmd["op"]
            try:
                if op == "add_peer":
                    reply(t.add_peer(cmd["meta"]))
                elif op == "prepare_remote":
                    lay = cmd["layout"]
                    remotes[cmd["peer"]] = t.prepare_remote(
                        cmd["peer"],
                        BlockLayout(
                            regions=[MemoryRegion(addr=a, length=n) for a, n in lay["regions"]],
                            block_lens=lay["block_lens"],
                            num_blocks=lay["num_blocks"],
                        ),
                    )
                    reply(None)
                elif op == "get":
                    reply(bufs[cmd["region"]].tobytes())
                elif op == "notify":
                    t.send_notification(cmd["peer"], cmd["payload"])
                    reply(None)
                elif op == "drain":
                    pump()
                    reply(inbox[:])
                    inbox.clear()
                elif op == "post":
                    h = t.post(
                        Op(cmd["kind"]),
                        local,
                        cmd["local"],
                        remotes[cmd["peer"]],
                        cmd["remote"],
                        regions=cmd.get("regions"),
                        notification=cmd.get("notification"),
                    )
                    deadline = time.monotonic() + 10
                    while t.poll(h).state is XferState.PENDING and time.monotonic() < deadline:
                        pump()
                    status = t.poll(h)
                    t.release(h)
                    err = status.error
                    reply([status.state.value, type(err).__name__ if err else None])
                elif op == "stats":
                    reply(dict(t.stats()))
                elif op == "exit":
                    t.close()
                    reply(None)
                    return
                else:
                    reply({"error": f"unknown op {op!r}"})
            except Exception as exc:
                reply({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    _main()
