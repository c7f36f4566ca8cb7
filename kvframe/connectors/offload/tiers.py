"""The built-in offload tiers: ``"cpu"`` (host memory) and ``"disk"`` (one file per block).

**cpu** (:class:`CPUTier`, a :class:`~kvframe.spi.offload.MemoryTier`): one uint8 array of
``capacity_blocks × block_bytes``, allocated in :meth:`~CPUTier.open` (page-locked when CUDA is
available, so copies to and from the GPU run at full speed and can be asynchronous). Options:
none.

**disk** (:class:`DiskTier`): one file per block under ``path``, named by the key's hex
(``ab/abcdef….kvb``), written to a temporary name and renamed into place, so a reader never
sees a half-written file under its final name. Each file starts with a 64-byte header (magic,
version, key, payload length, CRC-32 of the payload); a read checks all of them and removes a
file that fails (truncated, corrupted, foreign). Writes go through the page cache with one
``os.writev`` per block: on our machines NIXL's POSIX backend is no faster than ``os.pwrite``
through the page cache (``/work/shared/FACTS.md``), and O_DIRECT needs aligned buffers and
bypasses the page cache that makes re-reads after a write fast. Options: ``path`` (required,
a directory; created), ``fsync`` (bool, default false: fsync each file before the rename, for
crash durability at a large cost per block).

``ENOSPC`` (``EDQUOT``) raises :class:`~kvframe.spi.offload.TierFullError`; the connector
then stops writing to the tier.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

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

__all__ = ["DISK_HEADER_BYTES", "CPUTier", "DiskTier", "create_cpu_tier", "create_disk_tier"]

_MAGIC = b"KVOB"
_VERSION = 1
# magic, version, reserved, key, payload length, crc32, padding to 64 bytes
_HEADER = struct.Struct("<4sHH32sQI12x")
DISK_HEADER_BYTES = _HEADER.size
"""Bytes of the header in front of every block file."""
_SUFFIX = ".kvb"
_NOSPACE = {errno.ENOSPC, errno.EDQUOT}


def _torch_pinned() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch is a dependency; be safe anyway
        return False


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
                self._buffer = np.empty(shape, dtype=np.uint8)
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
        _check_options(config, ("path", "fsync"))
        path = config.options.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(
                f"{config.path}.path: got {path!r}; the disk tier needs a directory path "
                "(a non-empty string)"
            )
        fsync = config.options.get("fsync", False)
        if not isinstance(fsync, bool):
            raise ConfigError(f"{config.path}.fsync: got {fsync!r}; expected true or false")
        self.root = Path(path)
        self.fsync = fsync
        # Sub-directories known to exist: saves a mkdir system call per block written.
        self._dirs: set[str] = set()
        if self.capacity_blocks < 1:
            raise ConfigError(
                f"{config.path}.capacity_bytes: got {config.capacity_bytes}; expected at least "
                f"one block file ({config.block_bytes + DISK_HEADER_BYTES} bytes)"
            )

    @property
    def capacity_blocks(self) -> int:
        return self.config.capacity_bytes // (self.config.block_bytes + DISK_HEADER_BYTES)

    def file_of(self, key: bytes) -> Path:
        """The file that holds ``key``."""
        name = key.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    def open(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"{self.config.path}.path: cannot create directory {str(self.root)!r}: {exc}"
            ) from exc

    def write(self, key: bytes, slot: int, data: ByteArray) -> None:
        final = self.file_of(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{slot}.tmp")
        payload = memoryview(np.ascontiguousarray(data).data).cast("B")
        header = _HEADER.pack(_MAGIC, _VERSION, 0, key, len(payload), zlib.crc32(payload))
        try:
            if final.parent.name not in self._dirs:
                final.parent.mkdir(exist_ok=True)
                self._dirs.add(final.parent.name)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                written = self._writev(fd, [header, payload])
                if written != len(header) + len(payload):
                    raise OffloadError(f"short write to {tmp}: {written} bytes")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in _NOSPACE:
                raise TierFullError(f"disk tier {str(self.root)!r} is full: {exc}") from exc
            raise OffloadError(f"writing {final}: {exc}") from exc

    def _writev(self, fd: int, buffers: list[Any]) -> int:
        """The one system call that writes a block file: a fault-injection point for tests
        (a subclass raises ``OSError(errno.ENOSPC, ...)`` here to simulate a full disk)."""
        return os.writev(fd, buffers)

    def read(self, key: bytes, slot: int, out: ByteArray) -> None:
        path = self.file_of(key)
        header = bytearray(_HEADER.size)
        dst = memoryview(out.data).cast("B")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise CorruptEntryError(f"{path} is gone") from exc
        except OSError as exc:
            raise OffloadError(f"opening {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            got = os.preadv(fd, [header, dst], 0)
        except OSError as exc:
            raise OffloadError(f"reading {path}: {exc}") from exc
        finally:
            os.close(fd)
        problem = self._check(key, bytes(header), got, size, dst)
        if problem:
            path.unlink(missing_ok=True)
            raise CorruptEntryError(f"{path}: {problem}; removed")

    def _check(self, key: bytes, header: bytes, got: int, size: int, payload: memoryview) -> str:
        want = _HEADER.size + len(payload)
        if size != want or got != want:
            return f"{size} bytes on disk, expected {want} (truncated or foreign)"
        magic, version, _, stored_key, length, crc = _HEADER.unpack(header)
        if magic != _MAGIC or version != _VERSION:
            return f"bad magic or version ({magic!r}, {version})"
        if stored_key != key:
            return "the header names another key"
        if length != len(payload):
            return f"payload length {length}, expected {len(payload)}"
        if zlib.crc32(payload) != crc:
            return "checksum mismatch"
        return ""

    def remove(self, key: bytes, slot: int) -> None:
        # Best effort: a later read finds the file gone or damaged and removes what is left.
        with contextlib.suppress(OSError):
            self.file_of(key).unlink(missing_ok=True)

    def scan(self) -> Iterator[bytes]:
        if not self.root.is_dir():
            return
        for sub in sorted(self.root.iterdir()):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                name = f.name
                if name.endswith(".tmp"):
                    f.unlink(missing_ok=True)  # a write that never finished
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


def create_cpu_tier(config: TierConfig) -> CPUTier:
    """The ``"cpu"`` tier factory."""
    return CPUTier(config)


def create_disk_tier(config: TierConfig) -> DiskTier:
    """The ``"disk"`` tier factory."""
    return DiskTier(config)
