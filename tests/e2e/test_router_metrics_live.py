"""GET /metrics of a live router (real store, prefill and decode processes, tiny preset): after
requests through it, the series of each group carry the values those requests imply."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.router_cluster import ClusterSpec, RouterCluster

pytestmark = pytest.mark.e2e

PROMPT = "The store is the index of what is cached; the router only asks it. " * 4
ADMISSION = """
[admission]
default_class = "standard"
[[admission.classes]]
name = "standard"
ttft_s = 30.0
tpot_s = 5.0
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterCluster]:
    spec = ClusterSpec(preset="tiny", prefill=1, decode=1, router_config=ADMISSION)
    with RouterCluster(spec, tmp_path_factory.mktemp("metrics-live")) as c:
        yield c


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(
    data: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **want: str
) -> float:
    """Sum of `name`'s samples whose labels include `want`."""
    return sum(
        v for (n, labels), v in data.items()
        if n == name and set(want.items()) <= labels
    )  # fmt: skip


def test_series_of_every_group_have_samples_after_requests(cluster: RouterCluster) -> None:
    model = str(cluster.health()["models"][0])  # type: ignore[index]
    url = f"{cluster.base_url}/v1/completions"
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}
    completion_tokens = 0
    for _ in range(2):  # the second prefill finds the first one's pages in the store
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        completion_tokens += r.json()["usage"]["completion_tokens"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    completion_tokens += 6
    assert httpx.post(url, json={**body, "model": "nope"}, timeout=10).status_code == 404
    prefill = cluster.by_role("prefill")[0].address
    decode = cluster.by_role("decode")[0].address

    data = samples(cluster.metrics_text())
    # prefill pool
    assert total(data, "strata_router_prefill_seconds_count", worker=prefill) == 3
    assert total(data, "strata_router_pool_workers", pool="prefill") == 1
    assert total(data, "strata_router_prefill_utilization", worker=prefill) > 0
    assert ("strata_router_prefill_queue_requests", frozenset({("worker", prefill)})) in data
    # decode pool
    assert total(data, "strata_router_decode_tpot_seconds_count", worker=decode) == 3
    assert total(data, "strata_router_pool_workers", pool="decode") == 1
    assert total(data, "strata_router_decode_batch_size_count") >= 1
    assert ("strata_router_decode_active_requests", frozenset({("worker", decode)})) in data
    # KV movement: prefill hit the first request's pages twice; decode pulled at least the
    # prompt's full pages every time (more once earlier decodes published their output's).
    full_tokens = total(data, "strata_router_prompt_tokens_total") // 3 // 16 * 16
    assert full_tokens > 0
    assert total(data, "strata_router_hit_tokens_total", stage="decode") >= 3 * full_tokens
    assert total(data, "strata_router_hit_tokens_total", stage="prefill") == 2 * full_tokens
    assert total(data, "strata_router_kv_pull_seconds_count", stage="decode") == 3
    assert total(data, "strata_router_kv_pull_bytes_total", stage="decode") > 0
    assert total(data, "strata_router_kv_pull_failures_total") == 0
    # end to end
    for name in ("ttft", "tpot", "e2e", "queue"):
        assert total(data, f"strata_router_{name}_seconds_count", slo_class="standard") == 3
    assert total(data, "strata_router_requests_total", outcome="ok") == 3
    assert total(data, "strata_router_output_tokens_total") == completion_tokens
    assert total(data, "strata_router_slo_met_total", slo_class="standard", target="both") == 3
    assert total(data, "strata_router_slo_ttft_seconds", slo_class="standard") == 30.0
    assert total(data, "strata_router_admission_decisions_total", outcome="admitted") == 3
    assert total(data, "strata_router_decision_seconds_count") == 3
    assert total(data, "strata_router_errors_total", kind="unknown_model") == 1
    assert total(data, "strata_router_prediction_relative_error_count", kind="ttft") == 3
    # The drift gauges read the tracker the core scores (not an idle copy).
    assert ("strata_router_prediction_median_relative_error", frozenset({("kind", "ttft")})) in data
    assert ("strata_router_profile_drift", frozenset({("kind", "ttft")})) in data
