"""`HeadHoldingTransport`: a response's head leaves with its first body bytes, in one write, and
is never held past the loop turn that wrote it, nor lost on close."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import cast

import pytest

from engine.router.http_protocol import HeadHoldingTransport, protocol_class

pytestmark = pytest.mark.unit

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


@dataclass
class Wire:
    writes: list[bytes] = field(default_factory=list)
    closed: bool = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def _held(wire: Wire, loop: asyncio.AbstractEventLoop) -> HeadHoldingTransport:
    return HeadHoldingTransport(cast(asyncio.Transport, wire), loop)


def test_a_head_and_its_body_leave_in_one_write() -> None:
    async def run() -> tuple[list[bytes], list[bytes], int]:
        wire = Wire()
        t = _held(wire, asyncio.get_running_loop())
        t.write(HEAD)
        before = list(wire.writes)
        t.write(b"ok")
        t.write(b"more")  # not a head: straight through
        await asyncio.sleep(0)  # the turn ends: nothing left to flush
        return before, wire.writes, t.joined

    before, writes, joined = asyncio.run(run())
    assert before == []
    assert writes == [HEAD + b"ok", b"more"] and joined == 1


def test_a_head_alone_leaves_when_its_loop_turn_ends() -> None:
    async def run() -> tuple[list[bytes], list[bytes]]:
        wire = Wire()
        t = _held(wire, asyncio.get_running_loop())
        t.write(HEAD)
        held = list(wire.writes)
        await asyncio.sleep(0)
        return held, wire.writes

    held, writes = asyncio.run(run())
    assert held == [] and writes == [HEAD]


def test_close_writes_what_is_held_first_and_the_rest_is_the_transports() -> None:
    async def run() -> tuple[list[bytes], bool, str]:
        wire = Wire()
        t = _held(wire, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        t.close()
        await asyncio.sleep(0)  # the pending flush finds nothing (and a closed transport)
        return wire.writes, wire.closed, t.get_extra_info("peername")

    writes, closed, info = asyncio.run(run())
    assert writes == [b"HTTP/1.1 204 No Content\r\n\r\n"] and closed
    assert info == "info:peername"


def test_the_router_runs_the_holding_protocol_where_httptools_is_installed() -> None:
    pytest.importorskip("httptools")
    cls = protocol_class()
    assert cls is not None and cls.__name__ == "HeadHoldingHttpTools"
