"""P/D over a transport whose post notification may reach the peer before the bytes land.

``EarlyNotificationTransport`` (kvframe.testing.faults) delivers a post's notification when the
READ is posted. With its card saying so (``notification_after_data=False``) the decode side
posts the READ without the notification and sends the done notice itself once it saw the
transfer DONE, so the prefill side frees (and may reuse) the blocks only after every byte
landed. With the card lying, the notice reaches P first and a P that reuses the freed blocks at
once hands D another request's bytes: the harm the capability exists to prevent.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch

import tests.pd.driver as driver_module
from kvframe.core import wire
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.hookspecs import TransportRegistrar, hookimpl
from kvframe.spi.transport import Transport, TransportParams, XferState
from kvframe.testing.faults import EarlyNotificationTransport, Faults
from kvframe.transports.inprocess import InProcessFabric
from tests.pd.driver import Driver, view

NAME = "early-notification"
_ids = itertools.count()


class _EarlyPlugin:
    """Registers ``early-notification`` on one fabric of the test's own."""

    def __init__(self, fabric: InProcessFabric) -> None:
        self.fabric = fabric

    def build(self, params: TransportParams) -> Transport:
        options = {**params.options, "fabric": self.fabric}
        return EarlyNotificationTransport(TransportParams(name=params.name, options=options))

    @hookimpl
    def kvframe_register_transports(self, register: TransportRegistrar) -> None:
        probe = EarlyNotificationTransport(
            TransportParams(name="probe", options={"fabric": InProcessFabric()})
        )
        register(NAME, self.build, capabilities=probe.capabilities)
        probe.close()


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> InProcessFabric:
    fab = InProcessFabric()
    plugin = _EarlyPlugin(fab)

    class Host(PluginHost):
        def load(self, *, strict: bool = False) -> None:
            first = not self.loaded
            super().load(strict=strict)
            if first:
                self.register(plugin, name="test-early-notification")

    monkeypatch.setattr(driver_module, "PluginHost", Host)
    return fab


def _pair(honest: bool, *, optimistic: bool = True) -> tuple[Driver, Driver]:
    n = next(_ids)
    extra: dict[str, Any] = {"transport_options": {"notification_after_data": not honest}}
    p = Driver(f"Pu{n}", "kv_producer", transport=NAME, extra=extra)
    # No endpoint flush READs: the spies below count D's posts.
    d_extra = {**extra, "optimistic_read": optimistic, "flush_endpoints": False}
    d = Driver(f"Du{n}", "kv_consumer", transport=NAME, extra=d_extra)
    return p, d


def _watch(d: Driver, log: list[tuple[str, Any]]) -> None:
    """Record D's posts, polls and sends, in order."""
    t = d.worker.transport
    post, poll, send = t.post, t.poll, t.send_notification

    def posting(*args: Any, **kw: Any) -> Any:
        handle = post(*args, **kw)
        log.append(("post", (handle, kw.get("notification"))))
        return handle

    def polling(handle: Any) -> Any:
        status = poll(handle)
        log.append(("poll", (handle, status.state)))
        return status

    def sending(peer: str, payload: bytes) -> None:
        log.append(("send", payload))
        send(peer, payload)

    t.post, t.poll, t.send_notification = posting, polling, sending  # type: ignore[method-assign]


def _is_done_notice(payload: bytes) -> bool:
    try:
        return isinstance(wire.decode(payload), wire.LeaseDone)
    except Exception:  # another message (a heartbeat) or not one of ours
        return False


