"""The P/D recipe of ``docs/vllm.md``, run as the page writes it.

The commands are read from the page (the blocks marked ``<!-- recipe: NAME -->``): the prefill
server, the decode server and the router each run with ``bash -c`` in a process group of its
own, as an operator would start them, with this suite's tiny model and free ports as the values
of the page's variables. Completions sent through the router must equal the same requests
answered by one server alone, and the decode server must have taken the prompts' KV from the
prefill server (vLLM's own ``prompt_tokens_by_source`` counter). ``SIGTERM`` to each group
must end every process in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvframe_vllm.tiny import prompt_ids

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm.md"
_BLOCK = re.compile(r"<!-- recipe: (\w+) -->\n```(\w+)\n(.*?)```", re.S)
VARIABLES = ("MODEL", "PREFILL_PORT", "DECODE_PORT", "ROUTER_PORT")
"""The page's variables, which this test gives its own values."""
SERVERS = {"prefill": "PREFILL_PORT", "decode": "DECODE_PORT", "router": "ROUTER_PORT"}
START_S = 300.0
"""Start-up bound per process (35-60 s each on two busy cores)."""
STOP_S = 30.0


def recipe() -> dict[str, str]:
    """The page's recipe blocks by name."""
    blocks = {name: body for name, lang, body in _BLOCK.findall(DOC.read_text())}
    assert set(blocks) >= {"variables", *SERVERS, "request"}, f"{DOC}: recipe blocks {blocks}"
    return blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url} answered {exc.code}: {exc.read().decode()[:2000]}") from exc


class Recipe:
    """The three processes of the recipe, started from the page's commands."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.blocks = recipe()
        self.values = {
            "MODEL": str(model),
            **{var: str(_free_port()) for var in SERVERS.values()},
        }
        env = dict(os.environ)
        env.update(self.values)
        # `python` in the commands is this suite's interpreter (the virtualenv an operator
        # installed vLLM and kvframe into); the rest is this machine's, not the recipe's.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        self.logs = {name: logs / f"{name}.log" for name in SERVERS}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in SERVERS:
            with open(self.logs[name], "wb") as log:
                self.procs[name] = subprocess.Popen(
                    ["bash", "-c", self.blocks[name]],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.values[SERVERS[name]]}"

    def tail(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")[-3000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        for name in SERVERS:
            while True:
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise AssertionError(
                        f"the {name} command exited with {proc.returncode}:\n{self.tail(name)}"
                    )
                try:
                    if _get(self.url(name) + "/health")[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"{name} not up in {START_S:g} s:\n{self.tail(name)}")
                time.sleep(0.5)

    def alive(self, name: str) -> bool:
        try:
            os.killpg(self.procs[name].pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> list[str]:
        """SIGTERM every group; the names of those with a process left after STOP_S."""
        for name, proc in self.procs.items():
            if self.alive(name):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        while time.monotonic() < deadline and any(self.alive(n) for n in self.procs):
            time.sleep(0.2)  # the leader's children (engine core, worker) follow it
        return [name for name in self.procs if self.alive(name)]

    def kill(self) -> None:
        for name, proc in self.procs.items():
            if self.alive(name):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def pair(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recipe]:
    """The recipe's processes, up; killed (process groups) at the end whatever happened."""
    running = Recipe(models["a"], tmp_path_factory.mktemp("recipe-logs"))
    try:
        running.wait_ready()
        yield running
    finally:
        running.kill()


def _served_name() -> str:
    match = re.search(r"--served-model-name\s+(\S+)", recipe()["prefill"])
    assert match, "the prefill command names no --served-model-name"
    return match.group(1)


def test_the_commands_use_only_the_pages_variables() -> None:
    blocks = recipe()
    assert re.findall(r"\b([A-Z_]+)=", blocks["variables"]) == list(VARIABLES)
    for name in (*SERVERS, "request"):
        used = set(re.findall(r"\$\{?([A-Z_]+)", blocks[name]))
        assert used <= set(VARIABLES), f"recipe {name}: {sorted(used - set(VARIABLES))}"
    for name in ("prefill", "decode"):
        assert "python -m vllm.entrypoints.openai.api_server" in blocks[name]


def test_completions_through_the_router_equal_one_server_alone(pair: Recipe) -> None:
    model = _served_name()
    prompts = [prompt_ids(100 + i, 64) for i in range(3)]  # two 32-token blocks each

    def body(prompt: list[int]) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }

    routed = [_post(pair.url("router") + "/v1/completions", body(p)) for p in prompts]
    # One server alone: the prefill server, asked directly (its prefix cache holds only what
    # it computed itself).
    alone = [_post(pair.url("prefill") + "/v1/completions", body(p)) for p in prompts]
    got = [r["choices"][0]["token_ids"] for r in routed]
    want = [r["choices"][0]["token_ids"] for r in alone]
    assert got == want
    assert all(len(t) == 8 for t in got)
    assert all("prefill_id" in r for r in routed)  # the router's answer: it went through P
    # D loaded the prompts' KV from P rather than computing it: vLLM's own accounting.
    status, metrics = _get(pair.url("decode") + "/metrics")
    assert status == 200
    pulled = sum(
        float(m.group(1))
        for m in re.finditer(
            r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)',
            metrics,
            re.M,
        )
    )
    assert pulled >= len(prompts) * 32, metrics[-3000:]


def _kvframe_families(text: str) -> str:
    """The ``vllm:kvframe_*`` families of a vLLM server's ``/metrics`` (HELP, TYPE, samples)."""
    keep = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("# ") else line
        if name.startswith("vllm:kvframe_"):
            keep.append(line)
    return "\n".join(keep) + "\n"


def _samples(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)", text, re.M))


def test_the_servers_metrics_pass_a_prometheus_checker(pair: Recipe) -> None:
    # After the completions above (pytest runs this module's tests in file order).
    from kvframe.runtime.metrics import lint

    texts = {name: _get(pair.url(name) + "/metrics") for name in SERVERS}
    assert {name: status for name, (status, _) in texts.items()} == dict.fromkeys(SERVERS, 200)
    prefill, decode = (_kvframe_families(texts[n][1]) for n in ("prefill", "decode"))
    # vLLM names every metric vllm:*, which promtool's naming rule flags (vLLM's own too).
    ignore = ("should not contain ':'",)
    assert lint(prefill, promtool_ignore=ignore) == []
    assert lint(decode, promtool_ignore=ignore) == []
    assert lint(texts["router"][1]) == []
    assert _samples(prefill, "vllm:kvframe_leases_granted_total") >= 3, prefill[-3000:]
    assert _samples(decode, "vllm:kvframe_transfer_seconds_count") >= 3, decode[-3000:]
    assert _samples(texts["router"][1], "kvframe_router_requests_total") >= 3


def test_the_pages_request_gets_an_answer(pair: Recipe) -> None:
    words = shlex.split(pair.blocks["request"].replace("\\\n", " "))
    url = words[words.index("curl") + 2].replace("$ROUTER_PORT", pair.values["ROUTER_PORT"])
    body = json.loads(words[words.index("-d") + 1])
    answer = _post(url, body)
    alone = _post(pair.url("prefill") + "/v1/completions", body)
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == body["max_tokens"]


def test_sigterm_to_each_process_group_ends_every_process(pair: Recipe) -> None:
    assert pair.stop() == []
