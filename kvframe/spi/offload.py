"""The offload SPI: the contracts of offload tiers, eviction policies and the offload manager.

The offloading connector (``"OffloadingConnector"``) keeps KV blocks outside the engine's KV
cache, in *tiers* (host memory, local disk, ... ) so that a prompt seen before is loaded
instead of recomputed. Three contracts make it pluggable; each is an abstract class here, and
third-party plugins provide implementations through the hooks
:func:`~kvframe.spi.hookspecs.kvframe_register_offload_tiers` and
:func:`~kvframe.spi.hookspecs.kvframe_register_eviction_policies`:

- :class:`OffloadTier` keeps the *bytes* of blocks. It lives in the worker process and is
  called only from the connector's I/O threads (never from the engine's thread), so its
  methods may block. :class:`MemoryTier` is a tier whose slots are addressable host memory;
  the first tier of a configuration must be one (loads into the KV cache copy from it).
- :class:`EvictionPolicy` decides which blocks a full tier drops. Pure bookkeeping, called
  from the scheduler's thread; must be fast (O(1) or amortised O(1) per call).
- :class:`OffloadManager` is the scheduler-side index over all tiers: lookups, the life cycle
  of loads and stores, eviction, events. kvframe ships one
  (:class:`kvframe.connectors.offload.manager.TieredOffloadManager`).

**Keys.** A block is named by a 32-byte key derived from the request's chained block hash
(:func:`kvframe.spi.request.block_hashes`) and the KV layout (:func:`offload_key`); equal keys
mean equal token prefixes under equal models and layouts, in every process and on every host,
so instances may share a persistent tier.

**Slots.** Each tier has ``capacity_blocks`` slots numbered ``0 .. capacity_blocks - 1``; the
manager assigns a free slot to every block it places in a tier and passes both the key and
the slot to the tier. Memory tiers address by slot; file tiers may address by key.
"""

from __future__ import annotations

import abc
import enum
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from kvframe.errors import KVFrameError
from kvframe.protocol.messages import KVEvent, freeze_plain
from kvframe.spi.request import BLOCK_HASH_SIZE

__all__ = [
    "KEY_SIZE",
    "ByteArray",
    "CorruptEntryError",
    "EvictionPolicy",
    "EvictionPolicyFactory",
    "LookupResult",
    "LookupStatus",
    "MemoryTier",
    "OffloadError",
    "OffloadManager",
    "OffloadTier",
    "OffloadTierFactory",
    "PolicyConfig",
    "TierConfig",
    "TierFullError",
    "offload_key",
]

KEY_SIZE = 32
"""Length in bytes of every offload key."""

ByteArray = npt.NDArray[np.uint8]
"""A contiguous uint8 numpy array: what tiers read into and write from."""


class OffloadError(KVFrameError):
    """A tier operation failed. The offloading connector turns it into a miss (for a load) or
    a dropped block (for a store); it never reaches the engine."""


class TierFullError(OffloadError):
    """The tier's backing store has no room left (``ENOSPC``), although the manager's
    accounting said there was. The connector stops using the tier (it degrades to the tiers
    above it) and reports a ``offload.tier_disabled`` warning event."""


class CorruptEntryError(OffloadError):
    """A stored block failed its integrity check (bad checksum, truncated, wrong key) or is
    gone. The tier has removed it (or tried to); the block is a miss."""


def offload_key(block_hash: bytes, namespace: bytes) -> bytes:
    """The offload key of the block whose chained hash is ``block_hash``.

    ``namespace`` separates caches whose equal token prefixes must not share KV: the model,
    the KV layout (dtype, shapes) and any user salt; the offloading connector derives it from
    the workers' handshake. BLAKE2b-256, so keys are equal across processes and hosts.
    Raises ``ValueError`` for a block hash of the wrong length or a non-bytes namespace.
    """
    if not isinstance(block_hash, bytes) or len(block_hash) != BLOCK_HASH_SIZE:
        raise ValueError(f"block_hash must be {BLOCK_HASH_SIZE} bytes, got {block_hash!r}")
    if not isinstance(namespace, bytes):
        raise ValueError(f"namespace must be bytes, got {type(namespace).__name__}")
    h = hashlib.blake2b(digest_size=KEY_SIZE, person=b"kvframe.offload1")
    h.update(len(namespace).to_bytes(4, "little"))
    h.update(namespace)
    h.update(block_hash)
    return h.digest()


