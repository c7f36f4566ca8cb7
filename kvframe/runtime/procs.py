"""Child processes that do not outlive the command that started them.

The demo and the benchmarks start engines, routers and helper processes. Two rules keep a
signal from leaving any of them behind:

- **Each child starts in its own session** (:meth:`ChildProcesses.popen`), so it leads a
  process group that holds it and everything it starts. The whole group is signalled at once,
  and a Ctrl-C at the terminal reaches only the command itself, which then stops the children
  in order (instead of every process dying at once and the parent reporting the broken
  connections as failures).
- **SIGINT, SIGTERM and SIGHUP stop everything first, then unwind**
  (:func:`stop_on_signals`): the handler stops every open :class:`ChildProcesses` (SIGTERM to
  each group, ``grace`` seconds, then SIGKILL) and raises :class:`Stopped` in the main
  thread, so ``finally`` blocks run and threads blocked on a child's socket return at once. A
  second signal while stopping skips what is left of the grace period. :func:`run_main` wraps
  a command: the signal becomes a one-line message and exit status ``128 + signal``.

Temporary directories made with :meth:`ChildProcesses.mkdtemp` are removed when the children
are stopped (on close, on a signal, at interpreter exit).

Threads: the registry of open :class:`ChildProcesses` is shared by the threads that create
and close them and by the signal handler (which runs in the main thread); a lock guards it.
A :class:`ChildProcesses` itself is used by one thread at a time, except :meth:`stop`, which a
signal may call while the owning thread is inside another method: stopping twice is harmless.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NamedTuple

__all__ = [
    "SIGNALS",
    "ChildProcesses",
    "ProcStat",
    "Stopped",
    "descendants",
    "live_processes",
    "proc_stat",
    "run_main",
    "still_running",
    "stop_on_signals",
]

#: The signals :func:`stop_on_signals` turns into :class:`Stopped`.
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """The command was stopped by a signal; every registered child process was already stopped
    when this is raised.

    A ``BaseException`` (as ``KeyboardInterrupt`` is), so ``except Exception`` in code that
    reports failures does not swallow it. Nothing is left to clean up but the caller's own
    ``finally`` blocks.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        """The signal's number."""
        super().__init__(f"stopped by {self.signal_name}")

    @property
    def signal_name(self) -> str:
        """``"SIGTERM"``, ``"SIGINT"``, ..."""
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    @property
    def exit_status(self) -> int:
        """``128 + signum``, the shell's status for a command ended by that signal."""
        return 128 + self.signum


_lock = threading.RLock()  # the signal handler may run while the main thread holds it
_open: list[ChildProcesses] = []
_stopping: int | None = None  # the signal being handled, while stop_on_signals is active
_hurry = threading.Event()  # a second signal: no more grace
# While the main thread is between starting a child and registering it, a signal waits: the
# handler would otherwise stop everything but that child and unwind past its registration.
_starting = 0
_deferred: int | None = None


class ProcStat(NamedTuple):
    """What ``/proc/PID/stat`` says of a process (Linux)."""

    state: str
    """``R``, ``S``, ... ``Z`` (a zombie), ``X`` (dead)."""
    ppid: int
    pgrp: int
    start: str
    """Its start time in clock ticks since boot: with the pid, names one process for good."""

    @property
    def live(self) -> bool:
        """Neither a zombie nor dead."""
        return self.state not in ("Z", "X")


