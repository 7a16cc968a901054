"""Replay of Mooncake-format traces (one JSON object a line: timestamp in ms, input_length,
output_length, hash_ids — one id per 512-token block, equal ids = equal prefix blocks).

Each hash id becomes the content block with that id (`Segment(hash_id, block_tokens)`), so equal
ids give equal token ids; the last block is cut so the prompt is `input_length` long. Scaling:
`block_tokens` (default 512 times the model's context scale) shrinks every block and so every input
length; `output_scale` scales output lengths; `time_scale` stretches timestamps (a sweep's rate
sets it so the trace's mean rate becomes the asked one); `start_s` and `max_requests` cut a window.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from loadtests.workload.requests import Request, Segment, truncate_segments
from loadtests.workload.spec import ClassSpec, ModelSpec, WorkloadError

TRACE_BLOCK_TOKENS = 512
SHIPPED_TRACE = (
    Path(__file__).resolve().parents[1] / "workloads" / "data" / "mooncake_synthetic_trace.jsonl.gz"
)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path) -> tuple[TraceRecord, ...]:
    """All records of a Mooncake-format JSONL file (plain or .gz), in file order."""
    p = Path(path)
    if not p.exists():
        raise WorkloadError(
            f"trace file {p} does not exist (the Mooncake synthetic trace ships as {SHIPPED_TRACE})"
        )
    opener = gzip.open if p.suffix == ".gz" else open
    records: list[TraceRecord] = []
    with opener(p, "rt") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                rec = TraceRecord(
                    float(raw["timestamp"]),
                    int(raw["input_length"]),
                    int(raw["output_length"]),
                    tuple(int(h) for h in raw["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise WorkloadError(f"{p}:{lineno}: not a Mooncake trace record ({exc})") from None
            if rec.input_length < 1 or rec.output_length < 0 or not rec.hash_ids:
                raise WorkloadError(f"{p}:{lineno}: empty prompt or negative length")
            records.append(rec)
    if not records:
        raise WorkloadError(f"{p}: the trace has no records")
    return tuple(records)


def trace_requests(
    records: tuple[TraceRecord, ...],
    cls: ClassSpec,
    model: ModelSpec,
    *,
    name: str,
    duration_s: float,
    rate: float | None,
) -> tuple[Request, ...]:
    """The trace as requests of class `cls`, scaled by the class generator's options."""
    gen = cls.generator
    block_tokens = int(gen.number("block_tokens", round(TRACE_BLOCK_TOKENS * model.scale)))
    if block_tokens < 1:
        raise WorkloadError("trace block_tokens must be >= 1")
    output_scale = gen.number("output_scale", 1.0)
    start_s = gen.number("start_s", 0.0)
    max_requests = int(gen.number("max_requests", 0)) or len(records)
    first = records[0].timestamp_ms / 1000 + start_s
    window = [r for r in records if r.timestamp_ms / 1000 >= first][:max_requests]
    if not window:
        raise WorkloadError(f"the trace has no records after start_s = {start_s}")
    time_scale = gen.number("time_scale", 1.0)
    if rate is not None:
        span = window[-1].timestamp_ms / 1000 - first
        natural = len(window) / span if span > 0 else rate
        time_scale = natural / rate
    out: list[Request] = []
    for rec in window:
        t = (rec.timestamp_ms / 1000 - first) * time_scale
        if t >= duration_s:
            break
        max_tokens = max(1, round(rec.output_length * output_scale))
        input_len = max(1, round(rec.input_length * block_tokens / TRACE_BLOCK_TOKENS))
        limit = max(1, min(input_len, model.context_tokens - max_tokens))
        blocks = tuple(Segment(h, block_tokens) for h in rec.hash_ids)
        segments = truncate_segments(blocks, limit)
        index = len(out)
        out.append(Request(index, f"{name}-{index:06d}", t, cls.name, segments, max_tokens))
    return tuple(out)
