"""Store models: a global tiered store (one node per host: DRAM, then SSD, LRU in each) and the
per-engine prefix cache of a local-only deployment (an LRU over the pages in an engine's pool).

Global: a page lives on the node chosen by rendezvous hashing of its key over the hosts (as the
cluster client places pages, DESIGN §7); a put lands in DRAM, DRAM overflow demotes the least
recently used page to SSD, SSD overflow drops it (an eviction). A get of an SSD page promotes it.
Lookups return the longest present prefix with each page's tier and node host. Mutating methods
say so; nothing here knows requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class LruPages:
    """A set of page keys with a capacity, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._pages: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def touch(self, key: int) -> None:
        self._pages.move_to_end(key)

    def add(self, key: int) -> int | None:
        """Insert (or refresh) `key`; returns the key pushed out when full (mutates)."""
        if key in self._pages:
            self._pages.move_to_end(key)
            return None
        self._pages[key] = None
        if len(self._pages) > self.capacity:
            old, _ = self._pages.popitem(last=False)
            return old
        return None

    def remove(self, key: int) -> None:
        self._pages.pop(key, None)

    def pop_oldest(self) -> int | None:
        if not self._pages:
            return None
        old, _ = self._pages.popitem(last=False)
        return old


class StoreNode:
    def __init__(self, host: str, dram_pages: int, ssd_pages: int) -> None:
        self.host = host
        self.dram = LruPages(dram_pages)
        self.ssd = LruPages(ssd_pages)
        self.evictions = 0

    def tier_of(self, key: int) -> str | None:
        if key in self.dram:
            return "dram"
        if key in self.ssd:
            return "ssd"
        return None

    def put(self, key: int) -> None:
        """Write `key` into DRAM, demoting/evicting as needed (mutates)."""
        if key in self.ssd:
            self.ssd.remove(key)
        demoted = self.dram.add(key)
        if demoted is not None:
            if self.ssd.capacity > 0:
                if self.ssd.add(demoted) is not None:
                    self.evictions += 1
            else:
                self.evictions += 1

    def get(self, key: int) -> None:
        """A read: refresh recency; an SSD page is promoted to DRAM (mutates)."""
        if key in self.dram:
            self.dram.touch(key)
        elif key in self.ssd:
            self.put(key)


class GlobalStore:
    def __init__(self, hosts: Sequence[str], dram_pages: int, ssd_pages: int) -> None:
        self.nodes = [StoreNode(h, dram_pages, ssd_pages) for h in hosts]

    def node_for(self, key: int) -> StoreNode:
        best = max(range(len(self.nodes)), key=lambda i: hash((key, i)))
        return self.nodes[best]

    def lookup(self, keys: Sequence[int]) -> list[tuple[str, str]]:
        """(tier, node host) of each page of the longest present prefix (pure)."""
        out: list[tuple[str, str]] = []
        for key in keys:
            node = self.node_for(key)
            tier = node.tier_of(key)
            if tier is None:
                break
            out.append((tier, node.host))
        return out

    def get(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.node_for(key).get(key)

    def put(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.node_for(key).put(key)

    @property
    def evictions(self) -> int:
        return sum(n.evictions for n in self.nodes)


class LocalCache:
    """The prefix cache in one engine's paged pool: cached pages use pool room until evicted."""

    def __init__(self) -> None:
        self.pages = LruPages(1 << 62)
        self.evictions = 0

    def prefix(self, keys: Sequence[int]) -> int:
        n = 0
        for key in keys:
            if key not in self.pages:
                break
            n += 1
        return n

    def use(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.pages.touch(key)

    def insert(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.pages.add(key)

    def evict(self, n: int) -> int:
        """Drop up to `n` least recently used pages; returns how many went (mutates)."""
        gone = 0
        while gone < n and self.pages.pop_oldest() is not None:
            gone += 1
        self.evictions += gone
        return gone

    def __len__(self) -> int:
        return len(self.pages)
