"""`round_robin`: the baseline that ignores load and cache: prefill and decode workers in turn.

The turn is kept per side in the policy object (ordered by worker id, so the order does not
depend on how the snapshot was listed); a worker that leaves or returns just shifts the turn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine.router.core.policies.base import no_worker, pick_pair, pools
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import Placement, Refusal, RequestView, WorkerView


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._prefill_turn = 0
        self._decode_turn = 0

    def place(
        self,
        request: RequestView,
        workers: Sequence[WorkerView],
        model: TimeModel,
        now: float,
        rng: random.Random,
    ) -> Placement | Refusal:
        pool = pools(request, workers)
        servable = sorted(pool.servable, key=lambda w: w.worker_id)
        if not servable:
            return no_worker(request, workers)
        prefill = servable[self._prefill_turn % len(servable)]
        self._prefill_turn += 1
        decoders = sorted(pool.decoders_for(prefill), key=lambda w: w.worker_id)
        if len(decoders) == 1:
            decode = decoders[0]
        else:
            decode = decoders[self._decode_turn % len(decoders)]
            self._decode_turn += 1
        return pick_pair(request, prefill, decode, model, now, self.name)
