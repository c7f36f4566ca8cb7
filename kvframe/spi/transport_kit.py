"""The transport kit: the contract code every transport shares, written once.

A transport plugin implements :class:`~kvframe.spi.transport.Transport`; most of what the SPI
promises besides moving bytes is the same in every transport — which error a closed transport
raises, how a request's blocks become descriptor ids and what is wrong with a bad request, what
a notification may be, what adding a known peer again does, how ``TransportParams.options`` are
checked and worded. This module is that code. The shipped transports (in-process, NIXL, UCX and
the example TCP plugin) all use it; a new plugin should too, so that its errors read like
everyone else's and the conformance kit finds nothing to complain about in them.

What is here, in the order a transport needs it:

- :class:`TransportOptions` with :func:`flag`, :func:`integer`, :func:`seconds`, :func:`text`,
  :func:`names`, :func:`text_map` and :func:`instance` — one parser for
  ``TransportParams.options``: known keys, types, ranges, and the closest known key for a
  typo, in the wording of :mod:`kvframe.config`.
- :class:`OpenGuard` — the ``TransportClosedError`` after ``close()``, and a ``close`` that
  knows whether it is the first.
- :func:`check_regions`, :func:`check_op` and :func:`check_notification` — ``ValueError`` /
  ``CapabilityError`` exactly as the SPI's failure table says.
- :func:`block_table`, :func:`check_inside` — a layout's region-major (address, length) table
  and the "is it inside registered memory" check.
- :func:`pair_descriptors` (and the one-sided :func:`descriptor_ids`) — a request's per-block
  local/remote ids and a :class:`~kvframe.spi.transport.BlockLayout` turned into descriptor ids
  of both sides, validated together, vectorised for large requests.
- :func:`contiguous_runs` — a request's pairs merged into one (address, length) run per stretch
  of blocks adjacent on both sides within one region (:class:`Runs`), for a native API that
  takes address ranges: fewer, larger operations.
- :class:`PeerTable` — peers by name with their incarnation: adding a known name again is a
  rebuild (the old connection is torn down first, and :class:`PeerAdded` says so), removal,
  lookup with the SPI's ``PeerUnreachableError``, and the check that a remote layout was
  prepared for the peer's current incarnation; :class:`Prepared` is the layout record it
  checks (and :meth:`Prepared.check_local` the local one).
- :func:`check_post` — all of the above for one ``post``, in the SPI's order, as a
  :class:`PostRequest`.
- :class:`Transfer` — the mutable side of a frozen :class:`~kvframe.spi.transport.XferHandle`:
  state transitions that happen once, the :class:`~kvframe.spi.transport.XferStatus` that
  ``poll`` answers, release and ownership checks.

Nothing here does I/O, reads a clock or starts a thread: it is plain functions and small
records that a transport owns. Every function documents what it raises; on any error nothing
was changed.

Threads: none of these objects is locked. A transport that uses a helper thread (NIXL's post
worker) must only touch them from the caller's thread, as the SPI's threading rule says.
"""

from __future__ import annotations

import difflib
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Generic, TypeVar

import attrs
import numpy as np
import numpy.typing as npt

from kvframe.errors import (
    CapabilityError,
    ConfigError,
    PeerUnreachableError,
    TransportClosedError,
    TransportError,
)
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryRegion,
    Op,
    TransportCapabilities,
    XferHandle,
    XferState,
    XferStatus,
)

__all__ = [
    "SMALL_REQUEST_DESCRIPTORS",
    "DescriptorIds",
    "DescriptorPairs",
    "OpenGuard",
    "Option",
    "PeerAdded",
    "PeerEntry",
    "PeerTable",
    "PostRequest",
    "Prepared",
    "Runs",
    "Transfer",
    "TransportOptions",
    "block_table",
    "check_inside",
    "check_notification",
    "check_op",
    "check_post",
    "check_regions",
    "contiguous_runs",
    "descriptor_ids",
    "flag",
    "instance",
    "integer",
    "names",
    "pair_descriptors",
    "seconds",
    "text",
    "text_map",
]

C = TypeVar("C")
R = TypeVar("R")
T = TypeVar("T")


# -- options -----------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= 80 else text_[:77] + "..."


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


_NO_DEFAULT: Final = _NoDefault()


@attrs.frozen(kw_only=True)
class Option:
    """One key of ``TransportParams.options``: its name, what it allows and its default.

    ``convert`` turns an accepted value into what the transport uses, or raises ``ValueError``
    or ``TypeError`` for a value it does not accept; :meth:`TransportOptions.parse` turns that
    into a :class:`~kvframe.errors.ConfigError` that names the key, the value and
    ``expected``. Build options with :func:`flag`, :func:`integer`, :func:`seconds`,
    :func:`text`, :func:`names`, :func:`text_map` and :func:`instance`, or directly for a key
    none of them fits.
    """

    key: str
    expected: str
    """What is allowed, in words: ``"a number of seconds > 0"``."""
    convert: Callable[[Any], Any]
    default: Any = _NO_DEFAULT
    """The value used when the key is absent; without one an absent key is left out of what
    :meth:`TransportOptions.parse` returns (the options class then keeps its own default)."""

    @property
    def has_default(self) -> bool:
        """Whether :attr:`default` was given."""
        return self.default is not _NO_DEFAULT


