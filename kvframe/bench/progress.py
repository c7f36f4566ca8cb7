"""Progress lines of the benchmarks, on stderr, so that stdout stays the table or the JSON.

A benchmark makes one :class:`Progress` with the number of measurements it will take and
calls it before each one::

    progress = Progress("offload", total=len(cases))
    for case in cases:
        progress(f"disk write, {case.blocks} blocks of {case.kib} KiB")
        ...

which prints ``kvframe bench offload [3/12, 41 s] disk write, 64 blocks of 256 KiB``.
:meth:`Progress.note` prints a line without counting. ``KVFRAME_PROGRESS=0`` silences every
benchmark (tests that compare stderr may set it).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Numbered progress lines for benchmark ``name``.

    Args:
        name: the benchmark (``"transfer"``); lines start ``kvframe bench NAME``.
        total: how many steps there will be, or ``None`` when that is not known (lines then
            show the step number alone). A run may take more steps than announced; the count
            just goes on.
        stream: where lines go (``sys.stderr`` at the time of each line by default).
        enabled: ``False`` prints nothing; by default on unless ``KVFRAME_PROGRESS=0``.
    """

    def __init__(
        self,
        name: str,
        *,
        total: int | None = None,
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.name = name
        self.total = total
        self.done = 0
        """Steps announced so far."""
        self._stream = stream
        self._enabled = (
            os.environ.get("KVFRAME_PROGRESS", "1") != "0" if enabled is None else enabled
        )
        self._t0 = time.monotonic()

    def __call__(self, what: str) -> None:
        """Announce the next step (``what`` is measured now)."""
        self.done += 1
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        self._emit(f"[{count}, {time.monotonic() - self._t0:.0f} s] {what}")

    def note(self, message: str) -> None:
        """A line outside the count (start-up, where logs go, ...)."""
        self._emit(message)

    def _emit(self, text: str) -> None:
        if not self._enabled:
            return
        stream = self._stream if self._stream is not None else sys.stderr
        print(f"kvframe bench {self.name} {text}", file=stream, flush=True)
