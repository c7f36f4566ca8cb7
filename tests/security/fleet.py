"""P and D as reference-engine server processes over NIXL, a router in the test process, a
single-engine reference, and the HTTP calls the tests make (as any client could)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
from kvframe_refengine import router as router_mod
from kvframe_refengine.router import post_json
from kvframe_refengine.tokenizer import encode

ROOT = Path(__file__).resolve().parents[2]

#: Lease duration of the fleet (s): short, so that leases the attacks leave behind expire
#: within a test.
LEASE = 3.0
MAX_TOKENS = 8

#: Counters (P's and D's ``/stats``: the connector worker's, its scheduler half's, the
#: engine's) whose names say an input was refused, dropped or failed authentication. The
#: keyed tests require that an attack moves at least one of them: it was counted.
REFUSAL = re.compile(
    r"\.(handshakes_refused|handshakes_rate_limited|notifications_unauthenticated"
    r"|notifications_rejected|bad_params|requests_refused)$"
)


def prompt(text: str) -> list[int]:
    return encode(text)


#: Two prompts of the same length (and so the same number of blocks) with different text.
VICTIM = prompt("The victim asks about disaggregated serving and leases, politely. " * 2)
OTHER = prompt("An attacker prompt of exactly the same length, but other words!!! " * 2)
assert len(VICTIM) == len(OTHER)
#: The prompt whose KV the attacker overwrites without a key (P's prefix cache keeps it).
POISONED = prompt("A prompt whose KV an unauthenticated attacker overwrites on P.")
#: What a real client keeps asking (during the flood, and after the attacks).
CLIENT = prompt("A real client keeps asking during the flood.")


def write_key_file(path: Path, key_id: str = "k1") -> Path:
    """A fleet key file (``KEY_ID SECRET_HEX``, docs/security.md)."""
    path.write_text(f"# fleet key\n{key_id} {secrets.token_hex(32)}\n")
    path.chmod(0o600)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcess:
    """``python -m kvframe_refengine.server`` in its own process."""

    def __init__(
        self, engine_id: str, role: str, *, key_file: Path | None, log_dir: Path, **kw: Any
    ) -> None:
        self.engine_id = engine_id
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable, "-m", "kvframe_refengine.server", "--port", str(self.port),
            "--engine-id", engine_id, "--role", role, "--transport", "nixl",
            "--lease", str(LEASE),
        ]  # fmt: skip
        for k, v in kw.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        if key_file is not None:
            args += ["--auth-key-file", str(key_file)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.log = log_dir / f"{engine_id}.log"
        self._err = self.log.open("w")
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self._err, text=True, cwd=ROOT, env=env
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.engine_id} exited with status {self.proc.returncode}:\n"
                    + self.log.read_text()[-3000:]
                )
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready and '"ready": true' in self.proc.stdout.readline():
                return
        raise RuntimeError(f"{self.engine_id} did not start within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


def get(url: str, timeout: float = 30.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def counters(url: str) -> dict[str, float]:
    """Every counter of an engine's ``/stats``, flattened (``connector.NAME``,
    ``connector_scheduler.NAME``, ``engine.NAME``)."""
    st = get(f"{url}/stats")
    out: dict[str, float] = {}
    for part in ("connector", "connector_scheduler"):
        for k, v in st.get(part, {}).get("counters", {}).items():
            out[f"{part}.{k}"] = float(v)
    for k, v in st.get("engine", {}).items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[f"engine.{k}"] = float(v)
    return out


def gauges(url: str) -> dict[str, float]:
    st = get(f"{url}/stats")
    return {k: float(v) for k, v in st.get("connector", {}).get("gauges", {}).items()}


def refusals(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """The refusal counters (:data:`REFUSAL`) that moved between two :func:`counters`."""
    return {
        k: after[k] - before.get(k, 0.0)
        for k in after
        if REFUSAL.search(k) and after[k] > before.get(k, 0.0)
    }


def wait_for(pred: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


@attrs.define
class Fleet:
    """A running P, D and router (``key_file`` None: unauthenticated)."""

    p: EngineProcess
    d: EngineProcess
    router: str
    key_file: Path | None

    def complete(
        self, url: str, tokens: list[int], *, max_tokens: int = MAX_TOKENS, **body: Any
    ) -> tuple[int, dict[str, Any]]:
        return post_json(
            f"{url}/v1/completions",
            {"prompt": tokens, "max_tokens": max_tokens, **body},
            timeout=60,
        )

    def routed(self, tokens: list[int]) -> tuple[int, dict[str, Any]]:
        """A real client's request through the router."""
        return self.complete(self.router, tokens)

    def ticket(self, tokens: list[int]) -> dict[str, Any]:
        """What any client of P gets: P prefills ``tokens`` and keeps the KV under a lease;
        returns its ``kv_transfer_params``."""
        code, body = self.complete(
            self.p.url, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
        assert code == 200, body
        params: dict[str, Any] = body["kv_transfer_params"]
        assert params, body
        assert params.get("do_remote_prefill") is True, body
        return params

    def side_channel(self) -> tuple[str, int]:
        """P's side-channel address, as P's own kv_transfer_params name it."""
        params = self.ticket(prompt("where is the side channel?"))
        ports = params.get("remote_ports") or [params["remote_port"]]
        return str(params["remote_host"]), int(ports[0])


@contextlib.contextmanager
def fleet(log_dir: Path, key_file: Path | None, tag: str) -> Iterator[Fleet]:
    p = EngineProcess(f"sec-{tag}-P", "kv_producer", key_file=key_file, log_dir=log_dir)
    d = EngineProcess(
        f"sec-{tag}-D", "kv_consumer", key_file=key_file, log_dir=log_dir, max_num_seqs=4
    )
    httpd = None
    try:
        p.wait_ready()
        d.wait_ready()
        httpd = router_mod.serve(router_mod.Router(p.url, d.url), "127.0.0.1", 0)
        yield Fleet(p, d, f"http://127.0.0.1:{httpd.server_address[1]}", key_file)
    finally:
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        p.stop()
        d.stop()


def reference(prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Each prompt's greedy output on one engine without P/D (the demo's check)."""
    from kvframe_refengine.server import build_engine

    engine = build_engine(engine_id="sec-ref", role=None)
    try:
        return [list(o.token_ids) for o in engine.generate(prompts, max_tokens)]
    finally:
        engine.shutdown()
