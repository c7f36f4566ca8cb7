"""The disk tier's file format (payload, then a checksummed trailer): every kind of damage is
detected, named and removed (a short file once it is old: a write may be under way); files
of the older format are refused by name; the CPU tier's slots are page-aligned; the checksum
releases the GIL."""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import xxhash

from kvframe.connectors.offload.tiers import (
    DISK_TRAILER_BYTES,
    IN_PROGRESS_GRACE_S,
    CPUTier,
    DiskTier,
)
from kvframe.errors import ConfigError
from kvframe.spi.offload import CorruptEntryError, TierConfig

BLOCK = 4096
KEY = bytes(range(32))


def _tier(
    root: Path, block: int = BLOCK, *, cls: type[DiskTier] = DiskTier, **options: object
) -> DiskTier:
    tier = cls(
        TierConfig(
            name="disk",
            index=1,
            capacity_bytes=1 << 20,
            block_bytes=block,
            options={"path": str(root), **options},
        )
    )
    tier.open()
    return tier


def _data(block: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 255, block, dtype=np.uint8)


def test_payload_first_then_a_64_byte_trailer(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    data = _data()
    tier.write(KEY, 3, data)
    raw = tier.file_of(KEY).read_bytes()
    assert DISK_TRAILER_BYTES == 64
    assert len(raw) == BLOCK + 64
    assert raw[:BLOCK] == data.tobytes()  # at offset 0: page-aligned in the page cache
    magic, version, _, key, length, checksum, _ = struct.unpack("<4sHH32sQQ8s", raw[BLOCK:])
    assert (magic, version, key, length) == (b"KVOB", 2, KEY, BLOCK)
    assert checksum == xxhash.xxh3_64_intdigest(data.tobytes())
    out = np.zeros(BLOCK, dtype=np.uint8)
    tier.read(KEY, 0, out)
    assert np.array_equal(out, data)
    assert not list(tmp_path.rglob("*.tmp"))


def _flip(offset: int) -> Callable[[bytearray], bytes]:
    def damage(raw: bytearray) -> bytes:
        raw[offset] ^= 0x01
        return bytes(raw)

    return damage


def _set_field(fmt: str, at: int, value: int) -> Callable[[bytearray], bytes]:
    def damage(raw: bytearray) -> bytes:
        struct.pack_into(fmt, raw, BLOCK + at, value)
        return bytes(raw)

    return damage


DAMAGE: dict[str, tuple[Callable[[bytearray], bytes], str]] = {
    "payload byte": (_flip(100), "checksum mismatch"),
    "last payload byte": (_flip(BLOCK - 1), "checksum mismatch"),
    "magic": (_flip(BLOCK), "bad magic"),
    "version": (_set_field("<H", 4, 3), "unknown format version 3"),
    "reserved": (_flip(BLOCK + 6), "reserved trailer bytes"),
    "key": (_flip(BLOCK + 20), "another key"),
    "length": (_set_field("<Q", 40, BLOCK + 1), "payload length"),
    "checksum": (_flip(BLOCK + 48), "checksum mismatch"),
    "last byte": (_flip(BLOCK + 63), "reserved trailer bytes"),
    "truncated in the payload": (lambda raw: bytes(raw[: BLOCK // 2]), "truncated"),
    "truncated in the trailer": (lambda raw: bytes(raw[:-1]), "truncated"),
    "empty": (lambda raw: b"", "0 bytes on disk"),
    "one byte too long": (lambda raw: bytes(raw) + b"\0", "more than"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_every_damage_is_detected_named_and_removed(tmp_path: Path, kind: str) -> None:
    tier = _tier(tmp_path)
    tier.write(KEY, 0, _data())
    path = tier.file_of(KEY)
    damage, message = DAMAGE[kind]
    path.write_bytes(damage(bytearray(path.read_bytes())))
    _age(path)  # a short file is removed only once it is old (see the next test)
    with pytest.raises(CorruptEntryError, match=message):
        tier.read(KEY, 0, np.zeros(BLOCK, dtype=np.uint8))
    assert not path.exists()
    with pytest.raises(CorruptEntryError, match="gone"):
        tier.read(KEY, 0, np.zeros(BLOCK, dtype=np.uint8))


def _age(path: Path, seconds: float = IN_PROGRESS_GRACE_S + 1) -> None:
    """Make ``path`` look last changed ``seconds`` ago."""
    then = time.time() - seconds
    os.utime(path, (then, then))


@pytest.mark.parametrize("cut", [0, BLOCK // 2, BLOCK, BLOCK + DISK_TRAILER_BYTES - 1])
def test_a_file_without_its_trailer_yet_is_a_miss_left_in_place_until_old(
    tmp_path: Path, cut: int
) -> None:
    # What a reader in another engine sees while this one writes (payload first, trailer last).
    tier = _tier(tmp_path)
    tier.write(KEY, 0, _data())
    path = tier.file_of(KEY)
    path.write_bytes(path.read_bytes()[:cut])
    out = np.zeros(BLOCK, dtype=np.uint8)
    with pytest.raises(CorruptEntryError, match=r"left in place .*perhaps still being written"):
        tier.read(KEY, 0, out)
    assert path.stat().st_size == cut  # untouched
    _age(path, IN_PROGRESS_GRACE_S - 5)
    with pytest.raises(CorruptEntryError, match="left in place"):
        tier.read(KEY, 0, out)
    _age(path)  # a crash's leftover: removed
    with pytest.raises(CorruptEntryError, match="removed"):
        tier.read(KEY, 0, out)
    assert not path.exists()
    tier.write(KEY, 0, _data())  # and the key can be written again
    tier.read(KEY, 0, out)
    assert np.array_equal(out, _data())


def test_a_rewrite_in_place_replaces_the_block_and_a_mixed_file_is_refused(
    tmp_path: Path,
) -> None:
    tier = _tier(tmp_path)
    first, second = _data(), _data()[::-1].copy()
    tier.write(KEY, 0, first)
    path = tier.file_of(KEY)
    old = path.read_bytes()
    tier.write(KEY, 0, second)
    out = np.zeros(BLOCK, dtype=np.uint8)
    tier.read(KEY, 0, out)
    assert np.array_equal(out, second)
    # Two engines writing the key at once: the payload of one, the trailer of the other.
    path.write_bytes(second.tobytes() + old[BLOCK:])
    with pytest.raises(CorruptEntryError, match="checksum mismatch"):
        tier.read(KEY, 0, out)
    assert not path.exists()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_written_files_stay_open_up_to_open_files_and_reads_use_them(tmp_path: Path) -> None:
    before = _open_fds()
    tier = _tier(tmp_path, open_files=2)
    blocks = {_key(i): _data()[::-1].copy() if i % 2 else _data() for i in range(5)}
    for i, (key, data) in enumerate(blocks.items()):
        tier.write(key, i, data)
    assert list(tier._fds) == [_key(3), _key(4)]  # the last two written, oldest first
    assert _open_fds() == before + 2
    for i, (key, data) in enumerate(blocks.items()):  # kept or not, every block reads back
        out = np.zeros(BLOCK, dtype=np.uint8)
        tier.read(key, i, out)
        assert np.array_equal(out, data)
    assert _open_fds() == before + 2  # a read's dup is closed again
    tier.remove(_key(4), 4)
    assert list(tier._fds) == [_key(3)]
    assert _open_fds() == before + 1
    tier.close()
    assert _open_fds() == before


def test_a_kept_file_damaged_in_place_is_still_refused_and_closed(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.write(KEY, 0, _data())
    assert KEY in tier._fds
    path = tier.file_of(KEY)
    raw = bytearray(path.read_bytes())
    raw[7] ^= 1
    path.write_bytes(bytes(raw))  # the same inode: the kept descriptor sees the damage
    with pytest.raises(CorruptEntryError, match="checksum mismatch"):
        tier.read(KEY, 0, np.zeros(BLOCK, dtype=np.uint8))
    assert KEY not in tier._fds
    assert not path.exists()


def test_a_kept_file_unlinked_by_another_engine_still_reads_its_block(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    tier.write(KEY, 0, _data())
    tier.file_of(KEY).unlink()  # another engine sharing the directory removed it
    out = np.zeros(BLOCK, dtype=np.uint8)
    tier.read(KEY, 0, out)  # the kept descriptor: the block that file held, checked
    assert np.array_equal(out, _data())
    tier.remove(KEY, 0)
    with pytest.raises(CorruptEntryError, match="gone"):
        tier.read(KEY, 0, out)


def test_open_files_zero_keeps_none_and_bad_values_are_refused(tmp_path: Path) -> None:
    before = _open_fds()
    tier = _tier(tmp_path, open_files=0)
    tier.write(KEY, 0, _data())
    assert not tier._fds
    assert _open_fds() == before
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ConfigError, match=r"open_files: got .*expected an int >= 0"):
            _tier(tmp_path, open_files=bad)


def _version_1_file(data: np.ndarray) -> bytes:
    """A block file as kvframe releases before format version 2 wrote it."""
    header = struct.pack("<4sHH32sQI12x", b"KVOB", 1, 0, KEY, data.size, zlib.crc32(data))
    return header + data.tobytes()


@pytest.mark.parametrize("block", [BLOCK, 2 * BLOCK])
def test_a_version_1_file_is_refused_by_name_and_removed(tmp_path: Path, block: int) -> None:
    # Same block size (the same file size as a version-2 file) or another one.
    tier = _tier(tmp_path)
    tier.write(KEY, 0, _data())
    path = tier.file_of(KEY)
    path.write_bytes(_version_1_file(_data(block)))
    assert list(tier.scan()) == [KEY]  # listed at start-up like any entry ...
    out = np.zeros(BLOCK, dtype=np.uint8)
    with pytest.raises(CorruptEntryError, match=r"format version 1 \(a CRC-32 header"):
        tier.read(KEY, 0, out)  # ... and never read as data
    assert not path.exists()


def test_cpu_tier_slots_are_page_aligned() -> None:
    tier = CPUTier(
        TierConfig(name="cpu", index=0, capacity_bytes=8 * BLOCK, block_bytes=BLOCK, options={})
    )
    tier.open()
    try:
        for slot in range(tier.capacity_blocks):
            assert tier.slot_array(slot).ctypes.data % mmap.PAGESIZE == 0
        whole = tier.contiguous_array()
        assert whole is not None
        assert whole.shape == (8, BLOCK)
        assert whole.flags.c_contiguous
    finally:
        tier.close()


def _stall_beside_a_hash(view: memoryview) -> tuple[float, float]:
    """(longest stall of a Python loop, duration of the hash) with one thread hashing
    ``view`` in one call."""
    done = threading.Event()
    took: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        xxhash.xxh3_64_intdigest(view)
        took.append(time.perf_counter() - t0)
        done.set()

    thread = threading.Thread(target=work)
    last = time.perf_counter()
    stall = 0.0
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        stall, last = max(stall, now - last), now
    thread.join()
    return stall, took[0]


def test_the_checksum_releases_the_gil() -> None:
    # A Python loop beside a thread checksumming 64 MiB in one call: held, the GIL would stall
    # the loop for the whole call. Several tries: a busy machine can stall a thread anyway.
    view = memoryview(np.ones(64 << 20, dtype=np.uint8).data).cast("B")
    tries = [_stall_beside_a_hash(view) for _ in range(5)]
    assert any(stall < took / 2 for stall, took in tries), tries


@pytest.mark.parametrize("shape", ["strided", "2d", "float32"])
def test_any_array_layout_is_written_as_its_bytes_and_read_back(tmp_path: Path, shape: str) -> None:
    """``write`` takes the slot's memory as it is when it is contiguous bytes, and copies or
    reinterprets anything else: the file holds the array's bytes in C order either way."""
    base = _data(2 * BLOCK)
    data = {
        "strided": base[::2],  # not contiguous: copied first
        "2d": base[:BLOCK].reshape(64, BLOCK // 64),
        "float32": base[:BLOCK].view(np.float32),
    }[shape]
    tier = _tier(tmp_path)
    tier.write(KEY, 0, data)
    assert tier.file_of(KEY).read_bytes()[:BLOCK] == np.ascontiguousarray(data).tobytes()
    for open_files in (True, False):
        if not open_files:
            tier.close()  # the kept descriptor gone: the read opens the file by name
        out = np.zeros(BLOCK, dtype=np.uint8)
        tier.read(KEY, 0, out)
        assert out.tobytes() == np.ascontiguousarray(data).tobytes()


def _spares(root: Path) -> list[Path]:
    return sorted(root.glob("spare/*.kvs"))


def test_a_removed_blocks_file_is_renamed_aside_and_overwritten_by_the_next_write(
    tmp_path: Path,
) -> None:
    tier = _tier(tmp_path)
    a, b = _key(1), _key(2)
    tier.write(a, 0, _data())
    inode = tier.file_of(a).stat().st_ino
    tier.remove(a, 0)
    assert not tier.file_of(a).exists()
    assert [p.stat().st_ino for p in _spares(tmp_path)] == [inode]
    assert list(tier.scan()) == []  # a spare file is never taken for a block
    second = _data()[::-1].copy()
    tier.write(b, 0, second)  # overwrites the spare: no new file
    assert tier.file_of(b).stat().st_ino == inode
    assert not _spares(tmp_path)
    out = np.zeros(BLOCK, dtype=np.uint8)
    tier.read(b, 0, out)
    assert np.array_equal(out, second)
    with pytest.raises(CorruptEntryError, match="gone"):
        tier.read(a, 0, out)
    tier.write(a, 1, _data())  # no spare left: a new file
    tier.read(a, 1, out)
    assert np.array_equal(out, _data())


class _Crash(BaseException):
    """The process dies mid-write (nothing of the write's own clean-up runs)."""


class _CrashingTier(DiskTier):
    """Dies in the system call that writes at ``at`` (0: the payload, BLOCK: the trailer),
    after writing its first ``cut`` bytes."""

    at = 0
    cut = 0

    def _pwrite(self, fd: int, data: object, offset: int) -> int:
        if offset == self.at:
            if self.cut:
                os.pwrite(fd, bytes(memoryview(data))[: self.cut], offset)  # type: ignore[arg-type]
            raise _Crash
        return super()._pwrite(fd, data, offset)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("at", "cut"),
    [(0, 0), (0, BLOCK // 2), (0, BLOCK - 1), (BLOCK, 0), (BLOCK, 24), (BLOCK, 40)],
    ids=[
        "renamed only",
        "half the payload",
        "all but a byte",
        "payload, no trailer",
        "trailer torn in the key",
        "trailer torn after the key",
    ],
)
def test_a_torn_overwrite_of_a_spare_file_is_a_miss_never_the_block_it_held(
    tmp_path: Path, at: int, cut: int
) -> None:
    # The trailer binds the key: the spare file renamed to b's name still ends with a's
    # trailer (and a's payload, whole or in part) until b's trailer lands. A reader that
    # checked the checksum alone would take a's bytes for b's in the first case.
    old, new = _data(), _data()[::-1].copy()
    a, b = _key(1), _key(2)
    tier = cast(_CrashingTier, _tier(tmp_path, cls=_CrashingTier))
    tier.at, tier.cut = -1, 0
    tier.write(a, 0, old)
    tier.remove(a, 0)
    tier.at, tier.cut = at, cut
    with pytest.raises(_Crash):
        tier.write(b, 0, new)
    path = tier.file_of(b)
    assert path.stat().st_size == BLOCK + DISK_TRAILER_BYTES
    after = _tier(tmp_path, open_files=0)  # a restart: reads open the file by name
    out = np.zeros(BLOCK, dtype=np.uint8)
    problem = "checksum mismatch" if (at, cut) == (BLOCK, 40) else "another key"
    with pytest.raises(CorruptEntryError, match=f"{problem}; removed"):
        after.read(b, 0, out)
    assert not path.exists()
    with pytest.raises(CorruptEntryError, match="gone"):
        after.read(a, 0, out)


def test_spare_files_zero_unlinks_and_bad_values_are_refused(tmp_path: Path) -> None:
    tier = _tier(tmp_path, spare_files=0)
    tier.write(KEY, 0, _data())
    tier.remove(KEY, 0)
    assert not tier.file_of(KEY).exists()
    assert not _spares(tmp_path)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ConfigError, match=r"spare_files: got .*expected an int >= 0"):
            _tier(tmp_path, spare_files=bad)


def test_spares_are_capped_damaged_files_not_kept_and_close_unlinks_them(
    tmp_path: Path,
) -> None:
    tier = _tier(tmp_path, spare_files=2)
    for i in range(4):
        tier.write(_key(i), i, _data())
    short = tier.file_of(_key(3))
    short.write_bytes(short.read_bytes()[:-1])
    tier.remove(_key(3), 3)  # not a whole block file: unlinked, never reused
    assert not short.exists()
    assert not _spares(tmp_path)
    for i in range(3):
        tier.remove(_key(i), i)
    assert len(_spares(tmp_path)) == 2  # the third is unlinked
    assert not list(tmp_path.rglob("*.kvb"))
    tier.close()
    assert not _spares(tmp_path)


def test_scan_removes_old_spare_files_and_a_write_then_makes_a_new_file(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for i in range(2):
        tier.write(_key(i), i, _data())
    for i in range(2):
        tier.remove(_key(i), i)
    old, young = _spares(tmp_path)
    _age(old)
    other = _tier(tmp_path)  # another engine (or a restart) sharing the directory
    assert list(other.scan()) == []
    assert _spares(tmp_path) == [young]
    # The first engine's writes take its spares, newest first, and get over a vanished one.
    out = np.zeros(BLOCK, dtype=np.uint8)
    for i in (5, 6):
        tier.write(_key(i), i, _data())
        tier.read(_key(i), i, out)
        assert np.array_equal(out, _data())
    assert not _spares(tmp_path)
