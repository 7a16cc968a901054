"""Admission: serve a placed request now, or refuse it at once with a retry hint.

A request is refused (never queued at the router) when

- its predicted TTFT breaks its class's target (`ttft_slo`), retry after the predicted queue
  drain that would bring it back under the target;
- its predicted TPOT breaks the class's target, or the tightest TPOT target of the requests it
  admitted to that decode worker that are still running (`tpot_slo`: a loose-class newcomer may
  not slow down a tight-class batch), retry after the predicted time for enough of the decode
  batch to finish. In the default "predicted" mode TPOT is the decode
  worker's batch at the moment the prefill finishes (departures and the ledger's joins counted,
  see estimate.py), so admission does not swing with the momentary batch; "current" takes the
  batch as reported now and exists as the baseline to compare against. On a co-located decode
  worker both modes add the steady-state prefill stall (`prefill_stall_s(steady=True)`: the
  prefills that will follow the batch's requests run in its steps), and with `tpot_margin` the
  prediction must leave that part of the target free;
- its class is past its share of the prefill capacity while another class that is within its
  share (or of higher priority) is active (`class_share`).

With `low_hit_share` set, each class's share is split in two share groups: its low-hit requests
(under `low_hit_ratio` of the prompt found in the store) are guaranteed that part of it, so a
flood of cheap, high-hit requests cannot keep the queues too full for requests that must compute
most of their prompt (and the other way round). Groups are judged by the same rule as classes.

With `tenants` given (tenant -> weight), every group is split once more by tenant
("<group>@<tenant>"), each tenant guaranteed `weight / sum(weights)` of its class's share: a
tenant's flood is past its share and must leave headroom for every other tenant within its own,
so one tenant cannot starve another of the same class (and a request of a tenant not in the
map is refused with UnknownTenant, a bug in the caller).

Shares: each class is guaranteed `share / sum(shares)` of the prefill pool's capacity (one second
of prefill work per second per prefill worker), measured as its admitted work over the last
`share_window_s` (an exponentially decaying sum). A class within its share is judged only on its
SLO. A class past its share may borrow idle capacity, but must leave headroom for every other
class that has asked for service within the window and is within its own share (or has a higher
priority): it is admitted only while its predicted TTFT stays under the headroom of each such
class, `min(ttft_s * (1 - share fraction), ttft_s - its largest recent request's work)` (room
for its share of the queue, and for its requests to fit behind it). So a flood of one class keeps the queues short enough for the
others to meet their targets, and with nobody else active the flood may use everything: below
capacity nothing is refused.

Mutates only its own bookkeeping (`on_dispatch`, `on_first_token`, `on_finish`); no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.router.core.errors import ErrorKind, RouterError, UnknownSloClass
from engine.router.core.estimate import estimate_tpot, prefill_stall_s
from engine.router.core.slo import AdmissionConfig, SloClass
from engine.router.core.timemodel import TimeModel
from engine.router.core.types import (
    Placement,
    Refusal,
    RefusalReason,
    RequestView,
    Role,
    WorkerView,
)

MIN_RETRY_S = 0.05  # the smallest retry hint: a refusal always says "later", never "now"
HEADROOM_MARGIN = 0.1  # a protected group's largest request is given this much more room
INFLIGHT_MAX_AGE_S = 3600.0  # a request whose finish was never reported is forgotten after this


@dataclass(frozen=True, slots=True)
class _Group:
    """A share group: a class, or the low-hit or other requests of a class."""

    slo: SloClass
    fraction: float  # of the prefill pool's capacity


class UnknownTenant(RouterError):
    """A request of a tenant that the admission's tenant map does not have."""

    def __init__(self, tenant: str) -> None:
        super().__init__(ErrorKind.internal, f"tenant {tenant!r} has no admission share")


def _groups(config: AdmissionConfig, tenants: Mapping[str, float] | None) -> dict[str, _Group]:
    out: dict[str, _Group] = {}
    low = config.low_hit_share
    for slo in config.classes:
        fraction = config.share_fraction(slo.name)
        if low <= 0:
            out[slo.name] = _Group(slo, fraction)
        else:
            out[f"{slo.name}/low_hit"] = _Group(slo, fraction * low)
            out[f"{slo.name}/hit"] = _Group(slo, fraction * (1.0 - low))
    if not tenants:
        return out
    total = sum(tenants.values())
    return {
        f"{key}@{tenant}": _Group(group.slo, group.fraction * weight / total)
        for key, group in out.items()
        for tenant, weight in tenants.items()
    }


