"""The prefill, decode and co-located workers over an in-memory page store (no daemon): greedy
output equal to the cache-free reference whatever the store holds, pages pulled and verified,
published in the background, and a store that fails never failing a request.

The store double has `client.StoreClient`'s lookup/get/put surface and faults to switch on;
tests/integration/test_engine_disagg.py runs the same paths against a real daemon.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from client import (
    CapacityExhausted,
    GetResult,
    IoClass,
    LookupResult,
    Page,
    PageHeader,
    PutResult,
    PutStatus,
    Scope,
    Tier,
    Unavailable,
    WritableBuffer,
    page_keys,
)
from client.contract.types import checked_tokens, match_tokens
from engine.colocated import ColocatedWorker
from engine.decode import DecodeWorker
from engine.errors import EngineBusy, EngineStopping, InvalidRequest
from engine.prefill import PrefillWorker
from engine.reference import greedy_generate
from engine.requests import DecodeRequest, FinishReason
from engine.runtime import ModelRuntime
from engine.sampling import SamplingParams

pytestmark = pytest.mark.unit

PAGE = 16


class MemoryStore:
    """Pages in a dict, served like the real client serves them (a miss is None). Faults:
    `down` (every call raises Unavailable), `full` (put raises CapacityExhausted), `serve`
    (rewrites what get hands back: a store that lies), `gate` (lookups block: a slow store)."""

    def __init__(self) -> None:
        self.pages: dict[bytes, tuple[PageHeader, bytes, Tier]] = {}
        self.down = False
        self.full = False
        self.serve: Callable[[int, PageHeader, bytes], tuple[PageHeader, bytes]] | None = None
        self.gate: threading.Event | None = None  # when set: lookups wait for it (a slow store)
        self.waiting = threading.Event()  # a lookup is waiting at the gate
        self.calls: collections.Counter[tuple[str, IoClass | None]] = collections.Counter()
        self._lock = threading.Lock()

    def _check(self, call: str, io_class: IoClass | None = None) -> None:
        with self._lock:
            self.calls[(call, io_class)] += 1
        if self.down:
            raise Unavailable("store is down (test)")

    def lookup(self, scope: Scope, keys: Sequence[bytes]) -> LookupResult:
        self._check("lookup")
        if self.gate is not None:
            self.waiting.set()
            assert self.gate.wait(30)
        tiers = []
        for key in keys:
            entry = self.pages.get(key)
            if entry is None or entry[0].scope_digest != scope.digest:
                break
            tiers.append(entry[2])
        return LookupResult(len(tiers), tuple(tiers))

    def get(
        self,
        scope: Scope,
        keys: Sequence[bytes],
        into: Sequence[WritableBuffer],
        *,
        tokens: Sequence[Sequence[int]] | None,
        io_class: IoClass | None = None,
        verify: bool | None = None,
    ) -> GetResult:
        self._check("get", io_class)
        expected = checked_tokens(scope, keys, tokens)
        headers: list[PageHeader | None] = []
        for i, key in enumerate(keys):
            entry = self.pages.get(key)
            if entry is None:
                headers.append(None)
                continue
            header, payload = entry[0], entry[1]
            if self.serve is not None:
                header, payload = self.serve(i, header, payload)
            memoryview(into[i]).cast("B")[: len(payload)] = payload
            headers.append(header)
        # the SDK's check of the caller's tokens (StoreClient.get), on whatever `serve` served
        checked, rejected = match_tokens(scope, headers, expected)
        return GetResult(checked, rejected)

    def put(
        self,
        scope: Scope,
        pages: Sequence[Page],
        *,
        io_class: IoClass | None = None,
        tier: Tier | None = None,
        prefix_tokens: Sequence[int] = (),
    ) -> PutResult:
        self._check("put", io_class)
        if self.full:
            raise CapacityExhausted("store is full (test)")
        statuses = []
        for page in pages:
            page.header.validate_for(scope)
            if page.header.key in self.pages:
                statuses.append(PutStatus.ALREADY_PRESENT)
                continue
            payload = bytes(memoryview(page.payload).cast("B"))
            self.pages[page.header.key] = (page.header, payload, tier or Tier.DRAM)
            statuses.append(PutStatus.STORED)
        return PutResult(tuple(statuses))


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint: Path) -> ModelRuntime:
    return ModelRuntime(tiny_checkpoint, page_tokens=PAGE, max_context=512)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def workers(
    runtime: ModelRuntime, store: MemoryStore
) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = PrefillWorker(runtime, store, chunk_tokens=24)
    decode = DecodeWorker(runtime, store, max_batch=4, chunk_tokens=24)
    yield prefill, decode
    prefill.stop(5)
    decode.stop(5)


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def reference(runtime: ModelRuntime, prompt: Sequence[int], count: int) -> list[int]:
    """Greedy tokens of the dense, cache-free model (memoised per prompt)."""
    key = tuple(prompt)
    known = _REFERENCE.get(key, [])
    if len(known) < count:
        known = greedy_generate(runtime.model, list(prompt), count)
        _REFERENCE[key] = known
    return known[:count]


def prompt_of(runtime: ModelRuntime, length: int, seed: int) -> list[int]:
    """`length` tokens: BOS, then a seeded random walk over the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(3, runtime.vocab_size, (length - 1,), generator=gen).tolist()
    return [runtime.tokenizer.bos_id or 0, *body]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def disaggregated(
    prefill: PrefillWorker, decode: DecodeWorker, prompt: Sequence[int], params: SamplingParams
) -> list[int]:
    first = prefill.prefill(prompt, params)
    rest = decode.generate(prompt, (first.first_token,), params)
    return [first.first_token, *rest.token_ids]


