"""Payload segment files of the SSD tier: append-only, read with direct I/O.

RocksDB keeps each page's header and the location of its payload (kvstore/tiers/ssd.py); the
payload bytes live here, in files `<folder>/<id>.seg` of up to `segment_bytes`, each payload at a
4 KiB-aligned offset. A read is one `preadv` of the aligned span with O_DIRECT (the page cache
is bypassed, as for a KV page read once and promoted to DRAM) into a per-thread buffer, then a
copy to where the caller wants it; the read releases the GIL and runs at the disk's speed:
measured here, 1.4-2.2 GB/s against 0.44 GB/s for the same 1 MiB values read through RocksDB's
blob files. Where the file system refuses O_DIRECT (tmpfs), reads are buffered.

Space: `release` takes a payload's bytes off its segment's live count; a sealed segment with
nothing live is deleted, and the tier rewrites the live pages of one that is less than half live
(`sparse`) so the files never hold much more than twice the live bytes. Not thread-safe for
writers (the tier serializes them); `read` may run concurrently with everything.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import struct
import threading
from pathlib import Path

from kvstore.errors import Corrupt, InvalidArgument, Unavailable
from kvstore.tiers.faults import NO_FAULTS, SsdFaults

__all__ = ["LOCATION", "SegmentFiles", "sync_dir"]

log = logging.getLogger(__name__)

ALIGN = 4096
LOCATION = struct.Struct("<IQQ")  # segment id, offset, payload length: a page's payload address
_NAME = re.compile(r"^(\d{8})\.seg$")
_ZEROS = bytes(ALIGN)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def sync_dir(folder: Path) -> None:
    """fsync a directory, making the entries created in it durable. Raises OSError."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentFiles:
    """The segment files of one SSD tier folder."""

    def __init__(
        self,
        folder: Path,
        segment_bytes: int,
        *,
        sync_dirs: bool = False,
        accounting: threading.Lock | None = None,
    ) -> None:
        """`sync_dirs`: make each new segment file's directory entry durable (fsync of the
        folder after it is created, and of the folder's parent when the folder is new), as
        `sync_writes` promises: a payload synced in a file whose name is lost is lost too."""
        if segment_bytes < ALIGN:
            raise InvalidArgument(f"segment size must be at least {ALIGN} bytes")
        self._folder = folder
        self._segment_bytes = segment_bytes
        self._sync_dirs = sync_dirs
        # Guards the live/size accounting: `append` (one writer at a time) takes it only around
        # its bookkeeping, never over its I/O; the owner holds it when it calls `release`,
        # `adopt`, `sparse` or `drop_empty`.
        self._acct = accounting or threading.Lock()
        try:
            new = not folder.exists()
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # private (tiers/private.py)
            if sync_dirs:
                if new:
                    sync_dir(folder.parent)
                sync_dir(folder)
        except OSError as exc:
            raise Unavailable(f"cannot create {folder}: {exc}") from exc
        self._live: dict[int, int] = {}  # segment id -> live (aligned) payload bytes
        self._size: dict[int, int] = {}  # segment id -> bytes written (aligned)
        self._read_fds: dict[int, int] = {}
        self._readers: dict[int, int] = {}  # segment id -> reads in progress
        self._closing: dict[int, int] = {}  # removed segments' descriptors still being read
        self._fd_lock = threading.Lock()
        self._buffers = threading.local()
        self.faults: SsdFaults = NO_FAULTS  # injected faults (kvstore/tiers/faults.py)
        self._current = -1
        self._write_fd = -1
        self._unsynced = False
        existing = [int(m.group(1)) for p in folder.iterdir() if (m := _NAME.match(p.name))]
        for seg in existing:
            self._size[seg] = os.stat(self._file(seg)).st_size
            self._live[seg] = 0
        self._next = max(existing, default=0) + 1  # never append to a file from an earlier run

    # ---- writes (the caller serializes them) ---------------------------------------------------

    def append(self, payload: memoryview) -> tuple[int, int]:
        """Write a payload; returns (segment id, offset). Raises Unavailable on I/O errors."""
        n = payload.nbytes
        span = _aligned(max(n, 1))
        if self._write_fd < 0 or self._size[self._current] + span > self._segment_bytes:
            self._roll()
        seg, offset = self._current, self._size[self._current]
        pad = span - n
        self.faults.before_write(f"segment {seg}")
        try:
            os.pwritev(self._write_fd, [payload, _ZEROS[:pad]] if pad else [payload], offset)
        except OSError as exc:
            raise Unavailable(f"ssd tier: writing segment {seg}: {exc}") from exc
        with self._acct:
            self._size[seg] = offset + span
            self._live[seg] += span
        self._unsynced = True
        return seg, offset

    def sync(self) -> None:
        """Make appended payloads durable (fdatasync of the segment being written)."""
        if self._write_fd >= 0 and self._unsynced:
            try:
                os.fdatasync(self._write_fd)
            except OSError as exc:
                raise Unavailable(f"ssd tier: syncing segment {self._current}: {exc}") from exc
            self._unsynced = False

    def adopt(self, seg: int, offset: int, length: int) -> bool:
        """Count a payload found by a restart scan as live; False (not counted) when its segment
        file is missing or too short to hold it."""
        size = self._size.get(seg)
        if size is None or offset % ALIGN or offset + length > size:
            return False
        self._live[seg] += _aligned(max(length, 1))
        return True

    def release(self, seg: int, length: int) -> None:
        """A payload of `seg` is gone; a sealed segment with nothing live is deleted."""
        if seg not in self._live:
            return
        self._live[seg] = max(0, self._live[seg] - _aligned(max(length, 1)))
        if not self._live[seg] and seg != self._current:
            self._remove(seg)

    def drop_empty(self) -> int:
        """Delete every sealed segment with nothing live (after a restart scan); how many."""
        empty = [seg for seg, live in self._live.items() if not live and seg != self._current]
        for seg in empty:
            self._remove(seg)
        return len(empty)

    def sparse(self) -> int | None:
        """A sealed segment less than half live, the emptiest first; None if there is none."""
        found = [
            (live / max(self._size[seg], 1), seg)
            for seg, live in self._live.items()
            if seg != self._current and live * 2 < self._size[seg]
        ]
        return min(found)[1] if found else None

    @property
    def disk_bytes(self) -> int:
        return sum(self._size.values())

    # ---- reads (any thread) --------------------------------------------------------------------

    def read_into(self, seg: int, offset: int, length: int, dest: memoryview) -> None:
        """Read the payload at (seg, offset) of `length` bytes into `dest` (a writable byte view
        of at least `length` bytes). Raises as `read`.

        The disk reads into this thread's buffer, then the bytes are copied to `dest`: direct
        I/O into the same few pages again and again measured 1.6 GB/s with the copy, against
        1.2 GB/s straight into a different DRAM slot each time (every direct read pins its
        destination pages first)."""
        span = _aligned(max(length, 1))
        buf = self._buffer(span)
        fd = self._open_for_read(seg)
        try:
            self.faults.before_read(f"segment {seg}")
            got = os.preadv(fd, [memoryview(buf)[:span]], offset)
        except OSError as exc:
            self._forget(seg, fd)  # the next read opens the file afresh (it may be replaced)
            raise Unavailable(f"ssd tier: reading segment {seg}: {exc}") from exc
        finally:
            self._done_reading(seg, fd)
        if got < length:
            raise Corrupt(f"segment {seg} ends before the payload at {offset} (+{length})")
        dest[:length] = memoryview(buf)[:length]

    def read(self, seg: int, offset: int, length: int) -> bytearray:
        """The payload at (seg, offset) of `length` bytes. Raises Corrupt when the segment is
        missing (deleted, or moved by a compaction since the caller looked it up) or too short,
        Unavailable on other I/O errors."""
        out = bytearray(length)
        self.read_into(seg, offset, length, memoryview(out))
        return out

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._fd_lock:
            fds = [*self._read_fds.values(), *self._closing.values()]
            self._read_fds, self._closing = {}, {}
        if self._write_fd >= 0:
            fds.append(self._write_fd)
            self._write_fd = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- helpers -------------------------------------------------------------------------------

    def _file(self, seg: int) -> Path:
        return self._folder / f"{seg:08d}.seg"

    def _roll(self) -> None:
        if self._write_fd >= 0:
            self.sync()
            os.close(self._write_fd)
            self._write_fd = -1
            with self._acct:
                old, self._current = self._current, -1  # sealed from now on
                if not self._live.get(old):
                    self._remove(old)
        seg = self._next
        self._next += 1
        try:
            fd = os.open(self._file(seg), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            self._write_fd = -1
            raise Unavailable(f"ssd tier: creating segment {seg}: {exc}") from exc
        with self._acct:
            self._current, self._write_fd = seg, fd
            self._size[seg] = 0
            self._live[seg] = 0
        if self._sync_dirs:
            try:
                sync_dir(self._folder)  # the new file's name survives a power loss
            except OSError as exc:
                raise Unavailable(f"ssd tier: syncing {self._folder}: {exc}") from exc

    def _remove(self, seg: int) -> None:
        self._live.pop(seg, None)
        self._size.pop(seg, None)
        with self._fd_lock:
            fd = self._read_fds.pop(seg, None)
            if fd is not None and self._readers.get(seg):
                self._closing[seg] = fd  # the last reader closes it
                fd = None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(seg))  # an open descriptor still reads it

    def _open_for_read(self, seg: int) -> int:
        with self._fd_lock:
            fd = self._read_fds.get(seg)
            if fd is None:
                fd = self._open(seg)
                self._read_fds[seg] = fd
            self._readers[seg] = self._readers.get(seg, 0) + 1
            return fd

    def _forget(self, seg: int, fd: int) -> None:
        """Stop reusing the descriptor `fd` of `seg` (a read failed on it); the last reader
        closes it."""
        with self._fd_lock:
            if self._read_fds.get(seg) == fd and seg not in self._closing:
                del self._read_fds[seg]
                self._closing[seg] = fd

    def _done_reading(self, seg: int, fd: int) -> None:
        with self._fd_lock:
            left = self._readers[seg] - 1
            if left:
                self._readers[seg] = left
                return
            del self._readers[seg]
            closing = self._closing.pop(seg, None)
        if closing is not None:
            with contextlib.suppress(OSError):
                os.close(closing)

    def _open(self, seg: int) -> int:
        path = self._file(seg)
        try:
            try:
                return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: no direct I/O on this file system
                    raise
                return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise Corrupt(f"segment file {path.name} is missing") from None
        except OSError as exc:
            raise Unavailable(f"ssd tier: opening {path.name}: {exc}") from exc

    def _buffer(self, span: int) -> mmap.mmap:
        """A page-aligned buffer of at least `span` bytes, one per thread (direct I/O needs
        aligned memory)."""
        buf: mmap.mmap | None = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < span:
            if buf is not None:
                buf.close()
            buf = mmap.mmap(-1, max(span, 1 << 20))
            self._buffers.buf = buf
        return buf
