"""The gRPC store user: the interceptor reports every SDK call (method, bytes, latency) against a
real daemon, and the store load (lookup, get hits, put misses) sees the workload's sharing."""

from __future__ import annotations

import pytest

from loadtests.live.grpc_user import StoreLoad, instrumented_client, load_scope
from loadtests.workload import generate_requests, parse_workload

pytestmark = pytest.mark.e2e


def test_interceptor_reports_every_call_and_the_store_sees_sharing(daemon_factory) -> None:
    running = daemon_factory(dram="64MiB", ssd=None)
    calls: list[tuple[str, float, int, int, object]] = []
    spec = parse_workload(
        {
            "name": "storeload",
            "seed": 2,
            "duration_s": 5,
            "model": {"context_tokens": 4096, "vocab_size": 1000},
            "arrival": {"rate": 4.0},
            "classes": [
                {
                    "name": "c",
                    "generator": {
                        "kind": "tool_use",
                        "tools": 2,
                        "system": 64,
                        "tool": 128,
                        "question": 16,
                        "output": 4,
                    },
                }
            ],
        }
    )
    client = instrumented_client(
        running.info.address, lambda *a: calls.append(a), shared_memory=False
    )
    try:
        load = StoreLoad(client, spec, load_scope(spec))
        outcomes = [load.serve(r) for r in generate_requests(spec)[:8]]
    finally:
        client.close()
    assert outcomes[0].hit_pages == 0 and outcomes[0].put_pages == outcomes[0].pages > 0
    assert sum(o.hit_pages for o in outcomes[1:]) > 0  # shared system + tool prompts hit
    methods = {c[0] for c in calls}
    assert any(m.endswith("/Lookup") for m in methods), methods
    assert any("Put" in m for m in methods) and any("Get" in m for m in methods), methods
    assert all(c[1] >= 0 and c[4] is None for c in calls)
    assert sum(c[3] for c in calls if "Get" in c[0]) >= load.page_bytes * sum(
        o.hit_pages for o in outcomes
    )
    put_bytes = sum(c[2] for c in calls if "Put" in c[0])
    page_bytes = load.page_bytes
    assert put_bytes >= page_bytes * sum(o.put_pages for o in outcomes)  # payloads crossed gRPC
