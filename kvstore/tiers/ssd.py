"""The SSD tier: page headers in RocksDB (through rocksdict), payloads in segment files.

A page's payload is appended to a segment file first (kvstore/tiers/segments.py); then its
header and the payload's location (segment, offset, length) go to two column families under the
page's key (layout and rocksdict notes in kvstore/tiers/rocks.py), in one WriteBatch with the
WAL on: once `write` returns, the page survives a `kill -9` of the process (and, with
`sync_writes`, which also syncs the segment file first, a power loss). After a crash RocksDB
replays the WAL up to its last intact record, so at most the writes still in flight are lost; a
payload written without its record is garbage the segment accounting never counts.

Reads go straight to the segment file with direct I/O, three to five times faster here than the
same payloads read through RocksDB's blob files. Nothing corrupt is served: `read` verifies the
header checksum, that the header's key is the key asked for, and the payload's length and
xxh3-64. `scan` rebuilds the tier's accounting from the headers and locations after a restart,
drops bad entries, and salvages the headers family when RocksDB reports damage in it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rocksdict import Rdict, ReadOptions, WriteBatch, WriteOptions

from client.contract.page import PageHeader
from kvstore.errors import CapacityExhausted, Corrupt, InvalidArgument, Unavailable
from kvstore.keys import KEY_BYTES
from kvstore.tiers.faults import NO_FAULTS, SsdFaults
from kvstore.tiers.rocks import (
    RocksHandles,
    delete_namespaces,
    has_headers,
    iterate_headers,
    open_rocks,
    put_namespace,
    read_namespaces,
    rocks_error,
    salvage_headers,
)
from kvstore.tiers.segments import LOCATION, SegmentFiles, sync_dir

__all__ = ["ScanResult", "SsdTier"]

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

_NAMED_MEMORY = 1 << 16  # scope digests whose namespace record is known to be on disk
SEGMENT_BYTES = 64 << 20  # payload segment files (smaller when the tier itself is smaller)


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What a restart scan found: the valid pages' headers and how many bad entries it dropped.

    `complete` is False when RocksDB could not iterate past a damaged region of the headers;
    pages beyond it are neither returned nor counted (they stay on disk, unaccounted).
    """

    headers: list[PageHeader] = field(default_factory=list)
    dropped: int = 0
    complete: bool = True
    # the namespace of each scope digest among `headers` that has one recorded (name_scope)
    namespaces: dict[bytes, str] = field(default_factory=dict)


def _location(raw: bytes) -> tuple[int, int, int]:
    """(segment, offset, length) of a stored payload location; Corrupt when it is not one."""
    if len(raw) != LOCATION.size:
        raise Corrupt(f"payload location of {len(raw)} bytes (not {LOCATION.size})")
    seg, offset, length = LOCATION.unpack(raw)
    return int(seg), int(offset), int(length)


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidArgument(f"page keys are {KEY_BYTES} bytes")


