"""Fuzzing every RPC of the store against a live daemon (a `strata serve` child on loopback).

Hypothesis draws calls of every method (tests/fuzz/rpc_strategies.py: hostile field values,
malformed page headers inside Put chunks, streams that end early, mangled bytes) and sends
them as raw bytes. After every case the answer must be a clean status code within its deadline
and the daemon must answer NodeInfo; after the run every page it serves must be well-formed
and a legitimate tenant's pages (stored first, never shown to the fuzzer) intact
(tests/fuzz/live.py). `STRATA_FUZZ_EXAMPLES=N` (or `strata fuzz props --target rpc`) runs
longer, randomized; the suite's run is derandomized and bounded.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from fuzz.live import LiveDaemon
from fuzz.rpc_calls import KINDS, Call, Outcome, check, healthy, send
from fuzz.rpc_strategies import calls, fresh_pages
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kvstore_pb import store_pb2 as pb
from kvstore_pb.store_pb2_grpc import StoreStub

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "800"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("STRATA_FUZZ_EXAMPLES"),
    suppress_health_check=list(HealthCheck),
)
CALL_TIMEOUT_S = 5.0
WATCH_TIMEOUT_S = 0.2


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDaemon]:
    with LiveDaemon(tmp_path_factory.mktemp("rpc-fuzz")) as d:
        yield d


def run(live: LiveDaemon, call: Call, who: str | None = "fuzzer") -> Outcome:
    assert live.channel is not None
    timeout = WATCH_TIMEOUT_S if call.method == "Watch" else CALL_TIMEOUT_S
    outcome = send(live.channel, call, timeout, live.metadata(who))
    note(f"{call.describe()} as {who} -> {outcome.code.name} {outcome.details[:200]!r}")
    assert check(call, outcome) is None, check(call, outcome)
    if who != "fuzzer" and live.auth and outcome.code is not grpc.StatusCode.CANCELLED:
        # no token, or a wrong one: refused before anything (bytes that do not even parse as
        # the request are refused as such first: that tells nothing about the store)
        malformed = outcome.details.startswith("malformed request message")
        assert outcome.code is grpc.StatusCode.UNAUTHENTICATED or malformed, (
            outcome.code,
            outcome.details,
        )
    assert healthy(live.channel, CALL_TIMEOUT_S, live.metadata("ops")) is None
    return outcome


@pytest.mark.parametrize("method", sorted(KINDS))
def test_request_bytes_that_do_not_parse_are_invalid_argument(
    live: LiveDaemon, method: str
) -> None:
    """Bytes protobuf cannot parse are the caller's mistake (INVALID_ARGUMENT), not the daemon's
    (gRPC's own answer to a request its deserializer refuses is INTERNAL)."""
    assert live.channel is not None
    garbage = b"\xff\xff\xff\xff"
    call = Call(method, (garbage, garbage) if KINDS[method][0] else (garbage,))
    outcome = send(live.channel, call, CALL_TIMEOUT_S, live.metadata("fuzzer"))
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT, (outcome.code, outcome.details)
    assert "malformed" in outcome.details.lower()


def test_fuzzed_calls_of_every_method_leave_the_daemon_serving_and_its_pages_sound(
    live: LiveDaemon,
) -> None:
    seen: Counter[tuple[str, str]] = Counter()

    @FUZZ
    @given(calls(live.world), st.sampled_from(("fuzzer",) * 8 + (None, "stranger")))
    def case(call: Call, who: str | None) -> None:
        seen[call.method, run(live, call, who).code.name] += 1

    case()
    print("fuzzed calls (method, answer): count", sorted(seen.items()))
    if EXAMPLES >= 800:  # (a shorter randomized run may miss one)
        assert {method for method, _ in seen} == set(KINDS)  # every RPC was fuzzed
    assert seen["Put", "OK"] > 0 and seen["Put", "INVALID_ARGUMENT"] > 0
    codes = Counter(code for (_, code), n in seen.items() for _ in range(n))
    assert codes["PERMISSION_DENIED"] > 0 and codes["UNAUTHENTICATED"] > 0
    live.finish()


def test_a_reservation_that_reserved_nothing_ends_cleanly(live: LiveDaemon) -> None:
    """Found by the lane campaign: a second reservation of a page another reservation is
    writing reserves nothing (PENDING); once the first ended, ending the second raised KeyError
    in the store (an UNKNOWN answer, or a failed mover pass when the lease expired)."""
    assert live.channel is not None
    header, _ = fresh_pages(live.world.scope, 1, seed=4242)[0]
    reserve = pb.ReserveRequest(scope=live.world.scope.encode(), headers=[header])
    md = live.metadata("fuzzer")
    first = StoreStub(live.channel).Reserve(reserve, metadata=md, timeout=CALL_TIMEOUT_S)
    second = StoreStub(live.channel).Reserve(reserve, metadata=md, timeout=CALL_TIMEOUT_S)
    assert first.slots[0].reserved and second.slots[0].pending
    for lease in (first.lease_id, second.lease_id):
        reply = StoreStub(live.channel).Release(
            pb.ReleaseRequest(lease_id=lease), metadata=md, timeout=CALL_TIMEOUT_S
        )
        assert reply.released
    assert healthy(live.channel, CALL_TIMEOUT_S, live.metadata("ops")) is None
