"""The NIXL transport against real NIXL, across two processes on loopback.

Each module-scoped endpoint pair is used twice: posting inline and posting from the worker
thread (``post_thread``). The child endpoint is ``nixl_peer.py``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from conftest import BLOCK_LENS, NUM_BLOCKS, Local, Peer
from hypothesis import given, settings
from hypothesis import strategies as st
from kvframe_nixl import CAPABILITIES, MAX_NOTIFICATION_BYTES, NixlOptions, NixlTransport

from kvframe.errors import (
    CapabilityError,
    ConfigError,
    PeerUnreachableError,
    TransportClosedError,
    TransportError,
)
from kvframe.spi.transport import (
    BlockLayout,
    MemoryKind,
    MemoryRegion,
    Op,
    TransportParams,
    XferHandle,
    XferState,
    XferStatus,
)

pytestmark = pytest.mark.nixl

MIB = 1 << 20


def wait(local: Local, h: XferHandle, timeout: float = 10.0) -> XferStatus:
    """Poll until the transfer stops (driving progress), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (status := local.t.poll(h)).stopped:
        assert time.monotonic() < deadline, "transfer did not stop in time"
        local.t.progress()
    return status


def drain_until(local: Local, n: int, timeout: float = 5.0) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got.extend((x.sender, x.payload) for x in local.t.drain_notifications())
    return got


def transfer_requests() -> st.SearchStrategy[tuple[list[int], list[int], list[int] | None]]:
    """(local blocks, remote blocks, regions or None): distinct destination blocks."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[list[int], list[int], list[int] | None]:
        n = draw(st.integers(1, 12))
        dst = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True))
        src = draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=n, max_size=n))
        regions = draw(
            st.none() | st.lists(st.integers(0, len(BLOCK_LENS) - 1), min_size=1, unique=True)
        )
        return dst, src, regions

    return build()


# -- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"bogus": 1}, r"nixl transport_options\.bogus: unknown key"),
        ({"post_treahd": 1}, "did you mean 'post_thread'"),
        ({"backends": "UCX"}, r"transport_options\.backends: got 'UCX' \(str\)"),
        ({"backends": []}, r"transport_options\.backends: got \[\]"),
        ({"progress_thread": "yes"}, r"transport_options\.progress_thread: .*true or false"),
        ({"num_threads": -1}, r"transport_options\.num_threads: .*an integer >= 0"),
        ({"num_threads": True}, r"transport_options\.num_threads: got True \(bool\)"),
        ({"post_thread": 1}, r"transport_options\.post_thread: got 1 \(int\)"),
        ({"ucx_env": {"TLS": "tcp"}}, r"transport_options\.ucx_env: .*UCX_\* names"),
        ({"inline_post_bytes": -1}, r"transport_options\.inline_post_bytes: got -1"),
    ],
)
def test_bad_options_raise_config_error_naming_the_key(
    options: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        NixlOptions.from_mapping(options)


def test_options_defaults_and_values() -> None:
    assert NixlOptions.from_mapping({}) == NixlOptions()
    opts = NixlOptions.from_mapping(
        {"backends": ["UCX"], "num_threads": 2, "ucx_env": {"UCX_TLS": "cma,self"}}
    )
    assert opts.backends == ("UCX",)
    assert opts.num_threads == 2
    assert not opts.progress_thread


def test_missing_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="NOPE"):
        NixlTransport.create(TransportParams(name="x", options={"backends": ["NOPE"]}))


def test_plugin_registers_nixl() -> None:
    from kvframe_nixl import plugin

    seen: list[tuple[str, Any, Any]] = []

    def register(name: str, factory: Any, *, capabilities: Any) -> None:
        seen.append((name, factory, capabilities))

    plugin.kvframe_register_transports(register)
    assert seen == [("nixl", NixlTransport.create, CAPABILITIES)]


# -- data path -------------------------------------------------------------------------------


@settings(max_examples=25)  # each example is a cross-process round trip
@given(req=transfer_requests())
def test_read_is_byte_exact(local: Local, peer: tuple[Peer, Any], req: Any) -> None:
    p, remote = peer
    dst, src, regions = req
    for b in local.bufs:
        b[:] = 0x5A
    h = local.t.post(Op.READ, local.local, dst, remote, src, regions=regions)
    assert (st := wait(local, h)).state is XferState.DONE, st.error
    local.t.release(h)
    chosen = range(len(BLOCK_LENS)) if regions is None else regions
    for r in range(len(BLOCK_LENS)):
        want = np.full((NUM_BLOCKS, BLOCK_LENS[r]), 0x5A, dtype=np.uint8)
        if r in chosen:
            source = p_content(p, r)
            want[dst] = source[src]
        np.testing.assert_array_equal(local.view(r), want, err_msg=f"region {r}")


_model: dict[str, list[np.ndarray[Any, Any]]] = {}


def p_content(p: Peer, r: int) -> np.ndarray[Any, Any]:
    """What the peer's region ``r`` holds now (a model updated by the WRITE test)."""
    if p.name not in _model:
        _model[p.name] = [p.expected(i) for i in range(len(BLOCK_LENS))]
    return _model[p.name][r].reshape(NUM_BLOCKS, BLOCK_LENS[r])


