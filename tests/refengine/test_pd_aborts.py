"""Every abort path on D ends with D's blocks freed and the transfer stopped first, and P clean
(issue 20, defect 1), and the counts a failed load reports match what was loaded (defect 3).

Two reference engines over the in-process transport; each path is held in place with a fault
rule or a silent side channel, the request is aborted there, and the leak oracle runs on both
engines. The same paths over NIXL are in ``tests/pd/test_pd_aborts_nixl.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq
from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig

from kvframe.config import KVTransferConfig
from kvframe.core.reader import ReadState
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.transport import XferState, XferStatus
from kvframe.testing.faults import Faults

MODEL = ModelConfig(seed=5)
_ids = itertools.count()
LEASE = 1.2


def _engine(role: str, engine_id: str, host: PluginHost, **extra: Any) -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_lease_duration": LEASE,
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"transport": "inprocess", **extra},
        }
    )
    cfg = EngineConfig(model=MODEL, block_size=8, num_blocks=64)
    return Engine(cfg, kv, plugin_host=host)


@pytest.fixture
def pd() -> Iterator[tuple[Engine, Engine]]:
    host = PluginHost(autoload=False, env={})
    host.load()
    n = next(_ids)
    p = _engine("kv_producer", f"abortP{n}", host)
    # No lease table: the loads here wait for P's acknowledgement (aborts while they do).
    d = _engine("kv_consumer", f"abortD{n}", host, handshake_timeout=3.0, lease_table_slots=0)
    yield p, d
    d.shutdown()
    p.shutdown()


def _prompt(seed: int, n: int = 33) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


def _prefill(p: Engine, rid: str, prompt: list[int]) -> dict[str, Any]:
    p.add_request(rid, prompt, 1, {"do_remote_decode": True})
    for _ in range(200):
        for out in p.step():
            if out.request_id == rid and out.finished:
                assert out.kv_transfer_params is not None
                return dict(out.kv_transfer_params)
    raise AssertionError("prefill did not finish")


def _step_until(engines: list[Engine], cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        for e in engines:
            e.step()
        time.sleep(0.001)


def _settle(engines: list[Engine], timeout: float = 6.0) -> None:
    """Step until no engine has unfinished work (leases expire within LEASE)."""
    _step_until(engines, lambda: not any(e.has_unfinished_work() for e in engines), timeout)


def _load_state(d: Engine, rid: str) -> ReadState | None:
    worker: Any = d.connector_worker
    state: ReadState | None = worker.reader.state(rid)
    return state


def _d_transport(d: Engine) -> Any:
    worker: Any = d.connector_worker
    return worker.transport


def _finished(engines: list[Engine], d: Engine, rid: str, timeout: float = 5.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        assert time.monotonic() < end, f"{rid} did not finish in time"
        for e in engines:
            for out in e.step():
                if e is d and out.request_id == rid and out.finished:
                    return out
        time.sleep(0.001)


def _abort_and_check(p: Engine, d: Engine, rid: str) -> None:
    assert d.abort(rid)
    _step_until([p, d], lambda: not d.has_unfinished_work(), timeout=3.0)
    d.check_no_leaks()
    _settle([p, d])
    p.check_no_leaks()
    d.check_no_leaks()


def test_abort_before_scheduling(pd: tuple[Engine, Engine]) -> None:
    p, d = pd
    params = _prefill(p, "r", _prompt(1))
    d.add_request("d", _prompt(1), 4, params)
    assert d.abort("d")
    _step_until([p, d], lambda: not d.has_unfinished_work(), timeout=3.0)
    d.check_no_leaks()
    # The release reached P: it frees at once, long before the lease would expire.
    t0 = time.monotonic()
    _settle([p, d])
    assert time.monotonic() - t0 < LEASE
    p.check_no_leaks()


def test_abort_while_waiting_for_the_peer(pd: tuple[Engine, Engine]) -> None:
    p, d = pd
    params = _prefill(p, "r", _prompt(2))
    # A side channel that accepts the connection and never answers: the handshake hangs.
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        params = {**params, "remote_port": port}
        params.pop("remote_ports", None)
        d.add_request("d", _prompt(2), 4, params)
        _step_until([p, d], lambda: _load_state(d, "d") is ReadState.WAITING_PEER)
        _abort_and_check(p, d, "d")  # P's lease expires: D never reached it
    finally:
        silent.close(linger=0)


def test_abort_while_waiting_for_the_lease(pd: tuple[Engine, Engine]) -> None:
    p, d = pd
    params = _prefill(p, "r", _prompt(3))
    # Everything D sends to P is lost: the lease is never confirmed. The READ posted beside
    # the heartbeat (optimistic_read) completed and waits for the confirmation.
    rule = Faults.of(_d_transport(d).fabric).drop_notifications(endpoint=_d_transport(d).name)
    d.add_request("d", _prompt(3), 4, params)
    _step_until([p, d], lambda: _load_state(d, "d") is ReadState.VERIFYING)
    rule.cancel()
    _abort_and_check(p, d, "d")


def test_abort_while_waiting_for_the_lease_without_optimistic_reads() -> None:
    host = PluginHost(autoload=False, env={})
    host.load()
    n = next(_ids)
    p = _engine("kv_producer", f"abortP{n}", host)
    # No endpoint flush READs either (flush_endpoints): the check below counts D's READs.
    d = _engine(
        "kv_consumer",
        f"abortD{n}",
        host,
        handshake_timeout=3.0,
        optimistic_read=False,
        flush_endpoints=False,
    )
    try:
        params = _prefill(p, "r", _prompt(3))
        rule = Faults.of(_d_transport(d).fabric).drop_notifications(endpoint=_d_transport(d).name)
        d.add_request("d", _prompt(3), 4, params)
        _step_until([p, d], lambda: _load_state(d, "d") is ReadState.CONFIRMING)
        assert _d_transport(d).stats().get("transfers_posted", 0) == 0  # waits for the ack
        rule.cancel()
        _abort_and_check(p, d, "d")
    finally:
        d.shutdown()
        p.shutdown()


@pytest.mark.parametrize("when", ["after_the_first_read", "at_the_same_time"])
def test_a_ticket_replayed_to_another_decoder_is_never_trusted(when: str) -> None:
    """A router retry sends the same kv_transfer_params to a second decoder, after the first
    one read them (P consumed the lease, freed the blocks and reused them) or at the same time
    (the first decoder to ask claims the lease). The second decoder posts its READ before P
    answers (optimistic_read, the default), and P's answer (consumed, or claimed by the
    other) fails the load: its bytes are never decoded."""
    host = PluginHost(autoload=False, env={})
    host.load()
    n = next(_ids)
    p = _engine("kv_producer", f"replayP{n}", host)
    d1 = _engine("kv_consumer", f"replayD{n}", host, handshake_timeout=3.0)
    d2 = _engine("kv_consumer", f"replayE{n}", host, handshake_timeout=3.0)
    engines = [p, d1, d2]
    try:
        # Connect d2 to P first (a load of another prompt), so that its replayed load below
        # posts at once, beside its heartbeat.
        warm = _prompt(70, 40)
        d2.add_request("warm", warm, 2, _prefill(p, "w", warm))
        assert _finished(engines, d2, "warm").finish_reason is FinishReason.LENGTH
        prompt = _prompt(71, 40)
        params = _prefill(p, "r", prompt)
        d1.add_request("d1", prompt, 4, params)
        if when == "after_the_first_read":
            first = _finished(engines, d1, "d1")
            assert first.finish_reason is FinishReason.LENGTH
            _settle(engines)  # P consumed the lease and freed the blocks
            for i in range(3):  # P reuses the blocks for other prompts
                _prefill(p, f"other{i}", _prompt(200 + i, 40))
            d2.add_request("d2", prompt, 4, params)
            second = _finished(engines, d2, "d2")
        else:
            d2.add_request("d2", prompt, 4, params)
            outs: dict[str, Any] = {}
            end = time.monotonic() + 5.0
            while len(outs) < 2:
                assert time.monotonic() < end, "the two loads did not finish"
                for e in engines:
                    for out in e.step():
                        if out.request_id in ("d1", "d2") and out.finished:
                            outs[out.request_id] = out
                time.sleep(0.001)
            reasons = sorted(o.finish_reason.name for o in outs.values())
            assert reasons == ["ERROR", "LENGTH"], "one decoder reads, the other is refused"
            first, second = sorted(outs.values(), key=lambda o: o.finish_reason.name != "LENGTH")
        assert second.finish_reason is FinishReason.ERROR, "a replayed ticket was trusted"
        assert second.num_external_tokens == 0
        stats = (d2 if second.request_id == "d2" else d1).connector_stats()
        if when == "after_the_first_read":
            assert stats.get("reads_posted_early", 0) >= 1  # the replay's READ was posted
            assert "consumed" in (second.error or "")
        _settle(engines)
        for e in engines:
            e.check_no_leaks()
    finally:
        d2.shutdown()
        d1.shutdown()
        p.shutdown()


def test_abort_with_the_transfer_in_flight(pd: tuple[Engine, Engine]) -> None:
    p, d = pd
    params = _prefill(p, "r", _prompt(4))
    faults = Faults.of(_d_transport(d).fabric)
    rule = faults.delay_transfers(10_000, endpoint=_d_transport(d).name)
    d.add_request("d", _prompt(4), 4, params)
    _step_until([p, d], lambda: _load_state(d, "d") is ReadState.POSTED)
    _abort_and_check(p, d, "d")
    rule.cancel()
    # The transfer was stopped before the blocks were freed: not a byte of it ever landed.
    stats = _d_transport(d).stats()
    assert stats.get("transfers_done", 0) == 0
    assert stats.get("bytes_read", 0) == 0


def test_abort_with_the_transfer_done_but_not_reported(
    pd: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d = pd
    params = _prefill(p, "r", _prompt(5))
    transport = _d_transport(d)
    real_poll = transport.poll
    hide = {"on": True}
    landed: set[int] = set()  # the KV READs seen done (not the endpoint flush READs)

    def poll(handle: Any) -> Any:
        state = real_poll(handle)  # the copy happens here ...
        if state.state is XferState.DONE and handle.nbytes > 64:
            landed.add(id(handle))
        return XferStatus.pending() if hide["on"] else state  # ... and the worker is not told

    monkeypatch.setattr(transport, "poll", poll)
    d.add_request("d", _prompt(5), 4, params)
    _step_until([p, d], lambda: len(landed) == 1)
    assert _load_state(d, "d") is ReadState.POSTED
    _abort_and_check(p, d, "d")
    hide["on"] = False


def test_a_failed_load_reports_no_external_tokens(pd: tuple[Engine, Engine]) -> None:
    p, d = pd
    prompt = _prompt(6, 50)
    params = _prefill(p, "r", prompt)
    Faults.of(_d_transport(d).fabric).fail_transfers(endpoint=_d_transport(d).name, written=0.5)
    d.add_request("d", prompt, 4, params)
    out = _finished([p, d], d, "d")
    assert out.finish_reason is FinishReason.ERROR
    assert out.num_external_tokens == 0  # nothing was loaded (it was 49 before the fix)
    _settle([p, d])
    p.check_no_leaks()
    d.check_no_leaks()


def test_a_replayed_ticket_is_refused_and_never_decodes_reused_blocks(
    pd: tuple[Engine, Engine],
) -> None:
    """The router-retry defect: the same kv_transfer_params sent to D a second time after D
    read and P freed and reused the blocks, still inside the initial lease window."""
    p, d = pd
    prompt = _prompt(7, 40)
    params = _prefill(p, "r", prompt)
    d.add_request("d1", prompt, 4, params)
    assert _finished([p, d], d, "d1").finish_reason is FinishReason.LENGTH
    _settle([p, d])  # P consumed the lease and freed the blocks
    # P reuses the blocks for other prompts.
    for i in range(3):
        _prefill(p, f"other{i}", _prompt(100 + i, 40))
    d.add_request("d2", prompt, 4, params)  # the retry, well inside lease_expires_at
    out = _finished([p, d], d, "d2")
    assert out.finish_reason is FinishReason.ERROR, "a replayed ticket was read"
    assert "ticket" in (out.error or "") or "consumed" in (out.error or "")
    stats = d.connector_stats()
    assert stats.get("loads_done", 0) == 1
    _settle([p, d])
    p.check_no_leaks()
    d.check_no_leaks()
