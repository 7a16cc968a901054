"""The client end of the same-host control lane (framing in client/transports/lane_protocol.py).

`LaneStub` looks like the generated gRPC stub to the client's call code: `stub.Acquire(request,
timeout=...)` returns the reply or raises a `grpc.RpcError` carrying the status code, details and
retry hint, so retries and error mapping are shared with the gRPC path. Streaming methods (Put,
Get, Watch) are forwarded to a real gRPC stub. Connections are pooled, so concurrent callers
(threads or greenlets) never wait on each other's round trips. Each new connection first sends
HELLO with the client's token (client/transports/lane_protocol.py); a daemon that does not trust this
client with the same-host path refuses it (`LaneError.refused`); one that trusts a client of
another user (`auth.local_uids`) hands it the segment's descriptor with the answer
(`Lane.take_segment_fds`).

A pooled connection's socket stays blocking; each send or receive is first tried without
waiting (MSG_DONTWAIT), and only one that would block waits, in one poll() bounded by the call's
deadline (a socket with a timeout would poll before every call, and take an ioctl for every
change of its timeout). A reply's first receive polls for up to `_SPIN_S` before it sleeps.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import threading
import time

import grpc
from google.protobuf.message import Message

from client.transports.lane_protocol import (
    HELLO,
    METHOD_IDS,
    METHODS,
    ONE_WAY,
    REQUEST,
    RESPONSE,
    SCHEME,
    STATUS_OK,
    LaneClosed,
    recv_exact,
)
from client.transports.socket_io import NOWAIT, recv_some, remaining, wait_ready
from kvstore_pb.store_pb2_grpc import StoreStub

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
_MAX_IDLE = 8
_MAX_FDS = 4  # segment descriptors a HELLO answer may carry


class LaneError(grpc.RpcError):
    """A lane call that failed, shaped like a grpc.Call error for the shared error mapping."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: int = 0) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._retry_after_ms = retry_after_ms

    def code(self) -> grpc.StatusCode:
        return self._code

    @property
    def refused(self) -> bool:
        """The daemon refused this client the lane (its token, principal or user)."""
        return self._code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

    def details(self) -> str:
        return self._details

    # grpc returns (key, value) pairs here; its type stub says otherwise
    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:  # type: ignore[override]
        if self._retry_after_ms:
            return (("retry-after-ms", str(self._retry_after_ms)),)
        return ()


class _Done:
    """The result of a one-way call: already complete."""

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> None:
        return None