def _not_bool(value: Any) -> None:
    # bool is an int subclass; a flag given as 1 or a count given as True is a mistake
    if isinstance(value, bool):
        raise TypeError("a bool is not a number here")


def flag(key: str, default: Any = _NO_DEFAULT) -> Option:
    """A ``bool`` (``1`` and ``"yes"`` are refused)."""

    def convert(value: Any) -> bool:
        if not isinstance(value, bool):
            raise TypeError("not a bool")
        return value

    return Option(key=key, expected="true or false", convert=convert, default=default)


def integer(
    key: str,
    default: Any = _NO_DEFAULT,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    note: str = "",
) -> Option:
    """An ``int`` (not a ``bool``) within ``[minimum, maximum]``; ``note`` is added to what the
    message says is allowed (``"0: NIXL decides"``)."""
    if minimum is not None and maximum is not None:
        expected = f"an integer {minimum}..{maximum}"
    elif minimum is not None:
        expected = f"an integer >= {minimum}"
    elif maximum is not None:
        expected = f"an integer <= {maximum}"
    else:
        expected = "an integer"
    if note:
        expected += f" ({note})"

    def convert(value: Any) -> int:
        _not_bool(value)
        if not isinstance(value, int):
            raise TypeError("not an int")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ValueError("out of range")
        return value

    return Option(key=key, expected=expected, convert=convert, default=default)


def seconds(key: str, default: Any = _NO_DEFAULT) -> Option:
    """A finite number of seconds > 0, returned as ``float``."""

    def convert(value: Any) -> float:
        _not_bool(value)
        if not isinstance(value, int | float):
            raise TypeError("not a number")
        if not math.isfinite(value) or value <= 0:
            raise ValueError("out of range")
        return float(value)

    return Option(
        key=key, expected="a finite number of seconds > 0", convert=convert, default=default
    )


