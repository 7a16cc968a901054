"""The daemon's end of the same-host control lane (framing in client/lane_protocol.py).

One thread accepts connections on a unix socket; one thread per connection reads request
frames and dispatches them to the very same StoreService handlers as gRPC does, through a small
context object that turns `abort` into an error frame. So the lane adds no behaviour of its own:
it is only a cheaper way to carry the same messages between processes on one host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import Message

from client.lane_protocol import (
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
from kvstore.service import StoreService
from kvstore_pb import store_pb2

log = logging.getLogger(__name__)


_RESERVE = METHOD_IDS["Reserve"]


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _LaneContext:
    """The slice of grpc.ServicerContext that unary StoreService handlers use, plus the
    caller's process id as the kernel reports it (`peer_pid`, 0 when unknown)."""

    def __init__(self, peer_pid: int = 0) -> None:
        self.retry_after_ms = 0
        self.peer_pid = peer_pid

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
    """Serves the lane on `path` for `service`. `start()`, then `stop()`."""

    def __init__(self, path: str, service: StoreService, max_frame_bytes: int) -> None:
        self.path = path
        self._service = service
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
        os.chmod(self.path, 0o600)
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
            peer_pid = _peer_pid(conn)
            while True:
                length, method, flags, _ = REQUEST.unpack(recv_exact(conn, REQUEST.size))
                if length > self._max_frame:
                    log.warning("lane frame of %d bytes exceeds the limit; closing", length)
                    return
                payload = bytes(recv_growing(conn, length)) if length else b""
                status, retry_ms, body = self._dispatch(method, payload, peer_pid)
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

    def _dispatch(self, method: int, payload: bytes, peer_pid: int = 0) -> tuple[int, int, bytes]:
        handler = self._handlers.get(method)
        if handler is None:
            return (
                grpc.StatusCode.UNIMPLEMENTED.value[0],
                0,
                f"unknown lane method {method}".encode(),
            )
        req_type, fn = handler
        context = _LaneContext(peer_pid)
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


def _peer_pid(conn: socket.socket) -> int:
    """The connecting process's id in this PID namespace (SO_PEERCRED), 0 when unknown (a peer
    in a PID namespace this one cannot see is reported as 0 by the kernel)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return 0
    pid, _, _ = struct.unpack("3i", raw)
    return max(int(pid), 0)