class LaneCall:
    """A lane call in flight on a connection of its own; `result()` waits for the reply."""

    def __init__(
        self, lane: Lane, sock: socket.socket, reply_type: type[Message], deadline: float
    ) -> None:
        self._lane = lane
        self._sock: socket.socket | None = sock
        self._reply_type = reply_type
        self._deadline = deadline

    def result(self) -> Message:
        """The reply; raises LaneError (then, and after `cancel`, the connection is gone)."""
        sock, self._sock = self._sock, None
        if sock is None:
            raise LaneError(grpc.StatusCode.CANCELLED, "lane call already finished or cancelled")
        return self._reply_type.FromString(self._lane.finish(sock, self._deadline))

    def cancel(self) -> None:
        """Give up on the reply (the connection is closed, not reused)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class _LaneMethod:
    def __init__(self, lane: Lane, name: str) -> None:
        self._lane = lane
        self._id = METHOD_IDS[name]
        self._reply_type = METHODS[self._id][2]

    def __call__(self, request: Message, timeout: float | None = None) -> Message:
        body = self._lane.call(self._id, request.SerializeToString(), timeout, one_way=False)
        return self._reply_type.FromString(body)

    def start(self, request: Message, timeout: float | None = None) -> LaneCall:
        """Send the request and return at once; the reply is read by `LaneCall.result()`.
        Calls started together run on separate connections, so the daemon serves them while
        the caller does other work."""
        deadline = _deadline(timeout)
        sock = self._lane.send(self._id, request.SerializeToString(), deadline)
        return LaneCall(self._lane, sock, self._reply_type, deadline)

    def future(self, request: Message, timeout: float | None = None) -> _Done:
        """Send without waiting for any reply (the lane's one-way frame)."""
        self._lane.call(self._id, request.SerializeToString(), timeout, one_way=True)
        return _Done()


class Lane:
    """A pool of unix-socket connections to one daemon's lane, each opened with HELLO carrying
    `token` (None: none)."""

    def __init__(self, address: str, token: str | None = None) -> None:
        if not address.startswith(SCHEME):
            raise ValueError(f"not a lane address: {address!r}")
        self.path = address[len(SCHEME) :]
        self._hello = (token or "").encode()
        self._segment_fds: list[int] = []  # handed over with a HELLO answer, not yet taken
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self, deadline: float) -> socket.socket:
        with self._lock:
            if self._closed:
                raise LaneError(grpc.StatusCode.UNAVAILABLE, "lane closed")
            if self._idle:
                return self._idle.pop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(remaining(deadline))
        except TimeoutError:
            sock.close()
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "lane call timed out") from None
        try:
            sock.connect(self.path)
            sock.sendall(REQUEST.pack(len(self._hello), HELLO, 0, 0) + self._hello)
        except TimeoutError:
            sock.close()
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "lane HELLO timed out") from None
        except OSError as exc:
            sock.close()
            raise LaneError(grpc.StatusCode.UNAVAILABLE, f"lane {self.path}: {exc}") from None
        self._hello_answer(sock)
        sock.settimeout(None)  # blocking from now on: each call bounds its own waits
        return sock

    def _hello_answer(self, sock: socket.socket) -> None:
        """Read the HELLO's answer (keeping a segment descriptor that comes with it); LaneError
        when the daemon refuses this client."""
        try:
            head, fds, _, _ = socket.recv_fds(sock, RESPONSE.size, _MAX_FDS)
            if len(head) < RESPONSE.size:
                head += bytes(recv_exact(sock, RESPONSE.size - len(head)))
        except TimeoutError:
            sock.close()
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "lane HELLO timed out") from None
        except (LaneClosed, OSError) as exc:
            sock.close()
            raise LaneError(grpc.StatusCode.UNAVAILABLE, f"lane HELLO: {exc}") from None
        with self._lock:
            keep = not self._segment_fds and not self._closed
            if keep:
                self._segment_fds = list(fds)
        if not keep:
            for fd in fds:
                os.close(fd)
        length, status, _ = RESPONSE.unpack(head)
        body = bytes(recv_exact(sock, length)) if length else b""
        if status != STATUS_OK:
            sock.close()
            code = _STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
            raise LaneError(code, body.decode(errors="replace"))

    def take_segment_fds(self) -> list[int]:
        """The segment descriptors the daemon handed over (the caller now owns them), else []."""
        with self._lock:
            fds, self._segment_fds = self._segment_fds, []
        return fds

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()

    def call(self, method: int, payload: bytes, timeout: float | None, *, one_way: bool) -> bytes:
        """One request (and, unless one-way, its response) within `timeout` seconds (None: no
        bound). Raises LaneError."""
        deadline = _deadline(timeout)
        sock = self.send(method, payload, deadline, one_way=one_way)
        if one_way:
            self._give_back(sock)
            return b""
        return self.finish(sock, deadline)

    def send(
        self, method: int, payload: bytes, deadline: float, *, one_way: bool = False
    ) -> socket.socket:
        """Send a request on a connection of its own before `deadline` (time.monotonic();
        math.inf: none); `finish` reads its reply. LaneError."""
        sock = self._take(deadline)
        try:
            _send_all(
                sock,
                REQUEST.pack(len(payload), method, ONE_WAY if one_way else 0, 0) + payload,
                deadline,
            )
        except TimeoutError:
            sock.close()
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "lane call timed out") from None
        except OSError as exc:
            sock.close()
            raise LaneError(grpc.StatusCode.UNAVAILABLE, f"lane: {exc}") from None
        return sock

    def finish(self, sock: socket.socket, deadline: float = math.inf) -> bytes:
        """The reply to the request just sent on `sock` (which goes back to the pool), before
        `deadline`. Raises LaneError. Nothing but this reply can arrive on `sock` now, so the
        frame head and a small body come in one read."""
        try:
            status, retry_ms, body = _read_reply(sock, deadline)
        except TimeoutError:
            sock.close()
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "lane call timed out") from None
        except (LaneClosed, OSError) as exc:
            sock.close()
            raise LaneError(grpc.StatusCode.UNAVAILABLE, f"lane: {exc}") from None
        self._give_back(sock)
        if status != STATUS_OK:
            code = _STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
            raise LaneError(code, body.decode(errors="replace"), retry_ms)
        return body

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            fds, self._segment_fds = self._segment_fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.close()


