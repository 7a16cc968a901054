"""AsyncTcpTransport sends a call again only on a kept connection that ended before any byte
of its reply: one that ended part-way through the reply may already have stored a put, so the
call fails with TransportFailed for the caller's fallback to decide; a resend keeps the call's
one deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest

from client.transports.tcp_endpoint import ByteStream, EndpointClosed
from client.transports.tcp_protocol import Recv, Send
from client.transports.tcp_transport import AsyncTcpTransport, TransportFailed

REPLY = b"0123456789abcdef"


class FakeEndpoint(ByteStream):
    """Answers REPLY, or ends the connection after `fail_after` bytes of it."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.sent: list[bytes] = []
        self.aborted = False

    async def send(self, data: Any) -> None:
        self.sent.append(bytes(data))

    async def recv(self, into: Any) -> None:
        view = memoryview(into).cast("B")
        if self.fail_after is not None:
            view[: self.fail_after] = REPLY[: self.fail_after]
            self.received += self.fail_after
            raise EndpointClosed("the peer closed the TCP connection")
        view[:] = REPLY[: view.nbytes]
        self.received += view.nbytes

    def abort(self) -> None:
        self.aborted = True


def op() -> Generator[Send | Recv, None, bytes]:
    yield Send((b"call",))
    into = memoryview(bytearray(len(REPLY)))
    yield Recv(into)
    return bytes(into)


def transport(kept: FakeEndpoint, fresh: list[FakeEndpoint]) -> tuple[AsyncTcpTransport, list[int]]:
    t = AsyncTcpTransport("tcp://127.0.0.1:1")
    t._idle.append(kept)
    connects: list[int] = []

    async def connect(timeout_s: float) -> ByteStream:
        connects.append(1)
        return fresh.pop(0)

    t._connect = connect  # type: ignore[method-assign]
    return t, connects


def test_a_kept_connection_closed_before_the_reply_is_resent_on_a_fresh_one() -> None:
    kept, good = FakeEndpoint(fail_after=0), FakeEndpoint()
    t, connects = transport(kept, [good])
    assert asyncio.run(t._call(op, 5.0)) == REPLY
    assert kept.aborted and connects == [1] and good.sent == [b"call"]


def test_a_kept_connection_closed_part_way_through_the_reply_is_not_resent() -> None:
    kept, good = FakeEndpoint(fail_after=5), FakeEndpoint()
    t, connects = transport(kept, [good])
    with pytest.raises(TransportFailed):
        asyncio.run(t._call(op, 5.0))
    assert kept.aborted and connects == [] and good.sent == []


def test_a_fresh_connection_that_ends_is_not_resent() -> None:
    t = AsyncTcpTransport("tcp://127.0.0.1:1")
    bad = [FakeEndpoint(fail_after=0), FakeEndpoint()]

    async def connect(timeout_s: float) -> ByteStream:
        return bad.pop(0)

    t._connect = connect  # type: ignore[method-assign]
    with pytest.raises(TransportFailed):
        asyncio.run(t._call(op, 5.0))
    assert len(bad) == 1  # the second endpoint was never taken
