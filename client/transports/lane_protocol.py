"""The same-host control lane: the store's unary RPCs, framed over a unix socket.

On one host a gRPC round trip in Python costs a few hundred microseconds, more than copying a
batch of 64 KiB pages. The lane carries the *same protobuf messages* as the gRPC service, in
length-prefixed frames over a unix socket, for the unary calls of the same-host path (NodeInfo,
Lookup, Reserve, Commit, Acquire, Release, Renew, Delete, Stats). Streams (Put, Get, Watch)
stay on gRPC. Both ends share this module so the framing is defined once.

Request frame:  u32 payload length | u8 method | u8 flags | u16 reserved | payload
Response frame: u32 payload length | u8 status | 3 reserved | u32 retry-after ms | payload

`status` is 0 for OK (payload = the serialized reply), else a gRPC status code number (payload =
UTF-8 error details). Flag ONE_WAY asks for no response (used for Release).

The first frame of every connection is HELLO (method 0, payload = the client's bearer token in
UTF-8, empty for none): the daemon binds the connection to the token's principal, and answers OK
only to a principal it trusts with the same-host path (`trusted_local`, and the connecting
process runs as the daemon's user or one of `auth.local_uids`, as the kernel reports it). Any
other answer (UNAUTHENTICATED, PERMISSION_DENIED) comes with the connection closed: that client
uses the remote path. An open daemon (no tokens) also serves a connection that starts without
HELLO, as the OPEN principal, when its user is trusted.
"""

from __future__ import annotations

import socket
import struct

from google.protobuf.message import Message

from kvstore_pb import store_pb2 as pb

REQUEST = struct.Struct("<IBBH")
RESPONSE = struct.Struct("<IB3xI")
ONE_WAY = 1
STATUS_OK = 0
SCHEME = "lane:"
HELLO = 0  # the first frame's method id (not a protobuf call)

# method id -> (name, request type, response type); ids are part of the protocol: never reuse.
METHODS: dict[int, tuple[str, type[Message], type[Message]]] = {
    1: ("NodeInfo", pb.NodeInfoRequest, pb.NodeInfoResponse),
    2: ("Lookup", pb.LookupRequest, pb.LookupResponse),
    3: ("Reserve", pb.ReserveRequest, pb.ReserveResponse),
    4: ("Commit", pb.CommitRequest, pb.CommitResponse),
    5: ("Acquire", pb.AcquireRequest, pb.AcquireResponse),
    6: ("Release", pb.ReleaseRequest, pb.ReleaseResponse),
    7: ("Renew", pb.RenewRequest, pb.RenewResponse),
    8: ("Delete", pb.DeleteRequest, pb.DeleteResponse),
    9: ("Stats", pb.StatsRequest, pb.StatsResponse),
}
METHOD_IDS: dict[str, int] = {name: mid for mid, (name, _, _) in METHODS.items()}


class LaneClosed(ConnectionError):
    """The peer closed the lane mid-frame."""


def recv_exact(sock: socket.socket, n_bytes: int) -> bytearray:
    """Read exactly n_bytes; raises LaneClosed on EOF."""
    buf = bytearray(n_bytes)
    view = memoryview(buf)
    got = 0
    while got < n_bytes:
        n = sock.recv_into(view[got:], n_bytes - got)
        if n == 0:
            raise LaneClosed("lane closed by peer")
        got += n
    return buf


def recv_growing(sock: socket.socket, n_bytes: int, step_bytes: int = 1 << 20) -> bytearray:
    """Read exactly n_bytes, committing memory only as they arrive (a step at a time): a frame
    header that announces much and sends little costs one step. Raises LaneClosed on EOF."""
    if n_bytes <= step_bytes:
        return recv_exact(sock, n_bytes)
    buf = bytearray()
    while len(buf) < n_bytes:
        buf += recv_exact(sock, min(step_bytes, n_bytes - len(buf)))
    return buf
