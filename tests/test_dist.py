"""kvframe installed from its wheels, as docs/install.md tells an operator.

The page's two blocks run as written (read from the page: ``<!-- install: wheels -->`` and
``<!-- install: check -->``): ``./dev dist`` builds every distribution's wheel into dist/
(failing on any build-backend warning), a fresh venv in a temporary directory gets the CPU
torch first and then the wheels with constraints.txt, and from a directory outside the source
tree ``kvframe --version``, ``kvframe plugins`` and the quickest ``kvframe demo`` run there.
About 2 minutes on 2 cores (most of it unpacking torch), 1.4 GB in the temporary directory
while it runs.

The other tests check that constraints.txt pins every package this venv holds, at the version
it holds (what CI tests is what ``./dev`` installs on a fresh machine), and that the page's
table of tested versions agrees with the constraints files and the pyproject.toml files.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
VLLM_CONSTRAINTS = ROOT / "constraints-vllm.txt"
PAGE = ROOT / "docs" / "install.md"
_BLOCK = re.compile(r"<!-- install: (\w+) -->\n```bash\n(.*?)```", re.S)
#: This machine's pip finds the CPU torch on local disk and cannot reach PyTorch's index.
_TORCH_INDEX = " --index-url https://download.pytorch.org/whl/cpu"
#: The wheel ./dev dist builds of each distribution.
DISTRIBUTIONS = (
    "kvframe",
    "kvframe_nixl",
    "kvframe_ucx",
    "kvframe_etcd",
    "kvframe_refengine",
    "kvframe_vllm",
    "kvframe_example_transport",
)

_F = TypeVar("_F", bound=Callable[..., object])


def _slow(test: _F) -> _F:
    """The tests on the wheels' venv: the first one to run builds it (1-3 minutes)."""
    marked: _F = pytest.mark.slow(pytest.mark.timeout(600)(test))
    return marked


def _blocks() -> dict[str, str]:
    blocks = dict(_BLOCK.findall(PAGE.read_text()))
    assert set(blocks) == {"wheels", "check"}, f"{PAGE}: install blocks {sorted(blocks)}"
    return blocks


