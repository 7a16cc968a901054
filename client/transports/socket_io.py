"""Deadline-bounded waits on blocking sockets, shared by the same-host lane and the TCP data path.

Plain sockets stay in blocking mode, and each receive or send is first tried without waiting
(`NOWAIT`): when the bytes are there the call is one syscall. Only a try that would block
waits, in one poll() bounded by the deadline. (A Python socket with a timeout instead polls
before every call and takes an ioctl for every change of its timeout.)
"""

from __future__ import annotations

import math
import os
import select
import socket
import ssl
import time

NOWAIT = socket.MSG_DONTWAIT


def remaining(deadline: float) -> float | None:
    """Seconds left before `deadline` (None: no deadline, `math.inf`); TimeoutError once it
    has passed."""
    if deadline == math.inf:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def wait_ready(sock: socket.socket, events: int, deadline: float) -> None:
    """Sleep until `sock` is ready for `events`; TimeoutError past `deadline`."""
    left = remaining(deadline)
    poller = select.poll()
    poller.register(sock, events)
    if not poller.poll(None if left is None else max(math.ceil(left * 1000), 1)):
        raise TimeoutError


def recv_some(
    sock: socket.socket, into: memoryview, deadline: float, spin_s: float = 0.0
) -> int:
    """One receive into `into` (0: the peer closed), waiting at most until `deadline`; with
    `spin_s`, a receive that would block is retried for that long (yielding the CPU between
    tries) before it sleeps."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(remaining(deadline))
        return sock.recv_into(into)
    spin_until = 0.0
    while True:
        try:
            return sock.recv_into(into, 0, NOWAIT)
        except BlockingIOError:
            if spin_s:
                now = time.perf_counter()
                if not spin_until:
                    spin_until = now + spin_s
                if now < spin_until:
                    os.sched_yield()
                    continue
            wait_ready(sock, select.POLLIN, deadline)