@pytest.mark.parametrize("length", [1, 15, 16, 40, 64])
def test_greedy_matches_the_reference_cold_and_hit(
    runtime: ModelRuntime,
    store: MemoryStore,
    workers: tuple[PrefillWorker, DecodeWorker],
    length: int,
) -> None:
    prefill, decode = workers
    prompt = prompt_of(runtime, length, seed=length)
    want = reference(runtime, prompt, GREEDY.max_tokens)
    cold = prefill.prefill(prompt, GREEDY)
    full_pages = length // PAGE
    assert cold.hit_tokens.total == 0 and cold.computed_tokens == length
    assert cold.page_keys == tuple(page_keys(runtime.scope(), prompt))
    assert cold.published_pages == full_pages  # the answer waited for its puts
    assert all(k in store.pages for k in cold.page_keys)
    rest = decode.generate(prompt, (cold.first_token,), GREEDY)
    assert [cold.first_token, *rest.token_ids] == want
    assert rest.finish_reason is FinishReason.LENGTH
    # the decode pulled every prompt page and recomputed only the tail (and the first token)
    assert rest.stats.hit_tokens.dram == full_pages * PAGE
    assert rest.stats.computed_tokens == length + 1 - full_pages * PAGE
    hit = prefill.prefill(prompt, GREEDY)
    assert hit.first_token == cold.first_token and hit.hit_tokens.dram == full_pages * PAGE
    assert hit.computed_tokens == max(1, length - full_pages * PAGE)
    assert hit.published_pages == 0


