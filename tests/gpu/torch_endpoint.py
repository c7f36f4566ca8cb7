"""Conformance-kit endpoints whose buffers are torch tensors on a device (``cuda:0`` or ``cpu``).

kvframe's conformance kit (:mod:`kvframe.testing`) allocates its buffers with numpy, in host
memory. The GPU check runs the same kit with every buffer a torch tensor on the device named by
``KVFRAME_KIT_DEVICE`` (default ``cpu``): on a CUDA device the regions are ``DEVICE`` memory
(NIXL ``VRAM``), so every kit test moves and compares bytes in device memory; with ``cpu`` they
are host tensors, which is how the CPU dry run exercises this file.

How it plugs in without changing the kit: :func:`install` points the two names
``kvframe.testing.pair.make_pair`` builds endpoints with (``LocalEndpoint`` and
``ChildEndpoint``) at the classes below, for one test (pytest's ``monkeypatch``); the child
endpoint runs this file as a script, which points the kit's child server at
:class:`TorchEndpoint` in that (dedicated) process and serves. A ``memory`` option in the kit's
``make_pair`` would make both unnecessary.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from kvframe.spi.transport import MemoryRegion, Transport
from kvframe.testing import endpoint as kit_endpoint
from kvframe.testing import pair as kit_pair
from kvframe.testing.endpoint import ChildEndpoint, LocalEndpoint, TransportSpec

DEVICE_ENV = "KVFRAME_KIT_DEVICE"


def kit_device() -> str:
    """The device the kit's buffers live on (``KVFRAME_KIT_DEVICE``, default ``cpu``)."""
    return os.environ.get(DEVICE_ENV, "cpu")


class TorchEndpoint(LocalEndpoint):
    """A :class:`LocalEndpoint` whose buffers are uint8 tensors on :func:`kit_device`."""

    def __init__(self, transport: Transport) -> None:
        super().__init__(transport)
        self.device = torch.device(kit_device())
        self._tensors: list[torch.Tensor] = []

    def alloc(self, nbytes: int) -> MemoryRegion:
        if nbytes <= 0:
            raise ValueError(f"alloc({nbytes}): give a positive size")
        t = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._sync()
        self._tensors.append(t)
        return MemoryRegion.from_tensor(t)  # DEVICE memory for a CUDA tensor

    def _view(self, addr: int, length: int) -> torch.Tensor:
        for t in self._tensors:
            start = int(t.data_ptr())
            if start <= addr and addr + length <= start + t.numel():
                return t[addr - start : addr - start + length]
        raise ValueError(f"[{addr:#x}, +{length}) is not inside a buffer of endpoint {self.name}")

    def _owns(self, addr: int, length: int) -> bool:
        try:
            self._view(addr, length)
        except ValueError:
            return False
        return True

    def digest_range(self, addr: int, length: int) -> str:
        return hashlib.sha256(self.read(addr, length)).hexdigest()

    def invert_range(self, addr: int, length: int) -> None:
        self._view(addr, length).bitwise_not_()
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def write(self, addr: int, data: bytes) -> None:
        view = self._view(addr, len(data))
        if data:
            view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self._sync()

    def read(self, addr: int, length: int) -> bytes:
        self._sync()  # a transfer seen DONE must be visible to a read through the device
        view = self._view(addr, length)
        return bytes(view.cpu().numpy().tobytes())

    def shutdown(self) -> None:
        super().shutdown()
        self._tensors.clear()


class TorchChildEndpoint(ChildEndpoint):
    """A :class:`ChildEndpoint` whose child runs this file, so its buffers are tensors too."""

    @classmethod
    def start(
        cls,
        spec: TransportSpec,
        endpoint_name: str,
        *,
        timeout: float = 30.0,
        pump: Any = None,
        env: Mapping[str, str] | None = None,
    ) -> TorchChildEndpoint:
        wire_spec = spec.for_child().to_wire()
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, __file__, str(child_sock.fileno())],
                pass_fds=[child_sock.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno(),
                env={**os.environ, **(env or {})},
            )
        finally:
            child_sock.close()
        ep = cls(proc, parent_sock, timeout=timeout, pump=pump)
        try:
            ep.create(wire_spec, endpoint_name)
        except BaseException:
            ep.kill()
            raise
        return ep


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the kit's ``make_pair`` build tensor endpoints for the current test."""
    monkeypatch.setattr(kit_pair, "LocalEndpoint", TorchEndpoint)
    monkeypatch.setattr(kit_pair, "ChildEndpoint", TorchChildEndpoint)


if __name__ == "__main__":
    # A child endpoint: this process exists only to serve the kit, so the server's endpoint
    # class is replaced for the whole process.
    kit_endpoint.LocalEndpoint = TorchEndpoint  # type: ignore[misc]
    kit_endpoint.serve_child(int(sys.argv[1]))
