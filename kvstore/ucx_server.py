"""The daemon's end of the UCX bulk data path (framing in client/ucx_protocol.py).

A ucxx listener on the process's UCX loop (client/ucx_runtime.py). Each connected endpoint is served
one request at a time: a get acquires its pages, sends them straight from their DRAM slots and
releases them; a put reserves DRAM slots, receives each payload straight into its slot, verifies
every checksum (a network receive), then commits — or aborts and stores nothing. Typed errors go
back as ERROR frames; the connection stays usable. A client that disconnects mid-transfer only
ends its own connection: its leases are released or aborted, the daemon keeps serving.

`ucxx` is imported only by `start()`: a daemon without it serves gRPC alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError

from client.errors import Corrupt, InvalidArgument, StrataError, Unavailable
from client.page import PageHeader
from client.scope import KEY_BYTES, unpack_keys
from client.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    KIND_GET,
    KIND_MANIFEST,
    KIND_PUT,
    KIND_WANT,
    PREAMBLE,
    ManifestEntry,
    ProtocolError,
    decode_put,
    encode_error,
    encode_manifest,
    format_address,
    parse_preamble,
    preamble,
    settle,
)
from client.ucx_runtime import ucx_runtime
from kvstore.keys import IoClass, Tier, io_class_from_wire, tier_from_wire
from kvstore.store import Reservation, Store
from kvstore_pb import store_pb2

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0


class UcxServer:
    """Serves the UCX data path of `store` on `host`:`port` (0 = any free port).

    `start()` returns the address to advertise ("ucx://host:port") and raises Unavailable when
    ucxx cannot be imported or the listener cannot start; `stop()` closes every connection.
    """

    def __init__(self, store: Store, host: str, port: int = 0) -> None:
        self._store = store
        self._host = host
        self._port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Any = None
        self._endpoints: set[Any] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        limits = store.config.limits
        self._max_meta = limits.max_message_bytes
        self._reserve_ms = limits.max_lease_ttl_ms
        # a transfer must end well before its lease could run out under it
        self._put_timeout_s = limits.max_lease_ttl_ms / 2000
        self._get_timeout_s = limits.lease_ttl_ms / 2000
        self.address = ""

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        ucxx, loop = ucx_runtime()  # raises Unavailable without a usable ucxx

        async def listen() -> Any:
            return ucxx.create_listener(self._accept, port=self._port)

        try:
            self._listener = asyncio.run_coroutine_threadsafe(listen(), loop).result(
                _START_TIMEOUT_S
            )
        except Exception as exc:
            raise Unavailable(f"no UCX listener on port {self._port}: {exc}") from None
        self._loop = loop
        self.address = format_address(self._host, int(self._listener.port))
        log.info("UCX data path listening at %s", self.address)
        return self.address

    def stop(self) -> None:
        """Close the listener and every connection (their leases are released). The process's
        UCX loop itself lives on (client/ucx_runtime.py)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(_STOP_TIMEOUT_S * 2)
        except Exception as exc:
            log.warning("UCX listener did not close cleanly: %r", exc)

    async def _close(self) -> None:
        for ep in list(self._endpoints):
            with contextlib.suppress(Exception):
                ep.abort()
        if self._handlers:
            _, pending = await asyncio.wait(list(self._handlers), timeout=_STOP_TIMEOUT_S)
            for task in pending:
                task.cancel()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # ---- connections -------------------------------------------------------------------------

    async def _accept(self, ep: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._endpoints.add(ep)
        try:
            while True:
                head = bytearray(PREAMBLE.size)
                await ep.recv(head)
                frame = parse_preamble(head, self._max_meta)
                meta = bytearray(frame.meta_bytes)
                if frame.meta_bytes:
                    await ep.recv(meta)
                if frame.kind == KIND_GET:
                    await self._get(ep, meta)
                elif frame.kind == KIND_PUT:
                    await self._put(ep, frame.aux, meta)
                else:
                    raise ProtocolError(f"unexpected UCX frame kind {frame.kind}")
        except ProtocolError as exc:
            log.warning("UCX connection closed: %s", exc)
        except Exception as exc:  # the peer went away (ucxx raises its own error classes)
            log.debug("UCX connection ended: %r", exc)
        finally:
            self._endpoints.discard(ep)
            self._handlers.discard(task)
            with contextlib.suppress(Exception):
                ep.abort()

    async def _send_error(self, ep: Any, exc: BaseException) -> None:
        if not isinstance(exc, StrataError):
            log.exception("UCX request failed", exc_info=exc)
        code, meta = encode_error(exc)
        await ep.send(preamble(KIND_ERROR, code, len(meta)))
        await ep.send(meta)

    # ---- get -------------------------------------------------------------------------------

    async def _get(self, ep: Any, meta: bytearray) -> None:
        store = self._store
        try:
            try:
                request = store_pb2.GetRequest.FromString(bytes(meta))
            except DecodeError:
                raise InvalidArgument("malformed GetRequest") from None
            keys = unpack_keys(request.keys)
            if len(request.scope_digest) != KEY_BYTES:
                raise InvalidArgument(f"scope digest must be {KEY_BYTES} bytes")
            if len(keys) > store.config.limits.max_keys_per_call:
                raise InvalidArgument(
                    f"{len(keys)} keys in one get; the limit is {store.config.limits.max_keys_per_call}"
                )
            io = io_class_from_wire(request.io_class)
            acq = await asyncio.to_thread(store.acquire, request.scope_digest, keys, io)
        except StrataError as exc:
            await self._send_error(ep, exc)
            return
        try:
            dram = store.tiers.dram
            entries: list[ManifestEntry] = []
            views: list[memoryview] = []
            for page in acq.pages:
                if page is None:
                    entries.append(ManifestEntry(b"", 0))
                    continue
                entries.append(ManifestEntry(page.header, page.length))
                if page.length:
                    views.append(dram.view(page.offset, page.length))
            manifest = encode_manifest(entries)
            await ep.send(preamble(KIND_MANIFEST, len(entries), len(manifest)))
            await ep.send(manifest)
            total = sum(v.nbytes for v in views)
            admission = store.scheduler.admit(io, total)
            await asyncio.to_thread(admission.__enter__)
            try:
                await settle([ep.send(v) for v in views], self._get_timeout_s, ep)
            finally:
                admission.__exit__(None, None, None)
            store.counters.add_bytes("ucx", "out", io, total)
        finally:
            if acq.lease_id:
                await asyncio.to_thread(store.release, acq.lease_id)

    # ---- put -------------------------------------------------------------------------------

    async def _put(self, ep: Any, page_count: int, meta: bytearray) -> None:
        store = self._store
        limits = store.config.limits
        try:
            if page_count > limits.max_keys_per_call:
                raise InvalidArgument(
                    f"{page_count} pages in one put; the limit is {limits.max_keys_per_call}"
                )
            raw_begin, headers = decode_put(meta, page_count)
            try:
                begin = store_pb2.PutBegin.FromString(raw_begin)
            except DecodeError:
                raise InvalidArgument("malformed PutBegin") from None
            if begin.page_count != page_count:
                raise InvalidArgument(
                    f"PutBegin announces {begin.page_count} pages, sent {page_count}"
                )
            scope = store.scope_of(begin.scope)
            io = io_class_from_wire(begin.io_class)
            tier = tier_from_wire(begin.tier)
            res = await asyncio.to_thread(store.reserve, scope, headers, self._reserve_ms, io)
        except StrataError as exc:
            await self._send_error(ep, exc)
            return
        lease = res.lease_id
        try:
            want = bytes(1 if s.reserved else 0 for s in res.slots)
            await ep.send(preamble(KIND_WANT, page_count, len(want)))
            await ep.send(want)
            dram = store.tiers.dram
            views = [dram.view(s.offset, s.length) for s in res.slots if s.reserved and s.length]
            admission = store.scheduler.admit(io, sum(v.nbytes for v in views))
            await asyncio.to_thread(admission.__enter__)
            try:
                await settle([ep.recv(v) for v in views], self._put_timeout_s, ep)
            finally:
                admission.__exit__(None, None, None)
            try:
                await asyncio.to_thread(self._verify_and_commit, res, headers, tier, io)
                lease = 0  # committed: the lease has ended
            except StrataError as exc:
                await self._send_error(ep, exc)
                return
            statuses = bytes(
                store_pb2.PUT_STATUS_STORED if s.reserved else store_pb2.PUT_STATUS_ALREADY_PRESENT
                for s in res.slots
            )
            await ep.send(preamble(KIND_DONE, page_count, len(statuses)))
            await ep.send(statuses)
        finally:
            if lease:
                await asyncio.to_thread(store.abort, lease)

    def _verify_and_commit(
        self, res: Reservation, headers: Sequence[bytes], tier: Tier | None, io: IoClass
    ) -> int:
        """Check every received payload against its header; commit all or (raising) none."""
        store = self._store
        dram = store.tiers.dram
        bad: list[int] = []
        for i, slot in enumerate(res.slots):
            if not slot.reserved:
                continue
            try:
                PageHeader.decode(headers[i]).verify_payload(dram.view(slot.offset, slot.length))
            except Corrupt:
                bad.append(i)
        if bad:
            with store.counters.lock:
                store.counters.corrupt_dropped += len(bad)
            raise Corrupt(
                f"{len(bad)} page(s) failed the payload checksum after the network receive "
                f"(first: page {bad[0]}); nothing of this put was stored"
            )
        return store.commit(res.lease_id, tier, io, path="ucx")
