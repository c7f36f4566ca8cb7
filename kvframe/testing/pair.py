"""Connected pairs of endpoints: what the conformance kit and its state machine test on.

A :class:`Pair` is endpoint ``a`` in the test process (its transport is ``pair.a.transport``)
and endpoint ``b`` — in a child process when the transport's capabilities say
``cross_process``, else in this process. Both have registered one host buffer cut into a
three-region :class:`~kvframe.spi.transport.BlockLayout` (block lengths :data:`BLOCK_LENS`,
:data:`NUM_BLOCKS` blocks), know each other as peers and have prepared each other's layout.
Build one with :func:`make_pair`, or many with :func:`pair_factory`.

**Time.** A pair waits (for a transfer, for notifications) on its own :attr:`Pair.clock`. When
both endpoints are in this process nothing needs real time to pass — the in-process transport
completes in progress steps — so the pair waits on a :class:`~kvframe.testing.FakeClock`
that advances a fixed step per round of progress and never sleeps: its timeouts count rounds,
and a test runs as fast, and as deterministically, as the transport allows. With a child
process the pair waits in real time (the child makes progress on its own clock).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np

from kvframe.spi.transport import (
    BlockLayout,
    MemoryRegion,
    Notification,
    TransportCapabilities,
    XferState,
)
from kvframe.testing.clock import FakeClock
from kvframe.testing.endpoint import ChildEndpoint, Endpoint, LocalEndpoint, TransportSpec

__all__ = [
    "BLOCK_LENS",
    "NUM_BLOCKS",
    "POLL_INTERVAL",
    "Pair",
    "PairFactory",
    "expected_after",
    "make_layout",
    "make_pair",
    "pair_factory",
]

T = TypeVar("T")

POLL_INTERVAL = 0.0002
"""Seconds between two rounds of progress while a pair waits (real or fake)."""

#: Block length of each region of the kit's layout (deliberately different per region).
BLOCK_LENS = (256, 64, 1024)
#: Blocks per region in the kit's layout.
NUM_BLOCKS = 16


def make_layout(buffer: MemoryRegion, block_lens: Sequence[int], num_blocks: int) -> BlockLayout:
    """Cut ``buffer`` into consecutive regions of ``num_blocks`` blocks each.

    Raises ``ValueError`` when the buffer is too small.
    """
    need = sum(block_lens) * num_blocks
    if need > buffer.length:
        raise ValueError(f"buffer of {buffer.length} bytes is too small; the layout needs {need}")
    regions = []
    addr = buffer.addr
    for blen in block_lens:
        regions.append(
            MemoryRegion(
                addr=addr, length=blen * num_blocks, kind=buffer.kind, device_id=buffer.device_id
            )
        )
        addr += blen * num_blocks
    return BlockLayout(regions=regions, block_lens=list(block_lens), num_blocks=num_blocks)


def _offsets(layout: BlockLayout) -> list[int]:
    base = layout.regions[0].addr
    return [r.addr - base for r in layout.regions]


def expected_after(
    dst: np.ndarray[Any, Any],
    src: np.ndarray[Any, Any],
    layout: BlockLayout,
    dst_blocks: Sequence[int],
    src_blocks: Sequence[int],
    regions: Sequence[int] | None,
) -> np.ndarray[Any, Any]:
    """What the destination buffer holds after a transfer: ``dst`` with the selected blocks
    replaced by the paired ``src`` blocks (both buffers laid out by :func:`make_layout`)."""
    out = dst.copy()
    offsets = _offsets(layout)
    for r in range(layout.num_regions) if regions is None else regions:
        blen = layout.block_lens[r]
        for d, s in zip(dst_blocks, src_blocks, strict=True):
            out[offsets[r] + d * blen : offsets[r] + (d + 1) * blen] = src[
                offsets[r] + s * blen : offsets[r] + (s + 1) * blen
            ]
    return out


@attrs.define(eq=False)
class Pair:
    """Two connected endpoints of the transport under test (see the module docstring).

    ``a_local``/``a_remote`` are ``a``'s layout ids for its own buffer and for ``b``'s;
    ``b_local``/``b_remote`` likewise for ``b``. ``peer_a``/``peer_b`` are the names each
    side's ``add_peer`` returned (``b``'s name as seen by ``a`` is ``peer_b``).
    """

    a: LocalEndpoint
    b: Endpoint
    cross_process: bool
    timeout: float
    a_buffer: MemoryRegion
    b_buffer: MemoryRegion
    a_layout: BlockLayout
    b_layout: BlockLayout
    a_local: int
    a_remote: int
    b_local: int
    b_remote: int
    peer_a: str
    peer_b: str
    a_data: np.ndarray[Any, Any]
    """What ``a``'s buffer was filled with at set-up."""
    b_data: np.ndarray[Any, Any]
    """What ``b``'s buffer was filled with at set-up."""
    clock: Callable[[], float] = time.monotonic
    """What the pair's waits read: a :class:`~kvframe.testing.FakeClock` for a pair in this
    process, ``time.monotonic`` with a child (see the module docstring)."""
    sleep: Callable[[float], object] = time.sleep
    """How the pair lets time pass between two rounds: the fake clock's ``advance``, or
    ``time.sleep``."""

    @property
    def fake_time(self) -> bool:
        """Whether the pair waits on a fake clock."""
        return isinstance(self.clock, FakeClock)

    @property
    def caps(self) -> TransportCapabilities:
        """The transport's capabilities (as ``a`` reports them)."""
        return self.a.capabilities

    def pump(self) -> None:
        """One round of progress on both sides."""
        self.a.pump()
        self.b.pump()

    def read_a(self) -> np.ndarray[Any, Any]:
        """``a``'s whole buffer, as bytes in a numpy array."""
        return np.frombuffer(self.a.read(self.a_buffer.addr, self.a_buffer.length), np.uint8)

    def read_b(self) -> np.ndarray[Any, Any]:
        """``b``'s whole buffer, as bytes in a numpy array."""
        return np.frombuffer(self.b.read(self.b_buffer.addr, self.b_buffer.length), np.uint8)

    def wait(self, ep: Endpoint, xfer: int, timeout: float | None = None) -> XferState:
        """Poll ``xfer`` on ``ep`` until it stops; pumps the other side meanwhile.

        Raises ``AssertionError`` when it is still ``PENDING`` after ``timeout`` (default:
        the pair's timeout).
        """
        bound = self.timeout if timeout is None else timeout
        state = self._until(ep, lambda: ep.poll(xfer).state, _stopped, bound)
        if state is None:
            raise AssertionError(f"transfer still PENDING after {bound} s{self._kind()}")
        return state

    def wait_notifications(
        self, ep: Endpoint, count: int, timeout: float | None = None
    ) -> list[Notification]:
        """Drain ``ep`` until ``count`` notifications arrived (pumping the other side); returns
        all that arrived. Raises ``AssertionError`` on timeout, listing what did arrive."""
        got: list[Notification] = []

        def drain() -> int:
            got.extend(ep.drain())
            return len(got)

        bound = self.timeout if timeout is None else timeout
        if self._until(ep, drain, lambda n: n >= count, bound) is None:
            raise AssertionError(
                f"{len(got)} of {count} notifications arrived{self._kind()}: {got!r}"
            )
        return got

    def _until(
        self, ep: Endpoint, look: Callable[[], T], ok: Callable[[T], bool], bound: float
    ) -> T | None:
        """``look()`` until ``ok`` of it, pumping the side that is not ``ep`` between rounds;
        ``None`` after ``bound`` seconds of :attr:`clock`."""
        deadline = self.clock() + bound
        other = self.b if ep is self.a else self.a
        while True:
            seen = look()
            if ok(seen):
                return seen
            other.pump()
            if self.clock() > deadline:
                return None
            self.sleep(POLL_INTERVAL)

    def settle(self, rounds: int = 20) -> None:
        """Pump both sides ``rounds`` times (lets a wrongly started transfer do its damage)."""
        for _ in range(rounds):
            self.pump()
            self.sleep(POLL_INTERVAL)

    def _kind(self) -> str:
        return " (fake time: rounds of progress)" if self.fake_time else ""

    def close(self) -> None:
        """Shut both endpoints down (closing transports, stopping a child). Idempotent."""
        self.a.shutdown()
        self.b.shutdown()


