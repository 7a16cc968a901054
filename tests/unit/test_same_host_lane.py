"""The lane client's reply reader (client/transports/lane.py `_read_reply`): a reply frame read
whole however the kernel splits it — in one read when small, in pieces, or larger than the first
read — and a peer that closes mid-frame is LaneClosed, never a short body. Its wait polls
briefly, then sleeps until the reply comes or the call's deadline passes; the socket stays
blocking."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from client.transports.lane import _FIRST_READ, _read_reply
from client.transports.lane_protocol import RESPONSE, LaneClosed


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def frame(body: bytes, status: int = 0, retry_ms: int = 0) -> bytes:
    return RESPONSE.pack(len(body), status, retry_ms) + body


@pytest.mark.parametrize(
    "size", [0, 1, 100, _FIRST_READ - RESPONSE.size, _FIRST_READ, 3 * _FIRST_READ + 7]
)
def test_a_reply_of_any_size_is_read_whole(
    pair: tuple[socket.socket, socket.socket], size: int
) -> None:
    client, daemon = pair
    body = bytes(i % 251 for i in range(size))
    daemon.sendall(frame(body, status=5, retry_ms=42))
    assert _read_reply(client) == (5, 42, body)


class Trickle:
    """A socket whose reads return the frame in the given pieces, one piece (at most) a read."""

    def __init__(self, data: bytes, cuts: list[int]) -> None:
        self.pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        self.reads = 0

    def recv_into(self, view: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        self.reads += 1
        if not self.pieces:
            return 0
        piece = self.pieces[0]
        room = min(len(view), nbytes or len(view))
        view[: min(room, len(piece))] = piece[:room]
        if room < len(piece):
            self.pieces[0] = piece[room:]
        else:
            self.pieces.pop(0)
        return min(room, len(piece))


@pytest.mark.parametrize(
    "cuts", [[3], [RESPONSE.size], [RESPONSE.size + 1, 5000], [7, _FIRST_READ + 2, 19_000]]
)
def test_a_reply_split_anywhere_is_read_whole(cuts: list[int]) -> None:
    body = bytes(range(200)) * 100  # 20000 bytes: more than the first read
    sock = Trickle(frame(body, status=3), cuts)
    assert _read_reply(sock) == (3, 0, body)  # type: ignore[arg-type]
    assert not sock.pieces


def test_a_small_reply_that_arrives_whole_takes_one_read() -> None:
    sock = Trickle(frame(b"x" * 300), [])
    assert _read_reply(sock) == (0, 0, b"x" * 300)  # type: ignore[arg-type]
    assert sock.reads == 1


@pytest.mark.parametrize("cut", [2, RESPONSE.size, RESPONSE.size + 10, _FIRST_READ + 5])
def test_a_peer_that_closes_mid_frame_is_lane_closed(
    pair: tuple[socket.socket, socket.socket], cut: int
) -> None:
    client, daemon = pair
    daemon.sendall(frame(bytes(2 * _FIRST_READ))[:cut])
    daemon.shutdown(socket.SHUT_WR)
    with pytest.raises(LaneClosed):
        _read_reply(client)


def test_the_reply_wait_polls_then_sleeps_until_the_reply_or_the_deadline() -> None:
    """A reply there at once is read with no wait; one that comes after the poll window is
    read by the sleeping wait; none by the deadline is TimeoutError with nothing consumed; the
    socket is left blocking (no timeout set or changed)."""
    import threading
    import time

    from client.transports import lane as lane_mod

    a, b = socket.socketpair()
    try:
        b.sendall(frame(b"now"))
        assert _read_reply(a, time.monotonic() + 1.0) == (0, 0, b"now")
        timer = threading.Timer(0.2, b.sendall, (frame(b"later"),))
        timer.start()
        started = time.monotonic()
        assert _read_reply(a, time.monotonic() + 5.0) == (0, 0, b"later")
        assert time.monotonic() - started >= 0.19 > 100 * lane_mod._SPIN_S  # slept, then woke
        timer.join()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            _read_reply(a, time.monotonic() + 0.05)
        assert 0.04 <= time.monotonic() - started < 1.0
        b.sendall(frame(b"after"))  # the timed-out wait consumed nothing
        assert _read_reply(a) == (0, 0, b"after")
        assert a.gettimeout() is None
        b.close()
        with pytest.raises(LaneClosed):  # EOF while waiting
            _read_reply(a, time.monotonic() + 1.0)
    finally:
        a.close()