@settings(max_examples=15)  # each example reads the peer's memory back over the pipe
@given(req=transfer_requests(), seed=st.integers(0, 2**32 - 1))
def test_write_is_byte_exact(local: Local, peer: tuple[Peer, Any], req: Any, seed: int) -> None:
    p, remote = peer
    dst, src, regions = req
    rng = np.random.default_rng(seed)
    for b in local.bufs:
        b[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
    # For a WRITE the remote blocks are the destination: keep them distinct.
    h = local.t.post(Op.WRITE, local.local, src, remote, dst, regions=regions)
    assert (st := wait(local, h)).state is XferState.DONE, st.error
    local.t.release(h)
    chosen = range(len(BLOCK_LENS)) if regions is None else regions
    for r in range(len(BLOCK_LENS)):
        model = p_content(p, r)
        if r in chosen:
            model[dst] = local.view(r)[src]
        got = np.frombuffer(p.call("get", drive=local.t, region=r), dtype=np.uint8)
        np.testing.assert_array_equal(got.reshape(model.shape), model, err_msg=f"region {r}")


def test_stats_count_transfers(local: Local, peer: tuple[Peer, Any]) -> None:
    _, remote = peer
    before = dict(local.t.stats())
    h = local.t.post(Op.READ, local.local, [0, 1], remote, [2, 3])
    assert wait(local, h).state is XferState.DONE
    local.t.release(h)
    after = local.t.stats()
    assert after["transfers_posted"] == before["transfers_posted"] + 1
    assert after["transfers_done"] == before["transfers_done"] + 1
    assert after["bytes"] == before["bytes"] + 2 * sum(BLOCK_LENS)
    # Blocks 0, 1 into 2, 3 are adjacent on both sides: merge_runs posts one NIXL descriptor
    # per region.
    merged = len(BLOCK_LENS) if local.t.options.merge_runs else 0
    assert after["descriptors"] == before["descriptors"] + 2 * len(BLOCK_LENS) - merged
    assert after["descriptors_merged"] == before["descriptors_merged"] + merged
    assert after["post_time_us"] > before["post_time_us"]
    assert after["nixl_xfer_us"] >= before["nixl_xfer_us"]
    assert after["peers"] >= 1


@pytest.mark.parametrize(
    ("dst", "src", "runs"),
    [
        ([0, 1, 2, 3], [4, 5, 6, 7], 1),  # one run
        ([0, 1, 2, 5], [4, 5, 6, 7], 2),  # the destination breaks after block 2
        ([0, 1, 2, 3], [4, 5, 7, 8], 2),  # the source breaks after block 5
        ([3, 2, 1, 0], [4, 5, 6, 7], 4),  # descending: nothing adjacent in request order
        ([0, 2, 4, 6], [1, 3, 5, 7], 4),
    ],
)
def test_merge_runs_posts_one_descriptor_per_run_and_region(
    local: Local, peer: tuple[Peer, Any], dst: list[int], src: list[int], runs: int
) -> None:
    p, remote = peer
    before = dict(local.t.stats())
    rng = np.random.default_rng(len(dst) + runs)
    for b in local.bufs:
        b[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
    h = local.t.post(Op.READ, local.local, dst, remote, src)
    assert h.num_descriptors == len(dst) * len(BLOCK_LENS)  # the SPI's count: blocks x regions
    assert (st := wait(local, h)).state is XferState.DONE, st.error
    local.t.release(h)
    after = local.t.stats()
    if not local.t.options.merge_runs:
        runs = len(dst)  # one prepared descriptor per block and region
    assert after["descriptors"] - before["descriptors"] == runs * len(BLOCK_LENS)
    merged = (len(dst) - runs) * len(BLOCK_LENS)
    assert after["descriptors_merged"] - before["descriptors_merged"] == merged
    for r in range(len(BLOCK_LENS)):  # and the bytes are the peer's, block by block
        np.testing.assert_array_equal(local.view(r)[dst], p_content(p, r)[src])


# -- notifications ---------------------------------------------------------------------------


def test_notifications_both_ways(local: Local, peer: tuple[Peer, Any]) -> None:
    p, _ = peer
    local.t.send_notification(p.name, b"to-p-1")
    local.t.send_notification(p.name, b"")
    local.t.send_notification(p.name, b"x" * MAX_NOTIFICATION_BYTES)
    deadline = time.monotonic() + 5
    got: list[Any] = []
    while len(got) < 3 and time.monotonic() < deadline:
        got += p.call("drain", drive=local.t)
    assert got == [
        [local.t.name, b"to-p-1"],
        [local.t.name, b""],
        [local.t.name, b"x" * MAX_NOTIFICATION_BYTES],
    ]
    p.call("notify", drive=local.t, peer=local.t.name, payload=b"to-d")
    assert drain_until(local, 1) == [(p.name, b"to-d")]


def test_write_notification_arrives_after_the_data(local: Local, peer: tuple[Peer, Any]) -> None:
    p, remote = peer
    blocks = [5, 6, 7]
    tag = f"written-{time.monotonic_ns()}".encode()
    local.view(0)[blocks] = np.arange(len(blocks), dtype=np.uint8)[:, None] + 100
    p.send("snapshot_on_notification", payload=tag, region=0, blocks=blocks, timeout=10.0)
    h = local.t.post(Op.WRITE, local.local, blocks, remote, blocks, regions=[0], notification=tag)
    assert wait(local, h).state is XferState.DONE
    local.t.release(h)
    seen, snapshot = p.result(drive=local.t)
    assert seen
    # The peer copied the blocks the moment it saw the notification: the data was there.
    assert snapshot == local.view(0)[blocks].tobytes()
    p_content(p, 0)[blocks] = local.view(0)[blocks]


def test_read_notification_lets_the_peer_reuse_blocks(local: Local, peer: tuple[Peer, Any]) -> None:
    p, remote = peer
    blocks = [10, 11]
    tag = f"read-done-{time.monotonic_ns()}".encode()
    want = p_content(p, 1)[blocks].copy()
    p.send("overwrite_on_notification", payload=tag, region=1, blocks=blocks, timeout=10.0)
    h = local.t.post(Op.READ, local.local, [0, 1], remote, blocks, regions=[1], notification=tag)
    assert wait(local, h).state is XferState.DONE
    local.t.release(h)
    assert p.result(drive=local.t) is True
    p_content(p, 1)[blocks] = 0xEE
    # Everything landed before the peer was told (and overwrote its blocks).
    np.testing.assert_array_equal(local.view(1)[[0, 1]], want)


def test_empty_request_still_notifies(local: Local, peer: tuple[Peer, Any]) -> None:
    p, remote = peer
    h = local.t.post(Op.READ, local.local, [], remote, [], notification=b"nothing-to-move")
    assert h.nbytes == 0
    assert wait(local, h).state is XferState.DONE
    local.t.release(h)
    deadline = time.monotonic() + 5
    got: list[Any] = []
    while not got and time.monotonic() < deadline:
        got = p.call("drain", drive=local.t)
    assert got == [[local.t.name, b"nothing-to-move"]]


# -- misuse ----------------------------------------------------------------------------------


def test_invalid_requests_raise_before_anything_moves(local: Local, peer: tuple[Peer, Any]) -> None:
    p, remote = peer
    t = local.t
    with pytest.raises(ValueError, match="block index out of range"):
        t.post(Op.READ, local.local, [NUM_BLOCKS], remote, [0])
    with pytest.raises(ValueError, match="block index out of range"):
        t.post(Op.READ, local.local, [0], remote, [-1])
    with pytest.raises(ValueError, match="region index out of range"):
        t.post(Op.READ, local.local, [0], remote, [0], regions=[len(BLOCK_LENS)])
    with pytest.raises(ValueError, match="pair one to one"):
        t.post(Op.READ, local.local, [0, 1], remote, [0])
    with pytest.raises(ValueError, match="came from prepare_local"):
        t.post(Op.READ, local.local, [0], local.local, [0])
    with pytest.raises(ValueError, match="came from prepare_remote"):
        t.post(Op.READ, remote, [0], remote, [0])
    with pytest.raises(ValueError, match="payload is bytes"):
        t.send_notification(p.name, "text")  # type: ignore[arg-type]
    with pytest.raises(CapabilityError, match="exceeds"):
        t.post(
            Op.READ, local.local, [0], remote, [0], notification=b"x" * (1 + MAX_NOTIFICATION_BYTES)
        )
    with pytest.raises(CapabilityError, match="exceeds"):
        t.send_notification(p.name, b"x" * (1 + MAX_NOTIFICATION_BYTES))
    with pytest.raises(PeerUnreachableError, match="unknown peer"):
        t.send_notification("nobody", b"x")
    with pytest.raises(PeerUnreachableError, match="unknown peer"):
        t.prepare_remote("nobody", p.layout)
    with pytest.raises(PeerUnreachableError, match=r"does not decode|not from"):
        t.add_peer(b"\xc1garbage")
    with pytest.raises(PeerUnreachableError, match="itself"):
        t.add_peer(t.local_metadata())
    assert t.add_peer(p.meta) == p.name  # same metadata again: a rebuild; handles keep working
    other = NixlTransport.create(TransportParams(name=f"other-{os.getpid()}"))
    try:
        with pytest.raises(ValueError, match="unknown layout handle: this local layout"):
            other.post(Op.READ, local.local, [0], remote, [0])
    finally:
        other.close()
    unregistered = np.zeros(4096, dtype=np.uint8)
    bad = BlockLayout(
        regions=[MemoryRegion(addr=unregistered.ctypes.data, length=4096)],
        block_lens=[1024],
        num_blocks=4,
    )
    with pytest.raises(ValueError, match="not inside memory registered by this endpoint"):
        t.prepare_local(bad)
    # Nothing above disturbed the transport.
    h = t.post(Op.READ, local.local, [1], remote, [1])
    assert wait(local, h).state is XferState.DONE
    t.release(h)
    t.release(h)  # twice: a no-op
    with pytest.raises(TransportClosedError):
        t.poll(h)


def test_device_memory_without_cuda_support_is_a_capability_error() -> None:
    t = NixlTransport.create(TransportParams(name=f"dev-{os.getpid()}"))
    try:
        buf = np.zeros(4096, dtype=np.uint8)
        region = MemoryRegion(addr=buf.ctypes.data, length=4096, kind=MemoryKind.DEVICE)
        mixed = BlockLayout(
            regions=[MemoryRegion(addr=buf.ctypes.data, length=2048), region],
            block_lens=[1024, 1024],
            num_blocks=2,
        )
        with pytest.raises(CapabilityError, match="one memory kind"):
            t.prepare_local(mixed)
        # UCX here advertises VRAM; registering host memory as VRAM must then fail in NIXL
        # (no CUDA), and be reported as a kvframe error with nothing registered.
        with pytest.raises(TransportError, match="registering memory"):
            t.register_memory([region])
    finally:
        t.close()


def test_close_twice_and_use_after_close() -> None:
    t = NixlTransport.create(TransportParams(name=f"closing-{os.getpid()}"))
    buf = np.zeros(8192, dtype=np.uint8)
    t.register_memory([MemoryRegion(addr=buf.ctypes.data, length=8192)])
    layout = BlockLayout(
        regions=[MemoryRegion(addr=buf.ctypes.data, length=8192)], block_lens=[4096], num_blocks=2
    )
    lh = t.prepare_local(layout)
    assert t.prepare_local(layout) is lh  # prepared once
    t.close()
    t.close()
    for call in (
        t.local_metadata,
        t.drain_notifications,
        t.progress,
        lambda: t.prepare_local(layout),
        lambda: t.add_peer(b""),
        lambda: t.send_notification("x", b""),
        lambda: t.post(Op.READ, lh, [0], lh, [0]),
        lambda: t.remove_peer("x"),
        lambda: t.register_memory([]),
    ):
        with pytest.raises(TransportClosedError):
            call()


# -- failures --------------------------------------------------------------------------------


def _post_until_failure(
    local: Local, remote: Any, timeout: float, lh: Any = None
) -> tuple[float, Exception | None]:
    """Post READs of every block back to back until one fails; returns (seconds, the error)."""
    lh = local.local if lh is None else lh
    every = list(range(lh.layout.num_blocks))
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            h = local.t.post(Op.READ, lh, every, remote, every)
        except PeerUnreachableError as exc:
            return time.monotonic() - start, exc
        status = wait(local, h)
        local.t.release(h)
        if status.state is XferState.FAILED:
            return time.monotonic() - start, status.error
    return time.monotonic() - start, None


def test_peer_killed_mid_transfer_then_restarted(local: Local, peer: tuple[Peer, Any]) -> None:
    victim_name = f"V-{local.t.name}"
    # 32 MiB per READ (a few ms each), back to back: the kill almost surely lands mid-copy.
    big = np.zeros(32 * MIB, dtype=np.uint8)
    local.keep.append(big)  # registered until the transport closes: keep the memory alive
    region = MemoryRegion(addr=big.ctypes.data, length=big.nbytes)
    local.t.register_memory([region])
    big_local = local.t.prepare_local(
        BlockLayout(regions=[region], block_lens=[MIB], num_blocks=32)
    )
    victim = Peer(victim_name, seed=7, block_lens=(MIB,), num_blocks=32)
    try:
        local.connect(victim)
        remote = local.t.prepare_remote(victim_name, victim.layout)
        h = local.t.post(Op.READ, big_local, [0], remote, [5])
        assert wait(local, h).state is XferState.DONE
        local.t.release(h)
        np.testing.assert_array_equal(big[:MIB], victim.expected(0)[5 * MIB : 6 * MIB])
        killer = threading.Timer(0.05, victim.kill)
        killer.start()
        took, err = _post_until_failure(local, remote, timeout=5.0, lh=big_local)
        # The failure can be seen while the timer's kill is still closing the pipes: let it end
        # before this thread touches the victim again.
        killer.join(15)
        assert isinstance(err, PeerUnreachableError), err
        assert took < 2.0
        victim.kill()
        # The transport stays usable with the other peer.
        _p, premote = peer
        h = local.t.post(Op.READ, local.local, [0], premote, [0])
        assert wait(local, h).state is XferState.DONE
        local.t.release(h)
        # The old remote layout is dead; a restarted peer under the same name is re-added.
        restarted = Peer(victim_name, seed=8)
        try:
            remote2 = local.connect(restarted)
            with pytest.raises(PeerUnreachableError, match="removed or replaced"):
                local.t.post(Op.READ, local.local, [0], remote, [0])
            h = local.t.post(Op.READ, local.local, [0, 1], remote2, [3, 4], regions=[2])
            assert wait(local, h).state is XferState.DONE
            local.t.release(h)
            np.testing.assert_array_equal(
                local.view(2)[[0, 1]], restarted.expected(2).reshape(NUM_BLOCKS, -1)[[3, 4]]
            )
        finally:
            restarted.stop()
            local.t.remove_peer(victim_name)
    finally:
        victim.kill()


def _notify_both_ways(local: Local, p: Peer, tag: bytes) -> None:
    local.t.send_notification(p.name, b"to-peer-" + tag)
    deadline = time.monotonic() + 5
    got: list[Any] = []
    while not got and time.monotonic() < deadline:
        got = p.call("drain", drive=local.t)
    assert got == [[local.t.name, b"to-peer-" + tag]]
    p.call("notify", drive=local.t, peer=local.t.name, payload=b"to-local-" + tag)
    assert drain_until(local, 1) == [(p.name, b"to-local-" + tag)]


def _read_exact(local: Local, p: Peer, remote: Any, dst: list[int], src: list[int]) -> None:
    h = local.t.post(Op.READ, local.local, dst, remote, src)
    assert (st := wait(local, h)).state is XferState.DONE, st.error
    local.t.release(h)
    for r in range(len(BLOCK_LENS)):
        want = p.expected(r).reshape(NUM_BLOCKS, -1)[src]
        np.testing.assert_array_equal(local.view(r)[dst], want, err_msg=f"region {r}")


def test_add_peer_again_rebuilds_the_connection(
    local: Local, monkeypatch: pytest.MonkeyPatch
) -> None:
    """add_peer of a known name with the same metadata (the peer handshook again, as after a
    failure) tears NIXL's connection down and makes a new one, because NIXL never repairs a
    connection it saw fail. The remote layout handle is prepared again on the new connection
    and keeps working; READs and notifications work both ways, and the peer's own connection
    to us is unaffected. remove_peer then add_peer rebuilds too, and drops the handle."""
    p = Peer(f"R-{local.t.name}", seed=11)
    agent = local.t._agent
    removed: list[str] = []
    real_remove = agent.remove_remote_agent

    def spy(name: str | bytes) -> Any:
        removed.append(name.decode() if isinstance(name, bytes) else name)
        return real_remove(name)

    monkeypatch.setattr(agent, "remove_remote_agent", spy)
    try:
        remote = local.connect(p)
        _read_exact(local, p, remote, [0, 1], [2, 3])
        old_list = remote.native.table.dlist
        rebuilt = local.t.stats()["peers_rebuilt"]
        # Same metadata again: a rebuild, not a no-op.
        assert local.t.add_peer(p.meta) == p.name
        assert removed == [p.name]
        assert local.t.stats()["peers_rebuilt"] == rebuilt + 1
        assert remote.native.table.dlist is not old_list  # a new NIXL list, on the new connection
        assert local.t.prepare_remote(p.name, p.layout) is remote
        _read_exact(local, p, remote, [4, 5], [6, 7])
        _notify_both_ways(local, p, b"after-add")
        # The peer still reads from us over its own connection, and we are told.
        reply = p.call(
            "post",
            drive=local.t,
            kind="read",
            peer=local.t.name,
            local=[8],
            remote=[9],
            notification=b"peer-read",
        )
        assert reply == ["done", None]
        assert drain_until(local, 1) == [(p.name, b"peer-read")]
        # Twice in a row is a rebuild each time.
        assert local.t.add_peer(p.meta) == p.name
        _read_exact(local, p, remote, [10], [11])
        # remove_peer then add_peer: also a rebuild, and the old handle is gone.
        local.t.remove_peer(p.name)
        assert removed == [p.name] * 3
        assert local.t.add_peer(p.meta) == p.name
        assert removed == [p.name] * 3  # nothing left to tear down
        with pytest.raises(PeerUnreachableError, match="removed or replaced"):
            local.t.post(Op.READ, local.local, [0], remote, [0])
        remote2 = local.t.prepare_remote(p.name, p.layout)
        assert remote2 is not remote
        _read_exact(local, p, remote2, [12, 13], [14, 15])
        _notify_both_ways(local, p, b"after-remove-add")
    finally:
        p.stop()
        local.t.remove_peer(p.name)


def test_add_peer_recovers_when_nixl_kept_the_old_agent(
    local: Local, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If NIXL refuses to remove a peer's agent (the removal never raises), it still holds it,
    and refuses new metadata under that name (nixlNotAllowedError); add_peer then removes the
    agent again and loads the restarted peer's metadata."""
    name = f"K-{local.t.name}"
    first = Peer(name, seed=12)
    restarted = None
    agent = local.t._agent
    real_remove = agent.remove_remote_agent
    refuse = [True]

    def flaky(peer: str | bytes) -> Any:
        if refuse and refuse.pop():
            raise RuntimeError("refused once, by the test")
        return real_remove(peer)

    try:
        local.connect(first)
        first.kill()
        restarted = Peer(name, seed=13)
        monkeypatch.setattr(agent, "remove_remote_agent", flaky)
        assert local.t.add_peer(restarted.meta) == name  # its removal of the old one: refused
        assert not refuse
        restarted.call("add_peer", drive=local.t, meta=local.t.local_metadata())
        remote = local.t.prepare_remote(name, restarted.layout)
        _read_exact(local, restarted, remote, [16], [17])
        _notify_both_ways(local, restarted, b"after-refused-removal")
    finally:
        first.kill()
        if restarted is not None:
            restarted.stop()
        local.t.remove_peer(name)


def test_peer_killed_while_idle(local: Local, peer: tuple[Peer, Any]) -> None:
    victim = Peer(f"I-{local.t.name}", seed=9)
    try:
        remote = local.connect(victim)
    finally:
        victim.kill()
    took, err = _post_until_failure(local, remote, timeout=5.0)
    assert isinstance(err, PeerUnreachableError), err
    assert took < 2.0
    with pytest.raises(PeerUnreachableError):
        local.t.send_notification(victim.name, b"are you there")
    local.t.remove_peer(victim.name)
    local.t.remove_peer(victim.name)  # unknown now: ignored
    with pytest.raises(PeerUnreachableError):
        local.t.post(Op.READ, local.local, [0], remote, [0])
    _p, premote = peer
    h = local.t.post(Op.READ, local.local, [0], premote, [0])
    assert wait(local, h).state is XferState.DONE
    local.t.release(h)


# -- descriptor ids ----------------------------------------------------------------------------
# The pairing NIXL uses (lists for small requests, int32 arrays for large ones) is the kit's
# pair_descriptors, tested against a brute-force reference in tests/spi/test_transport_kit.py.


# -- an asynchronous backend -------------------------------------------------------------------


@pytest.mark.parametrize("post_thread", [False, True], ids=["inline", "post_thread"])
def test_over_ucx_tcp_transfers_complete_in_the_background(post_thread: bool) -> None:
    """Under UCX ``tcp`` NIXL's transfer() returns at once (PROC) and the copy completes while
    both sides make progress: this takes the ``poll`` path that asks NIXL for the state, and
    tests ``ucx_env``."""
    options: dict[str, Any] = {
        "ucx_env": {"UCX_TLS": "tcp"},
        "post_thread": post_thread,
        "inline_post_bytes": 0,
    }
    tag = "t" if post_thread else "i"
    local = Local(f"tcp-D-{tag}-{os.getpid()}", options)
    # 16 MiB: far more than UCX tcp moves inside the transfer() call itself.
    big = np.zeros(16 * MIB, dtype=np.uint8)
    region = MemoryRegion(addr=big.ctypes.data, length=big.nbytes)
    local.t.register_memory([region])
    big_local = local.t.prepare_local(
        BlockLayout(regions=[region], block_lens=[MIB], num_blocks=16)
    )
    peer = Peer(
        f"tcp-P-{tag}-{os.getpid()}",
        seed=3,
        block_lens=(MIB,),
        num_blocks=16,
        options={"ucx_env": {"UCX_TLS": "tcp"}},
    )
    try:
        local.connect(peer)
        remote = local.t.prepare_remote(peer.name, peer.layout)
        assert os.environ.get("UCX_TLS") != "tcp"  # ucx_env applies only while creating
        agent = local.t._agent  # record NIXL's answers: the PROC path must be taken
        asked: list[str] = []
        check = agent.check_xfer_state
        agent.check_xfer_state = lambda x: asked.append(check(x)) or asked[-1]
        order = list(range(16))[::-1]
        deadline = time.monotonic() + 20
        for _ in range(3):  # transfer() now and then finishes the copy itself: try again
            big[:] = 0
            h = local.t.post(Op.READ, big_local, order, remote, list(range(16)))
            while not (st := local.t.poll(h)).stopped:
                assert time.monotonic() < deadline
                local.t.progress()
            assert st.state is XferState.DONE, st.error
            local.t.release(h)
            want = peer.expected(0).reshape(16, MIB)[::-1]
            np.testing.assert_array_equal(big.reshape(16, MIB), want)
            if asked:
                break
        # transfer() answered PROC (poll asks NIXL only then), and poll saw it finish.
        assert asked
        assert asked[-1] == "DONE"
        local.t.send_notification(peer.name, b"tcp")
        got: list[Any] = []
        while not got and time.monotonic() < deadline:
            got = peer.call("drain", drive=local.t)
        assert got == [[local.t.name, b"tcp"]]
    finally:
        peer.stop()
        local.t.close()
