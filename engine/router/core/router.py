"""`RouterCore`: the one entry point the HTTP shell and the simulator both call.

    decide(request, workers, now, rng):
        views = ledger.apply(workers, now)        # add dispatches the reports cannot show yet
        pick  = policy.place(request, views, ...) # a Placement, or Refusal(no_worker)
        pick  = admission.admit(request, pick, views, now)
        if admitted: ledger.reserve(...); admission.on_dispatch(...)

`observe_prefill` feeds a worker's own prefill timing to the live calibration (when the core
has one: prefills are then priced at the speed the workers show, and a drifted profile shows in
the calibration's `scale`, not in the predictions). `resume` places the rest of
a decode whose worker died (`place_resume`: decode-only, priced, explained) and moves its ledger and admission records there; and the events the caller feeds
back as the request runs: `on_first_token` (the prefill is done:
the ledger moves it to decode, the TTFT prediction is scored: the `Placement`'s own, the one the
caller is told, against the time from the request's receipt, `decide(received_at=...)`, to its
first token), `on_finish` (the TPOT prediction is
scored, every record released) and `on_failed` (released, nothing scored). `explain` turns a
decision into a plain dict for a debug log or the `x-strata-*` headers.

Pure: state lives in the ledger, admission and tracker objects; time is the `now` argument;
randomness comes from the caller's `rng`.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from engine.router.core.admission import Admission
from engine.router.core.calibration import PrefillCalibration
from engine.router.core.ledger import DispatchLedger
from engine.router.core.policies import Policy
from engine.router.core.prediction import PredictionTracker
from engine.router.core.resume import place_resume, resume_view
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import Decision, Placement, Refusal, RequestView, WorkerView


@dataclass(frozen=True, slots=True)
class _Open:
    received_at_s: float  # the TTFT is scored from here
    predicted_ttft_s: float
    predicted_tpot_s: float
    first_token_at_s: float | None = None


class RouterCore:
    def __init__(
        self,
        policy: Policy,
        admission: Admission,
        model: TimeModel,
        ledger: DispatchLedger | None = None,
        tracker: PredictionTracker | None = None,
        calibration: PrefillCalibration | None = None,
    ) -> None:
        self.policy = policy
        self.admission = admission
        self.model = model
        # prices prefills at the speed the workers report (None: as profiled)
        self.calibration = calibration
        self.ledger = ledger if ledger is not None else DispatchLedger()
        self.tracker = tracker if tracker is not None else PredictionTracker()
        self._open: dict[str, _Open] = {}

    def decide(
        self,
        request: RequestView,
        workers: Sequence[WorkerView],
        now: float,
        rng: random.Random,
        *,
        received_at: float | None = None,
    ) -> Decision:
        """Place and admit `request`; an admitted one is counted as load from `now` on.
        `received_at` (default `now`): when the caller received the request, on the same clock;
        its TTFT is scored from there, as its client sees it (lookup and decision included).

        Raises UnknownSloClass for a class the configuration lacks (an invalid request)."""
        views = self.ledger.apply(workers, now)
        placed = self.policy.place(request, views, self.model, now, rng)
        if isinstance(placed, Refusal):
            return placed
        decision = self.admission.admit(request, placed, views, now, model=self.model)
        if isinstance(decision, Placement):
            self.ledger.reserve(request, decision, now)
            self.admission.on_dispatch(request, decision, now)
            self._open[request.request_id] = _Open(
                now if received_at is None else min(received_at, now),
                decision.predicted_ttft_s,
                decision.predicted_tpot_s,
            )
        return decision

    def resume(
        self,
        request: RequestView,
        workers: Sequence[WorkerView],
        now: float,
        *,
        produced: int,
        colocated: bool,
        exclude: Collection[str] = (),
    ) -> Decision:
        """Where to continue `request` (the original view) after `produced` tokens, on a decode
        worker (co-located for a co-located run) not in `exclude`. Never refused by admission:
        the request was admitted once. A placement moves the request's ledger entry (its
        catch-up and decode load) and its TPOT target to the chosen worker."""
        rest = resume_view(request, produced)
        self.ledger.release(request.request_id)
        views = self.ledger.apply(workers, now)
        decision = place_resume(rest, views, self.model, now, colocated=colocated, exclude=exclude)
        if isinstance(decision, Placement):
            self.ledger.reserve(rest, decision, now)
            self.admission.on_resume(request.request_id, decision.decode_id)
        return decision

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> bool:
        """A worker computed `new_tokens` after `cached_tokens` in `seconds` (its own timing):
        with a calibration, later decisions price prefills at the live speed. Returns whether
        the model changed."""
        if self.calibration is None or not self.calibration.observe(
            new_tokens, cached_tokens, seconds
        ):
            return False
        self.model = self.calibration.model
        return True

    def on_first_token(self, request_id: str, now: float) -> float | None:
        """The first token arrived; returns the TTFT prediction's relative error (None if unknown)."""
        entry = self._open.get(request_id)
        self.ledger.on_prefill_done(request_id, now)
        self.admission.on_first_token(request_id, now)
        if entry is None or entry.first_token_at_s is not None:
            return None
        self._open[request_id] = _Open(
            entry.received_at_s, entry.predicted_ttft_s, entry.predicted_tpot_s, now
        )
        return self.tracker.record("ttft", entry.predicted_ttft_s, now - entry.received_at_s, now)

    def on_finish(self, request_id: str, now: float, output_tokens: int) -> float | None:
        """The request completed with `output_tokens` tokens; scores TPOT (needs >= 2 tokens)."""
        entry = self._open.pop(request_id, None)
        self.ledger.release(request_id)
        self.admission.on_finish(request_id, now)
        if entry is None or entry.first_token_at_s is None or output_tokens < 2:
            return None
        observed = (now - entry.first_token_at_s) / (output_tokens - 1)
        return self.tracker.record("tpot", entry.predicted_tpot_s, observed, now)

    def on_failed(self, request_id: str, now: float) -> None:
        """The request failed or was cancelled: forget it, score nothing."""
        self._open.pop(request_id, None)
        self.ledger.release(request_id)
        self.admission.on_finish(request_id, now)

    @property
    def open_requests(self) -> int:
        return len(self._open)


