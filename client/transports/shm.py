"""The same-host data path (DESIGN §6): the daemon's shared-memory segments, mapped by the client.

A `SegmentMap` maps one segment file `/dev/shm/<name>` read-write (with os.open + mmap, never
multiprocessing.shared_memory, whose resource tracker would unlink the daemon's segment when this
process exits). A put copies each payload into the slot the daemon reserved for it; a get copies
each leased page out of its slot into the caller's buffer: one memcpy per page, no intermediate
bytes objects.

A daemon that restarts creates a new segment file; `SegmentMap.is_current()` tells whether the
file under the name is still the one mapped, so a client never copies through a stale map.

The read fence (a seqlock): after the slots, the segment holds a table of slot generations (one
counter per granule; the daemon advances a slot's counter whenever it frees the slot). The
Acquire reply names each slot's generation as the daemon read it with the page pinned (the read
before the copy); the get copies the page out, then reads the counter again: any other value
means the slot was freed meanwhile (this process stalled past its lease) and perhaps reused, so
the copy may hold another page's bytes: the page is a miss. Writers need no check here: the
daemon quarantines an expired reservation's slots until this process is done with them
(kvstore/fence.py).

Integrity on this path (DESIGN §6): the bytes of a same-host get are copied from the daemon's
DRAM, where nothing between two processes of one host can damage them, so a get does not hash
them: every get is fenced by the slot generation and its header checked byte for byte (checksum,
scope, layout, key chain, key asked for; the caller's token ids in `match_tokens`), whatever
`verify` says. Payload checksums are checked where bytes can be damaged: the daemon verifies a
page read from SSD or received over the network before it enters DRAM, and a same-host put
whose writer sent a checksum before any reader gets it. A same-host put sends none
(`reserve_headers`): the daemon computes it off the writer's path, before the page leaves DRAM.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from collections.abc import Sequence

from client.contract.errors import Corrupt, InvalidArgument, Unavailable
from client.contract.page import PageHeader, quick_check
from client.contract.scope import Scope
from client.contract.types import NodeInfo, Page, PutStatus, Segment
from client.transports._wire import malformed
from client.transports.hostid import host_id
from kvstore_pb import store_pb2 as pb

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


class SegmentMap:
    """One daemon segment mapped read-write into this process. Close it when done."""

    __slots__ = ("_gens", "_granule", "_identity", "_mmap", "_view", "path", "segment")

    def __init__(self, segment: Segment, path: str, mapped: mmap.mmap, identity: tuple[int, int]):
        self.segment = segment
        self.path = path
        self._mmap: mmap.mmap | None = mapped
        self._view: memoryview | None = memoryview(mapped)
        self._identity = identity
        self._gens: memoryview | None = None
        self._granule = segment.generation_granule_bytes
        start = segment.generations_offset
        if start and self._granule > 0 and start % 8 == 0 and start < segment.size_bytes:
            count = (segment.size_bytes - start) // 8
            self._gens = self._view[start : start + count * 8].cast("Q")

    def generation(self, offset: int) -> int | None:
        """The daemon's generation counter of the slot at `offset`, or None when the segment has
        no generation table (an older daemon) or the offset is outside it."""
        gens = self._gens
        if gens is None:
            return None
        i = offset // self._granule
        return int(gens[i]) if 0 <= i < len(gens) else None

    @property
    def size_bytes(self) -> int:
        return self.segment.size_bytes

    @property
    def closed(self) -> bool:
        return self._view is None

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of `length` bytes at `offset`; InvalidArgument if out of bounds."""
        if self._view is None:
            raise InvalidArgument(f"segment {self.segment.name} is closed")
        if offset < 0 or length < 0 or offset + length > self.segment.size_bytes:
            raise InvalidArgument(
                f"range {offset}+{length} is outside segment {self.segment.name} "
                f"of {self.segment.size_bytes} bytes"
            )
        return self._view[offset : offset + length]

    def is_current(self) -> bool:
        """True while the file under the segment's name is still the one this maps."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def close(self) -> None:
        """Unmap. Idempotent. Views handed out earlier keep the memory alive until released."""
        view, mapped, gens = self._view, self._mmap, self._gens
        self._view = self._mmap = self._gens = None
        if gens is not None:
            gens.release()
        if view is not None:
            view.release()
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:
                # A caller still holds a view; the mapping goes when the last view does.
                log.debug("segment %s: views still exported at close", self.segment.name)

    def __enter__(self) -> SegmentMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def segment_path(name: str) -> str:
    """The file of a POSIX shared-memory name; InvalidArgument for a name that is not one."""
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or bare in (".", "..") or "\0" in bare:
        raise InvalidArgument(f"not a shared-memory name: {name!r}")
    return os.path.join(SHM_DIR, bare)


def open_segment(segment: Segment, fd: int | None = None) -> SegmentMap:
    """Map `segment` (opened by name, or the descriptor `fd` the daemon handed over, which this
    takes and closes); raises Unavailable saying why it cannot be (missing, wrong size, denied)."""
    try:
        path = segment_path(segment.name)
        if segment.size_bytes <= 0:
            raise Unavailable(f"segment {segment.name} announces {segment.size_bytes} bytes")
    except (InvalidArgument, Unavailable) as exc:
        if fd is not None:
            os.close(fd)
        raise Unavailable(str(exc)) from None
    if fd is None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise Unavailable(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unavailable(f"{path} is not a regular file")
        if st.st_size != segment.size_bytes:
            raise Unavailable(
                f"{path} is {st.st_size} bytes; the daemon announced {segment.size_bytes}"
            )
        try:
            # populated: map every page now, so no later copy pays for page faults
            mapped = mmap.mmap(
                fd,
                segment.size_bytes,
                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as exc:
            raise Unavailable(f"cannot map {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return SegmentMap(segment, path, mapped, (st.st_dev, st.st_ino))


def try_map(segment: Segment) -> SegmentMap | None:
    """Map `segment`, or None when it is missing, of the wrong size or not accessible."""
    try:
        return open_segment(segment)
    except Unavailable as exc:
        log.info("shared memory unavailable: %s", exc)
        return None


def map_node_segments(node: NodeInfo, wanted: bool | None) -> tuple[SegmentMap, ...]:
    """The maps of every segment of `node` when the same-host path is wanted and possible.

    `wanted` False: none. None (auto): the maps when the daemon runs on this host and all its
    segments map, else none. True: the maps, or Unavailable saying why they cannot be had.
    """
    if wanted is False:
        return ()
    reason = ""
    maps: list[SegmentMap] = []
    if node.host_id != host_id():
        reason = f"the daemon runs on another host (host id {node.host_id!r} != {host_id()!r})"
    elif not node.segments:
        # a daemon with auth shows its segment only to principals trusted with it
        reason = "the daemon offers this client no shared-memory segment"
    else:
        for segment in node.segments:
            try:
                maps.append(open_segment(segment))
            except Unavailable as exc:
                reason = str(exc)
                for m in maps:
                    m.close()
                maps = []
                break
    if reason:
        if wanted:
            raise Unavailable(f"shared memory was requested but cannot be used: {reason}")
        log.info("using the gRPC data path: %s", reason)
    return tuple(maps)


def map_handed_segments(node: NodeInfo, fds: Sequence[int]) -> tuple[SegmentMap, ...]:
    """The maps of `node`'s segments from the descriptors its lane handed over (one per
    segment, in order; all taken and closed here), or () when they do not fit (logged)."""
    if len(fds) != len(node.segments) or node.host_id != host_id():
        for fd in fds:
            os.close(fd)
        return ()
    maps: list[SegmentMap] = []
    try:
        for segment, fd in zip(node.segments, fds, strict=True):
            maps.append(open_segment(segment, fd))
    except Unavailable as exc:
        log.info("the handed-over segment does not map: %s", exc)
        for m in maps:
            m.close()
        for fd in fds[len(maps) + 1 :]:
            os.close(fd)
        return ()
    return tuple(maps)


def segments_current(maps: Sequence[SegmentMap]) -> bool:
    """True while every mapped segment is still the daemon's (it has not restarted)."""
    return all(m.is_current() for m in maps)


