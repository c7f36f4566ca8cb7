"""P's side of the P/D lease protocol as one machine: notifications in; replies, ended leases out.

The holder (a prefill worker) keeps finished KV blocks under leases (:class:`LeaseTable`) and
answers the readers (decode workers) that talk to it through the transport's notifications.
:class:`LeaseHolder` makes every decision the worker used to make inline:

- a **heartbeat** renews the leases it names (by handle, in bulk:
  :meth:`LeaseTable.renew_handles`) as of its send time mapped onto the holder's clock
  (:class:`~kvframe.core.heartbeat.HeartbeatGuard`: a stale burst extends nothing, a reordered
  one renews only as far as it would have on time) and is answered with an acknowledgement
  (the earliest new expiry, a lower bound for every lease renewed) and, for handles with no
  live lease, a loss notice per reason;
- a **lease done** notice consumes (after a read) or aborts (after a release) each lease;
- **one reader per lease**: the first reader that names a lease *claims* it; any other reader
  naming it is told it is lost (``CLAIMED``) and can neither renew nor end it. A ticket that a
  router sent to two decoders is thus read by one of them only, and a consumption by one can
  never free blocks the other is reading;
- **reader groups** (heterogeneous tensor parallelism): the decode ranks of one engine that
  read from this holder form one group (:meth:`LeaseHolder.join`): the group claims a lease,
  every member renews it, and it ends only when *every* member reported it done (consumed when
  all read it, else aborted), or at its expiry. A reader that never joined is a group of one,
  as before;
- :meth:`LeaseHolder.expire` reclaims leases nobody renewed in time;
- :meth:`LeaseHolder.revoke` (push mode, where D holds its destination blocks) stops renewing a
  lease the holder no longer wants written: heartbeats naming it are answered ``ABORTED``, and
  it still ends only by the reader's done notice or its expiry, so the blocks stay put while a
  write the reader already posted may still land;
- :meth:`LeaseHolder.keep` (bidirectional mode, where D keeps a finished turn's blocks for the
  next turn's prefill engine) grants a lease for a fixed ``ttl`` that nobody heartbeats; the
  first heartbeat that claims it *restarts* it as an ordinary lease (:meth:`LeaseTable.restart`:
  it then ends within one extension of the claimant's last heartbeat), and
  :meth:`LeaseHolder.evict` gives it back early when the engine needs the memory: at once while
  nobody has claimed it, else as :meth:`revoke` does.
- **leases meant for a decode engine**: a grant may name the engine it is meant for (the
  router's ``decode_engine_id``); when that engine is gone for good, :meth:`abort_unclaimed_for`
  ends at once every lease meant for it that no reader has claimed (:meth:`abort_claims` ends
  those its readers claimed). The holder remembers the engine of a live lease only: the entry
  goes when the lease ends, by whatever path.

Like the lease table it is sans-I/O: every call takes ``now`` (the holder's monotonic clock) and
returns what happened (:class:`HolderOutput`); :meth:`LeaseHolder.next_deadline` says when to
call :meth:`LeaseHolder.expire` next. The caller sends the replies and frees the payloads of the
ended leases. Malformed input never reaches it: the caller decodes notifications with
:func:`kvframe.core.wire.decode` first and drops what does not decode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

import attrs

from kvframe.core import wire
from kvframe.core._checks import check_now
from kvframe.core.clock import DEFAULT_MAX_DRIFT
from kvframe.core.heartbeat import HeartbeatGuard
from kvframe.core.lease import (
    DEFAULT_REMEMBER_ENDED,
    Lease,
    LeasePolicy,
    LeaseState,
    LeaseTable,
    RenewIgnored,
    lease_handle,
)
from kvframe.core.slots import LeaseSlots

__all__ = ["HolderCounters", "HolderOutput", "LeaseHolder"]

_PayloadT = TypeVar("_PayloadT")

_LOST_FOR_STATE = {
    LeaseState.ABSENT: wire.LostReason.UNKNOWN,
    LeaseState.CONSUMED: wire.LostReason.CONSUMED,
    LeaseState.ABORTED: wire.LostReason.ABORTED,
    LeaseState.EXPIRED: wire.LostReason.EXPIRED,
}
_LOST_FOR_IGNORED = {
    RenewIgnored.UNKNOWN: wire.LostReason.UNKNOWN,
    RenewIgnored.CONSUMED: wire.LostReason.CONSUMED,
    RenewIgnored.ABORTED: wire.LostReason.ABORTED,
    RenewIgnored.EXPIRED: wire.LostReason.EXPIRED,
}


@attrs.frozen(kw_only=True)
class HolderOutput(Generic[_PayloadT]):
    """What one call did: the messages to send back and the leases that ended."""

    replies: tuple[wire.Message, ...] = ()
    """Messages for the reader the input came from, in order (acks before loss notices)."""
    ended: tuple[Lease[_PayloadT], ...] = ()
    """Leases that ended in this call (consumed, aborted or expired), each exactly once over
    the holder's life. Free their payloads now."""


