"""A decode resumed after its worker died is placed by the core: decode-only, priced, explained."""

from __future__ import annotations

import random

import pytest

from engine.router.core import (
    Admission,
    AdmissionConfig,
    DecodeCoeffs,
    Placement,
    PrefillCoeffs,
    PrefixHit,
    PullCoeffs,
    Refusal,
    RefusalReason,
    RequestView,
    Role,
    RouterCore,
    SloClass,
    TimeModel,
    WorkerView,
    build_policy,
    explain,
)
from engine.router.core.resume import place_resume, resume_view

pytestmark = pytest.mark.unit

PAGE = 16
MODEL = TimeModel(
    prefill=PrefillCoeffs(fixed_s=0.005, per_token_s=5e-5, per_cached_token_s=0.0, attention_s=0.0),
    decode=DecodeCoeffs(fixed_s=0.008, per_request_s=5e-4, per_context_token_s=1e-7),
    pulls=(
        PullCoeffs("dram", True, 1e-4, 1e-10),
        PullCoeffs("dram", False, 1e-3, 1e-8),
    ),
)


def w(worker_id: str, role: Role = Role.decode, host: str = "h1", **load: int) -> WorkerView:
    return WorkerView(worker_id, role, host, "m", PAGE, **load)  # type: ignore[arg-type]


def req(prompt: int = 800, max_tokens: int = 40, hit_pages: int = 0) -> RequestView:
    return RequestView(
        "r",
        prompt,
        max_tokens,
        prefix=PrefixHit.uniform(hit_pages, "dram", "h1"),
        page_tokens=PAGE,
        page_bytes=64 * 1024,
    )


def test_the_rest_of_a_request_is_its_context_and_the_tokens_left() -> None:
    rest = resume_view(req(prompt=800, max_tokens=40), produced=15)
    assert (rest.prompt_tokens, rest.max_tokens) == (815, 25)
    assert resume_view(req(max_tokens=5), produced=9).max_tokens == 1
    with pytest.raises(ValueError):
        resume_view(req(), produced=-1)


def test_the_idler_decode_worker_wins_and_every_other_says_why_it_lost() -> None:
    workers = [
        w("dead:1"),
        w("busy:1", running_requests=40, running_context_tokens=40 * 2000),
        w("idle:1", running_requests=1, running_context_tokens=500),
        w("pre:1", Role.prefill),  # never a decode target
        w("co:1", Role.colocated),  # not for a disaggregated run
    ]
    out = place_resume(req(), workers, MODEL, 0.0, colocated=False, exclude={"dead:1"})
    assert isinstance(out, Placement)
    assert (out.prefill_id, out.decode_id, out.policy) == ("idle:1", "idle:1", "resume")
    assert [c.decode_id for c in out.candidates] == ["idle:1", "busy:1"]
    loser = out.candidates[1]
    assert "decode load" in loser.rejected_because and loser.cost > out.candidates[0].cost
    # the catch-up recomputes the context (no queue on a decode worker)
    assert out.predicted_ttft_s == pytest.approx(MODEL.prefill_s(800, 0))


def test_a_cached_prompt_is_pulled_where_that_is_cheaper_and_its_host_matters() -> None:
    rest = req(prompt=1600, hit_pages=80)
    near = w("b:1", host="h1")
    far = w("a:1", host="h2")
    out = place_resume(rest, [far, near], MODEL, 0.0, colocated=False)
    assert isinstance(out, Placement) and out.decode_id == "b:1"
    assert out.hit_tokens_used > 0 and out.predicted_ttft_s < MODEL.prefill_s(1600, 0)
    assert "pull" in out.candidates[1].rejected_because


def test_a_colocated_run_resumes_on_a_colocated_worker_behind_its_queue() -> None:
    workers = [
        w("c1:1", Role.colocated, queued_prefill_tokens=20_000, queued_requests=10),
        w("c2:1", Role.colocated),
        w("d:1"),
    ]
    out = place_resume(req(), workers, MODEL, 0.0, colocated=True)
    assert isinstance(out, Placement) and out.decode_id == "c2:1"
    assert "queue" in out.candidates[1].rejected_because


def test_nobody_left_is_a_no_worker_refusal() -> None:
    out = place_resume(
        req(), [w("d:1"), w("p:1", Role.prefill)], MODEL, 0.0, colocated=False, exclude={"d:1"}
    )
    assert isinstance(out, Refusal) and out.reason is RefusalReason.no_worker
    unhealthy = place_resume(req(), [w("d:1", healthy=False)], MODEL, 0.0, colocated=False)  # type: ignore[arg-type]
    assert isinstance(unhealthy, Refusal)


def test_core_resume_moves_the_ledger_and_the_tpot_target_and_is_never_refused() -> None:
    tight = AdmissionConfig(classes=(SloClass("c", ttft_s=0.5, tpot_s=0.05),), default_class="c")
    core = RouterCore(build_policy("strata"), Admission(tight), MODEL)
    workers = [w("p:1", Role.prefill), w("d1:1"), w("d2:1")]
    first = core.decide(req(), workers, 0.0, random.Random(0))
    assert isinstance(first, Placement)
    core.on_first_token("r", 0.1)
    dead = first.decode_id
    other = "d2:1" if dead == "d1:1" else "d1:1"
    assert core.admission._decode_of["r"] == dead
    out = core.resume(req(), workers, 1.0, produced=10, colocated=False, exclude={dead})
    assert isinstance(out, Placement) and out.decode_id == other
    entry = core.ledger.get("r")
    assert entry is not None and entry.decode_id == other and entry.max_tokens == 30
    assert entry.context_tokens == 810
    assert core.admission._decode_of["r"] == other and dead not in core.admission._decoding
    # the moved request now weighs on the new worker's view, not on the dead one's
    views = {v.worker_id: v for v in core.ledger.apply(workers, 1.0)}
    assert [j.request_id for j in views[other].pending_joins] == ["r"]
    assert not views[dead].pending_joins
    info = explain(out)
    assert info["policy"] == "resume" and info["decode"] == other
    # finishing releases everything, wherever it ended
    core.on_finish("r", 2.0, output_tokens=40)
    assert len(core.ledger) == 0 and not core.admission._decoding
