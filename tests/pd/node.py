"""One engine (P or D) in its own process, stepping every millisecond, driven over stdin/stdout
with length-prefixed msgpack frames (never pickle). Used by the cross-process P/D tests.

    python -m tests.pd.node ENGINE_ID ROLE LEASE SKEW TRANSPORT [EXTRA_JSON]

EXTRA_JSON is kv_connector_extra_config, plus an optional "_ttl" key for the top-level
decoder_kv_blocks_ttl.
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

from kvframe.core.reader import ReadState
from kvframe.spi.transport import Op, XferHandle, XferStatus
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
    # "_ttl" in EXTRA_JSON: the top-level decoder_kv_blocks_ttl (not a connector extra key).
    ttl = extra.pop("_ttl", None)
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
        ttl=None if ttl is None else float(ttl),
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
    hold: tuple[str, float] | None = None
    # Transfers posted while a "*_posted" hold is armed: polled as pending until the stall.
    frozen: set[int] = set()
    xport = drv.worker.transport
    real_post, real_poll = xport.post, xport.poll

    def post(op: Op, *args: Any, **kw: Any) -> XferHandle:
        handle: XferHandle = real_post(op, *args, **kw)
        if hold is not None and hold[0] == f"{op.value}_posted":
            frozen.add(id(handle))
        return handle

    def poll(handle: XferHandle) -> XferStatus:
        return XferStatus.pending() if id(handle) in frozen else real_poll(handle)

    xport.post = post  # type: ignore[method-assign]
    xport.poll = poll  # type: ignore[method-assign]
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
                    # get_stats() hands over the counts since its last call: keep them, or a
                    # count made since the last step (a refused handshake) would be lost.
                    stats = drv.worker.get_stats()
                    for k, v in stats.counters.items():
                        counters[k] = counters.get(k, 0) + v
                    reply(
                        {
                            "finished_sending": finished_sending,
                            "finished_recving": finished_recving,
                            "invalid": invalid,
                            "failures": failures,
                            "counters": counters,
                            "times": times,
                            "pending": drv.sched.has_pending_work(),
                            "gauges": dict(stats.gauges),
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
                elif op == "address":
                    # P: the fields of a push-mode D leg that name this engine.
                    reply({"address": drv.sched.kv_address()})
                elif op == "push_prefill":
                    # P: finish a request with a push leg (finish_reason "abort": P gave up).
                    drv.fill(cmd["blocks"], cmd["seed"])
                    delay, params = drv.sched.request_finished(
                        view(
                            cmd["rid"],
                            cmd["tokens"],
                            cmd["leg"],
                            finish_reason=cmd.get("finish_reason", "length"),
                        ),
                        (tuple(cmd["blocks"]),),
                    )
                    reply({"delay": delay, "params": params})
                elif op == "push_start":
                    # D: a request with a push leg arrives and gets its blocks at once.
                    req = view(cmd["rid"], cmd["tokens"], cmd["leg"], arrival_time=clock())
                    drv.sched.on_new_request(req)
                    n_ext, is_async = drv.sched.get_num_new_matched_tokens(req, 0)
                    if n_ext:
                        drv.sched.update_state_after_alloc(req, (tuple(cmd["blocks"]),), n_ext)
                    reply({"external": n_ext, "async": is_async})
                elif op == "push_state":
                    # The push machines and the leak oracle's inputs, now.
                    w = drv.worker
                    for k, v in w.get_stats().counters.items():
                        counters[k] = counters.get(k, 0) + v
                    rid = cmd.get("rid")
                    wstate = w.writer.state(rid) if rid is not None else None
                    rstate = w.reader.state(rid) if rid is not None else None
                    reply(
                        {
                            "writer": wstate.value if wstate is not None else None,
                            "reader": rstate.value if rstate is not None else None,
                            "writes": len(w.writer),
                            "writes_posted": w.writer.loads(ReadState.POSTED),
                            "reads": len(w.reader),
                            "push_waiting": len(w.push_source),
                            "leases_live": w.holder.live_count,
                            "pending": drv.sched.has_pending_work(),
                            "counters": counters,
                            "paused": time.monotonic() < paused_until,
                        }
                    )
                elif op == "hold":
                    # Stop stepping for ``seconds`` once ``when`` happened in a step:
                    # "write_posted" / "read_posted" (a WRITE / READ was posted: no poll sees
                    # it complete in that step, so it is in flight when the stall starts) or
                    # "counter:NAME" (the step's counters include NAME, e.g. leases_renewed).
                    hold = (str(cmd["when"]), float(cmd["seconds"]))
                    reply({})
                elif op == "keep_finish":
                    # D, multi-turn: the request generated ``answer`` tokens (the ids after the
                    # prompt's) into ``blocks``, the answer's KV filled from ``seed`` into
                    # ``fill``; it finishes with keep_for_next_turn in ``params``. Replies
                    # whether D keeps the blocks and its history params.
                    drv.fill(cmd.get("fill", []), cmd.get("seed", 0))
                    n = cmd["tokens"]
                    keep, params = drv.sched.request_finished(
                        view(
                            cmd["rid"],
                            n,
                            cmd["params"],
                            finish_reason="stop",
                            output_token_ids=list(range(n, n + cmd["answer"])),
                        ),
                        (tuple(cmd["blocks"]),),
                    )
                    reply({"keep": keep, "params": params})
                elif op == "reclaim":
                    # D, multi-turn: the engine is short of ``blocks`` blocks.
                    reply({"given": drv.sched.reclaim_blocks(cmd["blocks"], clock())})
                elif op == "kept":
                    # D, multi-turn: kept leases nobody claimed, live leases, and per live
                    # lease (by request id): its expiry relative to this engine's clock now,
                    # whether it is still an unclaimed kept lease, its renewals.
                    holder = drv.worker.holder
                    now_c = clock()
                    reply(
                        {
                            "kept": holder.kept_count,
                            "live": holder.live_count,
                            "leases": {
                                lease.payload[0]: {
                                    "expiry": lease.expiry - now_c,
                                    "kept": holder.kept(lease.request_id),
                                    "renewals": lease.renewals,
                                }
                                for lease in holder.table.leases()
                            },
                        }
                    )
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
        if hold is not None:
            when, seconds = hold
            if (when.endswith("_posted") and frozen) or (
                when.startswith("counter:") and o.stats.counters.get(when[8:], 0)
            ):
                paused_until = now + seconds
                hold = None
                frozen.clear()
                times["held"] = now
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
