"""The gRPC side of the store clients' wire: status codes to typed errors, the caller's token
on every call, channel options, and the C allocator's tuning for bulk gRPC traffic.

What is pure (request checks, proto <-> `client.contract.types` conversions, retries, the
hand-built Put and Get messages and the Get stream's reassembly) lives in client/core/; it is
re-exported here under its old names for the daemon and tests that import it from here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar, cast

import grpc

from client.contract.errors import (
    CapacityExhausted,
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    LeaseExpired,
    PermissionDenied,
    StrataError,
    Unauthenticated,
    Unavailable,
)
from client.core.assembler import GetAssembler
from client.core.frames import (
    DEFAULT_CHUNK_BYTES,
    GET_METHOD,
    PUT_METHOD,
    TAG_GET_CHUNK,
    TAG_GET_MISSING,
    TAG_PUT_CHUNK,
    ChunkView,
    chunk_bytes_for,
    chunk_message,
    chunk_message_prefix,
    decode_chunk_message,
    put_messages,
    put_requests,
    varint,
)
from client.core.replies import (
    event_from_proto,
    lookup_from_proto,
    node_info_from_proto,
    optional_tier,
    put_statuses_from_proto,
    stats_from_proto,
    tier_of,
)
from client.core.requests import (
    batch_ranges,
    byte_view,
    check_node,
    destination_views,
    io_class_value,
    malformed,
    packed_keys,
    payload_views,
    scope_bytes,
    tier_value,
)
from client.core.retry import (
    DEFAULT_RETRY_AFTER_S,
    IDEMPOTENT_METHODS,
    RETRY_AFTER_KEY,
    RETRY_AFTER_S_KEY,
    Deadline,
    RetryPolicy,
    retry_after_s,
)
from kvstore_pb import store_pb2 as pb

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_RETRY_AFTER_S",
    "GET_METHOD",
    "IDEMPOTENT_METHODS",
    "PUT_METHOD",
    "RETRY_AFTER_KEY",
    "RETRY_AFTER_S_KEY",
    "STORE_METHODS",
    "TAG_GET_CHUNK",
    "TAG_GET_MISSING",
    "TAG_PUT_CHUNK",
    "WATCH_TIMEOUT_S",
    "ChunkView",
    "Deadline",
    "GetAssembler",
    "RetryPolicy",
    "TokenStub",
    "auth_metadata",
    "batch_ranges",
    "byte_view",
    "channel_options",
    "check_node",
    "chunk_bytes_for",
    "chunk_message",
    "chunk_message_prefix",
    "decode_chunk_message",
    "destination_views",
    "error_from_status",
    "event_from_proto",
    "io_class_value",
    "lookup_from_proto",
    "malformed",
    "map_rpc_error",
    "node_info_from_proto",
    "optional_tier",
    "packed_keys",
    "payload_views",
    "put_messages",
    "put_requests",
    "put_statuses_from_proto",
    "raw_bytes",
    "resolve_token",
    "retry_after_s",
    "scope_bytes",
    "stats_from_proto",
    "tier_of",
    "tier_value",
    "tune_malloc",
    "typed_error",
    "varint",
    "with_token",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 72 << 20
WATCH_TIMEOUT_S = 3600.0  # the default deadline of `watch` (a stream holds a daemon thread)


# ---- gRPC status -> typed error ----------------------------------------------------------


def error_from_status(
    code: grpc.StatusCode,
    details: str,
    trailing: Iterable[tuple[str, str | bytes]] | None = None,
) -> StrataError:
    """The typed error for a gRPC status (the SDK's one mapping, inverse of the service's)."""
    name = getattr(code, "name", str(code))
    message = f"{details or 'no details'} ({name})"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityExhausted(message, retry_after_s=retry_after_s(trailing))
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return LeaseExpired(message)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return Unavailable(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if code == grpc.StatusCode.DATA_LOSS:
        return Corrupt(message)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(message)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(message)
    return StrataError(message)


def map_rpc_error(exc: BaseException) -> StrataError:
    """The typed error for an exception raised by a grpc (sync or aio) call."""
    if isinstance(exc, StrataError):
        return exc
    code_fn = getattr(exc, "code", None)
    if not callable(code_fn):
        return Unavailable(f"gRPC failure without a status: {exc!r}")
    details_fn = getattr(exc, "details", None)
    trailing_fn = getattr(exc, "trailing_metadata", None)
    details = details_fn() if callable(details_fn) else ""
    trailing = trailing_fn() if callable(trailing_fn) else None
    return error_from_status(code_fn(), str(details or ""), _pairs(trailing))


def typed_error(exc: BaseException) -> BaseException:
    """What a client shell throws into a plan for a step that failed: a gRPC failure as its
    typed error (with the gRPC error as its cause), anything else as it is."""
    if isinstance(exc, grpc.RpcError) and not isinstance(exc, StrataError):
        error = map_rpc_error(exc)
        error.__cause__ = exc
        return error
    return exc


def _pairs(metadata: object) -> list[tuple[str, str | bytes]]:
    pairs: list[tuple[str, str | bytes]] = []
    if not isinstance(metadata, Iterable):
        return pairs
    for item in metadata:
        key = getattr(item, "key", None)
        value = getattr(item, "value", None)
        if key is None and isinstance(item, tuple) and len(item) == 2:
            key, value = item
        if isinstance(key, str) and isinstance(value, str | bytes):
            pairs.append((key, value))
    return pairs


# ---- the caller's token --------------------------------------------------------------------

TOKEN_ENV = "STRATA_STORE_TOKEN"
AUTHORIZATION = "authorization"


def resolve_token(token: str | None) -> str | None:
    """The token a client sends: `token`; None: $STRATA_STORE_TOKEN if set; "" or unset: none
    (an open daemon needs none). InvalidArgument for one that cannot travel in a header."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if not token:
        return None
    if token != token.strip() or not token.isprintable() or not token.isascii():
        raise InvalidArgument("a store token must be non-empty printable ASCII without spaces")
    return token


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata that carries `token` on a gRPC call (`authorization: Bearer ...`)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else None