def test_partial_hit_and_kv_equal_to_a_cold_computation(
    runtime: ModelRuntime, store: MemoryStore, workers: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = workers
    shared = prompt_of(runtime, 40, seed=7)
    first = [*shared, *prompt_of(runtime, 30, seed=8)[1:]]
    second = [*shared, *prompt_of(runtime, 35, seed=9)[1:]]
    prefill.prefill(first, GREEDY)
    hit = prefill.prefill(second, GREEDY)
    assert hit.hit_tokens.total == 32 and hit.computed_tokens == len(second) - 32
    rest = decode.generate(second, (hit.first_token,), GREEDY)
    assert [hit.first_token, *rest.token_ids] == reference(runtime, second, GREEDY.max_tokens)
    # the pages computed on top of the hit equal those of a prefill without any store
    alone = MemoryStore()
    lone = PrefillWorker(runtime, alone, chunk_tokens=1000)
    lone.prefill(second, GREEDY)
    lone.stop()
    keys = page_keys(runtime.scope(), second)
    assert len(keys) == 4
    for key in keys:
        with_hit = torch.frombuffer(bytearray(store.pages[key][1]), dtype=torch.float32)
        cold = torch.frombuffer(bytearray(alone.pages[key][1]), dtype=torch.float32)
        torch.testing.assert_close(with_hit, cold, atol=1e-5, rtol=0)


def test_chunk_size_changes_nothing_and_io_classes_are_right(
    runtime: ModelRuntime, store: MemoryStore
) -> None:
    prompt = prompt_of(runtime, 70, seed=3)
    results = {}
    for chunk in (5, 16, 33, 512):
        scope_store = MemoryStore()
        worker = PrefillWorker(runtime, scope_store, chunk_tokens=chunk)
        results[chunk] = (worker.prefill(prompt, GREEDY), scope_store)
        worker.stop()
    firsts = {r.first_token for r, _ in results.values()}
    assert firsts == {reference(runtime, prompt, 1)[0]}
    base = results[512][1].pages
    for result, pages in results.values():
        assert result.published_pages == 4
        for key, (_, payload, _) in pages.pages.items():
            torch.testing.assert_close(
                torch.frombuffer(bytearray(payload), dtype=torch.float32),
                torch.frombuffer(bytearray(base[key][1]), dtype=torch.float32),
                atol=1e-5,
                rtol=0,
            )
    used = results[5][1]
    worker = PrefillWorker(runtime, used)
    worker.prefill(prompt, GREEDY)
    worker.stop()
    decode = DecodeWorker(runtime, used, max_batch=2)
    decode.generate(prompt, (results[5][0].first_token,), GREEDY)
    decode.stop()
    assert used.calls[("get", IoClass.NORMAL)] == 1  # the prefill's pull
    assert used.calls[("get", IoClass.CRITICAL)] == 1  # the decode's pull
    assert used.calls[("put", IoClass.BACKGROUND)] >= 1
    assert {io for (call, io) in used.calls if call == "put"} == {IoClass.BACKGROUND}


def test_a_page_with_other_tokens_under_the_key_is_rejected(
    runtime: ModelRuntime, store: MemoryStore, workers: tuple[PrefillWorker, DecodeWorker]
) -> None:
    """A store that answers a key with a page of other tokens (a collision, a bug, an attack):
    token verification turns it into a miss, and the output is still the reference's."""
    prefill, decode = workers
    prompt = prompt_of(runtime, 50, seed=11)
    decoy = prompt_of(runtime, 50, seed=12)
    prefill.prefill(decoy, GREEDY)
    prefill.prefill(prompt, GREEDY)
    decoy_pages = [store.pages[k] for k in page_keys(runtime.scope(), decoy)]

    def lie(i: int, header: PageHeader, payload: bytes) -> tuple[PageHeader, bytes]:
        if i == 1:  # page 1: the decoy's KV and tokens, under this prompt's key and parent
            wrong = decoy_pages[1][0]
            return dataclasses.replace(wrong, key=header.key, parent=header.parent), decoy_pages[1][
                1
            ]
        return header, payload

    store.serve = lie
    again = prefill.prefill(prompt, GREEDY)
    assert again.rejected_pages == 1 and again.hit_tokens.total == PAGE  # page 0 only
    assert again.computed_tokens == 50 - PAGE
    rest = decode.generate(prompt, (again.first_token,), GREEDY)
    assert rest.stats.rejected_pages == 1 and rest.stats.hit_tokens.total == PAGE
    assert [again.first_token, *rest.token_ids] == reference(runtime, prompt, GREEDY.max_tokens)
    assert prefill.link.stats.rejected_pages == 1


def test_a_failing_store_only_costs_compute(
    runtime: ModelRuntime, store: MemoryStore, workers: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = workers
    now = [0.0]
    prefill.link.clock = lambda: now[0]
    prompt = prompt_of(runtime, 45, seed=13)
    want = reference(runtime, prompt, GREEDY.max_tokens)
    store.full = True
    full = prefill.prefill(prompt, GREEDY)
    assert full.published_pages == 0 and not store.pages
    assert disaggregated(prefill, decode, prompt, GREEDY) == want
    store.full, store.down = False, True
    down = prefill.prefill(prompt, GREEDY)
    assert down.hit_tokens.total == 0 and down.computed_tokens == 45
    assert disaggregated(prefill, decode, prompt, GREEDY) == want
    assert prefill.link.stats.store_errors >= 1
    # while the link waits out the store's outage it does not call it at all
    calls = sum(store.calls.values())
    prefill.prefill(prompt, GREEDY)
    assert sum(store.calls.values()) == calls
    store.down = False
    now[0] += prefill.link.retry_after_s
    prefill.prefill(prompt, GREEDY)  # calls the store again, and publishes
    assert prefill.prefill(prompt, GREEDY).hit_tokens.total == 32


def test_decode_resumes_from_the_tokens_produced_so_far(
    runtime: ModelRuntime, store: MemoryStore, workers: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = workers
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = prompt_of(runtime, 20, seed=14)
    want = reference(runtime, prompt, params.max_tokens)
    first = prefill.prefill(prompt, params).first_token
    stream = decode.submit(DecodeRequest(tuple(prompt), (first,), params))
    produced = [first]
    for event in stream:
        assert event.token_id is not None
        produced.append(event.token_id)
        if len(produced) == 25:
            stream.cancel()  # this worker goes away after 24 tokens of its own
            break
    other = DecodeWorker(runtime, store, max_batch=2)
    rest = other.generate(prompt, produced, params)
    other.stop()
    assert produced + list(rest.token_ids) == want
    # pages of the generated text were published as they filled, and the second worker
    # pulled them: 45 tokens → 2 full pages (the prompt had only 1)
    assert rest.stats.hit_tokens.total == 2 * PAGE
    assert decode.in_flight == 0


def test_a_slow_store_does_not_stall_running_decodes(
    runtime: ModelRuntime, store: MemoryStore, workers: tuple[PrefillWorker, DecodeWorker]
) -> None:
    """A new request's pull hangs in the store; the running request decodes on regardless."""
    prefill, decode = workers
    long, short = SamplingParams(max_tokens=300, ignore_eos=True), GREEDY
    running, late = prompt_of(runtime, 20, seed=19), prompt_of(runtime, 40, seed=20)
    first = prefill.prefill(running, long).first_token
    late_first = prefill.prefill(late, short).first_token
    events = iter(decode.submit(DecodeRequest(tuple(running), (first,), long)))
    head = next(events)
    gate = store.gate = threading.Event()
    blocked = decode.submit(DecodeRequest(tuple(late), (late_first,), short))
    assert store.waiting.wait(10)  # the late request's lookup hangs in the store
    hung_at = time.monotonic()
    failsafe = threading.Timer(30, gate.set)  # a stalled scheduler fails, not hangs, the test
    failsafe.start()
    rest = [head, *events]
    still_hung = not gate.is_set()
    gate.set()
    failsafe.cancel()
    assert still_hung and len(rest) == 299
    assert sum(e.time_s > hung_at for e in rest) >= 100  # decoded while the pull hung
    assert [first, *(e.token_id for e in rest[:29])] == reference(runtime, running, 30)
    result = blocked.result()
    assert [late_first, *result.token_ids] == reference(runtime, late, short.max_tokens)
    assert result.stats.hit_tokens.total == 32


def test_colocated_matches_and_interleaves_prefill_chunks(runtime: ModelRuntime) -> None:
    worker = ColocatedWorker(runtime, None, max_batch=4, step_token_budget=24, chunk_tokens=16)
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        short = prompt_of(runtime, 5, seed=15)
        long = prompt_of(runtime, 300, seed=16)
        events = iter(worker.submit(DecodeRequest(tuple(short), (), params)))
        head = next(events)  # the short request is decoding now
        submitted = time.monotonic()
        second = worker.submit(DecodeRequest(tuple(long), (), SamplingParams(max_tokens=3)))
        short_events = [head, *events]
        long_result = second.result()
        assert [e.token_id for e in short_events] == reference(runtime, short, 40)
        assert list(long_result.token_ids) == reference(runtime, long, 3)
        # The long prompt was prefilled in chunks of at most 23 tokens a step (the budget less
        # the decode), >= 13 steps, and the short request decoded a token in each of them.
        first_long = long_result.token_times_s[0]
        during = [e for e in short_events if submitted < e.time_s < first_long]
        assert len(during) >= 12
        assert long_result.stats.computed_tokens == 300
    finally:
        worker.stop(5)


def test_requests_that_end_apart_keep_their_rows_right(runtime: ModelRuntime) -> None:
    """Requests of different prompt lengths and lengths decoded together: each one that ends
    moves another's K/V row (CPU), and every request still gives the reference's tokens."""
    worker = ColocatedWorker(runtime, None, max_batch=4, step_token_budget=64, chunk_tokens=32)
    try:
        assert worker.rows is not None  # the CPU path under test
        cases = [
            (prompt_of(runtime, n, seed=30 + n), m)
            for n, m in ((9, 6), (40, 20), (23, 3), (70, 14), (5, 9))
        ]
        streams = [
            worker.submit(
                DecodeRequest(tuple(p), (), SamplingParams(max_tokens=m, ignore_eos=True))
            )
            for p, m in cases
        ]
        for (prompt, count), stream in zip(cases, streams, strict=True):
            assert list(stream.result().token_ids) == reference(runtime, prompt, count)
        assert worker.wait_idle(5) and worker.rows.count == 0
        assert worker.pool.num_free == worker.pool.num_pages
    finally:
        worker.stop(5)


def test_seeded_sampling_is_the_same_split_or_not(
    runtime: ModelRuntime, workers: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = workers
    params = SamplingParams(
        temperature=2.0, top_p=0.95, top_k=50, seed=99, max_tokens=20, ignore_eos=True
    )
    prompt = prompt_of(runtime, 30, seed=17)
    split = disaggregated(prefill, decode, prompt, params)
    colocated = ColocatedWorker(runtime, None, max_batch=2)
    try:
        together = list(colocated.generate(prompt, params).token_ids)
        other_seed = list(
            colocated.generate(prompt, dataclasses.replace(params, seed=100)).token_ids
        )
    finally:
        colocated.stop(5)
    assert split == together != other_seed
    assert split != reference(runtime, prompt, 20)  # it did sample


def test_streams_stop_strings_and_finished_requests(
    runtime: ModelRuntime, workers: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = workers
    prompt = prompt_of(runtime, 12, seed=18)
    want = reference(runtime, prompt, 30)
    text = runtime.tokenizer.decode(want)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,))
    first = prefill.prefill(prompt, params)
    result = decode.generate(prompt, (first.first_token,), params)
    assert result.finish_reason is FinishReason.STOP
    assert first.first_text + result.text == text[: text.index(stop)]
    assert [first.first_token, *result.token_ids] == want[: 1 + len(result.token_ids)]
    # a request its tokens already finish: one last event, no token, nothing computed
    done = list(
        decode.submit(DecodeRequest(tuple(prompt), tuple(want[:5]), SamplingParams(max_tokens=5)))
    )
    assert [(e.index, e.token_id, e.finish_reason) for e in done] == [
        (5, None, FinishReason.LENGTH)
    ]
    eos = runtime.tokenizer.eos_id
    assert eos is not None
    ended = decode.generate(prompt, (want[0], eos), SamplingParams(max_tokens=9))
    assert ended.token_ids == () and ended.finish_reason is FinishReason.STOP


def test_bad_requests_busy_and_stopping(runtime: ModelRuntime, store: MemoryStore) -> None:
    prefill = PrefillWorker(runtime, store)
    decode = DecodeWorker(runtime, store, max_batch=1, max_waiting=1, kv_capacity_tokens=512)
    try:
        with pytest.raises(InvalidRequest, match="empty"):
            prefill.prefill([])
        with pytest.raises(InvalidRequest, match="context holds 512"):
            prefill.prefill([1] * 512)
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            prefill.prefill([1, runtime.vocab_size])
        with pytest.raises(InvalidRequest, match="not both"):
            prefill.prefill([1, 2], text="hi")
        with pytest.raises(InvalidRequest, match="stop token ids"):
            prefill.prefill([1, 2], SamplingParams(stop_token_ids=(runtime.vocab_size,)))
        with pytest.raises(InvalidRequest, match="output token ids"):
            decode.submit(DecodeRequest((1, 2), (-1,)))
        assert prefill.prefill(text="still serving").prompt_tokens > 1
        # one running (it holds the whole pool), one waiting, the next refused
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        running = decode.submit(DecodeRequest((1, 2, 3), (), long))
        next(iter(running))
        waiting = decode.submit(DecodeRequest((1, 2, 3), (), SamplingParams(max_tokens=2)))
        with pytest.raises(EngineBusy):
            decode.submit(DecodeRequest((1, 2, 3), ()))
        running.cancel()
        assert waiting.result().finish_reason is FinishReason.LENGTH
        assert running.result().finish_reason is FinishReason.CANCELLED
        assert decode.in_flight == 0 and decode.pool.num_free == decode.pool.num_pages
    finally:
        assert prefill.stop(5) and decode.stop(5)
    with pytest.raises(EngineStopping):
        prefill.prefill([1, 2])
    with pytest.raises(EngineStopping):
        decode.submit(DecodeRequest((1, 2), ()))