def _map_of(maps: Sequence[SegmentMap], index: int) -> SegmentMap | None:
    return maps[index] if index < len(maps) else None


def reserve_headers(pages: Sequence[Page]) -> list[bytes]:
    """The header bytes of a same-host Reserve: each page's `encode_for_same_host()`, so a page
    whose payload checksum is still pending goes with the checksum left to the daemon, and the
    writer never hashes its payloads (client/contract/page.py)."""
    return [p.header.encode_for_same_host() for p in pages]


def write_reserved(
    reply: pb.ReserveResponse, maps: Sequence[SegmentMap], payloads: Sequence[memoryview]
) -> tuple[PutStatus, ...]:
    """Copy each payload into its reserved slot; a slot not reserved is ALREADY_PRESENT.

    Raises a malformed-reply StrataError when the reply does not fit the request (slot count,
    length, segment, bounds, or a reservation without a lease); the caller then releases.
    """
    if len(reply.slots) != len(payloads):
        raise malformed(f"reserve of {len(payloads)} pages answered {len(reply.slots)} slots")
    statuses: list[PutStatus] = []
    for i, (slot, payload) in enumerate(zip(reply.slots, payloads, strict=True)):
        if not slot.reserved:
            statuses.append(PutStatus.PENDING if slot.pending else PutStatus.ALREADY_PRESENT)
            continue
        if reply.lease_id == 0:
            raise malformed("slots reserved without a lease")
        if slot.length != payload.nbytes:
            raise malformed(f"slot {i} is {slot.length} bytes for a {payload.nbytes}-byte payload")
        seg = _map_of(maps, slot.segment)
        if seg is None:
            raise malformed(f"slot {i} names segment {slot.segment} of {len(maps)}")
        try:
            dest = seg.view(slot.offset, slot.length)
        except InvalidArgument as exc:
            raise malformed(f"slot {i}: {exc}") from None
        dest[:] = payload
        statuses.append(PutStatus.STORED)
    return tuple(statuses)


