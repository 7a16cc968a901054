"""The daemon's end of the TCP data path (operations in client/transports/tcp_protocol.py).

A thread per connection does blocking socket I/O and calls the store directly (its calls are
thread-safe under its lock): no event loop, no thread-pool hop per call. After each answer the
thread polls its socket for up to `server.reply_poll_us` (50 us) before it sleeps in the kernel,
so the next call of a burst costs neither end a wake-up. Each connection is served one request
at a time:

- GET: acquire the pages, then, admitted by the scheduler and with the lease renewed, send the
  manifest and every present payload straight from its DRAM slot (one `sendmsg` of many
  views), then release the lease — the daemon ends the read itself when the send is done; a
  connection that breaks mid-send releases it the same way. A miss is answered in the same
  round trip.
- PUT_PAGES: reserve DRAM slots, receive each announced payload straight into its slot (a page
  not reserved, already present or being written, is received and dropped), verify every
  checksum (a network receive), then commit — or abort and store nothing. Whatever the answer,
  every announced byte is read first, so the connection stays in step.
- LOOKUP: the longest present prefix of a chain, as the gRPC Lookup.

Typed errors go back as ERROR frames and the connection stays usable; a frame that breaks the
framing (foreign magic, truncated meta, sizes that cannot be read) ends that connection only.

Who calls: as on UCX, the first frame is HELLO with the client's token (an open daemon also
serves a connection without one); the connection is bound to its principal and every request is
checked against its namespaces (a get or lookup carries its scope's canonical encoding; its
digest must be the one sent). With TLS, a connection whose first byte opens a TLS handshake is
served over TLS; a plaintext one only unless TLS is required (then it is closed at once).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from client.contract.errors import (
    Corrupt,
    InvalidArgument,
    StrataError,
    Unauthenticated,
    Unavailable,
)
from client.contract.page import PageHeader
from client.transports.tcp_endpoint import TLS_HANDSHAKE_TIMEOUT_S
from client.transports.tcp_protocol import (
    KIND_LOOKUP,
    KIND_LOOKUP_HITS,
    KIND_PUT_PAGES,
    receive_groups,
    split_put_pages,
)
from client.transports.tcp_transport import SocketReader, send_parts
from client.transports.ucx_protocol import (
    KIND_DONE,
    KIND_ERROR,
    KIND_GET,
    KIND_HELLO,
    KIND_MANIFEST,
    KIND_WELCOME,
    PREAMBLE,
    TCP_SCHEME,
    Frame,
    ManifestEntry,
    ProtocolError,
    encode_error,
    encode_manifest,
    format_address,
    parse_preamble,
    preamble,
)
from kvstore.auth import OPEN, Authenticator, Principal
from kvstore.bulk_manifest import acquired_manifest, check_sent_from_held_slots
from kvstore.bulk_requests import decode_bulk_get, decode_bulk_put, read_digest
from kvstore.keys import IoClass
from kvstore.store import Reservation, Store
from kvstore.tls import TLS_HANDSHAKE_BYTE, ServerTls
from kvstore_pb import store_pb2

log = logging.getLogger(__name__)

_BACKLOG = 128
_META_STEP_BYTES = 1 << 20  # frame metadata is taken in steps of this, as it arrives
_DRAIN_STEP_BYTES = 1 << 20
_STOP_TIMEOUT_S = 5.0
_SOCKET_BUFFER_BYTES = 4 << 20
_STATUS = {
    "stored": store_pb2.PUT_STATUS_STORED,
    "pending": store_pb2.PUT_STATUS_PENDING,
    "present": store_pb2.PUT_STATUS_ALREADY_PRESENT,
}
# Connections served at once (a thread each); beyond this a new one is closed at once, so a
# flood of connections cannot exhaust the daemon's threads.
MAX_CONNECTIONS = 512
# With auth on, a connection's first frame (HELLO) must arrive within this long, else it is
# closed: an unauthenticated connection holds nothing for longer.
HELLO_TIMEOUT_S = 10.0
# With auth on, the most meta a connection's first frame may announce (a HELLO carries a token):
# a larger one is refused on its preamble, before anything of it is waited for or allocated.
MAX_HELLO_META_BYTES = 64 << 10
# A connection with no next frame for this long is closed (server.tcp_idle_timeout_s), so
# connections kept idle cannot hold the cap; a client opens another when it needs one.
IDLE_TIMEOUT_S = 120.0
# After answering, a connection's thread polls for the next frame this long (non-blocking
# tries, yielding the CPU between them) before it sleeps in poll() (server.reply_poll_us): an
# engine's calls come in bursts, and a request that arrives within it costs no wake-up on
# either end. An idle connection costs nothing once it is over.
REPLY_POLL_S = 50e-6
_ABSENT_ENTRY = encode_manifest([ManifestEntry(b"", 0)])  # a manifest entry of a missing page


class _PeerGone(Exception):
    """The client closed the connection."""


class _Conn:
    """One accepted connection: its socket and the deadline-bounded I/O on it."""

    __slots__ = ("name", "reader", "sock")

    def __init__(self, sock: socket.socket, poll_s: float = 0.0) -> None:
        self.sock = sock
        self.reader = SocketReader(sock, poll_s)  # a receive that would block polls first
        self.name = f"tcp:{id(self)}"

    def send(self, parts: Sequence[bytes | memoryview], timeout_s: float) -> None:
        send_parts(self.sock, parts, time.monotonic() + timeout_s)

    def recv_many(self, parts: Sequence[memoryview], timeout_s: float) -> None:
        if self.reader.fill(parts, time.monotonic() + timeout_s) < sum(p.nbytes for p in parts):
            raise _PeerGone

    def recv(self, into: memoryview, timeout_s: float | None) -> None:
        deadline = time.monotonic() + timeout_s if timeout_s is not None else math.inf
        if self.reader.fill_one(into, deadline) < into.nbytes:
            raise _PeerGone


class TcpServer:
    """Serves the TCP data path of `store` on `host`. `start(port)` (0 = any free port) returns
    the address to advertise ("tcp://host:port") or raises Unavailable; `stop()` closes the
    listener and every connection (their leases are released)."""

    def __init__(
        self,
        store: Store,
        host: str,
        tls: ServerTls | None = None,
        auth: Authenticator | None = None,
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        reply_poll_s: float = REPLY_POLL_S,
    ) -> None:
        if not idle_timeout_s > 0:
            raise InvalidArgument(f"TCP idle timeout must be positive, got {idle_timeout_s}")
        if not 0 <= reply_poll_s <= 1e-3:
            raise InvalidArgument(f"reply poll must be in [0, 1] ms, got {reply_poll_s} s")
        self._idle_timeout_s = idle_timeout_s
        self._reply_poll_s = reply_poll_s
        self._store = store
        self._host = host
        self._auth = auth if auth is not None else Authenticator(None)
        self._tls = tls
        self._tls_context = tls.ssl_context() if tls is not None else None
        limits = store.config.limits
        self._max_meta = limits.max_message_bytes
        self._max_page = limits.max_page_bytes
        self._reserve_ms = limits.max_reserve_lease_ms
        # a transfer must end well before its lease could run out under it
        self._put_timeout_s = limits.max_reserve_lease_ms / 2000
        self._get_timeout_s = limits.lease_ttl_ms / 2000
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._acceptor: threading.Thread | None = None
        self._stopping = False
        self._full = False  # (said once per time the cap is reached)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, port: int = 0) -> str:
        try:
            family, kind, proto, _, where = socket.getaddrinfo(
                self._host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise Unavailable(f"no TCP data listener on {self._host}:{port}: {exc}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(_BACKLOG)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"no TCP data listener on {self._host}:{port}: {exc}") from None
        self._sock = sock
        self._acceptor = threading.Thread(
            target=self._accept_loop, args=(sock,), name="strata-tcp-accept", daemon=True
        )
        self._acceptor.start()
        address = format_address(self._host, int(sock.getsockname()[1]), TCP_SCHEME)
        log.info("TCP data path listening at %s", address)
        return address

    def stop(self) -> None:
        """Close the listener and every connection; wait (bounded) for their threads."""
        with self._lock:
            self._stopping = True
            sock, self._sock = self._sock, None
            conns = list(self._conns)
            threads = list(self._threads)
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        sock.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for thread in [*threads, *([self._acceptor] if self._acceptor else [])]:
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive():
                log.warning(
                    "TCP data path: %s did not end within %.0f s", thread.name, _STOP_TIMEOUT_S
                )

    def connection_count(self) -> int:
        """Connections open now (kept-alive ones included)."""
        with self._lock:
            return len(self._conns)

    def drop_connections(self) -> None:
        """End every open connection (each releases what it holds); the listener stays."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # the listener was closed (stop)
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                if len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    if not self._full:
                        log.warning(
                            "TCP data path: %d connections open; new ones are closed until "
                            "some end",
                            MAX_CONNECTIONS,
                        )
                    self._full = True
                    continue
                self._full = False
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name="strata-tcp-conn", daemon=True
                )
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()

    # ---- one connection ----------------------------------------------------------------------

    def _serve(self, raw: socket.socket) -> None:
        sock = raw
        try:
            opened = self._open(raw)
            if opened is None:
                return
            sock = opened
            self._requests(_Conn(sock, self._reply_poll_s))
        except ProtocolError as exc:
            log.warning("TCP data path: connection closed: %s", exc)
        except (_PeerGone, OSError, ssl.SSLError, TimeoutError) as exc:
            log.debug("TCP data path: connection ended: %r", exc)
        except Exception:  # a bug: this connection ends, the daemon keeps serving
            log.exception("TCP data path: connection failed")
        finally:
            with self._lock:
                self._conns.discard(raw)
                self._threads.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                sock.close()
            with contextlib.suppress(OSError):
                raw.close()

    def _open(self, conn: socket.socket) -> socket.socket | None:
        """The connection to serve: plaintext, or over TLS when this server has TLS and the
        client opens with a TLS handshake; None when it is refused (closed)."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
        ctx = self._tls_context
        if ctx is None:
            return conn  # blocking: each receive and send bounds its own wait (send_parts)
        conn.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
        try:
            head = conn.recv(1, socket.MSG_PEEK)
        except (OSError, TimeoutError) as exc:
            log.warning("TCP data path: connection refused: %r", exc)
            return None
        if not head:
            return None
        if head[0] == TLS_HANDSHAKE_BYTE:
            try:
                return ctx.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError, TimeoutError) as exc:
                log.warning("TCP data path: connection refused: %r", exc)
                return None
        if self._tls is not None and self._tls.require:
            log.warning("TCP data path: plaintext connection refused (TLS is required)")
            return None
        conn.settimeout(None)
        return conn

    def _requests(self, conn: _Conn) -> None:
        principal: Principal | None = None
        while True:
            first = principal is None and not self._auth.open  # HELLO comes at once, or never
            try:
                if first:
                    frame, meta = self._frame(conn, HELLO_TIMEOUT_S, MAX_HELLO_META_BYTES)
                else:
                    frame, meta = self._frame(conn, self._idle_timeout_s)
            except TimeoutError:
                log.debug("TCP data path: %s idle, closed", conn.name)
                return
            if principal is None:
                principal = self._hello(conn, frame.kind, meta)
                if principal is None:
                    return  # refused (and told so)
                if frame.kind == KIND_HELLO:
                    continue
            if frame.kind == KIND_GET:
                self._get(conn, meta, principal)
            elif frame.kind == KIND_PUT_PAGES:
                self._put(conn, frame.aux, meta, principal)
            elif frame.kind == KIND_LOOKUP:
                self._lookup(conn, meta, principal)
            else:
                raise ProtocolError(f"unexpected TCP frame kind {frame.kind}")

    def _frame(
        self, conn: _Conn, timeout_s: float | None, max_meta: int = 0
    ) -> tuple[Frame, bytearray]:
        """The next frame. Its meta is taken a step at a time as it arrives: a header that
        announces 72 MiB and sends nothing costs one step, not 72 MiB. `max_meta`: a tighter
        bound than limits.max_message_bytes (a first frame before HELLO): over it, ProtocolError
        (the connection ends) on the preamble alone."""
        head = bytearray(PREAMBLE.size)
        conn.recv(memoryview(head), timeout_s)
        frame = parse_preamble(head, max_meta or self._max_meta)
        if frame.meta_bytes <= _META_STEP_BYTES:
            meta = bytearray(frame.meta_bytes)
            if frame.meta_bytes:
                conn.recv(memoryview(meta), timeout_s)
            return frame, meta
        meta = bytearray()
        while len(meta) < frame.meta_bytes:
            part = bytearray(min(_META_STEP_BYTES, frame.meta_bytes - len(meta)))
            conn.recv(memoryview(part), timeout_s)
            meta += part
        return frame, meta

    def _hello(self, conn: _Conn, kind: int, meta: bytearray) -> Principal | None:
        """The principal of a connection whose first frame is `kind` (WELCOME sent for a HELLO),
        or None when it is refused (ERROR sent: the connection is to be closed)."""
        auth = self._auth
        if kind != KIND_HELLO:
            if auth.open:
                return OPEN  # an open daemon serves clients that send no HELLO
            auth.denied(None, "unauthenticated")
            self._send_error(conn, Unauthenticated("the first frame must be HELLO"))
            return None
        try:
            principal = auth.authenticate(bytes(meta).decode("utf-8", "replace") or None)
        except Unauthenticated as exc:
            auth.denied(None, "unauthenticated")
            self._send_error(conn, exc)
            return None
        conn.send((preamble(KIND_WELCOME),), self._get_timeout_s)
        return principal

    def _send_error(self, conn: _Conn, exc: BaseException) -> None:
        if not isinstance(exc, StrataError):
            log.exception("TCP data path request failed", exc_info=exc)
        code, meta = encode_error(exc)
        conn.send((preamble(KIND_ERROR, code, len(meta)), meta), self._get_timeout_s)

    # ---- lookup ------------------------------------------------------------------------------

    def _lookup(self, conn: _Conn, meta: bytearray, principal: Principal) -> None:
        try:
            try:
                request = store_pb2.LookupRequest.FromString(bytes(meta))
            except DecodeError:
                raise InvalidArgument("malformed LookupRequest") from None
            digest = read_digest(self._auth, principal, request.scope, request.scope_digest)
            # packed keys in (Store.lookup checks the field and the key limit), one Tier byte a
            # hit out: the codes are what the frame carries
            codes = self._store.lookup(digest, request.keys).codes
        except StrataError as exc:
            self._send_error(conn, exc)
            return
        conn.send((preamble(KIND_LOOKUP_HITS, len(codes), len(codes)), codes), self._get_timeout_s)

    # ---- get ---------------------------------------------------------------------------------

    def _get(self, conn: _Conn, meta: bytearray, principal: Principal) -> None:
        store = self._store
        try:
            get = decode_bulk_get(store, self._auth, principal, meta)
            io = get.io
            acq = store.acquire(get.digest, get.keys, io)
        except StrataError as exc:
            self._send_error(conn, exc)
            return
        try:
            pages = acq.pages
            if pages.count(None) == len(pages):  # a miss of every key: the manifest alone
                absent = _ABSENT_ENTRY * len(pages)
                conn.send(
                    (preamble(KIND_MANIFEST, len(pages), len(absent)) + absent,),
                    self._get_timeout_s,
                )
                return
            dram = store.tiers.dram
            manifest, views, total = acquired_manifest(acq, dram)
            frame = preamble(KIND_MANIFEST, len(acq.pages), len(manifest))
            if not views:  # nothing to send from DRAM: no admission, no lease to fence
                conn.send((frame, manifest), self._get_timeout_s)
                return
            # The read fence of the daemon's own copy: the lease is renewed right after the
            # admission wait and the whole send is bounded by half of it, so no slot can be
            # freed (and reused) while its bytes are still being sent.
            with store.scheduler.admit(io, total):
                try:
                    store.renew(acq.lease_id)
                except StrataError as exc:
                    self._send_error(conn, exc)
                    return
                conn.send((frame, manifest, *views), self._get_timeout_s)
            check_sent_from_held_slots(acq, store)
            store.counters.add_bytes("tcp", "out", io, total)
        finally:
            if acq.lease_id:
                store.release(acq.lease_id)

    # ---- put ---------------------------------------------------------------------------------

    def _put(self, conn: _Conn, page_count: int, meta: bytearray, principal: Principal) -> None:
        store = self._store
        limits = store.config.limits
        if page_count > limits.max_keys_per_call:
            # refused before anything is decoded; what follows cannot be told apart
            self._send_error(
                conn,
                InvalidArgument(
                    f"{page_count} pages in one put; the limit is {limits.max_keys_per_call}"
                ),
            )
            raise ProtocolError(f"a put of {page_count} pages")
        try:
            head, sizes = split_put_pages(meta, page_count, self._max_page)
        except ProtocolError as exc:
            self._send_error(conn, InvalidArgument(str(exc)))
            raise
        try:
            put = decode_bulk_put(store, self._auth, principal, head, page_count)
            headers, io = put.headers, put.io
            res = store.reserve(
                put.scope,
                headers,
                self._reserve_ms,
                io,
                client=conn.name,
                chain_prefix=put.chain_prefix,
            )
        except StrataError as exc:
            self._drain(conn, sum(sizes))
            self._send_error(conn, exc)
            return
        lease = res.lease_id
        try:
            error = self._receive_pages(conn, res, headers, sizes, io)
            if error is None:
                try:
                    store.commit(res.lease_id, put.tier, io, path="tcp")
                    lease = 0  # committed: the lease has ended
                except StrataError as exc:
                    error = exc
            if error is not None:
                self._send_error(conn, error)
                return
            statuses = bytes(
                _STATUS["stored" if s.reserved else "pending" if s.pending else "present"]
                for s in res.slots
            )
            conn.send(
                (preamble(KIND_DONE, page_count, len(statuses)), statuses), self._put_timeout_s
            )
        finally:
            if lease:
                store.abort(lease)

    def _receive_pages(
        self,
        conn: _Conn,
        res: Reservation,
        headers: Sequence[bytes],
        sizes: Sequence[int],
        io: IoClass,
    ) -> StrataError | None:
        """Receive every announced payload, scattered straight into the reserved pages' slots
        (any other page's into a scratch buffer, dropped), and check each reserved page's
        checksum (a network receive) while the next group of pages is arriving. Returns, every
        byte read, InvalidArgument for a payload whose announced size is not its header's, or
        Corrupt for payloads failing their checksum (nothing of the put may be stored)."""
        dram = self._store.tiers.dram
        error: StrataError | None = None
        targets: list[tuple[int, memoryview]] = []  # (page to check, or -1; where it goes)
        scratch: memoryview | None = None
        for i, slot in enumerate(res.slots):
            if slot.reserved and slot.length == sizes[i]:
                if slot.length:
                    targets.append((i, dram.view(slot.offset, slot.length)))
                continue
            if slot.reserved and error is None:
                error = InvalidArgument(
                    f"page {i}: {sizes[i]} payload bytes sent, its header says {slot.length}"
                )
            if scratch is None and sizes[i]:
                scratch = memoryview(bytearray(_DRAIN_STEP_BYTES))
            for k in range(0, sizes[i], _DRAIN_STEP_BYTES):  # dropped: a scratch view a step
                assert scratch is not None
                targets.append((-1, scratch[: min(_DRAIN_STEP_BYTES, sizes[i] - k)]))
        bad: list[int] = []
        total = sum(s.length for s in res.slots if s.reserved)
        deadline = time.monotonic() + self._put_timeout_s
        with self._store.scheduler.admit(io, total):
            for group in receive_groups(targets):
                conn.recv_many([view for _, view in group], max(deadline - time.monotonic(), 0))
                for i, view in group:
                    if i < 0 or error is not None:
                        continue
                    try:
                        PageHeader.decode(headers[i]).verify_payload(view)
                    except Corrupt:
                        bad.append(i)
        if error is None and bad:
            store = self._store
            with store.counters.lock:
                store.counters.corrupt_dropped += len(bad)
            error = Corrupt(
                f"{len(bad)} page(s) failed the payload checksum after the network receive "
                f"(first: page {bad[0]}); nothing of this put was stored"
            )
        return error

    def _drain(self, conn: _Conn, n_bytes: int, timeout_s: float | None = None) -> None:
        """Read and drop `n_bytes` (payloads announced but not wanted)."""
        if not n_bytes:
            return
        timeout = timeout_s if timeout_s is not None else self._put_timeout_s
        scratch = bytearray(min(n_bytes, _DRAIN_STEP_BYTES))
        view = memoryview(scratch)
        start, left = time.monotonic(), n_bytes
        while left:
            n = min(left, len(scratch))
            conn.recv(view[:n], max(timeout - (time.monotonic() - start), 0.001))
            left -= n
