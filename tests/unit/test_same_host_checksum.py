"""The same-host path's integrity pieces in isolation: headers whose payload checksum is computed
on first use or left to the daemon (client/contract/page.py), and the slot-generation fence of a
same-host get (client/transports/shm.py `read_acquired`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import xxhash

import client.contract.page as page_module
from client import KVLayout, Page, Scope, build_pages
from client.contract.errors import Corrupt
from client.contract.page import (
    FLAG_CHECKSUM_DEFERRED,
    PageHeader,
    checked_payload_checksum,
    checksum_deferred,
    make_header,
    quick_check,
    seal_header,
)
from client.contract.types import GetResult, Segment, Tier
from client.transports.shm import SegmentMap, open_segment, read_acquired, reserve_headers
from kvstore_pb import store_pb2 as pb

SCOPE = Scope(
    model_id="tiny",
    weights_revision="w1",
    tokenizer_fingerprint="tok1",
    kv_dtype="float16",
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=4),
)
PAGE = SCOPE.page_payload_bytes
GRANULE = PAGE
SLOTS = 4
GENERATIONS_AT = SLOTS * PAGE


def payload(i: int) -> bytes:
    return bytes((i * 29 + j) % 253 for j in range(PAGE))


def pages_of(count: int) -> list[Page]:
    return build_pages(SCOPE, list(range(3, 3 + 4 * count)), [payload(i) for i in range(count)])


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every payload hash the page codec computes, by size."""
    calls: list[int] = []
    real = page_module.payload_checksum

    def counting(data: page_module.Buffer) -> int:
        calls.append(memoryview(data).nbytes)
        return real(data)

    monkeypatch.setattr(page_module, "payload_checksum", counting)
    return calls


def test_built_headers_hash_no_payload_until_something_needs_the_checksum(
    counted: list[int],
) -> None:
    pages = pages_of(3)
    sent = reserve_headers(pages)
    assert counted == []  # building and a same-host reserve hash nothing
    assert all(checksum_deferred(raw) and checked_payload_checksum(raw) == 0 for raw in sent)
    for raw, p in zip(sent, pages, strict=True):
        assert quick_check(raw, SCOPE) == (p.header.key, p.header.parent)
    assert pages[0].header.checksum_pending
    # reading the checksum (as a remote put's encode does) computes it, once
    assert pages[0].header.payload_checksum == xxhash.xxh3_64_intdigest(payload(0))
    assert pages[0].header.payload_checksum == xxhash.xxh3_64_intdigest(payload(0))
    assert counted == [PAGE] and not pages[0].header.checksum_pending
    # after that, the same-host form carries it too: nothing is left to the daemon
    assert reserve_headers(pages[:1]) == [pages[0].header.encode()]
    assert not checksum_deferred(pages[0].header.encode())
    # equality and hashing see the real checksum
    decoded = PageHeader.decode(pages[1].header.encode())
    assert decoded == pages[1].header and hash(decoded) == hash(pages[1].header)
    assert make_header(SCOPE, SCOPE.digest, list(range(3, 7)), payload(0)) == pages[0].header


def test_the_daemon_seals_a_deferred_header_into_the_header_the_writer_would_have_sent() -> None:
    (page,) = pages_of(1)
    deferred = page.header.encode_for_same_host()
    decoded = PageHeader.decode(deferred)
    assert decoded.checksum_deferred and decoded.payload_checksum == 0
    with pytest.raises(Corrupt, match="never computed"):
        decoded.verify_payload(payload(0))  # a deferred header vouches for no bytes
    sealed = seal_header(deferred, xxhash.xxh3_64_intdigest(payload(0)))
    assert sealed == page.header.encode()
    assert quick_check(sealed, SCOPE) is not None and not checksum_deferred(sealed)
    PageHeader.decode(sealed).verify_payload(payload(0))
    with pytest.raises(Corrupt):
        PageHeader.decode(sealed).verify_payload(payload(1))