def _positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a positive int")


def _non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a non-negative int")


def _options(value: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"options must be a mapping, got {type(value).__name__}")
    frozen: Mapping[str, Any] = freeze_plain(value, "options")
    return frozen


@attrs.frozen(kw_only=True)
class TierConfig:
    """What a tier factory receives: one entry of ``kv_connector_extra_config.tiers``.

    ``capacity_bytes`` and ``block_bytes`` are already validated; ``options`` are the entry's
    other keys (tier-specific; the factory validates them and raises
    :class:`~kvframe.errors.ConfigError` naming ``path`` and the key).
    """

    name: str
    """The tier's registered name (``"cpu"``, ``"disk"``, ...)."""
    index: int = attrs.field(validator=_non_negative_int)
    """Position in the tier list: 0 is the fastest (a :class:`MemoryTier`)."""
    capacity_bytes: int = attrs.field(validator=_positive_int)
    """The most bytes of KV the tier may hold."""
    block_bytes: int = attrs.field(validator=_positive_int)
    """Bytes of one block over all layers (what one slot holds)."""
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options, hash=False)
    """The tier's own options (everything in its configuration entry but ``tier`` and
    ``capacity_bytes``), read-only."""
    path: str = "kv_connector_extra_config.tiers[0]"
    """Where the entry sits in the configuration, for error messages."""

    @property
    def capacity_blocks(self) -> int:
        """Whole blocks that fit in ``capacity_bytes`` (tiers with per-block overhead may
        offer fewer)."""
        return self.capacity_bytes // self.block_bytes


@attrs.frozen(kw_only=True)
class PolicyConfig:
    """What an eviction-policy factory receives (one policy per tier)."""

    name: str
    """The policy's registered name (``"lru"``, ``"arc"``, ...)."""
    capacity_blocks: int = attrs.field(validator=_positive_int)
    """Slots of the tier the policy serves (ARC sizes its ghost lists from it)."""
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options, hash=False)
    """``kv_connector_extra_config.eviction_options``, read-only."""


class OffloadTier(abc.ABC):
    """Where a tier keeps block bytes. Built by a factory ``factory(TierConfig) -> tier``.

    **Threads.** The factory and :meth:`scan` run in the scheduler process at start (no
    memory is reserved there); :meth:`open` runs once in each worker before any I/O; the I/O
    methods run in the connector's worker threads, possibly concurrently for *different*
    slots (never for the same slot at once); :meth:`close` runs once, after every I/O
    returned.

    **Failures.** I/O methods raise :class:`OffloadError` subclasses (or ``OSError``, which
    the connector treats like :class:`OffloadError`): :class:`TierFullError` when the backing
    store is full, :class:`CorruptEntryError` when a read finds a damaged or missing entry.
    After a failed :meth:`write` the slot holds nothing valid; the connector forgets the
    block. Nothing a tier raises reaches the engine.
    """

    persistent: bool = False
    """True when entries survive a restart (then :meth:`scan` reports them)."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config

    @property
    def capacity_blocks(self) -> int:
        """How many blocks the tier holds at most. Default ``config.capacity_blocks``."""
        return self.config.capacity_blocks

    def open(self) -> None:  # noqa: B027 - optional hook
        """Reserve memory, create directories. Called once per worker before any I/O.
        Raises :class:`~kvframe.errors.ConfigError` when that is impossible (a directory that
        cannot be created); nothing is left reserved then. Default: nothing."""

    @abc.abstractmethod
    def write(self, key: bytes, slot: int, data: ByteArray) -> None:
        """Store ``data`` (``block_bytes`` uint8, contiguous) as ``key`` in ``slot``, replacing
        whatever the slot held. Returns when ``data`` may be reused. Raises
        :class:`TierFullError` or another :class:`OffloadError` / ``OSError``; the slot holds
        nothing valid then."""

    @abc.abstractmethod
    def read(self, key: bytes, slot: int, out: ByteArray) -> None:
        """Fill ``out`` (``block_bytes`` uint8, contiguous) with the block stored as ``key``
        in ``slot``. Raises :class:`CorruptEntryError` when the entry is damaged or missing
        (after removing it), another :class:`OffloadError` / ``OSError`` otherwise; ``out`` is
        undefined then."""

    def remove(self, key: bytes, slot: int) -> None:  # noqa: B027 - optional hook
        """Forget the block (delete its file). Must not raise for an entry that is already
        gone. Default: nothing (memory slots are simply reused)."""

    def scan(self) -> Iterator[bytes]:
        """The keys a persistent tier already holds (from an earlier run), in any order.
        Called once in the scheduler process at start, before :meth:`open`. Unreadable
        entries are skipped (and may be removed). Default: none."""
        return iter(())

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release memory and file handles; may be called twice; never raises. Persistent
        entries stay. Default: nothing."""


