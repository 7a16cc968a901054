"""`longest_prefix`: cache affinity only: the workers on the host that holds most of the hit pages.

A worker "holds" a hit page when the store node with the page runs on the worker's host (its
pull is a same-host copy). The prefill worker with the most such pages wins, regardless of load;
the decode worker likewise (it pulls the same prefix). Ties, including a miss, go to a random one
of the tied workers (from the `rng` passed in).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine.router.core.policies.base import lowest, no_worker, pick_pair, pools
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import Placement, Refusal, RequestView, WorkerView


def local_pages(request: RequestView, worker: WorkerView) -> int:
    """How many of the request's hit pages sit on a store node on `worker`'s host."""
    return sum(1 for host in request.prefix.node_hosts if host == worker.host_id)


def most(workers: Sequence[WorkerView], request: RequestView, rng: random.Random) -> WorkerView:
    """A random one of the workers with the most of the request's hit pages on their host."""
    return lowest(workers, lambda w: -local_pages(request, w), rng)


class LongestPrefix:
    name = "longest_prefix"

    def place(
        self,
        request: RequestView,
        workers: Sequence[WorkerView],
        model: TimeModel,
        now: float,
        rng: random.Random,
    ) -> Placement | Refusal:
        pool = pools(request, workers)
        servable = pool.servable
        if not servable:
            return no_worker(request, workers)
        prefill = most(servable, request, rng)
        decode = most(pool.decoders_for(prefill), request, rng)
        return pick_pair(request, prefill, decode, model, now, self.name)