class _TokenMethod:
    """One method of a generated stub, sending the token metadata on every call."""

    __slots__ = ("_metadata", "_method")

    def __init__(self, method: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._method = method
        self._metadata = metadata

    def __call__(self, request: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._method(request, timeout=timeout, metadata=self._metadata, **kwargs)

    def future(self, request: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._method.future(request, timeout=timeout, metadata=self._metadata, **kwargs)

    def with_call(self, request: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._method.with_call(request, timeout=timeout, metadata=self._metadata, **kwargs)


class TokenStub:
    """A generated Store stub (blocking or asyncio) whose every method sends `authorization:
    Bearer <token>`. (Binding the metadata per call costs about a microsecond; a channel
    interceptor doing the same measured about 30 µs a call.)"""

    def __init__(self, stub: object, metadata: tuple[tuple[str, str], ...]) -> None:
        for name in STORE_METHODS:
            setattr(self, name, _TokenMethod(getattr(stub, name), metadata))


STORE_METHODS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["Store"].methods)
_S = TypeVar("_S")


def with_token(stub: _S, token: str | None) -> _S:
    """`stub`, sending `token` on every call (unchanged when there is none). Raw calls made on
    the channel itself (the hand-encoded Put and Get) pass `auth_metadata(token)` themselves."""
    metadata = auth_metadata(token)
    if metadata is None:
        return stub
    return cast(_S, TokenStub(stub, metadata))


# ---- channel options ---------------------------------------------------------------------


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options of every channel a client opens."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # The clients retry idempotent calls themselves; gRPC's own retries would multiply them.
        ("grpc.enable_retries", 0),
    ]


# ---- the C allocator under bulk gRPC traffic ---------------------------------------------

# glibc malloc serves requests above M_MMAP_THRESHOLD with fresh mappings and hands free memory
# at the top of a heap back to the kernel above M_TRIM_THRESHOLD. Both start small (128 KiB,
# adapting upwards only as far as the largest mapping freed so far), so a stream of MiB-sized
# messages maps, zero-fills and unmaps its buffers again and again: gRPC's receive path spent
# more time in page faults than in copying. Raised, freed buffers are reused instead, at the cost
# of keeping up to M_TRIM_THRESHOLD of free memory per heap.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its adaptive threshold
_TRIM_THRESHOLD_BYTES = 64 << 20
TUNE_MALLOC_ENV = "STRATA_TUNE_MALLOC"  # "0" leaves the allocator alone
_malloc_tuned = False


def tune_malloc() -> None:
    """Raise glibc's mmap and trim thresholds for this process, once (see above). Called by the
    gRPC data paths of the clients and the daemon; a no-op off glibc or with STRATA_TUNE_MALLOC=0.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    if os.environ.get(TUNE_MALLOC_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) and mallopt(
        _M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES
    )
    log.debug("malloc thresholds raised: %s", bool(ok))


def raw_bytes(message: bytes) -> bytes:
    """Identity (de)serializer: the message is already protobuf bytes."""
    return message
