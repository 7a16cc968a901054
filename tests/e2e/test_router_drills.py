"""Operator drills on real processes (tiny preset): every prefill worker killed, half the decode
workers killed, 1% packet loss between the router and its workers in a network namespace this
test creates. The router degrades gracefully (a fast 503 with Retry-After, or service by the
survivors) and recovers by itself; each drill's recovery time is printed.

The three drills share one cluster (2 prefill + 2 decode, the store and the workers inside a
network namespace when packet loss can be injected here), in this order. Packet loss uses
`tc netem` where the kernel has it and an nftables random-drop rule where it does not; with
neither (or without root) the loss drill is skipped with the precise reason, and the others run
on plain loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtests.router_cluster import ClusterSpec, RouterCluster, loss_support
from loadtests.router_drills import (
    drill_decode_half,
    drill_packet_loss,
    drill_prefill_down,
    model_of,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LOSS = loss_support()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterCluster]:
    spec = ClusterSpec(preset="tiny", prefill=2, decode=2, netns=bool(LOSS[0]))
    with RouterCluster(spec, tmp_path_factory.mktemp("drills")) as c:
        yield c


def test_every_prefill_worker_killed_fast_503_then_recovers(cluster: RouterCluster) -> None:
    r = drill_prefill_down(cluster, model_of(cluster), down_s=1.5, restart_all=False)
    print(f"\nprefill down: {r}")
    # While down, only 503s (and a request already past its prefill at the kill).
    assert r.requests_while_down >= 3
    assert set(r.status_counts) <= {"200", "503"}, r.status_counts
    assert r.status_counts.get("503", 0) >= r.requests_while_down - 2
    assert r.first_503_after_kill_s is not None and r.first_503_after_kill_s < 5.0
    assert r.latency_503_p50_ms < 500, "a refusal must not wait on dead workers"
    assert r.retry_after_values and all(float(v) >= 1 for v in r.retry_after_values)
    assert r.recover_s is not None and r.recover_s < 10.0


def test_half_the_decode_workers_killed_survivors_serve(cluster: RouterCluster) -> None:
    r = drill_decode_half(cluster, model_of(cluster), run_s=2.0)
    print(f"\ndecode half: {r}")
    assert r.killed == 1 and r.requests >= 3
    assert r.failed == 0, r.failures
    # The registry drops a silent worker within drop_after_s (1 s) + one poll's deadline.
    assert r.dropped_from_health_s is not None and r.dropped_from_health_s < 4.0
    assert r.back_in_rotation_s is not None and r.back_in_rotation_s < 15.0


@pytest.mark.skipif(not LOSS[0], reason=f"no packet loss can be injected here: {LOSS[1]}")
def test_one_percent_packet_loss_requests_still_succeed(cluster: RouterCluster) -> None:
    assert cluster.netns is not None
    r = drill_packet_loss(cluster, model_of(cluster), loss_percent=1.0, phase_s=3.0)
    print(f"\npacket loss ({r.mechanism}; {r.why_not_netem or 'netem available'}): {r}")
    assert r.mechanism == LOSS[0]
    assert r.packets_dropped > 0 or r.mechanism == "netem"
    assert r.baseline_ok == r.baseline_requests >= 5
    assert r.lossy_requests >= 5
    assert r.lossy_ok >= 0.95 * r.lossy_requests, r.lossy_failures
    assert r.recover_s is not None and r.recover_s < 30.0