@attrs.frozen(kw_only=True)
class HolderCounters:
    """Cumulative counts of a :class:`LeaseHolder` (each a plain number)."""

    heartbeats: int
    """Heartbeats received (accepted or not)."""
    heartbeats_stale: int
    """Heartbeats older than one already accepted from the same reader (reordered or delayed):
    they renew only as of their own mapped send time."""
    ids_ignored: int
    """Ids in heartbeats that renewed nothing (unknown, ended, due, stale or claimed)."""
    claimed_elsewhere: int
    """Ids another reader named after the first one claimed them (answered ``CLAIMED``)."""
    done_unknown: int
    """Lease-done entries for leases that were not live (answered with a loss notice)."""


class LeaseHolder(Generic[_PayloadT]):
    """P's lease protocol: a lease table, a heartbeat guard and reader claims.

    :param policy: the lease timing.
    :param max_drift: clock-rate difference allowed between reader and holder (for the guard's
        send-time mapping).
    :param remember_ended: ended leases remembered for precise loss notices.
    :param slots: the lease table readers can READ (:mod:`kvframe.core.slots`), or ``None``.
        A lease entered with :meth:`publish` leaves it in the call that ends the lease, before
        that call returns it in :attr:`HolderOutput.ended`, whichever way it ends.
    """

    def __init__(
        self,
        policy: LeasePolicy,
        *,
        max_drift: float = DEFAULT_MAX_DRIFT,
        remember_ended: int = DEFAULT_REMEMBER_ENDED,
        slots: LeaseSlots | None = None,
    ) -> None:
        self._slots = slots
        self._table: LeaseTable[_PayloadT] = LeaseTable(policy, remember_ended=remember_ended)
        self._guard = HeartbeatGuard(max_drift)
        self._claims: dict[int, str] = {}  # live lease handle -> the group that claimed it
        # reader -> (its group, its member id in the group, the group's member count)
        self._members: dict[str, tuple[str, int, int]] = {}
        # live lease handle -> member id -> its done reason (groups of several members only)
        self._reported: dict[int, dict[int, wire.DoneReason]] = {}
        self._revoked: set[int] = set()  # live lease handles no longer renewed
        self._kept: set[int] = set()  # live kept (TTL) lease handles nobody has claimed yet
        self._meant: dict[int, str] = {}  # live lease handle -> the decode engine it is meant for
        self._heartbeats = 0
        self._stale = 0
        self._ignored = 0
        self._claimed_elsewhere = 0
        self._done_unknown = 0
        self._taken = HolderCounters(
            heartbeats=0, heartbeats_stale=0, ids_ignored=0, claimed_elsewhere=0, done_unknown=0
        )

    # -- inspection ----------------------------------------------------------------------
    @property
    def table(self) -> LeaseTable[_PayloadT]:
        """The lease table (read it; change it only through the holder)."""
        return self._table

    @property
    def live_count(self) -> int:
        """Live leases."""
        return self._table.live_count

    def claimant(self, lease_id: str) -> str | None:
        """The group (for a reader that never joined one: the reader) that claimed the live
        lease ``lease_id``, or ``None``."""
        return self._claims.get(lease_handle(lease_id))

    def group_of(self, reader: str) -> str:
        """The group ``reader`` belongs to (itself unless it joined one)."""
        member = self._members.get(reader)
        return reader if member is None else member[0]

    def reported(self, lease_id: str) -> tuple[int, ...]:
        """The members of the claiming group that reported the live lease ``lease_id`` done
        while others had not yet (ascending; empty for groups of one)."""
        return tuple(sorted(self._reported.get(lease_handle(lease_id), ())))

    @property
    def counters(self) -> HolderCounters:
        """Cumulative counts (a snapshot)."""
        return HolderCounters(
            heartbeats=self._heartbeats,
            heartbeats_stale=self._stale,
            ids_ignored=self._ignored,
            claimed_elsewhere=self._claimed_elsewhere,
            done_unknown=self._done_unknown,
        )

    def take_counts(self) -> dict[str, int]:
        """Counts since the last call, under the names the P/D connector reports
        (``heartbeats_stale``, ``claimed_elsewhere``, ``done_for_unknown_lease``); zeros left
        out."""
        now, was = self.counters, self._taken
        self._taken = now
        out = {
            "heartbeats_stale": now.heartbeats_stale - was.heartbeats_stale,
            "claimed_elsewhere": now.claimed_elsewhere - was.claimed_elsewhere,
            "done_for_unknown_lease": now.done_unknown - was.done_unknown,
        }
        return {k: v for k, v in out.items() if v}

    def next_deadline(self) -> float | None:
        """The earliest live expiry (call :meth:`expire` then), or ``None``."""
        return self._table.next_deadline()

    def revoked(self, lease_id: str) -> bool:
        """Whether the live lease ``lease_id`` was revoked."""
        return lease_handle(lease_id) in self._revoked

    def revoke(self, lease_id: str, now: float) -> bool:
        """Renew the live lease ``lease_id`` no more: heartbeats naming it are answered with a
        loss notice (``ABORTED``) and renew nothing. The lease still ends only by the reader's
        done notice (it stopped, or its transfer completed) or at its expiry, whichever comes
        first: until then its blocks may still be touched by a transfer the reader posted under
        a bound the holder confirmed. Returns False (and does nothing) for a lease not live."""
        check_now(now)
        if self._table.state(lease_id) is not LeaseState.LIVE:
            return False
        self._revoked.add(lease_handle(lease_id))
        return True

    def kept(self, lease_id: str) -> bool:
        """Whether ``lease_id`` is a live kept lease (:meth:`keep`) that no reader has claimed
        yet (it still runs on its ``ttl``)."""
        return lease_handle(lease_id) in self._kept

    @property
    def kept_count(self) -> int:
        """Live kept leases nobody has claimed yet."""
        return len(self._kept)

    def meant_for(self, lease_id: str) -> str | None:
        """The decode engine the live lease ``lease_id`` was granted for (:meth:`grant`'s
        ``engine``), or ``None`` (none named, or the lease is not live)."""
        return self._meant.get(lease_handle(lease_id))

    @property
    def meant_count(self) -> int:
        """Live leases granted for a named decode engine (never more than :attr:`live_count`)."""
        return len(self._meant)

    # -- inputs --------------------------------------------------------------------------
    def grant(
        self, lease_id: str, now: float, payload: _PayloadT, *, engine: str | None = None
    ) -> Lease[_PayloadT]:
        """Grant a lease (see :meth:`LeaseTable.grant`; raises as it does, changing nothing).

        ``engine``: the decode engine the lease is meant for (the prefill request's
        ``decode_engine_id``), remembered while the lease lives for
        :meth:`abort_unclaimed_for`; ``None``: not known (the lease then ends by its reader or
        its expiry only). It restricts nothing: the first reader that names the lease claims
        it, whichever engine it belongs to.

        :raises ValueError: ``engine`` is given but not a non-empty string (nothing changes).
        """
        if engine is not None and (not isinstance(engine, str) or not engine):
            raise ValueError(f"engine = {engine!r}; give a decode engine id or None")
        lease = self._table.grant(lease_id, now, payload)
        if engine is not None:
            self._meant[lease.handle] = engine
        return lease

    def publish(self, lease_id: str) -> bool:
        """Enter the live lease ``lease_id`` in the lease table (``slots``), so a reader can
        prove it there; ``False`` when there is no table, the lease is not live, or its slot
        is taken (:meth:`LeaseSlots.publish <kvframe.core.slots.LeaseSlots.publish>`). Only for
        leases whose blocks nothing reuses before the lease ends (not a kept turn: its
        engine may evict it first)."""
        if self._slots is None or self._table.state(lease_id) is not LeaseState.LIVE:
            return False
        return self._slots.publish(lease_handle(lease_id))

    def keep(self, lease_id: str, now: float, payload: _PayloadT, ttl: float) -> Lease[_PayloadT]:
        """Grant a *kept* lease: it lives ``ttl`` seconds (``decoder_kv_blocks_ttl``) with no
        heartbeat at all. The first heartbeat that names it claims it for its reader and
        restarts it as an ordinary lease as of the heartbeat's send time (``sent +
        extension``, which may be earlier than the ttl's end): from then on it follows that
        reader's heartbeats, so it outlives the ttl while the reader keeps heartbeating and
        ends within one extension when the reader goes silent. A heartbeat that arrives after
        the ttl's end renews nothing (the reader is told ``EXPIRED``). Raises as
        :meth:`LeaseTable.grant` does (and for a ``ttl`` that is not a positive finite
        number), changing nothing."""
        lease = self._table.grant(lease_id, now, payload, ttl=ttl)
        self._kept.add(lease.handle)
        return lease

    def evict(self, lease_id: str, now: float) -> HolderOutput[_PayloadT]:
        """The engine needs the memory of the live lease ``lease_id`` back early.

        A kept lease nobody has claimed ends at once (``ABORTED``: no reader holds a bound on
        it, and a reader that names it later is told ``ABORTED`` and recomputes). Any other
        live lease is revoked (:meth:`revoke`): its claimant is told ``ABORTED`` at its next
        heartbeat, and it ends at its reader's done notice or its expiry, at most one
        extension after the claimant's last heartbeat, because a read posted under a bound
        this holder confirmed may still be running. Unknown or ended ids are a no-op."""
        handle = lease_handle(lease_id)
        if handle in self._kept:
            return self.abort(lease_id, now)
        self.revoke(lease_id, now)
        return HolderOutput()

    def connected(self, reader: str) -> None:
        """A reader (re)connected: its sequence numbers start again. Claims it holds stay."""
        self._guard.forget(reader)

    def join(self, reader: str, group: str, member: int, members: int) -> None:
        """``reader`` is member ``member`` (``0 .. members - 1``, stable across its
        reconnections: a decode rank) of ``group`` (a decode engine), whose ``members`` readers
        all read every lease the group claims from this holder. A lease the group claimed ends
        when every member reported it done (or at its expiry): a member's done notice alone
        frees nothing while another member may still be reading. A reader that joins again
        (reconnected) keeps its member id; its reports so far stay counted.

        :raises ValueError: ``members`` is not a positive int, ``member`` lies outside
            ``0 .. members - 1``, or ``group`` is empty.
        """
        if type(members) is not int or members < 1:
            raise ValueError(f"members = {members!r}; it must be a positive int")
        if type(member) is not int or not 0 <= member < members:
            raise ValueError(f"member = {member!r}; it must lie in 0..{members - 1}")
        if not isinstance(group, str) or not group:
            raise ValueError(f"group = {group!r}; it must be a non-empty string")
        self._members[reader] = (group, member, members)

    def leave(self, reader: str) -> None:
        """Forget ``reader``'s group membership (its connection was removed). Claims and
        reports of its group stay."""
        self._members.pop(reader, None)

    def receive(self, reader: str, message: wire.Message, now: float) -> HolderOutput[_PayloadT]:
        """A decoded notification from ``reader``. Holder-bound messages are heartbeats and
        lease-done notices; anything else (an ack or loss notice sent the wrong way) is ignored.

        :raises LeaseError: ``now`` is not finite (nothing changes).
        """
        check_now(now)
        if isinstance(message, wire.Heartbeat):
            return self._heartbeat(reader, message, now)
        if isinstance(message, wire.LeaseDone):
            return self._done(reader, message, now)
        return HolderOutput()

    def expire(self, now: float) -> HolderOutput[_PayloadT]:
        """Reclaim every lease whose expiry is ``<= now``."""
        ended = self._table.expire(now)
        if self._slots is not None or self._claims or self._revoked or self._kept or self._meant:
            for handle in ended.handles:
                self._forget(handle)
        return HolderOutput(ended=tuple(ended))

    def abort(self, lease_id: str, now: float) -> HolderOutput[_PayloadT]:
        """The holder itself gives up a live lease (shutdown, a failed request). Unknown or
        ended ids are a no-op."""
        if self._table.state(lease_id) is not LeaseState.LIVE:
            return HolderOutput()
        self._forget(lease_handle(lease_id))
        return HolderOutput(ended=(self._table.abort(lease_id, now),))

    def _forget(self, handle: int) -> None:
        """Everything kept about the live lease ``handle`` besides the table's own record,
        dropped as it ends: its lease-table entry first (before the ending call returns the
        lease, so before its blocks can be reported free), then its claim, revocation, kept
        mark, group reports and intended engine."""
        if self._slots is not None:
            self._slots.withdraw(handle)
        self._claims.pop(handle, None)
        self._revoked.discard(handle)
        self._kept.discard(handle)
        self._reported.pop(handle, None)
        self._meant.pop(handle, None)

    def claimed_by(self, reader: str) -> tuple[str, ...]:
        """The live leases ``reader``'s group has claimed (named in a heartbeat), by lease
        id."""
        table = self._table
        group = self.group_of(reader)
        ids = (table.request_id_for(h) for h, r in self._claims.items() if r == group)
        return tuple(sorted(i for i in ids if i is not None))

    def abort_claims(self, reader: str, now: float) -> HolderOutput[_PayloadT]:
        """``reader`` is gone for good (its engine left the fleet): end every live lease its
        group claimed at once (``ABORTED``) instead of at its expiry. Leases nobody claimed yet
        are untouched here: :meth:`abort_unclaimed_for` ends those granted for the reader's
        engine; the others end at their expiry as usual. Only for a reader that can no longer
        be reading: a reader still alive would lose blocks under a bound this holder confirmed.

        :raises LeaseError: ``now`` is not finite (nothing changes).
        """
        check_now(now)
        ended: list[Lease[_PayloadT]] = []
        for lease_id in self.claimed_by(reader):
            ended.extend(self.abort(lease_id, now).ended)
        return HolderOutput(ended=tuple(ended))

    def abort_unclaimed_for(self, engine: str, now: float) -> HolderOutput[_PayloadT]:
        """Decode engine ``engine`` is gone for good (it left the fleet): end at once
        (``ABORTED``) every live lease granted for it (:meth:`grant`'s ``engine``) that no
        reader has claimed, instead of at its expiry. A lease some reader claimed is left to
        the claim, whoever claimed it: :meth:`abort_claims` ends it when its claimant's engine
        is gone, and a lease meant for ``engine`` but claimed by another engine's reader (a
        router that retried the ticket elsewhere) is not touched.

        Why this is safe: a reader's bytes count only under a bound this holder confirmed in an
        acknowledgement, and the holder acknowledges only the leases a heartbeat renews, which
        that same call claims for the heartbeat's reader. An unclaimed lease has therefore
        never been confirmed to anyone: no reader holds a bound on it, so no accepted read
        can overlap the release of its blocks (a READ posted before any confirmation, an
        optimistic one, is never accepted without one). Any reader that names it later, the
        engine's own or another engine's that the router handed the same ticket, is answered
        ``ABORTED`` (a lease id is single-use: it is never live again) and its load fails by
        the failure policy (it recomputes the prompt or fails the request).

        :raises LeaseError: ``now`` is not finite (nothing changes).
        """
        check_now(now)
        if not self._meant:
            return HolderOutput()
        table, claims = self._table, self._claims
        ended: list[Lease[_PayloadT]] = []
        for handle in [h for h, e in self._meant.items() if e == engine and h not in claims]:
            lease_id = table.request_id_for(handle)
            if lease_id is not None:
                ended.extend(self.abort(lease_id, now).ended)
        return HolderOutput(ended=tuple(ended))

    # -- internals -----------------------------------------------------------------------
    def _split_claims(self, reader: str, handles: Iterable[int]) -> tuple[list[int], list[int]]:
        claims = self._claims
        if not claims:
            return list(handles), []
        reader = self.group_of(reader)
        mine: list[int] = []
        theirs: list[int] = []
        for h in handles:
            owner = claims.get(h)
            if owner is None or owner == reader:
                mine.append(h)
            else:
                theirs.append(h)
        return mine, theirs

    def _heartbeat(self, reader: str, msg: wire.Heartbeat, now: float) -> HolderOutput[_PayloadT]:
        self._heartbeats += 1
        sent_at = self._guard.accept(reader, msg.seq, msg.sent_at, now)
        if sent_at is None:
            # Overtaken by a newer heartbeat (a transport that reorders notifications). It
            # still renews what it names, as of its own mapped send time: a stale one extends
            # nothing, and dropping it would starve leases that only it names.
            self._stale += 1
            sent_at = self._guard.map_send_time(reader, msg.sent_at, now)
        mine, theirs = self._split_claims(reader, msg.handles)
        lost: dict[wire.LostReason, list[int]] = {}
        if self._revoked:
            revoked = [h for h in mine if h in self._revoked]
            if revoked:
                mine = [h for h in mine if h not in self._revoked]
                lost[wire.LostReason.ABORTED] = revoked
                self._ignored += len(revoked)
        if self._kept:
            self._restart_kept(mine, now, sent_at)
        result = self._table.renew_handles(mine, now, sent_at=sent_at)
        if theirs:
            lost[wire.LostReason.CLAIMED] = theirs
        self._claimed_elsewhere += len(theirs)
        renewed = result.renewed.tolist()
        claim = self._claims.setdefault
        group = self.group_of(reader)
        for h in renewed:
            claim(h, group)
        for h, why in result.ignored.items():
            if why is RenewIgnored.STALE:
                continue  # live: a fresher heartbeat will renew it
            lost.setdefault(_LOST_FOR_IGNORED[why], []).append(h)
        self._ignored += len(result.ignored) + len(theirs)
        replies: list[wire.Message] = []
        expiry = result.min_expiry
        if expiry is not None:
            replies.append(
                wire.LeaseAck(
                    echo_seq=msg.seq, holder_now=float(now), expiry=expiry, handles=renewed
                )
            )
        replies += _lost_notices(msg.seq, now, lost)
        return HolderOutput(replies=tuple(replies))

    def _restart_kept(self, handles: list[int], now: float, sent_at: float) -> None:
        # A kept lease's first heartbeat claims it: it lives by that reader's heartbeats now.
        kept, table = self._kept, self._table
        for h in kept.intersection(handles):  # one C-level pass over the batch
            rid = table.request_id_for(h)
            if rid is None or table.restart(rid, now, sent_at=sent_at) is not None:
                kept.discard(h)

    def _done(self, reader: str, msg: wire.LeaseDone, now: float) -> HolderOutput[_PayloadT]:
        lost: dict[wire.LostReason, list[int]] = {}
        ended: list[Lease[_PayloadT]] = []
        table = self._table
        group, member, members = self._members.get(reader, (reader, 0, 1))
        for h in msg.handles:
            rid = table.request_id_for(h)
            state = LeaseState.ABSENT if rid is None else table.state(rid)
            if rid is None or state is not LeaseState.LIVE:
                self._done_unknown += 1
                lost.setdefault(_LOST_FOR_STATE[state], []).append(h)
                continue
            owner = self._claims.get(h)
            if owner is not None and owner != group:
                self._claimed_elsewhere += 1
                lost.setdefault(wire.LostReason.CLAIMED, []).append(h)
                continue
            reason = msg.reason
            if members > 1:
                # A group's lease ends at its last member's report: the others may still be
                # reading under bounds this holder confirmed to them.
                self._claims[h] = group
                reports = self._reported.setdefault(h, {})
                reports[member] = reason
                if len(reports) < members:
                    continue
                del self._reported[h]
                if any(r is not wire.DoneReason.READ for r in reports.values()):
                    reason = wire.DoneReason.RELEASED
            self._forget(h)
            if reason is wire.DoneReason.READ:
                ended.append(table.consume(rid, now))
            else:
                ended.append(table.abort(rid, now))
        return HolderOutput(replies=tuple(_lost_notices(msg.seq, now, lost)), ended=tuple(ended))


def _lost_notices(
    seq: int, now: float, lost: dict[wire.LostReason, list[int]]
) -> list[wire.Message]:
    # One notice per reason (the wire carries one reason per message), in reason order.
    return [
        wire.LeaseLost(echo_seq=seq, holder_now=float(now), reason=why, handles=lost[why])
        for why in sorted(lost)
    ]
