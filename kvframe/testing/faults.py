"""Fault injection for the in-process transport: rules that drop, delay or corrupt
notifications, fail or delay transfers, or make an endpoint vanish.

:class:`Faults` is a :class:`~kvframe.transports.inprocess.FabricHooks`: the fabric asks it
before every transfer moves its bytes and before every notification is queued. Get a fabric's
with :meth:`Faults.of`, which installs one on first use — also on a fabric a connector built
for itself, or the default fabric::

    from kvframe.testing.faults import Faults
    from kvframe.transports.inprocess import InProcessFabric

    fabric = InProcessFabric()
    faults = Faults.of(fabric)
    faults.fail_transfers(peer="P", nth=2, written=0.5)  # 2nd transfer to P: half lands
    faults.drop_notifications(endpoint="D", when=lambda e: e.payload == b"done")
    faults.vanish("P")  # every transfer with P fails

Rules select operations by endpoint, by peer, by operation, by the n-th matching operation or
by a predicate over a :class:`FaultEvent`. Nothing here reads a clock: delays are counted in
progress steps, so tests are deterministic.

:class:`EarlyNotificationTransport` is an in-process transport that delivers a post's
notification when the transfer is *posted*, before its bytes land, as a backend that notifies
on issue would: the conformance kit must catch it when its card claims
``notification_after_data``, and a connector must work over it when the card honestly says it
does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from kvframe.errors import ConfigError
from kvframe.spi import transport_kit as kit
from kvframe.spi.transport import LayoutHandle, Op, TransportParams, XferHandle
from kvframe.transports.inprocess import (
    FabricHooks,
    InProcessFabric,
    InProcessTransport,
    NotificationVerdict,
    TransferVerdict,
)

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["EarlyNotificationTransport", "FaultEvent", "FaultRule", "Faults"]


@attrs.frozen(kw_only=True)
class FaultEvent:
    """One operation as fault rules see it."""

    kind: Literal["transfer", "notification"]
    endpoint: str
    """The endpoint that posted the transfer or sent the notification."""
    peer: str
    """The other endpoint: the transfer's remote side or the notification's receiver."""
    op: Op | None = None
    """``READ`` or ``WRITE`` for a transfer; ``None`` for a notification."""
    nbytes: int = 0
    """Bytes the transfer moves, or the notification's payload size."""
    payload: bytes | None = None
    """The notification's payload (``None`` for a transfer)."""


_Action = Literal["drop", "delay", "corrupt", "fail", "delay_transfer"]


def _flip_bits(payload: bytes) -> bytes:
    return bytes(b ^ 0xFF for b in payload) if payload else b"\xff"


@attrs.define(eq=False)
class _Counts:
    matched: int = 0
    fired: int = 0
    active: bool = True


@attrs.define(eq=False, kw_only=True, on_setattr=attrs.setters.frozen)
class FaultRule:
    """One rule of a :class:`Faults` object; returned by the methods that add rules.

    A rule *matches* an event when every given selector agrees (``endpoint``, ``peer``,
    ``op``, ``when``). It *fires* on every match, or only on the ``nth`` match (1-based) when
    ``nth`` is given, and at most ``times`` times when ``times`` is given. Its settings are
    fixed when it is made (setting one raises ``attrs.exceptions.FrozenAttributeError``);
    :attr:`matched` and :attr:`fired` count what happened so far; :meth:`cancel` removes it.
    """

    action: _Action
    kind: Literal["transfer", "notification"]
    endpoint: str | None = None
    peer: str | None = None
    op: Op | None = None
    nth: int | None = None
    when: Callable[[FaultEvent], bool] | None = None
    times: int | None = None
    polls: int = 0
    """Delay in progress steps (for the delay actions)."""
    written: float = 0.0
    """Fraction of descriptors copied before an injected transfer failure."""
    corrupt: Callable[[bytes], bytes] = _flip_bits
    _counts: _Counts = attrs.field(factory=_Counts, init=False, repr=False)
    _owner: Faults | None = attrs.field(default=None, repr=False, alias="owner")

    @property
    def matched(self) -> int:
        """How many events matched the selectors so far."""
        return self._counts.matched

    @property
    def fired(self) -> int:
        """How many times the rule acted so far."""
        return self._counts.fired

    @property
    def active(self) -> bool:
        """False once cancelled."""
        return self._counts.active

    def cancel(self) -> None:
        """Remove the rule; later operations are not affected by it. Idempotent."""
        self._counts.active = False
        if self._owner is not None:
            self._owner._forget(self)

    def _check(self, event: FaultEvent) -> bool:
        counts = self._counts
        if not counts.active or event.kind != self.kind:
            return False
        if self.endpoint is not None and event.endpoint != self.endpoint:
            return False
        if self.peer is not None and event.peer != self.peer:
            return False
        if self.op is not None and event.op is not self.op:
            return False
        if self.when is not None and not self.when(event):
            return False
        counts.matched += 1
        if self.nth is not None and counts.matched != self.nth:
            return False
        if self.times is not None and counts.fired >= self.times:
            return False
        counts.fired += 1
        return True


