"""The kit must fail for broken transports: each mutant breaks one promise of the SPI."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import Phase, settings

from kvframe.spi.transport import LayoutHandle, Notification, Op, TransportParams, XferHandle
from kvframe.testing import Pair, TransportConformance, TransportSpec, make_pair
from kvframe.testing.pair import pair_factory
from kvframe.testing.stateful import run_transport_state_machine
from kvframe.transports.inprocess import InProcessFabric, InProcessTransport

Failure = (AssertionError, pytest.fail.Exception)


class ReversedRemoteBlocks(InProcessTransport):
    def post(self, op: Op, local: LayoutHandle, local_blocks: Any, remote: LayoutHandle,
             remote_blocks: Any, **kw: Any) -> XferHandle:  # fmt: skip
        return super().post(op, local, local_blocks, remote, list(remote_blocks)[::-1], **kw)


class IgnoresRegions(InProcessTransport):
    def post(self, op: Op, local: LayoutHandle, local_blocks: Any, remote: LayoutHandle,
             remote_blocks: Any, *, regions: Sequence[int] | None = None,
             notification: bytes | None = None) -> XferHandle:  # fmt: skip
        return super().post(op, local, local_blocks, remote, remote_blocks,
                            notification=notification)  # fmt: skip


class UsableAfterClose(InProcessTransport):
    def local_metadata(self) -> bytes:
        if self.closed:
            return b"still here"
        return super().local_metadata()


class ReversedNotifications(InProcessTransport):
    def drain_notifications(self) -> list[Notification]:
        return super().drain_notifications()[::-1]


class ReleaseDoesNotStop(InProcessTransport):
    def release(self, handle: XferHandle) -> None:
        handle.native.release()  # marked released, but the transfer stays queued and writes later


def _spec(cls: type[InProcessTransport], **options: Any) -> TransportSpec:
    fabric = InProcessFabric()

    def factory(params: TransportParams) -> InProcessTransport:
        return cls(TransportParams(name=params.name, options={"fabric": fabric, **options}))

    return TransportSpec(name=cls.__name__, factory=factory)


@pytest.fixture
def kit() -> TransportConformance:
    return TransportConformance()


@pytest.fixture
def pairs() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def make(cls: type[InProcessTransport], **options: Any) -> Pair:
        pair = make_pair(_spec(cls, **options), timeout=2.0)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


@pytest.mark.parametrize("cls", [ReversedRemoteBlocks, IgnoresRegions])
def test_wrong_bytes_are_caught(
    kit: TransportConformance, pairs: Callable[..., Pair], cls: type[InProcessTransport]
) -> None:
    with pytest.raises(Failure):
        kit.test_transfer_moves_exactly_the_selected_blocks(pairs(cls), Op.READ, 0)


def test_use_after_close_is_caught(kit: TransportConformance, pairs: Callable[..., Pair]) -> None:
    with pytest.raises(Failure, match="local_metadata"):
        kit.test_close_twice_and_use_after_close(pairs(UsableAfterClose))


def test_misordered_notifications_are_caught(
    kit: TransportConformance, pairs: Callable[..., Pair]
) -> None:
    with pytest.raises(Failure):
        kit.test_notifications_arrive_in_order_both_ways(pairs(ReversedNotifications))


def test_slow_transfers_are_caught(kit: TransportConformance, pairs: Callable[..., Pair]) -> None:
    # a transfer that needs more progress steps than the bound allows looks hung
    pair = pairs(InProcessTransport, completion_polls=10**9)
    pair.timeout = 0.2
    with pytest.raises(Failure, match="PENDING"):
        kit.test_empty_transfer_completes(pair)


@pytest.mark.parametrize("cls", [ReversedNotifications, ReleaseDoesNotStop, IgnoresRegions])
def test_state_machine_catches(cls: type[InProcessTransport]) -> None:
    # no shrinking: we only need to know that the machine finds the bug, not the smallest
    # case; derandomized, so a machine that stops finding it fails every time, not sometimes
    fast = settings(phases=[Phase.generate], report_multiple_bugs=False, derandomize=True)
    with pair_factory(_spec(cls), timeout=2.0) as factory, pytest.raises(Failure):
        run_transport_state_machine(factory, base_settings=fast)
