"""The daemon's cluster membership: a leased key in etcd, kept alive from a thread (DESIGN §7).

`Registration.start()` grants a lease, writes `/strata/<cluster>/members/<node_id>` (a
`client.cluster.membership.Member`) attached to it, and starts a thread that refreshes the lease every
third of its TTL. `stop()` revokes the lease, so a clean stop leaves the member set at once; a
crash leaves it when the lease runs out.

etcd being unreachable never stops the daemon from serving: the registration marks itself
`stale` (exported as `strata_cluster_membership_stale`), logs it once, and keeps retrying; when
etcd answers again it re-registers (with a new lease if the old one ran out meanwhile).

The etcd client and the member record are the SDK's shared definitions (`client.cluster.etcd`,
`client.cluster.membership`), so the daemon and the cluster client read and write the same format.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from client.cluster.etcd import EtcdClient, EtcdUnavailable
from client.cluster.membership import Member, member_key
from kvstore.config import ClusterConfig

log = logging.getLogger(__name__)


class Registration:
    """This daemon's membership record in etcd. Thread-safe; `stop()` is idempotent."""

    def __init__(
        self,
        config: ClusterConfig,
        member: Member,
        on_stale: Callable[[bool], None] | None = None,
    ) -> None:
        """`on_stale(stale)` is called whenever membership turns stale or is confirmed again."""
        self.config = config
        self._on_stale = on_stale
        self.member = member
        self.key = member_key(config.name, member.node_id)
        self._etcd = EtcdClient(config.etcd_endpoints, timeout_s=config.etcd_timeout_ms / 1000)
        self._lease = 0
        self._ttl_s = max(config.lease_ttl_s, 1)
        self._stale = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stale(self) -> bool:
        """True while this daemon could not confirm its membership in etcd."""
        with self._lock:
            return self._stale

    @property
    def lease(self) -> int:
        with self._lock:
            return self._lease

    def start(self) -> None:
        """Register (once, synchronously: a daemon that can reach etcd is a member when this
        returns) and start the keep-alive thread. Never raises for an etcd outage."""
        self._tick()
        self._thread = threading.Thread(target=self._run, name="strata-membership", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing and revoke the lease (the key goes with it). Bounded by the etcd
        timeout; an unreachable etcd lets the lease run out instead."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._etcd.timeout_s * 2 + 1)
            self._thread = None
        lease = self.lease
        if lease:
            try:
                self._etcd.revoke(lease)
                log.info("left cluster %r (%s)", self.config.name, self.member.node_id)
            except EtcdUnavailable as exc:
                log.warning("could not deregister from etcd (%s); the lease will run out", exc)
        with self._lock:
            self._lease = 0

    # ---- the keep-alive loop ---------------------------------------------------------------

    def _run(self) -> None:
        # one iteration per third of the TTL until stop(); each bounded by the etcd timeout
        while not self._stop.wait(self._ttl_s / 3):
            self._tick()

    def _tick(self) -> None:
        try:
            lease = self.lease
            ttl = self._etcd.keepalive(lease) if lease else 0
            if ttl <= 0:
                lease, self._ttl_s = self._etcd.grant(max(self.config.lease_ttl_s, 1))
                self._etcd.put(self.key, self.member.encode(), lease=lease)
                log.info(
                    "registered in cluster %r as %s at %s (lease TTL %d s)",
                    self.config.name,
                    self.member.node_id,
                    self.member.address,
                    self._ttl_s,
                )
        except EtcdUnavailable as exc:
            self._set_stale(True, str(exc))
            return
        with self._lock:
            self._lease = lease
        self._set_stale(False, "")

    def _set_stale(self, stale: bool, why: str) -> None:
        with self._lock:
            changed, self._stale = self._stale != stale, stale
        if changed and self._on_stale is not None:
            self._on_stale(stale)
        if changed and stale:
            log.warning("cluster membership is stale: etcd unreachable (%s); still serving", why)
        elif changed:
            log.info("cluster membership confirmed in etcd again")
        elif stale:
            log.debug("etcd still unreachable: %s", why)