def _check_selectors(nth: int | None, times: int | None) -> None:
    if nth is not None and nth < 1:
        raise ValueError(f"nth={nth}: operations are counted from 1")
    if times is not None and times < 1:
        raise ValueError(f"times={times}: a rule must be allowed to fire at least once")


def _check_polls(polls: int) -> None:
    if polls < 1:
        raise ValueError(f"polls={polls}: a delay must be at least one progress step")


class Faults(FabricHooks):
    """Fault injection for one :class:`~kvframe.transports.inprocess.InProcessFabric`.

    Every method that adds a rule takes the same selectors — ``endpoint`` (the posting or
    sending side), ``peer`` (the other side), ``nth`` (fire only on the n-th matching
    operation, counted from 1), ``when`` (a predicate over a :class:`FaultEvent`) and ``times``
    (fire at most that often) — and returns the :class:`FaultRule`, which counts matches and
    can be cancelled. Rules apply in the order they were added. Raises ``ValueError`` for a
    selector or parameter out of range; then no rule was added.
    """

    def __init__(self) -> None:
        """No rules, nothing vanished. Install it with :meth:`of` or
        ``InProcessFabric(hooks=...)``."""
        self._rules: list[FaultRule] = []
        self._vanished: set[str] = set()

    @classmethod
    def of(cls, fabric: InProcessFabric) -> Faults:
        """The fabric's fault rules, installed as its hooks on first use.

        Raises ``ValueError`` when the fabric has other (non-default) hooks installed.
        """
        hooks = fabric.hooks
        if isinstance(hooks, Faults):
            return hooks
        if type(hooks) is not FabricHooks:
            raise ValueError(
                f"the fabric has other hooks installed ({type(hooks).__name__}); "
                "Faults.of only replaces the default ones"
            )
        faults = cls()
        fabric.hooks = faults
        return faults

    # -- notifications ----------------------------------------------------------------------
    def drop_notifications(
        self,
        *,
        endpoint: str | None = None,
        peer: str | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Lose matching notifications silently (the send still returns normally)."""
        return self._add("drop", "notification", endpoint, peer, None, nth, when, times)

    def delay_notifications(
        self,
        polls: int,
        *,
        endpoint: str | None = None,
        peer: str | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Hold matching notifications back for ``polls`` progress steps of the receiver.

        Later notifications from the same sender wait behind a delayed one (order per sender
        is kept, as on a real link that stalls and then delivers a burst).
        """
        _check_polls(polls)
        return self._add(
            "delay", "notification", endpoint, peer, None, nth, when, times, polls=polls
        )

    def corrupt_notifications(
        self,
        corrupt: Callable[[bytes], bytes] = _flip_bits,
        *,
        endpoint: str | None = None,
        peer: str | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Replace matching payloads by ``corrupt(payload)`` (default: every bit flipped)."""
        return self._add(
            "corrupt", "notification", endpoint, peer, None, nth, when, times, corrupt=corrupt
        )

    # -- transfers --------------------------------------------------------------------------
    def fail_transfers(
        self,
        *,
        written: float = 0.0,
        endpoint: str | None = None,
        peer: str | None = None,
        op: Op | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Make matching transfers fail with :class:`~kvframe.errors.TransferFailedError`.

        ``written`` is the fraction of the transfer's descriptors copied before it fails
        (0.0: no byte lands; 0.5: the first half lands). Its notification is not sent.
        """
        if not 0.0 <= written <= 1.0:
            raise ValueError(f"written={written}: give a fraction between 0.0 and 1.0")
        return self._add("fail", "transfer", endpoint, peer, op, nth, when, times, written=written)

    def delay_transfers(
        self,
        polls: int,
        *,
        endpoint: str | None = None,
        peer: str | None = None,
        op: Op | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Make matching transfers take ``polls`` more progress steps to complete."""
        _check_polls(polls)
        return self._add(
            "delay_transfer", "transfer", endpoint, peer, op, nth, when, times, polls=polls
        )

    # -- peers ------------------------------------------------------------------------------
    def vanish(self, endpoint: str) -> None:
        """Cut ``endpoint`` off, as if its process died: every transfer with it (either way)
        fails with :class:`~kvframe.errors.PeerUnreachableError` on the next progress step,
        new posts, notifications and ``add_peer`` with it raise it, and notifications it sent
        that were not yet drained are lost. The endpoint itself stays open."""
        self._vanished.add(endpoint)

    def restore(self, endpoint: str) -> None:
        """Undo :meth:`vanish`. Transfers that already failed stay failed; as after a real
        outage, peers should ``add_peer`` again to reconnect."""
        self._vanished.discard(endpoint)

    def is_vanished(self, endpoint: str) -> bool:
        """Whether :meth:`vanish` cut ``endpoint`` off."""
        return endpoint in self._vanished

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        """The active rules, in the order they apply."""
        return tuple(self._rules)

    def clear(self) -> None:
        """Cancel every rule and restore every vanished endpoint."""
        for rule in list(self._rules):
            rule.cancel()
        self._vanished.clear()

    # -- the hooks the fabric calls ---------------------------------------------------------
    def transfer(self, *, endpoint: str, peer: str, op: Op, nbytes: int) -> TransferVerdict:
        """Apply the transfer rules: the first failing rule fails it, delays add up."""
        event = FaultEvent(kind="transfer", endpoint=endpoint, peer=peer, op=op, nbytes=nbytes)
        delay, fail_after = 0, None
        for rule in self._firing(event):
            if rule.action == "fail" and fail_after is None:
                fail_after = rule.written
            elif rule.action == "delay_transfer":
                delay += rule.polls
        return TransferVerdict(delay=delay, fail_after=fail_after)

    def notification(self, *, endpoint: str, peer: str, payload: bytes) -> NotificationVerdict:
        """Apply the notification rules in order: a drop wins, corruptions chain, delays add
        up."""
        event = FaultEvent(
            kind="notification", endpoint=endpoint, peer=peer, nbytes=len(payload), payload=payload
        )
        delay = 0
        for rule in self._firing(event):
            if rule.action == "drop":
                return NotificationVerdict(payload=None)
            if rule.action == "corrupt":
                payload = bytes(rule.corrupt(payload))
            elif rule.action == "delay":
                delay += rule.polls
        return NotificationVerdict(payload=payload, delay=delay)

    def cut_off(self, endpoint: str) -> bool:
        """Whether :meth:`vanish` cut ``endpoint`` off (same as :meth:`is_vanished`)."""
        return endpoint in self._vanished

    # -- internals --------------------------------------------------------------------------
    def _add(
        self,
        action: _Action,
        kind: Literal["transfer", "notification"],
        endpoint: str | None,
        peer: str | None,
        op: Op | None,
        nth: int | None,
        when: Callable[[FaultEvent], bool] | None,
        times: int | None,
        *,
        polls: int = 0,
        written: float = 0.0,
        corrupt: Callable[[bytes], bytes] = _flip_bits,
    ) -> FaultRule:
        _check_selectors(nth, times)
        rule = FaultRule(
            action=action,
            kind=kind,
            endpoint=endpoint,
            peer=peer,
            op=op,
            nth=nth,
            when=when,
            times=times,
            polls=polls,
            written=written,
            corrupt=corrupt,
            owner=self,
        )
        self._rules.append(rule)
        return rule

    def _forget(self, rule: FaultRule) -> None:
        if rule in self._rules:
            self._rules.remove(rule)

    def _firing(self, event: FaultEvent) -> list[FaultRule]:
        # Every rule sees every event (so nth counts all matches), in insertion order.
        return [rule for rule in list(self._rules) if rule._check(event)]


class EarlyNotificationTransport(InProcessTransport):
    """An in-process transport whose post delivers its notification at once, when the transfer
    is posted — before its bytes land (they move on a later progress step, as always) and
    whether or not the transfer then succeeds. Everything else is the in-process transport.

    Its option ``notification_after_data`` (bool, default ``False``) is what its capability
    card declares: ``False`` is honest (the kit then reports its ordering checks as not
    applicable, and the P/D connector sends its done notice itself once the READ is DONE);
    ``True`` is the lie the conformance kit must catch. Every other option is the in-process
    transport's. Raises :class:`~kvframe.errors.ConfigError` for a value that is not a bool.
    """

    def __init__(self, params: TransportParams) -> None:
        options = dict(params.options)
        declared = options.pop("notification_after_data", False)
        if not isinstance(declared, bool):
            raise ConfigError(
                f"early-notification transport_options.notification_after_data = "
                f"{declared!r}; give true or false"
            )
        super().__init__(TransportParams(name=params.name, options=options))
        self.capabilities = attrs.evolve(self.capabilities, notification_after_data=declared)

    def post(
        self,
        op: Op,
        local: LayoutHandle,
        local_blocks: Sequence[int] | npt.NDArray[Any],
        remote: LayoutHandle,
        remote_blocks: Sequence[int] | npt.NDArray[Any],
        *,
        regions: Sequence[int] | None = None,
        notification: bytes | None = None,
    ) -> XferHandle:
        """Queue the transfer without its notification, then send the notification now."""
        if notification is not None:  # refused before anything is queued, as the SPI says
            notification = kit.check_notification(notification, self.capabilities, self.name)
        handle = super().post(
            op, local, local_blocks, remote, remote_blocks, regions=regions, notification=None
        )
        if notification is not None:
            self.send_notification(handle.peer, notification)
        return handle
