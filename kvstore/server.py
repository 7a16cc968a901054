"""The daemon process: gRPC server (TCP), same-host lane (unix socket), UCX data path (when ucxx
is installed), health, metrics, lifecycle.

`create_server(config, store)` builds and binds a gRPC server (tests bind port 0) and returns it
with its port; `Daemon` owns a Store plus that server and the Prometheus endpoint, and is what
`strata serve` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client.cluster.membership import Member, TierCapacity
from client.transports.hostid import host_id
from client.transports.lane_protocol import SCHEME
from kvstore.auth import Authenticator
from kvstore.cluster import Registration
from kvstore.config import StoreConfig, format_size
from kvstore.errors import Unavailable
from kvstore.lane import LaneServer
from kvstore.metrics import (
    TIER_NAMES,
    AuthCollector,
    MembershipCollector,
    StoreCollector,
    make_registry,
    serve_metrics,
)
from kvstore.service import NodeIdentity, StoreService, add_to_server
from kvstore.store import Store
from kvstore.tcp_server import TcpServer
from kvstore.tiers.dram import ephemeral_segment_name, reclaim_ephemeral_segments
from kvstore.tiers.private import make_private, private_folder, private_umask, restore_umask
from kvstore.tls import ServerTls
from kvstore.ucx_server import BulkServer

log = logging.getLogger(__name__)

SERVICE_NAME = "strata.store.v1.Store"
# Health of this node's cluster membership: NOT_SERVING while etcd cannot confirm it (the store
# itself keeps serving with the last known membership, so "" and SERVICE_NAME stay SERVING).
CLUSTER_SERVICE_NAME = "strata.store.v1.Cluster"


def grpc_options(config: StoreConfig) -> list[tuple[str, int]]:
    n = config.limits.max_message_bytes
    return [
        ("grpc.max_receive_message_length", n),
        ("grpc.max_send_message_length", n),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ]


def create_server(
    config: StoreConfig,
    store: Store,
    *,
    local_address: str = "",
    tls: ServerTls | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer, StoreService]:
    """Build and bind (not start) the gRPC server for `store`.

    Returns (server, bound TCP port, health servicer, store servicer). `local_address` is what
    NodeInfo advertises for same-host control traffic (the lane). With `tls` the port speaks
    TLS only (no plaintext port is opened). Raises Unavailable when the address cannot be bound.
    """
    auth = Authenticator.from_config(config.auth)
    auth.check_listen(config.server.host, config.server.allow_open)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.server.workers, thread_name_prefix="strata-rpc"),
        options=grpc_options(config),
    )
    address = f"{config.server.host}:{config.server.port}"
    try:
        if tls is not None:
            port = server.add_secure_port(address, tls.grpc_credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise Unavailable(f"cannot listen on {address}: {exc}") from None
    if port == 0:
        raise Unavailable(f"cannot listen on {address} (in use?)")
    node_id = config.server.node_id or f"{reachable_host(config.server.host)}:{port}"
    service = StoreService(store, NodeIdentity(node_id, host_id(), local_address), auth)
    add_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, port, health_servicer, service


def reachable_host(host: str) -> str:
    """The host part others can use: a wildcard listen address becomes this host's name."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return socket.gethostname()
    return host


def _probe_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise Unavailable(
                f"cannot listen on {host}:{port}: {exc.strerror} (another daemon?)"
            ) from None


@dataclass(frozen=True, slots=True)
class DaemonInfo:
    address: str
    port: int
    local_address: str
    metrics_url: str
    segment_name: str
    ucx_address: str = ""  # "ucx://host:port", or "" without a UCX listener
    tcp_address: str = ""  # "tcp://host:port", or "" without a TCP data listener


