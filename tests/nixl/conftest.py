"""Fixtures for the NIXL transport tests: real NIXL endpoints in two processes on loopback.

A :class:`Peer` is a child process running ``nixl_peer.py`` (one NixlTransport, its own memory);
the test process hosts the other endpoint. Child processes are module-scoped and shared, since
creating a NIXL agent costs about 0.4 s; the tests that kill a peer start their own.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL tests need nixl-cu12 (./dev installs it)")
pytest.importorskip("kvframe_nixl", reason="install plugins/kvframe-nixl (./dev does)")

from kvframe_nixl import NixlTransport
from nixl_peer import decode_layout, region_bytes

from kvframe.spi.transport import BlockLayout, MemoryRegion, TransportParams, XferState

PEER_SCRIPT = Path(__file__).with_name("nixl_peer.py")

#: The test layout: three regions (think K, V and a layer with another block size).
BLOCK_LENS = (4096, 8192, 1024)
NUM_BLOCKS = 48


class Peer:
    """A child process hosting the other endpoint; call its ops with :meth:`call`."""

    def __init__(
        self,
        name: str,
        *,
        seed: int = 1,
        block_lens: tuple[int, ...] = BLOCK_LENS,
        num_blocks: int = NUM_BLOCKS,
        options: dict[str, Any] | None = None,
        prefix: Sequence[str] = (),
        pump_interval: float = 0.0005,
    ) -> None:
        """Start the child; ``prefix`` goes before the interpreter on its command line (for
        example ``ip netns exec NAME`` to run it inside a network namespace); the child drives
        its progress every ``pump_interval`` seconds between commands."""
        self.name = name
        self.seed = seed
        self.block_lens = block_lens
        self.num_blocks = num_blocks
        spec = {
            "block_lens": list(block_lens),
            "num_blocks": num_blocks,
            "seed": seed,
            "options": options or {},
            "pump_interval": pump_interval,
        }
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(PEER_SCRIPT), str(w), name, json.dumps(spec)],
            stdin=subprocess.PIPE,
            pass_fds=[w],
        )
        os.close(w)
        self._fd = r
        self._killing = threading.Lock()
        self._unpacker = msgpack.Unpacker(raw=False)
        hello = self._read(30.0, None)
        self.meta: bytes = hello["meta"]
        self.layout: BlockLayout = decode_layout(hello["layout"])
        self.pid: int = hello["pid"]

    def expected(self, region: int) -> np.ndarray[Any, Any]:
        """The content the child filled region ``region`` with at start."""
        return region_bytes(self.seed, region, self.block_lens[region] * self.num_blocks)

    def send(self, op: str, **kw: Any) -> None:
        """Send a command without waiting for its reply (see :meth:`result`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgpack.packb({"op": op, **kw}, use_bin_type=True))
        self.proc.stdin.flush()

    def result(self, drive: NixlTransport | None = None, timeout: float = 15.0) -> Any:
        """Wait for the next reply, driving ``drive``'s progress meanwhile (a passive NIXL
        endpoint must be polled while its peer connects)."""
        value = self._read(timeout, drive)
        if isinstance(value, dict) and "error" in value:
            raise AssertionError(f"peer {self.name} failed: {value['error']}")
        return value

    def call(self, op: str, drive: NixlTransport | None = None, **kw: Any) -> Any:
        """Send a command and return its reply."""
        self.send(op, **kw)
        return self.result(drive)

    def _read(self, timeout: float, drive: NixlTransport | None) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            for value in self._unpacker:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"peer {self.name} did not answer within {timeout} s")
            if self.proc.poll() is not None:
                raise AssertionError(f"peer {self.name} exited with {self.proc.returncode}")
            ready, _, _ = select.select([self._fd], [], [], 0.0005)
            if drive is not None:
                drive.progress()
            if ready:
                self._unpacker.feed(os.read(self._fd, 1 << 22))

    def kill(self) -> None:
        """SIGKILL the child, reap it and close the pipes (idempotent, and safe to call from a
        timer thread while the test's thread calls it too: each pipe is closed once)."""
        with self._killing:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self._close_pipes()

    def stop(self) -> None:
        """Ask the child to close its transport and exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call("exit")
                self.proc.wait(5)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def _close_pipes(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class Local:
    """The test process's endpoint: a NixlTransport with its own registered regions."""

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        self.bufs = [np.zeros(b * NUM_BLOCKS, dtype=np.uint8) for b in BLOCK_LENS]
        self.t = NixlTransport.create(TransportParams(name=name, options=options or {}))
        regions = [MemoryRegion(addr=b.ctypes.data, length=b.nbytes) for b in self.bufs]
        self.t.register_memory(regions)
        self.layout = BlockLayout(regions=regions, block_lens=BLOCK_LENS, num_blocks=NUM_BLOCKS)
        self.local = self.t.prepare_local(self.layout)
        self.keep: list[Any] = []  # more memory tests register; alive until close

    def view(self, region: int) -> np.ndarray[Any, Any]:
        """Region ``region`` as a (num_blocks, block_len) array."""
        return self.bufs[region].reshape(NUM_BLOCKS, BLOCK_LENS[region])

    def connect(self, peer: Peer) -> Any:
        """Handshake both ways; returns the prepared remote layout of ``peer``."""
        name = self.t.add_peer(peer.meta)
        assert name == peer.name
        peer.call("add_peer", drive=self.t, meta=self.t.local_metadata())
        from nixl_peer import encode_layout

        peer.call(
            "prepare_remote", drive=self.t, peer=self.t.name, layout=encode_layout(self.layout)
        )
        return self.t.prepare_remote(peer.name, peer.layout)


@pytest.fixture(scope="module", params=[False, True], ids=["inline", "post_thread"])
def local(request: pytest.FixtureRequest) -> Iterator[Local]:
    """This process's endpoint, once with posting inline and once from the post worker."""
    mode = "t" if request.param else "i"
    # With the worker on, send every request to it (the default posts small ones inline).
    options = (
        # The worker's endpoint also merges adjacent blocks, so every transfer test runs
        # both NIXL paths (prepared lists, merged runs).
        {"post_thread": True, "inline_post_bytes": 0, "merge_runs": True}
        if request.param
        else {"post_thread": False}
    )
    end = Local(f"D-{mode}-{os.getpid()}", options)
    yield end
    end.t.close()


@pytest.fixture(scope="module")
def peer(local: Local) -> Iterator[tuple[Peer, Any]]:
    """A shared child endpoint connected both ways to :func:`local`; yields (peer, remote
    layout handle)."""
    p = Peer(f"P-{local.t.name}")
    remote = local.connect(p)
    yield p, remote
    p.stop()


def settle(t: NixlTransport, h: Any, timeout: float = 10.0) -> XferState:
    """Poll ``h`` on ``t`` (driving ``t``'s progress) until it is no longer pending, at most
    ``timeout`` seconds; its last state."""
    deadline = time.monotonic() + timeout
    while (state := t.poll(h).state) is XferState.PENDING and time.monotonic() < deadline:
        t.progress()
    return state
