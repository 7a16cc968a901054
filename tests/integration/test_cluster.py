"""A cluster of store daemons registered in a real etcd, served by ClusterClient (DESIGN §7).

etcd runs as a child process on loopback ports picked at start (state under tmp_path) and is
killed by its PID at teardown; the daemons run in-process (registration, metrics) or as
`strata serve` children (a crash is a SIGKILL to one PID). A missing etcd binary fails these
tests; it never skips them.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import ClusterClient, PutStatus, Scope
from client.cluster.etcd import EtcdClient
from client.cluster.membership import Member, member_key, members_prefix
from kvstore.server import CLUSTER_SERVICE_NAME
from loadtests.daemon import DaemonProcess, wait_for
from loadtests.etcd import EtcdProcess
from tests.conftest import DaemonFactory, buffers, chain, keys_of, make_scope, singles, tokens_of

pytestmark = pytest.mark.integration


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    proc = EtcdProcess(tmp_path / "etcd")
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()


def _metric(url: str, name: str) -> float | None:
    with urllib.request.urlopen(url, timeout=2.0) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def _settings(etcd: EtcdProcess, node_id: str) -> dict[str, str]:
    return {
        "cluster.etcd_endpoints": etcd.url,
        "cluster.name": "t",
        "cluster.lease_ttl_s": "2",
        "cluster.etcd_timeout_ms": "1000",
        "server.node_id": node_id,
    }


def test_a_daemon_registers_with_a_lease_and_leaves_on_stop(
    etcd: EtcdProcess, daemon_factory: DaemonFactory
) -> None:
    running = daemon_factory(settings=_settings(etcd, "n1"))
    kv = EtcdClient(etcd.url)
    found = kv.get_prefix(members_prefix("t")).kvs
    assert [x.key for x in found] == [member_key("t", "n1")]
    member = Member.decode(found[0].value)
    assert (member.node_id, member.address) == ("n1", running.address)
    assert {t.tier for t in member.tiers} == {"dram", "ssd"}
    assert found[0].lease != 0
    assert _metric(running.info.metrics_url, "strata_cluster_membership_stale") == 0
    assert _health(running.address, CLUSTER_SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    running.stop()
    assert kv.get_prefix(members_prefix("t")).kvs == ()


def _health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return int(reply.status)


def test_no_cluster_section_needs_no_etcd(daemon_factory: DaemonFactory) -> None:
    running = daemon_factory()
    assert running.daemon.registration is None
    assert _metric(running.info.metrics_url, "strata_cluster_membership_stale") is None


def _read(client: ClusterClient, scope: Scope, pages: list) -> list[bytes | None]:  # type: ignore[type-arg]
    into = buffers(scope, len(pages))
    got = client.get(scope, keys_of(pages), into, tokens=tokens_of(pages))
    return [bytes(b) if h is not None else None for h, b in zip(got.headers, into, strict=True)]


def _pages_on(client: ClusterClient) -> dict[str, int]:
    return {n.node_id: n.stats.pages for n in client.stats().nodes if n.stats is not None}


def test_cluster_survives_a_crash_a_rejoin_and_an_etcd_outage(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    scope = make_scope("cluster")

    def daemon(node_id: str) -> DaemonProcess:
        extra: list[str] = ["--ssd", "0"]
        for key, value in _settings(etcd, node_id).items():
            extra += ["--set", f"{key}={value}"]
        return DaemonProcess(tmp_path / node_id, dram="64MiB", ssd="64MiB", extra=extra)

    procs = {n: daemon(n) for n in ("n1", "n2", "n3")}
    client = ClusterClient(
        etcd_endpoints=etcd.url,
        cluster="t",
        replicas=2,
        timeout_s=3.0,
        down_s=1.0,
        watch_idle_s=0.5,
    )
    try:
        for p in procs.values():
            p.start()
        assert wait_for(lambda: len(client.members) == 3, timeout_s=10)

        # R=2: every page on two of the three nodes, each node holding its share
        first = singles(scope, 60, seed=1)
        prompt = chain(scope, 8, seed=2)
        result = client.put(scope, first + prompt)
        assert result.statuses == (PutStatus.STORED,) * 68
        spread = _pages_on(client)
        assert sum(spread.values()) == 2 * 68
        assert all(c > 68 * 2 / 3 * 0.5 for c in spread.values()), spread
        assert client.lookup(scope, keys_of(prompt)).hit_count == 8
        assert _read(client, scope, first + prompt) == [bytes(p.payload) for p in first + prompt]

        # a crash: every page keeps a live replica; nothing raises; the node is dropped
        procs["n2"].kill()
        assert _read(client, scope, first + prompt) == [bytes(p.payload) for p in first + prompt]
        assert client.lookup(scope, keys_of(prompt)).hit_count == 8
        assert "n2" not in client.live_nodes()  # marked down after its Unavailable
        assert wait_for(lambda: "n2" not in client.members, timeout_s=8)  # its lease ran out
        second = singles(scope, 30, seed=3)
        assert client.put(scope, second).stored == 30
        # both replicas of every new page went to the two live nodes
        assert _pages_on(client) == {"n1": spread["n1"] + 30, "n3": spread["n3"] + 30}

        # it comes back (same node id, new port): it rejoins and takes its share of new pages
        procs["n2"] = daemon("n2").start()
        assert wait_for(lambda: "n2" in client.members, timeout_s=8)
        assert wait_for(lambda: "n2" in client.live_nodes(), timeout_s=5)
        third = singles(scope, 60, seed=4)
        assert client.put(scope, third).stored == 60
        assert _pages_on(client)["n2"] >= 60 * 2 / 3 * 0.5
        everything = first + prompt + second + third
        got = _read(client, scope, everything)
        # n2 lost its DRAM pages in the crash, but each of them has its other replica
        assert got == [bytes(p.payload) for p in everything]

        # etcd goes away: the client keeps the last members and says so; daemons go stale
        etcd.kill()
        assert _read(client, scope, third) == [bytes(p.payload) for p in third]
        assert wait_for(lambda: client.degraded, timeout_s=5)
        stats = client.stats()
        assert stats.degraded and set(stats.live) == {"n1", "n2", "n3"}
        fourth = singles(scope, 10, seed=5)
        assert client.put(scope, fourth).stored == 10
        assert _read(client, scope, fourth) == [bytes(p.payload) for p in fourth]
        url = procs["n1"].metrics_url
        assert wait_for(
            lambda: _metric(url, "strata_cluster_membership_stale") == 1,
            timeout_s=6,
            interval_s=0.1,
        )
        assert any("membership is stale" in line for line in procs["n1"].output)
        # health says so too: the store serves, its cluster membership does not
        assert _health(procs["n1"].address, "") == health_pb2.HealthCheckResponse.SERVING
        assert _health(procs["n1"].address, CLUSTER_SERVICE_NAME) == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
    finally:
        client.close()
        for p in procs.values():
            p.kill()


def test_static_addresses_need_no_etcd(daemon_factory: DaemonFactory) -> None:
    scope = make_scope("static")
    nodes = [daemon_factory() for _ in range(2)]
    with ClusterClient(addresses=[n.address for n in nodes], replicas=1) as client:
        pages = singles(scope, 40, seed=9)
        assert client.put(scope, pages).stored == 40
        assert client.stats().pages == 40
        assert all(n.stats is not None and 0 < n.stats.pages < 40 for n in client.stats().nodes)
        assert _read(client, scope, pages) == [bytes(p.payload) for p in pages]
        assert client.delete(keys=keys_of(pages)) == 40
        assert client.lookup(scope, keys_of(pages[:1])).hit_count == 0
        assert not client.degraded


def test_lookup_counts_a_page_present_if_any_replica_has_it(daemon_factory: DaemonFactory) -> None:
    scope = make_scope("holes")
    nodes = [daemon_factory(), daemon_factory()]
    with ClusterClient(addresses=[n.address for n in nodes], replicas=2) as client:
        prompt = chain(scope, 6, seed=11)
        assert client.put(scope, prompt).stored == 6
        first = nodes[0].client(shared_memory=False)
        second = nodes[1].client(shared_memory=False)
        assert first.delete(keys=[prompt[1].header.key]) == 1  # one replica of page 1 gone
        assert first.lookup(scope, keys_of(prompt)).hit_count == 1
        assert client.lookup(scope, keys_of(prompt)).hit_count == 6
        assert _read(client, scope, prompt) == [bytes(p.payload) for p in prompt]
        assert first.delete(keys=[prompt[4].header.key]) == 1
        assert second.delete(keys=[prompt[4].header.key]) == 1  # page 4 gone everywhere
        result = client.lookup(scope, keys_of(prompt))
        assert result.hit_count == 4 and len(result.tiers) == 4


def test_hot_pages_get_an_extra_replica_on_the_next_put(daemon_factory: DaemonFactory) -> None:
    scope = make_scope("hot")
    nodes = [daemon_factory() for _ in range(3)]
    with ClusterClient(
        addresses=[n.address for n in nodes], replicas=1, hot_extra=1, hot_threshold=2
    ) as client:
        page, cold = singles(scope, 2, seed=21)
        assert client.put(scope, [page, cold]).stored == 2
        assert client.stats().pages == 2
        for _ in range(3):  # more than the threshold of 2 reads
            assert _read(client, scope, [page]) == [bytes(page.payload)]
        result = client.put(scope, [page, cold])  # re-published: the hot one gains a replica
        assert result.statuses == (PutStatus.STORED, PutStatus.ALREADY_PRESENT)
        assert client.stats().pages == 3