def read_acquired(
    reply: pb.AcquireResponse,
    maps: Sequence[SegmentMap],
    scope: Scope,
    keys: Sequence[bytes],
    into: Sequence[memoryview],
    *,
    verify: bool = True,
) -> tuple[tuple[PageHeader | bytes | None, ...], int]:
    """Copy each acquired page out of its slot into `into[i]`; return (headers, dropped count).

    Each delivered page's header comes back as the header bytes, checked byte for byte (see
    `quick_check`: checksum, scope, layout, key chain) and against the key asked for, or as a
    PageHeader when only the full decode could accept it (GetResult decodes bytes on demand).
    A page whose header fails, names another key or scope, whose slot is not in a mapped segment
    or does not fit its buffer, or whose slot generation moved during the copy (the fence, see
    the module docstring), is a miss (None) and counted. `verify` asks for nothing more on this
    path: the payload is not hashed (the module docstring says why). Raises a malformed-reply
    StrataError only when the page count is wrong or pages are present without a lease.
    """
    del verify  # every same-host get is fenced and header-checked; none hashes its payload
    pages = reply.pages
    if len(pages) != len(keys):
        raise malformed(f"acquire of {len(keys)} keys answered {len(pages)} pages")
    if reply.lease_id == 0 and any(p.present for p in pages):
        raise malformed("pages acquired without a lease")
    headers: list[PageHeader | bytes | None] = []
    corrupt = 0
    size = scope.page_payload_bytes
    n_maps = len(maps)
    for i, page in enumerate(pages):
        if not page.present:
            headers.append(None)
            continue
        raw = page.header
        quick = quick_check(raw, scope)
        index = page.segment
        dest = into[i]
        if (
            quick is not None
            and quick[0] == keys[i]
            and page.length == size
            and size <= dest.nbytes
            and index < n_maps
        ):
            seg = maps[index]
            header: PageHeader | bytes | None
            try:
                source = seg.view(page.offset, size)
            except InvalidArgument as exc:
                header, why = None, str(exc)
            else:
                dest[:size] = source
                header, why = raw, ""
                if seg.generation(page.offset) not in (page.generation, None):
                    header, why = None, "the slot was freed during the copy (lease ran out)"
        else:  # the slow path names exactly what is wrong (or accepts what quick_check cannot)
            header, why = _copy_out(page, maps, scope.digest, keys[i], dest)
        if header is None:
            corrupt += 1
            log.debug("get: page %d dropped: %s", i, why)
        headers.append(header)
    return tuple(headers), corrupt


def _copy_out(
    page: pb.AcquiredPage,
    maps: Sequence[SegmentMap],
    scope_digest: bytes,
    key: bytes,
    dest: memoryview,
) -> tuple[PageHeader | None, str]:
    try:
        header = PageHeader.decode(page.header)
    except Corrupt as exc:
        return None, f"header: {exc}"
    if header.key != key or header.scope_digest != scope_digest:
        return None, "header names another key or scope"
    size = header.payload_bytes
    if page.length != size or size > dest.nbytes:
        return None, f"slot of {page.length} bytes, header {size}, buffer {dest.nbytes}"
    seg = _map_of(maps, page.segment)
    if seg is None:
        return None, f"segment {page.segment} is not mapped"
    try:
        source = seg.view(page.offset, size)
    except InvalidArgument as exc:
        return None, str(exc)
    dest[:size] = source
    if seg.generation(page.offset) not in (page.generation, None):
        return None, "the slot was freed during the copy (lease ran out)"
    return header, ""
