"""The ``kvframe`` command itself: ``--version``, missing optional dependencies named with
their install command, bad demo options refused before any process starts, and the shared
pieces behind them (:mod:`kvframe.runtime.procs`, :mod:`kvframe.bench.progress`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

import kvframe
from kvframe import cli
from kvframe.bench.progress import Progress
from kvframe.runtime import procs


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- --version ----------------------------------------------------------------------------


def test_version_names_kvframe_and_the_installed_kvframe_distributions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"kvframe {kvframe.__version__} (Python ")
    assert lines[1].startswith("distributions and plugins: ")
    installed = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    for name in ("kvframe-refengine", "kvframe-nixl"):
        if name in installed:
            version = importlib.metadata.version(name)
            assert f"{name} {version}" in lines[1]
    assert len(lines) <= 3


# -- missing optional dependencies --------------------------------------------------------


@pytest.mark.parametrize("module", sorted(cli.OPTIONAL_DEPENDENCIES))
def test_a_missing_optional_dependency_is_named_with_its_install_command(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = types.ModuleType("kvframe_test_bench")

    def run(args: argparse.Namespace) -> int:
        raise ModuleNotFoundError(f"No module named {module!r}", name=f"{module}.sub")

    fake.add_arguments = lambda parser: None  # type: ignore[attr-defined]
    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvframe_test_bench", fake)
    monkeypatch.setitem(cli.BENCHMARKS, "fake", ("kvframe_test_bench", "a fake"))
    code, out, err = _run(capsys, "bench", "fake")
    what, install = cli.OPTIONAL_DEPENDENCIES[module]
    assert code == 1
    assert out == ""
    assert err.startswith(f"kvframe bench fake needs {what}, which is not installed")
    assert err.rstrip().endswith(f"install it with: {install}")
    assert len(err.splitlines()) == 1


def test_an_unknown_missing_module_is_a_bug_and_keeps_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = types.ModuleType("kvframe_test_bench")

    def run(args: argparse.Namespace) -> int:
        raise ModuleNotFoundError("No module named 'kvframe_typo'", name="kvframe_typo")

    fake.add_arguments = lambda parser: None  # type: ignore[attr-defined]
    fake.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvframe_test_bench", fake)
    monkeypatch.setitem(cli.BENCHMARKS, "fake", ("kvframe_test_bench", "a fake"))
    with pytest.raises(ModuleNotFoundError, match="kvframe_typo"):
        cli.main(["bench", "fake"])


def test_bench_offload_without_torch_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    code, _out, err = _run(capsys, "bench", "offload", "--quick")
    assert code == 1
    assert "Traceback" not in err
    assert err.startswith("kvframe bench offload needs torch, which is not installed")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in err


def test_bench_transfer_without_the_nixl_plugin_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kvframe_nixl", None)  # find_spec now says: not installed
    code, out, err = _run(capsys, "bench", "transfer", "--quick")
    assert (code, out) == (1, "")
    assert err.startswith("kvframe bench transfer needs the NIXL transport plugin, which is")
    assert "pip install kvframe-nixl" in err


def test_bench_pipeline_names_torch_not_the_reference_engine_when_torch_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("kvframe_refengine", reason="the benchmark is the reference engine's")
    monkeypatch.delitem(sys.modules, "kvframe_refengine.bench_pipeline", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    code, _, err = _run(capsys, "bench", "pipeline", "--quick")
    assert code == 1
    assert err.startswith("kvframe bench pipeline needs torch, which is not installed")


def test_a_benchmark_module_that_cannot_import_leaves_the_others_usable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kvframe_test_broken", None)  # import fails: not found
    monkeypatch.setitem(cli.OPTIONAL_DEPENDENCIES, "kvframe_test_broken", ("X", "pip install x"))
    monkeypatch.setitem(cli.BENCHMARKS, "broken", ("kvframe_test_broken", "needs X"))
    code, _, err = _run(capsys, "bench", "broken", "--any", "option")
    assert code == 1
    assert err.startswith("kvframe bench broken needs X, which is not installed")
    code, out, _ = _run(capsys, "plugins", "--json")
    assert code in (0, 1)
    assert out.startswith("{")


def test_the_demo_without_the_reference_engine_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kvframe_refengine.demo", None)
    code, _, err = _run(capsys, "demo")
    assert code == 1
    assert err.startswith("kvframe demo needs the reference engine, which is not installed")
    assert "pip install kvframe-refengine" in err


# -- bad demo options ---------------------------------------------------------------------


def _no_process(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"a process was started: {args}")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lease", "0"], "--lease 0: kv_lease_duration"),
        (["--lease", "-3"], "--lease -3: kv_lease_duration"),
        (["--lease", "nan"], "--lease nan: kv_lease_duration"),
        (["--lease", "inf"], "--lease inf: kv_lease_duration"),
        (["--lease", "0.05"], "--lease 0.05: kv_lease_duration: got 0.05"),  # the floor
        (["--prompts", "0"], "--prompts 0: expected 1..64"),
        (["--prompts", "65"], "--prompts 65: expected 1..64"),
        (["--max-tokens", "0"], "--max-tokens 0: expected 1.."),
        (["--max-tokens", "100000"], "--max-tokens 100000: expected 1.."),
        (["--transport", "inprocess"], "--transport inprocess: the demo runs P and D as separate"),
        (["--transport", "nixx"], "--transport nixx: no transport named 'nixx'"),
    ],
)
def test_a_bad_demo_option_is_refused_before_any_process_starts(
    argv: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("kvframe_refengine", reason="the demo is the reference engine's")
    monkeypatch.setattr(subprocess, "Popen", _no_process)
    code, out, err = _run(capsys, "demo", *argv)
    assert code == 2
    assert out == ""
    assert err.startswith(f"kvframe demo: {expected}")
    assert len(err.splitlines()) == 1


def test_the_demo_checks_its_options_with_the_engines_own_configuration(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("kvframe_refengine", reason="the demo is the reference engine's")
    from kvframe_refengine import server

    from kvframe.errors import ConfigError

    # Whatever the engines' configuration refuses (kvframe.config's rules, floors included),
    # the demo refuses up front, naming the option.
    seen: list[float] = []

    def refuse(**kwargs: Any) -> Any:
        seen.append(kwargs["lease"])
        raise ConfigError("kv_lease_duration: got 5.0; expected something else")

    monkeypatch.setattr(server, "kv_transfer_config", refuse)
    monkeypatch.setattr(subprocess, "Popen", _no_process)
    code, _, err = _run(capsys, "demo", "--lease", "5")
    assert code == 2
    assert seen == [5.0]
    assert err == "kvframe demo: --lease 5: kv_lease_duration: got 5.0; expected something else\n"


# -- kvframe.runtime.procs ----------------------------------------------------------------

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# A child that starts a grandchild in its own group, prints the grandchild's pid, and waits.
_FAMILY = [
    sys.executable,
    "-c",
    "import subprocess, sys, time\n"
    f"g = subprocess.Popen({_SLEEPER!r})\n"
    "print(g.pid, flush=True)\n"
    "time.sleep(60)\n",
]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_gone(pids: list[int], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.02)
    return False


def test_children_lead_their_own_group_and_stop_with_grandchildren_and_temp_dirs() -> None:
    with procs.ChildProcesses(grace=2.0) as children:
        proc = children.popen(_FAMILY, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        assert os.getpgid(proc.pid) == proc.pid != os.getpgrp()
        assert os.getpgid(grandchild) == proc.pid
        tmp = children.mkdtemp("kvframe-test-")
        (tmp / "f").write_text("x")
        assert children.pids() == [proc.pid]
    assert proc.returncode == -signal.SIGTERM
    assert _wait_gone([grandchild])
    assert not tmp.exists()
    proc.stdout.close()


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period() -> None:
    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)",
    ]
    children = procs.ChildProcesses(grace=0.3)
    proc = children.popen(stubborn, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    keep = children.mkdtemp("kvframe-test-")
    children.keep(keep)
    t0 = time.monotonic()
    children.close()
    assert proc.returncode == -signal.SIGKILL
    assert 0.3 <= time.monotonic() - t0 < 5
    assert keep.exists()
    keep.rmdir()
    children.close()  # twice is fine
    with pytest.raises(RuntimeError, match="stopped"):
        children.popen(_SLEEPER)
    proc.stdout.close()


def test_a_signal_stops_the_children_first_then_unwinds_as_stopped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[int] = []

    def command() -> int:
        with procs.ChildProcesses(grace=2.0) as children:
            proc = children.popen(_SLEEPER)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # interrupted by the handler
                return 0
            finally:
                seen.append(proc.returncode)  # already stopped when Stopped unwinds here

    before = signal.getsignal(signal.SIGTERM)
    assert procs.run_main("kvframe probe", command) == 128 + signal.SIGTERM
    assert seen == [-signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err
    assert err == "kvframe probe: stopped by SIGTERM; every process it started has been stopped\n"


def test_a_signal_while_a_child_starts_waits_until_it_is_registered(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = subprocess.Popen
    started: list[subprocess.Popen[Any]] = []

    def popen_then_signal(*args: Any, **kwargs: Any) -> Any:
        proc = real(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives before ChildProcesses registered it
        time.sleep(0.2)  # the handler runs here, and must not unwind yet
        return proc

    def command() -> int:
        with procs.ChildProcesses(grace=2.0) as children:
            monkeypatch.setattr(subprocess, "Popen", popen_then_signal)
            children.popen(_SLEEPER)
            return 0  # not reached: the deferred signal stops it as popen returns

    assert procs.run_main("kvframe probe", command) == 128 + signal.SIGTERM
    assert [p.returncode for p in started] == [-signal.SIGTERM]
    assert "stopped by SIGTERM" in capsys.readouterr().err


def test_adopted_processes_are_stopped_too() -> None:
    proc = subprocess.Popen(_SLEEPER, start_new_session=True)
    with procs.ChildProcesses(grace=2.0) as children:
        assert children.adopt(proc) is proc
    assert proc.returncode == -signal.SIGTERM


# -- kvframe.bench.progress ---------------------------------------------------------------


def test_progress_lines_count_and_can_be_silenced(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    progress = Progress("probe", total=2, stream=stream)
    progress.note("starting")
    progress("first")
    progress("second")
    progress("one more than announced")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "kvframe bench probe starting"
    assert lines[1].startswith("kvframe bench probe [1/2, ")
    assert lines[1].endswith("s] first")
    assert lines[3].startswith("kvframe bench probe [3/2, ")
    monkeypatch.setenv("KVFRAME_PROGRESS", "0")
    quiet = io.StringIO()
    Progress("probe", total=1, stream=quiet)("nothing")
    assert quiet.getvalue() == ""
    unknown = io.StringIO()
    Progress("probe", stream=unknown, enabled=True)("a step")
    assert unknown.getvalue().startswith("kvframe bench probe [1, ")


# -- keygen ---------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_file_and_never_overwrites_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvframe.connectors.pd.auth import KeyRing

    path = tmp_path / "fleet.key"
    code, out, _ = _run(capsys, "keygen", str(path), "--key-id", "2026a")
    assert code == 0
    assert "auth_key_file" in out
    assert (path.stat().st_mode & 0o777) == 0o600
    assert KeyRing.from_file(path).signing_id == "2026a"
    before = path.read_bytes()
    code, _, err = _run(capsys, "keygen", str(path))
    assert code == 2
    assert "never overwrites" in err
    assert path.read_bytes() == before
