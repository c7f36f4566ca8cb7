"""``kvframe bench vllm``: kvframe's P/D connector beside vLLM's own ``NixlConnector`` in real
vLLM OpenAI servers (``--quick``: offline engines in-process, not what users run) — a thin
launcher.

vLLM lives in its own virtualenv (``.venv-vllm``, made by ``./dev vllm-setup``; it pins its own
torch build), so this command becomes ``python -m kvframe_vllm.bench`` with that venv's
interpreter (``exec``: the same process, so a signal sent to ``kvframe bench vllm`` reaches
the benchmark, which stops its engines and removes its temporary directory) and passes the
options through. ``KVFRAME_VLLM_PYTHON`` names another interpreter. What is measured and the
JSON shape are documented in ``kvframe_vllm.bench_servers`` (the default servers mode) and
``kvframe_vllm.bench`` (``--quick``), and in ``docs/vllm.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["add_arguments", "find_python", "run"]


def find_python() -> Path | None:
    """The vLLM venv's interpreter: ``$KVFRAME_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
    beside the kvframe checkout or in the current directory; ``None`` if none exists."""
    env = os.environ.get("KVFRAME_VLLM_PYTHON")
    if env:
        return Path(env)
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        candidate = root / ".venv-vllm" / "bin" / "python"
        if candidate.exists():
            return candidate
    return None


#: The options passed through, with their types (``kvframe_vllm.bench`` checks the values
#: and fills in each mode's defaults).
_OPTIONS: dict[str, tuple[type, str]] = {
    "--decode-tokens": (int, "tokens decoded (servers 16, --quick 32)"),
    "--lease": (float, "kv_lease_duration s, both connectors (6; at least 6 in servers mode)"),
    "--prompts": (int, "servers mode: requests measured (16)"),
    "--min-prompt-tokens": (int, "servers mode: shortest prompt (64)"),
    "--max-prompt-tokens": (int, "servers mode: longest prompt (256)"),
    "--idle-window": (float, "servers mode: idle CPU window, s (5)"),
    "--requests": (int, "--quick: requests per phase (8)"),
    "--prompt-tokens": (int, "--quick: prompt length (256)"),
    "--repeat": (int, "--quick: repetitions of each phase; medians (3)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (passed through to ``kvframe_vllm.bench``)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="in-process quick mode (offline engines in one process each: not what users run)",
    )
    for flag, (kind, text) in _OPTIONS.items():
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument(
        "--only", choices=("nixl", "kvframe"), default=None, help="run one connector only"
    )


def run(args: argparse.Namespace) -> int:
    """Replace this process with the benchmark in the vLLM venv; returns only when that fails:
    2 when there is no such venv (with a message saying how to make one) or it cannot be
    started."""
    python = find_python()
    if python is None or not python.exists():
        print(
            "kvframe bench vllm: no vLLM virtualenv found (.venv-vllm/bin/python); create it "
            "with `./dev vllm-setup` or set KVFRAME_VLLM_PYTHON to a Python that has vllm "
            "and kvframe-vllm installed",
            file=sys.stderr,
        )
        return 2
    cmd = [str(python), "-m", "kvframe_vllm.bench"]
    for flag in _OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            cmd += [flag, str(value)]
    if args.only:
        cmd += ["--only", args.only]
    for flag in ("--quick", "--json"):
        if getattr(args, flag[2:]):
            cmd.append(flag)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(cmd[0], cmd)
    except OSError as exc:
        print(f"kvframe bench vllm: cannot start {python}: {exc}", file=sys.stderr)
    return 2
