"""A stranger's plugin, end to end: install contrib/kvframe-example-transport outside the shared
venv, find it through its entry point, and run the conformance kit from its own test suite."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "contrib" / "kvframe-example-transport"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(a copy of the source tree, an environment whose PYTHONPATH holds the installed copy).

    ``pip install --no-deps --target`` into a temporary directory: the shared .venv is never
    modified, and no index is needed (kvframe, msgpack and numpy come from the venv)."""
    root = tmp_path_factory.mktemp("example")
    src, target = root / "src", root / "site"
    shutil.copytree(
        EXAMPLE,
        src,
        ignore=shutil.ignore_patterns(
            "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--no-cache-dir", "--disable-pip-version-check",
         "--target", str(target), str(src)],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("PYTEST_ADDOPTS", None)
    return src, env


def test_found_through_its_entry_point(installed: tuple[Path, dict[str, str]]) -> None:
    _, env = installed
    probe = (
        "from kvframe.runtime.plugins import PluginHost\n"
        "h = PluginHost(); h.load()\n"
        "i = h.transport_info('example-tcp')\n"
        "print(i.distribution, i.version, i.capabilities.cross_process)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["kvframe-example-transport", "0.1.0", "True"]
    listing = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "plugins"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    assert "kvframe-example-transport 0.1.0" in listing.stdout
    assert re.search(r"^\s+example-tcp\b.*\n.*cross-process", listing.stdout, re.M)


def test_its_own_suite_runs_the_conformance_kit(installed: tuple[Path, dict[str, str]]) -> None:
    src, env = installed
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=src, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = run.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))  # type: ignore[union-attr]
    assert passed >= 30, summary
    # example-tcp supports everything the kit checks, cross-process: nothing may be skipped
    assert "skipped" not in summary, summary
    assert "failed" not in summary, summary