class Daemon:
    """A running store daemon. `start()` returns once it serves; `stop()` drains and closes."""

    def __init__(self, config: StoreConfig) -> None:
        if config.server.port == 0 and not config.dram.segment_name:
            # an ephemeral port gets an ephemeral, unique segment (parallel tests, benchmarks);
            # those of daemons that died without removing theirs go first
            reclaim_ephemeral_segments()
            unique = ephemeral_segment_name()
            config = dataclasses.replace(
                config, dram=dataclasses.replace(config.dram, segment_name=unique)
            )
        self.config = config
        self.store: Store | None = None
        self.server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._stop_metrics: Callable[[], None] | None = None
        self.info: DaemonInfo | None = None
        self._lane: LaneServer | None = None
        self._ucx: BulkServer | None = None
        self._tcp: TcpServer | None = None
        self.registration: Registration | None = None
        self._umask: int | None = None  # the umask before start(), restored by stop()
        self._segment_fd = -1  # the DRAM segment, for lane clients of auth.local_uids

    def start(self) -> DaemonInfo:
        """Open the store, bind and start serving. Raises Unavailable (port in use, ...).

        While it runs, the process creates files private to its user (umask 077, restored by
        `stop`); the data folder and what is in it are made private first (kvstore/tiers/
        private.py)."""
        cfg = self.config
        if self._umask is None:
            self._umask = private_umask()
        try:
            _make_paths_private(cfg)
            if cfg.server.port:
                # fail before touching the shared-memory segment a running daemon may own
                _probe_port(cfg.server.host, cfg.server.port)
            tls = ServerTls.from_config(cfg.tls)  # unreadable PEM files: refused before anything
            store = Store(cfg)
        except BaseException:
            self._restore_umask()
            raise
        self.store = store
        try:
            sock = cfg.unix_socket_path
            sock_str = ""
            if sock is not None:
                sock_str = str(
                    sock
                    if cfg.server.port
                    else sock.with_name(f"strata-{uuid.uuid4().hex[:8]}.sock")
                )
            server, port, health_servicer, service = create_server(
                cfg, store, local_address=f"{SCHEME}{sock_str}" if sock_str else "", tls=tls
            )
            if sock_str:
                if cfg.auth.local_uids:  # their clients get the segment by descriptor
                    self._segment_fd = os.open(store.tiers.dram.path, os.O_RDWR | os.O_CLOEXEC)
                self._lane = LaneServer(
                    sock_str,
                    service,
                    cfg.limits.max_message_bytes,
                    service.auth,
                    frozenset(cfg.auth.local_uids),
                    self._segment_fd,
                    reply_poll_s=cfg.server.reply_poll_us / 1e6,
                )
                try:
                    self._lane.start()
                except OSError as exc:
                    log.warning(
                        "no same-host lane at %s (%s); local clients use gRPC", sock_str, exc
                    )
                    self._lane = None
                    service.node = dataclasses.replace(service.node, local_address="")
            if cfg.server.ucx or cfg.server.tcp:
                self._start_bulk(store, service, tls)
            self.server = server
            self._health = health_servicer
            if cfg.cluster.enabled:
                self.registration = Registration(
                    cfg.cluster,
                    self._member(service.node.node_id, port, service.node.host_id),
                    on_stale=lambda stale: health_servicer.set(
                        CLUSTER_SERVICE_NAME,
                        health_pb2.HealthCheckResponse.NOT_SERVING
                        if stale
                        else health_pb2.HealthCheckResponse.SERVING,
                    ),
                )
            registration = self.registration
            metrics_url = ""
            if cfg.server.metrics_port >= 0:
                registry = make_registry(
                    StoreCollector(
                        store.counters,
                        lambda: store.tiers.gauges(),
                        store.scheduler.queue_depths,
                        lambda: len(store.leases),
                        store.namespace_usage,
                    ),
                    MembershipCollector(lambda: registration.stale) if registration else None,
                )
                registry.register(AuthCollector(service.auth.denied_counts))
                self._stop_metrics, mport = serve_metrics(
                    registry, cfg.server.metrics_host, cfg.server.metrics_port
                )
                metrics_url = f"http://{cfg.server.metrics_host}:{mport}/metrics"
            server.start()
            health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
            if registration is not None:
                health_servicer.set(CLUSTER_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
                registration.start()  # after serving: members listed in etcd answer
        except BaseException:
            self.stop()
            raise
        local = service.node.local_address
        self.info = DaemonInfo(
            address=f"{cfg.server.host}:{port}",
            port=port,
            local_address=local,
            metrics_url=metrics_url,
            segment_name=store.tiers.dram.segment_name,
            ucx_address=service.node.ucx_address,
            tcp_address=service.node.tcp_address,
        )
        log.info(
            "serving on %s (%s; local %s, ucx %s, tcp %s); tiers: %s; %d pages rebuilt from SSD; "
            "metrics %s",
            self.info.address,
            tls.describe() if tls is not None else "plaintext",
            local or "none",
            service.node.ucx_address or "off",
            service.node.tcp_address or "off",
            self.describe_tiers(),
            store.rebuilt_pages,
            metrics_url or "off",
        )
        return self.info

    def _start_bulk(self, store: Store, service: StoreService, tls: ServerTls | None) -> None:
        """Serve the bulk data paths configured (UCX where ucxx is usable, TLS is not required
        and the daemon is not open or `server.allow_open` says so: ucxx cannot listen on
        loopback alone; TCP); remote clients use gRPC streams where neither runs."""
        server = self.config.server
        bulk = BulkServer(store, server.host, tls, service.auth)
        node = service.node
        if server.ucx:
            try:
                if service.auth.open and not server.allow_open and not (tls and tls.require):
                    # (with TLS required, start_ucx says why there is no UCX path)
                    raise Unavailable(
                        "its listener takes every interface and this daemon is open (no "
                        "auth.tokens_file); server.allow_open = true serves it anyway"
                    )
                node = dataclasses.replace(node, ucx_address=bulk.start_ucx(server.ucx_port))
            except Unavailable as exc:
                log.info("no UCX data path (%s)", exc)
            else:
                if tls is not None:
                    log.warning("the UCX data path at %s is not encrypted", node.ucx_address)
        if server.tcp:
            tcp = TcpServer(
                store,
                server.host,
                tls,
                service.auth,
                idle_timeout_s=server.tcp_idle_timeout_s,
                reply_poll_s=server.reply_poll_us / 1e6,
            )
            try:
                node = dataclasses.replace(node, tcp_address=tcp.start(server.tcp_port))
            except Unavailable as exc:
                log.warning("no TCP data path (%s)", exc)
            else:
                self._tcp = tcp
        service.node = node
        self._ucx = bulk

    def _member(self, node_id: str, port: int, host: str) -> Member:
        assert self.store is not None
        cfg = self.config
        address = cfg.cluster.advertise_address or f"{reachable_host(cfg.server.host)}:{port}"
        tiers = tuple(
            TierCapacity(TIER_NAMES[g.tier], g.capacity_bytes) for g in self.store.tiers.gauges()
        )
        return Member(node_id=node_id, address=address, host_id=host, tiers=tiers)

    def describe_tiers(self) -> str:
        assert self.store is not None
        parts = []
        for g in self.store.tiers.gauges():
            parts.append(f"{g.tier.name.lower()} {format_size(g.capacity_bytes)}")
        ssd = self.store.tiers.ssd
        if ssd is not None:
            parts[-1] += f" at {self.config.ssd_path}"
        return ", ".join(parts)

    def stop(self, grace_s: float = 5.0) -> None:
        """Leave the cluster, stop serving (finishing in-flight calls for up to grace_s) and
        close the store."""
        if self.registration is not None:
            self.registration.stop()  # first, so clients stop sending here
            self.registration = None
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._lane is not None:
            self._lane.stop()
            self._lane = None
        if self._segment_fd >= 0:
            os.close(self._segment_fd)
            self._segment_fd = -1
        if self._ucx is not None:
            self._ucx.stop()
            self._ucx = None
        if self._tcp is not None:
            self._tcp.stop()
            self._tcp = None
        if self.server is not None:
            self.server.stop(grace_s).wait()
            self.server = None
        if self._stop_metrics is not None:
            self._stop_metrics()
            self._stop_metrics = None
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.info and self.info.local_address:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.info.local_address.removeprefix("unix:"))
        self._restore_umask()

    def _restore_umask(self) -> None:
        if self._umask is not None:
            restore_umask(self._umask)
            self._umask = None


def _make_paths_private(cfg: StoreConfig) -> None:
    """The data folder 0700, and the SSD tier's folder with all in it 0700 / 0600 (the
    daemon's own files: RocksDB's, the segment files). Only the daemon's own folder is walked:
    a data folder named by hand may hold other things, which are left alone; one shared on
    purpose (see `shared_folder`) keeps its mode. The lane socket's folder is created 0700 when
    missing; one that exists and other users may enter is left as it is (it may be shared on
    purpose: auth.local_uids), with a warning."""
    private_folder(cfg.data_path)
    if cfg.ssd.enabled:
        private_folder(cfg.ssd_path)
        make_private(cfg.ssd_path)
    sock = cfg.unix_socket_path
    if sock is None or sock.parent == cfg.data_path:
        return
    if not sock.parent.exists():
        private_folder(sock.parent)
    elif sock.parent.stat().st_mode & 0o077 and not cfg.auth.local_uids:
        log.warning(
            "the lane socket's folder %s is open to other users (the socket itself is 0600)",
            sock.parent,
        )
