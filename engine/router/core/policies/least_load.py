"""`least_load`: the prefill worker with the least queued work, the decode worker with the smallest batch.

Load is what the workers reported plus the router's own dispatches not yet in those reports (the
ledger has already added them to the views). Cache hits play no part. Ties go to a random one of
the tied workers (from the `rng` passed in), so equal workers share a burst.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine.router.core.policies.base import lowest, no_worker, pick_pair, pools
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import Placement, Refusal, RequestView, WorkerView


def prefill_load(worker: WorkerView) -> tuple[int, int]:
    return (worker.queued_prefill_tokens, worker.queued_requests)


def decode_load(worker: WorkerView) -> tuple[int, int]:
    joining = len(worker.pending_joins)
    return (worker.running_requests + joining, worker.running_context_tokens)


class LeastLoad:
    name = "least_load"

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
        prefill = lowest(servable, prefill_load, rng)
        decode = lowest(pool.decoders_for(prefill), decode_load, rng)
        return pick_pair(request, prefill, decode, model, now, self.name)
