"""Placement policies on constructed cases: each does what its name says, `strata` weighs hits
against queues (exploit the hit unless its queue makes it slower; a hot prefix spreads)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from engine.router.core import (
    TIERS,
    Admission,
    Candidate,
    DecodeCoeffs,
    DispatchLedger,
    PendingJoin,
    Placement,
    PrefillCoeffs,
    PrefixHit,
    PullCoeffs,
    Refusal,
    RefusalReason,
    RequestView,
    Role,
    RouterCore,
    TimeModel,
    WorkerView,
    build_policy,
    explain,
)
from engine.router.core.estimate import (
    batch_step_s,
    decode_load,
    estimate_prefill,
    prefix_groups,
)
from engine.router.core.types import CandidateList

pytestmark = pytest.mark.unit

PAGE = 16
PAGE_BYTES = 64 * 1024
MODEL = TimeModel(
    prefill=PrefillCoeffs(
        fixed_s=0.005, per_token_s=5e-5, per_cached_token_s=1e-7, attention_s=1e-8
    ),
    decode=DecodeCoeffs(fixed_s=0.008, per_request_s=5e-4, per_context_token_s=1e-7),
    pulls=(
        PullCoeffs("dram", True, 2e-4, 1 / 4e9),  # shared memory
        PullCoeffs("dram", False, 1e-3, 1 / 2.5e8),  # remote TCP, 250 MB/s
        PullCoeffs("ssd", True, 5e-4, 1 / 1e9),
    ),
)


def prefill(worker_id: str, host: str, **load: int) -> WorkerView:
    return WorkerView(worker_id, Role.prefill, host, "m", PAGE, **load)


def decode(worker_id: str, host: str, **load: int) -> WorkerView:
    return WorkerView(worker_id, Role.decode, host, "m", PAGE, max_batch=32, **load)


def request(
    rid: str = "r", prompt: int = 2048, hit_pages: int = 120, node: str = "A", **kw
) -> RequestView:
    prefix = PrefixHit.uniform(hit_pages, "dram", node) if hit_pages else PrefixHit.none()
    return RequestView(
        rid, prompt, 32, prefix=prefix, page_tokens=PAGE, page_bytes=PAGE_BYTES, **kw
    )


def place(policy: str, req: RequestView, workers: list[WorkerView], seed: int = 0) -> Placement:
    out = build_policy(policy).place(req, workers, MODEL, 0.0, random.Random(seed))
    assert isinstance(out, Placement), out
    return out


def test_strata_goes_to_the_hit_when_both_are_idle() -> None:
    workers = [prefill("a:1", "A"), prefill("b:1", "B"), decode("d:1", "A")]
    out = place("strata", request(), workers)
    assert out.prefill_id == "a:1" and out.decode_id == "d:1"
    assert out.hit_tokens_used == 120 * PAGE
    loser = next(c for c in out.candidates if c.prefill_id == "b:1")
    assert loser.rejected_because and "pull" in loser.rejected_because  # remote pull is dearer
    assert out.candidates[0].rejected_because == ""


def test_strata_leaves_the_hit_exactly_when_its_queue_makes_it_slower() -> None:
    req = request()
    idle_b = estimate_prefill(req, prefill("b:1", "B"), MODEL).ttft_s
    at_a = estimate_prefill(req, prefill("a:1", "A"), MODEL).ttft_s
    assert at_a < idle_b
    # the queue (one queued request of q tokens) at which A's TTFT equals B's
    q = next(t for t in range(16, 100_000, 16) if MODEL.queue_drain_s(t, 1) + at_a > idle_b)
    below = [
        prefill("a:1", "A", queued_prefill_tokens=q - 16, queued_requests=1),
        prefill("b:1", "B"),
        decode("d:1", "A"),
    ]
    above = [
        prefill("a:1", "A", queued_prefill_tokens=q + 16, queued_requests=1),
        prefill("b:1", "B"),
        decode("d:1", "A"),
    ]
    exact = build_policy("strata", tie_tolerance=0.0)
    assert exact.place(req, below, MODEL, 0.0, random.Random(0)).prefill_id == "a:1"  # type: ignore[union-attr]
    moved = exact.place(req, above, MODEL, 0.0, random.Random(0))
    assert isinstance(moved, Placement)
    assert moved.prefill_id == "b:1"
    lost = next(c for c in moved.candidates if c.prefill_id == "a:1")
    assert "queue" in lost.rejected_because


def test_strata_recomputes_when_a_remote_pull_is_slower() -> None:
    # a slow remote path: pulling 120 pages remotely costs more than computing 1920 tokens
    slow = replace(
        MODEL,
        pulls=(PullCoeffs("dram", True, 2e-4, 1 / 4e9), PullCoeffs("dram", False, 1e-3, 1 / 2e7)),
    )
    req = request()
    b = estimate_prefill(req, prefill("b:1", "B"), slow)
    assert b.hit_tokens_used == 0 and b.pull_s == 0.0
    assert b.compute_s == pytest.approx(slow.prefill_s(req.prompt_tokens, 0))
    a = estimate_prefill(req, prefill("a:1", "A"), slow)
    assert a.hit_tokens_used == 120 * PAGE


def test_strata_prefers_the_less_loaded_decode_worker() -> None:
    workers = [
        prefill("a:1", "A"),
        decode("d:1", "A", running_requests=24, running_context_tokens=24 * 3000),
        decode("d:2", "B"),
    ]
    out = place("strata", request(), workers)
    assert out.decode_id == "d:2"
    lost = next(c for c in out.candidates if c.decode_id == "d:1")
    assert "decode load" in lost.rejected_because


def test_hot_prefix_spreads_over_workers_under_a_burst() -> None:
    workers = [prefill(f"p{i}:1", h) for i, h in enumerate("ABCD")] + [
        decode(f"d{i}:1", h) for i, h in enumerate("ABCD")
    ]
    core = RouterCore(build_policy("strata"), Admission(), MODEL, DispatchLedger())
    rng = random.Random(7)
    picks = Counter()
    for i in range(40):  # all at once: the reports never see the burst
        out = core.decide(request(f"r{i}"), workers, 0.0, rng)
        assert isinstance(out, Placement)
        picks[out.prefill_id] += 1
    assert len(picks) == 4  # every worker took part of the hot prefix
    assert picks.most_common(1)[0][0] == "p0:1"  # the one next to the pages took the most
    assert picks["p0:1"] < 40 * 0.75
    # and a single request on idle workers still exploits the hit
    fresh = RouterCore(build_policy("strata"), Admission(), MODEL, DispatchLedger())
    first = fresh.decide(request("x"), workers, 0.0, random.Random(1))
    assert isinstance(first, Placement) and first.prefill_id == "p0:1"


def test_round_robin_takes_turns_in_id_order() -> None:
    workers = [
        prefill("p2:1", "B"),
        prefill("p1:1", "A"),
        prefill("p3:1", "C"),
        decode("d2:1", "B"),
        decode("d1:1", "A"),
    ]
    policy = build_policy("round_robin")
    got = [policy.place(request(str(i)), workers, MODEL, 0.0, random.Random(0)) for i in range(6)]
    assert [p.prefill_id for p in got] == ["p1:1", "p2:1", "p3:1"] * 2  # type: ignore[union-attr]
    assert [p.decode_id for p in got] == ["d1:1", "d2:1"] * 3  # type: ignore[union-attr]
    # it prices its pick all the same, for admission
    assert all(p.predicted_ttft_s > 0 and p.predicted_tpot_s > 0 for p in got)  # type: ignore[union-attr]


def test_least_load_picks_the_shortest_queue_and_smallest_batch_ignoring_hits() -> None:
    workers = [
        prefill("a:1", "A", queued_prefill_tokens=4000, queued_requests=2),
        prefill("b:1", "B", queued_prefill_tokens=100, queued_requests=1),
        prefill("c:1", "C", queued_prefill_tokens=900, queued_requests=1),
        decode("d1:1", "A", running_requests=5),
        decode("d2:1", "B", running_requests=2),
    ]
    out = place("least_load", request(node="A"), workers)
    assert (out.prefill_id, out.decode_id) == ("b:1", "d2:1")


def test_least_load_breaks_ties_with_the_rng() -> None:
    workers = [prefill("a:1", "A"), prefill("b:1", "B"), decode("d:1", "A")]
    seen = {place("least_load", request(), workers, seed).prefill_id for seed in range(20)}
    assert seen == {"a:1", "b:1"}


def test_longest_prefix_follows_the_pages_whatever_the_load() -> None:
    workers = [
        prefill("a:1", "A", queued_prefill_tokens=1_000_000, queued_requests=50),
        prefill("b:1", "B"),
        decode("d1:1", "A", running_requests=30),
        decode("d2:1", "B"),
    ]
    out = place("longest_prefix", request(node="A"), workers)
    assert (out.prefill_id, out.decode_id) == ("a:1", "d1:1")
    # pages split over two nodes: the host with more of them wins
    split = PrefixHit(10, ("dram",) * 10, ("A",) * 3 + ("B",) * 7)
    req = RequestView("s", 512, 8, prefix=split, page_tokens=PAGE, page_bytes=PAGE_BYTES)
    assert place("longest_prefix", req, workers).prefill_id == "b:1"


def test_colocated_workers_pair_with_themselves() -> None:
    workers = [
        WorkerView(
            "c1:1", Role.colocated, "A", "m", PAGE, queued_prefill_tokens=5000, queued_requests=2
        ),
        WorkerView("c2:1", Role.colocated, "B", "m", PAGE),
    ]
    for name in ("strata", "round_robin", "least_load", "longest_prefix"):
        out = place(name, request(hit_pages=0), workers)
        assert out.prefill_id == out.decode_id and out.colocated
    assert place("strata", request(hit_pages=0), workers).prefill_id == "c2:1"


@pytest.mark.parametrize("name", ["strata", "round_robin", "least_load", "longest_prefix"])
def test_no_worker_is_a_refusal(name: str) -> None:
    sick = [replace(prefill("a:1", "A"), healthy=False), decode("d:1", "A")]
    out = build_policy(name).place(request(), sick, MODEL, 0.0, random.Random(0))
    assert (
        isinstance(out, Refusal) and out.reason is RefusalReason.no_worker and out.retry_after_s > 0
    )
    # prefill workers but no decode worker: nothing can serve either
    out = build_policy(name).place(request(), [prefill("a:1", "A")], MODEL, 0.0, random.Random(0))
    assert isinstance(out, Refusal) and out.reason is RefusalReason.no_worker
    # a model nobody serves
    out = build_policy(name).place(
        request(model="other"),
        [prefill("a:1", "A"), decode("d:1", "A")],
        MODEL,
        0.0,
        random.Random(0),
    )
    assert isinstance(out, Refusal) and "other" in out.detail


def test_build_policy_by_name() -> None:
    assert build_policy().name == "strata"
    assert build_policy("strata", decode_weight=0.0).decode_weight == 0.0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown policy"):
        build_policy("random")
    with pytest.raises(ValueError, match="no option"):
        build_policy("strata", speed=1.0)
    with pytest.raises(ValueError, match="no options"):
        build_policy("round_robin", decode_weight=1.0)


def test_explain_lists_every_candidate() -> None:
    workers = [prefill("a:1", "A"), prefill("b:1", "B"), decode("d1:1", "A"), decode("d2:1", "B")]
    out = place("strata", request(), workers)
    info = explain(out)
    assert info["prefill"] == out.prefill_id and info["policy"] == "strata"
    cands = info["candidates"]
    assert isinstance(cands, list) and len(cands) == 4  # every pair, when there are few
    assert [c["rejected_because"] == "" for c in cands].count(True) == 1


def test_a_colocated_worker_pays_its_decode_steps_during_prefill() -> None:
    busy = WorkerView(
        "c:1",
        Role.colocated,
        "A",
        "m",
        PAGE,
        running_requests=16,
        running_context_tokens=16 * 1000,
        step_token_budget=272,
    )
    req = request(hit_pages=0, prompt=1024)
    est = estimate_prefill(req, busy, MODEL)
    steps = -(-1024 // (272 - 16))  # 4 steps of 256 prompt tokens, each with a decode step
    extra = steps * MODEL.decode_step_s(16, 16 * 1000)
    assert est.compute_s == pytest.approx(MODEL.prefill_s(1024, 0) + extra)
    # unknown budget or an idle batch: the prefill alone
    assert estimate_prefill(req, replace(busy, step_token_budget=0), MODEL).compute_s == (
        pytest.approx(MODEL.prefill_s(1024, 0))
    )
    assert estimate_prefill(req, replace(busy, running_requests=0), MODEL).compute_s == (
        pytest.approx(MODEL.prefill_s(1024, 0))
    )
    # and its queue interleaves the same way
    queued = replace(busy, queued_prefill_tokens=512, queued_requests=1)
    assert estimate_prefill(req, queued, MODEL).queue_s == pytest.approx(
        MODEL.prefill_s(512, 0) + 2 * MODEL.decode_step_s(16, 16 * 1000)
    )


def test_a_full_hit_still_computes_the_last_token() -> None:
    req = request(prompt=PAGE * 8, hit_pages=8)
    est = estimate_prefill(req, prefill("a:1", "A"), MODEL)
    assert est.hit_tokens_used == PAGE * 7 and est.compute_s > 0


def test_steps_at_gives_the_step_of_the_joined_batch_for_every_join() -> None:
    """DecodeLoad.steps_at (the strata policy's batched pricing) equals pricing each join with
    `joined` + `batch_step_s` (as estimate_tpot does), exactly, with departures, ledger joins,
    a batch past max_batch, a life given or taken at the join."""
    rng = random.Random(5)
    now = 10.0
    for case in range(300):
        running = rng.randrange(0, 40)
        view = WorkerView(
            "d:1",
            Role.decode,
            "A",
            "m",
            PAGE,
            running_requests=running,
            running_context_tokens=running * rng.randrange(1, 4000),
            max_batch=rng.choice((1, 4, 16, 64)),
            report_age_s=rng.choice((0.0, rng.uniform(0.0, 0.5))),
            running_remaining_tokens=tuple(
                rng.randrange(0, 500) for _ in range(rng.choice((0, running, running // 2)))
            ),
            pending_joins=tuple(
                PendingJoin(
                    f"j{k}",
                    now + rng.uniform(-0.5, 3),
                    rng.randrange(1, 3000),
                    rng.randrange(1, 300),
                )
                for k in range(rng.randrange(0, 4))
            ),
        )
        load = decode_load(view, MODEL, now)
        own, max_tokens = rng.uniform(1.0, 5000.0), rng.randrange(1, 512)
        joins = [
            now + rng.choice((0.0, rng.uniform(-0.2, 4.0))) for _ in range(rng.randrange(1, 6))
        ]
        life = rng.choice((None, 0.0, rng.uniform(0.01, 20.0)))
        want = []
        for join in joins:
            running_at, context_at = load.joined(MODEL, own, max_tokens, join, life)
            want.append(batch_step_s(MODEL, running_at + 1.0, context_at + own, view.max_batch))
        assert load.steps_at(MODEL, own, max_tokens, joins, life) == want, case


def test_a_candidate_list_is_built_once_and_only_when_read() -> None:
    cands = tuple(
        Candidate(f"p{i}:1", "d:1", 0.1 * i, 0.01, 0.1 * i + 1.0, "" if i == 0 else "lost")
        for i in range(3)
    )
    calls = []

    def build() -> tuple[Candidate, ...]:
        calls.append(1)
        return cands

    lazy = CandidateList(3, build)
    assert len(lazy) == 3 and bool(lazy) and not calls  # the length builds nothing
    assert lazy[0] is cands[0] and list(lazy) == list(cands) and lazy == cands
    assert lazy[1:] == cands[1:] and lazy[-1] is cands[2]
    assert calls == [1]  # built once
    with pytest.raises(AssertionError, match="announced 4"):
        list(CandidateList(4, build))
    with pytest.raises(ValueError, match="at least its winner"):
        CandidateList(0, build)


def test_strata_builds_its_explanation_only_when_asked() -> None:
    """A placement's candidates are priced numbers until read; read, they are the full record
    (every candidate with its cost parts, the winner first, each loser with a reason)."""
    workers = [prefill(f"p{i}:1", h) for i, h in enumerate("ABCD")] + [
        decode(f"d{i}:1", h, running_requests=i * 4, running_context_tokens=i * 4000)
        for i, h in enumerate("ABCD")
    ]
    out = place("strata", request(), workers)
    assert isinstance(out.candidates, CandidateList)
    assert out.candidates._items is None  # nothing built by placing
    info = explain(out)
    cands = info["candidates"]
    assert isinstance(cands, list) and len(cands) == len(out.candidates)
    assert cands[0]["rejected_because"] == "" and cands[0]["prefill"] == out.prefill_id
    assert all(c["rejected_because"] for c in cands[1:])
    assert {c["prefill"] for c in cands} == {f"p{i}:1" for i in range(4)}


def test_prefix_groups_of_one_tier_match_the_general_grouping() -> None:
    """The shortcuts for a hit in one tier (on one node, or spread over nodes) group the pages
    as counting every (tier, host) pair does, in first-seen order."""
    rng = random.Random(3)
    for _ in range(200):
        pages = rng.randrange(1, 40)
        tiers = rng.choice((("dram",) * pages, tuple(rng.choice(TIERS) for _ in range(pages))))
        hosts = rng.choice((("A",) * pages, tuple(rng.choice("ABC") for _ in range(pages))))
        req = RequestView(
            "r", rng.randrange(1, 800), 4, prefix=PrefixHit(pages, tiers, hosts), page_tokens=PAGE
        )
        got = prefix_groups(req)
        usable = max(0, min(pages, (req.prompt_tokens - 1) // PAGE))
        want: dict[str, dict[str, int]] = {}
        for tier, host in zip(tiers[:usable], hosts[:usable], strict=True):
            want.setdefault(tier, {}).setdefault(host, 0)
            want[tier][host] += 1
        assert got.pages == usable
        assert [(t, n, list(h.items())) for t, n, h in got.by_tier] == [
            (t, sum(h.values()), list(h.items())) for t, h in want.items()
        ]
