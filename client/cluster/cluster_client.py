"""`ClusterClient`: one blocking client over every store daemon of a cluster (DESIGN §7).

Members come from etcd (`etcd_endpoints`: followed by a `MemberWatch`) or from a fixed list of
`addresses` (each address is then its own node id). Pages are placed by rendezvous hashing
(`client.cluster.placement`): each page goes to its top `replicas` live nodes, hot pages (read more than
`hot_threshold` times within `hot_window_s` through this client) to `replicas + hot_extra` on
their next put. The client keeps one `StoreClient` per member and fans each call out per node in
parallel on a thread pool:

- `lookup` merges per-node answers into the longest prefix of which every page is present on at
  least one of its replicas (more rounds only when a node lacks a page another replica has);
- `get` asks each page's replicas in rank order until one delivers it;
- `put` writes each page to all its replicas; a page is stored if any replica took it.

Failure: a node that answers Unavailable (or times out) is marked down for `down_s` and skipped,
its pages become misses and no call fails for it; after `down_s` it is tried again. A node whose
etcd lease runs out leaves the member set. A node that joins takes its share of new pages. When
etcd is unreachable the client keeps the last known members and says so (`degraded`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from client.cluster.etcd import EtcdClient
from client.cluster.member_watch import MemberWatch
from client.cluster.membership import Member
from client.cluster.placement import HotPages, plan, rank
from client.contract.errors import InvalidArgument, StrataError, Unavailable
from client.contract.page import PageHeader
from client.contract.scope import Scope
from client.contract.types import (
    GetResult,
    IoClass,
    LookupResult,
    Page,
    PutResult,
    PutStatus,
    StoreStats,
    Tier,
    WritableBuffer,
    chain_prefixes_for,
    checked_tokens,
)
from client.store_client import StoreClient
from client.transports._wire import resolve_token
from client.transports.tls import TlsOptions, resolve_tls

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NodeStats:
    """One member's counters, or the error that kept them from this call."""

    node_id: str
    address: str
    stats: StoreStats | None
    error: str


@dataclass(frozen=True, slots=True)
class ClusterStats:
    nodes: tuple[NodeStats, ...]
    live: tuple[str, ...]  # members not marked down
    down: tuple[str, ...]  # members skipped after a failure
    degraded: bool  # etcd unreachable: members may be out of date

    @property
    def pages(self) -> int:
        """Page copies held by all reachable nodes (a replicated page counts once per copy)."""
        return sum(n.stats.pages for n in self.nodes if n.stats is not None)


