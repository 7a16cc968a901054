"""The daemon's end of the UCX data path (framing in client/transports/ucx_protocol.py; the TCP data
path is kvstore/tcp_server.py).

A ucxx listener on the process's bulk loop (client/transports/ucx_runtime.py). Each connected
endpoint is served
one request at a time: a get acquires its pages, sends them straight from their DRAM slots and
releases them; a put reserves DRAM slots, receives each payload straight into its slot, verifies
every checksum (a network receive), then commits — or aborts and stores nothing. Typed errors go
back as ERROR frames; the connection stays usable. A client that disconnects mid-transfer only
ends its own connection: its leases are released or aborted, the daemon keeps serving.

Who calls: the first frame of a connection is HELLO with the client's token; the connection is
bound to its principal (Unauthenticated ends it) and every get and put is checked against that
principal's namespaces, as the gRPC calls are (a get carries its scope's canonical encoding; its
digest must be the one sent).

`ucxx` is imported only by `start_ucx()`: a daemon without it serves TCP and gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from client.contract.errors import (
    Corrupt,
    InvalidArgument,
    StrataError,
    Unauthenticated,
    Unavailable,
)
from client.contract.page import PageHeader
from client.transports.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    KIND_GET,
    KIND_HELLO,
    KIND_MANIFEST,
    KIND_PUT,
    KIND_WANT,
    KIND_WELCOME,
    PREAMBLE,
    Frame,
    ProtocolError,
    encode_error,
    format_address,
    parse_preamble,
    preamble,
    settle,
)
from client.transports.ucx_runtime import ucx_runtime
from kvstore.auth import OPEN, Authenticator, Principal
from kvstore.bulk_manifest import acquired_manifest, check_sent_from_held_slots
from kvstore.bulk_requests import decode_bulk_get, decode_bulk_put
from kvstore.keys import IoClass, Tier
from kvstore.store import Reservation, Store
from kvstore.tls import ServerTls
from kvstore_pb import store_pb2

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0
_POOL_THREADS = 8  # per I/O class
# With auth on, a connection's first frame (HELLO) must arrive within this long, else it is
# closed: an unauthenticated connection holds nothing for longer.
HELLO_TIMEOUT_S = 10.0
_T = TypeVar("_T")


async def _recv_meta(ep: Any, n_bytes: int) -> bytearray:
    """A frame's `n_bytes` of metadata (a UCX message is received whole: its size is the
    sender's, bounded by the preamble check)."""
    meta = bytearray(n_bytes)
    if n_bytes:
        await ep.recv(meta)
    return meta


def _admit_and_renew(admission: Any, store: Store, lease_id: int) -> StrataError | None:
    """Enter `admission` (blocking), then renew the read lease `lease_id` (if any): the error
    of the renewal, if it failed (the admission is held either way)."""
    admission.__enter__()
    if lease_id:
        try:
            store.renew(lease_id)
        except StrataError as exc:
            return exc
    return None


