"""The kit checks notification ordering by bytes: a transport whose post notification reaches the
peer before the bytes land fails it when its card claims ``notification_after_data``, and
passes the whole kit when its card honestly says it does not (the ordering checks are then
reported as skipped, never as passed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from kvframe.errors import ConfigError
from kvframe.spi.transport import Op, Transport, TransportParams, XferState
from kvframe.testing import TransportConformance
from kvframe.testing.conformance import ORDER_BLOCK_LENS, ORDER_NUM_BLOCKS
from kvframe.testing.faults import EarlyNotificationTransport
from kvframe.testing.pair import Pair, PairFactory, make_pair, pair_factory
from kvframe.testing.pytest_plugin import (  # noqa: F401 - the kit's fixtures, for this module
    kvframe_conformance_timeout,
    kvframe_pair,
    kvframe_pair_factory,
    kvframe_transport_spec,
)
from kvframe.transports.inprocess import InProcessFabric, InProcessTransport
from tests.testing.test_kit_catches_bugs import Failure, _spec


@pytest.fixture
def factory_of() -> Iterator[Callable[..., PairFactory]]:
    with_exit: list[Any] = []

    def make(cls: type[InProcessTransport], **options: Any) -> PairFactory:
        ctx = pair_factory(_spec(cls, **options), timeout=2.0)
        with_exit.append(ctx)
        return ctx.__enter__()

    yield make
    for ctx in with_exit:
        ctx.__exit__(None, None, None)


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_the_kit_catches_a_notification_before_the_bytes(
    factory_of: Callable[..., PairFactory], op: Op
) -> None:
    kit = TransportConformance()
    liar = factory_of(EarlyNotificationTransport, notification_after_data=True)
    with pytest.raises(Failure, match="notification_after_data"):
        kit.test_post_notification_arrives_only_after_every_byte(liar, op)


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_the_same_checks_pass_an_ordered_transport(
    factory_of: Callable[..., PairFactory], op: Op
) -> None:
    # the control: without the early notification the very same test passes
    TransportConformance().test_post_notification_arrives_only_after_every_byte(
        factory_of(InProcessTransport), op
    )


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
def test_an_honest_card_makes_the_check_not_applicable(
    factory_of: Callable[..., PairFactory], op: Op
) -> None:
    honest = factory_of(EarlyNotificationTransport)
    with pytest.raises(pytest.skip.Exception, match="not applicable"):
        TransportConformance().test_post_notification_arrives_only_after_every_byte(honest, op)


def test_the_early_transport_really_notifies_before_the_bytes() -> None:
    # what the kit must catch, seen directly: the peer holds the notification while the
    # destination still has its old bytes
    pair = make_pair(_spec(EarlyNotificationTransport), timeout=2.0)
    try:
        assert pair.caps.notification_after_data is False
        before = pair.read_b()
        xid = pair.a.post(Op.WRITE, pair.a_local, [0], pair.a_remote, [1], notification=b"n")
        assert [n.payload for n in pair.b.drain()] == [b"n"]
        assert (pair.read_b() == before).all(), "the bytes landed already"
        assert pair.wait(pair.a, xid) is XferState.DONE
        assert (pair.read_b() != before).any()
        pair.a.release(xid)
    finally:
        pair.close()


def test_the_early_transport_refuses_a_bad_option() -> None:
    with pytest.raises(ConfigError, match="notification_after_data"):
        EarlyNotificationTransport(
            TransportParams(name="x", options={"notification_after_data": "yes"})
        )


def test_a_watch_fires_once_at_receipt() -> None:
    pair = make_pair(_spec(InProcessTransport), timeout=2.0)
    try:
        region = pair.b_layout.regions[0]
        pair.b.watch(b"w", digest=[region], invert=[region])
        before = pair.read_b()
        pair.a.notify(pair.peer_b, b"w")
        pair.a.notify(pair.peer_b, b"w")
        assert len(pair.wait_notifications(pair.b, 2)) == 2
        seen = pair.b.sightings()
        assert list(seen) == [b"w"]
        assert len(seen[b"w"]) == 1
        after = pair.read_b()
        n = region.length
        assert ((after[:n] ^ before[:n]) == 0xFF).all(), "inverted once, not twice"
        assert (after[n:] == before[n:]).all()
        with pytest.raises(ValueError, match="not inside a buffer"):
            pair.b.watch(b"x", invert=[pair.a_layout.regions[0]])
    finally:
        pair.close()


def test_release_by_bytes_catches_a_release_that_does_not_stop(
    factory_of: Callable[..., PairFactory],
) -> None:
    class ReleaseDoesNotStop(InProcessTransport):
        def release(self, handle: Any) -> None:
            handle.native.release()  # marked released, but the copy stays queued

    kit = TransportConformance()
    with pytest.raises(Failure, match="landed after release"):
        kit.test_release_while_pending_stops_the_transfer(factory_of(ReleaseDoesNotStop))


def test_handle_fields_are_checked(factory_of: Callable[..., PairFactory]) -> None:
    class CountsBlocksOnly(InProcessTransport):
        def post(self, *args: Any, **kw: Any) -> Any:
            import attrs

            handle = super().post(*args, **kw)
            return attrs.evolve(handle, num_descriptors=len(args[2]))

    kit = TransportConformance()
    pair = factory_of(CountsBlocksOnly)()
    with pytest.raises(Failure, match="num_descriptors"):
        kit.test_xfer_handle_fields_describe_the_post(pair)


def test_an_inconsistent_card_is_caught(factory_of: Callable[..., PairFactory]) -> None:
    class LimitWithoutNotifications(InProcessTransport):
        def __init__(self, params: TransportParams) -> None:
            import attrs

            super().__init__(params)
            self.capabilities = attrs.evolve(self.capabilities, notifications=False)

    pair: Pair = factory_of(LimitWithoutNotifications)()
    with pytest.raises(Failure, match="max_notification_bytes"):
        TransportConformance().test_capability_card_is_consistent(pair)


def test_the_ordering_layout_is_large() -> None:
    assert sum(ORDER_BLOCK_LENS) * ORDER_NUM_BLOCKS >= 4 << 20
    assert len(ORDER_BLOCK_LENS) * ORDER_NUM_BLOCKS >= 500


# -- the whole kit against the honest early transport --------------------------------------


@pytest.fixture
def kvframe_transport_name() -> str:
    return "early-notification"


@pytest.fixture
def kvframe_transport_options() -> Mapping[str, Any]:
    return {}


@pytest.fixture
def kvframe_transport_factory() -> Callable[[TransportParams], Transport]:
    fabric = InProcessFabric()

    def build(params: TransportParams) -> Transport:
        return EarlyNotificationTransport(
            TransportParams(name=params.name, options={**params.options, "fabric": fabric})
        )

    return build


class TestHonestEarlyNotificationTransport(TransportConformance):
    """Every check of the kit passes (or is skipped as not applicable) for a transport that
    notifies before the bytes land and says so on its card."""
