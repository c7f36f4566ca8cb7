"""A vLLM engine in its own process, driven over loopback: the harness of the vLLM tests and of
``kvframe bench vllm``.

``python -m kvframe_vllm.host --endpoint tcp://127.0.0.1:PORT --model DIR ...`` builds an
offline ``vllm.LLM`` with its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
and answers msgpack requests on a pyzmq REP socket. Between requests it steps the engine
while vLLM's scheduler has work (``Scheduler.has_requests()``, which includes requests whose
blocks a connector holds and ``has_pending_push_work()``): the same rule as vLLM's own engine
busy loop, so a producer holding leases keeps stepping and frees blocks when idle.

:class:`EngineProcess` is the parent's handle. Requests and answers are msgpack maps (never
pickle).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq

__all__ = ["EngineError", "EngineProcess", "main"]


class EngineError(RuntimeError):
    """The engine process failed a request, died, or did not answer in time; the message
    says which and where its log is."""


def _engine_env(core: int | None, kv_space_gib: int, side_port: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    if side_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    return env


class EngineProcess:
    """A vLLM engine process (see the module docstring).

    :meth:`start` launches it; :meth:`wait_ready` waits for the engine to be built; then
    :meth:`call` sends one request. :meth:`kill` ends it abruptly (SIGKILL, like a crash);
    :meth:`close` asks it to exit and kills it if it does not. Both may be called twice.
    """

    def __init__(
        self,
        name: str,
        *,
        model: str | Path,
        kv_transfer_config: Mapping[str, Any] | None,
        log_dir: str | Path,
        core: int | None = None,
        kv_space_gib: int = 1,
        side_port: int | None = None,
        served_model_name: str = "tiny-llama",
        python: str = sys.executable,
    ) -> None:
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        cmd = [
            python,
            "-m",
            "kvframe_vllm.host",
            "--endpoint",
            f"tcp://127.0.0.1:{port}",
            "--model",
            str(model),
            "--served-model-name",
            served_model_name,
        ]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=_engine_env(core, kv_space_gib, side_port),
            start_new_session=True,
        )
        self._ready = False

    def _tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        """Send ``{"op": op, **args}`` and return the answer map.

        Raises :class:`EngineError` when the engine answers with an error, exits, or does
        not answer within ``timeout`` seconds (the socket is then unusable: close it).
        """
        self._sock.send(msgpack.packb({"op": op, **args}))
        deadline = time.monotonic() + timeout
        while True:
            if self._sock.poll(200):
                reply: dict[str, Any] = msgpack.unpackb(self._sock.recv(), raw=False)
                if "error" in reply:
                    raise EngineError(f"{self.name}: {op} failed: {reply['error']}")
                return reply
            if self.proc.poll() is not None:
                raise EngineError(
                    f"{self.name} exited with {self.proc.returncode} during {op}; "
                    f"log {self.log_path}:\n{self._tail()}"
                )
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{self.name}: no answer to {op} within {timeout} s; log {self.log_path}"
                )

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """Block until the engine is built; returns its facts (``total_blocks``, ...)."""
        info = self.call("ping", timeout=timeout)
        self._ready = True
        return info

    def kill(self) -> None:
        """SIGKILL the engine's process group (a crash: nothing is cleaned up by it)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        """Ask the engine to exit (5 s), then kill it; release the socket and the log."""
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=5)
                self.proc.wait(timeout=10)
            except (EngineError, subprocess.TimeoutExpired, zmq.ZMQError):
                pass
        self.kill()
        self._sock.close(0)
        self._ctx.term()
        self._log.close()


# -- the engine side ---------------------------------------------------------------------