class Venv:
    """The venv the page's commands made, and where they ran."""

    def __init__(self, path: Path, cwd: Path) -> None:
        self.path = path
        self.cwd = cwd
        self.python = path / "bin" / "python"
        self.wheels = sorted((ROOT / "dist").glob("kvframe*.whl"))

    def env(self) -> dict[str, str]:
        # Nothing of this session's venv or source tree: only $VENV, as the page has it.
        drop = ("PYTHON", "VIRTUAL_ENV", "KVFRAME_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env["VENV"] = str(self.path)
        env["PATH"] = os.pathsep.join(
            p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))
        )
        # Quicker, the same install: modules compile on first import instead.
        env["PIP_COMPILE"] = "0"
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        return env

    def bash(self, script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=cwd,
            env=self.env(),
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
    v = Venv(tmp / "venv", tmp)
    wheels = _blocks()["wheels"]
    assert _TORCH_INDEX in wheels, f"{PAGE}: the torch line changed: {wheels}"
    _ok(v.bash(wheels.replace(_TORCH_INDEX, ""), ROOT, timeout=500), "docs/install.md (wheels)")
    v.wheels = sorted((ROOT / "dist").glob("kvframe*.whl"))
    yield v
    # 1.4 GB: not left behind with pytest's last three temporary directories.
    shutil.rmtree(v.path, ignore_errors=True)


@pytest.fixture(scope="module")
def checked(venv: Venv) -> str:
    """The output of the page's check block (--version, plugins, the demo)."""
    return _ok(venv.bash(_blocks()["check"], venv.cwd, timeout=400), "docs/install.md (check)")


@_slow
def test_dist_builds_every_wheel(venv: Venv) -> None:
    names = sorted(w.name.split("-")[0] for w in venv.wheels)
    assert names == sorted(DISTRIBUTIONS)
    assert all(w.name.endswith("-0.1.0-py3-none-any.whl") for w in venv.wheels)


@_slow
def test_the_venv_runs_the_installed_kvframe_not_the_source_tree(venv: Venv) -> None:
    code = "import kvframe, kvframe_nixl, kvframe_refengine; print(kvframe.__file__)"
    out = _ok(venv.bash(f'"$VENV/bin/python" -c "{code}"', venv.cwd, 120), "import kvframe")
    where = Path(out.strip())
    assert where.is_relative_to(venv.path), where
    assert not where.is_relative_to(ROOT), where


@_slow
def test_pip_check_is_clean(venv: Venv) -> None:
    out = _ok(venv.bash('"$VENV/bin/pip" check', venv.cwd, 120), "pip check")
    assert "No broken requirements found." in out


@_slow
def test_version_names_every_installed_distribution(checked: str) -> None:
    version = re.search(r"^kvframe 0\.1\.0 \(Python [\d.]+\)\n(.*)\n(.*)$", checked, re.MULTILINE)
    assert version, checked
    for dist in ("kvframe-nixl 0.1.0", "kvframe-ucx 0.1.0", "kvframe-refengine 0.1.0"):
        assert dist in version[1]
    assert "torch 2.13.0+cpu" in version[2]  # the CPU build, not a CUDA one


@_slow
def test_plugins_lists_the_nixl_and_ucx_transports(checked: str) -> None:
    transports = checked.split("\ntransports:\n", 1)[1]
    listed = re.findall(r"^  (\S+)  \(from ", transports, flags=re.MULTILINE)
    assert {"nixl", "ucx", "inprocess", "example-tcp"} <= set(listed), checked
    for name, dist in (("nixl", "kvframe-nixl"), ("ucx", "kvframe-ucx")):
        loaded = rf"^  {name}  \[loaded, entry-point\]  {dist} 0\.1\.0 "
        assert re.search(loaded, checked, re.MULTILINE), checked


@_slow
def test_demo_runs_from_the_wheels(checked: str) -> None:
    demo = checked.split("\nstarting prefill, decode and router on ", 1)[1]
    assert "(transport nixl, pull mode;" in demo
    assert "token-for-token equal: 1/1" in demo
    assert re.search(r"^\[PASS\] outputs equal single-engine greedy outputs$", demo, re.MULTILINE)
    assert "[FAIL]" not in demo
    assert re.search(r"^all checks passed in [\d.]+ s$", demo, re.MULTILINE), demo


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


def _declared() -> dict[str, list[SpecifierSet]]:
    """Every requirement of every pyproject.toml (dependencies and extras), by name."""
    declared: dict[str, list[SpecifierSet]] = {}
    for path in [ROOT / "pyproject.toml", *ROOT.glob("*/*/pyproject.toml")]:
        project = tomllib.loads(path.read_text())["project"]
        lists = [project.get("dependencies", [])]
        lists += project.get("optional-dependencies", {}).values()
        for req in (Requirement(r) for deps in lists for r in deps):
            declared.setdefault(canonicalize_name(req.name), []).append(req.specifier)
    return declared


def test_the_pages_table_of_tested_versions_is_what_ci_tests() -> None:
    table = PAGE.read_text().split("<!-- versions -->\n", 1)[1].split("\n\n", 1)[0]
    rows = [
        [c.strip().strip("`") for c in line.strip("|").split("|")] for line in table.splitlines()
    ]
    assert rows[0] == ["package", "declared", "tested (`.venv`)", "tested (`.venv-vllm`)"]
    declared = _declared()
    pins = _pins(CONSTRAINTS), _pins(VLLM_CONSTRAINTS)
    for name, spec, *tested in rows[2:]:
        key = canonicalize_name(name)
        assert SpecifierSet(spec) in declared.get(key, []), f"{name}: declared {declared.get(key)}"
        for pinned, version in zip(pins, tested, strict=True):
            assert pinned.get(key, "–") == version, f"{name}: pinned {pinned.get(key)}"
