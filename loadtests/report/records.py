"""What a run records: one `RequestRecord` per request, raw times only, and the run around them.

Live runs and simulations write the same records, and every metric is computed from them at the
end (`metrics.py`), so a live run and a simulation of it are compared with the same definitions.
Times are seconds from the run's start on the run's clock (wall clock live, virtual in the
simulator). `intended_s` is when the arrival process said the request should leave; latencies
count from it (open loop), so a client that fell behind cannot hide a slow server.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

STATUSES = ("ok", "refused", "timeout", "failed")
TIER_NAMES = ("gpu", "dram", "ssd", "unknown")  # live runs see hits, not their tier


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Where a request's time went (seconds): its latency split into consecutive parts."""

    queue_s: float = 0.0  # waiting for a prefill slot
    prefill_s: float = 0.0  # computing the missed tokens
    pull_s: float = 0.0  # pulling KV pages (hit pages before prefill, the prompt to decode)
    decode_queue_s: float = 0.0  # first token → joining a decode batch (besides the pull)
    decode_s: float = 0.0  # generating the remaining tokens
    other_s: float = 0.0  # live runs: what the workers do not report (client, router, network)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    slo_class: str
    status: str  # ok | refused (429) | timeout | failed
    intended_s: float
    sent_s: float
    first_token_s: float = math.nan  # absolute, run clock
    finish_s: float = math.nan
    prompt_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = 0
    hit_tokens: tuple[tuple[str, int], ...] = ()  # (tier, tokens) pulled instead of computed
    token_gaps_s: tuple[float, ...] = ()  # every inter-token gap (live runs)
    breakdown: Breakdown = field(default_factory=Breakdown)
    prefill_worker: str = ""
    decode_worker: str = ""
    http_status: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.intended_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.intended_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a one-token answer)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def lag_s(self) -> float:
        """How late the client sent it (actual minus intended send time)."""
        return self.sent_s - self.intended_s

    def hit(self, tier: str) -> int:
        return dict(self.hit_tokens).get(tier, 0)

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["hit_tokens"] = dict(self.hit_tokens)
        d["token_gaps_s"] = [round(g, 6) for g in self.token_gaps_s]
        for key in ("first_token_s", "finish_s"):
            if math.isnan(d[key]):
                d[key] = None
        return d

    @classmethod
    def from_json(cls, d: dict[str, object]) -> RequestRecord:
        raw = dict(d)
        raw["hit_tokens"] = tuple(sorted(dict(raw.get("hit_tokens") or {}).items()))  # type: ignore[call-overload]
        raw["token_gaps_s"] = tuple(raw.get("token_gaps_s") or ())  # type: ignore[arg-type]
        raw["breakdown"] = Breakdown(**dict(raw.get("breakdown") or {}))  # type: ignore[call-overload]
        for key in ("first_token_s", "finish_s"):
            if raw.get(key) is None:
                raw[key] = math.nan
        return cls(**raw)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Sample:
    """A point of a time series (queue length, in flight) taken during the run."""

    t_s: float
    queued: int
    running: int


@dataclass(frozen=True, slots=True)
class ClassTarget:
    name: str
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run (one rate, one policy, one cluster): its setup, its records, its counters."""

    label: str  # e.g. "strata @ 20/s"
    kind: str  # "live" | "sim"
    workload: str
    target_rate: float  # offered requests/s
    duration_s: float
    classes: tuple[ClassTarget, ...]
    records: tuple[RequestRecord, ...]
    samples: tuple[Sample, ...] = ()
    policy: str = ""
    cluster: str = ""
    gpus: int = 0
    bytes_moved: int = 0
    evictions: int = 0
    seed: int = 0
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "label": self.label,
            "kind": self.kind,
            "workload": self.workload,
            "target_rate": self.target_rate,
            "duration_s": self.duration_s,
            "classes": [asdict(c) for c in self.classes],
            "policy": self.policy,
            "cluster": self.cluster,
            "gpus": self.gpus,
            "bytes_moved": self.bytes_moved,
            "evictions": self.evictions,
            "seed": self.seed,
            "notes": list(self.notes),
            "samples": [[s.t_s, s.queued, s.running] for s in self.samples],
            "records": [r.to_json() for r in self.records],
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> RunResult:
        return cls(
            label=str(d["label"]),
            kind=str(d["kind"]),
            workload=str(d["workload"]),
            target_rate=float(d["target_rate"]),  # type: ignore[arg-type]
            duration_s=float(d["duration_s"]),  # type: ignore[arg-type]
            classes=tuple(ClassTarget(**c) for c in d["classes"]),  # type: ignore[attr-defined]
            records=tuple(RequestRecord.from_json(r) for r in d["records"]),  # type: ignore[attr-defined]
            samples=tuple(Sample(*s) for s in d.get("samples", ())),  # type: ignore[attr-defined]
            policy=str(d.get("policy", "")),
            cluster=str(d.get("cluster", "")),
            gpus=int(d.get("gpus", 0)),  # type: ignore[call-overload]
            bytes_moved=int(d.get("bytes_moved", 0)),  # type: ignore[call-overload]
            evictions=int(d.get("evictions", 0)),  # type: ignore[call-overload]
            seed=int(d.get("seed", 0)),  # type: ignore[call-overload]
            notes=tuple(d.get("notes", ())),  # type: ignore[arg-type]
        )
