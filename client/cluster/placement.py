"""Where a page lives in a cluster: rendezvous hashing with replicas and hot-page extras (DESIGN §7).

Rendezvous (highest-random-weight) hashing: each node scores a page key as
`xxh3_64(node_id ‖ key)`; the page's replicas are the `replicas` nodes with the highest scores
(ties, which need a 64-bit collision, go to the smaller node id). Every client computes the same
answer from the same member set, with no coordination and no process-random seed. When a node
joins it takes only the pages it now outranks (about 1/N of them); when one leaves, only its own
pages move, each to the next node of its ranking.

Hot pages: `HotPages` counts, per page key, the reads a client served within a sliding window.
A page read more than `threshold` times in the last `window_s` seconds is hot, and the next put of
it (a re-publish) places it on `replicas + hot_extra` nodes, which spreads the reads of a popular
prefix over more nodes. Nothing is copied behind the caller's back: a page becomes more replicated
only when it is published again, and the extra copies age out like any other page.

Pure (the clock is passed in); no I/O.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from client.contract.errors import InvalidArgument


def score(node_id: str, key: bytes) -> int:
    """The weight of `node_id` for page `key` (higher wins)."""
    return xxhash.xxh3_64_intdigest(node_id.encode() + key)


def rank(key: bytes, nodes: Iterable[str]) -> list[str]:
    """All `nodes`, best first, for page `key`."""
    return sorted(nodes, key=lambda n: (-score(n, key), n))


def replicas_of(key: bytes, nodes: Iterable[str], count: int) -> tuple[str, ...]:
    """The `count` best nodes for `key` (fewer when fewer nodes exist)."""
    if count < 1:
        raise InvalidArgument(f"replica count must be >= 1, not {count}")
    return tuple(rank(key, nodes)[:count])


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """Which pages (by index into the request) go to which node, in request order."""

    by_node: dict[str, tuple[int, ...]]
    replicas: tuple[tuple[str, ...], ...]  # replicas[i]: the nodes of page i, best first


def plan(
    keys: Sequence[bytes],
    nodes: Iterable[str],
    replicas: int,
    *,
    extra: Sequence[int] | None = None,
) -> PlacementPlan:
    """Place each key on its top `replicas + extra[i]` nodes. Pure."""
    members = sorted(set(nodes))
    if extra is not None and len(extra) != len(keys):
        raise InvalidArgument("extra needs one entry per key")
    by_node: dict[str, list[int]] = {}
    chosen: list[tuple[str, ...]] = []
    for i, key in enumerate(keys):
        want = replicas + (extra[i] if extra is not None else 0)
        targets = replicas_of(key, members, want) if members else ()
        chosen.append(targets)
        for node in targets:
            by_node.setdefault(node, []).append(i)
    return PlacementPlan(
        by_node={n: tuple(ix) for n, ix in by_node.items()}, replicas=tuple(chosen)
    )


class HotPages:
    """Reads per page key within a sliding window; a key read more than `threshold` times in
    the last `window_s` seconds is hot. Remembers at most `max_keys` keys (least recently read
    go first), so memory stays bounded. Not thread-safe: the owner locks."""

    def __init__(
        self, *, threshold: int = 8, window_s: float = 60.0, max_keys: int = 65536
    ) -> None:
        if threshold < 1 or window_s <= 0 or max_keys < 1:
            raise InvalidArgument("threshold, window_s and max_keys must be positive")
        self.threshold = threshold
        self.window_s = window_s
        self.max_keys = max_keys
        self._reads: OrderedDict[bytes, deque[float]] = OrderedDict()

    def record(self, key: bytes, now: float) -> None:
        """Count one read of `key` at time `now`."""
        times = self._reads.get(key)
        if times is None:
            times = self._reads[key] = deque(maxlen=self.threshold + 1)
        else:
            self._reads.move_to_end(key)
        times.append(now)
        while len(self._reads) > self.max_keys:
            self._reads.popitem(last=False)

    def is_hot(self, key: bytes, now: float) -> bool:
        """More than `threshold` reads of `key` within the window ending at `now`."""
        times = self._reads.get(key)
        if times is None or len(times) <= self.threshold:
            return False
        return now - times[0] <= self.window_s

    def __len__(self) -> int:
        return len(self._reads)
