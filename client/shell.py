"""What the two client shells hold alike: their options, resolved once, and what a call's
`Route` is made of.

`StoreClient` (blocking) and `AsyncStoreClient` (asyncio) both derive from `ClientShell`: the
constructor (its arguments are documented on `StoreClient`; each shell adds its own I/O state in
`_init_io_state`), the call settings the core runs
under, the caller's TLS options and token, the choice of bulk data path (`UcxLink`), the count
of pages dropped by verification, and the facts of a connection the core decides paths from.
Everything that does I/O stays in the shells.
"""

from __future__ import annotations

from typing import Literal, Protocol

from client.contract.errors import InvalidArgument
from client.contract.types import IoClass, NodeInfo
from client.core.retry import RetryPolicy
from client.core.route import Route, Settings
from client.core.stripes import resolve_striping
from client.transports._wire import DEFAULT_MAX_MESSAGE_BYTES, auth_metadata, resolve_token
from client.transports.shm import SegmentMap
from client.transports.tls import TlsOptions, resolve_tls
from client.transports.ucx_protocol import TCP_SCHEME
from client.transports.ucx_transport import UcxLink, UcxTransport

Transport = Literal["shm", "grpc", "ucx", "tcp"]


class Connection(Protocol):
    """What a shell's connection shows the shared code: the node and the mapped segments."""

    @property
    def node(self) -> NodeInfo: ...
    @property
    def maps(self) -> tuple[SegmentMap, ...]: ...


class ClientShell:
    """The state both clients share; see `StoreClient` for the arguments."""

    def __init__(
        self,
        address: str,
        *,
        shared_memory: bool | None = None,
        timeout_s: float = 10.0,
        retries: int = 2,
        io_class: IoClass = IoClass.NORMAL,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ucx: bool | None = None,
        tcp: bool | None = None,
        tls: TlsOptions | bool | None = None,
        token: str | None = None,
        tcp_stripes: int | None = None,
        tcp_stripe_min_bytes: int | None = None,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or max_message_bytes <= 0:
            raise InvalidArgument("timeout_s and max_message_bytes must be > 0, retries >= 0")
        self.address = address
        self._shared_memory = shared_memory
        self._timeout_s = timeout_s
        self._settings = Settings(
            timeout_s,
            RetryPolicy(retries),
            IoClass(io_class),
            max_message_bytes,
            resolve_striping(tcp_stripes, tcp_stripe_min_bytes),
        )
        self._max_message_bytes = max_message_bytes
        self._tls = resolve_tls(tls)
        self._token = resolve_token(token)
        self._metadata = auth_metadata(self._token)  # for the calls made on a raw channel
        self._ucx = UcxLink(ucx, address, tcp, self._tls, self._token)
        self.corrupt_pages = 0
        """Pages dropped by verification since the client was made (each also a miss)."""
        self._init_io_state()

    def _init_io_state(self) -> None:
        """The shell's own state: its locks, the connection slot, lease releases in flight."""
        raise NotImplementedError

    def _bulk_for(self, conn: Connection) -> UcxTransport | None:
        """The UCX or TCP transport of the remote path of `conn`, or None (use gRPC); opened
        (a blocking connect) on first ask."""
        if conn.maps or self._ucx.off:
            return None
        return self._ucx.transport(
            conn,
            conn.node.ucx_address or "",
            tcp_address=conn.node.tcp_address or "",
            timeout_s=self._timeout_s,
            max_page_bytes=conn.node.limits.max_page_bytes,
        )

    def _route_of(self, conn: Connection, bulk: UcxTransport | None, *, pipelined: bool) -> Route:
        """What `conn` offers a call, with `bulk` its open bulk transport (None: none)."""
        tcp = bulk is not None and bulk.tcp is not None
        return Route(
            limits=conn.node.limits,
            same_host=bool(conn.maps),
            bulk=bulk is not None,
            bulk_lookups=tcp,
            bulk_stripes=tcp and self._settings.striping.stripes > 1,
            pipelined=pipelined,
        )

    @staticmethod
    def _transport_of(conn: Connection, bulk: UcxTransport | None) -> Transport:
        """The data path name of `conn` with `bulk` its bulk transport (None: none)."""
        if conn.maps:
            return "shm"
        if bulk is None:
            return "grpc"
        return "tcp" if bulk.address.startswith(TCP_SCHEME) else "ucx"
