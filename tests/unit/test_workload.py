"""Workload spec, generators and arrivals: seeded determinism (golden first requests), shapes, errors."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import pytest

from loadtests.workload import (
    LengthDist,
    WorkloadError,
    generate_requests,
    load_workload,
    parse_workload,
    request_token_ids,
    requests_digest,
)
from loadtests.workload.arrivals import arrival_times
from loadtests.workload.spec import ArrivalSpec

pytestmark = pytest.mark.unit

WORKLOADS = Path(__file__).resolve().parents[2] / "loadtests" / "workloads"


def spec_of(kind: str, process: str = "poisson", generator: dict | None = None, **arrival: float):
    return parse_workload(
        {
            "name": kind,
            "seed": 5,
            "duration_s": 10,
            "model": {"context_tokens": 16384, "vocab_size": 1000},
            "arrival": {"process": process, "rate": 2.0, **arrival},
            "classes": [{"name": "c", "generator": {"kind": kind, **(generator or {})}}],
        }
    )


# Golden values: the digest of all requests, and the first request's arrival, length and prompt.
GOLDEN = {
    "tool_use": (
        "2b2537cf98efb37ed2138fde9a84fda13387b14524aa71666b2247baa53da0f3",
        65,
        [(5849505950134847667, 200), (7981103426137489526, 1147), (8095803090686545206, 24)],
        [933, 516, 188, 516],
    ),
    "agent": (
        "a5e5cddd8e943970b266721116de6b22f5d6c1f294db450d82f0107777234486",
        353,
        [(8177676015783532519, 1000), (7209335422518701053, 214)],
        [40, 31, 759, 437],
    ),
    "doc_qa": (
        "2f29539560963be69b26461999a9105db9e0fead252f036b3440507cd8d5176f",
        146,
        [(4907052051724686600, 6167), (6732323696738046855, 42)],
        [551, 240, 182, 414],
    ),
    "chat": (
        "81384dadca798cb83b2e4fb83da9b5b1b3914aadc6e6e9ee51af9adc07362c42",
        134,
        [(7019523736067786841, 779)],
        [41, 133, 722, 779],
    ),
}


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_generators_match_their_golden_first_requests(kind: str) -> None:
    digest, max_tokens, segments, first_ids = GOLDEN[kind]
    spec = spec_of(kind)
    reqs = generate_requests(spec)
    assert requests_digest(reqs) == digest
    first = reqs[0]
    assert first.arrival_s == pytest.approx(0.153812, abs=1e-6)
    assert first.max_tokens == max_tokens
    assert [(s.block, s.length) for s in first.segments] == segments
    assert request_token_ids(first, spec.model)[:4] == first_ids
    # Same seed again (a fresh spec object): byte-identical.
    assert requests_digest(generate_requests(spec_of(kind))) == digest


def test_another_seed_gives_other_requests() -> None:
    a = spec_of("tool_use")
    b = parse_workload({**_raw(a), "seed": 6})
    assert requests_digest(generate_requests(a)) != requests_digest(generate_requests(b))


def _raw(spec) -> dict:
    return {
        "name": spec.name,
        "seed": spec.seed,
        "duration_s": spec.duration_s,
        "model": {"context_tokens": 16384, "vocab_size": 1000},
        "arrival": {"process": "poisson", "rate": 2.0},
        "classes": [{"name": "c", "generator": {"kind": "tool_use"}}],
    }


def test_tool_use_shares_system_and_popular_tools() -> None:
    reqs = generate_requests(spec_of("tool_use", generator={"tools": 300, "zipf": 1.1}), rate=50)
    assert len({r.segments[0] for r in reqs}) == 1  # one system prompt
    tools = [r.segments[1].block for r in reqs]
    counts = sorted((tools.count(t) for t in set(tools)), reverse=True)
    assert len(set(tools)) > 60  # hundreds of tools, many of them seen
    assert counts[0] > 8 * statistics.median(counts)  # Zipf: a few tools are very popular
    assert len({r.segments[2].block for r in reqs}) == len(reqs)  # unique questions


def test_agent_turns_extend_their_session_context() -> None:
    reqs = generate_requests(spec_of("agent", generator={"sessions": 4}), rate=20)
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 2]
    assert multi
    for turns in multi:
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.turn == prev.turn + 1
            assert nxt.segments[: len(prev.segments)] == prev.segments
            # the previous turn's output is part of the next prompt
            assert nxt.segments[len(prev.segments)].length == prev.max_tokens


def test_chat_shares_nothing_and_doc_qa_shares_few_documents() -> None:
    chat = generate_requests(spec_of("chat"), rate=20)
    assert len({r.segments[0].block for r in chat}) == len(chat)
    docs = generate_requests(spec_of("doc_qa", generator={"documents": 3}), rate=20)
    assert len({r.segments[0].block for r in docs}) == 3


def test_lengths_scale_to_the_model_context() -> None:
    raw = {
        "seed": 1,
        "duration_s": 20,
        "model": {"context_tokens": 1024, "reference_context": 8192, "vocab_size": 512},
        "arrival": {"rate": 5.0},
        "classes": [{"name": "c", "generator": {"kind": "chat", "prompt": 800, "output": 80}}],
    }
    reqs = generate_requests(parse_workload(raw))
    assert {r.prompt_tokens for r in reqs} == {100}
    assert {r.max_tokens for r in reqs} == {10}
    ids = request_token_ids(reqs[0], parse_workload(raw).model)
    assert len(ids) == 100 and min(ids) >= 3 and max(ids) < 512


def test_prompts_never_exceed_the_context() -> None:
    spec = spec_of("doc_qa", generator={"document": 40000})
    for r in generate_requests(spec):
        assert r.prompt_tokens + r.max_tokens <= spec.model.context_tokens


def test_class_mix_follows_weights() -> None:
    raw = {
        "seed": 3,
        "duration_s": 100,
        "arrival": {"rate": 20.0},
        "classes": [
            {"name": "a", "weight": 3, "generator": {"kind": "chat"}},
            {"name": "b", "weight": 1, "generator": {"kind": "chat"}},
        ],
    }
    reqs = generate_requests(parse_workload(raw))
    share = sum(r.slo_class == "a" for r in reqs) / len(reqs)
    assert 0.70 < share < 0.80


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_and_gamma_rates_and_cv() -> None:
    poisson = arrival_times(ArrivalSpec("poisson"), 10.0, 1000.0, random.Random(1))
    assert len(poisson) == pytest.approx(10_000, rel=0.03)
    g = _gaps(poisson)
    assert statistics.pstdev(g) / statistics.mean(g) == pytest.approx(1.0, abs=0.05)
    bursty = arrival_times(ArrivalSpec("gamma", cv=3.0), 10.0, 1000.0, random.Random(1))
    assert len(bursty) == pytest.approx(10_000, rel=0.1)
    g = _gaps(bursty)
    assert statistics.pstdev(g) / statistics.mean(g) == pytest.approx(3.0, rel=0.15)


def test_onoff_is_silent_when_off_and_keeps_the_mean() -> None:
    times = arrival_times(ArrivalSpec("onoff", on_s=2.0, off_s=3.0), 4.0, 500.0, random.Random(2))
    assert all((t % 5.0) < 2.0 for t in times)
    assert len(times) == pytest.approx(2000, rel=0.06)


def test_ramp_rate_grows() -> None:
    times = arrival_times(ArrivalSpec("ramp", rate=1.0, rate_end=9.0), 1.0, 400.0, random.Random(3))
    first = sum(t < 100 for t in times)
    last = sum(t >= 300 for t in times)
    assert first == pytest.approx(100 * 2.0, rel=0.2)  # mean rate 2/s over the first quarter
    assert last == pytest.approx(100 * 8.0, rel=0.1)  # 8/s over the last


def test_rate_override_scales_the_run() -> None:
    spec = spec_of("chat")
    assert len(generate_requests(spec, rate=40.0, duration_s=50)) == pytest.approx(2000, rel=0.06)


def test_example_workloads_load_and_generate() -> None:
    files = sorted(WORKLOADS.glob("*.toml"))
    assert {f.stem for f in files} >= {
        "tool_use",
        "agent",
        "doc_qa",
        "chat",
        "mix",
        "mooncake",
        "tiny",
    }
    for f in files:
        spec = load_workload(f)
        reqs = generate_requests(spec, duration_s=5)
        assert reqs, f
        assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"arrival": {"process": "uniform"}}, "arrival.process"),
        ({"classes": []}, "at least one"),
        ({"classes": [{"name": "c"}]}, "generator"),
        ({"classes": [{"name": "c", "generator": {"kind": "chat", "bogus": 1}}]}, "unknown keys"),
        (
            {
                "classes": [
                    {"name": "c", "generator": {"kind": "chat", "prompt": {"dist": "weird"}}}
                ]
            },
            "unknown dist",
        ),
        ({"classes": [{"name": "c", "ttft_s": -1, "generator": {"kind": "chat"}}]}, "ttft_s"),
        ({"arrival": {"process": "trace"}}, "trace"),
        ({"seed": "x"}, "seed"),
        ({"duration_s": 0}, "duration_s"),
    ],
)
def test_bad_specs_name_the_key(patch: dict, message: str) -> None:
    raw = {
        "seed": 1,
        "arrival": {"rate": 1.0},
        "classes": [{"name": "c", "generator": {"kind": "chat"}}],
    }
    raw.update(patch)
    with pytest.raises(WorkloadError, match=message):
        parse_workload(raw)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("seed = = 1")
    with pytest.raises(WorkloadError, match="not valid TOML"):
        load_workload(bad)


def test_length_dists() -> None:
    rng = random.Random(4)
    logn = LengthDist("lognormal", 500, 0.5)
    xs = [logn.sample(rng) for _ in range(20000)]
    assert statistics.mean(xs) == pytest.approx(500, rel=0.03)
    assert statistics.pstdev(xs) / statistics.mean(xs) == pytest.approx(0.5, rel=0.08)
    uni = LengthDist("uniform", 10, 20)
    assert {uni.sample(rng) for _ in range(2000)} == set(range(10, 21))
    assert LengthDist.fixed(7).sample(rng, 2.0) == 14