class SsdTier:
    """Pages on local SSD under a logical byte budget (sum of `PageHeader.total_bytes`).

    Opening creates the folder and database if needed; raises Unavailable if RocksDB cannot open
    it (e.g. another process holds its LOCK). A database that already holds pages must be
    `scan()`ned before `write`, `delete` or `contains` (they raise Unavailable until then): the
    scan rebuilds the accounting. `read` works at any time. Thread-safe: writes, deletes and the
    scan serialize on one lock; reads take no lock, so they are never blocked by writes.
    """

    def __init__(
        self,
        path: Path,
        capacity_bytes: int,
        *,
        sync_writes: bool = False,
        faults: SsdFaults = NO_FAULTS,
    ) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgument(f"ssd capacity must be positive, got {capacity_bytes}")
        self._path = Path(path)
        self._capacity = capacity_bytes
        self._lock = threading.Lock()  # the accounting (held for moments, never over I/O)
        self._io_lock = threading.Lock()  # writers' I/O (writes, compaction steps, tombstones)
        self._sizes: dict[bytes, int] = {}
        self._where: dict[bytes, tuple[int, int, int]] = {}  # key -> payload location
        self._used = 0
        self._sync = sync_writes
        try:
            new = not self._path.exists()
            self._path.mkdir(mode=0o700, parents=True, exist_ok=True)  # private (tiers/private.py)
            if sync_writes and new:
                sync_dir(self._path.parent)  # the tier's folder itself survives a power loss
        except OSError as exc:
            raise Unavailable(f"cannot create ssd tier folder {self._path}: {exc}") from exc
        self._handles: RocksHandles | None = open_rocks(self._path)
        segment_bytes = max(min(SEGMENT_BYTES, capacity_bytes // 4), 1 << 20)
        self._files = SegmentFiles(
            self._path / "segments", segment_bytes, sync_dirs=sync_writes, accounting=self._lock
        )
        self._files.faults = faults
        if faults.active:
            log.warning("ssd tier: injecting faults: %s", faults)
        self._tombstones: dict[bytes, int] = {}  # deleted keys whose records are still on disk
        # scope digest -> namespace as recorded on disk (name_scope); the digests of pages that
        # left are pruned at the next scan
        self._named: dict[bytes, str] = {}
        self._write_opts = WriteOptions()
        self._write_opts.sync = sync_writes
        self._read_opts = ReadOptions()
        self._read_opts.set_verify_checksums(True)
        # A fresh (empty) database needs no scan; one with pages does, before it is written.
        self._scanned = not has_headers(self._handles)
        log.info(
            "ssd tier: %s, capacity %d bytes, sync_writes=%s%s",
            self._path,
            capacity_bytes,
            sync_writes,
            "" if self._scanned else " (existing pages: scan pending)",
        )

    # ---- queries -------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def faults(self) -> SsdFaults:
        """The faults injected into payload reads and writes (kvstore/tiers/faults.py); tests
        may assign new ones at any time."""
        return self._files.faults

    @faults.setter
    def faults(self, faults: SsdFaults) -> None:
        self._files.faults = faults

    @property
    def used_bytes(self) -> int:
        """Sum of `total_bytes` (header + payload) of the pages held; RocksDB overhead not counted."""
        return self._used

    @property
    def pages(self) -> int:
        return len(self._sizes)

    def contains(self, key: bytes) -> bool:
        """Whether a page is held under `key` (from memory, no I/O). Pure."""
        _check_key(key)
        self._require_scanned()
        return key in self._sizes

    def read(self, key: bytes) -> tuple[PageHeader, bytes] | None:
        """The verified header and payload of page `key`, or None when absent. Pure.

        Raises Corrupt when the stored header or payload fails verification, the payload is
        missing, or RocksDB reports corruption: the page must not be used, and the caller drops
        it (`delete`) and counts it. Raises Unavailable on other RocksDB errors or after close.
        """
        found = self._locate(key)
        if found is None:
            return None
        header, _ = found
        payload = bytearray(header.payload_bytes)
        got = self.read_into(key, memoryview(payload), header)  # located: not looked up again
        if got is None:
            return None
        return got, bytes(payload)

    def read_into(
        self, key: bytes, dest: memoryview, known: PageHeader | None = None, *, verify: bool = True
    ) -> PageHeader | None:
        """Read page `key`'s payload into `dest` (a writable byte view at least as long) and
        return its verified header, or None when absent. Raises as `read`; after a raise, `dest`
        holds unspecified bytes.

        `known`: the page's header as the caller holds it (the store's index does); then the
        read touches no RocksDB block, only the payload: the location is kept in memory.
        `verify=False` leaves the payload checksum to the caller (`header.verify_payload`),
        which must check it before using the bytes.
        """
        for attempt in range(2):
            found = self._locate(key, known)
            if found is None:
                return None
            header, (seg, offset, length) = found
            if dest.nbytes < length:
                raise InvalidArgument(f"buffer of {dest.nbytes} bytes for a {length}-byte payload")
            try:
                self._files.read_into(seg, offset, length, dest)
            except Corrupt:
                moved = self._locate(key, known)
                if attempt == 0 and moved is not None and moved[1] != (seg, offset, length):
                    continue  # a compaction moved it meanwhile: read it where it is now
                raise
            if verify:
                header.verify_payload(dest[:length])
            return header
        raise Corrupt("page payload keeps moving")  # not reached: one move per compaction

    def _locate(
        self, key: bytes, known: PageHeader | None = None
    ) -> tuple[PageHeader, tuple[int, int, int]] | None:
        """The stored header of `key` (or `known`) and its payload's location, or None when
        absent. With `known` and the accounting built, no RocksDB read at all."""
        _check_key(key)
        h = self._require_open()
        if self._scanned and key not in self._sizes:
            return None
        if known is not None and self._scanned:
            if known.key != key:
                raise InvalidArgument("the header given names another key")
            where_now = self._where.get(key)  # a dict read: atomic, no lock needed
            if where_now is None:
                return None
            if where_now[2] != known.payload_bytes:
                raise Corrupt("payload location disagrees with the page's header")
            return known, where_now
        raw_header = self._get(h.headers, key, "header read")
        if raw_header is None:
            return None
        header = PageHeader.decode(raw_header)
        if header.key != key:
            raise Corrupt("stored page header names another key")
        where = self._get(h.payloads, key, "payload location read")
        if where is None:
            if self._get(h.headers, key, "header read") is None:
                return None  # deleted between the two reads
            raise Corrupt("page payload is missing")
        seg, offset, length = _location(where)
        if length != header.payload_bytes:
            raise Corrupt(f"payload location says {length} bytes, header {header.payload_bytes}")
        return header, (seg, offset, length)

    # ---- mutations -----------------------------------------------------------------------------

    def name_scope(self, digest: bytes, namespace: str) -> None:
        """Record, durably as page writes are, that scope digest `digest` is of `namespace`
        (once per digest: a repeat costs a dict lookup), so that a restart's `scan` names the
        scopes of the pages it finds. Mutates; raises Unavailable when RocksDB fails."""
        with self._lock:
            if self._named.get(digest) == namespace:
                return
            h = self._require_open()
        put_namespace(h, digest, namespace, self._write_opts)
        with self._lock:
            self._named[digest] = namespace
            if len(self._named) > _NAMED_MEMORY:  # forget the oldest: a repeat only rewrites
                for old in list(itertools.islice(self._named, len(self._named) // 2)):
                    del self._named[old]

    def write(self, header: PageHeader, payload: Buffer) -> int:
        """Store a page durably (WAL) under `header.key`; mutates. Returns `header.total_bytes`.

        Idempotent: a key already present is not rewritten (and needs no room). Raises
        CapacityExhausted when the page does not fit in the remaining budget (the caller evicts
        first; nothing changes), InvalidArgument when the payload length disagrees with the
        header (or is not contiguous), Unavailable when RocksDB fails or before the pending scan.
        The payload checksum is not recomputed here: `read` verifies it.
        """
        _check_key(header.key)
        view = memoryview(payload)
        if not view.c_contiguous:
            raise InvalidArgument("page payload must be a C-contiguous buffer")
        if view.nbytes != header.payload_bytes:
            raise InvalidArgument(
                f"payload is {view.nbytes} bytes, its header says {header.payload_bytes}"
            )
        data = view.cast("B")
        total = header.total_bytes
        encoded = header.encode()
        with self._io_lock:  # writers one at a time; the accounting lock only for moments
            with self._lock:
                h = self._require_open()
                self._require_scanned()
                if header.key in self._sizes:
                    return total
                if self._used + total > self._capacity:
                    raise CapacityExhausted(
                        f"ssd tier full: {self._used} of {self._capacity} bytes used, "
                        f"page needs {total}"
                    )
                self._used += total  # held for it while it is written
            try:
                seg, offset = self._files.append(data)
                try:
                    if self._sync:
                        self._files.sync()  # the payload is durable before the record naming it
                    batch = WriteBatch(raw_mode=True)
                    batch.put(header.key, encoded, h.headers_cf)
                    batch.put(header.key, LOCATION.pack(seg, offset, data.nbytes), h.payloads_cf)
                    try:
                        h.db.write(batch, self._write_opts)
                    except Exception as exc:  # rocksdict reports RocksDB errors as Exception
                        raise rocks_error("write", exc) from exc
                except BaseException:
                    with self._lock:
                        self._files.release(seg, data.nbytes)
                    raise
            except BaseException:
                with self._lock:
                    self._used -= total
                raise
            with self._lock:
                self._sizes[header.key] = total
                self._where[header.key] = (seg, offset, data.nbytes)
                self._tombstones.pop(header.key, None)  # the new record replaces a pending delete
        return total

    def delete(self, key: bytes) -> int:
        """Remove page `key`; mutates. Returns bytes freed (0 when the page is absent).

        No disk I/O: the page leaves the tier's accounting at once (reads miss it, its space is
        free) and its RocksDB tombstones are queued for `flush_deletes` (the mover's pass, or
        `flush`/`close`), so a caller holding a lock never waits on the disk for a delete. A
        crash before the flush may bring the deleted page back at the next scan: whole and
        verified, never damaged. Raises Unavailable before the pending scan. Works on a
        corrupt page too.
        """
        _check_key(key)
        with self._lock:
            self._require_open()
            self._require_scanned()
            size = self._sizes.get(key)
            if size is None:
                return 0
            del self._sizes[key]
            self._used -= size
            seg, _, length = self._where.pop(key)
            self._tombstones[key] = seg
            self._files.release(seg, length)
        return size

    def flush_deletes(self) -> int:
        """Write the queued tombstones of deleted pages (one WriteBatch); how many. Raises
        Unavailable when RocksDB fails (they stay queued)."""
        with self._io_lock:
            with self._lock:
                if not self._tombstones:
                    return 0
                h = self._require_open()
                keys = list(self._tombstones)
            self._delete_keys(h, keys)  # no write can run meanwhile (it would re-put a key)
            with self._lock:
                for key in keys:
                    self._tombstones.pop(key, None)
        return len(keys)

    def compact_step(self, max_bytes: int = 8 << 20) -> int:
        """One bounded step of segment compaction: move at most `max_bytes` of live payloads
        out of the sparsest segment file less than half live (the last move deletes the file).
        Mutates; the mover calls it each pass, never under the store lock. Returns the bytes
        moved (0: nothing to do). A failure leaves the pages where they were."""
        with self._io_lock:
            with self._lock:
                h = self._require_open()
                if not self._scanned:
                    return 0
            return self._compact_some(h, max_bytes)

    def scan(self) -> ScanResult:
        """Rebuild the accounting from the stored headers and return the valid ones; mutates.

        Reads the headers column family only, never a payload. An entry whose header fails to
        decode or verify, whose header names another key, or whose payload is definitely absent
        (RocksDB `key_may_exist`, no I/O) is deleted and counted in `dropped`. A payload that is
        damaged, or missing in a way `key_may_exist` cannot tell, is caught later by `read`.
        When RocksDB reports damage in the headers' files, the valid headers are salvaged into a
        fresh column family (kvstore/tiers/rocks.py), so the neighbours of a bad entry survive
        and later compactions do not fail. Raises Unavailable after close or when RocksDB fails.
        """
        with self._io_lock, self._lock:  # at start-up: nothing else runs yet
            h = self._require_open()
            entries, damaged, complete = self._read_headers(h)
            headers: list[PageHeader] = []
            sizes: dict[bytes, int] = {}
            where: dict[bytes, tuple[int, int, int]] = {}
            keep: list[tuple[bytes, bytes]] = []
            bad: list[bytes] = []
            for key, value in entries:
                try:
                    header = PageHeader.decode(value)
                    if header.key != key:
                        raise Corrupt("header names another key")
                    raw_where = self._get(h.payloads, key, "payload location read")
                    if raw_where is None:
                        raise Corrupt("payload is missing")
                    seg, offset, length = _location(raw_where)
                    if length != header.payload_bytes or not self._files.adopt(seg, offset, length):
                        raise Corrupt("payload location does not fit its segment file")
                except Corrupt as exc:
                    log.debug("ssd tier: dropping page %s: %s", key.hex(), exc)
                    bad.append(key)
                    continue
                headers.append(header)
                sizes[key] = header.total_bytes
                where[key] = (seg, offset, length)
                keep.append((key, value))
            if damaged:
                self._handles = salvage_headers(h, keep, bad, self._write_opts)
            elif bad:
                self._delete_keys(h, bad)
            recorded, error = read_namespaces(h)
            if error is not None:
                log.warning("ssd tier: reading the scopes' namespaces stopped early: %s", error)
            digests = {header.scope_digest for header in headers}
            named = {d: ns for d, ns in recorded.items() if d in digests}
            gone = [d for d in recorded if d not in digests]
            if gone and error is None:  # scopes none of whose pages is left
                delete_namespaces(h, gone, self._write_opts)
            self._named = named
            self._sizes = sizes
            self._where = where
            self._used = sum(sizes.values())
            self._scanned = True
            emptied = self._files.drop_empty()
        if bad:
            log.warning("ssd tier: dropped %d corrupt pages from %s", len(bad), self._path)
        log.info(
            "ssd tier: %d pages, %d bytes after scan (%d empty segment files removed)",
            len(headers),
            self._used,
            emptied,
        )
        return ScanResult(headers=headers, dropped=len(bad), complete=complete, namespaces=named)

    # ---- lifecycle -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Sync the payload segment, flush memtables to SST files and sync the WAL; raises
        Unavailable on failure."""
        h = self._require_open()
        self.flush_deletes()
        with self._io_lock:
            self._files.sync()
        try:
            h.headers.flush()
            h.payloads.flush()
            h.db.flush_wal(True)
        except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
            raise rocks_error("flush", exc) from exc

    def close(self) -> None:
        """Flush and close the database, releasing its LOCK; idempotent. Later calls raise Unavailable."""
        with contextlib.suppress(Unavailable):
            self.flush_deletes()
        with self._io_lock, self._lock:
            h, self._handles = self._handles, None
            if h is not None:
                with contextlib.suppress(Unavailable):
                    self._files.sync()
                self._files.close()
        if h is None:
            return
        try:
            h.headers.flush()
            h.payloads.flush()
        except Exception as exc:  # a failed flush loses nothing: the WAL still holds the writes
            log.warning("ssd tier: flush at close failed: %s", exc)
        db = h.db
        del h  # column-family objects and handles keep RocksDB open: drop them before closing
        try:
            db.close()
        except Exception as exc:
            log.warning("ssd tier: close failed: %s", exc)
        log.info("ssd tier: %s closed", self._path)

    def __enter__(self) -> SsdTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers -------------------------------------------------------------------------------

    def _require_open(self) -> RocksHandles:
        h = self._handles
        if h is None:
            raise Unavailable(f"ssd tier at {self._path} is closed")
        return h

    def _require_scanned(self) -> None:
        if not self._scanned:
            raise Unavailable(
                f"ssd tier at {self._path} holds pages from a previous run: scan() first"
            )

    def _get(
        self, cf: Rdict, key: bytes, what: str, opts: ReadOptions | None = None
    ) -> bytes | None:
        try:
            value = cf.get(key, None, opts or self._read_opts)
        except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
            raise rocks_error(what, exc, reading=True) from exc
        assert value is None or isinstance(value, bytes)
        return value

    def _compact_some(self, h: RocksHandles, max_bytes: int) -> int:
        """Move up to `max_bytes` of the live payloads of the sparsest segment less than half
        live into the current segment (one WriteBatch of new locations). The I/O lock held, the
        accounting lock only to plan and to apply (a page deleted meanwhile stays deleted)."""
        with self._lock:
            seg = self._files.sparse()
            if seg is None:
                return 0
            moving: list[tuple[bytes, tuple[int, int, int]]] = []
            planned = 0
            for key, where in self._where.items():
                if where[0] == seg:
                    moving.append((key, where))
                    planned += where[2]
                    if planned >= max_bytes:
                        break
        if not moving:
            return 0
        batch = WriteBatch(raw_mode=True)
        moved: list[tuple[bytes, tuple[int, int, int], tuple[int, int, int]]] = []
        try:
            for key, old in moving:
                _, offset, length = old
                payload = self._files.read(seg, offset, length)
                new_seg, new_offset = self._files.append(memoryview(payload))
                batch.put(key, LOCATION.pack(new_seg, new_offset, length), h.payloads_cf)
                moved.append((key, old, (new_seg, new_offset, length)))
            if self._sync:
                self._files.sync()
            h.db.write(batch, self._write_opts)
        except Exception as exc:  # the copies are garbage; the old places stay valid
            with self._lock:
                for _, _, (new_seg, _, length) in moved:
                    self._files.release(new_seg, length)
            log.warning("ssd tier: compaction step stopped: %s", exc)
            return 0
        with self._lock:
            for key, old, new in moved:
                if self._where.get(key) == old:
                    self._where[key] = new
                    self._files.release(seg, old[2])  # the last one deletes the old file
                else:  # deleted meanwhile: its tombstone (queued) covers the new record too
                    self._files.release(new[0], new[2])
        log.debug("ssd tier: compaction moved %d pages out of segment %d", len(moved), seg)
        return sum(new[2] for _, _, new in moved)

    def _delete_keys(self, h: RocksHandles, keys: list[bytes]) -> None:
        batch = WriteBatch(raw_mode=True)
        for key in keys:
            batch.delete(key, h.headers_cf)
            batch.delete(key, h.payloads_cf)
        try:
            h.db.write(batch, self._write_opts)
        except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
            raise rocks_error("delete", exc) from exc

    def _read_headers(self, h: RocksHandles) -> tuple[list[tuple[bytes, bytes]], bool, bool]:
        """(entries, damaged, complete): RocksDB-verified if possible, else raw.

        A clean pass checks RocksDB's block checksums and is the only pass. After an error, a
        second pass without them reads every entry it can, and our own header checks judge each
        one. `complete` is False when even that pass could not reach the end.
        """
        entries, error = iterate_headers(h, verify=True)
        if error is None:
            return entries, False, True
        log.error("ssd tier: damaged headers in %s: %s", self._path, error)
        entries, error = iterate_headers(h, verify=False)
        if error is not None:
            log.error("ssd tier: headers beyond the damage in %s are lost: %s", self._path, error)
        return entries, True, error is None

    def __repr__(self) -> str:
        return (
            f"SsdTier(path={str(self._path)!r}, capacity_bytes={self._capacity}, "
            f"used_bytes={self._used}, pages={len(self._sizes)}, "
            f"segment_bytes={self._files.disk_bytes})"
        )
