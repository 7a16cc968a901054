"""The daemon's reply poll (`server.reply_poll_us`): after answering, a TCP data or lane
connection's thread polls its socket for the next request, bounded, then sleeps in the kernel.

Shown here: the window is bounded by config (refused outside [0, 1000] us); a connection
thread that has answered and then sees nothing uses no CPU once the window is over (its own
CPU clock stays flat while it idles, at the largest window allowed); a request that comes
during the window, or after it, is served alike; the lane's header receive takes a header
that is already there without blocking, and one that comes later in a blocking receive.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from conftest import DaemonFactory, RunningDaemon, make_scope

from client.contract.errors import InvalidArgument
from kvstore.config import load_config
from kvstore.lane import next_header
from kvstore.tcp_server import TcpServer

pytestmark = pytest.mark.integration

WIDEST = {"server.tcp": "true", "server.reply_poll_us": "1000"}
IDLE_S = 0.3
# CPU a thread blocked in the kernel may still be charged over IDLE_S (a stray wake-up); a
# thread still polling would be charged most of IDLE_S.
FLAT_S = 0.02


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == prefix]


def _cpu_s(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _idle_cpu_s(threads: list[threading.Thread]) -> list[float]:
    """CPU each of `threads` used over IDLE_S, counted from past the poll window."""
    time.sleep(0.01)  # ten times the widest window: every poll is over
    before = [_cpu_s(t) for t in threads]
    time.sleep(IDLE_S)
    return [_cpu_s(t) - b for t, b in zip(threads, before, strict=True)]


def _misses(d: RunningDaemon, shared_memory: bool, calls: int) -> None:
    client = d.client(shared_memory=shared_memory)
    scope = make_scope("poll")
    buf = [bytearray(scope.page_payload_bytes)]
    for _ in range(calls):
        assert client.get(scope, [bytes(16)], buf, tokens=None).hit_count == 0
        assert client.lookup(scope, [bytes(16)] * 4).hit_count == 0


def test_the_reply_poll_is_bounded_by_config() -> None:
    for bad in ("-1", "1001"):
        with pytest.raises(InvalidArgument, match="reply_poll_us"):
            load_config(None, env={}, overrides={"server.reply_poll_us": bad})
    assert load_config(None, env={}, overrides={}).server.reply_poll_us == 50.0
    with pytest.raises(InvalidArgument, match="reply poll"):
        TcpServer(None, "127.0.0.1", reply_poll_s=0.002)  # type: ignore[arg-type]


def test_a_tcp_connection_thread_uses_no_cpu_once_its_poll_window_is_over(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(settings=WIDEST)
    _misses(d, shared_memory=False, calls=20)
    threads = _threads("strata-tcp-conn")
    assert threads  # the client keeps its connection: its thread waits for the next frame
    assert max(_idle_cpu_s(threads)) < FLAT_S
    _misses(d, shared_memory=False, calls=3)  # after a sleep in the kernel: served alike
    assert max(_idle_cpu_s(_threads("strata-tcp-conn"))) < FLAT_S


def test_a_lane_connection_thread_uses_no_cpu_once_its_poll_window_is_over(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory(settings=WIDEST)
    _misses(d, shared_memory=True, calls=20)
    threads = _threads("strata-lane")
    assert threads
    assert max(_idle_cpu_s(threads)) < FLAT_S
    _misses(d, shared_memory=True, calls=3)
    assert max(_idle_cpu_s(_threads("strata-lane"))) < FLAT_S


def test_the_lane_header_receive_polls_then_blocks() -> None:
    a, b = socket.socketpair()
    try:
        head = bytearray(8)
        a.sendall(b"12345678abc")
        assert next_header(b, head, 1e-3) == bytearray(b"12345678")  # there: no wait
        assert b.recv(3) == b"abc"  # nothing read past the header
        a.sendall(b"1234")  # half a header now, the rest after any window
        timer = threading.Timer(0.05, a.sendall, (b"5678",))
        timer.start()
        started = time.monotonic()
        assert next_header(b, head, 1e-4) == bytearray(b"12345678")
        assert time.monotonic() - started >= 0.04  # the rest came in the blocking receive
        timer.join()
        a.close()
        with pytest.raises(ConnectionError):
            next_header(b, head, 1e-4)
    finally:
        a.close()
        b.close()


def test_calls_spaced_wider_than_the_window_are_served(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(settings={"server.tcp": "true", "server.reply_poll_us": "20"})
    scope = make_scope("spaced")
    tcp = d.client(shared_memory=False)
    shm = d.client(shared_memory=True)
    for _ in range(3):
        for c in (tcp, shm):
            assert c.lookup(scope, [bytes(16)]).hit_count == 0
        time.sleep(0.005)  # well past the window: each next request wakes a sleeping thread
