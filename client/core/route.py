"""Which data path serves a call, and the settings every call of one client runs under.

Pure: the shell says what its connection offers (`Route`); the core picks the path from it, so
both clients choose alike. Paths: "shm" (the same-host path: payloads copied straight into and
out of the daemon's mapped DRAM segment, control calls over the lane or the unix socket), "bulk"
(the remote UCX or TCP data path: payloads straight between the caller's buffers and DRAM
slots), "grpc" (chunked gRPC streams, the fallback every daemon serves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from client.contract.types import IoClass, Limits, Tier
from client.core.retry import RetryPolicy
from client.core.stripes import NO_STRIPING, Striping

Path = Literal["shm", "bulk", "grpc"]


@dataclass(frozen=True, slots=True)
class Settings:
    """One client's call settings: the deadline of each call (shared by its attempts), the
    retry policy, the default I/O class, the largest gRPC message it sends or takes, and how a
    large batch is split over parallel TCP connections (client/core/stripes.py; off unless
    given)."""

    timeout_s: float
    policy: RetryPolicy
    io_class: IoClass
    max_message_bytes: int
    striping: Striping = NO_STRIPING

    def io(self, io_class: IoClass | None) -> IoClass:
        """The I/O class of one call: its own, else the client's."""
        return IoClass(io_class) if io_class is not None else self.io_class


@dataclass(frozen=True, slots=True)
class Route:
    """What the connection a call runs on offers.

    `limits`: the node's. `same_host`: the daemon's segments are mapped here. `bulk`: a UCX or
    TCP data path is open to the daemon (remote only); `bulk_lookups`: it serves lookups too
    (TCP does, UCX does not); `bulk_stripes`: a large batch may go over several of its
    connections at once (`Together`; TCP). `pipelined`: the shell can keep two control calls in flight
    (`Start`/`Join`), so a large same-host put overlaps its halves.
    """

    limits: Limits
    same_host: bool = False
    bulk: bool = False
    bulk_lookups: bool = False
    bulk_stripes: bool = False
    pipelined: bool = False


def put_path(route: Route, tier: Tier | None) -> Path:
    """A put goes into the mapped DRAM segment unless it asks for another tier, then over the
    bulk path when one is open, else over gRPC."""
    if route.same_host:
        return "shm" if tier in (None, Tier.DRAM) else "grpc"
    return "bulk" if route.bulk else "grpc"


def get_path(route: Route) -> Path:
    """A get reads the mapped segments on the same host, else the bulk path, else gRPC."""
    if route.same_host:
        return "shm"
    return "bulk" if route.bulk else "grpc"


def lookup_path(route: Route) -> Path:
    """A lookup goes over the TCP data path when one is open (one round trip on a connection
    already made), else over the control channel (the lane on the same host, or gRPC)."""
    return "bulk" if route.bulk_lookups and not route.same_host else "grpc"


def verifies(route: Route, verify: bool | None) -> bool:
    """Whether a get checks payload checksums: as asked, else off the same-host path only (the
    daemon verifies what it reads from SSD; bytes over a network are checked here)."""
    return verify if verify is not None else not route.same_host
