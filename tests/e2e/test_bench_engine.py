"""`strata bench engine` on the tiny preset with tiny sizes: the JSON it writes has every field,
and the values that do not depend on the machine's speed are exact (hits cover exactly the
prompt's full pages from the tier asked for, a hit computes only the tail, every first token is
the no-cache one, decode gives the tokens asked for). Timings are only checked to be positive:
which path is faster is the benchmark's answer, not something a loaded CI machine can promise.

The smoke test starts the store daemon as a subprocess (the benchmark's own path), twice: the
SSD measurement restarts it. It takes a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.bench_engine import main
from loadtests.bench_engine_decode import Stat, decode_rate, steady_rate

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 40  # two full pages of 16 and a partial tail of 8
PAGE_TOKENS = 16
FULL_TOKENS = PROMPT_TOKENS // PAGE_TOKENS * PAGE_TOKENS


def test_stat_median_and_nearest_rank_p90() -> None:
    stat = Stat.of([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (stat.median_s, stat.p90_s) == (3.0, 5.0)
    assert Stat.of([float(i) for i in range(1, 21)]).p90_s == 18.0
    assert stat.samples_s == (5.0, 1.0, 4.0, 2.0, 3.0)


def test_steady_rate_counts_only_steps_with_the_whole_batch() -> None:
    # the second request joins at t = 2 and ends at t = 6; the first runs 0..5
    times = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0, 4.0, 5.0, 6.0]]
    assert steady_rate(times) == pytest.approx(6 / 3)  # steps 3, 4, 5: two tokens each
    assert decode_rate(times) == pytest.approx(10 / 6)
    assert steady_rate([[0.0, 1.0], [2.0, 3.0]]) == 0.0  # never decoding together


def test_decode_rate_counts_tokens_after_the_first_step() -> None:
    # Two requests decoded together: steps at t = 10, 11, 12; both in every step.
    assert decode_rate([[10.0, 11.0, 12.0], [10.0, 11.0, 12.0]]) == pytest.approx(2.0)
    # One request alone: 4 tokens, 3 after the first, over 1.5 s.
    assert decode_rate([[0.0, 0.5, 1.0, 1.5]]) == pytest.approx(2.0)


def test_bench_engine_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    argv = [
        "--preset",
        "tiny",
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--reps",
        "2",
        "--decode-reps",
        "1",
        "--new-tokens",
        "3",
        "--batch",
        "2",
        "--reference-steps",
        "2",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "TTFT full hit, DRAM" in printed.out and "target:" in printed.out
    assert "no cache 2/2" in printed.err  # progress goes to stderr

    bench = json.loads(out.read_text())
    assert bench["command"].startswith("strata bench engine --preset tiny")
    assert bench["model"] == "tiny preset (seed 0)"
    assert bench["prompt_tokens"] == PROMPT_TOKENS
    assert bench["page_tokens"] == PAGE_TOKENS
    assert bench["full_pages"] == PROMPT_TOKENS // PAGE_TOKENS
    assert bench["repetitions"] == 2
    assert isinstance(bench["page_cache_dropped"], bool) and "SSD" in bench["ssd_method"]

    no_cache, dram, ssd = bench["ttft"]
    assert [t["name"] for t in bench["ttft"]] == [
        "TTFT no cache",
        "TTFT full hit, DRAM",
        "TTFT full hit, SSD",
    ]
    assert (no_cache["hit_tokens"], no_cache["computed_tokens"]) == (0, PROMPT_TOKENS)
    for hit in (dram, ssd):
        assert hit["hit_tokens"] == FULL_TOKENS
        assert hit["computed_tokens"] == PROMPT_TOKENS - FULL_TOKENS
        assert hit["first_token"] == no_cache["first_token"]
    for t in bench["ttft"]:
        stat = t["ttft"]
        assert len(stat["samples_s"]) == 2
        assert all(s > 0 for s in stat["samples_s"])
        assert min(stat["samples_s"]) <= stat["median_s"] <= stat["p90_s"]
        assert stat["p90_s"] == max(stat["samples_s"])

    assert [d["batch"] for d in bench["decode"]] == [1, 2]
    for d in bench["decode"]:
        assert d["new_tokens_per_request"] == 3
        assert d["hit_tokens_per_request"] == FULL_TOKENS
        assert d["same_tokens_as_batch_1"] is True
        assert d["tokens_per_s_median"] > 0 and d["end_to_end_tokens_per_s_median"] > 0

    # the reference steps next to the worker, at each batch: rates and the ratios between them
    assert [st["batch"] for st in bench["steps"]] == [1, 2]
    by_batch = {d["batch"]: d["tokens_per_s_median"] for d in bench["decode"]}
    for st in bench["steps"]:
        assert st["context_tokens"] == PROMPT_TOKENS
        assert st["worker_tokens_per_s"] == by_batch[st["batch"]]
        for name in ("model_step", "gathered_step", "dense_step"):
            rate = st[f"{name}_tokens_per_s"]
            assert rate == pytest.approx(st["batch"] / st[f"{name}_median_s"])
        assert st["worker_to_dense_ratio"] == pytest.approx(
            st["worker_tokens_per_s"] / st["dense_step_tokens_per_s"]
        )
        assert st["worker_to_model_step_ratio"] == pytest.approx(
            st["worker_tokens_per_s"] / st["model_step_tokens_per_s"]
        )
        assert st["worker_steady_tokens_per_s"] >= 0  # 0 when the two never decoded together
        assert st["worker_steady_to_dense_ratio"] == pytest.approx(
            st["worker_steady_tokens_per_s"] / st["dense_step_tokens_per_s"]
        )
        assert st["model_step_to_dense_ratio"] == pytest.approx(
            st["model_step_tokens_per_s"] / st["dense_step_tokens_per_s"]
        )
    names = [t["name"] for t in bench["targets"]]
    assert names == [
        "TTFT full DRAM hit / no cache",
        "worker / model step, batch 1",
        "worker / dense step, batch 2",
        "steady worker / dense step, batch 2",
        "model step / dense step, batch 2",
    ]
    for t in bench["targets"]:
        assert t["met"] == (t["value"] <= t["bound"] if t["at_most"] else t["value"] >= t["bound"])
    assert "w/dense" in printed.out and "target: worker / dense step, batch 2" in printed.out

    ratios = bench["ratios"]
    base = no_cache["ttft"]["median_s"]
    assert ratios["dram_hit_over_no_cache"] == pytest.approx(dram["ttft"]["median_s"] / base)
    assert ratios["ssd_hit_over_no_cache"] == pytest.approx(ssd["ttft"]["median_s"] / base)
    assert ratios["dram_target"] == 0.2
    assert ratios["dram_target_met"] == (ratios["dram_hit_over_no_cache"] <= 0.2)
    assert ratios["batch_over_batch_1"] > 0


def test_bench_engine_rejects_a_prompt_shorter_than_a_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--preset", "tiny", "--prompt-tokens", "8", "--json", str(tmp_path / "x.json")])
    assert exited.value.code == 2
    assert "at least one page" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
