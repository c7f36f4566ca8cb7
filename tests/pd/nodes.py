"""Client side of tests/pd/node.py: start an engine process, send it commands."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack

ROOT = Path(__file__).resolve().parents[2]
_LEN = struct.Struct(">I")


class Node:
    def __init__(
        self,
        engine_id: str,
        role: str,
        *,
        lease: float = 3.0,
        skew: float = 0.0,
        transport: str = "nixl",
        extra: dict[str, Any] | None = None,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Start the node. ``prefix`` goes before the interpreter on the command line (e.g.
        ``ip netns exec NAME`` to run it inside a network namespace); ``env`` adds to the
        environment (e.g. ``UCX_*`` settings)."""
        environ = {**os.environ, **(env or {})}
        environ["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "tests.pd.node",
                engine_id,
                role,
                str(lease),
                str(skew),
                transport,
                json.dumps(extra or {}),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=environ,
        )
        self.engine_id = engine_id
        hello = self._recv(timeout=60)
        assert hello.get("ready"), hello
        self.pid = int(hello["pid"])

    def _recv(self, timeout: float = 30) -> dict[str, Any]:
        assert self.proc.stdout is not None
        import select

        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        need = 4
        header_done = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"node {self.engine_id} did not answer")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, need - len(buf))
            if not chunk:
                raise EOFError(f"node {self.engine_id} exited (rc={self.proc.poll()})")
            buf += chunk
            if len(buf) == need:
                if header_done:
                    obj: dict[str, Any] = msgpack.unpackb(buf, raw=False)
                    return obj
                (need,) = _LEN.unpack(buf)
                buf = b""
                header_done = True

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        data = msgpack.packb({"op": op, **kw}, use_bin_type=True)
        self.proc.stdin.write(_LEN.pack(len(data)) + data)
        self.proc.stdin.flush()
        out = self._recv()
        if "error" in out:
            raise RuntimeError(f"{self.engine_id}: {out['error']}\n{out.get('tb', '')}")
        return out

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def wait(self, pred: Any, timeout: float = 20.0, interval: float = 0.02) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.engine_id}: condition not met; status {st}")
            time.sleep(interval)

    def dump_stacks(self) -> None:
        """Ask the node to print every thread's stack to its stderr (for one that stopped
        answering)."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGUSR1)

    def kill(self) -> float:
        os.kill(self.pid, signal.SIGKILL)
        t = time.monotonic()
        self.proc.wait(timeout=10)
        return t

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit")
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
