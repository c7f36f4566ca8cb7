"""One engine (P or D) in its own process, stepping every millisecond, driven over stdin/stdout
with length-prefixed msgpack frames (never pickle). Used by the cross-process P/D tests.

    python -m tests.pd.node ENGINE_ID ROLE LEASE SKEW TRANSPORT [EXTRA_JSON]
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import select
import signal
import struct
import sys
import time
import traceback
from typing import Any

import msgpack

from tests.pd.driver import Driver, view

_LEN = struct.Struct(">I")


def _read_exact(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def main() -> None:
    # Replies go to the pipe that was stdout; fd 1 becomes stderr, because libraries write
    # there (UCX logs its warnings and errors to stdout, NIXL's logger too), and one such line
    # in the pipe breaks the framing: the parent then waits for a reply that never parses.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    # Node.dump_stacks: a node that stops answering prints where every thread is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    engine_id, role, lease, skew, transport = sys.argv[1:6]
    extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    offset = float(skew)

    def clock() -> float:
        return time.monotonic() + offset

    drv = Driver(
        engine_id,
        role,
        lease=float(lease),
        transport=transport,
        clock=clock,
        num_blocks=64,
        extra=extra,
    )
    finished_sending: list[str] = []
    finished_recving: list[str] = []
    invalid: list[int] = []
    failures: dict[str, str] = {}
    counters: dict[str, float] = {}
    times: dict[str, float] = {}
    fd_in = sys.stdin.fileno()

    def reply(obj: Any) -> None:
        data = msgpack.packb(obj, use_bin_type=True)
        out.write(_LEN.pack(len(data)) + data)
        out.flush()

    paused_until = 0.0
    reply({"ready": True, "pid": os.getpid()})
    while True:
        ready, _, _ = select.select([fd_in], [], [], 0.001)
        if ready:
            try:
                (n,) = _LEN.unpack(_read_exact(fd_in, 4))
                cmd = msgpack.unpackb(_read_exact(fd_in, n), raw=False)
            except EOFError:
                break
            op = cmd["op"]
            try:
                if op == "prefill":
                    drv.fill(cmd["blocks"], cmd["seed"])
                    _, params = drv.sched.request_finished(
                        view(
                            cmd["rid"],
                            cmd["tokens"],
                            {"do_remote_decode": True},
                            finish_reason="length",
                        ),
                        (tuple(cmd["blocks"]),),
                    )
                    reply({"params": params})
                elif op == "arrive":
                    drv.sched.on_new_request(
                        view(cmd["rid"], cmd["tokens"], cmd["params"], arrival_time=clock())
                    )
                    reply({})
                elif op == "schedule":
                    req = view(cmd["rid"], cmd["tokens"], cmd["params"])
                    n_ext, _ = drv.sched.get_num_new_matched_tokens(req, 0)
                    if n_ext:
                        drv.sched.update_state_after_alloc(req, (tuple(cmd["blocks"]),), n_ext)
                    reply({"external": n_ext})
                elif op == "abort":
                    delay, _ = drv.sched.request_finished(
                        view(cmd["rid"], cmd["tokens"], cmd["params"], finish_reason="abort"),
                        (tuple(cmd["blocks"]),),
                    )
                    reply({"delay": delay})
                elif op == "digest":
                    h = hashlib.sha256()
                    for t in drv.blocks(cmd["blocks"]):
                        h.update(t.numpy().tobytes())
                    reply({"digest": h.hexdigest()})
                elif op == "poke":
                    drv.fill(cmd["blocks"], cmd["seed"])
                    reply({})
                elif op == "notify":
                    drv.worker.transport.send_notification(cmd["peer"], cmd["payload"])
                    reply({})
                elif op == "status":
                    reply(
                        {
                            "finished_sending": finished_sending,
                            "finished_recving": finished_recving,
                            "invalid": invalid,
                            "failures": failures,
                            "counters": counters,
                            "times": times,
                            "pending": drv.sched.has_pending_work(),
                            "gauges": dict(drv.worker.get_stats().gauges),
                            "transport": dict(drv.worker.transport.stats()),
                            "name": drv.worker.transport.name,
                            "now": clock(),
                        }
                    )
                elif op == "pause":
                    # Stop stepping (no progress, no notifications drained) for a while: an
                    # engine stalled, or idle and not stepping.
                    paused_until = time.monotonic() + float(cmd["seconds"])
                    reply({})
                elif op == "load_state":
                    state = drv.worker.reader.state(cmd["rid"])
                    reply({"state": state.value if state is not None else None})
                elif op == "exit":
                    reply({})
                    break
                else:
                    reply({"error": f"unknown op {op}"})
            except Exception as exc:
                reply({"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
        if time.monotonic() < paused_until:
            continue
        o = drv.step()
        now = time.monotonic()
        for rid in o.finished_sending:
            finished_sending.append(rid)
            times.setdefault(f"sent:{rid}", now)
        for rid in o.finished_recving:
            finished_recving.append(rid)
            times.setdefault(f"recv:{rid}", now)
        invalid.extend(o.invalid_block_ids)
        failures.update(o.failures)
        for k, v in o.stats.counters.items():
            counters[k] = counters.get(k, 0) + v
    drv.shutdown()


if __name__ == "__main__":
    main()
