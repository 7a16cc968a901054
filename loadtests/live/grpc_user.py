"""The store under load through the blocking SDK, every gRPC call reported (method, bytes, time).

`ReportingInterceptor(report)` wraps every kind of gRPC call (unary and streaming, both ways) and
calls `report(method, seconds, request_bytes, response_bytes, error)` when the call completes:
for a response stream, when it is exhausted. `instrumented_client(address, report)` makes a
`client.StoreClient` whose channel carries the interceptor (the SDK opens its own channel, so the
channel factory is swapped for the duration of `connect()` only). Pages that move over shared
memory or the bulk data path do not cross gRPC; their calls' control messages are what is
reported, and `StoreLoad` times the SDK operations themselves too.

`StoreLoad` is what a locust user runs for each workload request: look the prompt's page keys
up, put the missing full pages (zero payloads of the scope's page size), get the hit ones;
`strata loadtest --store ADDR` runs it open loop under locust (runner.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from client import KVLayout, Scope, StoreClient, build_pages, page_keys, page_tokens
from loadtests.workload import Request, WorkloadSpec, request_token_ids

Report = Callable[[str, float, int, int, BaseException | None], None]


def _size(message: object) -> int:
    """Bytes of a message: protobuf messages by ByteSize, raw frames (the SDK's own codec for page
    payloads sends bytes-like messages) by length."""
    if isinstance(message, bytes | bytearray | memoryview):
        return len(message)
    byte_size = getattr(message, "ByteSize", None)
    return int(byte_size()) if callable(byte_size) else 0


class _CountingIterator:
    """A request stream that counts the bytes it hands to gRPC."""

    def __init__(self, it: Iterator[object]) -> None:
        self._it = it
        self.nbytes = 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> object:
        msg = next(self._it)
        self.nbytes += _size(msg)
        return msg


class _ReportingStream:
    """A response stream that reports the call when it ends; other attributes pass through."""

    def __init__(self, call: Any, done: Callable[[int, BaseException | None], None]) -> None:
        self._call = call
        self._done = done
        self._nbytes = 0
        self._reported = False

    def __iter__(self) -> _ReportingStream:
        return self

    def __next__(self) -> object:
        try:
            msg = next(self._call)
        except StopIteration:
            self._finish(None)
            raise
        except grpc.RpcError as exc:
            self._finish(exc)
            raise
        self._nbytes += _size(msg)
        return msg

    def _finish(self, error: BaseException | None) -> None:
        if not self._reported:
            self._reported = True
            self._done(self._nbytes, error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class ReportingInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, report: Report, clock: Callable[[], float] = time.perf_counter) -> None:
        self.report = report
        self.clock = clock

    def _unary_response(self, method: str, start: float, sent: int, call: Any) -> Any:
        try:
            result = call.result()
        except grpc.RpcError as exc:
            self.report(method, self.clock() - start, sent, 0, exc)
            raise
        self.report(method, self.clock() - start, sent, _size(result), None)
        return call

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        start = self.clock()
        return self._unary_response(
            details.method, start, _size(request), continuation(details, request)
        )

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        start = self.clock()
        counting = _CountingIterator(iter(request_iterator))
        call = continuation(details, counting)
        try:
            result = call.result()
        except grpc.RpcError as exc:
            self.report(details.method, self.clock() - start, counting.nbytes, 0, exc)
            raise
        self.report(details.method, self.clock() - start, counting.nbytes, _size(result), None)
        return call

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        start, sent = self.clock(), _size(request)
        call = continuation(details, request)
        return _ReportingStream(
            call, lambda n, err: self.report(details.method, self.clock() - start, sent, n, err)
        )

    def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        start = self.clock()
        counting = _CountingIterator(iter(request_iterator))
        call = continuation(details, counting)
        return _ReportingStream(
            call,
            lambda n, err: self.report(
                details.method, self.clock() - start, counting.nbytes, n, err
            ),
        )


def instrumented_client(address: str, report: Report, **options: Any) -> StoreClient:
    """A connected StoreClient whose gRPC channel reports every call to `report`."""
    client = StoreClient(address, **options)
    real = grpc.insecure_channel

    def intercepted(
        target: str, options: Sequence[tuple[str, Any]] | None = None, compression: Any = None
    ) -> grpc.Channel:
        return grpc.intercept_channel(
            real(target, options=options, compression=compression), ReportingInterceptor(report)
        )

    grpc.insecure_channel = intercepted  # type: ignore[assignment]
    try:
        client.connect()
    finally:
        grpc.insecure_channel = real  # type: ignore[assignment]
    return client


def load_scope(spec: WorkloadSpec, page_tokens: int = 16) -> Scope:
    """A small scope for store load (2 layers, 2 KV heads, head dim 64: 16 KiB float16 pages)."""
    return Scope(
        model_id=f"loadtest/{spec.name}",
        weights_revision="loadtest",
        tokenizer_fingerprint="loadtest",
        kv_dtype="float16",
        layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=page_tokens),
    )


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    pages: int
    hit_pages: int
    put_pages: int


class StoreLoad:
    """The store's share of serving one request, as an engine does it (lookup, put, get)."""

    def __init__(self, client: StoreClient, spec: WorkloadSpec, scope: Scope) -> None:
        self.client = client
        self.spec = spec
        self.scope = scope
        self.page_bytes = scope.layout.payload_bytes(scope.kv_dtype)

    def serve(self, request: Request) -> StoreOutcome:
        ids = request_token_ids(request, self.spec.model)
        keys = page_keys(self.scope, ids)
        if not keys:
            return StoreOutcome(0, 0, 0)
        hit = self.client.lookup(self.scope, keys).hit_count
        if hit:
            self.client.get(
                self.scope,
                keys[:hit],
                [bytearray(self.page_bytes) for _ in range(hit)],
                tokens=page_tokens(self.scope, ids)[:hit],
            )
        missing = len(keys) - hit
        if missing:
            payloads = [bytes(self.page_bytes)] * missing
            self.client.put(self.scope, build_pages(self.scope, ids, payloads, first_page=hit))
        return StoreOutcome(len(keys), hit, missing)