_FIRST_READ = 16 << 10  # a reply this small (a miss, a lookup, most acquires) is one recv


# Before it sleeps on a reply, a call polls the socket for up to this long (non-blocking tries,
# yielding the CPU between them): most lane replies come within it, and a thread that never
# sleeps is not woken by the kernel. Measured on the 2-core development machine: a same-host get
# of one missing page, 174-186 us p50 sleeping at once, 114-119 us polling 100 us; the first
# reservation and last commit of a pipelined 64 x 1 MiB put take 0.1-0.3 ms, past 100 us, and
# polling 500 us took that put from 0.71-0.79x memcpy to 0.79-0.82x (interleaved runs). The cost
# is at most this much CPU a call, of a thread that would otherwise wait idle.
_SPIN_S = 500e-6


def _deadline(timeout: float | None) -> float:
    return math.inf if timeout is None else time.monotonic() + timeout


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Every byte of `data` sent on `sock` before `deadline` (a request usually goes at once)."""
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(memoryview(data)[sent:] if sent else data, NOWAIT)
        except BlockingIOError:
            wait_ready(sock, select.POLLOUT, deadline)


def _read_reply(sock: socket.socket, deadline: float = math.inf) -> tuple[int, int, bytes]:
    """(status, retry-after ms, body) of the one reply frame due on `sock`, before `deadline`
    (TimeoutError past it); its first receive polls briefly before it sleeps."""
    head = RESPONSE.size
    buf = bytearray(_FIRST_READ)
    view = memoryview(buf)
    got = 0
    while got < head:
        n = recv_some(sock, view[got:], deadline, 0.0 if got else _SPIN_S)
        if n == 0:
            raise LaneClosed("lane closed by peer")
        got += n
    length, status, retry_ms = RESPONSE.unpack_from(buf)
    total = head + length
    if total > _FIRST_READ:  # the rest straight into a buffer of its size
        out = bytearray(length)
        out[: got - head] = view[head:got]
        view, got, total = memoryview(out), got - head, length
        head = 0
    while got < total:
        n = recv_some(sock, view[got:total], deadline)
        if n == 0:
            raise LaneClosed("lane closed by peer")
        got += n
    return status, retry_ms, bytes(view[head:total])


class LaneStub:
    """Drop-in for StoreStub: unary calls over the lane, streams over gRPC."""

    def __init__(self, lane: Lane, grpc_stub: StoreStub) -> None:
        self.lane = lane
        self.NodeInfo = _LaneMethod(lane, "NodeInfo")
        self.Lookup = _LaneMethod(lane, "Lookup")
        self.Reserve = _LaneMethod(lane, "Reserve")
        self.Commit = _LaneMethod(lane, "Commit")
        self.Acquire = _LaneMethod(lane, "Acquire")
        self.Release = _LaneMethod(lane, "Release")
        self.Renew = _LaneMethod(lane, "Renew")
        self.Delete = _LaneMethod(lane, "Delete")
        self.Stats = _LaneMethod(lane, "Stats")
        self.Put = grpc_stub.Put
        self.Get = grpc_stub.Get
        self.Watch = grpc_stub.Watch
