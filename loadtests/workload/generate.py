"""A workload's requests: arrival times, a class per arrival, a prompt per request — all seeded.

Every random stream is seeded apart from the workload seed and its own name (SHA-256, never
Python's process-random `hash`), so changing one class's lengths does not move another class's
requests, and the same spec gives the same requests on every machine.
"""

from __future__ import annotations

import hashlib
import json
import random

from loadtests.workload.arrivals import arrival_times
from loadtests.workload.generators import build_generator
from loadtests.workload.requests import Request, truncate_segments
from loadtests.workload.spec import WorkloadError, WorkloadSpec
from loadtests.workload.trace import load_trace, trace_requests


def stream(seed: int, *names: str) -> random.Random:
    """The random stream `names` of workload seed `seed`."""
    digest = hashlib.sha256("/".join((str(seed), *names)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def generate_requests(
    spec: WorkloadSpec, *, rate: float | None = None, duration_s: float | None = None
) -> tuple[Request, ...]:
    """The requests of `spec` (sorted by arrival), at `rate` req/s instead of the spec's if given."""
    duration = spec.duration_s if duration_s is None else duration_s
    if duration <= 0:
        raise WorkloadError(f"duration must be > 0, got {duration}")
    if spec.classes[0].generator.kind == "trace":
        cls = spec.classes[0]
        records = load_trace(cls.generator.path)
        if spec.arrival.process == "trace":
            return trace_requests(
                records, cls, spec.model, name=spec.name, duration_s=duration, rate=rate
            )
        # A trace's prompts on a generated arrival process: records in order, re-timed.
        prompts = trace_requests(
            records, cls, spec.model, name=spec.name, duration_s=float("inf"), rate=None
        )
        times = arrival_times(
            spec.arrival, rate or spec.arrival.rate, duration, stream(spec.seed, "arrivals")
        )
        return tuple(
            Request(i, p.request_id, t, p.slo_class, p.segments, p.max_tokens)
            for i, (t, p) in enumerate(zip(times, prompts, strict=False))
        )
    times = arrival_times(
        spec.arrival, rate or spec.arrival.rate, duration, stream(spec.seed, "arrivals")
    )
    pick = stream(spec.seed, "classes")
    names = [c.name for c in spec.classes]
    weights = [c.weight for c in spec.classes]
    gens = {
        c.name: build_generator(
            c.generator, spec.model, stream(spec.seed, "class", c.name, c.generator.kind, "fixed")
        )
        for c in spec.classes
    }
    draws = {
        c.name: stream(spec.seed, "class", c.name, c.generator.kind, "draws") for c in spec.classes
    }
    context = spec.model.context_tokens
    out: list[Request] = []
    for index, t in enumerate(times):
        name = names[0] if len(names) == 1 else pick.choices(names, weights)[0]
        d = gens[name].draw(draws[name])
        max_tokens = min(d.max_tokens, max(1, context // 2))
        segments = truncate_segments(d.segments, context - max_tokens)
        out.append(
            Request(
                index, f"{spec.name}-{index:06d}", t, name, segments, max_tokens, d.session, d.turn
            )
        )
    return tuple(out)


def requests_digest(requests: tuple[Request, ...]) -> str:
    """SHA-256 of the requests as canonical JSON lines (equal digests = byte-identical requests)."""
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps(r.to_json(), sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()
