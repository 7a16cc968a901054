"""Prefill → store → decode against a real in-process daemon (DESIGN §1, §8): the greedy tokens
are the cache-free reference's with a cold store, a full or partial prefix hit, pages served from
SSD, and a decode resumed on another worker; pages never cross scopes; and a store that stops,
serves a corrupt page or is full only makes the engines compute more."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from conftest import DaemonFactory, RunningDaemon

from client import (
    CapacityExhausted,
    GetResult,
    InvalidArgument,
    IoClass,
    PageHeader,
    Scope,
    StoreClient,
    Tier,
    WritableBuffer,
    build_pages,
    make_header,
    page_keys,
)
from client.contract.types import checked_tokens, match_tokens
from engine.checkpoint import load_checkpoint, make_scope
from engine.decode import DecodeWorker
from engine.prefill import PrefillWorker
from engine.presets import init_checkpoint
from engine.reference import greedy_generate
from engine.requests import DecodeRequest
from engine.runtime import ModelRuntime
from engine.sampling import SamplingParams
from kvstore.auth import hash_token

pytestmark = pytest.mark.integration

PAGE = 16
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint: Path) -> ModelRuntime:
    return ModelRuntime(tiny_checkpoint, page_tokens=PAGE, max_context=1024)


_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def reference(runtime: ModelRuntime, prompt: Sequence[int], count: int) -> list[int]:
    key = (id(runtime), *prompt)
    if len(_REFERENCE.get(key, ())) < count:
        _REFERENCE[key] = greedy_generate(runtime.model, list(prompt), count)
    return _REFERENCE[key][:count]


def prompt_of(runtime: ModelRuntime, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(3, runtime.vocab_size, (length - 1,), generator=gen).tolist()
    return [runtime.tokenizer.bos_id or 0, *body]


class Engines:
    """A prefill and a decode worker sharing one store client of a daemon."""

    def __init__(self, runtime: ModelRuntime, store: StoreClient) -> None:
        self.runtime = runtime
        self.store = store
        self.prefill = PrefillWorker(runtime, store, chunk_tokens=32)
        self.decode = DecodeWorker(runtime, store, max_batch=4)

    def generate(
        self, prompt: Sequence[int], params: SamplingParams = GREEDY, namespace: str = ""
    ) -> list[int]:
        first = self.prefill.prefill(prompt, params, namespace=namespace)
        rest = self.decode.generate(prompt, (first.first_token,), params, namespace=namespace)
        return [first.first_token, *rest.token_ids]

    def stop(self) -> None:
        self.prefill.stop(5)
        self.decode.stop(5)


@pytest.fixture
def engines(runtime: ModelRuntime, daemon: RunningDaemon) -> Iterator[Engines]:
    store = StoreClient(daemon.address, timeout_s=2.0, retries=1)
    running = Engines(runtime, store)
    yield running
    running.stop()
    store.close()


def test_cold_full_and_partial_hits_match_the_reference(
    runtime: ModelRuntime, engines: Engines, daemon: RunningDaemon
) -> None:
    shared = prompt_of(runtime, 48, seed=1)
    prompt = [*shared, *prompt_of(runtime, 20, seed=2)[1:]]  # 67 tokens: 4 full pages
    want = reference(runtime, prompt, GREEDY.max_tokens)

    cold = engines.prefill.prefill(prompt, GREEDY)
    assert (cold.hit_tokens.total, cold.computed_tokens, cold.published_pages) == (0, 67, 4)
    found = engines.store.lookup(runtime.scope(), list(cold.page_keys))
    assert (found.hit_count, found.tiers) == (4, (Tier.DRAM,) * 4)
    rest = engines.decode.generate(prompt, (cold.first_token,), GREEDY)
    assert [cold.first_token, *rest.token_ids] == want
    assert (rest.stats.hit_tokens.dram, rest.stats.computed_tokens) == (64, 4)

    hit = engines.prefill.prefill(prompt, GREEDY)  # the full prefix is in the store
    assert (hit.hit_tokens.dram, hit.computed_tokens, hit.first_token) == (64, 3, want[0])
    assert engines.generate(prompt) == want

    other = [*shared, *prompt_of(runtime, 30, seed=3)[1:]]  # shares 3 full pages
    part = engines.prefill.prefill(other, GREEDY)
    assert (part.hit_tokens.dram, part.computed_tokens) == (48, len(other) - 48)
    rest = engines.decode.generate(other, (part.first_token,), GREEDY)
    assert [part.first_token, *rest.token_ids] == reference(runtime, other, GREEDY.max_tokens)
    daemon.check()


def test_kv_computed_on_a_prefix_hit_equals_kv_without_one(
    runtime: ModelRuntime, engines: Engines
) -> None:
    shared = prompt_of(runtime, 40, seed=4)
    engines.prefill.prefill([*shared, *prompt_of(runtime, 9, seed=5)[1:]], GREEDY)
    prompt = [*shared, *prompt_of(runtime, 50, seed=6)[1:]]
    hit = engines.prefill.prefill(prompt, GREEDY)
    assert hit.hit_tokens.total == 32 and hit.published_pages == 3
    # the same prompt computed with no store at all, in one pass
    alone = runtime.new_pool(8)
    table = alone.allocate(alone.pages_for(len(prompt)))
    runtime.model.forward(torch.tensor(prompt), None, alone, table, 0)
    scope = runtime.scope()
    keys = page_keys(scope, prompt)
    into = [bytearray(scope.page_payload_bytes) for _ in keys]
    got = engines.store.get(scope, keys, into, tokens=None)
    assert got.hit_count == len(keys) == 5
    for i, buf in enumerate(into):
        stored = torch.frombuffer(buf, dtype=torch.float32)
        cold = alone.tensor[table[i]].reshape(-1)
        torch.testing.assert_close(stored, cold, atol=1e-5, rtol=0)


def test_hits_served_from_ssd(
    runtime: ModelRuntime, engines: Engines, daemon: RunningDaemon
) -> None:
    prompt = prompt_of(runtime, 70, seed=7)
    want = reference(runtime, prompt, GREEDY.max_tokens)
    scope = runtime.scope()
    engines.prefill.prefill(prompt, GREEDY)
    keys = page_keys(scope, prompt)
    into = [bytearray(scope.page_payload_bytes) for _ in keys]
    assert engines.store.get(scope, keys, into, tokens=None).hit_count == 4
    assert engines.store.delete(keys=keys) == 4
    assert engines.store.put(scope, build_pages(scope, prompt, into), tier=Tier.SSD).stored == 4
    assert engines.store.lookup(scope, keys).tiers == (Tier.SSD,) * 4
    first = engines.prefill.prefill(prompt, GREEDY)
    assert (first.hit_tokens.ssd, first.computed_tokens) == (64, 6)
    rest = engines.decode.generate(prompt, (first.first_token,), GREEDY)
    assert [first.first_token, *rest.token_ids] == want


def test_decode_resumes_on_another_worker(
    runtime: ModelRuntime, engines: Engines, daemon: RunningDaemon
) -> None:
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompt = prompt_of(runtime, 30, seed=8)
    want = reference(runtime, prompt, params.max_tokens)
    first = engines.prefill.prefill(prompt, params).first_token
    stream = engines.decode.submit(DecodeRequest(tuple(prompt), (first,), params))
    produced = [first]
    for event in stream:
        assert event.token_id is not None and event.index == len(produced)
        produced.append(event.token_id)
        if len(produced) == 35:
            break
    stream.cancel()  # the caller and the first decode worker go away mid-stream
    engines.decode.stop(0)
    engines.decode.link.drain(5)
    second = DecodeWorker(runtime, engines.store, max_batch=2)
    try:
        rest = second.generate(prompt, produced, params)
    finally:
        second.stop(5)
    assert produced + list(rest.token_ids) == want
    # 30 + 35 tokens: 4 full pages, 2 of them text the first worker generated and published
    assert rest.stats.hit_tokens.dram == 64 and rest.stats.computed_tokens == 1


def test_pages_never_cross_scopes(
    runtime: ModelRuntime, engines: Engines, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    prompt = prompt_of(runtime, 50, seed=9)
    scope = runtime.scope()
    engines.generate(prompt)
    assert engines.store.lookup(scope, page_keys(scope, prompt)).hit_count == 3
    init_checkpoint(tmp_path / "other", "tiny", seed=1, tie_word_embeddings=False)
    other_weights = ModelRuntime(tmp_path / "other", page_tokens=PAGE, max_context=1024)
    others = {
        "weights": other_weights.scope(),
        "tokenizer": dataclasses.replace(scope, tokenizer_fingerprint="0" * 32),
        "adapter": dataclasses.replace(scope, adapter_id="lora-1", adapter_fingerprint="ab12"),
        "namespace": runtime.scope("tenant-b"),
    }
    for name, other in others.items():
        assert other.digest != scope.digest, name
        assert engines.store.lookup(other, page_keys(other, prompt)).hit_count == 0, name
    # the other weights' engine finds nothing and produces its own model's tokens
    other = Engines(other_weights, engines.store)
    try:
        hit = other.prefill.prefill(prompt, GREEDY)
        assert hit.hit_tokens.total == 0
        assert other.generate(prompt) == reference(other_weights, prompt, GREEDY.max_tokens)
    finally:
        other.stop()
    tenant = engines.prefill.prefill(prompt, GREEDY, namespace="tenant-b")
    assert tenant.hit_tokens.total == 0 and tenant.computed_tokens == 50
    # make_scope of the same checkpoint folder, loaded again: the same scope (a hit)
    again = make_scope(load_checkpoint(tiny_checkpoint), page_tokens=PAGE)
    assert again.digest == scope.digest


class LyingStore:
    """A real store client that answers chosen keys with another prompt's page (its tokens and
    KV, relabelled with the asked-for key): what a colliding or malicious page looks like."""

    def __init__(self, inner: StoreClient, swap: dict[bytes, tuple[PageHeader, bytes]]) -> None:
        self.inner = inner
        self.swap = swap
        self.lookup = inner.lookup
        self.put = inner.put

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
        got = self.inner.get(scope, keys, into, tokens=None, io_class=io_class, verify=verify)
        headers = list(got.headers)
        for i, key in enumerate(keys):
            if key in self.swap and headers[i] is not None:
                header, payload = self.swap[key]
                memoryview(into[i]).cast("B")[: len(payload)] = payload
                headers[i] = dataclasses.replace(header, key=key)
        # what the SDK then does with the caller's tokens (as StoreClient.get does)
        checked, rejected = match_tokens(scope, headers, checked_tokens(scope, keys, tokens))
        return GetResult(checked, rejected)


def test_a_poisoned_page_is_refused_by_the_store_and_by_token_checks(
    runtime: ModelRuntime, engines: Engines, daemon: RunningDaemon
) -> None:
    scope = runtime.scope()
    prompt, decoy = prompt_of(runtime, 40, seed=10), prompt_of(runtime, 40, seed=11)
    want = reference(runtime, prompt, GREEDY.max_tokens)
    engines.generate(prompt)
    engines.generate(decoy)
    keys, decoy_keys = page_keys(scope, prompt), page_keys(scope, decoy)
    buf = bytearray(scope.page_payload_bytes)
    assert engines.store.get(scope, decoy_keys[1:2], [buf], tokens=None).hit_count == 1
    decoy_header = make_header(scope, decoy_keys[0], decoy[16:32], buf)
    # A page crafted to sit under this prompt's key with the decoy's tokens: refused on put,
    # by the client and by the daemon alike, since its key is not chain_key(parent, tokens).
    crafted = dataclasses.replace(decoy_header, key=keys[1], parent=keys[0])
    with pytest.raises(InvalidArgument, match="chain_key"):
        crafted.validate_for(scope)
    with pytest.raises(InvalidArgument, match="chain_key"):
        daemon.store.plan_put(scope, [crafted.encode()])
    # A store that serves it anyway: the engines check the tokens and compute that page.
    lying = LyingStore(engines.store, {keys[1]: (decoy_header, bytes(buf))})
    fooled = Engines(runtime, lying)  # type: ignore[arg-type]
    try:
        first = fooled.prefill.prefill(prompt, GREEDY)
        assert (first.rejected_pages, first.hit_tokens.total, first.computed_tokens) == (1, 16, 24)
        rest = fooled.decode.generate(prompt, (first.first_token,), GREEDY)
        assert rest.stats.rejected_pages == 1 and rest.stats.hit_tokens.total == 16
        assert [first.first_token, *rest.token_ids] == want
    finally:
        fooled.stop()


def test_store_stopped_mid_run(
    runtime: ModelRuntime, engines: Engines, daemon: RunningDaemon
) -> None:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    prompt = prompt_of(runtime, 45, seed=12)
    want = reference(runtime, prompt, params.max_tokens)
    first = engines.prefill.prefill(prompt, params)
    assert first.published_pages == 2
    stream = engines.decode.submit(DecodeRequest(tuple(prompt), (first.first_token,), params))
    events = iter(stream)
    produced = [first.first_token, next(events).token_id]
    daemon.stop()  # the store goes away while the request decodes (and publishes)
    produced += [e.token_id for e in events]
    assert produced == want
    # new requests still complete, computing everything
    again = engines.prefill.prefill(prompt, params)
    assert again.hit_tokens.total == 0 and again.computed_tokens == 45
    rest = engines.decode.generate(prompt, (again.first_token,), params)
    assert [again.first_token, *rest.token_ids] == want
    assert rest.stats.hit_tokens.total == 0
    assert engines.prefill.link.stats.store_errors >= 1


def test_a_corrupt_page_is_recomputed(
    runtime: ModelRuntime, engines: Engines, daemon: RunningDaemon
) -> None:
    scope = runtime.scope()
    prompt = prompt_of(runtime, 40, seed=13)
    want = reference(runtime, prompt, GREEDY.max_tokens)
    engines.prefill.prefill(prompt, GREEDY)
    keys = page_keys(scope, prompt)
    buf = bytearray(scope.page_payload_bytes)
    # a remote read: the daemon computes page 1's checksum (a same-host publish leaves it to the
    # daemon, which computes it when the bytes leave DRAM)
    remote = daemon.client(shared_memory=False)
    assert remote.get(scope, keys[1:2], [buf], tokens=None).hit_count == 1
    # flip one byte of page 1's payload where it lies, in the daemon's DRAM segment
    with open(f"/dev/shm/{daemon.info.segment_name}", "r+b") as segment:
        data = segment.read()
        at = data.find(bytes(buf))
        assert at >= 0 and data.find(bytes(buf), at + 1) < 0
        segment.seek(at + 100)
        segment.write(bytes([data[at + 100] ^ 0x40]))
    # ...then it leaves DRAM for SSD: the read back verifies it (a same-host copy out of DRAM is
    # fenced, not hashed: the checksum is checked where bytes can be damaged)
    with daemon.store._lock:
        entry = daemon.store.index.get(keys[1])
    assert entry is not None and daemon.store.mover.copy_to_ssd(entry, clear_dram=True)
    before = daemon.store.counters.corrupt_dropped
    first = engines.prefill.prefill(prompt, GREEDY)
    assert (first.hit_tokens.total, first.computed_tokens) == (16, 24)
    rest = engines.decode.generate(prompt, (first.first_token,), GREEDY)
    assert [first.first_token, *rest.token_ids] == want
    assert daemon.store.counters.corrupt_dropped == before + 1  # dropped, counted, recomputed


def test_a_full_store_refuses_pages_and_requests_still_complete(
    runtime: ModelRuntime, daemon_factory: DaemonFactory
) -> None:
    full = daemon_factory(dram="1MiB", ssd=None)
    filler = runtime.scope("filler")
    taken = 0
    while True:  # reserve every DRAM slot (leased: nothing can be evicted to make room)
        tokens = prompt_of(runtime, PAGE, seed=1000 + taken)
        page = build_pages(filler, tokens, [bytes(filler.page_payload_bytes)])[0]
        try:
            full.store.reserve(filler, [page.header.encode()], lease_ms=120_000)
        except CapacityExhausted:
            break
        taken += 1
    assert taken >= 100
    store = StoreClient(full.address, timeout_s=2.0, retries=1)
    engines = Engines(runtime, store)
    try:
        prompt = prompt_of(runtime, 50, seed=14)
        first = engines.prefill.prefill(prompt, GREEDY)
        assert first.published_pages == 0
        rest = engines.decode.generate(prompt, (first.first_token,), GREEDY)
        assert [first.first_token, *rest.token_ids] == reference(runtime, prompt, GREEDY.max_tokens)
        assert engines.prefill.link.stats.unpublished_pages == 3
    finally:
        engines.stop()
        store.close()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_workers_publish_and_pull_through_a_daemon_with_tokens(
    runtime: ModelRuntime, daemon_factory: DaemonFactory, tmp_path: Path, shared_memory: bool
) -> None:
    """Engines with their principal's token (the same-host lane's HELLO, or gRPC metadata)
    publish and pull their namespace's pages; an engine holding another namespace's token is
    refused both ways by the daemon (so computes everything) and still answers right."""
    tokens = {"engine-a": "engine-a-token-0123456789", "engine-b": "engine-b-token-0123456789"}
    file = tmp_path / "tokens.toml"
    file.write_text(
        "".join(
            f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{hash_token(token)}"\n'
            f'read = ["{name}-ns"]\nwrite = ["{name}-ns"]\ntrusted_local = true\n\n'
            for name, token in tokens.items()
        )
    )
    file.chmod(0o600)
    d = daemon_factory(ssd=None, settings={"auth.tokens_file": str(file)})
    stores = {
        name: StoreClient(
            d.address, shared_memory=shared_memory, timeout_s=2.0, retries=1, token=token
        )
        for name, token in tokens.items()
    }
    a, b = Engines(runtime, stores["engine-a"]), Engines(runtime, stores["engine-b"])
    try:
        prompt = prompt_of(runtime, 50, seed=30)  # 3 full pages
        want = reference(runtime, prompt, GREEDY.max_tokens)
        cold = a.prefill.prefill(prompt, GREEDY, namespace="engine-a-ns")
        assert cold.published_pages == 3
        rest = a.decode.generate(prompt, (cold.first_token,), GREEDY, namespace="engine-a-ns")
        assert [cold.first_token, *rest.token_ids] == want
        assert rest.stats.hit_tokens.total == 48  # pulled through the authenticated daemon
        assert stores["engine-a"].transport == ("shm" if shared_memory else "grpc")
        # engine-b's token does not hold engine-a-ns: its lookups and pulls miss, its pages
        # are not published, and it computes the same answer
        other = b.prefill.prefill(prompt, GREEDY, namespace="engine-a-ns")
        assert (other.hit_tokens.total, other.published_pages) == (0, 0)
        more = b.decode.generate(prompt, (other.first_token,), GREEDY, namespace="engine-a-ns")
        assert more.stats.hit_tokens.total == 0
        assert [other.first_token, *more.token_ids] == want
        with d.store._lock:  # engine-a's pages only (its prompt's, and its decode's)
            assert d.store.index.namespaces() == ["engine-a-ns"]
    finally:
        a.stop()
        b.stop()
        for store in stores.values():
            store.close()
    d.check()