class BulkServer:
    """Serves the UCX data path of `store` on `host`: `start_ucx(port)` (0 = any free port)
    returns the address to advertise ("ucx://host:port") and raises Unavailable when the
    listener cannot start or ucxx cannot be imported; `stop()` closes the listener and every
    connection.

    With `tls.require` the UCX listener is not started (UCX here cannot encrypt).
    """

    def __init__(
        self,
        store: Store,
        host: str,
        tls: ServerTls | None = None,
        auth: Authenticator | None = None,
    ) -> None:
        self._store = store
        self._host = host
        self._auth = auth if auth is not None else Authenticator(None)
        self._tls = tls
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Any = None  # the ucxx listener
        self._endpoints: set[Any] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        limits = store.config.limits
        self._max_meta = limits.max_message_bytes
        self._reserve_ms = limits.max_reserve_lease_ms
        # a transfer must end well before its lease could run out under it
        self._put_timeout_s = limits.max_reserve_lease_ms / 2000
        self._get_timeout_s = limits.lease_ttl_ms / 2000
        # Store calls and admission waits run in a thread pool per I/O class, not the loop's
        # default pool: background work waiting for its turn (or for the background cap) can
        # hold only the background threads, never the ones a critical get needs.
        self._pools = {
            io: ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix=f"strata-bulk-{io.name}")
            for io in IoClass
        }

    async def _call(self, io: IoClass, fn: Callable[..., _T], *args: object) -> _T:
        """`fn(*args)` in the thread pool of I/O class `io`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pools[io], functools.partial(fn, *args))

    # ---- lifecycle -------------------------------------------------------------------------

    def start_ucx(self, port: int = 0) -> str:
        if self._tls is not None and self._tls.require:
            raise Unavailable("TLS is required and the UCX data path cannot be encrypted")
        ucxx, loop = ucx_runtime()  # raises Unavailable without a usable ucxx

        async def listen() -> Any:
            return ucxx.create_listener(self._accept, port=port)

        try:
            self._listener = asyncio.run_coroutine_threadsafe(listen(), loop).result(
                _START_TIMEOUT_S
            )
        except Exception as exc:
            raise Unavailable(f"no UCX listener on port {port}: {exc}") from None
        self._loop = loop
        address = format_address(self._host, int(self._listener.port))
        log.info("UCX data path listening at %s", address)
        return address

    def stop(self) -> None:
        """Close the listeners and every connection (their leases are released). The process's
        bulk loop itself lives on (client/transports/ucx_runtime.py)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(_STOP_TIMEOUT_S * 2)
        except Exception as exc:
            log.warning("bulk data listeners did not close cleanly: %r", exc)
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

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
        path = "ucx"  # for the byte counters
        principal: Principal | None = None
        try:
            while True:
                if principal is None and not self._auth.open:  # HELLO comes at once, or never
                    frame, meta = await asyncio.wait_for(self._frame(ep), HELLO_TIMEOUT_S)
                else:
                    frame, meta = await self._frame(ep)
                if principal is None:
                    principal = await self._hello(ep, frame.kind, meta)
                    if principal is None:
                        return  # refused (and told so)
                    if frame.kind == KIND_HELLO:
                        continue
                if frame.kind == KIND_GET:
                    await self._get(ep, meta, path, principal)
                elif frame.kind == KIND_PUT:
                    await self._put(ep, frame.aux, meta, path, principal)
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

    async def _frame(self, ep: Any) -> tuple[Frame, bytearray]:
        head = bytearray(PREAMBLE.size)
        await ep.recv(head)
        frame = parse_preamble(head, self._max_meta)
        return frame, await _recv_meta(ep, frame.meta_bytes)

    async def _hello(self, ep: Any, kind: int, meta: bytearray) -> Principal | None:
        """The principal of a connection whose first frame is `kind` (WELCOME sent for a HELLO),
        or None when it is refused (ERROR sent: the connection is to be closed)."""
        auth = self._auth
        if kind != KIND_HELLO:
            if auth.open:
                return OPEN  # an open daemon serves clients that send no HELLO
            auth.denied(None, "unauthenticated")
            await self._send_error(ep, Unauthenticated("the first frame must be HELLO"))
            return None
        try:
            principal = auth.authenticate(bytes(meta).decode("utf-8", "replace") or None)
        except Unauthenticated as exc:
            auth.denied(None, "unauthenticated")
            await self._send_error(ep, exc)
            return None
        await ep.send(preamble(KIND_WELCOME))
        return principal

    async def _send_error(self, ep: Any, exc: BaseException) -> None:
        if not isinstance(exc, StrataError):
            log.exception("UCX request failed", exc_info=exc)
        code, meta = encode_error(exc)
        await ep.send(preamble(KIND_ERROR, code, len(meta)))
        await ep.send(meta)

    # ---- get -------------------------------------------------------------------------------

    async def _get(self, ep: Any, meta: bytearray, path: str, principal: Principal) -> None:
        store = self._store
        try:
            get = decode_bulk_get(store, self._auth, principal, meta)
            io = get.io
            acq = await self._call(io, store.acquire, get.digest, get.keys, io)
        except StrataError as exc:
            await self._send_error(ep, exc)
            return
        try:
            dram = store.tiers.dram
            manifest, views, total = acquired_manifest(acq, dram)
            admission = store.scheduler.admit(io, total)
            # The read fence of the daemon's own copy: the lease is renewed right after the
            # admission wait (in the same thread: an admitted operation never waits for a pool
            # thread while it holds its slot) and the whole send is bounded by half of it, so
            # no slot can be freed (and reused) while its bytes are still being sent.
            renewed = await self._call(io, _admit_and_renew, admission, store, acq.lease_id)
            try:
                if isinstance(renewed, StrataError):
                    await self._send_error(ep, renewed)
                    return
                await settle(
                    [
                        ep.send(preamble(KIND_MANIFEST, len(acq.pages), len(manifest))),
                        ep.send(manifest),
                        *(ep.send(v) for v in views),
                    ],
                    self._get_timeout_s,
                    ep,
                )
            finally:
                admission.__exit__(None, None, None)
            check_sent_from_held_slots(acq, store)
            store.counters.add_bytes(path, "out", io, total)
        finally:
            if acq.lease_id:
                await self._call(io, store.release, acq.lease_id)

    # ---- put -------------------------------------------------------------------------------

    async def _put(
        self, ep: Any, page_count: int, meta: bytearray, path: str, principal: Principal
    ) -> None:
        store = self._store
        limits = store.config.limits
        try:
            if page_count > limits.max_keys_per_call:
                raise InvalidArgument(
                    f"{page_count} pages in one put; the limit is {limits.max_keys_per_call}"
                )
            put = decode_bulk_put(store, self._auth, principal, meta, page_count)
            headers, io = put.headers, put.io
            res = await self._call(
                io,
                functools.partial(
                    store.reserve,
                    put.scope,
                    headers,
                    self._reserve_ms,
                    io,
                    client=f"{path}:{id(ep)}",
                    chain_prefix=put.chain_prefix,
                ),
            )
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
            await self._call(io, admission.__enter__)
            try:
                await settle([ep.recv(v) for v in views], self._put_timeout_s, ep)
            finally:
                admission.__exit__(None, None, None)
            try:
                await self._call(io, self._verify_and_commit, res, headers, put.tier, io, path)
                lease = 0  # committed: the lease has ended
            except StrataError as exc:
                await self._send_error(ep, exc)
                return
            statuses = bytes(
                store_pb2.PUT_STATUS_STORED
                if s.reserved
                else store_pb2.PUT_STATUS_PENDING
                if s.pending
                else store_pb2.PUT_STATUS_ALREADY_PRESENT
                for s in res.slots
            )
            await ep.send(preamble(KIND_DONE, page_count, len(statuses)))
            await ep.send(statuses)
        finally:
            if lease:
                await self._call(io, store.abort, lease)

    def _verify_and_commit(
        self,
        res: Reservation,
        headers: Sequence[bytes],
        tier: Tier | None,
        io: IoClass,
        path: str,
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
        return store.commit(res.lease_id, tier, io, path=path)
