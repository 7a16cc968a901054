"""The router and its workers over a store cluster, all found through a real etcd: two daemons
register as cluster members, a prefill and a decode worker take the cluster as their store
(`--store etcd://.../t`) and register themselves (`--etcd`), and `strata router` is given only
etcd. The router finds the workers, its own lookups see the pages the workers published to the
cluster, and a worker that stops leaves the router's set. The same over a fixed list of daemons
(`--store HOST:PORT,HOST:PORT`, no etcd)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import DaemonFactory
from router_processes import Child, router, wait_for, worker, write_profile

from client import host_id
from loadtests.etcd import EtcdProcess

pytestmark = pytest.mark.e2e

MODEL = "strata-tiny-llama"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path / "etcd")
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()


def test_workers_and_router_over_an_etcd_cluster(
    tmp_path: Path, etcd: EtcdProcess, daemon_factory: DaemonFactory, tiny_checkpoint: Path
) -> None:
    for node in ("n1", "n2"):
        daemon_factory(
            settings={
                "cluster.etcd_endpoints": etcd.url,
                "cluster.name": "t",
                "cluster.lease_ttl_s": "2",
                "cluster.etcd_timeout_ms": "1000",
                "server.node_id": node,
            }
        )
    endpoint = etcd.url.removeprefix("http://")
    store = f"etcd://{endpoint}/t"
    children: list[Child] = []
    try:
        for role in ("prefill", "decode"):
            children.append(
                worker(role, tiny_checkpoint, store, "--etcd", endpoint, "--cluster", "t").start()
            )
        decode_address = [c.ready() for c in children][1]
        front = router(
            "--etcd",
            endpoint,
            "--cluster",
            "t",
            "--store",
            store,
            "--profile",
            str(write_profile(tmp_path / "profile.json")),
        ).start()
        children.append(front)
        base = front.ready(60).removesuffix("/v1")
        http = httpx.Client(base_url=base, timeout=60)

        def health() -> dict[str, object]:
            return dict(http.get("/health").json())

        wait_for(lambda: health()["status"] == "ok", 30, "the workers found through etcd")
        prompt = [0, *range(10, 50)]  # 41 tokens: 2 full pages
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        first = http.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        again = http.post("/v1/completions", json=body)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        # the router's own lookup found the two pages in the cluster when it placed the request
        decisions = http.get("/debug/decisions").json()["decisions"]
        mine = [d for d in decisions if d["request_id"] == again.headers["x-request-id"]]
        assert mine and mine[0]["hit_tokens_used"] == 32
        # on this host: the first replica of each page is a daemon here
        assert mine[0]["prefix"] == {
            "hit_pages": 2,
            "tiers": ["dram", "dram"],
            "node_hosts": [host_id(), host_id()],
        }
        workers = http.get("/debug/workers").json()["workers"]
        assert {w["source"] for w in workers} == {"etcd"} and len(workers) == 2
        # a worker that stops revokes its lease: the router forgets it
        assert children[1].terminate() == 0

        def known() -> set[str]:
            return {w["address"] for w in http.get("/debug/workers").json()["workers"]}

        wait_for(lambda: decode_address not in known(), 10, "the stopped worker to leave")
        assert health()["decode"] == 0
        http.close()
    finally:
        for child in children:
            child.kill9()


def test_workers_and_router_over_a_fixed_list_of_daemons(
    tmp_path: Path, daemon_factory: DaemonFactory, tiny_checkpoint: Path
) -> None:
    """The other cluster form: `--store HOST:PORT,HOST:PORT` (no etcd). The workers spread the
    pages over both daemons, and the router's lookups, over the same list, find them."""
    daemons = [daemon_factory(settings={"server.node_id": node}, ssd=None) for node in ("n1", "n2")]
    store = ",".join(d.address for d in daemons)
    children: list[Child] = []
    try:
        children += [worker(role, tiny_checkpoint, store).start() for role in ("prefill", "decode")]
        addresses = [c.ready() for c in children]
        front = router(
            "--workers",
            ",".join(addresses),
            "--store",
            store,
            "--profile",
            str(write_profile(tmp_path / "profile.json")),
        ).start()
        children.append(front)
        base = front.ready(60).removesuffix("/v1")
        with httpx.Client(base_url=base, timeout=60) as http:
            wait_for(lambda: http.get("/health").status_code == 200, 30, "router health")
            prompt = [0, *range(10, 90)]  # 81 tokens: 5 full pages
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            first = http.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            again = http.post("/v1/completions", json=body)
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
            decisions = http.get("/debug/decisions").json()["decisions"]
            mine = [d for d in decisions if d["request_id"] == again.headers["x-request-id"]]
            assert mine and mine[0]["prefix"]["hit_pages"] == 5
            assert mine[0]["hit_tokens_used"] == 80
        # both daemons hold some of the pages (the cluster client spread them)
        assert all(d.store.stats().pages > 0 for d in daemons), [d.store.stats() for d in daemons]
    finally:
        for child in children:
            child.kill9()
