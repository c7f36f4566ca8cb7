"""kvframe_vllm's public surface: explicit ``__all__`` in every module, a docstring on every
public name and public method (the house rule for kvframe's own packages).

Checked in a child interpreter: importing vLLM imports torch, whose own deprecation warnings
would fail this process (warnings are errors here) for something that is not ours.
"""

from __future__ import annotations

import subprocess
import sys

MODULES = [
    "kvframe_vllm",
    "kvframe_vllm.config",
    "kvframe_vllm.mapping",
    "kvframe_vllm.connector",
    "kvframe_vllm.stats",
    "kvframe_vllm.host",
    "kvframe_vllm.tiny",
    "kvframe_vllm.bench",
    "kvframe_vllm.bench_servers",
    "kvframe.bench.vllm",
]

CHECK = """
import importlib, inspect, sys
problems = []
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    if not module.__doc__:
        problems.append(f"{name}: no module docstring")
    names = getattr(module, "__all__", None)
    if not isinstance(names, list) or len(set(names)) != len(names):
        problems.append(f"{name}: __all__ is not a list of distinct names")
    for public in names or []:
        obj = getattr(module, public)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not obj.__doc__:
            problems.append(f"{name}.{public}: no docstring")
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (callable(member) or isinstance(member, property)):
                    continue
                if not getattr(member, "__doc__", None):
                    problems.append(f"{name}.{public}.{attr}: no docstring")
print("\\n".join(problems))
"""


def test_modules_have_docstrings_and_explicit_all() -> None:
    out = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", CHECK, *MODULES],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", out.stdout
