"""The daemon's end of the same-host control lane (framing in client/transports/lane_protocol.py).

One thread accepts connections on a unix socket; one thread per connection reads request
frames and dispatches them to the very same StoreService handlers as gRPC does, through a small
context object that turns `abort` into an error frame. So the lane adds no behaviour of its own:
it is only a cheaper way to carry the same messages between processes on one host.

Who may use it: the first frame of a connection (HELLO) carries the client's token; the
connection is bound to that principal (the handlers read it from the context) and served only
when the daemon trusts it with the same-host path: a `trusted_local` principal whose process runs
as the daemon's user or one of `auth.local_uids` (SO_PEERCRED, as the kernel reports it, not as
the client claims). Anyone else gets UNAUTHENTICATED or PERMISSION_DENIED and the connection is
closed; the refusal is counted and logged once per principal. A client of one of
`auth.local_uids` cannot open the segment file (0600, the daemon's user's), so the HELLO answer
hands it a descriptor of the segment (SCM_RIGHTS); the daemon's own user opens it by name.

After each answer a connection's thread polls its socket for the next request for up to
`server.reply_poll_us` (non-blocking tries, yielding the CPU between them) before it sleeps in a
blocking receive: the next call of a burst costs no wake-up; an idle connection costs nothing
once the window is over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import Message

from client.contract.errors import InvalidArgument, Unauthenticated
from client.transports.lane_protocol import (
    HELLO,
    METHOD_IDS,
    METHODS,
    ONE_WAY,
    REQUEST,
    RESPONSE,
    STATUS_OK,
    LaneClosed,
    recv_exact,
    recv_growing,
)
from kvstore.auth import OPEN, Authenticator, Principal
from kvstore.service import StoreService
from kvstore_pb import store_pb2

log = logging.getLogger(__name__)


_RESERVE = METHOD_IDS["Reserve"]
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
# With auth on, a connection's first frame (HELLO) must arrive within this long, else it is
# closed: a thread serving an unauthenticated connection is held for no longer.
HELLO_TIMEOUT_S = 10.0
_PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
REPLY_POLL_S = 50e-6  # see the module doc (server.reply_poll_us)
_NOWAIT = socket.MSG_DONTWAIT


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _LaneContext:
    """The slice of grpc.ServicerContext that unary StoreService handlers use, plus the
    caller's process id as the kernel reports it (`peer_pid`, 0 when unknown) and the principal
    the connection is bound to."""

    def __init__(self, peer_pid: int = 0, principal: Principal = OPEN) -> None:
        self.retry_after_ms = 0
        self.peer_pid = peer_pid
        self.principal = principal

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Abort(code, details)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        for key, value in metadata:
            if key == "retry-after-ms":
                self.retry_after_ms = int(value)

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return "lane"


class LaneServer:
    """Serves the lane on `path` for `service`. `start()`, then `stop()`.

    `auth` (None: open) decides who the tokens name; `local_uids`: users besides the daemon's own
    whose trusted_local principals may use it. Without such users the socket file is the
    daemon user's alone (0600); with them it is 0666 and HELLO decides (the folder holding it
    must then let them reach it)."""

    def __init__(
        self,
        path: str,
        service: StoreService,
        max_frame_bytes: int,
        auth: Authenticator | None = None,
        local_uids: frozenset[int] = frozenset(),
        segment_fd: int = -1,
        *,
        reply_poll_s: float = REPLY_POLL_S,
    ) -> None:
        if not 0 <= reply_poll_s <= 1e-3:
            raise InvalidArgument(f"reply poll must be in [0, 1] ms, got {reply_poll_s} s")
        self.path = path
        self._reply_poll_s = reply_poll_s
        self._service = service
        self._segment_fd = segment_fd  # handed to trusted clients of another user (not owned)
        self._auth = auth if auth is not None else Authenticator(None)
        self._uids = frozenset({os.getuid(), *local_uids})
        self._max_frame = max_frame_bytes
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False
        self._handlers: dict[int, tuple[type[Message], Callable[..., Message]]] = {
            mid: (req_type, getattr(service, name)) for mid, (name, req_type, _) in METHODS.items()
        }

    def start(self) -> None:
        """Bind and listen; raises OSError when the path cannot be bound."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o666 if len(self._uids) > 1 else 0o600)
        sock.listen(128)
        self._sock = sock
        threading.Thread(target=self._accept, name="strata-lane-accept", daemon=True).start()

    def stop(self) -> None:
        """Stop accepting, close every connection, remove the socket file."""
        with self._lock:
            self._stopped = True
            conns, self._conns = list(self._conns), set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="strata-lane", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            peer_pid, peer_uid = _peer_cred(conn)
            principal: Principal | None = None
            if not self._auth.open:
                conn.settimeout(HELLO_TIMEOUT_S)  # HELLO comes at once, or the connection goes
            head = bytearray(REQUEST.size)
            while True:
                # bound connections only: before HELLO the socket may have a timeout
                poll_s = self._reply_poll_s if principal is not None else 0.0
                length, method, flags, _ = REQUEST.unpack(next_header(conn, head, poll_s))
                if length > self._max_frame:
                    log.warning("lane frame of %d bytes exceeds the limit; closing", length)
                    return
                payload = bytes(recv_growing(conn, length)) if length else b""
                if principal is None or method == HELLO:
                    principal = self._greet(conn, method, payload, principal, peer_uid)
                    if principal is None:
                        return
                    if method == HELLO:
                        continue
                status, retry_ms, body = self._dispatch(method, payload, peer_pid, principal)
                try:
                    if flags & ONE_WAY:
                        raise LaneClosed("no reply wanted")
                    conn.sendall(RESPONSE.pack(len(body), status, retry_ms) + body)
                except (LaneClosed, OSError):
                    if method == _RESERVE and status == STATUS_OK:
                        self._give_back_reservation(body)
                    if not flags & ONE_WAY:
                        raise
        except (LaneClosed, OSError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _give_back_reservation(self, body: bytes) -> None:
        """A Reserve reply that never reached its caller (it gave up and closed the connection,
        or asked for no reply): the caller cannot know the lease, so it can neither copy into
        the slots nor make the late call that frees them once quarantined. Nothing was handed
        out: the reservation is given back now."""
        with contextlib.suppress(Exception):
            lease_id = store_pb2.ReserveResponse.FromString(body).lease_id
            if lease_id:
                self._service.store.abort(lease_id)

    def _greet(
        self,
        conn: socket.socket,
        method: int,
        payload: bytes,
        bound: Principal | None,
        peer_uid: int,
    ) -> Principal | None:
        """The connection's principal after its first frame: HELLO (answered: OK, with the
        segment's descriptor for a listed user, or the refusal), or, on an open daemon only, a
        call (then served as the OPEN principal). None: refused, the connection is to be
        closed. A second HELLO is refused unless the daemon is open."""
        hello = payload if method == HELLO and bound is None else None
        principal, status, body = self._admit(hello, peer_uid)
        if principal is not None and method != HELLO:
            return principal  # an open daemon's client that sent no HELLO: served at once
        reply = RESPONSE.pack(len(body), status, 0) + body
        if principal is not None and peer_uid != os.getuid():
            self._send_with_segment(conn, reply)
        else:
            conn.sendall(reply)
        if principal is not None:
            conn.settimeout(None)
        return principal

    def _send_with_segment(self, conn: socket.socket, reply: bytes) -> None:
        """The HELLO answer, with the segment's descriptor when there is one."""
        if self._segment_fd < 0:
            conn.sendall(reply)
            return
        sent = socket.send_fds(conn, [reply], [self._segment_fd])
        if sent < len(reply):
            conn.sendall(reply[sent:])

    def _admit(self, hello: bytes | None, peer_uid: int) -> tuple[Principal | None, int, bytes]:
        """(principal, OK, b"") for a connection this daemon lets use the lane, else (None, the
        refusal's status, its details). `hello`: the HELLO payload (the token), None when the
        connection began without one (or sent a second)."""
        auth = self._auth
        if hello is None and not auth.open:
            auth.denied(None, "unauthenticated")
            return None, _UNAUTHENTICATED, b"the lane's first frame must be HELLO with a token"
        if hello is None:
            principal = OPEN
        else:
            try:
                principal = auth.authenticate(hello.decode("utf-8", "replace") or None)
            except Unauthenticated as exc:
                auth.denied(None, "unauthenticated")
                return None, _UNAUTHENTICATED, str(exc).encode()
        why = ""
        if not principal.trusted_local:
            why = f"principal {principal.name!r} may not use the same-host path (trusted_local)"
        elif peer_uid not in self._uids:
            why = (
                f"uid {peer_uid} may not use the same-host path: not the daemon's user "
                "nor in auth.local_uids"
                if peer_uid >= 0
                else "the lane cannot tell the connecting user (SO_PEERCRED)"
            )
        if why:
            auth.denied(principal, "local_untrusted")
            return None, _PERMISSION_DENIED, f"{why}; use the remote path".encode()
        return principal, STATUS_OK, b""

    def _dispatch(
        self, method: int, payload: bytes, peer_pid: int = 0, principal: Principal = OPEN
    ) -> tuple[int, int, bytes]:
        handler = self._handlers.get(method)
        if handler is None:
            return (
                grpc.StatusCode.UNIMPLEMENTED.value[0],
                0,
                f"unknown lane method {method}".encode(),
            )
        req_type, fn = handler
        context = _LaneContext(peer_pid, principal)
        try:
            request = req_type.FromString(payload)
        except Exception as exc:  # protobuf's DecodeError and friends
            return (
                grpc.StatusCode.INVALID_ARGUMENT.value[0],
                0,
                f"malformed request: {exc}".encode(),
            )
        try:
            reply = fn(request, context)
        except _Abort as abort:
            return abort.code.value[0], context.retry_after_ms, abort.details.encode()
        except Exception as exc:
            log.exception("lane handler %s failed", METHODS[method][0])
            return grpc.StatusCode.INTERNAL.value[0], 0, f"internal error: {exc}".encode()
        return STATUS_OK, 0, reply.SerializeToString()


def next_header(sock: socket.socket, head: bytearray, poll_s: float) -> bytearray:
    """The next request header, received into `head`: tried without waiting for up to `poll_s`
    (yielding the CPU between tries), then in a blocking receive. Raises LaneClosed on EOF."""
    got = 0
    if poll_s > 0:
        until = 0.0
        while True:
            try:
                got = sock.recv_into(head, REQUEST.size, _NOWAIT)
            except BlockingIOError:
                now = time.perf_counter()
                if not until:
                    until = now + poll_s
                if now < until:
                    os.sched_yield()
                    continue
                break
            if got == 0:
                raise LaneClosed("lane closed by peer")
            break
    if got < REQUEST.size:
        head[got:] = recv_exact(sock, REQUEST.size - got)
    return head


def _peer_cred(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the connecting process (SO_PEERCRED): its id in this PID namespace, 0 when
    unknown (a peer in a PID namespace this one cannot see is reported as 0 by the kernel), and
    its user id in this user namespace, -1 when unknown."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return 0, -1
    pid, uid, _ = struct.unpack("3i", raw)
    return max(int(pid), 0), int(uid)