class MemoryTier(OffloadTier):
    """A tier whose slots are host memory the connector can copy to and from directly, layer
    by layer, without a whole-block :meth:`read` or :meth:`write`. The first tier of every
    configuration is one."""

    @abc.abstractmethod
    def slot_array(self, slot: int) -> ByteArray:
        """The slot's memory as a writable contiguous uint8 array of ``block_bytes`` (a view:
        writes land in the tier). Valid between :meth:`open` and :meth:`close`. Raises
        ``IndexError`` for a slot outside ``0 .. capacity_blocks - 1``."""

    def contiguous_array(self) -> ByteArray | None:
        """The whole tier as one writable ``[capacity_blocks, block_bytes]`` uint8 array when
        its slots are one contiguous allocation (slot ``i`` is row ``i``), else ``None``. With
        it the connector copies runs of consecutive slots in one call. Valid between
        :meth:`open` and :meth:`close`. Default: ``None``."""
        return None

    def write(self, key: bytes, slot: int, data: ByteArray) -> None:
        """Copy ``data`` into the slot."""
        np.copyto(self.slot_array(slot), data)

    def read(self, key: bytes, slot: int, out: ByteArray) -> None:
        """Copy the slot into ``out``."""
        np.copyto(out, self.slot_array(slot))


OffloadTierFactory = Callable[[TierConfig], OffloadTier]
"""What ``register(name, factory)`` of :func:`~kvframe.spi.hookspecs.kvframe_register_offload_tiers`
takes: a callable building a tier from its :class:`TierConfig`. It must be cheap (no memory
reserved until :meth:`OffloadTier.open`) and raise :class:`~kvframe.errors.ConfigError` for
bad options."""


class EvictionPolicy(abc.ABC):
    """Which blocks a full tier drops first. Built by ``factory(PolicyConfig) -> policy``,
    one per tier.

    The manager tells the policy about every block that becomes evictable (:meth:`insert`),
    every use (:meth:`touch`) and every removal (:meth:`remove`); when it needs room it asks
    :meth:`victims` and then removes the chosen blocks itself. Keys are 32-byte
    :data:`KEY_SIZE` keys. Calls come from one thread; none may raise for keys the manager
    passes correctly (a key inserted twice, or touched or removed without being inserted, is
    a manager bug and may raise ``KeyError``).
    """

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def insert(self, key: bytes) -> None:
        """``key`` was stored and is now a candidate for eviction."""

    @abc.abstractmethod
    def touch(self, key: bytes) -> None:
        """``key`` was hit (looked up and loaded, or stored again)."""

    @abc.abstractmethod
    def remove(self, key: bytes, *, evicted: bool) -> None:
        """``key`` left the tier: chosen by :meth:`victims` (``evicted=True``; an adaptive
        policy may remember it as a ghost) or dropped for another reason (a failure, a
        reset)."""

    @abc.abstractmethod
    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        """``n`` distinct keys to evict, best first, skipping keys for which ``can_evict`` is
        False (blocks being loaded or stored, the asking request's own blocks).

        Returns ``None`` when fewer than ``n`` keys can be evicted: the manager then evicts
        nothing (eviction is all or nothing). Must not change the policy's state; the manager
        calls :meth:`remove` for each key it actually evicts.
        """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Keys currently inserted (ghosts not counted)."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is inserted (ghosts not counted)."""


