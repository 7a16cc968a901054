"""Baseline placement that the router does not ship: `random` (Mooncake's paper compares it).

It follows the core's `Policy` protocol and prices its pick with the core's own estimate
(`pick_pair`), so admission judges it like any other policy. Randomness only from the `rng`
passed in.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from engine.router.core import Placement, Refusal, RequestView, TimeModel, WorkerView
from engine.router.core.policies.base import no_worker, pick_pair, pools


class RandomPlacement:
    name = "random"

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
        prefill = rng.choice(servable)
        decode = rng.choice(sorted(pool.decoders_for(prefill), key=lambda w: w.worker_id))
        return pick_pair(request, prefill, decode, model, now, self.name)
