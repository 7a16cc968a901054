"""The live member set of a cluster, followed from etcd by a background thread (DESIGN §7).

The thread reads `/strata/<cluster>/members/` and then watches it from the next revision, so no
change between the read and the watch is lost; each watch stream ends after `idle_s` without an
event (or after `max_stream_s`), and the loop reads the whole set again. When etcd cannot be
reached the last known set stays in force and `degraded` is True until a read succeeds again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from client.cluster.etcd import EtcdClient, EtcdUnavailable
from client.cluster.membership import Member, members_prefix
from client.contract.errors import InvalidArgument

log = logging.getLogger(__name__)


class MemberWatch:
    """Follows the members of `cluster`. Thread-safe; `close()` is idempotent."""

    def __init__(
        self,
        etcd: EtcdClient,
        cluster: str,
        *,
        idle_s: float = 1.0,
        max_stream_s: float = 10.0,
        retry_s: float = 0.5,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._etcd = etcd
        self.cluster = cluster
        self._prefix = members_prefix(cluster)
        self._idle_s = idle_s
        self._max_stream_s = max_stream_s
        self._retry_s = retry_s
        self._on_change = on_change
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._degraded = False
        self._synced_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def members(self) -> dict[str, Member]:
        """The last known members by node id (a copy)."""
        with self._lock:
            return dict(self._members)

    @property
    def degraded(self) -> bool:
        """True while etcd is unreachable and `members` may be out of date."""
        with self._lock:
            return self._degraded

    @property
    def age_s(self) -> float:
        """Seconds since the member set was last confirmed by etcd."""
        with self._lock:
            synced = self._synced_at
        return time.monotonic() - synced if synced else float("inf")

    def start(self) -> None:
        """Read the member set once (synchronously) and start following it."""
        self._sync()
        self._thread = threading.Thread(target=self._run, name="strata-members", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._idle_s + self._etcd.timeout_s + 1)
            self._thread = None

    # ---- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():  # each turn bounded by max_stream_s (+ etcd timeouts)
            revision = self._sync()
            if revision is None:
                self._stop.wait(self._retry_s)
                continue
            self._follow(revision + 1)

    def _sync(self) -> int | None:
        """Replace the member set by a fresh read; its revision, or None if etcd is down."""
        try:
            result = self._etcd.get_prefix(self._prefix)
        except EtcdUnavailable as exc:
            self._set_degraded(str(exc))
            return None
        members: dict[str, Member] = {}
        for kv in result.kvs:
            member = self._decode(kv.value)
            if member is not None:
                members[member.node_id] = member
        self._replace(members)
        return result.revision

    def _follow(self, start_revision: int) -> None:
        deadline = time.monotonic() + self._max_stream_s
        try:
            events = self._etcd.watch_prefix(
                self._prefix, start_revision=start_revision, idle_timeout_s=self._idle_s
            )
            for event in events:
                with self._lock:
                    members = dict(self._members)
                node_id = event.kv.key[len(self._prefix) :].decode(errors="replace")
                if event.kind == "DELETE":
                    members.pop(node_id, None)
                else:
                    member = self._decode(event.kv.value)
                    if member is not None:
                        members[member.node_id] = member
                self._replace(members)
                if self._stop.is_set() or time.monotonic() > deadline:
                    break
        except EtcdUnavailable as exc:
            self._set_degraded(str(exc))

    def _decode(self, value: bytes) -> Member | None:
        try:
            return Member.decode(value)
        except InvalidArgument as exc:
            log.warning("ignoring a malformed member record in cluster %r: %s", self.cluster, exc)
            return None

    def _replace(self, members: dict[str, Member]) -> None:
        with self._lock:
            changed = members != self._members
            self._members = members
            was_degraded, self._degraded = self._degraded, False
            self._synced_at = time.monotonic()
        if was_degraded:
            log.info("etcd reachable again; cluster %r membership is current", self.cluster)
        if changed:
            log.info("cluster %r members: %s", self.cluster, sorted(members) or "none")
            if self._on_change is not None:
                self._on_change()

    def _set_degraded(self, why: str) -> None:
        with self._lock:
            was, self._degraded = self._degraded, True
        if not was:
            log.warning(
                "cluster %r: etcd unreachable (%s); serving with the last known members",
                self.cluster,
                why,
            )
