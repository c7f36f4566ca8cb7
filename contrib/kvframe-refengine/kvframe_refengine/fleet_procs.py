"""A fleet on one host, for ``kvframe demo --fleet`` and ``kvframe bench fleet``: a real etcd
on loopback, prefill and decode engine servers registered in it (``--discovery``), and a
router that finds them there.

:class:`LocalEtcd` runs the ``etcd`` binary (Debian's ``etcd-server`` package; ``./dev``
installs it) on free loopback ports with a data directory of its own. :class:`LocalFleet`
starts the engines, each its own process in :class:`~kvframe.runtime.procs.ChildProcesses`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvframe.errors import ConfigError
from kvframe.runtime.procs import ChildProcesses
from kvframe_refengine.demo import _free_port, _get, _Proc

__all__ = ["LocalEtcd", "LocalFleet", "etcd_binary"]


def etcd_binary() -> str:
    """The ``etcd`` executable; raises :class:`~kvframe.errors.ConfigError` saying how to
    install it when there is none."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise ConfigError(
            "etcd is not installed: the fleet runs on a real etcd started on loopback. Install "
            "etcd >= 3.4 on PATH (Debian/Ubuntu: apt-get install etcd-server; ./dev test does)"
        )
    return path


class LocalEtcd:
    """One etcd member on ``127.0.0.1`` (:attr:`endpoint`), data under ``data_dir``.

    :param children: where the process is registered (stopped with the rest on a signal);
        ``None`` starts it with plain :class:`subprocess.Popen` (the etcd tests do).
    :param name: the member's name.
    :param log: a file etcd's output is appended to (errors only); ``None`` discards it.

    It can be stopped (:meth:`stop`, any signal) and started again on the same ports and data:
    the tests use that to restart etcd under its clients.
    """

    def __init__(
        self,
        data_dir: Path,
        children: ChildProcesses | None = None,
        *,
        name: str = "kvframe-fleet",
        log: Path | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        self._children = children
        self._name = name
        self._log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start etcd and wait until it answers ``/health``; :class:`RuntimeError` when it
        exits first or is not healthy within ``timeout`` seconds."""
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            etcd_binary(),
            f"--name={self._name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self._name}={peer}",
            "--logger=zap",
            "--log-level=error",
        ]
        with contextlib.ExitStack() as stack:
            out: Any = subprocess.DEVNULL
            if self._log is not None:
                out = stack.enter_context(open(self._log, "ab"))
            popen = subprocess.Popen if self._children is None else self._children.popen
            self.proc = popen(args, stdout=out, stderr=subprocess.STDOUT)
        where = "" if self._log is None else f"; see {self._log}"
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with status {self.proc.returncode}{where}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd was not healthy within {timeout:g} s{where}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        """Whether etcd answers ``/health`` with ``true`` within a second."""
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError, http.client.HTTPException):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` and wait for the process (up to 20 s, then SIGKILL); a no-op when it is
        not running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class LocalFleet:
    """``num_prefill`` P and ``num_decode`` D engine servers registered in ``etcd`` under a
    prefix of their own (:attr:`discovery`), and optionally a router process.

    :param ttl: the registrations' etcd lease TTL (seconds, whole, >= 2).
    :param server_args: more ``kvframe_refengine.server`` options for every engine.
    """

    def __init__(
        self,
        children: ChildProcesses,
        etcd: LocalEtcd,
        log: Callable[[str], None],
        *,
        num_prefill: int,
        num_decode: int,
        ttl: int = 2,
        prefix: str = "/kvframe-fleet/",
        server_args: list[str] | None = None,
    ) -> None:
        host = etcd.endpoint.removeprefix("http://")
        self.discovery = f"etcd://{host}{prefix}?ttl={ttl}&watch_timeout=2"
        self.ttl = ttl
        self._children = children
        self._log = log
        self.engines: dict[str, tuple[_Proc, str]] = {}
        """engine id → (its process, its base URL)."""
        self.roles: dict[str, str] = {}
        self.router: tuple[_Proc, str] | None = None
        for role, n in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(n):
                eid = f"fleet-{role[0].upper()}{i}"
                port = _free_port()
                args = [
                    "kvframe_refengine.server",
                    "--port",
                    str(port),
                    "--engine-id",
                    eid,
                    "--role",
                    "kv_producer" if role == "prefill" else "kv_consumer",
                    "--discovery",
                    self.discovery,
                    *(server_args or []),
                ]
                proc = _Proc(f"{role} engine {eid}", args, log, children)
                self.engines[eid] = (proc, f"http://127.0.0.1:{port}")
                self.roles[eid] = role

    def start_router(self, *args: str) -> str:
        """Start a router process on the fleet (``--discovery``, plus ``args``); returns its
        base URL."""
        port = _free_port()
        proc = _Proc(
            "router",
            ["kvframe_refengine.router", "--port", str(port), "--discovery", self.discovery, *args],
            self._log,
            self._children,
        )
        self.router = (proc, f"http://127.0.0.1:{port}")
        return self.router[1]

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Every process answered ready (engines registered)."""
        procs = [p for p, _ in self.engines.values()]
        if self.router is not None:
            procs.append(self.router[0])
        for p in procs:
            p.wait_ready(timeout)

    def router_health(self) -> dict[str, Any]:
        assert self.router is not None
        return _get(f"{self.router[1]}/health")

    def routed_engines(self) -> set[str]:
        """The engines the router routes to now (live and not found dead)."""
        fleet = self.router_health().get("fleet", {})
        return {e["engine_id"] for e in fleet.get("engines", []) if not e["down"]}

    def listed_engines(self) -> set[str]:
        """The engines in the router's fleet (discovery's view: found dead or not)."""
        fleet = self.router_health().get("fleet", {})
        return {e["engine_id"] for e in fleet.get("engines", [])}

    def pids(self) -> str:
        out = [f"{eid} {p.proc.pid}" for eid, (p, _) in self.engines.items()]
        if self.router is not None:
            out.append(f"router {self.router[0].proc.pid}")
        return ", ".join(out)

    def stop(self) -> None:
        procs = [p for p, _ in self.engines.values()]
        if self.router is not None:
            procs.insert(0, self.router[0])
        for p in procs:
            p.stop()
