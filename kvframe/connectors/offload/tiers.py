"""The built-in offload tiers: ``"cpu"`` (host memory) and ``"disk"`` (one file per block).

**cpu** (:class:`CPUTier`, a :class:`~kvframe.spi.offload.MemoryTier`): one uint8 array of
``capacity_blocks × block_bytes``, allocated in :meth:`~CPUTier.open` (page-locked when CUDA is
available, so copies to and from the GPU run at full speed and can be asynchronous), starting
on a page boundary, so that with a block size that is a multiple of the page size every slot
is page-aligned (the disk tier's reads and writes run fastest so, see below). Options: none.

**disk** (:class:`DiskTier`): one file per block under ``path``, named by the key's hex
(``ab/abcdef….kvb``). A file is the payload at offset 0 followed by a 64-byte trailer (magic,
format version, key, payload length, XXH3-64 of the payload, zero reserved bytes); a read
checks every one of them and removes a file that fails (truncated, too long, corrupted,
foreign, or in another format version: version-1 files of older releases, a CRC-32 header in
front of the payload, are refused by name and removed, never misread). A block is written in
place under its final name, the payload first and the trailer last: no temporary name and no
rename (the rename cost about a tenth of a block's write here). The tier keeps the files it
wrote last open (up to ``open_files``), so that a read soon after the write (a promotion after
a write-through) skips the path lookup and the open, about 7 µs of a 256 KiB block's 44 µs
here: the read works on a ``dup`` of the kept descriptor, and a removal closes it. A kept
descriptor outlives an unlink by another engine sharing the directory; the read then returns
the block that file held, checked like any other, and the file's disk space stays taken until
the descriptor closes (at most ``open_files`` blocks). A reader that comes before the
trailer has landed finds the file too short: that is a miss, and the file is left alone while
it is younger than :data:`IN_PROGRESS_GRACE_S` (another engine sharing the directory may be
writing it), removed when older (a crash's leftover). Two engines writing the same key at once
can leave a payload of one with the trailer of the other: the checksum refuses that file, so a
read never returns bytes the trailer does not vouch for.

**Spare files.** A removal (an eviction, mostly) does not unlink the block's file: it renames
it to ``path/spare/<pid>-<random>-<n>.kvs`` (when it is a whole block file, up to
``spare_files`` of them), and the next write renames a spare to its own block's name and
overwrites it (opened without ``O_TRUNC``, the trailer's page asked for with
``POSIX_FADV_WILLNEED`` first: the trailer's ``pwrite`` covers only part of that page, which the
kernel must read when it is not cached). No file is created, no blocks are freed and
allocated again: at capacity, evicting a block and writing another ran 1.9 – 3.0× as fast as
unlinking the old file and creating a new one, and 2.2 – 3.3× as fast as this tier did before
(``docs/offloading.md``). Until the new trailer
lands, the file still ends with the trailer of the block it held: its key is not the new
block's, so a read of the new key is a miss ("the trailer names another key"), and the old
key's name is gone. The key in the trailer is what makes this safe: a spare renamed but not yet
overwritten is a whole, checksummed block of another key. :meth:`DiskTier.scan` removes the spare
files whose bytes last changed more than :data:`IN_PROGRESS_GRACE_S` before (a rename keeps the
modification time, so that is most of them: a crash's leftovers, and those of another engine
sharing the directory, whose next write then finds its spare gone and creates a file);
:meth:`DiskTier.close` removes the tier's own.
A reader in another engine sharing the directory that comes in the middle of an overwrite
finds a trailer naming another key and removes the file, as it does for any such file: that
block is a miss for both engines, never misread.

The payload sits at offset 0 so that the kernel copies it between page-cache pages and
page-aligned memory (the CPU tier's slots are page-aligned) at the same offset within a page:
on the machines we measured, a copy where the two offsets differ runs at 3 GB/s instead of
5.5, and at 1 GB/s when the memory is 16 bytes ahead of the file (what a plain numpy array
gets), so a header in front of the payload slowed every read and write. XXH3 runs at memory
speed (13 GB/s from memory, about 30 GB/s on a block still in cache, against 3 GB/s for
``zlib.crc32`` here) and releases the GIL as ``zlib.crc32`` does, so the checks of reads in
the ``io_threads`` run in parallel. A block takes two ``os.pwrite`` to write (the payload
alone, then the trailer: faster than one ``os.writev`` of both) and one ``os.preadv`` to read
(payload, trailer and one byte past the end, which tells a too-long file without an
``fstat``), through the page cache: O_DIRECT is slower than the page cache on our machines
(measured: ``docs/offloading.md``), and the page cache is what makes a promotion soon after a
write-through cheap. Options: ``path`` (required, a directory;
created), ``fsync`` (bool, default false: fsync each file after its trailer, for crash
durability at a large cost per block), ``open_files`` (int >= 0: how many written files stay
open; default 1024, or an eighth of ``RLIMIT_NOFILE`` when that is lower; 0 keeps none),
``spare_files`` (int >= 0: how many removed blocks' files are kept for writes to overwrite,
see above; default 256; 0 unlinks every removed block's file; spares take disk space beside
``capacity_bytes``, at most ``spare_files`` blocks).

``ENOSPC`` (``EDQUOT``) raises :class:`~kvframe.spi.offload.TierFullError`; the connector
then stops writing to the tier.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvframe.errors import ConfigError
from kvframe.spi.offload import (
    KEY_SIZE,
    ByteArray,
    CorruptEntryError,
    MemoryTier,
    OffloadError,
    OffloadTier,
    TierConfig,
    TierFullError,
)

__all__ = [
    "DISK_HEADER_BYTES",
    "DISK_TRAILER_BYTES",
    "IN_PROGRESS_GRACE_S",
    "CPUTier",
    "DiskTier",
    "create_cpu_tier",
    "create_disk_tier",
]

_MAGIC = b"KVOB"
_VERSION = 2
# Behind the payload: magic, format version, reserved (0), key, payload length, XXH3-64 of
# the payload, reserved (0). Version 1 (older releases) had a 64-byte header in front instead:
# magic, version 1, reserved, key, length, CRC-32, padding.
_TRAILER = struct.Struct("<4sHH32sQQ8s")
# What a read of a block file finds in the trailer and the one byte it asks for past the end
# (none there: the byte stays zero).
_EXPECTED = struct.Struct("<4sHH32sQQ8sx")
_ZEROS = bytes(8)
DISK_TRAILER_BYTES = _TRAILER.size
"""Bytes each block file holds besides the payload (its trailer)."""
DISK_HEADER_BYTES = DISK_TRAILER_BYTES
"""The former name of :data:`DISK_TRAILER_BYTES` (format version 1 had a header)."""
_OLD_VERSIONS = {1: "a CRC-32 header in front of the payload"}
# Releases the GIL (checked: a Python loop beside a thread hashing 256 MiB never stalls).
_checksum = xxhash.xxh3_64_intdigest
_SUFFIX = ".kvb"
# Removed blocks' files waiting to be overwritten by a write (see the module docstring): in
# a sub-directory whose name is not two hex digits, so scan() never takes them for blocks.
_SPARE_DIR = "spare"
_SPARE_SUFFIX = ".kvs"
IN_PROGRESS_GRACE_S = 30.0
"""A file shorter than a block file that changed less than this many seconds ago is a miss
but stays on disk (a write may be under way); an older one is removed. :meth:`DiskTier.scan`
removes the spare files that changed longer ago than this."""
_NOSPACE = {errno.ENOSPC, errno.EDQUOT}
_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)


def _torch_pinned() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch is a dependency; be safe anyway
        return False


def _page_aligned(shape: tuple[int, int]) -> ByteArray:
    """An uninitialised uint8 array of ``shape`` whose first byte starts a page (numpy's own
    large arrays start 16 bytes into one)."""
    nbytes = shape[0] * shape[1]
    raw = np.empty(nbytes + mmap.PAGESIZE, dtype=np.uint8)
    start = -raw.ctypes.data % mmap.PAGESIZE
    out: ByteArray = raw[start : start + nbytes].reshape(shape)
    return out


def _check_options(config: TierConfig, allowed: tuple[str, ...]) -> None:
    for key in config.options:
        if key not in allowed:
            known = ", ".join(("tier", "capacity_bytes", *allowed))
            raise ConfigError(
                f"{config.path}.{key}: unknown option for the {config.name!r} tier; "
                f"known keys: {known}"
            )


class CPUTier(MemoryTier):
    """Host-memory tier (pinned when CUDA is present). See the module docstring."""

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        _check_options(config, ())
        if config.capacity_blocks < 1:
            raise ConfigError(
                f"{config.path}.capacity_bytes: got {config.capacity_bytes}; expected at least "
                f"one block ({config.block_bytes} bytes)"
            )
        self._buffer: ByteArray | None = None
        self._tensor: Any = None
        self.pinned = False

    def open(self) -> None:
        if self._buffer is not None:
            return
        shape = (self.capacity_blocks, self.config.block_bytes)
        if _torch_pinned():
            import torch

            self._tensor = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            self._buffer = self._tensor.numpy()
            self.pinned = True
        else:
            try:
                self._buffer = _page_aligned(shape)
            except MemoryError as exc:
                raise ConfigError(
                    f"{self.config.path}.capacity_bytes: cannot allocate "
                    f"{self.config.capacity_bytes} bytes of host memory; lower it"
                ) from exc

    def slot_array(self, slot: int) -> ByteArray:
        if self._buffer is None:
            raise RuntimeError("the cpu tier is not open; call open() first")
        if not 0 <= slot < self.capacity_blocks:
            raise IndexError(f"slot {slot} outside 0..{self.capacity_blocks - 1}")
        out: ByteArray = self._buffer[slot]
        return out

    def contiguous_array(self) -> ByteArray | None:
        return self._buffer

    def close(self) -> None:
        self._buffer = None
        self._tensor = None


class DiskTier(OffloadTier):
    """One checksummed file per block. See the module docstring."""

    persistent = True

    def __init__(self, config: TierConfig) -> None:
        super().__init__(config)
        _check_options(config, ("path", "fsync", "open_files", "spare_files"))
        path = config.options.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(
                f"{config.path}.path: got {path!r}; the disk tier needs a directory path "
                "(a non-empty string)"
            )
        fsync = config.options.get("fsync", False)
        if not isinstance(fsync, bool):
            raise ConfigError(f"{config.path}.fsync: got {fsync!r}; expected true or false")
        open_files = config.options.get("open_files", _default_open_files())
        if isinstance(open_files, bool) or not isinstance(open_files, int) or open_files < 0:
            raise ConfigError(
                f"{config.path}.open_files: got {open_files!r}; expected an int >= 0 (0 keeps "
                "no file open)"
            )
        spare_files = config.options.get("spare_files", 256)
        if isinstance(spare_files, bool) or not isinstance(spare_files, int) or spare_files < 0:
            raise ConfigError(
                f"{config.path}.spare_files: got {spare_files!r}; expected an int >= 0 (0 "
                "unlinks the file of every removed block)"
            )
        self.spare_files = spare_files
        """How many removed blocks' files this tier keeps for writes to overwrite (see the
        module docstring)."""
        self._spares: list[str] = []
        self._spares_lock = threading.Lock()
        self._spare_dir: str | None = None
        self._spare_serial = 0
        self.root = Path(path)
        self._root = str(self.root)
        self.fsync = fsync
        self.open_files = open_files
        """How many block files this tier keeps open after writing them (see the module
        docstring)."""
        # key -> the descriptor of its file, opened by the write, oldest first. Reads take a
        # dup() of it under the lock, so an eviction never closes one a read is using.
        self._fds: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._fds_lock = threading.Lock()
        # Sub-directories known to exist: saves a mkdir system call per block written.
        self._dirs: set[str] = set()
        if self.capacity_blocks < 1:
            raise ConfigError(
                f"{config.path}.capacity_bytes: got {config.capacity_bytes}; expected at least "
                f"one block file ({config.block_bytes + DISK_TRAILER_BYTES} bytes)"
            )

    @property
    def capacity_blocks(self) -> int:
        return self.config.capacity_bytes // (self.config.block_bytes + DISK_TRAILER_BYTES)

    def file_of(self, key: bytes) -> Path:
        """The file that holds ``key``."""
        return Path(self._path(key))

    def _path(self, key: bytes) -> str:
        # Plain strings: a pathlib join costs microseconds, a few percent of a block's I/O.
        name = key.hex()
        return f"{self._root}/{name[:2]}/{name}{_SUFFIX}"

    def _sub_dir(self, key: bytes) -> None:
        """Create the sub-directory of ``key``'s file unless it is known to exist."""
        sub = key[:1].hex()
        if sub not in self._dirs:
            os.makedirs(f"{self._root}/{sub}", exist_ok=True)
            self._dirs.add(sub)

    def open(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"{self.config.path}.path: cannot create directory {str(self.root)!r}: {exc}"
            ) from exc

    def write(self, key: bytes, slot: int, data: ByteArray) -> None:
        path = self._path(key)
        payload = data.data
        if not payload.c_contiguous:
            payload = memoryview(np.ascontiguousarray(data).data)
        if payload.ndim != 1 or payload.format != "B":
            payload = payload.cast("B")
        try:
            self._sub_dir(key)
            # In place, the trailer last: until the trailer lands, a reader finds the file
            # too short and leaves it alone (see read), or, over a reused spare, a trailer
            # that names the key the file held before: a miss either way.
            fd = self._reuse(path) if self._spares else -1
            if fd < 0:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            kept = False
            try:
                written = self._pwrite(fd, payload, 0)
                if written == len(payload):
                    # Checksummed after the copy into the page cache, which left the payload
                    # in the CPU's cache: faster than reading it from memory twice.
                    checksum = _checksum(payload)
                    trailer = _TRAILER.pack(
                        _MAGIC, _VERSION, 0, key, len(payload), checksum, _ZEROS
                    )
                    written += self._pwrite(fd, trailer, written)
                if written != len(payload) + _TRAILER.size:
                    raise OffloadError(f"short write to {path}: {written} bytes")
                if self.fsync:
                    os.fsync(fd)
                kept = self._keep(key, fd)
            finally:
                if not kept:
                    os.close(fd)
        except OSError as exc:
            self._forget(key)
            with contextlib.suppress(OSError):
                os.unlink(path)
            if exc.errno in _NOSPACE:
                raise TierFullError(f"disk tier {str(self.root)!r} is full: {exc}") from exc
            raise OffloadError(f"writing {path}: {exc}") from exc
        except OffloadError:
            self._forget(key)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def _reuse(self, path: str) -> int:
        """A spare file (a removed block's) renamed to ``path`` and opened for writing, or -1
        when there is none (or it vanished: another engine's :meth:`scan` removes old spare
        files). The file keeps the removed block's bytes and trailer until the write
        overwrites them: a reader in between finds a trailer that names another key, a miss."""
        while True:
            with self._spares_lock:
                if not self._spares:
                    return -1
                spare = self._spares.pop()
            try:
                os.rename(spare, path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(spare)
                continue
            fd = os.open(path, os.O_RDWR)
            if _WILLNEED is not None:
                # The trailer's page, which the trailer's pwrite covers only in part: the
                # kernel must read it first when it is not cached (an evicted block's file
                # seldom is), about 70 µs on our virtual disk. Asked for now, it is read
                # while the payload is copied (measured: 127 µs instead of 156 a block).
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, self.config.block_bytes, _TRAILER.size, _WILLNEED)
            return fd

    def _keep(self, key: bytes, fd: int) -> bool:
        """Keep ``fd`` open as ``key``'s file (closing the oldest kept one beyond
        :attr:`open_files`, or the one ``key`` had); ``False`` when nothing is kept."""
        if not self.open_files:
            return False
        with self._fds_lock:
            old = self._fds.pop(key, None)
            self._fds[key] = fd
            close = [old] if old is not None else []
            while len(self._fds) > self.open_files:
                close.append(self._fds.popitem(last=False)[1])
            for f in close:
                with contextlib.suppress(OSError):
                    os.close(f)
        return True

    def _forget(self, key: bytes) -> None:
        """Close ``key``'s kept file, if any."""
        with self._fds_lock:
            fd = self._fds.pop(key, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        """One of the two system calls that write a block file (the payload alone, then the
        trailer: the page cache takes a lone 256 KiB payload 1.3–2× faster than the same bytes
        with a 64-byte trailer in one ``os.writev``, measured on ext4). A fault-injection
        point for tests (a subclass raises ``OSError(errno.ENOSPC, ...)`` here to simulate a
        full disk)."""
        return os.pwrite(fd, data, offset)

    def read(self, key: bytes, slot: int, out: ByteArray) -> None:
        dst = out.data
        if dst.ndim != 1 or dst.format != "B":
            dst = dst.cast("B")
        # The trailer and one byte past the end in one buffer: a file of the right length
        # leaves that byte zero, as the expected trailer packed by _EXPECTED ends.
        tail = bytearray(_EXPECTED.size)
        path = ""
        try:
            # A dup of the kept descriptor (no path lookup, no open), taken under the lock so
            # that an eviction never closes it mid-read; else the file opened by name.
            with self._fds_lock:
                kept = self._fds.get(key)
                fd = os.dup(kept) if kept is not None else -1
            if fd < 0:
                path = self._path(key)
                fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise CorruptEntryError(f"{path} is gone") from exc
        except OSError as exc:
            raise OffloadError(f"opening {path or self._path(key)}: {exc}") from exc
        try:
            got = os.preadv(fd, [dst, tail], 0)
        except OSError as exc:
            raise OffloadError(f"reading {path or self._path(key)}: {exc}") from exc
        finally:
            os.close(fd)
        n = len(dst)
        # The one comparison of the common case; _check says what is wrong.
        if got == n + _TRAILER.size and tail == _EXPECTED.pack(
            _MAGIC, _VERSION, 0, key, n, _checksum(dst), _ZEROS
        ):
            return
        path = path or self._path(key)
        problem = self._check(key, dst, tail[: _TRAILER.size], got)
        if problem:
            if got < n + _TRAILER.size and _young(path):
                # Perhaps being written right now (by another engine sharing the directory):
                # a miss, but the file stays; a crash's leftover goes once it is old.
                raise CorruptEntryError(
                    f"{path}: {problem}; left in place (changed less than "
                    f"{IN_PROGRESS_GRACE_S:g} s ago: perhaps still being written)"
                )
            self._forget(key)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise CorruptEntryError(f"{path}: {problem}; removed")

    @staticmethod
    def _check(key: bytes, payload: memoryview, trailer: bytearray, got: int) -> str:
        """Why the file read into ``payload`` and ``trailer`` (``got`` bytes, at most one
        past the expected end) is not ``key``'s block, or ``""``."""
        want = len(payload) + _TRAILER.size
        if got != want:
            size = f"more than {want}" if got > want else str(got)
            return _old_format(payload, got) or (
                f"{size} bytes on disk, expected {want} (truncated or foreign)"
            )
        magic, version, reserved, stored_key, length, checksum, pad = _TRAILER.unpack(trailer)
        if magic != _MAGIC:
            return _old_format(payload, got) or f"bad magic {magic!r} (not a kvframe block file)"
        if version != _VERSION:
            return f"unknown format version {version}; this kvframe reads version {_VERSION}"
        if reserved or pad != _ZEROS:
            return "reserved trailer bytes are set (damaged)"
        if stored_key != key:
            return "the trailer names another key"
        if length != len(payload):
            return f"payload length {length}, expected {len(payload)}"
        if _checksum(payload) != checksum:
            return "checksum mismatch"
        return ""  # pragma: no cover - read() found the file intact

    def remove(self, key: bytes, slot: int) -> None:
        # Best effort: a later read finds the file gone or damaged and removes what is left.
        self._forget(key)
        path = self._path(key)
        with contextlib.suppress(OSError):
            if len(self._spares) < self.spare_files and self._spare(path):
                return
            os.unlink(path)

    def _spare(self, path: str) -> bool:
        """Rename the block file at ``path`` to a spare name for a later write to overwrite
        (see the module docstring); ``False`` when it is not a whole block file (damaged or
        too short: unlinked instead). Raises ``OSError`` when it is gone."""
        if os.stat(path).st_size != self.config.block_bytes + DISK_TRAILER_BYTES:
            return False
        if self._spare_dir is None:
            os.makedirs(f"{self._root}/{_SPARE_DIR}", exist_ok=True)
            self._spare_dir = f"{self._root}/{_SPARE_DIR}/{os.getpid()}-{secrets.token_hex(4)}-"
        with self._spares_lock:
            self._spare_serial += 1
            spare = f"{self._spare_dir}{self._spare_serial}{_SPARE_SUFFIX}"
        os.rename(path, spare)
        with self._spares_lock:
            self._spares.append(spare)
        return True

    def close(self) -> None:
        with self._fds_lock:
            fds, self._fds = list(self._fds.values()), collections.OrderedDict()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        with self._spares_lock:
            spares, self._spares = self._spares, []
        for spare in spares:
            with contextlib.suppress(OSError):
                os.unlink(spare)

    def scan(self) -> Iterator[bytes]:
        if not self.root.is_dir():
            return
        _remove_old_spares(self.root / _SPARE_DIR)
        for sub in sorted(self.root.iterdir()):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                name = f.name
                if name.endswith(".tmp"):
                    f.unlink(missing_ok=True)  # older releases' unfinished write
                    continue
                if not name.endswith(_SUFFIX):
                    continue
                stem = name[: -len(_SUFFIX)]
                try:
                    key = bytes.fromhex(stem)
                except ValueError:
                    continue
                if len(key) == KEY_SIZE:
                    yield key


def _default_open_files() -> int:
    """The disk tier's default ``open_files``: 1024, or an eighth of the process's limit on
    open files when that is lower (``RLIMIT_NOFILE``: sockets and the engine need the rest)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 0
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(0, min(1024, soft // 8))


def _remove_old_spares(spare_dir: Path) -> None:
    """Unlink the spare files under ``spare_dir`` whose bytes last changed more than
    :data:`IN_PROGRESS_GRACE_S` ago (a rename keeps the modification time): a crashed
    engine's, or another live one's (whose next write then finds its spare gone and creates a
    new file)."""
    if not spare_dir.is_dir():
        return
    now = time.time()
    for f in spare_dir.iterdir():
        with contextlib.suppress(OSError):
            if f.name.endswith(_SPARE_SUFFIX) and now - f.stat().st_mtime >= IN_PROGRESS_GRACE_S:
                f.unlink()


def _young(path: str) -> bool:
    """Whether ``path`` changed within :data:`IN_PROGRESS_GRACE_S` (false when it is gone)."""
    try:
        return time.time() - os.stat(path).st_mtime < IN_PROGRESS_GRACE_S
    except OSError:
        return False


def _old_format(payload: memoryview, got: int) -> str:
    """The refusal of a file in an older format version (its header is where the payload
    was read), or ``""``."""
    if got < 6 or payload[:4] != _MAGIC:
        return ""
    version = int.from_bytes(payload[4:6], "little")
    if version not in _OLD_VERSIONS:
        return ""
    return (
        f"format version {version} ({_OLD_VERSIONS[version]}, written by an older kvframe); "
        f"this one reads version {_VERSION} only"
    )


def create_cpu_tier(config: TierConfig) -> CPUTier:
    """The ``"cpu"`` tier factory."""
    return CPUTier(config)


def create_disk_tier(config: TierConfig) -> DiskTier:
    """The ``"disk"`` tier factory."""
    return DiskTier(config)
