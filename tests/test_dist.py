"""kvframe installed from its wheels, as an operator would (docs/install.md).

``./dev dist`` builds every distribution's wheel (and fails on any build-backend warning); a
fresh venv in a temporary directory gets the CPU torch first, then the wheels, with
constraints.txt; from a working directory outside the source tree, ``kvframe --version``,
``kvframe plugins`` and the quickest ``kvframe demo`` run there. About 1.5 minutes on 2 cores
(most of it unpacking torch), 1.4 GB in the temporary directory while it runs.

The last test checks that constraints.txt pins every package this venv holds, at the version
it holds: what CI tests is what ``./dev`` installs on a fresh machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
#: The wheel ./dev dist builds of each distribution.
DISTRIBUTIONS = (
    "kvframe",
    "kvframe_nixl",
    "kvframe_ucx",
    "kvframe_refengine",
    "kvframe_vllm",
    "kvframe_example_transport",
)

_F = TypeVar("_F", bound=Callable[..., object])


def _slow(test: _F) -> _F:
    """The tests on the wheels' venv: the first one to run builds it (1-3 minutes)."""
    marked: _F = pytest.mark.slow(pytest.mark.timeout(600)(test))
    return marked


class Venv:
    """A fresh venv that holds the wheels, and a working directory outside the source tree."""

    def __init__(self, path: Path, cwd: Path, wheels: list[Path]) -> None:
        self.path = path
        self.cwd = cwd
        self.wheels = wheels
        self.python = path / "bin" / "python"

    def env(self) -> dict[str, str]:
        drop = ("PYTHON", "VIRTUAL_ENV", "KVFRAME_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env["PATH"] = f"{self.path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(args),
            cwd=self.cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def pip(self, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
        # The test venv's own pip (a venv made --without-pip has none): pip --python installs
        # into it exactly as its own pip would.
        return subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(self.python), *args],
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def _ok(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    tmp = tmp_path_factory.mktemp("dist")
    wheels_dir, cwd = tmp / "wheels", tmp / "cwd"
    cwd.mkdir()
    _ok(
        subprocess.run(
            [str(ROOT / "dev"), "dist", str(wheels_dir)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        ),
        "./dev dist",
    )
    wheels = sorted(wheels_dir.glob("*.whl"))
    v = Venv(tmp / "venv", cwd, wheels)
    _ok(
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(v.path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ),
        "python -m venv",
    )
    quiet = ("-q", "--disable-pip-version-check", "--no-compile", "-c", str(CONSTRAINTS))
    # docs/install.md's order: the CPU torch first, or nixl-cu12 pulls a CUDA build.
    _ok(v.pip("install", *quiet, "torch==2.13.0"), "pip install torch")
    _ok(v.pip("install", *quiet, *map(str, wheels)), "pip install the wheels")
    yield v
    # 1.4 GB: not left behind with pytest's last three temporary directories.
    shutil.rmtree(v.path, ignore_errors=True)


@_slow
def test_dist_builds_every_wheel(venv: Venv) -> None:
    names = sorted(w.name.split("-")[0] for w in venv.wheels)
    assert names == sorted(DISTRIBUTIONS)
    assert all(w.name.endswith("-0.1.0-py3-none-any.whl") for w in venv.wheels)


@_slow
def test_the_venv_runs_the_installed_kvframe_not_the_source_tree(venv: Venv) -> None:
    out = _ok(
        venv.run(str(venv.python), "-c", "import kvframe, kvframe_nixl; print(kvframe.__file__)"),
        "import kvframe",
    )
    where = Path(out.strip())
    assert where.is_relative_to(venv.path), where
    assert not where.is_relative_to(ROOT), where


@_slow
def test_pip_check_is_clean(venv: Venv) -> None:
    out = _ok(venv.pip("check", "--disable-pip-version-check"), "pip check")
    assert "No broken requirements found." in out


@_slow
def test_version_names_every_installed_distribution(venv: Venv) -> None:
    out = _ok(venv.run("kvframe", "--version"), "kvframe --version")
    assert out.startswith("kvframe 0.1.0 (Python ")
    for dist in ("kvframe-nixl 0.1.0", "kvframe-ucx 0.1.0", "kvframe-refengine 0.1.0"):
        assert dist in out
    assert "torch 2.13.0+cpu" in out  # the CPU build, not a CUDA one


@_slow
def test_plugins_lists_the_nixl_and_ucx_transports(venv: Venv) -> None:
    out = _ok(venv.run("kvframe", "plugins", timeout=180), "kvframe plugins")
    transports = out.split("\ntransports:\n", 1)[1]
    listed = re.findall(r"^  (\S+)  \(from ", transports, flags=re.MULTILINE)
    assert {"nixl", "ucx", "inprocess", "example-tcp"} <= set(listed), out
    assert re.search(r"^  nixl  \[loaded, entry-point\]  kvframe-nixl 0\.1\.0", out, re.MULTILINE)
    assert re.search(r"^  ucx  \[loaded, entry-point\]  kvframe-ucx 0\.1\.0", out, re.MULTILINE)


@_slow
def test_demo_runs_from_the_wheels(venv: Venv) -> None:
    proc = venv.run("kvframe", "demo", "--json", "--prompts", "1", "--no-kill", timeout=240)
    _ok(proc, "kvframe demo")
    result = json.loads(proc.stdout)
    assert result["ok"] is True, proc.stdout
    assert result["transport"] == "nixl"
    assert all(result["checks"].values()), result["checks"]
    assert result["phase1"]["equal_outputs"] == result["phase1"]["requests"] == 1
    assert result["phase1"]["kv_bytes_moved"] > 0


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not an exact pin (NAME==VERSION)"
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_package_of_this_venv() -> None:
    pins = _pins(CONSTRAINTS)
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions()
        if d.metadata["Name"]
    }
    ours = {n for n in installed if n == "kvframe" or n.startswith("kvframe-")} | {"pip"}
    wrong = {
        name: (version, pins.get(name))
        for name, version in installed.items()
        if name not in ours and pins.get(name) != version
    }
    assert not wrong, (
        "constraints.txt does not pin this venv's packages (installed, pinned): "
        f"{wrong}; after changing a dependency run ./dev constraints and commit the result"
    )