def proc_stat(pid: int) -> ProcStat | None:
    """``pid``'s :class:`ProcStat`, or ``None`` when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command, which may hold ")"
        return ProcStat(fields[0].decode(), int(fields[1]), int(fields[2]), fields[19].decode())
    except (OSError, IndexError, ValueError):
        return None


def live_processes() -> dict[int, ProcStat]:
    """Every live process in ``/proc`` (empty without /proc)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    out = {}
    for entry in entries:
        if entry.isdigit() and (st := proc_stat(int(entry))) is not None and st.live:
            out[int(entry)] = st
    return out


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root`` (children, theirs, ...): pid -> start time, so that a
    later check (:func:`still_running`) cannot mistake a reused pid for one of them."""
    table = live_processes()
    out: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, st in table.items():
            if st.ppid == parent and pid not in out:
                out[pid] = st.start
                frontier.append(pid)
    return out


def still_running(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` (see :func:`descendants`) is
    alive and not a zombie."""
    st = proc_stat(pid)
    return st is not None and st.start == start and st.live


def _group_alive(pgid: int, groups: set[int] | None) -> bool:
    """Whether a process other than a zombie is in group ``pgid``, given ``groups``, the
    process groups of every live process (:func:`_live_groups`). On Linux from /proc: a
    leader that exited but is not reaped yet (its ``Popen`` may be locked by the thread a
    signal interrupted) is a zombie, and ``killpg(pgid, 0)`` would still find it; without
    /proc (``groups`` is ``None``) that is what it asks."""
    if groups is not None:
        return pgid in groups
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _live_groups() -> set[int] | None:
    """The process groups of every live process, ``None`` without /proc."""
    table = live_processes()
    return {st.pgrp for st in table.values()} if table else None


