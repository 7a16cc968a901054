"""Admission on a tiny deterministic fake-time cluster whose truth is the time model itself.

The fake cluster runs prefill queues (FIFO, each request taking exactly the model's prefill time)
and decode batches (each step taking exactly the model's step time for the batch it has), reports
its load every `report_every_s`, and feeds first tokens and finishes back to the RouterCore. So a
refusal, a retry hint and an SLO miss are all checked against the same truth the router predicts
from; the test asserts on what clients would see.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from engine.router.core import (
    Admission,
    AdmissionConfig,
    DecodeCoeffs,
    DispatchLedger,
    Placement,
    PrefillCoeffs,
    PrefixHit,
    Refusal,
    RefusalReason,
    RequestView,
    Role,
    RouterCore,
    SloClass,
    TimeModel,
    WorkerView,
    build_policy,
)

pytestmark = pytest.mark.unit

PAGE = 16
MODEL = TimeModel(
    prefill=PrefillCoeffs(fixed_s=0.005, per_token_s=5e-5, per_cached_token_s=0.0, attention_s=0.0),
    decode=DecodeCoeffs(fixed_s=0.008, per_request_s=5e-4, per_context_token_s=0.0),
)
DT = 0.001  # the fake clock's tick


@dataclass
class Job:
    request: RequestView
    placement: Placement
    arrive: float
    work_left: float
    first_token: float | None = None
    finish: float | None = None
    tokens: float = 0.0


@dataclass
class Outcome:
    admitted: list[Job] = field(default_factory=list)
    refused: list[tuple[RequestView, Refusal]] = field(default_factory=list)

    def attainment(self, slo: SloClass) -> float:
        done = [j for j in self.admitted if j.finish is not None and j.first_token is not None]
        assert len(done) == len(self.admitted), "every admitted request must finish"
        ok = [j for j in done if ttft(j) <= slo.ttft_s + 2 * DT and tpot(j) <= slo.tpot_s * 1.02]
        return len(ok) / len(done) if done else 1.0


def ttft(job: Job) -> float:
    assert job.first_token is not None
    return job.first_token - job.arrive


def tpot(job: Job) -> float:
    assert job.finish is not None and job.first_token is not None
    return (job.finish - job.first_token) / max(job.request.max_tokens - 1, 1)


class FakeCluster:
    def __init__(self, n_prefill: int, n_decode: int, report_every_s: float, max_batch: int = 64):
        self.prefill = {f"p{i}:1": [] for i in range(n_prefill)}  # id -> FIFO of jobs
        self.decode = {f"d{i}:1": [] for i in range(n_decode)}  # id -> running jobs
        self.report_every_s = report_every_s
        self.max_batch = max_batch
        self._snapshot: list[WorkerView] = []
        self._snapshot_at = -math.inf

    def views(self, now: float) -> list[WorkerView]:
        if now - self._snapshot_at >= self.report_every_s:
            self._snapshot_at = now
            self._snapshot = [
                WorkerView(
                    wid,
                    Role.prefill,
                    wid,
                    "m",
                    PAGE,
                    queued_prefill_tokens=sum(
                        round(_to_compute(j) * j.work_left / _work(j.request, j.placement))
                        for j in q
                    ),
                    queued_requests=len(q),
                )
                for wid, q in self.prefill.items()
            ] + [
                WorkerView(
                    wid,
                    Role.decode,
                    wid,
                    "m",
                    PAGE,
                    running_requests=len(b),
                    running_context_tokens=sum(j.request.prompt_tokens + int(j.tokens) for j in b),
                    running_remaining_tokens=tuple(
                        max(j.request.max_tokens - int(j.tokens), 0) for j in b
                    ),
                    max_batch=self.max_batch,
                )
                for wid, b in self.decode.items()
            ]
        age = now - self._snapshot_at
        return [_aged(v, age) for v in self._snapshot]

    def dispatch(self, job: Job) -> None:
        self.prefill[job.placement.prefill_id].append(job)

    def tick(self, now: float, core: RouterCore) -> None:
        """Advance the cluster from `now` to `now + DT`."""
        for q in self.prefill.values():
            budget = DT
            while q and budget > 0:
                head = q[0]
                used = min(budget, head.work_left)
                head.work_left -= used
                budget -= used
                if head.work_left <= 1e-12:
                    q.pop(0)
                    head.first_token = now + DT - budget
                    head.tokens = 1.0
                    core.on_first_token(head.request.request_id, head.first_token)
                    self.decode[head.placement.decode_id].append(head)
        for batch in self.decode.values():
            if not batch:
                continue
            ctx = sum(j.request.prompt_tokens + int(j.tokens) for j in batch)
            step = MODEL.decode_step_s(len(batch), ctx)
            for job in list(batch):
                job.tokens += DT / step
                if job.tokens >= job.request.max_tokens:
                    job.finish = now + DT
                    batch.remove(job)
                    core.on_finish(job.request.request_id, job.finish, job.request.max_tokens)

    def busy(self) -> bool:
        return any(self.prefill.values()) or any(self.decode.values())


def _to_compute(job: Job) -> int:
    return job.request.prompt_tokens - job.placement.hit_tokens_used


def _work(request: RequestView, placement: Placement) -> float:
    """The true prefill time: compute what the placement does not pull (pulls are free here)."""
    hit = placement.hit_tokens_used
    return MODEL.prefill_s(request.prompt_tokens - hit, hit)


def _aged(view: WorkerView, age: float) -> WorkerView:
    from dataclasses import replace

    return replace(view, report_age_s=age)


def run(
    core: RouterCore,
    cluster: FakeCluster,
    arrivals: list[tuple[float, RequestView]],
    seed: int = 0,
    horizon_s: float = 30.0,
) -> Outcome:
    """Drive arrivals through the core and the cluster until every admitted request finished."""
    rng = random.Random(seed)
    out = Outcome()
    pending = sorted(arrivals, key=lambda a: a[0])
    now, i = 0.0, 0
    for _ in range(int(horizon_s / DT)):
        while i < len(pending) and pending[i][0] <= now + 1e-12:
            _, req = pending[i]
            i += 1
            decision = core.decide(req, cluster.views(now), now, rng)
            if isinstance(decision, Refusal):
                out.refused.append((req, decision))
                continue
            job = Job(req, decision, now, _work(req, decision))
            out.admitted.append(job)
            cluster.dispatch(job)
        cluster.tick(now, core)
        now += DT
        if i == len(pending) and not cluster.busy():
            return out
    raise AssertionError("the fake cluster did not drain within its horizon")


def req(
    rid: str, prompt: int = 1000, max_tokens: int = 10, slo: str = "", hit_pages: int = 0
) -> RequestView:
    prefix = PrefixHit.uniform(hit_pages, "dram", "p0:1") if hit_pages else PrefixHit.none()
    return RequestView(
        rid, prompt, max_tokens, slo_class=slo, prefix=prefix, page_tokens=PAGE, page_bytes=1024
    )


INTERACTIVE = SloClass("interactive", ttft_s=0.5, tpot_s=0.05)


def core_for(config: AdmissionConfig, policy: str = "strata") -> RouterCore:
    return RouterCore(build_policy(policy), Admission(config, model=MODEL), MODEL, DispatchLedger())


def test_an_overload_burst_is_partly_refused_and_the_admitted_meet_their_slo() -> None:
    config = AdmissionConfig(classes=(INTERACTIVE,), default_class="interactive")
    core = core_for(config)
    cluster = FakeCluster(n_prefill=2, n_decode=1, report_every_s=0.05)
    burst = [(0.0, req(f"r{i}")) for i in range(60)]  # 60 x 55 ms of prefill on 2 workers: 1.65 s
    out = run(core, cluster, burst)
    assert 0 < len(out.admitted) < 60
    # 0.5 s of queue per worker at 55 ms a request: 9 each
    assert len(out.admitted) == 2 * int(INTERACTIVE.ttft_s / MODEL.prefill_s(1000, 0))
    assert all(r.reason is RefusalReason.ttft_slo and r.retry_after_s > 0 for _, r in out.refused)
    assert out.attainment(INTERACTIVE) == 1.0
    # the retry hint is the predicted drain: retrying then, the first refused request fits
    first_refused = out.refused[0][1]
    assert first_refused.retry_after_s == pytest.approx(
        first_refused.placement.predicted_ttft_s - INTERACTIVE.ttft_s  # type: ignore[union-attr]
    )
    assert core.admission.refused[("interactive", RefusalReason.ttft_slo)] == len(out.refused)


def test_retrying_after_the_hint_is_admitted() -> None:
    config = AdmissionConfig(classes=(INTERACTIVE,), default_class="interactive")
    core = core_for(config)
    cluster = FakeCluster(n_prefill=1, n_decode=1, report_every_s=0.0)
    out = run(core, cluster, [(0.0, req(f"r{i}")) for i in range(12)])
    refused = out.refused[0][1]
    core2 = core_for(config)
    cluster2 = FakeCluster(n_prefill=1, n_decode=1, report_every_s=0.0)
    again = [(0.0, req(f"r{i}")) for i in range(12)] + [
        (refused.retry_after_s + 0.002, req("retry"))
    ]
    out2 = run(core2, cluster2, again)
    assert "retry" in {j.request.request_id for j in out2.admitted}


def test_no_overload_nothing_is_refused() -> None:
    config = AdmissionConfig(classes=(INTERACTIVE,), default_class="interactive")
    core = core_for(config)
    cluster = FakeCluster(n_prefill=2, n_decode=1, report_every_s=0.1)
    # 2 workers x 55 ms each: capacity ~36 req/s; offer 25 req/s for 2 s (70%)
    arrivals = [(i * 0.04, req(f"r{i}")) for i in range(50)]
    out = run(core, cluster, arrivals)
    assert out.refused == [] and len(out.admitted) == 50
    assert out.attainment(INTERACTIVE) == 1.0


def decode_bound_workload() -> list[tuple[float, RequestView]]:
    """Waves of requests whose decode batch turns over while the next wave is in prefill."""
    arrivals: list[tuple[float, RequestView]] = []
    for wave in range(6):
        t0 = wave * 0.2
        for k in range(8):
            arrivals.append((t0 + k * 0.001, req(f"w{wave}-{k}", prompt=2000, max_tokens=12)))
    return arrivals


@pytest.mark.parametrize("report_every_s", [0.0, 0.05])
def test_predicted_load_refuses_fewer_than_current_load_at_equal_attainment(
    report_every_s: float,
) -> None:
    # TPOT target 12.1 ms: a batch of 8 (8 + 8 x 0.5 ms) fits, 9 does not. Each wave of 8 is
    # decided while the previous one still decodes, and joins after it has left.
    slo = SloClass("chat", ttft_s=1.0, tpot_s=0.0121)
    results = {}
    for mode in ("predicted", "current"):
        config = AdmissionConfig(classes=(slo,), default_class="chat", mode=mode)
        core = core_for(config)
        cluster = FakeCluster(n_prefill=8, n_decode=1, report_every_s=report_every_s)
        results[mode] = run(core, cluster, decode_bound_workload())
    pred, cur = results["predicted"], results["current"]
    assert len(pred.refused) < len(cur.refused)
    assert pred.attainment(slo) >= cur.attainment(slo)
    assert pred.attainment(slo) >= 0.95
    assert all(r.reason is RefusalReason.tpot_slo and r.retry_after_s > 0 for _, r in cur.refused)


def test_a_class_keeps_its_share_under_another_class_flood() -> None:
    batch = SloClass("batch", ttft_s=2.0, tpot_s=1.0, share=1.0)
    chat = SloClass("chat", ttft_s=0.3, tpot_s=1.0, share=1.0)
    # the flood: 60 req/s of batch (capacity ~36/s); chat at a steady 5 req/s
    arrivals = [(i / 60, req(f"b{i}", slo="batch")) for i in range(180)]
    arrivals += [(0.1 + i * 0.2, req(f"c{i}", slo="chat")) for i in range(15)]
    outcomes = {}
    for chat_share in (1.0, 0.001):
        config = AdmissionConfig(
            classes=(batch, SloClass("chat", 0.3, 1.0, share=chat_share)), default_class="batch"
        )
        core = core_for(config)
        cluster = FakeCluster(n_prefill=2, n_decode=1, report_every_s=0.02)
        outcomes[chat_share] = run(core, cluster, arrivals)
    fair = outcomes[1.0]
    admitted = Counter(j.request.slo_class for j in fair.admitted)
    assert admitted["chat"] >= 14  # chat keeps (nearly) all of its small demand
    assert any(r.reason is RefusalReason.class_share for _, r in fair.refused)
    assert all(
        r.slo_class == "batch" for _, r in fair.refused if r.reason is RefusalReason.class_share
    )
    assert admitted["batch"] > 60  # the flood still uses the rest
    assert fair.attainment(chat) == 1.0
    # with a negligible share, the flood fills the queues and chat starves: the share did it
    starved = Counter(j.request.slo_class for j in outcomes[0.001].admitted)
    assert starved["chat"] < admitted["chat"] // 2


def test_one_class_alone_below_capacity_is_never_refused_by_its_share() -> None:
    config = AdmissionConfig(
        classes=(SloClass("a", 1.0, 1.0, share=1.0), SloClass("b", 1.0, 1.0, share=9.0)),
        default_class="a",
    )
    core = core_for(config)
    cluster = FakeCluster(n_prefill=2, n_decode=1, report_every_s=0.05)
    arrivals = [(i * 0.035, req(f"a{i}", slo="a")) for i in range(60)]  # ~80% of capacity, all "a"
    out = run(core, cluster, arrivals)
    assert out.refused == []


def test_low_hit_requests_keep_their_part_of_a_class_share() -> None:
    chat = SloClass("chat", ttft_s=0.5, tpot_s=1.0)
    # a flood of cheap high-hit requests (896 of 1000 tokens cached: 10 ms of prefill each) at
    # twice the pool's capacity, and a few low-hit ones (4000 tokens, none cached: 205 ms)
    arrivals = [(i / 400, req(f"h{i}", slo="chat", hit_pages=56)) for i in range(1200)]
    arrivals += [(0.05 + i * 0.5, req(f"l{i}", prompt=4000, slo="chat")) for i in range(6)]
    admitted = {}
    for low_hit_share in (0.0, 0.3):
        config = AdmissionConfig(classes=(chat,), default_class="chat", low_hit_share=low_hit_share)
        core = core_for(config)
        cluster = FakeCluster(n_prefill=2, n_decode=1, report_every_s=0.02)
        out = run(core, cluster, arrivals)
        admitted[low_hit_share] = Counter(j.request.request_id[0] for j in out.admitted)
        assert out.attainment(chat) == 1.0
        if low_hit_share:
            assert core.admission.group_of(req("x", slo="chat")) == "chat/low_hit"
            assert any(r.reason is RefusalReason.class_share for _, r in out.refused)
    assert admitted[0.0]["l"] <= 2  # without the split, the flood keeps the queues too full
    assert admitted[0.3]["l"] >= 5  # with it, the low-hit requests get their part
    assert admitted[0.3]["h"] > 400  # and the flood still fills the rest


def test_a_loose_class_may_not_slow_down_a_tight_class_batch() -> None:
    tight = SloClass("tight", ttft_s=10.0, tpot_s=0.0095)
    loose = SloClass("loose", ttft_s=10.0, tpot_s=1.0)
    config = AdmissionConfig(classes=(tight, loose), default_class="loose")
    core = core_for(config)
    workers = [
        WorkerView("p:1", Role.prefill, "A", "m", PAGE),
        WorkerView("d:1", Role.decode, "A", "m", PAGE, running_requests=2,
                   running_context_tokens=2000),
    ]  # fmt: skip
    # a tight request joins the batch: 3 -> 8 + 3 x 0.5 = 9.5 ms per token, just within target
    first = core.decide(req("t", max_tokens=100, slo="tight"), workers, 0.0, random.Random(0))
    assert isinstance(first, Placement)
    # a loose one joining for the whole of the tight one's run: 4 -> 10 ms, fine for its own
    # class, too slow for the tight one
    second = core.decide(req("l1", max_tokens=100, slo="loose"), workers, 0.0, random.Random(0))
    assert isinstance(second, Refusal) and second.reason is RefusalReason.tpot_slo
    assert "tight" not in second.detail and "d:1" in second.detail and second.retry_after_s > 0
    # once the tight request is done, the loose one is welcome
    core.on_finish("t", 1.0, output_tokens=10)
    third = core.decide(req("l2", max_tokens=100, slo="loose"), workers, 1.0, random.Random(0))
    assert isinstance(third, Placement)


def test_config_from_mapping() -> None:
    config = AdmissionConfig.from_mapping(
        {
            "default_class": "standard",
            "mode": "current",
            "classes": [
                {"name": "interactive", "ttft_s": 0.5, "tpot_s": 0.05, "priority": 1, "share": 2},
                {"name": "standard", "ttft_s": 2, "tpot_s": "inf"},
            ],
        }
    )
    assert config.default_class == "standard" and config.mode == "current"
    assert config.by_name("standard").tpot_s == math.inf  # type: ignore[union-attr]
    assert config.share_fraction("interactive") == pytest.approx(2 / 3)
    assert AdmissionConfig.from_mapping({}).classes[0].name == "default"
    for bad, message in (
        ({"classes": [{"name": "a", "ttft": 1}]}, "unknown keys"),
        ({"classes": [{"name": "a", "ttft_s": -1}]}, "> 0"),
        ({"classes": [{"name": "a"}], "default_class": "b"}, "default class"),
        ({"classes": [{"name": "a"}, {"name": "a"}]}, "duplicate"),
        ({"mode": "psychic"}, "mode"),
        ({"classes": [{"name": "a", "share": 0}]}, "share"),
        ({"classes": [{"ttft_s": 1}]}, "name"),
        ({"classes": "a"}, "list"),
        ({"speed": 1}, "unknown keys"),
        ({"low_hit_share": 1.0}, "low_hit_share"),
        ({"low_hit_ratio": 0}, "low_hit_ratio"),
    ):
        with pytest.raises(ValueError, match=message):
            AdmissionConfig.from_mapping(bad)