@dataclass(slots=True)
class _Rate:
    """An exponentially decaying sum of admitted work (seconds) with its last update time."""

    value: float = 0.0
    at_s: float = 0.0

    def decayed(self, now: float, window_s: float) -> float:
        if now <= self.at_s:
            return self.value
        return self.value * math.exp(-(now - self.at_s) / window_s)

    def add(self, work_s: float, now: float, window_s: float) -> None:
        self.value = self.decayed(now, window_s) + work_s
        self.at_s = max(now, self.at_s)


@dataclass(slots=True)
class _Peak:
    """The largest value seen within the last window (forgotten a window after it was seen)."""

    value: float = 0.0
    at_s: float = -math.inf

    def seen(self, now: float, window_s: float) -> float:
        return self.value if now - self.at_s <= window_s else 0.0

    def add(self, value: float, now: float, window_s: float) -> None:
        if value >= self.seen(now, window_s):
            self.value, self.at_s = value, now


class Admission:
    def __init__(
        self,
        config: AdmissionConfig | None = None,
        *,
        model: TimeModel | None = None,
        tenants: Mapping[str, float] | None = None,
    ) -> None:
        """`model` is needed for mode "current" (it re-prices TPOT) and for TPOT retry hints;
        `tenants` (tenant -> share weight, each > 0) splits every share group by tenant."""
        self.config = config if config is not None else AdmissionConfig()
        self.model = model
        for tenant, weight in (tenants or {}).items():
            if not weight > 0 or math.isinf(weight):
                raise ValueError(f"tenant {tenant!r}: share must be a positive number")
        self.tenants = dict(tenants or {})
        self._groups = _groups(self.config, self.tenants)
        self._rates: dict[str, _Rate] = {key: _Rate() for key in self._groups}
        self._largest: dict[str, _Peak] = {key: _Peak() for key in self._groups}
        self._last_asked: dict[str, float] = {}
        self._inflight: dict[str, str] = {}  # request id -> class name
        # decode worker -> {request id: (its TPOT target, dispatch time)}: what a newcomer must
        # not break; an entry whose finish never came is forgotten after INFLIGHT_MAX_AGE_S
        self._decoding: dict[str, dict[str, tuple[float, float]]] = {}
        self._decode_of: dict[str, str] = {}
        self._started_s: float | None = None
        self.admitted: dict[str, int] = {c.name: 0 for c in self.config.classes}
        self.refused: dict[tuple[str, RefusalReason], int] = {}

    @property
    def mode(self) -> str:
        return self.config.mode

    def resolve(self, name: str) -> SloClass:
        """The class a request named ("" = the default); raises UnknownSloClass."""
        slo = self.config.by_name(name or self.config.default_class)
        if slo is None:
            raise UnknownSloClass(name, tuple(c.name for c in self.config.classes))
        return slo

    def group_of(self, request: RequestView) -> str:
        """The share group of a request: its class, or with `low_hit_share` its class and
        whether it is low-hit ("<class>/low_hit") or not ("<class>/hit")."""
        slo = self.resolve(request.slo_class)
        if self.config.low_hit_share <= 0:
            group = slo.name
        else:
            hit = request.prefix.hit_pages * request.page_tokens / request.prompt_tokens
            low = hit < self.config.low_hit_ratio
            group = f"{slo.name}/low_hit" if low else f"{slo.name}/hit"
        if not self.tenants:
            return group
        if request.tenant not in self.tenants:
            raise UnknownTenant(request.tenant)
        return f"{group}@{request.tenant}"

    def work_rate(self, group: str, now: float) -> float:
        """A share group's (or a class's, all its groups) admitted prefill work per second over
        the share window.

        The decaying sum is divided by the window's effective length so far (bias-corrected:
        `window * (1 - exp(-elapsed / window))`, elapsed counted from the first admission call,
        at least a tenth of the window), so a flood shows its real rate from its first moments
        rather than after a whole window has passed."""
        if self._started_s is None:
            return 0.0
        keys = (
            [group]
            if group in self._rates
            else [k for k, g in self._groups.items() if g.slo.name == group]
        )
        window = self.config.share_window_s
        elapsed = max(now - self._started_s, window / 10.0)
        total = sum(self._rates[k].decayed(now, window) for k in keys)
        return total / (window * -math.expm1(-elapsed / window))

    def admit(
        self,
        request: RequestView,
        placement: Placement,
        workers: Sequence[WorkerView],
        now: float,
        *,
        model: TimeModel | None = None,
    ) -> Placement | Refusal:
        """`placement` if the request may run now, else a Refusal (see module doc). Records that
        the class asked (for the share rule) and counts refusals; admission counts on dispatch."""
        slo = self.resolve(request.slo_class)
        group = self.group_of(request)
        self._last_asked[group] = now
        self._largest[group].add(placement.prefill_work_s, now, self.config.share_window_s)
        if self._started_s is None:
            self._started_s = now
        limit, protected = self._ttft_limit(group, placement, workers, now)
        ttft = placement.predicted_ttft_s
        if ttft > limit:
            if ttft > slo.ttft_s:
                reason = RefusalReason.ttft_slo
                detail = f"predicted TTFT {ttft:.3f}s > {slo.name} target {slo.ttft_s:.3f}s"
            else:
                reason = RefusalReason.class_share
                detail = (
                    f"{group} is past its share; predicted TTFT {ttft:.3f}s would eat "
                    f"the headroom of {protected} (limit {limit:.3f}s)"
                )
            return self._refuse(slo, reason, max(ttft - limit, MIN_RETRY_S), detail, placement)
        tpot = self._tpot(request, placement, workers, now, model or self.model)
        tightest = self._tightest_tpot(placement.decode_id, now)
        target = min(slo.tpot_s, tightest)
        if tpot * (1.0 + self.config.tpot_margin) > target:
            retry = self._tpot_retry(request, placement, workers, now, target, model or self.model)
            if tpot > slo.tpot_s:
                detail = (
                    f"predicted TPOT {tpot * 1e3:.1f}ms > {slo.name} target "
                    f"{slo.tpot_s * 1e3:.1f}ms ({self.mode} decode load)"
                )
            else:
                detail = (
                    f"predicted TPOT {tpot * 1e3:.1f}ms would break the "
                    f"{tightest * 1e3:.1f}ms target of requests decoding on {placement.decode_id}"
                )
            return self._refuse(slo, RefusalReason.tpot_slo, retry, detail, placement)
        return placement

    def on_dispatch(self, request: RequestView, placement: Placement, now: float) -> None:
        """The request was admitted and sent: its prefill work counts toward its class's share."""
        slo = self.resolve(request.slo_class)
        group = self.group_of(request)
        self._rates[group].add(placement.prefill_work_s, now, self.config.share_window_s)
        self._inflight[request.request_id] = slo.name
        self.admitted[slo.name] += 1
        if not math.isinf(slo.tpot_s):
            targets = self._decoding.setdefault(placement.decode_id, {})
            targets[request.request_id] = (slo.tpot_s, now)
            self._decode_of[request.request_id] = placement.decode_id

    def on_resume(self, request_id: str, decode_id: str) -> None:
        """The request's decode moved to `decode_id` (its worker died): its TPOT target goes
        with it. Shares and counts are unchanged (it was admitted once)."""
        worker = self._decode_of.get(request_id)
        if worker is None or worker == decode_id:
            return
        targets = self._decoding.get(worker, {})
        entry = targets.pop(request_id, None)
        if worker in self._decoding and not targets:
            del self._decoding[worker]
        if entry is not None:
            self._decoding.setdefault(decode_id, {})[request_id] = entry
            self._decode_of[request_id] = decode_id

    def on_first_token(self, request_id: str, now: float) -> None:
        """The prefill finished. (Shares count admitted work, so nothing changes yet.)"""

    def on_finish(self, request_id: str, now: float) -> None:
        """The request ended (done, failed or cancelled)."""
        self._inflight.pop(request_id, None)
        worker = self._decode_of.pop(request_id, None)
        if worker is not None:
            targets = self._decoding.get(worker)
            if targets is not None:
                targets.pop(request_id, None)
                if not targets:
                    del self._decoding[worker]

    def _tightest_tpot(self, decode_id: str, now: float) -> float:
        targets = self._decoding.get(decode_id)
        if not targets:
            return math.inf
        stale = [r for r, (_, at) in targets.items() if now - at > INFLIGHT_MAX_AGE_S]
        for request_id in stale:
            self.on_finish(request_id, now)
        targets = self._decoding.get(decode_id)
        return min(t for t, _ in targets.values()) if targets else math.inf

    def inflight(self, name: str) -> int:
        return sum(1 for c in self._inflight.values() if c == name)

    def _ttft_limit(
        self, group: str, placement: Placement, workers: Sequence[WorkerView], now: float
    ) -> tuple[float, str]:
        """The TTFT this request must stay under, and the group whose headroom set it ("")."""
        window = self.config.share_window_s
        capacity = max(sum(1 for w in workers if w.healthy and w.does_prefill), 1)
        mine = self._groups[group]
        rate = self.work_rate(group, now) + placement.prefill_work_s / window
        if rate <= mine.fraction * capacity:
            return mine.slo.ttft_s, ""
        limit, who = mine.slo.ttft_s, ""
        for key, other in self._groups.items():
            if key == group or math.isinf(other.slo.ttft_s):
                continue
            asked = self._last_asked.get(key)
            if asked is None or now - asked > window:
                continue
            within = self.work_rate(key, now) <= other.fraction * capacity
            if within or other.slo.priority > mine.slo.priority:
                # room for its share of the queue, and for its largest recent request
                largest = self._largest[key].seen(now, window) * (1.0 + HEADROOM_MARGIN)
                headroom = min(
                    other.slo.ttft_s * (1.0 - other.fraction), other.slo.ttft_s - largest
                )
                if headroom < limit:
                    limit, who = max(headroom, 0.0), key
        return limit, who

    def _decode_view(
        self, placement: Placement, workers: Sequence[WorkerView]
    ) -> WorkerView | None:
        for w in workers:
            if w.worker_id == placement.decode_id:
                return w
        return None

    def _tpot(
        self,
        request: RequestView,
        placement: Placement,
        workers: Sequence[WorkerView],
        now: float,
        model: TimeModel | None,
    ) -> float:
        view = self._decode_view(placement, workers)
        steady = 0.0
        if view is not None and model is not None and view.role is Role.colocated:
            # sustained load: the prefills that will follow the batch stall its steps too
            batch = view.running_requests + len(view.pending_joins) + 1.0
            steady = prefill_stall_s(request, view, model, batch, steady=True) - (
                prefill_stall_s(request, view, model, batch)
            )
        if self.mode == "predicted":
            return placement.predicted_tpot_s + steady
        if model is None or view is None:
            raise ValueError("current-load admission needs the time model and the decode view")
        return estimate_tpot(request, view, model, now, now, mode="current") + steady

    def _tpot_retry(
        self,
        request: RequestView,
        placement: Placement,
        workers: Sequence[WorkerView],
        now: float,
        target_s: float,
        model: TimeModel | None,
    ) -> float:
        """Predicted time until the decode batch is small enough for a TPOT of `target_s`."""
        view = self._decode_view(placement, workers)
        if model is None or view is None or view.running_requests == 0:
            return max(placement.predicted_ttft_s, MIN_RETRY_S)
        batch = view.running_requests + len(view.pending_joins)
        per_request = (view.running_context_tokens // max(view.running_requests, 1)) or 1
        step = model.decode_step_s(max(view.running_requests, 1), view.running_context_tokens)
        fits = 0
        for size in range(batch, -1, -1):
            cost = model.decode_step_s(size + 1, (size + 1) * per_request)
            if cost <= target_s:
                fits = size
                break
        excess = max(batch - fits, 1)
        remaining = sorted(view.running_remaining_tokens)
        if len(remaining) >= excess:
            wait = remaining[excess - 1] * step
        else:
            wait = excess / max(batch, 1) * request.max_tokens * step
        return max(wait, MIN_RETRY_S)

    def _refuse(
        self,
        slo: SloClass,
        reason: RefusalReason,
        retry_after_s: float,
        detail: str,
        placement: Placement,
    ) -> Refusal:
        key = (slo.name, reason)
        self.refused[key] = self.refused.get(key, 0) + 1
        return Refusal(reason, retry_after_s, detail, slo.name, placement)