class _Host:
    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        core = self.engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.ids = 0
        self.stats_log: list[Any] = []
        conn = self.worker_connector()
        if conn is not None:
            # Keep a copy of every stats report the model runner collects (any connector,
            # vLLM's own included), for the benchmark; vLLM still gets the original.
            original = conn.get_kv_connector_stats

            def recorded() -> Any:
                stats = original()
                if stats is not None and not stats.is_empty():
                    self.stats_log.append(copy.deepcopy(stats.data))
                return stats

            conn.get_kv_connector_stats = recorded

    def pool(self) -> Any:
        return self.scheduler.kv_cache_manager.block_pool

    def sched_connector(self) -> Any:
        return self.scheduler.get_kv_connector()

    def worker_connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    def state(self) -> dict[str, Any]:
        pool = self.pool()
        out: dict[str, Any] = {
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks,
            "has_requests": bool(self.scheduler.has_requests()),
            "requests": len(self.scheduler.requests),
        }
        for key, conn in (
            ("scheduler", self.sched_connector()),
            ("worker", self.worker_connector()),
        ):
            totals = getattr(conn, "totals", None)
            out[key] = totals() if callable(totals) else {}
        return out

    def sampling(self, max_tokens: int, params: Mapping[str, Any] | None) -> Any:
        from vllm import SamplingParams

        extra = {"kv_transfer_params": dict(params)} if params is not None else None
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, params: Sequence[Any]
    ) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        sps = [self.sampling(max_tokens, p) for p in params]
        t0 = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sps, use_tqdm=False
        )
        seconds = time.perf_counter() - t0
        return {
            "seconds": seconds,
            "outputs": [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "kv_transfer_params": o.kv_transfer_params,
                }
                for o in outs
            ],
        }

    def submit(
        self, prompt: Sequence[int], max_tokens: int, params: Any, steps: int, die: bool
    ) -> Any:
        from vllm.inputs import TokensPrompt

        self.ids += 1
        rid = f"submitted-{self.ids}"
        self.engine.add_request(
            rid, TokensPrompt(prompt_token_ids=list(prompt)), self.sampling(max_tokens, params)
        )
        for _ in range(steps):
            self.engine.step()
        if die:
            # A crash with the request accepted (the connector saw it) and nothing cleaned up.
            os.kill(os.getpid(), signal.SIGKILL)
        return {"request_id": rid}

    def pump(self) -> None:
        if self.scheduler.has_requests():
            self.engine.step()


def main(argv: Sequence[str] | None = None) -> int:
    """Run an engine host (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m kvframe_vllm.host")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--served-model-name", default="tiny-llama")
    ap.add_argument("--kv-transfer-config", default=None)
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args(argv)

    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if args.kv_transfer_config:
        kv = KVTransferConfig(**json.loads(args.kv_transfer_config))
    llm = LLM(
        model=args.model,
        tokenizer=args.model,
        served_model_name=args.served_model_name,
        dtype="float32",  # as the tiny model (kvframe_vllm.tiny says why)
        block_size=args.block_size,
        max_model_len=512,
        max_num_seqs=16,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv,
    )
    host = _Host(llm)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.endpoint)
    while True:
        # Step while vLLM has work (as its engine loop does); otherwise wait for a request.
        if not sock.poll(0 if host.scheduler.has_requests() else 10):
            host.pump()
            continue
        req = msgpack.unpackb(sock.recv(), raw=False)
        op = req.pop("op")
        try:
            if op == "ping":
                reply: Any = {"total_blocks": host.pool().num_gpu_blocks, "pid": os.getpid()}
            elif op == "generate":
                reply = host.generate(req["prompts"], req["max_tokens"], req["params"])
            elif op == "submit":
                reply = host.submit(
                    req["prompt"],
                    req["max_tokens"],
                    req["params"],
                    req.get("steps", 0),
                    req.get("die", False),
                )
            elif op == "reset_prefix_cache":
                reply = {"ok": bool(llm.reset_prefix_cache())}
            elif op == "take_stats":
                reply = {"reports": host.stats_log}
                host.stats_log = []
            elif op == "state":
                reply = host.state()
            elif op == "exit":
                sock.send(msgpack.packb({"ok": True}))
                break
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # reported to the parent, which fails the test with it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sock.send(msgpack.packb(reply, default=_plain))
    sock.close(0)
    ctx.term()
    os._exit(0)  # vLLM's atexit hooks can hang with the engine core in-process


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"cannot send {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
