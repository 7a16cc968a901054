"""The store as the index of what is cached: a request's page keys → the core's `PrefixHit`.

The router computes the page keys of a prompt under the workers' scope (`client.page_keys`) and
asks the same store the workers use (one daemon, or the cluster) which leading pages exist, in
which tier, and on which host (a cluster page's first replica by rendezvous hashing). A store that is down or slow is a miss, never an error (DESIGN §1): placement
then prices every worker as computing the whole prompt.

`find` is what the router awaits. A lookup in one daemon is one short blocking RPC (about 0.1 ms
on loopback, less than the two thread switches `asyncio.to_thread` adds), so it runs inline on
the event loop, except where that could stall the loop: the first call (it connects), a
cluster's lookups (several daemons, membership), and for `degraded_s` after a lookup that failed,
one that stalled the loop past `stall_s` (a lost packet's retransmit, a store that hangs), or
`slow_calls` in a row over `inline_budget_s` each (a slow store; one late call is the machine's
scheduling, not the store), which go to a thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

from client import ClusterClient, Scope, StoreClient, StrataError, Tier, page_keys, rank
from engine.router.core.types import PrefixHit
from engine.store_spec import StoreSpec

log = logging.getLogger(__name__)


class StoreLookup:
    """Looks prompts up in the store of `spec` (None: no store, every lookup misses), as the
    principal of `token` (None: $STRATA_STORE_TOKEN; it needs read of the workers' namespaces)."""

    def __init__(
        self,
        spec: StoreSpec | None,
        *,
        timeout_s: float = 0.5,
        token: str | None = None,
        inline_budget_s: float = 0.005,
        slow_calls: int = 3,
        stall_s: float = 0.05,
        degraded_s: float = 10.0,
    ) -> None:
        self.spec = spec
        self._client: StoreClient | ClusterClient | None = (
            spec.open(timeout_s=timeout_s, token=token) if spec is not None else None
        )
        self._node_host = ""  # the single daemon's host id, once known
        self._lock = threading.Lock()
        self._quiet_until = 0.0
        self.inline_budget_s = inline_budget_s
        self.slow_calls = slow_calls
        self.stall_s = stall_s
        self.degraded_s = degraded_s
        self._threaded_until = 0.0  # lookups go to a thread until then (monotonic)
        self._slow = 0  # inline lookups in a row over the budget
        self.errors = 0
        self.inline = 0  # lookups that ran on the event loop
        self.threaded = 0  # lookups that ran on a thread

    async def find(self, scope: Scope, token_ids: Sequence[int]) -> PrefixHit:
        """`lookup` for a coroutine: inline where that is safe (see the module doc), else on a
        thread. Read-only; a store failure is a miss, never an error."""
        client = self._client
        if client is None:
            return PrefixHit.none()
        start = time.monotonic()
        if isinstance(client, ClusterClient) or not self._node_host or start < self._threaded_until:
            self.threaded += 1
            return await asyncio.to_thread(self.lookup, scope, token_ids)
        self.inline += 1
        errors = self.errors
        hit = self.lookup(scope, token_ids)
        took = time.monotonic() - start
        failed = self.errors != errors
        self._slow = self._slow + 1 if took > self.inline_budget_s else 0
        if failed or took > self.stall_s or self._slow >= self.slow_calls:
            self._slow = 0
            self._threaded_until = start + took + self.degraded_s
            log.info(
                "store lookup %s (%.1f ms): lookups run on a thread for the next %.0f s",
                "failed" if failed else "was slow",
                took * 1e3,
                self.degraded_s,
            )
        return hit

    def page_keys(self, scope: Scope, token_ids: Sequence[int]) -> list[bytes]:
        return page_keys(scope, token_ids)

    def lookup(self, scope: Scope, token_ids: Sequence[int]) -> PrefixHit:
        """The store's answer for the prompt's full pages; a miss when the store fails."""
        client = self._client
        if client is None:
            return PrefixHit.none()
        keys = page_keys(scope, token_ids)
        if not keys:
            return PrefixHit.none()
        try:
            if isinstance(client, StoreClient) and not self._node_host:
                self._node_host = client.connect().host_id
            found = client.lookup(scope, keys)
        except StrataError as exc:
            with self._lock:
                self.errors += 1
                now = time.monotonic()
                loud, self._quiet_until = now >= self._quiet_until, now + 10.0
            if loud:
                log.warning("store lookup failed (%s); placing as a miss", exc)
            return PrefixHit.none()
        count = found.hit_count
        tiers = tuple(Tier(t).name.lower() for t in found.tiers[:count])
        if isinstance(client, ClusterClient):
            hosts = _cluster_hosts(client, keys[:count])
        else:
            hosts = (self._node_host,) * count
        return PrefixHit(count, tiers, hosts)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _cluster_hosts(client: ClusterClient, keys: Sequence[bytes]) -> tuple[str, ...]:
    """The host id of each page's first replica: the live member that ranks first for its key
    (rendezvous hashing, as the cluster places it). "" where the member's host is not known (a
    fixed address list names no hosts)."""
    live = client.live_nodes()
    members = client.members
    if not live:
        return ("",) * len(keys)
    out = []
    for key in keys:
        member = members.get(rank(key, live)[0])
        out.append(member.host_id if member is not None else "")
    return tuple(out)
