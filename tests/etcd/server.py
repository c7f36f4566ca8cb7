"""A real etcd server on loopback for the tests, and a TCP proxy that can partition a client.

:class:`EtcdServer` runs the ``etcd`` binary (Debian's ``etcd-server``; ``./dev test`` installs
it) on free loopback ports with a data directory of its own, through the fleet demo's
:class:`~kvframe_refengine.fleet_procs.LocalEtcd`; it can be stopped, killed and started again
on the same ports and data.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

from kvframe_refengine.fleet_procs import LocalEtcd


class EtcdServer(LocalEtcd):
    """One etcd member on ``127.0.0.1`` (the fleet demo's :class:`LocalEtcd`), its output
    appended to ``<data_dir>.log``; :attr:`endpoint` is its client URL."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir, name="kvframe-test", log=data_dir.with_suffix(".log"))

    def start(self, timeout: float = 20.0) -> None:
        super().start(timeout)


class Proxy:
    """A loopback TCP forwarder to ``port``: :meth:`cut` drops every connection and refuses
    new ones (a partition of the clients using it), :meth:`restore` lets them through."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._srv.getsockname()[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._open = True
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            with self._lock:
                if not self._open:
                    client.close()
                    continue
                try:
                    upstream = socket.create_connection(("127.0.0.1", self._target), timeout=2)
                except OSError:
                    client.close()
                    continue
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            self._open = False
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        with self._lock:
            self._open = True

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._srv.close()
