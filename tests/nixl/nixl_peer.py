"""The other endpoint of the cross-process NIXL tests: a child process hosting a NixlTransport.

Run as ``python nixl_peer.py REPLY_FD NAME SPEC_JSON``. It reads msgpack commands (maps with an
``"op"`` key) from stdin and writes one msgpack reply per command to ``REPLY_FD`` (not stdout:
NIXL's logger may write there). Between commands it drives progress every 0.5 ms, as the
transport's progress rule asks (``pump_interval`` in the spec sets another pace), and keeps
received notifications until ``drain``.

The helpers :func:`encode_layout`, :func:`decode_layout` and :func:`region_bytes` are shared
with the tests (imported from ``conftest.py``). Nothing here is pickled.
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

__all__ = ["decode_layout", "encode_layout", "region_bytes"]


def encode_layout(layout: Any) -> dict[str, Any]:
    """A BlockLayout as a msgpack-able map."""
    return {
        "regions": [[r.addr, r.length, r.kind.value, r.device_id] for r in layout.regions],
        "block_lens": list(layout.block_lens),
        "num_blocks": layout.num_blocks,
    }


def decode_layout(data: dict[str, Any]) -> Any:
    """The inverse of :func:`encode_layout`."""
    from kvframe.spi.transport import BlockLayout, MemoryKind, MemoryRegion

    regions = [
        MemoryRegion(addr=a, length=n, kind=MemoryKind(k), device_id=d)
        for a, n, k, d in data["regions"]
    ]
    return BlockLayout(
        regions=regions, block_lens=data["block_lens"], num_blocks=data["num_blocks"]
    )


def region_bytes(seed: int, region: int, nbytes: int) -> np.ndarray[Any, Any]:
    """The deterministic content a peer fills region ``region`` with."""
    return np.random.default_rng([seed, region]).integers(0, 256, nbytes, dtype=np.uint8)


def _main() -> None:
    reply_fd, name, spec = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    os.dup2(2, 1)  # keep stray library output off any pipe the parent reads
    from kvframe_nixl import NixlTransport

    from kvframe.spi.transport import BlockLayout, MemoryRegion, Op, TransportParams, XferState

    block_lens: list[int] = spec["block_lens"]
    num_blocks: int = spec["num_blocks"]
    bufs = [region_bytes(spec["seed"], r, b * num_blocks) for r, b in enumerate(block_lens)]
    t = NixlTransport.create(TransportParams(name=name, options=spec.get("options", {})))
    regions = [MemoryRegion(addr=b.ctypes.data, length=b.nbytes) for b in bufs]
    t.register_memory(regions)
    layout = BlockLayout(regions=regions, block_lens=block_lens, num_blocks=num_blocks)
    local = t.prepare_local(layout)
    remotes: dict[str, Any] = {}
    inbox: list[list[Any]] = []
    out = os.fdopen(reply_fd, "wb", buffering=0)
    stdin = 0  # the parent's command pipe; read unbuffered so select() sees every byte
    unpacker = msgpack.Unpacker(raw=False)

    def reply(value: Any) -> None:
        out.write(msgpack.packb(value, use_bin_type=True))

    def pump() -> None:
        inbox.extend([n.sender, n.payload] for n in t.drain_notifications())

    def wait_for(payload: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pump()
            for i, (_, p) in enumerate(inbox):
                if p == payload:
                    del inbox[i]
                    return True
        return False

    def blocks_of(region: int, blocks: list[int]) -> bytes:
        blen = block_lens[region]
        view = bufs[region].reshape(num_blocks, blen)
        return b"".join(view[b].tobytes() for b in blocks)

    reply({"meta": t.local_metadata(), "layout": encode_layout(layout), "pid": os.getpid()})
    interval = float(spec.get("pump_interval", 0.0005))  # a slow engine's step pace
    while True:
        ready, _, _ = select.select([stdin], [], [], interval)
        pump()
        if not ready:
            continue
        data = os.read(stdin, 1 << 20)
        if not data:
            break
        unpacker.feed(data)
        for cmd in unpacker:
            op = cmd["op"]
            try:
                if op == "add_peer":
                    reply(t.add_peer(cmd["meta"]))
                elif op == "remove_peer":
                    t.remove_peer(cmd["peer"])
                    remotes.pop(cmd["peer"], None)
                    reply(None)
                elif op == "prepare_remote":
                    remotes[cmd["peer"]] = t.prepare_remote(
                        cmd["peer"], decode_layout(cmd["layout"])
                    )
                    reply(None)
                elif op == "get":
                    reply(bufs[cmd["region"]].tobytes())
                elif op == "set":
                    bufs[cmd["region"]][:] = np.frombuffer(cmd["data"], dtype=np.uint8)
                    reply(None)
                elif op == "notify":
                    t.send_notification(cmd["peer"], cmd["payload"])
                    reply(None)
                elif op == "drain":
                    pump()
                    reply(inbox[:])
                    inbox.clear()
                elif op == "snapshot_on_notification":
                    # Copy the named blocks the moment the notification is seen.
                    ok = wait_for(cmd["payload"], cmd["timeout"])
                    reply([ok, blocks_of(cmd["region"], cmd["blocks"])])
                elif op == "overwrite_on_notification":
                    # Reuse the blocks the moment the notification says the peer is done.
                    ok = wait_for(cmd["payload"], cmd["timeout"])
                    blen = block_lens[cmd["region"]]
                    view = bufs[cmd["region"]].reshape(num_blocks, blen)
                    for b in cmd["blocks"]:
                        view[b] = 0xEE
                    reply(ok)
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
