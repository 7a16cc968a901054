"""Mooncake trace replay: equal hash ids → equal token ids, truncation, scaling, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.workload import WorkloadError, generate_requests, parse_workload, request_token_ids
from loadtests.workload.trace import SHIPPED_TRACE, load_trace

pytestmark = pytest.mark.unit


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trace_spec(path: Path, **gen: float) -> object:
    return parse_workload(
        {
            "name": "t",
            "seed": 1,
            "duration_s": 1000,
            "model": {"context_tokens": 65536, "vocab_size": 32000},
            "arrival": {"process": "trace"},
            "classes": [
                {"name": "trace", "generator": {"kind": "trace", "path": str(path), **gen}}
            ],
        }
    )


ROWS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2, 4]},
    {"timestamp": 2000, "input_length": 600, "output_length": 9, "hash_ids": [5, 2]},
]


def test_equal_hash_ids_give_equal_tokens(tmp_path: Path) -> None:
    spec = trace_spec(write_trace(tmp_path / "t.jsonl", ROWS))
    a, b, c = generate_requests(spec)
    ta, tb, tc = (request_token_ids(r, spec.model) for r in (a, b, c))
    assert len(ta) == 1200 and len(tb) == 1100 and len(tc) == 600
    assert ta[:1024] == tb[:1024]  # ids 1, 2 shared
    assert ta[1024:1100] != tb[1024:1100]  # 3 vs 4
    assert tc[512:600] == ta[512:600]  # id 2 in another position: the same block content
    assert ta[:512] != tc[:512]
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 0.5, 2.0]
    assert [r.max_tokens for r in (a, b, c)] == [5, 7, 9]


def test_scaling_of_lengths_and_time(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", ROWS)
    spec = trace_spec(path, block_tokens=64, output_scale=2.0, time_scale=3.0)
    a, b, c = generate_requests(spec)
    assert a.prompt_tokens == 150 and [s.length for s in a.segments] == [64, 64, 22]
    assert b.max_tokens == 14
    assert c.arrival_s == pytest.approx(6.0)
    # A rate override sets the time scale: 3 requests over 2 s at 3/s natural → 0.5/s here.
    a, b, c = generate_requests(trace_spec(path), rate=0.5)
    assert c.arrival_s == pytest.approx(2.0 * 3.0)


def test_missing_or_bad_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="does not exist"):
        generate_requests(trace_spec(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:1"):
        load_trace(bad)


def test_shipped_mooncake_trace() -> None:
    records = load_trace(SHIPPED_TRACE)
    assert len(records) == 3993
    assert records[0].input_length == 40160 and records[0].hash_ids[:3] == (0, 1, 2)
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in records[:200])