def _serve(
    fabric: InProcessFabric, p: Driver, d: Driver, *, reuse: bool
) -> tuple[list[torch.Tensor], int, int]:
    """Prefill r1 on P, load it on D with D's READ held back 40 progress steps; when P frees
    r1's blocks it reuses them at once (``reuse``: new bytes). Returns P's original bytes and
    the step counts at which D finished receiving and P finished sending."""
    blocks, dst = [3, 4, 5], [10, 11, 12]
    p.fill(blocks, seed=11)
    original = p.blocks(blocks)
    _, params = p.sched.request_finished(
        view("r1", 48, {"do_remote_decode": True}, finish_reason="length"), (tuple(blocks),)
    )
    assert params is not None
    p.step()
    Faults.of(fabric).delay_transfers(40, endpoint=d.worker.transport.name)
    req = view("d1", 48, params)
    d.sched.on_new_request(req)
    n, _ = d.sched.get_num_new_matched_tokens(req, 0)
    assert n is not None
    d.sched.update_state_after_alloc(req, (tuple(dst),), n)
    recv_at = send_at = -1
    deadline = time.monotonic() + 10
    for step in itertools.count():
        assert time.monotonic() < deadline, "the load did not finish"
        p_out, d_out = p.step(), d.step()
        if send_at < 0 and "r1" in p_out.finished_sending:
            send_at = step
            if reuse:
                p.fill(blocks, seed=99)  # P reuses the freed blocks for another request
        if recv_at < 0 and "d1" in d_out.finished_recving:
            recv_at = step
        if recv_at >= 0 and send_at >= 0:
            break
        time.sleep(0.001)
    assert not any(o.invalid_block_ids for o in d.outputs)
    got = d.blocks(dst)
    return [a == b for a, b in zip(original, got, strict=True)], recv_at, send_at


def test_an_honest_card_sends_the_done_notice_only_after_done(fabric: InProcessFabric) -> None:
    p, d = _pair(honest=True)
    spy: list[tuple[str, Any]] = []
    try:
        assert d.worker.transport.capabilities.notification_after_data is False
        _watch(d, spy)
        same, recv_at, send_at = _serve(fabric, p, d, reuse=True)
        assert all(bool(s.all()) for s in same), "D got other bytes than r1's"
        assert send_at >= recv_at, "P freed the blocks before D's read completed"
        posts = [v for k, v in spy if k == "post"]
        assert len(posts) == 1
        handle, notification = posts[0]
        assert notification is None, "the READ was posted with its notification"
        done_at = next(i for i, (k, v) in enumerate(spy) if k == "poll" and v == (handle,
                       XferState.DONE))  # fmt: skip
        notices = [i for i, (k, v) in enumerate(spy) if k == "send" and _is_done_notice(v)]
        assert len(notices) == 1, spy
        assert notices[0] > done_at, "the done notice went before the READ was seen DONE"
        consumed = sum(o.stats.counters.get("leases_consumed", 0) for o in p.outputs)
        assert consumed == 1, "P did not free the lease on the notice (it expired instead?)"
        assert not d.sched.has_pending_work()
    finally:
        d.shutdown()
        p.shutdown()


def test_a_lying_card_lets_p_reuse_blocks_before_the_bytes_land(
    fabric: InProcessFabric,
) -> None:
    # what the capability prevents: the notice reaches P at post, P frees and reuses the
    # blocks, and D's late READ copies the new request's bytes (a READ posted once the lease
    # is confirmed carries its notice; an optimistic one never does, see below)
    p, d = _pair(honest=False, optimistic=False)
    try:
        assert d.worker.transport.capabilities.notification_after_data is True
        same, recv_at, send_at = _serve(fabric, p, d, reuse=True)
        assert send_at < recv_at, "P freed the blocks only after D's read completed"
        assert not all(bool(s.all()) for s in same), "D got r1's bytes despite the reuse"
    finally:
        d.shutdown()
        p.shutdown()


def test_an_optimistic_read_sends_its_notice_after_done_even_under_a_lying_card(
    fabric: InProcessFabric,
) -> None:
    # An optimistic READ is posted before the heartbeat that asks P to claim its lease, so its
    # done notice always goes separately once the READ was seen DONE (after that heartbeat):
    # whatever the card says, P frees the blocks only after the bytes landed.
    p, d = _pair(honest=False)
    spy: list[tuple[str, Any]] = []
    try:
        _watch(d, spy)
        same, recv_at, send_at = _serve(fabric, p, d, reuse=True)
        assert all(bool(s.all()) for s in same), "D got other bytes than r1's"
        assert send_at >= recv_at, "P freed the blocks before D's read completed"
        posts = [v for k, v in spy if k == "post"]
        assert len(posts) == 1
        assert posts[0][1] is None, "the optimistic READ was posted with its notification"
        consumed = sum(o.stats.counters.get("leases_consumed", 0) for o in p.outputs)
        assert consumed == 1
    finally:
        d.shutdown()
        p.shutdown()