def test_a_deferred_header_that_holds_a_checksum_or_unknown_flags_is_refused() -> None:
    (page,) = pages_of(1)
    sealed = page.header.encode()
    body = bytearray(sealed[:-8])
    body[6] = FLAG_CHECKSUM_DEFERRED  # flagged, but the checksum field is not zero
    forged = bytes(body) + xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little")
    assert quick_check(forged, SCOPE) is None
    with pytest.raises(Corrupt, match="holds one"):
        PageHeader.decode(forged)
    body[6] = 2  # an unknown flag
    unknown = bytes(body) + xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little")
    assert quick_check(unknown, SCOPE) is None
    with pytest.raises(Corrupt, match="reserved"):
        PageHeader.decode(unknown)


# ---- the fence of a same-host get --------------------------------------------------------


@pytest.fixture
def fenced() -> Iterator[SegmentMap]:
    """A segment of SLOTS page slots followed by one generation counter per slot."""
    name = f"strata-test-{uuid.uuid4().hex}"
    size = GENERATIONS_AT + 8 * SLOTS
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    segment = Segment(
        tier=Tier.DRAM,
        name=name,
        size_bytes=size,
        generations_offset=GENERATIONS_AT,
        generation_granule_bytes=GRANULE,
    )
    try:
        with open_segment(segment) as seg:
            yield seg
    finally:
        os.unlink(path)


def set_generation(seg: SegmentMap, slot: int, value: int) -> None:
    seg.view(GENERATIONS_AT + 8 * slot, 8)[:] = value.to_bytes(8, "little")


def reply_for(pages: list[Page], generations: list[int]) -> pb.AcquireResponse:
    return pb.AcquireResponse(
        lease_id=9,
        pages=[
            pb.AcquiredPage(
                present=True,
                tier=pb.TIER_DRAM,
                segment=0,
                offset=i * PAGE,
                length=PAGE,
                header=p.header.encode_for_same_host(),
                generation=generations[i],
            )
            for i, p in enumerate(pages)
        ],
    )


def test_a_slot_freed_before_the_get_copies_it_is_a_miss(fenced: SegmentMap) -> None:
    pages = pages_of(3)
    for i in range(3):
        fenced.view(i * PAGE, PAGE)[:] = payload(i)
        set_generation(fenced, i, 5)
    reply = reply_for(pages, [5, 5, 5])
    set_generation(fenced, 1, 6)  # freed (and perhaps reused) after the acquire named 5
    into = [memoryview(bytearray(PAGE)) for _ in pages]
    keys = [p.header.key for p in pages]
    headers, dropped = read_acquired(reply, [fenced], SCOPE, keys, into)
    assert [h is not None for h in headers] == [True, False, True] and dropped == 1
    assert bytes(into[0]) == payload(0) and bytes(into[2]) == payload(2)
    got = GetResult(headers).headers
    assert got[0] is not None and got[0].checksum_deferred and got[0] == pages[0].header


def test_a_slot_rewritten_while_the_get_copies_it_is_a_miss_never_wrong_bytes(
    fenced: SegmentMap, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon frees the slot mid-copy (the reader stalled past its lease) and another page
    is written into it: the copy holds the other page's bytes, and the fence makes it a miss."""
    pages = pages_of(2)
    for i in range(2):
        fenced.view(i * PAGE, PAGE)[:] = payload(i)
        set_generation(fenced, i, 1)
    real_view = SegmentMap.view

    def racing(self: SegmentMap, offset: int, length: int) -> memoryview:
        if offset == PAGE and length == PAGE:  # the get is about to copy page 1's slot
            set_generation(self, 1, 2)  # freed...
            real_view(self, PAGE, PAGE)[:] = payload(7)  # ...and taken by another page
        return real_view(self, offset, length)

    monkeypatch.setattr(SegmentMap, "view", racing)
    into = [memoryview(bytearray(PAGE)) for _ in pages]
    headers, dropped = read_acquired(
        reply_for(pages, [1, 1]), [fenced], SCOPE, [p.header.key for p in pages], into, verify=True
    )
    assert headers[0] is not None and headers[1] is None and dropped == 1
    assert bytes(into[1]) == payload(7)  # the bytes copied were another page's: not delivered
