"""The I/O steps a client operation asks its shell to take, and the plan type that yields them.

An operation of the core (client/core/lookup.py, get.py, put.py, admin.py) is a generator, a
*plan*: it yields one step at a time and is sent back what the step produced, or has the step's
typed error (client.contract.errors) thrown into it; its return value is the call's result. The
blocking shell (client/store_client.py) takes each step with blocking calls, the asyncio shell
(client/async_client.py) with awaits. Both hand every step's failure to the plan as a typed
error (a gRPC status is mapped first), so what to retry, release or fall back on is decided here
once. A step names what to do, never how: no channel, socket or loop appears in one.

What each step sends back (the shell's half of the contract):

- `Connect`: the `Route` of the connection the call runs on, connecting first if need be (an
  operation yields it after checking its arguments, so a bad call fails before any I/O).
- `Call`: the reply message (one attempt of a unary control call; gRPC or the same-host lane).
- `Start`: an opaque handle of the call now in flight; `Join(handle)`: its reply;
  `Cancel(handle)`: None (the reply, if any, is ignored).
- `Pause`: None, after sleeping.
- `StreamGet`: None, once the Get stream's messages were all fed to its assembler.
- `StreamPut`: the PutResponse of the Put stream made of `messages`.
- `CheckSegments`: None; Unavailable when the daemon's shared segments are no longer the ones
  mapped (it restarted): the shell then drops the connection and releases `lease_id` itself.
- `CopyIn`: the put statuses after copying payloads into reserved slots (client/transports/shm.py).
- `CopyOut`: `(headers, corrupt)` after copying acquired pages out of their slots.
- `Release`: None at once (sent without waiting for the reply; a lease that is not released
  runs out on its own).
- `BulkGet`: `(headers, corrupt)` from the UCX or TCP data path, or `BULK_FAILED` when that
  path itself failed (the shell has given it up for the client): the plan goes on over gRPC.
- `BulkPut`: the put statuses, or `BULK_FAILED` likewise.
- `BulkLookup`: the tier of each hit (a tuple of `Tier`) over the TCP data path, or
  `BULK_FAILED` likewise.
- `Dropped`: None, after adding `count` to the client's `corrupt_pages`.
- `Together`: a tuple, one entry per step of `steps` in order: what that step sends back, or
  the typed error (a StrataError) it failed with. The steps are taken at the same time, each on
  a connection of its own (the stripes of a large batch, client/core/stripes.py); a failure of
  one never cancels another, and every one has ended when the tuple is sent back.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias, TypeVar

from google.protobuf.message import Message

from client.contract.scope import Scope
from client.core.assembler import GetAssembler
from kvstore_pb import store_pb2 as pb

# Steps are slotted but not frozen: a call builds several of them on its hot path, and a frozen
# dataclass's __init__ (one object.__setattr__ per field) measured about twice the cost (~1 µs
# against ~0.5 µs a step here). Nothing changes a step once it is yielded.

R = TypeVar("R")
M = TypeVar("M", bound=Message)


@dataclass(slots=True)
class Connect:
    """Connect (if not yet connected). `data`: the call may use the bulk data path, so settle
    it (open it on first use) before answering."""

    data: bool = False


@dataclass(slots=True)
class Call:
    """One attempt of the unary control call `method` (a Store RPC name) within `timeout_s`."""

    method: str
    request: Message
    timeout_s: float


@dataclass(slots=True)
class Start:
    """`Call`, without waiting: the reply is collected by a later `Join` of the handle."""

    method: str
    request: Message
    timeout_s: float


@dataclass(slots=True)
class Join:
    handle: object


@dataclass(slots=True)
class Cancel:
    handle: object


@dataclass(slots=True)
class Pause:
    seconds: float


@dataclass(slots=True)
class StreamGet:
    """One attempt of the Get stream of `request`, each message fed to `assembler`."""

    request: pb.GetRequest
    assembler: GetAssembler
    timeout_s: float


@dataclass(slots=True)
class StreamPut:
    """One attempt of a Put stream of the serialized PutRequests `messages`."""

    messages: Iterator[bytes]
    timeout_s: float


@dataclass(slots=True)
class CheckSegments:
    lease_id: int


@dataclass(slots=True)
class CopyIn:
    reply: pb.ReserveResponse
    payloads: Sequence[memoryview]


@dataclass(slots=True)
class CopyOut:
    reply: pb.AcquireResponse
    scope: Scope
    keys: Sequence[bytes]
    into: Sequence[memoryview]
    verify: bool


@dataclass(slots=True)
class Release:
    lease_id: int


@dataclass(slots=True)
class BulkGet:
    """A get over the bulk data path: `request` a serialized GetRequest for `keys`."""

    request: bytes
    scope_digest: bytes
    keys: Sequence[bytes]
    into: Sequence[memoryview]
    verify: bool
    timeout_s: float


@dataclass(slots=True)
class BulkPut:
    """A put over the bulk data path: `begin` a serialized PutBegin, then each page."""

    begin: bytes
    headers: Sequence[bytes]
    payloads: Sequence[memoryview]
    timeout_s: float


@dataclass(slots=True)
class BulkLookup:
    """A lookup over the TCP data path: `request` a serialized LookupRequest of `asked` keys."""

    request: bytes
    asked: int
    timeout_s: float


@dataclass(slots=True)
class Dropped:
    """Pages a get dropped by verification (each also a miss), for the client's count."""

    count: int


@dataclass(slots=True)
class Together:
    """Take the bulk steps `steps` at the same time, each on a connection of its own."""

    steps: tuple[BulkGet, ...] | tuple[BulkPut, ...]


class _BulkFailed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "BULK_FAILED"


BULK_FAILED: Final = _BulkFailed()
"""What a bulk step sends back when the UCX or TCP path itself failed (use gRPC instead)."""

Step: TypeAlias = (
    Connect
    | Call
    | Start
    | Join
    | Cancel
    | Pause
    | StreamGet
    | StreamPut
    | CheckSegments
    | CopyIn
    | CopyOut
    | Release
    | BulkGet
    | BulkPut
    | BulkLookup
    | Dropped
    | Together
)
Plan: TypeAlias = Generator[Step, object, R]
"""An operation: yields steps, is sent each step's outcome, returns the result."""