def explain(decision: Decision) -> dict[str, object]:
    """A JSON-ready account of a decision: the pick, its predictions, every candidate and why it
    lost; for a refusal, the reason, the retry hint and the placement that was turned down."""
    if isinstance(decision, Refusal):
        out: dict[str, object] = {
            "decision": "refused",
            "reason": str(decision.reason),
            "retry_after_s": round(decision.retry_after_s, 6),
            "detail": decision.detail,
            "slo_class": decision.slo_class,
        }
        if decision.placement is not None:
            out["placement"] = explain(decision.placement)
        return out
    return {
        "decision": "placed",
        "policy": decision.policy,
        "prefill": decision.prefill_id,
        "decode": decision.decode_id,
        "predicted_ttft_s": round(decision.predicted_ttft_s, 6),
        "predicted_tpot_s": round(decision.predicted_tpot_s, 6),
        "hit_tokens_used": decision.hit_tokens_used,
        "candidates": [
            {
                "prefill": c.prefill_id,
                "decode": c.decode_id,
                "predicted_ttft_s": round(c.predicted_ttft_s, 6),
                "predicted_tpot_s": round(c.predicted_tpot_s, 6),
                "cost": round(c.cost, 6),
                "queue_s": round(c.queue_s, 6),
                "pull_s": round(c.pull_s, 6),
                "compute_s": round(c.compute_s, 6),
                "hit_tokens_used": c.hit_tokens_used,
                "rejected_because": c.rejected_because,
            }
            for c in decision.candidates
        ],
    }


def headers(decision: Placement) -> dict[str, str]:
    """The `x-strata-*` response headers of a placement."""
    return {
        "x-strata-prefill": decision.prefill_id,
        "x-strata-decode": decision.decode_id,
        "x-strata-policy": decision.policy,
        "x-strata-predicted-ttft-ms": f"{decision.predicted_ttft_s * 1e3:.3f}",
        "x-strata-predicted-tpot-ms": f"{decision.predicted_tpot_s * 1e3:.3f}",
        "x-strata-hit-tokens": str(decision.hit_tokens_used),
    }