class ClusterClient:
    """Blocking client of a Strata cluster. Thread-safe. Use as a context manager.

    `token`: the principal's bearer token every node's client sends (None: $STRATA_STORE_TOKEN;
    see `StoreClient`). `tls`: every node's TLS options (see `StoreClient`; None: the
    STRATA_STORE_TLS_* environment)."""

    def __init__(
        self,
        *,
        etcd_endpoints: str | Sequence[str] | None = None,
        addresses: Sequence[str] | None = None,
        cluster: str = "default",
        replicas: int = 2,
        hot_extra: int = 1,
        hot_threshold: int = 8,
        hot_window_s: float = 60.0,
        shared_memory: bool | None = None,
        timeout_s: float = 5.0,
        down_s: float = 2.0,
        watch_idle_s: float = 1.0,
        max_workers: int = 16,
        token: str | None = None,
        tls: TlsOptions | bool | None = None,
    ) -> None:
        if (etcd_endpoints is None) == (addresses is None):
            raise InvalidArgument("ClusterClient takes exactly one of etcd_endpoints or addresses")
        if replicas < 1 or hot_extra < 0 or down_s <= 0 or timeout_s <= 0 or max_workers < 1:
            raise InvalidArgument("need replicas >= 1, hot_extra >= 0, positive times and workers")
        self.cluster = cluster
        self.replicas = replicas
        self.hot_extra = hot_extra
        self._shared_memory = shared_memory
        self._token = resolve_token(token)  # each node's StoreClient sends it
        self._tls = resolve_tls(tls) or False  # resolved once: every node alike
        self._timeout_s = timeout_s
        self._down_s = down_s
        self._lock = threading.Lock()
        self._clients: dict[str, StoreClient] = {}
        self._down_until: dict[str, float] = {}
        self._hot = HotPages(threshold=hot_threshold, window_s=hot_window_s)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="strata-fan")
        self._closed = False
        self._watch: MemberWatch | None = None
        self._static: dict[str, Member] = {}
        if addresses is not None:
            if not addresses:
                raise InvalidArgument("addresses is empty")
            self._static = {a: Member(node_id=a, address=a, host_id="") for a in addresses}
        else:
            assert etcd_endpoints is not None
            etcd = EtcdClient(etcd_endpoints, timeout_s=min(timeout_s, 2.0))
            self._watch = MemberWatch(etcd, cluster, idle_s=watch_idle_s)
            self._watch.start()

    # ---- membership -------------------------------------------------------------------------

    @property
    def members(self) -> dict[str, Member]:
        """Known members by node id (down or not)."""
        return self._watch.members if self._watch is not None else dict(self._static)

    @property
    def degraded(self) -> bool:
        """True while etcd is unreachable and the client serves with the last known members."""
        return self._watch is not None and self._watch.degraded

    def live_nodes(self) -> tuple[str, ...]:
        """Members not marked down, sorted by node id."""
        now = time.monotonic()
        members = self.members
        with self._lock:
            return tuple(n for n in sorted(members) if self._down_until.get(n, 0.0) <= now)

    def mark_down(self, node_id: str, why: str) -> None:
        """Skip `node_id` for `down_s` seconds (then try it again)."""
        with self._lock:
            first = self._down_until.get(node_id, 0.0) <= time.monotonic()
            self._down_until[node_id] = time.monotonic() + self._down_s
        if first:
            log.warning("store node %s marked down for %.1f s: %s", node_id, self._down_s, why)

    def _client(self, node_id: str) -> StoreClient:
        member = self.members.get(node_id)
        if member is None:
            raise Unavailable(f"node {node_id} left the cluster")
        with self._lock:
            if self._closed:
                raise Unavailable("the cluster client is closed")
            client = self._clients.get(node_id)
            if client is not None and client.address == member.address:
                return client
            old, client = (
                client,
                StoreClient(
                    member.address,
                    shared_memory=self._shared_memory,
                    timeout_s=self._timeout_s,
                    retries=1,
                    token=self._token,
                    tls=self._tls,
                ),
            )
            self._clients[node_id] = client
        if old is not None:  # the node came back at another address
            old.close()
        return client

    def _fan(self, calls: dict[str, Callable[[StoreClient], T]]) -> dict[str, T | StrataError]:
        """Run one call per node in parallel; a node that is unreachable is marked down and its
        entry is the error. Other errors (a bad argument) propagate."""

        def run(node: str, call: Callable[[StoreClient], T]) -> T | StrataError:
            try:
                return call(self._client(node))
            except Unavailable as exc:
                self.mark_down(node, str(exc))
                return exc

        if len(calls) == 1:
            ((node, call),) = calls.items()
            return {node: run(node, call)}
        futures: dict[str, Future[T | StrataError]] = {
            node: self._pool.submit(run, node, call) for node, call in calls.items()
        }
        out: dict[str, T | StrataError] = {}
        for node, fut in futures.items():
            try:
                out[node] = fut.result(timeout=self._timeout_s * 3 + 1)
            except TimeoutError:
                self.mark_down(node, "no answer in time")
                out[node] = Unavailable(f"node {node}: no answer in time")
        return out

    def _width(self, key: bytes, now: float) -> int:
        with self._lock:
            hot = self._hot.is_hot(key, now)
        return self.replicas + (self.hot_extra if hot else 0)

    # ---- calls ------------------------------------------------------------------------------

    def lookup(self, scope: Scope, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix of `keys` present on at least one replica each, with the fastest tier
        of each hit. Read-only; never fails for a down node (its pages count as absent)."""
        n = len(keys)
        live = self.live_nodes()
        if not n or not live:
            return LookupResult(hit_count=0, tiers=())
        now = time.monotonic()
        reps = [tuple(rank(k, live)[: self._width(k, now)]) for k in keys]
        present: list[Tier | None] = [None] * n
        absent: list[set[str]] = [set() for _ in range(n)]
        p = 0
        for round_no in range(n + 1):  # each round settles page p at least
            while p < n and present[p] is not None:
                p += 1
            if p == n or absent[p] >= set(reps[p]):
                break
            asked = [m for m in reps[p] if m not in absent[p]] if round_no else live
            lists = {
                node: [
                    i
                    for i in range(p, n)
                    if node in reps[i] and present[i] is None and node not in absent[i]
                ]
                for node in asked
            }
            lists = {node: ix for node, ix in lists.items() if ix}
            if not lists:
                break
            replies = self._fan(
                {node: _lookup_call(scope, [keys[i] for i in ix]) for node, ix in lists.items()}
            )
            for node, reply in replies.items():
                ix = lists[node]
                if isinstance(reply, StrataError):
                    for i in ix:
                        absent[i].add(node)
                    continue
                for j, tier in enumerate(reply.tiers[: reply.hit_count]):
                    i, current = ix[j], present[ix[j]]
                    present[i] = tier if current is None else Tier(min(current, tier))
                if reply.hit_count < len(ix):
                    absent[ix[reply.hit_count]].add(node)
        hits = 0
        while hits < n and present[hits] is not None:
            hits += 1
        return LookupResult(hit_count=hits, tiers=tuple(t for t in present[:hits] if t is not None))

    def get(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        into: Sequence[WritableBuffer],
        *,
        tokens: Sequence[Sequence[int]] | None,
        io_class: IoClass | None = None,
        verify: bool | None = None,
    ) -> GetResult:
        """Copy each page into `into[i]`, asking its replicas in rank order. Read-only; a page
        no live replica delivers is a miss (None); a replica's page whose token ids are not
        `tokens[i]` is refused (see `StoreClient.get`) and the next replica asked.
        InvalidArgument for mismatched buffers or tokens."""
        n = len(keys)
        if len(into) != n:
            raise InvalidArgument(f"{n} keys but {len(into)} buffers")
        checked_tokens(scope, keys, tokens)
        rejected = 0
        headers: list[PageHeader | bytes | None] = [None] * n
        live = self.live_nodes()
        if not n or not live:
            return GetResult(headers=tuple(headers))
        now = time.monotonic()
        reps = [tuple(rank(k, live)[: self._width(k, now)]) for k in keys]
        pending = list(range(n))
        for attempt in range(max(len(r) for r in reps)):  # one round per replica rank
            alive = set(self.live_nodes())
            groups: dict[str, list[int]] = {}
            for i in pending:
                if attempt < len(reps[i]) and reps[i][attempt] in alive:
                    groups.setdefault(reps[i][attempt], []).append(i)
            if groups:
                replies = self._fan(
                    {
                        node: _get_call(
                            scope,
                            [keys[i] for i in ix],
                            [into[i] for i in ix],
                            None if tokens is None else [tokens[i] for i in ix],
                            io_class,
                            verify,
                        )
                        for node, ix in groups.items()
                    }
                )
                for node, reply in replies.items():
                    if not isinstance(reply, StrataError):
                        rejected += reply.rejected
                        for i, header in zip(groups[node], reply.entries, strict=True):
                            headers[i] = header
            pending = [i for i in pending if headers[i] is None]
            if not pending:
                break
        with self._lock:
            for i, header in enumerate(headers):
                if header is not None:
                    self._hot.record(keys[i], now)
        return GetResult(tuple(headers), rejected)

    def put(
        self,
        scope: Scope,
        pages: Sequence[Page],
        *,
        io_class: IoClass | None = None,
        tier: Tier | None = None,
        prefix_tokens: Sequence[int] = (),
    ) -> PutResult:
        """Write each page to its replicas (hot ones to more). Mutates. A page is STORED if any
        replica stored it, ALREADY_PRESENT if the replicas that answered had it. A page whose
        replicas all failed goes to the next live node of its ranking; Unavailable only when no
        live node took it, CapacityExhausted when all that answered were full.

        A node often holds none of a page's ancestors (they live on other nodes): each node's
        put carries the token ids that vouch for them (`chain_prefixes_for`; `prefix_tokens` is
        the prompt before `pages[0]`, when they continue one), so the node verifies the key
        chain itself (kvstore/chain.py)."""
        if not pages:
            return PutResult(statuses=())
        n = len(pages)
        keys = [p.header.key for p in pages]
        status: list[PutStatus | None] = [None] * n
        tried: list[set[str]] = [set() for _ in range(n)]
        errors: list[StrataError] = []
        now = time.monotonic()
        todo = list(range(n))
        for round_no in range(2):  # the planned replicas, then one fallback round
            live = self.live_nodes()
            if round_no == 0:
                placed = plan(
                    keys,
                    live,
                    self.replicas,
                    extra=[self._width(k, now) - self.replicas for k in keys],
                )
                groups = {node: list(ix) for node, ix in placed.by_node.items()}
            else:
                groups = {}
                for i in todo:
                    spare = [node for node in rank(keys[i], live) if node not in tried[i]]
                    if spare:
                        groups.setdefault(spare[0], []).append(i)
            if not groups:
                break
            replies = self._fan(
                {
                    node: _put_call(
                        scope,
                        [pages[i] for i in ix],
                        io_class,
                        tier,
                        chain_prefixes_for(scope, pages, ix, prefix_tokens),
                    )
                    for node, ix in groups.items()
                }
            )
            for node, reply in replies.items():
                for i in groups[node]:
                    tried[i].add(node)
                if isinstance(reply, StrataError):
                    errors.append(reply)
                    continue
                for i, s in zip(groups[node], reply.statuses, strict=True):
                    if status[i] is not PutStatus.STORED:
                        status[i] = s
            todo = [i for i in range(n) if status[i] is None]
            if not todo:
                break
        if todo:
            if errors:
                raise errors[0]
            raise Unavailable(f"no live store node for {len(todo)} of {n} pages")
        return PutResult(statuses=tuple(s for s in status if s is not None))

    def delete(self, scope: Scope | None = None, keys: Sequence[bytes] | None = None) -> int:
        """Delete `keys` (or every page of `scope`) on every live node; returns the copies
        deleted (a replicated page counts once per replica). Mutates."""
        if (scope is None) == (keys is None):
            raise InvalidArgument("delete takes exactly one of scope or keys")
        replies = self._fan(
            {node: (lambda c: c.delete(scope=scope, keys=keys)) for node in self.live_nodes()}
        )
        return sum(r for r in replies.values() if isinstance(r, int))

    def stats(self) -> ClusterStats:
        """Counters of every live member, plus the membership state. Read-only."""
        members = self.members
        live = self.live_nodes()
        replies = self._fan({node: (lambda c: c.stats()) for node in live})
        nodes = []
        for node in sorted(members):
            reply = replies.get(node)
            if isinstance(reply, StoreStats):
                nodes.append(NodeStats(node, members[node].address, reply, ""))
            else:
                nodes.append(NodeStats(node, members[node].address, None, str(reply or "down")))
        live_now = self.live_nodes()
        return ClusterStats(
            nodes=tuple(nodes),
            live=live_now,
            down=tuple(n for n in sorted(members) if n not in live_now),
            degraded=self.degraded,
        )

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop following etcd, close every node client. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        if self._watch is not None:
            self._watch.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for c in clients:
            c.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lookup_call(scope: Scope, keys: list[bytes]) -> Callable[[StoreClient], LookupResult]:
    return lambda c: c.lookup(scope, keys)


def _get_call(
    scope: Scope,
    keys: list[bytes],
    into: list[WritableBuffer],
    tokens: list[Sequence[int]] | None,
    io_class: IoClass | None,
    verify: bool | None,
) -> Callable[[StoreClient], GetResult]:
    return lambda c: c.get(scope, keys, into, tokens=tokens, io_class=io_class, verify=verify)


def _put_call(
    scope: Scope,
    pages: list[Page],
    io_class: IoClass | None,
    tier: Tier | None,
    chain_prefixes: list[list[int]],
) -> Callable[[StoreClient], PutResult]:
    return lambda c: c.put(
        scope, pages, io_class=io_class, tier=tier, chain_prefixes=chain_prefixes
    )
