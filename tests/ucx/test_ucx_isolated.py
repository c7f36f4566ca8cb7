"""Runs the UCX transport's tests (``check_*.py`` in this folder) in a separate interpreter.

Loading ucxx into a process breaks NIXL in that process: with ucxx imported, NIXL's own
conformance tests read wrong bytes after a release or a peer removal (seen with ucxx-cu12 0.52
and nixl-cu12 1.5.1, which share one UCX build). The main test process runs the NIXL tests, so
the UCX tests must never load ucxx there; they run here in a child pytest, and this test fails
with the child's output when any of them fails. The check files are named ``check_*.py`` so
the main run does not collect them.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ucx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MATRIX = HERE / "check_ucx_pd_matrix.py"
MULTITURN = HERE / "check_ucx_multiturn.py"

if importlib.util.find_spec("ucxx") is None or importlib.util.find_spec("kvframe_ucx") is None:
    pytest.skip(
        "the UCX tests need ucxx-cu12 and plugins/kvframe-ucx (./dev installs both)",
        allow_module_level=True,
    )


def _child_pytest(targets: list[str], timeout: float, least: int) -> None:
    """Run ``targets`` in a child pytest; fail with its output unless ``least`` passed."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "python_files=check_*.py",
            *targets,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert summary is not None, tail
    # the checks were all collected: ``least`` is every test the targets hold (update it when
    # adding one), so one that silently stops being collected, or is skipped, fails this
    assert int(summary.group(1)) >= least, tail
    assert re.search(r"\d+ failed", proc.stdout) is None, tail


def test_ucx_suite_in_its_own_interpreter() -> None:
    assert "ucxx" not in sys.modules, "ucxx was loaded into the main test process"
    _child_pytest(
        ["--ignore", str(MATRIX), "--ignore", str(MULTITURN), str(HERE)], timeout=240, least=64
    )


def test_ucx_pd_matrix_in_its_own_interpreter() -> None:
    """The cross-process P/D matrix over UCX (check_ucx_pd_matrix.py), in a child of its own:
    its nodes take about as long as every other UCX check together."""
    _child_pytest([str(MATRIX)], timeout=300, least=15)


def test_ucx_multiturn_in_its_own_interpreter() -> None:
    """Bidirectional mode across processes over UCX (check_ucx_multiturn.py: the tests of
    tests/pd/test_pd_multiturn_nixl.py and one of its own), in a child of its own: its six
    nodes start together and its leases are short, so it runs beside nothing else."""
    _child_pytest([str(MULTITURN)], timeout=180, least=5)
