"""The transport kit: the contract code every transport shares, tested once here.

Each transport's own suite (and the conformance kit) shows that it *uses* these rules; this
module pins the rules themselves: option wording, the closed guard, payload and op checks,
descriptor pairing against a brute-force reference, the peer table's rebuild and incarnation
rules, and the transfer record's one-way state.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.errors import (
    CapabilityError,
    ConfigError,
    PeerUnreachableError,
    TransferFailedError,
    TransportClosedError,
)
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryKind,
    MemoryRegion,
    Op,
    TransportCapabilities,
    XferHandle,
    XferState,
    XferStatus,
)
from kvframe.spi.transport_kit import (
    SMALL_REQUEST_DESCRIPTORS,
    OpenGuard,
    PeerTable,
    Prepared,
    Transfer,
    TransportOptions,
    block_table,
    check_inside,
    check_notification,
    check_op,
    check_post,
    check_regions,
    contiguous_runs,
    descriptor_ids,
    flag,
    instance,
    integer,
    names,
    pair_descriptors,
    seconds,
    text,
    text_map,
)

CAPS = TransportCapabilities(
    memory_kinds={MemoryKind.HOST},
    read=True,
    write=False,
    notifications=True,
    max_notification_bytes=8,
)


# -- options -----------------------------------------------------------------------------------

OPTIONS = TransportOptions(
    "fast",
    seconds("release_timeout", 5.0),
    integer("num_threads", 0, minimum=0, note="0: the backend decides"),
    flag("progress_thread"),
    text("host", "127.0.0.1"),
    names("backends", ("UCX",), example='["UCX"]'),
    text_map("ucx_env", key_prefix="UCX_"),
    instance("clock", float),
)


def test_options_fill_defaults_and_convert() -> None:
    got = OPTIONS.parse({"release_timeout": 2, "backends": ["A", "B"], "ucx_env": {"UCX_X": "y"}})
    assert got == {
        "release_timeout": 2.0,
        "num_threads": 0,
        "host": "127.0.0.1",
        "backends": ("A", "B"),
        "ucx_env": {"UCX_X": "y"},
    }  # no default: progress_thread and clock are absent, the options class keeps its own
    assert isinstance(got["release_timeout"], float)
    assert OPTIONS.keys[0] == "release_timeout"


def test_a_typo_names_the_closest_key_in_the_house_wording() -> None:
    with pytest.raises(ConfigError) as info:
        OPTIONS.parse({"relase_timeout": 5})
    assert str(info.value) == (
        "fast transport_options.relase_timeout: unknown key (value 5); did you mean "
        "'release_timeout'? known keys: release_timeout, num_threads, progress_thread, host, "
        "backends, ucx_env, clock"
    )
    with pytest.raises(ConfigError, match=r"unknown key \(value 1\); known keys"):
        OPTIONS.parse({"zzzz": 1})  # nothing close: no guess


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("release_timeout", 0, "a finite number of seconds > 0"),
        ("release_timeout", True, "a finite number of seconds > 0"),
        ("release_timeout", float("inf"), "a finite number of seconds > 0"),
        ("release_timeout", "5", "a finite number of seconds > 0"),
        ("num_threads", -1, "an integer >= 0 (0: the backend decides)"),
        ("num_threads", True, "an integer >= 0"),
        ("num_threads", 1.5, "an integer >= 0"),
        ("progress_thread", 1, "true or false"),
        ("host", "", "a non-empty string"),
        ("backends", "UCX", 'a non-empty list of names, e.g. ["UCX"]'),
        ("backends", [], "a non-empty list of names"),
        ("ucx_env", {"TLS": "tcp"}, "a mapping of UCX_* names to strings"),
        ("ucx_env", {"UCX_TLS": 3}, "a mapping of UCX_* names to strings"),
        ("clock", "now", "an float"),
    ],
)
def test_bad_values_name_the_key_the_value_its_type_and_what_is_allowed(
    key: str, value: Any, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        OPTIONS.parse({key: value})
    text_ = str(info.value)
    assert text_.startswith(f"fast transport_options.{key}: got {value!r} ")
    assert f"({type(value).__name__}); expected {expected}" in text_


def test_options_must_be_a_mapping_and_keys_unique() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        OPTIONS.parse(["host"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        TransportOptions("x", flag("a"), flag("a"))
    err = OPTIONS.error("backends", ["NOPE"], "backends this library has", "available: ['UCX']")
    assert str(err) == (
        "fast transport_options.backends: got ['NOPE'] (list); expected backends this "
        "library has; available: ['UCX']"
    )


def test_instance_option_treats_none_as_absent() -> None:
    opts = TransportOptions("x", instance("fabric", dict, None))
    assert opts.parse({"fabric": None}) == {"fabric": None}
    assert opts.parse({}) == {"fabric": None}
    mine: dict[str, int] = {}
    assert opts.parse({"fabric": mine})["fabric"] is mine


# -- guard and checks --------------------------------------------------------------------------


def test_open_guard() -> None:
    guard = OpenGuard("fast transport 'a'")
    guard.check()
    assert not guard.closed
    assert guard.close() is True
    assert guard.close() is False  # the second close() is a no-op
    with pytest.raises(TransportClosedError, match="fast transport 'a' is closed"):
        guard.check()


def test_check_op() -> None:
    assert check_op(Op.READ, CAPS, "fast") is Op.READ
    with pytest.raises(CapabilityError, match="does not support WRITE"):
        check_op(Op.WRITE, CAPS, "fast")
    with pytest.raises(ValueError, match=r"Op\.READ or Op\.WRITE"):
        check_op("read", CAPS, "fast")


def test_check_notification_follows_the_failure_table() -> None:
    assert check_notification(bytearray(b"12345678"), CAPS, "fast") == b"12345678"  # the limit
    with pytest.raises(CapabilityError, match="9 bytes exceeds the limit of 8 bytes of fast"):
        check_notification(b"123456789", CAPS, "fast")
    with pytest.raises(ValueError, match="payload is bytes, got str"):
        check_notification("text", CAPS, "fast")
    off = attrs.evolve(CAPS, notifications=False, max_notification_bytes=0)
    with pytest.raises(CapabilityError, match="does not support notifications"):
        check_notification(b"", off, "fast")


# -- layouts and descriptors -------------------------------------------------------------------


def _layout(lens: list[int], nb: int, base: int = 1 << 20) -> BlockLayout:
    regions, addr = [], base
    for blen in lens:
        regions.append(MemoryRegion(addr=addr, length=blen * nb))
        addr += blen * nb
    return BlockLayout(regions=regions, block_lens=lens, num_blocks=nb)


def test_block_table_is_region_major() -> None:
    layout = _layout([16, 4], 3, base=1000)
    addrs, lens = block_table(layout)
    assert addrs.tolist() == [1000, 1016, 1032, 1048, 1052, 1056]
    assert lens.tolist() == [16, 16, 16, 4, 4, 4]


def test_check_inside() -> None:
    layout = _layout([16], 4, base=1000)
    check_inside(layout, [MemoryRegion(addr=900, length=200)], "me")
    with pytest.raises(ValueError, match=r"region 0 .* not inside memory registered by peer 'P'"):
        check_inside(layout, [MemoryRegion(addr=1000, length=63)], "peer 'P'")
    device = [MemoryRegion(addr=900, length=200, kind=MemoryKind.DEVICE)]
    with pytest.raises(ValueError, match="not inside"):
        check_inside(layout, device, "me")  # same addresses, other memory kind


@given(
    nb=st.integers(1, 20),
    lens=st.lists(st.integers(1, 64), min_size=1, max_size=4),
    data=st.data(),
)
def test_pairs_match_a_brute_force_reference(nb: int, lens: list[int], data: st.DataObject) -> None:
    local, remote = _layout(lens, nb), _layout(lens, nb + 3, base=1 << 30)
    n = data.draw(st.integers(0, 40))  # crosses the scalar/vectorised threshold
    lblk = data.draw(st.lists(st.integers(0, nb - 1), min_size=n, max_size=n))
    rblk = data.draw(st.lists(st.integers(0, nb - 1), min_size=n, max_size=n))
    sel = data.draw(st.none() | st.lists(st.integers(0, len(lens) - 1), min_size=1, unique=True))
    pairs = pair_descriptors(local, remote, lblk, rblk, sel)
    chosen = list(range(len(lens))) if sel is None else sel
    assert list(pairs.local) == [r * nb + b for r in chosen for b in lblk]
    assert list(pairs.remote) == [r * (nb + 3) + b for r in chosen for b in rblk]
    assert pairs.nbytes == n * sum(lens[r] for r in chosen)
    assert pairs.count == n * len(chosen)
    assert pairs.regions == tuple(chosen)
    small = pairs.count <= SMALL_REQUEST_DESCRIPTORS
    assert isinstance(pairs.local, list) is small
    as_arrays = pair_descriptors(local, remote, np.array(lblk, dtype=np.int64), np.array(rblk), sel)
    np.testing.assert_array_equal(as_arrays.local, pairs.local)
    np.testing.assert_array_equal(descriptor_ids(local, lblk, sel), pairs.local)


@given(
    nb=st.integers(1, 12),
    lens=st.lists(st.integers(1, 64), min_size=1, max_size=3),
    adjacent=st.booleans(),
    data=st.data(),
)
def test_runs_match_a_brute_force_merge(
    nb: int, lens: list[int], adjacent: bool, data: st.DataObject
) -> None:
    # adjacent: the regions touch (region r + 1 starts where region r ends), so a run could
    # only cross them by ignoring the region boundary, which it must not.
    gap = 0 if adjacent else 4096
    local = BlockLayout(
        regions=[
            MemoryRegion(addr=(sum(lens[:i]) * nb) + gap * i, length=ln * nb)
            for i, ln in enumerate(lens)
        ],
        block_lens=lens,
        num_blocks=nb,
    )
    remote = _layout(lens, nb + 2, base=1 << 30)
    n = data.draw(st.integers(0, 30))
    lblk = data.draw(st.lists(st.integers(0, nb - 1), min_size=n, max_size=n))
    rblk = data.draw(st.lists(st.integers(0, nb + 1), min_size=n, max_size=n))
    sel = data.draw(st.none() | st.lists(st.integers(0, len(lens) - 1), min_size=1, unique=True))
    pairs = pair_descriptors(local, remote, lblk, rblk, sel)
    runs = contiguous_runs(local, remote, pairs)
    # The reference: walk the pairs, extend the last run while both sides continue it.
    want: list[list[int]] = []  # [local address, remote address, length, local region]
    for r in pairs.regions:
        for lb, rb in zip(lblk, rblk, strict=True):
            la = local.regions[r].addr + lb * lens[r]
            ra = remote.regions[r].addr + rb * lens[r]
            last = want[-1] if want else None
            if last and last[3] == r and last[0] + last[2] == la and last[1] + last[2] == ra:
                last[2] += lens[r]
            else:
                want.append([la, ra, lens[r], r])
    got = list(zip(runs.local, runs.remote, runs.lengths, runs.local_regions, strict=True))
    assert [list(map(int, g)) for g in got] == want
    assert runs.count == len(want)
    np.testing.assert_array_equal(runs.local_regions, runs.remote_regions)
    assert int(runs.lengths.sum()) == pairs.nbytes


def test_runs_merge_adjacent_blocks_per_region() -> None:
    layout = _layout([8, 16], 10)
    pairs = pair_descriptors(layout, layout, [4, 5, 6, 9], [0, 1, 2, 3], None)
    runs = contiguous_runs(layout, layout, pairs)
    assert runs.count == 4  # blocks 4..6 and 9, in each of the two regions
    assert runs.lengths.tolist() == [24, 8, 48, 16]


def test_large_requests_are_numpy_arrays_of_the_asked_dtype() -> None:
    layout = _layout([8, 8], 64)
    pairs = pair_descriptors(layout, layout, range(64), range(64), None, dtype=np.int32)
    assert isinstance(pairs.local, np.ndarray)
    assert pairs.local.dtype == np.int32
    assert pairs.count == 128


@pytest.mark.parametrize(
    ("local_blocks", "remote_blocks", "regions", "message"),
    [
        ([0, 1], [0], None, "local_blocks has 2 entries but remote_blocks has 1; they pair"),
        ([4], [0], [0], "local block index out of range: the layout has 4 blocks, got min 4"),
        ([0], [-1], [0], "remote block index out of range"),
        ([0], [0], [2], r"region index out of range: .* 2 \(local\) and 3 \(remote\) .* \[2\]"),
        ([0], [0], [-1], "region index out of range"),
        (np.array([0.5]), [0], [0], "local_blocks must hold integers"),
        (["0"], [0], [0], "local_blocks must be a sequence of integers"),
    ],
)
def test_bad_requests_say_what_is_wrong(
    local_blocks: Any, remote_blocks: Any, regions: Any, message: str
) -> None:
    local, remote = _layout([8, 8], 4), _layout([8, 8, 8], 4)
    with pytest.raises(ValueError, match=message):
        pair_descriptors(local, remote, local_blocks, remote_blocks, regions)


def test_region_counts_and_block_lengths_must_agree() -> None:
    local, remote = _layout([8, 8], 4), _layout([8, 16, 8], 4)
    with pytest.raises(ValueError, match="2 regions and the remote one 3; pass regions="):
        pair_descriptors(local, remote, [0], [0], None)
    with pytest.raises(ValueError, match=r"region 1: block lengths differ \(local 8 bytes"):
        pair_descriptors(local, remote, [0], [0], [0, 1])
    assert pair_descriptors(local, remote, [0], [0], [0]).count == 1


# -- peers -------------------------------------------------------------------------------------


class Conn:
    def __init__(self, label: str, log: list[str]) -> None:
        self.label = label
        log.append(f"connect {label}")


def _table() -> tuple[PeerTable[Conn], list[str]]:
    log: list[str] = []
    return PeerTable(
        "fast transport 'a'", lambda c, why: log.append(f"teardown {c.label}: {why}")
    ), log


def test_a_known_name_added_again_is_a_rebuild_torn_down_first() -> None:
    table, log = _table()
    first = table.add("P", "inc-1", lambda: Conn("P1", log))
    assert not first.rebuilt
    again = table.add("P", "inc-1", lambda: Conn("P2", log))
    assert again.rebuilt
    assert again.layouts_kept
    assert not again.restarted
    assert again.replaced == first.entry
    assert log == ["connect P1", "teardown P1: peer 'P' was added again (rebuilt)", "connect P2"]
    assert table.get("P").conn.label == "P2"
    assert table.rebuilds == 1
    restarted = table.add("P", "inc-2", lambda: Conn("P3", log))
    assert restarted.restarted
    assert not restarted.layouts_kept
    assert "restarted" in log[-2]


def test_prepared_layouts_follow_the_incarnation() -> None:
    table, log = _table()
    owner = object()
    table.add("P", "inc-1", lambda: Conn("P1", log))
    layout = _layout([8], 4)
    handle = LayoutHandle(layout=layout, peer="P", native=table.prepared(owner, "P", "T"))
    assert table.check_prepared(handle, owner)[1] == "T"
    table.add("P", "inc-1", lambda: Conn("P2", log))  # a rebuild of the same incarnation
    assert table.check_prepared(handle, owner)[0].conn.label == "P2"
    table.add("P", "inc-2", lambda: Conn("P3", log))  # the peer restarted
    with pytest.raises(PeerUnreachableError, match="call prepare_remote again"):
        table.check_prepared(handle, owner)
    fresh = LayoutHandle(layout=layout, peer="P", native=table.prepared(owner, "P", "T"))
    table.remove("P")
    table.add("P", "inc-2", lambda: Conn("P4", log))  # same incarnation, but after a removal
    with pytest.raises(PeerUnreachableError, match="removed or replaced"):
        table.check_prepared(fresh, owner)
    with pytest.raises(ValueError, match="not prepared by fast transport 'a'"):
        table.check_prepared(fresh, object())
    local = LayoutHandle(layout=layout, peer=None, native=Prepared.local(owner, "L"))
    with pytest.raises(ValueError, match="came from prepare_local"):
        table.check_prepared(local, owner)
    assert Prepared.check_local(local, owner, "me") == "L"
    with pytest.raises(ValueError, match="came from prepare_remote"):
        Prepared.check_local(fresh, owner, "me")
    with pytest.raises(ValueError, match="unknown layout handle"):
        Prepared.check_local(local, object(), "me")


def test_a_failed_connect_leaves_no_entry_and_unknown_names() -> None:
    table, log = _table()
    table.add("P", 1, lambda: Conn("P1", log))

    def refuse() -> Conn:
        raise PeerUnreachableError("cannot reach P")

    with pytest.raises(PeerUnreachableError, match="cannot reach"):
        table.add("P", 1, refuse)
    assert "P" not in table
    assert log[-1].startswith("teardown P1")
    with pytest.raises(PeerUnreachableError, match="unknown peer 'P'; add it with add_peer"):
        table.get("P")
    assert table.remove("P") is None  # unknown: ignored
    assert table.find("P") is None


def test_discard_removes_only_the_current_entry() -> None:
    table, log = _table()
    old = table.add("P", 1, lambda: Conn("P1", log)).entry.conn
    table.add("P", 2, lambda: Conn("P2", log))
    table.discard(old, "broken")  # already replaced: torn down again, the new entry stays
    assert table.get("P").conn.label == "P2"
    table.discard(table.get("P").conn, "broken")
    assert len(table) == 0
    assert log[-1] == "teardown P2: broken"


# -- transfers and statuses --------------------------------------------------------------------


def _post() -> tuple[XferHandle, Transfer[str], object]:
    owner = object()
    layout = _layout([8, 8], 4)
    pairs = pair_descriptors(layout, layout, [0, 1], [2, 3], None)
    handle, tr = Transfer.post(owner, "record", op=Op.READ, peer="P", pairs=pairs)
    return handle, tr, owner


def test_a_transfer_stops_once_and_its_handle_is_frozen() -> None:
    handle, tr, owner = _post()
    assert (handle.op, handle.peer, handle.nbytes, handle.num_descriptors) == (Op.READ, "P", 32, 4)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        handle.nbytes = 0  # type: ignore[misc]
    assert Transfer.of(handle, owner, str) is tr
    assert tr.status is XferStatus.pending()
    assert tr.done(transfer_seconds=0.5)
    assert not tr.fail(TransferFailedError("late"))  # already stopped: nothing changes
    assert tr.status == XferStatus.done(32, 0.5)
    assert tr.polled() == tr.status
    assert tr.release()
    assert not tr.release()
    with pytest.raises(TransportClosedError, match="released"):
        tr.polled()


def test_foreign_handles_are_refused() -> None:
    handle, _, owner = _post()
    with pytest.raises(ValueError, match="not posted by this transport"):
        Transfer.of(handle, object(), str)
    with pytest.raises(ValueError, match="not posted by this transport"):
        Transfer.of(handle, owner, int)
    with pytest.raises(ValueError, match="not posted by this transport"):
        Transfer.of("handle", owner, str)  # type: ignore[arg-type]


def test_a_status_cannot_contradict_itself() -> None:
    err = TransferFailedError("x")
    assert XferStatus.failed(err).error is err
    assert XferStatus.failed(err).stopped
    assert not XferStatus.pending().stopped
    with pytest.raises(ValueError, match="needs the TransportError"):
        XferStatus(state=XferState.FAILED)
    with pytest.raises(ValueError, match="carries no error"):
        XferStatus(state=XferState.DONE, error=err)
    with pytest.raises(ValueError, match="only a DONE transfer counts its bytes"):
        XferStatus(state=XferState.FAILED, error=err, nbytes=8)
    with pytest.raises(ValueError, match="only known once DONE"):
        XferStatus(state=XferState.PENDING, transfer_seconds=1.0)
    with pytest.raises(ValueError, match="duration >= 0"):
        XferStatus.done(8, -1.0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        XferStatus.done(8).nbytes = 9  # type: ignore[misc]


def test_check_post_runs_every_check_in_the_spis_order() -> None:
    class Fake:
        capabilities = CAPS

    owner = Fake()
    table, log = _table()
    table.add("P", 1, lambda: Conn("P1", log))
    layout = _layout([8, 8], 4)
    local = LayoutHandle(layout=layout, peer=None, native=Prepared.local(owner, "L"))
    remote = LayoutHandle(layout=layout, peer="P", native=table.prepared(owner, "P", "R"))
    req = check_post(
        owner, table, Op.READ, local, [0], remote, [1], regions=[1], notification=bytearray(b"n")
    )
    assert (req.op, req.local, req.remote, req.peer.name) == (Op.READ, "L", "R", "P")
    assert list(req.pairs.local) == [4]
    assert req.notification == b"n"
    with pytest.raises(CapabilityError, match="WRITE"):
        check_post(owner, table, Op.WRITE, local, [0], remote, [1], regions=None, notification=None)
    with pytest.raises(ValueError, match="came from prepare_remote"):
        check_post(owner, table, Op.READ, remote, [0], remote, [1], regions=None, notification=None)
    with pytest.raises(CapabilityError, match="exceeds the limit"):
        check_post(
            owner, table, Op.READ, local, [0], remote, [1], regions=None, notification=b"x" * 9
        )
    table.remove("P")
    with pytest.raises(PeerUnreachableError, match="removed or replaced"):
        check_post(owner, table, Op.READ, local, [0], remote, [1], regions=None, notification=None)


def test_check_regions() -> None:
    host = MemoryRegion(addr=4096, length=64)
    assert check_regions(iter([host]), CAPS, "fast") == [host]
    device = MemoryRegion(addr=4096, length=64, kind=MemoryKind.DEVICE)
    with pytest.raises(CapabilityError, match=r"cannot register device memory .*; needs CUDA"):
        check_regions([host, device], CAPS, "fast", "needs CUDA")
    with pytest.raises(ValueError, match="takes MemoryRegion values"):
        check_regions([(4096, 64)], CAPS, "fast")


def test_polling_a_released_transfer_raises() -> None:
    handle, tr, owner = _post()
    assert Transfer.polling(handle, owner, str) is tr
    tr.release()
    with pytest.raises(TransportClosedError):
        Transfer.polling(handle, owner, str)