def text(key: str, default: Any = _NO_DEFAULT) -> Option:
    """A non-empty ``str``."""

    def convert(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise TypeError("not a non-empty str")
        return value

    return Option(key=key, expected="a non-empty string", convert=convert, default=default)


def names(key: str, default: Any = _NO_DEFAULT, *, example: str = "") -> Option:
    """A non-empty list of non-empty strings (a bare string is refused), returned as a
    ``tuple``."""

    def convert(value: Any) -> tuple[str, ...]:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
            raise TypeError("not a non-empty list")
        if not all(isinstance(v, str) and v for v in value):
            raise TypeError("not a list of names")
        return tuple(value)

    expected = "a non-empty list of names" + (f", e.g. {example}" if example else "")
    return Option(key=key, expected=expected, convert=convert, default=default)


def text_map(
    key: str,
    default: Any = _NO_DEFAULT,
    *,
    key_prefix: str = "",
    strip_prefix: str = "",
    example: str = "",
) -> Option:
    """A mapping of non-empty ``str`` keys (starting with ``key_prefix`` when given) to
    ``str`` values, returned as a ``dict``; ``strip_prefix`` is removed from each key."""

    def convert(value: Any) -> dict[str, str]:
        if not isinstance(value, Mapping):
            raise TypeError("not a mapping")
        for k, v in value.items():
            if not isinstance(k, str) or not k.startswith(key_prefix) or len(k) <= len(key_prefix):
                raise ValueError(f"key {k!r}")
            if not isinstance(v, str):
                raise TypeError(f"value of {k!r}")
        return {k.removeprefix(strip_prefix): v for k, v in value.items()}

    what = f"{key_prefix}* names" if key_prefix else "setting names"
    expected = f"a mapping of {what} to strings" + (f", e.g. {example}" if example else "")
    return Option(key=key, expected=expected, convert=convert, default=default)


def instance(key: str, cls: type[T], default: Any = _NO_DEFAULT) -> Option:
    """An instance of ``cls`` (``None`` counts as absent: the default is used)."""

    def convert(value: Any) -> T | None:
        if value is None:
            return None
        if not isinstance(value, cls):
            raise TypeError(f"not a {cls.__name__}")
        return value

    return Option(key=key, expected=f"an {cls.__name__}", convert=convert, default=default)


class TransportOptions:
    """The options one transport accepts; :meth:`parse` validates ``TransportParams.options``.

    Every message has the shape of :mod:`kvframe.config`'s, with the transport's name in
    front of the key path::

        ucx transport_options.release_timeout: got 0 (int); expected a finite number of
        seconds > 0
        ucx transport_options.relase_timeout: unknown key (value 5); did you mean
        'release_timeout'? known keys: release_timeout, ucx_config
    """

    def __init__(self, transport: str, *options: Option) -> None:
        """``transport`` is the name the messages use (``"ucx"``). Raises ``ValueError`` for
        a key given twice."""
        keys = [o.key for o in options]
        if len(set(keys)) != len(keys):
            raise ValueError(f"an option key is given twice: {keys}")
        self.transport = transport
        self._options = {o.key: o for o in options}

    @property
    def keys(self) -> tuple[str, ...]:
        """The known keys, in the order they were given."""
        return tuple(self._options)

    def error(self, key: str, value: Any, expected: str, hint: str = "") -> ConfigError:
        """A :class:`~kvframe.errors.ConfigError` about ``key`` in this parser's wording, for
        checks made after :meth:`parse` (a backend the library lacks, a setting the native
        library refuses)."""
        msg = f"{self._path(key)}: got {_fmt(value)} ({_kind(value)}); expected {expected}"
        return ConfigError(msg + (f"; {hint}" if hint else ""))

    def parse(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The converted value of every given key, plus the default of every absent key that
        has one.

        Raises :class:`~kvframe.errors.ConfigError` for options that are not a mapping, an
        unknown key (naming the closest known key) or a value a key does not accept (naming
        the key, the value, its type and what is allowed).
        """
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"{self.transport} transport_options: got {_fmt(options)} ({_kind(options)}); "
                "expected a mapping of option names to values"
            )
        known = self.keys
        for key, value in options.items():
            if key not in self._options:
                close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(
                    f"{self._path(str(key))}: unknown key (value {_fmt(value)}); {hint}"
                    f"known keys: {', '.join(known) or '(none)'}"
                )
        out: dict[str, Any] = {}
        for key, option in self._options.items():
            if key not in options:
                if option.has_default:
                    out[key] = option.default
                continue
            value = options[key]
            try:
                converted = option.convert(value)
            except (TypeError, ValueError) as exc:
                raise self.error(key, value, option.expected) from exc
            out[key] = option.default if converted is None and option.has_default else converted
        return out

    def _path(self, key: str) -> str:
        return f"{self.transport} transport_options.{key}"


# -- the closed guard and argument checks ------------------------------------------------------


class OpenGuard:
    """Open until :meth:`close`; then :meth:`check` raises
    :class:`~kvframe.errors.TransportClosedError`.

    ``what`` names the transport in the message (``"ucx transport 'decode-0'"``).
    """

    __slots__ = ("_closed", "what")

    def __init__(self, what: str) -> None:
        """Open, naming the transport as ``what``."""
        self.what = what
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def check(self) -> None:
        """Raise :class:`~kvframe.errors.TransportClosedError` once closed, else nothing."""
        if self._closed:
            raise TransportClosedError(
                f"{self.what} is closed; every method but close() raises this now"
            )

    def close(self) -> bool:
        """Mark closed; ``True`` the first time, ``False`` after (a second ``close()`` of the
        transport is then a no-op)."""
        first = not self._closed
        self._closed = True
        return first


def check_regions(
    regions: Iterable[Any], capabilities: TransportCapabilities, who: str, hint: str = ""
) -> list[MemoryRegion]:
    """The regions of a ``register_memory`` call, as a list, when the transport may register
    them all.

    Raises ``ValueError`` for something that is not a
    :class:`~kvframe.spi.transport.MemoryRegion` and
    :class:`~kvframe.errors.CapabilityError` for a memory kind
    ``capabilities.memory_kinds`` leaves out (``hint`` is added to that message). Nothing is
    registered then, as the SPI says.
    """
    out = list(regions)
    for region in out:
        if not isinstance(region, MemoryRegion):
            raise ValueError(f"register_memory takes MemoryRegion values, got {region!r}")
        if region.kind not in capabilities.memory_kinds:
            kinds = ", ".join(sorted(k.value for k in capabilities.memory_kinds))
            raise CapabilityError(
                f"{who} cannot register {region.kind.value} memory (it moves {kinds} memory)"
                + (f"; {hint}" if hint else "")
            )
    return out


def check_op(op: Any, capabilities: TransportCapabilities, who: str) -> Op:
    """The op, when it is a supported :class:`~kvframe.spi.transport.Op`.

    Raises ``ValueError`` for something that is not an ``Op`` and
    :class:`~kvframe.errors.CapabilityError` for ``READ``/``WRITE`` the capabilities leave out.
    """
    if not isinstance(op, Op):
        raise ValueError(f"op must be Op.READ or Op.WRITE, got {op!r}")
    supported = capabilities.read if op is Op.READ else capabilities.write
    if not supported:
        raise CapabilityError(f"{who} does not support {op.name} (see its capability card)")
    return op


def check_notification(payload: Any, capabilities: TransportCapabilities, who: str) -> bytes:
    """The payload as ``bytes``, when the transport may send it.

    Raises ``ValueError`` for a payload that is not bytes-like, and
    :class:`~kvframe.errors.CapabilityError` when notifications are unsupported or the payload
    is over ``capabilities.max_notification_bytes`` (a payload of exactly the limit is fine).
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise ValueError(
            f"a notification payload is bytes, got {type(payload).__name__}; encode it first"
        )
    if not capabilities.notifications:
        raise CapabilityError(f"{who} does not support notifications (see its capability card)")
    data = bytes(payload)
    limit = capabilities.max_notification_bytes
    if len(data) > limit:
        raise CapabilityError(
            f"notification of {len(data)} bytes exceeds the limit of {limit} bytes of {who} "
            "(capabilities.max_notification_bytes); send a key and move large data with a "
            "transfer"
        )
    return data


# -- layouts and descriptors -------------------------------------------------------------------


def block_table(layout: BlockLayout) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Every block's (address, length) as two arrays, region-major: entry ``r * num_blocks +
    b`` is block ``b`` of region ``r`` — the order :func:`pair_descriptors` indexes."""
    nb = layout.num_blocks
    base = np.array([r.addr for r in layout.regions], dtype=np.int64)
    blen = np.array(layout.block_lens, dtype=np.int64)
    addrs = (base[:, None] + np.arange(nb, dtype=np.int64)[None, :] * blen[:, None]).reshape(-1)
    lens = np.repeat(blen, nb)
    return addrs, lens


def check_inside(layout: BlockLayout, registered: Iterable[MemoryRegion], who: str) -> None:
    """Raise ``ValueError`` unless every region of ``layout`` (the bytes its blocks use) lies
    inside one region of ``registered`` of the same memory kind and device. ``who`` says whose
    memory it is in the message (``"this endpoint"``, ``"peer 'P'"``)."""
    regions = list(registered)
    for i, region in enumerate(layout.regions):
        span = layout.block_lens[i] * layout.num_blocks
        if not any(
            reg.kind is region.kind
            and reg.device_id == region.device_id
            and reg.addr <= region.addr
            and region.addr + span <= reg.addr + reg.length
            for reg in regions
        ):
            raise ValueError(
                f"layout region {i} ({region.kind.value} memory at {region.addr:#x}, "
                f"{span} bytes used) is not inside memory registered by {who}; "
                "register_memory it first"
            )


SMALL_REQUEST_DESCRIPTORS: Final = 64
"""Up to this many descriptors, :func:`pair_descriptors` computes ids in plain Python: each
numpy call costs 2-5 µs with cold CPU caches (as after an engine's forward pass), more than
the work itself for a small request."""

DescriptorIds = list[int] | npt.NDArray[np.integer[Any]]
"""Descriptor ids of one side: a Python list for a small request, a numpy array otherwise."""


def _int_list(values: Any, what: str) -> list[int]:
    if isinstance(values, np.ndarray):
        if values.size and values.dtype.kind not in "iu":
            raise ValueError(f"{what} must hold integers, got dtype {values.dtype}")
        out: list[int] = values.reshape(-1).tolist()
        return out
    try:
        return [operator.index(v) for v in values]
    except TypeError as exc:
        raise ValueError(f"{what} must be a sequence of integers: {exc}") from exc


@attrs.frozen(kw_only=True)
class DescriptorPairs:
    """A request's descriptor ids on both sides, paired one to one (see
    :func:`pair_descriptors`).

    ``local[i]`` pairs with ``remote[i]``; both index prepared lists laid out region-major
    (:func:`block_table`). Small requests hold Python lists, larger ones numpy arrays; either
    indexes a numpy table (``table[pairs.local]``) or goes to a native API as is.
    """

    local: DescriptorIds
    remote: DescriptorIds
    nbytes: int
    """Bytes the request moves."""
    regions: tuple[int, ...]
    """The selected region indices, in request order."""

    @property
    def count(self) -> int:
        """The number of descriptors on each side (``XferHandle.num_descriptors``)."""
        return len(self.local)


def pair_descriptors(
    local: BlockLayout,
    remote: BlockLayout,
    local_blocks: Sequence[int] | npt.NDArray[Any],
    remote_blocks: Sequence[int] | npt.NDArray[Any],
    regions: Sequence[int] | npt.NDArray[Any] | None,
    *,
    dtype: type[np.integer[Any]] = np.int64,
) -> DescriptorPairs:
    """Turn a request into descriptor ids of both sides, validated together.

    Descriptor ``r * num_blocks + b`` is block ``b`` of region ``r`` of that side's layout;
    the result lists, for every selected region in order, the request's blocks in order, so
    ``local[i]`` and ``remote[i]`` are the same region of paired blocks. ``regions=None``
    selects every region (both layouts must then have as many). Requests of at most
    :data:`SMALL_REQUEST_DESCRIPTORS` descriptors get Python lists; larger ones numpy arrays
    of ``dtype``, computed vectorised.

    Raises ``ValueError``, naming what is wrong, for: block or region lists that are not
    integers, block lists of different lengths, ``regions=None`` with layouts of different
    region counts, a region index outside either layout, block lengths that differ between the
    layouts in a selected region, or a block index outside its layout. Nothing is returned
    then, so no byte can move.
    """
    lb = _int_list(local_blocks, "local_blocks")
    rb = _int_list(remote_blocks, "remote_blocks")
    if len(lb) != len(rb):
        raise ValueError(
            f"local_blocks has {len(lb)} entries but remote_blocks has {len(rb)}; "
            "they pair one to one"
        )
    if regions is None:
        if local.num_regions != remote.num_regions:
            raise ValueError(
                f"the local layout has {local.num_regions} regions and the remote one "
                f"{remote.num_regions}; pass regions= to select regions both have"
            )
        sel = list(range(local.num_regions))
    else:
        sel = _int_list(regions, "regions")
        limit = min(local.num_regions, remote.num_regions)
        bad = [r for r in sel if not 0 <= r < limit]
        if bad:
            raise ValueError(
                f"region index out of range: the layouts have {local.num_regions} (local) and "
                f"{remote.num_regions} (remote) regions, got {bad}"
            )
    for r in sel:
        if local.block_lens[r] != remote.block_lens[r]:
            raise ValueError(
                f"region {r}: block lengths differ (local {local.block_lens[r]} bytes, remote "
                f"{remote.block_lens[r]}); both layouts must cut each selected region into "
                "blocks of the same size"
            )
    for blocks, nb, side in ((lb, local.num_blocks, "local"), (rb, remote.num_blocks, "remote")):
        if blocks and (min(blocks) < 0 or max(blocks) >= nb):
            raise ValueError(
                f"{side} block index out of range: the layout has {nb} blocks, "
                f"got min {min(blocks)}, max {max(blocks)}"
            )
    nbytes = len(lb) * sum(local.block_lens[r] for r in sel)
    lnb, rnb = local.num_blocks, remote.num_blocks
    if len(lb) * len(sel) <= SMALL_REQUEST_DESCRIPTORS:
        return DescriptorPairs(
            local=[r * lnb + b for r in sel for b in lb],
            remote=[r * rnb + b for r in sel for b in rb],
            nbytes=nbytes,
            regions=tuple(sel),
        )
    reg = np.asarray(sel, dtype=np.int64)[:, None]
    lids = (reg * lnb + np.asarray(lb, dtype=np.int64)[None, :]).reshape(-1).astype(dtype)
    rids = (reg * rnb + np.asarray(rb, dtype=np.int64)[None, :]).reshape(-1).astype(dtype)
    return DescriptorPairs(local=lids, remote=rids, nbytes=nbytes, regions=tuple(sel))


def descriptor_ids(
    layout: BlockLayout,
    blocks: Sequence[int] | npt.NDArray[Any],
    regions: Sequence[int] | npt.NDArray[Any] | None,
) -> npt.NDArray[np.int64]:
    """One side's descriptor ids (``r * num_blocks + b``, region-major) as an int64 array.

    Raises ``ValueError`` for a block or region index outside ``layout``. For a transfer,
    use :func:`pair_descriptors`, which validates both sides together.
    """
    pairs = pair_descriptors(layout, layout, blocks, blocks, regions)
    return np.asarray(pairs.local, dtype=np.int64)


@attrs.frozen(kw_only=True)
class Runs:
    """A request's descriptor pairs merged into runs (see :func:`contiguous_runs`): run ``i``
    moves ``lengths[i]`` bytes between ``local[i]`` and ``remote[i]`` (addresses), in region
    ``local_regions[i]`` / ``remote_regions[i]`` of each side's layout."""

    local: npt.NDArray[np.int64]
    remote: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    local_regions: npt.NDArray[np.int64]
    remote_regions: npt.NDArray[np.int64]

    @property
    def count(self) -> int:
        """The number of runs (descriptors each side once merged)."""
        return len(self.lengths)


def _addresses(
    layout: BlockLayout, ids: DescriptorIds
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    # (address, length, region) of each descriptor id, from the ids alone (O(request), not
    # O(layout)): id r * num_blocks + b is block b of region r.
    arr = np.asarray(ids, dtype=np.int64)
    region = arr // layout.num_blocks
    block = arr - region * layout.num_blocks
    base = np.array([r.addr for r in layout.regions], dtype=np.int64)
    blen = np.array(layout.block_lens, dtype=np.int64)
    return base[region] + block * blen[region], blen[region], region


def contiguous_runs(local: BlockLayout, remote: BlockLayout, pairs: DescriptorPairs) -> Runs:
    """Merge a request's pairs (from :func:`pair_descriptors` on these layouts) into runs.

    Pair ``i`` joins the run of pair ``i - 1`` when, on both sides, its block starts where the
    previous one ends and lies in the same region; so a request of blocks ``[4, 5, 6, 9]`` into
    ``[0, 1, 2, 3]`` over two regions is 4 runs (``4..6`` and ``9`` in each region), not 8
    descriptors. The bytes moved and their order are unchanged. A pure function of its
    arguments; raises nothing for pairs :func:`pair_descriptors` built on the same layouts.
    """
    la, ll, lr = _addresses(local, pairs.local)
    ra, _, rr = _addresses(remote, pairs.remote)
    if len(la) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(
            local=empty, remote=empty, lengths=empty, local_regions=empty, remote_regions=empty
        )
    joins = (
        (la[1:] == la[:-1] + ll[:-1])
        & (ra[1:] == ra[:-1] + ll[:-1])
        & (lr[1:] == lr[:-1])
        & (rr[1:] == rr[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return Runs(
        local=la[starts],
        remote=ra[starts],
        lengths=np.add.reduceat(ll, starts),
        local_regions=lr[starts],
        remote_regions=rr[starts],
    )


# -- peers -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PeerEntry(Generic[C]):
    """One known peer: its name, the incarnation its metadata named, and the transport's
    connection object for it."""

    name: str
    incarnation: Any
    """What tells two lives of the peer apart (a token in its metadata, or the metadata
    itself)."""
    epoch: int
    """Changes when the peer's prepared remote layouts stop being valid: on a new
    incarnation, and on an add after a removal. A rebuild with the same incarnation keeps it."""
    conn: C


@attrs.frozen(kw_only=True)
class PeerAdded(Generic[C]):
    """What :meth:`PeerTable.add` did."""

    entry: PeerEntry[C]
    replaced: PeerEntry[C] | None = None
    """The entry that was torn down first, when the name was known: a rebuild."""

    @property
    def rebuilt(self) -> bool:
        """Whether the name was known (the old connection was torn down first)."""
        return self.replaced is not None

    @property
    def restarted(self) -> bool:
        """Whether the name was known with another incarnation (the peer restarted)."""
        return self.replaced is not None and self.replaced.incarnation != self.entry.incarnation

    @property
    def layouts_kept(self) -> bool:
        """Whether remote layouts prepared before stay valid (a rebuild of the same
        incarnation)."""
        return self.replaced is not None and self.replaced.epoch == self.entry.epoch


@attrs.frozen(kw_only=True)
class Prepared(Generic[T]):
    """What a transport keeps in ``LayoutHandle.native``: who prepared the layout, for which
    peer and epoch (:meth:`PeerTable.check_prepared` checks them), and the transport's own
    descriptor table. Build local ones with :meth:`local` and remote ones with
    :meth:`PeerTable.prepared`."""

    owner: object
    peer: str | None
    """``None`` for a layout of this side's memory."""
    epoch: int = 0
    table: T

    @classmethod
    def local(cls, owner: object, table: T) -> Prepared[T]:
        """The record of a layout of ``owner``'s own memory."""
        return cls(owner=owner, peer=None, table=table)

    @staticmethod
    def check_local(handle: LayoutHandle, owner: object, who: str) -> Any:
        """The descriptor table behind a local layout handle ``owner`` prepared.

        Raises ``ValueError`` for a handle another transport prepared, or one that came
        from ``prepare_remote``.
        """
        prep = handle.native if isinstance(handle, LayoutHandle) else None
        if not isinstance(prep, Prepared) or prep.owner is not owner:
            raise ValueError(
                f"unknown layout handle: this local layout was not prepared by {who}; call "
                "prepare_local on this transport"
            )
        if prep.peer is not None:
            raise ValueError(
                "the local layout handle came from prepare_remote; use prepare_local(layout)"
            )
        return prep.table


class PeerTable(Generic[C]):
    """A transport's peers by name, with incarnation handling (the SPI's peer rules).

    :meth:`add` of a name already known is a **rebuild**: the old entry is removed and torn
    down first (``teardown(conn, why)``, which stops its transfers), then ``connect()`` makes
    the new connection; :class:`PeerAdded` says whether it was a rebuild and whether the peer
    restarted. :meth:`get` raises the SPI's :class:`~kvframe.errors.PeerUnreachableError` for an
    unknown name; :meth:`check_prepared` refuses remote layouts of an older incarnation.
    """

    def __init__(self, who: str, teardown: Callable[[C, str], None]) -> None:
        """``who`` names the transport in messages; ``teardown(conn, why)`` stops whatever the
        transport runs on a connection that is removed or replaced. It must not raise."""
        self.who = who
        """The transport's name in messages."""
        self._teardown = teardown
        self._entries: dict[str, PeerEntry[C]] = {}
        self._epochs = itertools.count(1)
        self.rebuilds = 0
        """How many :meth:`add` calls replaced a known peer."""

    def add(self, name: str, incarnation: Any, connect: Callable[[], C]) -> PeerAdded[C]:
        """Make ``name`` known with a new connection from ``connect()``.

        A known name is torn down first, whatever its incarnation (a caller re-adds a peer to
        reconnect, so an old connection that failed unseen must not survive). Raises what
        ``connect`` raises; then no entry of that name is left (a known one was torn down).
        """
        old = self._entries.pop(name, None)
        if old is not None:
            self.rebuilds += 1
            why = (
                f"peer {name!r} was added again (rebuilt)"
                if old.incarnation == incarnation
                else f"peer {name!r} restarted (added again with new metadata)"
            )
            self._teardown(old.conn, why)
        conn = connect()
        keep = old is not None and old.incarnation == incarnation
        epoch = old.epoch if keep and old is not None else next(self._epochs)
        entry = PeerEntry(name=name, incarnation=incarnation, epoch=epoch, conn=conn)
        self._entries[name] = entry
        return PeerAdded(entry=entry, replaced=old)

    def remove(self, name: str, why: str | None = None) -> PeerEntry[C] | None:
        """Forget ``name`` and tear its connection down; returns the entry, or ``None`` for an
        unknown name (ignored, as the SPI says)."""
        entry = self._entries.pop(name, None)
        if entry is not None:
            self._teardown(entry.conn, why or f"peer {name!r} was removed")
        return entry

    def discard(self, conn: C, why: str) -> None:
        """Tear ``conn`` down, and forget its entry if it is still the current one of its name
        (for a connection found broken while a newer one may already have replaced it)."""
        for name, entry in list(self._entries.items()):
            if entry.conn is conn:
                self.remove(name, why)
                return
        self._teardown(conn, why)

    def clear(self, why: str) -> None:
        """Tear every peer down (for ``close()``)."""
        for name in list(self._entries):
            self.remove(name, why)

    def get(self, name: str) -> PeerEntry[C]:
        """The entry of ``name``. Raises :class:`~kvframe.errors.PeerUnreachableError` for an
        unknown name."""
        entry = self._entries.get(name)
        if entry is None:
            raise PeerUnreachableError(
                f"{self.who}: unknown peer {name!r}; add it with add_peer(metadata) first"
            )
        return entry

    def find(self, name: str) -> PeerEntry[C] | None:
        """The entry of ``name``, or ``None``."""
        return self._entries.get(name)

    def prepared(self, owner: object, name: str, table: T) -> Prepared[T]:
        """A :class:`Prepared` record for a layout of ``name``'s memory, stamped with the
        peer's current epoch. Raises :class:`~kvframe.errors.PeerUnreachableError` for an
        unknown name."""
        return Prepared(owner=owner, peer=name, epoch=self.get(name).epoch, table=table)

    def check_prepared(self, handle: LayoutHandle, owner: object) -> tuple[PeerEntry[C], Any]:
        """The peer entry and the descriptor table behind a remote layout handle.

        Raises ``ValueError`` for a handle this transport did not prepare or a local one, and
        :class:`~kvframe.errors.PeerUnreachableError` when the peer is unknown now or the
        layout was prepared for an older incarnation (or before a removal).
        """
        prep = handle.native if isinstance(handle, LayoutHandle) else None
        if not isinstance(prep, Prepared) or prep.owner is not owner:
            raise ValueError(
                f"unknown layout handle: this remote layout was not prepared by {self.who}; "
                "call prepare_remote on this transport"
            )
        if prep.peer is None:
            raise ValueError(
                "the remote layout handle came from prepare_local; use prepare_remote(peer, layout)"
            )
        entry = self._entries.get(prep.peer)
        if entry is None or entry.epoch != prep.epoch:
            raise PeerUnreachableError(
                f"{self.who}: peer {prep.peer!r} was removed or replaced since this remote "
                "layout was prepared; add it and call prepare_remote again"
            )
        return entry, prep.table

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[PeerEntry[C]]:
        return iter(list(self._entries.values()))


# -- a post, checked ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PostRequest(Generic[C]):
    """A ``post`` that passed every check of the SPI (see :func:`check_post`)."""

    op: Op
    local: Any
    """The local layout's descriptor table (``Prepared.table``)."""
    remote: Any
    """The remote layout's descriptor table."""
    peer: PeerEntry[C]
    """The peer the remote layout was prepared for, as it is now."""
    pairs: DescriptorPairs
    notification: bytes | None


def check_post(
    transport: Any,
    peers: PeerTable[C],
    op: Any,
    local: LayoutHandle,
    local_blocks: Sequence[int] | npt.NDArray[Any],
    remote: LayoutHandle,
    remote_blocks: Sequence[int] | npt.NDArray[Any],
    *,
    regions: Sequence[int] | npt.NDArray[Any] | None,
    notification: Any,
    dtype: type[np.integer[Any]] = np.int64,
) -> PostRequest[C]:
    """Every check :meth:`~kvframe.spi.transport.Transport.post` owes its caller, in one call:
    the op against ``transport.capabilities`` (:func:`check_op`), the local handle
    (:meth:`Prepared.check_local`), the remote handle against the peer's current incarnation
    (:meth:`PeerTable.check_prepared`), the blocks (:func:`pair_descriptors`) and the
    notification (:func:`check_notification`).

    Raises what those raise — ``ValueError``, :class:`~kvframe.errors.CapabilityError`,
    :class:`~kvframe.errors.PeerUnreachableError` — before anything was started. The
    transport's own checks (is the peer's connection alive?) come after.
    """
    who = peers.who
    caps: TransportCapabilities = transport.capabilities
    checked_op = check_op(op, caps, who)
    ltable = Prepared.check_local(local, transport, who)
    entry, rtable = peers.check_prepared(remote, transport)
    pairs = pair_descriptors(
        local.layout, remote.layout, local_blocks, remote_blocks, regions, dtype=dtype
    )
    payload = None if notification is None else check_notification(notification, caps, who)
    return PostRequest(
        op=checked_op, local=ltable, remote=rtable, peer=entry, pairs=pairs, notification=payload
    )


# -- transfers ---------------------------------------------------------------------------------


class Transfer(Generic[R]):
    """The mutable side of one frozen :class:`~kvframe.spi.transport.XferHandle`, kept in its
    ``native`` field: the status, whether it was released, and the transport's own ``record``.

    Its state moves once, from ``PENDING`` to ``DONE`` (:meth:`done`) or ``FAILED``
    (:meth:`fail`); later calls change nothing and return ``False``, so a transport need not
    check first. :attr:`status` is what ``poll`` answers.
    """

    __slots__ = ("_released", "_status", "nbytes", "owner", "record")

    def __init__(self, owner: object, record: R, nbytes: int) -> None:
        """A pending transfer of ``nbytes`` posted by ``owner``, with the transport's
        ``record``. Use :meth:`post` to get the handle at the same time."""
        self.owner = owner
        self.record = record
        self.nbytes = nbytes
        self._status = XferStatus.pending()
        self._released = False

    @classmethod
    def post(
        cls, owner: object, record: R, *, op: Op, peer: str, pairs: DescriptorPairs
    ) -> tuple[XferHandle, Transfer[R]]:
        """A new pending transfer and the frozen handle that carries it."""
        tr = cls(owner, record, pairs.nbytes)
        handle = XferHandle(
            op=op, peer=peer, nbytes=pairs.nbytes, num_descriptors=pairs.count, native=tr
        )
        return handle, tr

    @staticmethod
    def of(handle: XferHandle, owner: object, record_type: type[T]) -> Transfer[T]:
        """The transfer behind a handle ``owner`` posted. Raises ``ValueError`` for anything
        else (a handle of another transport, not a handle at all)."""
        tr = handle.native if isinstance(handle, XferHandle) else None
        if (
            not isinstance(tr, Transfer)
            or tr.owner is not owner
            or not isinstance(tr.record, record_type)
        ):
            raise ValueError("unknown transfer handle: it was not posted by this transport")
        return tr

    @classmethod
    def polling(cls, handle: XferHandle, owner: object, record_type: type[T]) -> Transfer[T]:
        """:meth:`of`, for ``poll``: also raises :class:`~kvframe.errors.TransportClosedError`
        once the handle was released."""
        tr = cls.of(handle, owner, record_type)
        tr.polled()
        return tr

    @property
    def status(self) -> XferStatus:
        """The status as it stands (a frozen value)."""
        return self._status

    @property
    def pending(self) -> bool:
        """Whether it is still ``PENDING``."""
        return self._status.state is XferState.PENDING

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released

    def done(self, transfer_seconds: float | None = None) -> bool:
        """``PENDING`` → ``DONE``; ``False`` (and no change) when it had already stopped."""
        if not self.pending:
            return False
        self._status = XferStatus.done(self.nbytes, transfer_seconds)
        return True

    def fail(self, error: TransportError) -> bool:
        """``PENDING`` → ``FAILED`` with ``error``; ``False`` (and no change) when it had
        already stopped."""
        if not self.pending:
            return False
        self._status = XferStatus.failed(error)
        return True

    def release(self) -> bool:
        """Mark it released; ``True`` the first time, ``False`` after (releasing twice is a
        no-op). Stopping the transfer is the transport's job, before or after this."""
        first = not self._released
        self._released = True
        return first

    def polled(self) -> XferStatus:
        """:attr:`status`, for ``poll``. Raises :class:`~kvframe.errors.TransportClosedError`
        once released."""
        if self._released:
            raise TransportClosedError("this transfer handle was released; do not poll it again")
        return self._status

    def __repr__(self) -> str:
        state = self._status.state.name + (", released" if self._released else "")
        return f"<Transfer {state} {self.nbytes} bytes>"