EvictionPolicyFactory = Callable[[PolicyConfig], EvictionPolicy]
"""What ``register(name, factory)`` of
:func:`~kvframe.spi.hookspecs.kvframe_register_eviction_policies` takes."""


class LookupStatus(enum.Enum):
    """The four answers of :meth:`OffloadManager.lookup`."""

    MISS = "miss"
    """The first block is nowhere: load nothing."""
    HIT = "hit"
    """``ready`` blocks from the first one are in the memory tier and can be loaded now."""
    NOT_READY = "not_ready"
    """A hit, but some of the blocks after the ready ones are still being stored (by another
    request): they will be ready without further action. Ask again next step."""
    ASK_AGAIN = "ask_again"
    """A hit in a lower tier: the manager started promoting those blocks to the memory tier.
    Ask again next step."""


@attrs.frozen(kw_only=True)
class LookupResult:
    """What :meth:`OffloadManager.lookup` found for a sequence of keys."""

    status: LookupStatus
    ready: int = attrs.field(default=0, validator=_non_negative_int)
    """Leading blocks that can be loaded now."""
    pending: int = attrs.field(default=0, validator=_non_negative_int)
    """Blocks right after the ready ones that will be ready soon (``NOT_READY`` /
    ``ASK_AGAIN``); 0 otherwise."""


class OffloadManager(abc.ABC):
    """The scheduler-side index of every tier: what is where, what is in flight, what to evict.

    Pure bookkeeping: it never touches bytes, never blocks, never reads a clock. It hands out
    *jobs* (:meth:`take_jobs`) that the connector's workers execute, and learns their outcome
    through the ``complete_*`` methods. Its invariants (checked by
    :meth:`check_invariants`): a block is in a tier at most once; every used slot belongs to
    exactly one block; blocks being loaded, stored, promoted or spilled are never evicted;
    a tier never holds more than its capacity.
    """

    @abc.abstractmethod
    def lookup(self, keys: Sequence[bytes], *, protect: Iterable[bytes] = ()) -> LookupResult:
        """How many leading ``keys`` can be loaded. May start promotions from lower tiers
        (then answers :attr:`LookupStatus.ASK_AGAIN`); ``protect`` are keys that eviction must
        not drop to make room for them. Never raises for well-formed keys."""

    @abc.abstractmethod
    def prepare_load(self, keys: Sequence[bytes]) -> tuple[int, ...] | None:
        """Pin ``keys`` (all ready in the memory tier) for a load and return their memory-tier
        slots; ``None`` (and nothing pinned) when any of them is not ready. Pinned blocks are
        never evicted until :meth:`complete_load`."""

    @abc.abstractmethod
    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Unpin keys pinned by :meth:`prepare_load` (the load finished or was dropped)."""

    @abc.abstractmethod
    def prepare_store(
        self, keys: Sequence[bytes], *, protect: Iterable[bytes] = ()
    ) -> tuple[tuple[bytes, int], ...]:
        """Reserve memory-tier slots for the ``keys`` not stored yet; returns ``(key, slot)``
        for each, in order. Evicts what it needs atomically: when room for all of them cannot
        be made without evicting pinned, in-flight or ``protect`` blocks, reserves nothing and
        returns ``()``. Reserved blocks are in flight until :meth:`complete_store`."""

    @abc.abstractmethod
    def complete_store(self, keys: Sequence[bytes], *, ok: bool) -> None:
        """The copy into the memory tier finished. ``ok``: the blocks become ready (and are
        queued for writing to lower tiers); otherwise they are forgotten and their room
        returns."""

    @abc.abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Tell the eviction policies these ready blocks were used."""

    @abc.abstractmethod
    def take_jobs(self) -> Sequence[Any]:
        """Work for the workers queued since the last call (promotions, writes to lower tiers,
        removals), each returned once."""

    @abc.abstractmethod
    def take_events(self) -> tuple[KVEvent, ...]:
        """``offload.stored`` / ``offload.removed`` / ``offload.tier_disabled`` events since
        the last call, oldest first."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every block that is not in flight (and queue the removal of persisted
        ones). In-flight blocks finish their life cycle normally."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant; for tests."""
