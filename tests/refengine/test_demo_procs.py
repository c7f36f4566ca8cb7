"""The demo's child processes: one that exits before it is ready is reported with the end of
its stderr, so a failed start in CI says why."""

from __future__ import annotations

import pytest
from kvframe_refengine.demo import _Proc

from kvframe.runtime.procs import ChildProcesses


def test_a_process_that_exits_before_ready_is_reported_with_its_stderr() -> None:
    with ChildProcesses(grace=2.0) as children:
        proc = _Proc("prefill engine", ["kvframe_refengine.server", "--port", "x"], print, children)
        try:
            with pytest.raises(RuntimeError) as info:
                proc.wait_ready(60)
        finally:
            proc.stop()
    message = str(info.value)
    assert message.startswith("prefill engine exited with status 2; the end of its stderr:")
    assert "--port: invalid int value: 'x'" in message
