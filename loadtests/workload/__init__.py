"""One workload spec for the live load test, the simulator and `strata bench router` (DESIGN §10).

The loader API, in full:

    spec = load_workload("loadtests/workloads/tool_use.toml")   # WorkloadSpec, or WorkloadError
    requests = generate_requests(spec, rate=4.0, duration_s=30) # tuple[Request, ...], seeded
    ids = request_token_ids(requests[0], spec.model)            # the prompt as token ids

Same spec and seed → the same requests, byte for byte (`requests_digest` pins it). A request's
prompt is a tuple of `Segment`s (a content block id and a length); equal segments are equal
token ids, so prefixes shared between requests are shared token for token.
"""

from __future__ import annotations

from loadtests.workload.generate import generate_requests, requests_digest
from loadtests.workload.lengths import LengthDist
from loadtests.workload.requests import Request, Segment
from loadtests.workload.spec import (
    ArrivalSpec,
    ClassSpec,
    GeneratorSpec,
    ModelSpec,
    WorkloadError,
    WorkloadSpec,
    load_workload,
    parse_workload,
)
from loadtests.workload.tokens import block_token_ids, request_token_ids

__all__ = [
    "ArrivalSpec",
    "ClassSpec",
    "GeneratorSpec",
    "LengthDist",
    "ModelSpec",
    "Request",
    "Segment",
    "WorkloadError",
    "WorkloadSpec",
    "block_token_ids",
    "generate_requests",
    "load_workload",
    "parse_workload",
    "request_token_ids",
    "requests_digest",
]