def _stopped(state: XferState) -> bool:
    return state is not XferState.PENDING


#: Builds a new connected pair; ``cross_process=None`` follows the capabilities.
PairFactory = Callable[..., Pair]


def make_pair(
    spec: TransportSpec,
    *,
    cross_process: bool | None = None,
    timeout: float = 10.0,
    seed: int = 0,
    fake_time: bool | None = None,
    block_lens: Sequence[int] = BLOCK_LENS,
    num_blocks: int = NUM_BLOCKS,
) -> Pair:
    """Build two endpoints of ``spec``'s transport, register and fill a buffer on each,
    connect them both ways and prepare each other's layout.

    ``block_lens`` and ``num_blocks`` shape the layout (default: the kit's
    :data:`BLOCK_LENS` and :data:`NUM_BLOCKS`); the kit's ordering checks use a layout of a
    few MiB.

    ``cross_process`` ``None`` puts ``b`` in a child process exactly when the transport's
    capabilities say ``cross_process``. ``fake_time`` ``None`` makes the pair wait on a
    :class:`~kvframe.testing.FakeClock` exactly when ``b`` is in this process; pass ``False``
    for a local transport whose own threads need real time to pass. Raises what the transport
    raises during set-up (everything created so far is shut down first).
    """
    tag = uuid.uuid4().hex[:8]
    a = LocalEndpoint(spec.build(f"kit-{tag}-a"))
    b: Endpoint | None = None
    try:
        remote = a.capabilities.cross_process if cross_process is None else cross_process
        if remote:
            b = ChildEndpoint.start(spec, f"kit-{tag}-b", timeout=timeout, pump=a.pump)
        else:
            b = LocalEndpoint(spec.build(f"kit-{tag}-b"))
        size = sum(block_lens) * num_blocks
        rng = np.random.default_rng(seed)
        buffers = []
        data = []
        for ep in (a, b):
            buf = ep.alloc(size)
            content = rng.integers(0, 256, size, dtype=np.uint8)
            ep.write(buf.addr, content.tobytes())
            ep.register([buf])
            buffers.append(buf)
            data.append(content)
        fake = not remote if fake_time is None else fake_time
        clock: Callable[[], float] = time.monotonic
        sleep: Callable[[float], object] = time.sleep
        if fake:
            fake_clock = FakeClock()
            clock, sleep = fake_clock, fake_clock.advance
        a_layout = make_layout(buffers[0], block_lens, num_blocks)
        b_layout = make_layout(buffers[1], block_lens, num_blocks)
        a_meta, b_meta = a.metadata(), b.metadata()
        peer_b = a.add_peer(b_meta)
        peer_a = b.add_peer(a_meta)
        return Pair(
            a=a,
            b=b,
            cross_process=remote,
            timeout=timeout,
            a_buffer=buffers[0],
            b_buffer=buffers[1],
            a_layout=a_layout,
            b_layout=b_layout,
            a_local=a.prepare_local(a_layout),
            a_remote=a.prepare_remote(peer_b, b_layout),
            b_local=b.prepare_local(b_layout),
            b_remote=b.prepare_remote(peer_a, a_layout),
            peer_a=peer_a,
            peer_b=peer_b,
            a_data=data[0],
            b_data=data[1],
            clock=clock,
            sleep=sleep,
        )
    except BaseException:
        a.shutdown()
        if b is not None:
            b.shutdown()
        raise


@contextlib.contextmanager
def pair_factory(spec: TransportSpec, *, timeout: float) -> Iterator[PairFactory]:
    """A pair factory whose pairs are all shut down when the context exits."""
    made: list[Pair] = []

    def factory(**kwargs: Any) -> Pair:
        kwargs.setdefault("timeout", timeout)
        pair = make_pair(spec, **kwargs)
        made.append(pair)
        return pair

    try:
        yield factory
    finally:
        for pair in made:
            pair.close()
