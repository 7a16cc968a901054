"""Request checks of the store clients: everything a call validates and builds before any I/O.

Pure: no I/O. Each check raises InvalidArgument naming the offending argument, so a bad call
fails before a byte leaves the process.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from client.contract.errors import InvalidArgument, StrataError, Unavailable
from client.contract.scope import KEY_BYTES, Scope
from client.contract.types import IoClass, NodeInfo, Page, Tier, WritableBuffer
from kvstore_pb import API_VERSION
from kvstore_pb import store_pb2 as pb


def malformed(what: str) -> StrataError:
    """The error for a reply that breaks the wire contract (a daemon bug, never retried)."""
    return StrataError(f"malformed reply from the store: {what}")


def packed_keys(keys: Sequence[bytes]) -> bytes:
    """Keys packed for the wire; InvalidArgument unless each is `bytes` of KEY_BYTES."""
    n = len(keys)  # (counted in lists: half the cost of two sets on a 512-key chain)
    if list(map(type, keys)).count(bytes) != n or list(map(len, keys)).count(KEY_BYTES) != n:
        bad = next(k for k in keys if not isinstance(k, bytes) or len(k) != KEY_BYTES)
        raise InvalidArgument(f"page keys are {KEY_BYTES}-byte bytes, got {bad!r:.60}")
    return b"".join(keys)


def byte_view(buf: object, what: str, *, writable: bool) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer; InvalidArgument if it is not one."""
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{what} is not a buffer: {type(buf).__name__}") from None
    if writable and view.readonly:
        raise InvalidArgument(f"{what} is read-only")
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} is not C-contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def destination_views(
    scope: Scope, keys: Sequence[bytes], into: Sequence[WritableBuffer]
) -> list[memoryview]:
    """Writable byte views of `into`, one per key, each big enough for a page of `scope`."""
    if len(into) != len(keys):
        raise InvalidArgument(f"{len(keys)} keys but {len(into)} destination buffers")
    need = scope.page_payload_bytes
    views: list[memoryview] = []
    for i, buf in enumerate(into):
        view = byte_view(buf, f"into[{i}]", writable=True)
        if view.nbytes < need:
            raise InvalidArgument(f"into[{i}] holds {view.nbytes} bytes; a page needs {need}")
        views.append(view)
    return views


def payload_views(scope: Scope, pages: Sequence[Page]) -> list[memoryview]:
    """Byte views of the payloads of `pages`, after checking each page belongs to `scope`."""
    views: list[memoryview] = []
    for i, page in enumerate(pages):
        page.header.validate_for(scope)
        view = byte_view(page.payload, f"pages[{i}].payload", writable=False)
        if view.nbytes != page.header.payload_bytes:
            raise InvalidArgument(
                f"pages[{i}] payload is {view.nbytes} bytes; its header says "
                f"{page.header.payload_bytes}"
            )
        views.append(view)
    return views


def batch_ranges(count: int, limit: int) -> list[range]:
    """Split `count` items into calls of at most `limit` (0 = no limit)."""
    step = limit if limit > 0 else max(count, 1)
    return [range(start, min(start + step, count)) for start in range(0, count, step)]


# Same-host puts and gets of at least this many pages and bytes go as parts in flight at once:
# below it the daemon's work per page outweighs the copy that would overlap it (measured on the
# 2-core development machine, interleaved against one daemon: 64 x 64 KiB puts 2.07 ms whole,
# 2.89 ms in parts; 16 x 1 MiB level; 32 x 1 MiB 2.60 against 2.46 ms).
PIPELINE_MIN_PAGES = 16
PIPELINE_MIN_BYTES = 16 << 20


def pipelines(count: int, page_bytes: int) -> bool:
    """Whether a same-host batch of `count` pages of `page_bytes` goes as parts in flight."""
    return count >= PIPELINE_MIN_PAGES and count * page_bytes >= PIPELINE_MIN_BYTES


def pipeline_bounds(count: int, *, small_last: bool) -> list[int]:
    """Where a same-host batch of `count` pages (at least `PIPELINE_MIN_PAGES`) is cut into
    parts in flight at once: the first part a thirty-second (at least a page), so its reply
    comes back soonest and the copy starts early. A get (every Acquire sent at once) grows by
    three times (1/32, 3/32, the rest): each part's lease is granted while the one before it is
    copied. A put (`small_last`: its last Commit is waited for) ends with as small a part and
    halves the middle, so neither the first reservation nor the last commit is waited for
    long. (Measured interleaved, 64 x 1 MiB: ends of a sixteenth were 4-6% slower.)"""
    if count < PIPELINE_MIN_PAGES:
        raise ValueError(f"a pipelined batch has at least {PIPELINE_MIN_PAGES} pages, got {count}")
    end = max(1, count // 32)
    if small_last:
        middle = count - 2 * end
        return [0, end, end + middle // 2, count - end, count]
    return [0, end, 4 * end, count]


def io_class_value(io_class: IoClass) -> pb.IoClass.ValueType:
    return pb.IoClass.ValueType(int(io_class))


def tier_value(tier: Tier | None) -> pb.Tier.ValueType:
    return pb.Tier.ValueType(0 if tier is None else int(tier))


@functools.lru_cache(maxsize=256)
def scope_bytes(scope: Scope) -> bytes:
    """`scope.encode()`, remembered: every read carries its scope's canonical encoding."""
    return scope.encode()


def check_node(node: NodeInfo) -> None:
    """Refuse a daemon that speaks another wire version than this client."""
    if node.api_version != API_VERSION:
        raise Unavailable(
            f"store {node.node_id!r} speaks API version {node.api_version}; this client speaks "
            f"{API_VERSION}"
        )