def _exited(proc: subprocess.Popen[Any]) -> bool:
    if proc.returncode is not None:
        return True
    try:  # WNOWAIT: look without reaping (Popen reaps it; its lock may be taken)
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped meanwhile, or not our child (adopted): ask poll
        return proc.poll() is not None


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class ChildProcesses:
    """The processes (each leading its own process group) and temporary directories one
    command owns. Use it as a context manager, or call :meth:`stop`.

    Args:
        grace: seconds between SIGTERM and SIGKILL when stopping.

    While open it is registered, so a signal caught by :func:`stop_on_signals` (or the
    interpreter's exit) stops it too.
    """

    def __init__(self, *, grace: float = 5.0) -> None:
        self.grace = grace
        self._procs: list[subprocess.Popen[Any]] = []
        self._dirs: list[Path] = []
        self._stopped = False
        with _lock:
            _open.append(self)

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` began (a command may then stay quiet about failures that
        the stopping causes)."""
        return self._stopped

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen(args, **kwargs)`` in a new session (``start_new_session`` is
        forced on), registered here. Raises what ``Popen`` raises; :class:`RuntimeError` once
        stopping (nothing is started then)."""
        global _starting, _deferred
        if self._stopped:
            raise RuntimeError("ChildProcesses is stopped; it starts nothing more")
        kwargs["start_new_session"] = True
        main = threading.current_thread() is threading.main_thread()
        _starting += main
        try:
            proc: subprocess.Popen[Any] = subprocess.Popen(list(args), **kwargs)
            self._procs.append(proc)
        finally:
            _starting -= main
            if main and not _starting and _deferred is not None:
                signum, _deferred = _deferred, None
                _handler(signum, None)  # now the child is registered: stop it with the rest
        if self.stopping:  # stopped by a signal while another thread was starting this one
            self.stop()
        return proc

    def adopt(self, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        """Register a process started elsewhere (ideally with ``start_new_session=True``: then
        its whole group is stopped, otherwise the process alone); returns it."""
        self._procs.append(proc)
        if self._stopped:
            self.stop()
        return proc

    def mkdtemp(self, prefix: str) -> Path:
        """A new temporary directory, removed (with everything in it) by :meth:`stop`."""
        path = Path(tempfile.mkdtemp(prefix=prefix))
        self._dirs.append(path)
        return path

    def keep(self, path: Path) -> None:
        """Do not remove ``path`` (one of :meth:`mkdtemp`'s) when stopping: for logs a failure
        message points to."""
        with contextlib.suppress(ValueError):
            self._dirs.remove(path)

    def pids(self) -> list[int]:
        """The process ids of the registered children that are still running."""
        return [p.pid for p in self._procs if not _exited(p)]

    def _groups(self) -> list[tuple[subprocess.Popen[Any], int | None]]:
        out: list[tuple[subprocess.Popen[Any], int | None]] = []
        for p in self._procs:
            try:
                pgid: int | None = p.pid if _exited(p) else os.getpgid(p.pid)
            except ProcessLookupError:
                pgid = p.pid
            # Only a group the child leads is ours to signal (not the caller's own group).
            out.append((p, pgid if pgid == p.pid and pgid != os.getpgrp() else None))
        return out

    def _alive(self, groups: list[tuple[subprocess.Popen[Any], int | None]]) -> bool:
        live: set[int] | None = None  # one scan of /proc for all the groups
        scanned = False
        alive = False
        for p, pgid in groups:
            if not _exited(p):
                alive = True
            elif pgid is not None:
                if not scanned:
                    live, scanned = _live_groups(), True
                alive = alive or _group_alive(pgid, live)
        return alive

    def _send(self, groups: list[tuple[subprocess.Popen[Any], int | None]], sig: int) -> None:
        for p, pgid in groups:
            if pgid is not None:
                _signal_group(pgid, sig)
            elif not _exited(p):
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    def _wait(
        self, groups: list[tuple[subprocess.Popen[Any], int | None]], secs: float, hurry: bool
    ) -> bool:
        deadline = time.monotonic() + secs
        while self._alive(groups):
            if time.monotonic() >= deadline or (hurry and _hurry.is_set()):
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        """Stop every child: SIGTERM to each group, up to ``grace`` seconds, SIGKILL to what
        is left; then remove the temporary directories. Never raises; may be called again
        (it then stops what was adopted since)."""
        self._stopped = True
        groups = self._groups()
        if self._alive(groups):
            self._send(groups, signal.SIGTERM)
            if not self._wait(groups, self.grace, hurry=True):
                self._send(groups, signal.SIGKILL)
                self._wait(groups, 5.0, hurry=False)
        for p, _ in groups:
            p.poll()  # reap it (unless its Popen is locked: then its owner will)
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._dirs.clear()

    def close(self) -> None:
        """:meth:`stop`, then unregister. Never raises."""
        self.stop()
        with _lock, contextlib.suppress(ValueError):
            _open.remove(self)

    def __enter__(self) -> ChildProcesses:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _stop_all() -> None:
    with _lock:
        groups = list(_open)
    for g in groups:
        g.stop()


atexit.register(_stop_all)


def _handler(signum: int, frame: FrameType | None) -> None:
    global _stopping, _deferred
    if _starting:
        _deferred = signum  # handled as soon as the child being started is registered
        return
    if _stopping is not None:
        _hurry.set()  # already stopping: SIGKILL what is left, let the unwinding go on
        return
    _stopping = signum
    _stop_all()
    raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP stop every open :class:`ChildProcesses`
    and then raise :class:`Stopped` in the main thread. The previous handlers come back on
    exit. Does nothing outside the main thread, or when already active (it nests)."""
    global _stopping
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is _handler
    ):
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _stopping = None
    _hurry.clear()
    for s in SIGNALS:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _stopping = None
        _hurry.clear()


def run_main(name: str, main: Callable[[], int]) -> int:
    """Run ``main()`` under :func:`stop_on_signals`; returns its status, or, when a signal
    stopped it, prints ``"NAME: stopped by SIGTERM; ..."`` on stderr and returns ``128 +
    signal``. A ``KeyboardInterrupt`` (another handler's Ctrl-C) counts as SIGINT."""
    try:
        with stop_on_signals():
            return main()
    except Stopped as exc:
        stopped = exc
    except KeyboardInterrupt:
        _stop_all()
        stopped = Stopped(signal.SIGINT)
    print(
        f"{name}: {stopped}; every process it started has been stopped",
        file=sys.stderr,
        flush=True,
    )
    return stopped.exit_status
