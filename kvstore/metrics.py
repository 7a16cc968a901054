"""Counters of the store and their Prometheus exposition.

The store keeps plain integer counters (`StoreCounters`, mutated under the store's lock); the
Stats RPC and the Prometheus endpoint both read them, so the two can never disagree. Each daemon
has its own registry: no process-global metric state.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from kvstore.keys import IoClass, Tier

TIER_NAMES = {Tier.GPU: "gpu", Tier.DRAM: "dram", Tier.SSD: "ssd"}
CLASS_NAMES = {
    IoClass.CRITICAL: "critical",
    IoClass.NORMAL: "normal",
    IoClass.BACKGROUND: "background",
}


@dataclass(slots=True)
class StoreCounters:
    """Monotonic counters. Mutated only under the store lock (or with `lock` held)."""

    hits: dict[Tier, int] = field(default_factory=lambda: defaultdict(int))
    misses: dict[Tier, int] = field(default_factory=lambda: defaultdict(int))
    evictions: dict[Tier, int] = field(default_factory=lambda: defaultdict(int))
    # (path, direction, io class) -> bytes; path is shm | grpc | ssd | gpu
    bytes_moved: dict[tuple[str, str, IoClass], int] = field(
        default_factory=lambda: defaultdict(int)
    )
    demotions: dict[tuple[Tier, Tier], int] = field(default_factory=lambda: defaultdict(int))
    promotions: dict[tuple[Tier, Tier], int] = field(default_factory=lambda: defaultdict(int))
    corrupt_dropped: int = 0
    lease_expiries: int = 0
    lookups: int = 0
    lookup_hit_pages: int = 0
    refused_full: int = 0
    ssd_read_errors: int = 0  # I/O errors (not checksum failures) on SSD reads: served as misses
    ssd_write_errors: int = 0  # failed SSD writes (demotions, write-through, placement)
    stale_fenced: int = 0  # late calls on expired leases and torn reads stopped by the fences
    shm_put_corrupt: int = 0  # same-host puts whose payload failed the daemon's check: dropped
    quarantined_slots: int = 0  # slots of expired same-host leases held until their holder is done
    chain_rejected: int = 0  # puts refused because a page's key chain did not verify
    # namespace -> puts refused (or SSD writes skipped) because it was at its quota
    quota_refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_bytes(self, path: str, direction: str, io_class: IoClass, n_bytes: int) -> None:
        with self.lock:
            self.bytes_moved[(path, direction, io_class)] += n_bytes


@dataclass(frozen=True, slots=True)
class NamespaceGauge:
    namespace: str
    tier: Tier
    used_bytes: int
    quota_bytes: int  # 0: none


@dataclass(frozen=True, slots=True)
class TierGauge:
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    pages: int


class StoreCollector:
    """A Prometheus collector reading live values through callables (no copies of state)."""

    def __init__(
        self,
        counters: StoreCounters,
        tiers: Callable[[], list[TierGauge]],
        queue_depths: Callable[[], dict[IoClass, int]],
        active_leases: Callable[[], int],
        namespaces: Callable[[], list[NamespaceGauge]] | None = None,
    ) -> None:
        self._c = counters
        self._tiers = tiers
        self._queues = queue_depths
        self._leases = active_leases
        self._namespaces = namespaces

    def collect(self) -> Iterator[Metric]:
        c = self._c
        with c.lock:
            hits = dict(c.hits)
            misses = dict(c.misses)
            evictions = dict(c.evictions)
            moved = dict(c.bytes_moved)
            demotions = dict(c.demotions)
            promotions = dict(c.promotions)
            quota_refused = dict(c.quota_refused)
            scalars = (
                c.corrupt_dropped,
                c.lease_expiries,
                c.lookups,
                c.lookup_hit_pages,
                c.refused_full,
                c.ssd_read_errors,
                c.ssd_write_errors,
                c.stale_fenced,
                c.chain_rejected,
            )
        yield _per_tier("strata_hits", "Pages found, by the tier that served them", hits)
        yield _per_tier("strata_misses", "Pages looked for in a tier and not found there", misses)
        yield _per_tier("strata_evictions", "Pages that left a tier to make room", evictions)
        fam = CounterMetricFamily(
            "strata_bytes",
            "Payload bytes moved, by path, direction and I/O class",
            labels=["path", "direction", "io_class"],
        )
        for (path, direction, io_class), value in sorted(moved.items()):
            fam.add_metric([path, direction, CLASS_NAMES[io_class]], value)
        yield fam
        for name, doc, data in (
            ("strata_demotions", "Pages moved down a tier", demotions),
            ("strata_promotions", "Pages copied up a tier on a hit", promotions),
        ):
            fam = CounterMetricFamily(name, doc, labels=["from_tier", "to_tier"])
            for (src, dst), value in sorted(data.items()):
                fam.add_metric([TIER_NAMES[src], TIER_NAMES[dst]], value)
            yield fam
        corrupt, expiries, lookups, lookup_hits, refused, rd_err, wr_err, fenced, chain = scalars
        yield CounterMetricFamily(
            "strata_corrupt_pages_dropped",
            "Pages that failed verification and were dropped",
            value=corrupt,
        )
        yield CounterMetricFamily("strata_lease_expiries", "Leases that ran out", value=expiries)
        yield CounterMetricFamily("strata_lookups", "Lookup calls", value=lookups)
        yield CounterMetricFamily(
            "strata_lookup_hit_pages", "Pages hit by lookups", value=lookup_hits
        )
        yield CounterMetricFamily(
            "strata_writes_refused_full", "Writes refused because a tier was full", value=refused
        )
        yield CounterMetricFamily(
            "strata_ssd_read_errors", "SSD reads that failed with an I/O error", value=rd_err
        )
        yield CounterMetricFamily(
            "strata_ssd_write_errors", "SSD writes that failed with an I/O error", value=wr_err
        )
        yield CounterMetricFamily(
            "strata_stale_fenced",
            "Calls on expired leases and torn reads stopped by the slot fences",
            value=fenced,
        )
        yield CounterMetricFamily(
            "strata_chain_rejected",
            "Puts refused because a page's key chain did not verify",
            value=chain,
        )
        fam = CounterMetricFamily(
            "strata_quota_refused",
            "Puts refused (and SSD writes skipped) because a namespace was at its quota",
            labels=["namespace"],
        )
        for namespace, value in sorted(quota_refused.items()):
            fam.add_metric([namespace], value)
        yield fam
        if self._namespaces is not None:
            held = GaugeMetricFamily(
                "strata_namespace_bytes",
                "Payload bytes of a namespace's pages per tier",
                labels=["namespace", "tier"],
            )
            limit = GaugeMetricFamily(
                "strata_namespace_quota_bytes",
                "A namespace's byte quota per tier (namespaces with one)",
                labels=["namespace", "tier"],
            )
            for usage in self._namespaces():
                name = TIER_NAMES[usage.tier]
                held.add_metric([usage.namespace, name], usage.used_bytes)
                if usage.quota_bytes:
                    limit.add_metric([usage.namespace, name], usage.quota_bytes)
            yield held
            yield limit
        used = GaugeMetricFamily("strata_tier_used_bytes", "Bytes in use per tier", labels=["tier"])
        cap = GaugeMetricFamily(
            "strata_tier_capacity_bytes", "Byte budget per tier", labels=["tier"]
        )
        pages = GaugeMetricFamily("strata_tier_pages", "Pages resident per tier", labels=["tier"])
        for gauge in self._tiers():
            name = TIER_NAMES[gauge.tier]
            used.add_metric([name], gauge.used_bytes)
            cap.add_metric([name], gauge.capacity_bytes)
            pages.add_metric([name], gauge.pages)
        yield used
        yield cap
        yield pages
        depth = GaugeMetricFamily(
            "strata_io_queue_depth", "Data operations waiting, by I/O class", labels=["io_class"]
        )
        for io_class, value in sorted(self._queues().items()):
            depth.add_metric([CLASS_NAMES[io_class]], value)
        yield depth
        yield GaugeMetricFamily("strata_active_leases", "Leases held", value=self._leases())


def _per_tier(name: str, doc: str, data: dict[Tier, int]) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=["tier"])
    for tier in Tier:
        fam.add_metric([TIER_NAMES[tier]], data.get(tier, 0))
    return fam


class MembershipCollector:
    """`strata_cluster_membership_stale`: 1 while the daemon cannot confirm its etcd membership."""

    def __init__(self, stale: Callable[[], bool]) -> None:
        self._stale = stale

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "strata_cluster_membership_stale",
            "1 while etcd is unreachable and the member record may be out of date",
            value=1 if self._stale() else 0,
        )


class AuthCollector:
    """`strata_auth_denied_total{reason}`: calls refused by the principal checks (kvstore/auth.py;
    reason: unauthenticated, read, write, delete, lease, scope_mismatch, local_untrusted)."""

    def __init__(self, denied: Callable[[], dict[str, int]]) -> None:
        self._denied = denied

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "strata_auth_denied", "Calls refused by the principal checks", labels=["reason"]
        )
        for reason, value in sorted(self._denied().items()):
            fam.add_metric([reason], value)
        yield fam


def make_registry(
    collector: StoreCollector, membership: MembershipCollector | None = None
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if membership is not None:
        registry.register(membership)
    return registry


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[Callable[[], None], int]:
    """Start the /metrics HTTP endpoint; returns (stop, bound port). Port 0 picks a free port."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop, bound
