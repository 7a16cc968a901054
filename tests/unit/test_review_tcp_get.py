"""A TCP get's answer that is not what was asked (client/transports/tcp_protocol.py `get_op`),
against a scripted peer: more entries than keys, a page bigger than its buffer, a page whose
header vouches for no bytes. Each is refused or a counted miss, and the connection stays in step
(every announced byte is read)."""

from __future__ import annotations

import pytest
from conftest import make_scope
from test_tcp_protocol import LAYOUT, pages, run

from client.contract.page import checksum_deferred
from client.transports.tcp_protocol import get_op
from client.transports.ucx_protocol import (
    KIND_MANIFEST,
    ManifestEntry,
    ProtocolError,
    encode_manifest,
    preamble,
)

pytestmark = pytest.mark.unit

SCOPE = make_scope(layout=LAYOUT)
PAGE = SCOPE.page_payload_bytes


def _get(keys: list[bytes], into: list[memoryview], reply: bytes, *, verify: bool = True):  # type: ignore[no-untyped-def]
    return run(get_op(b"r", SCOPE.digest, keys, into, verify=verify, max_page_bytes=1 << 20), reply)


def test_a_manifest_with_more_entries_than_keys_is_refused() -> None:
    ps = pages(2, seed=11)
    entries = [ManifestEntry(p.header.encode(), PAGE) for p in ps]
    into = [memoryview(bytearray(PAGE))]
    manifest = encode_manifest(entries)
    for aux in (1, 2):  # the count says one page (the meta holds two), or says two
        with pytest.raises(ProtocolError):
            _get([ps[0].header.key], into, preamble(KIND_MANIFEST, aux, len(manifest)) + manifest)


def test_a_page_bigger_than_its_buffer_is_a_counted_miss_and_its_bytes_are_read() -> None:
    ps = pages(2, seed=12)
    manifest = encode_manifest([ManifestEntry(p.header.encode(), PAGE) for p in ps])
    reply = preamble(KIND_MANIFEST, 2, len(manifest)) + manifest
    reply += bytes(ps[0].payload) + bytes(ps[1].payload)
    small = bytearray(PAGE // 2)
    into = [memoryview(small), memoryview(bytearray(PAGE))]
    out, _ = _get([p.header.key for p in ps], into, reply)  # `run` checks every byte is read
    assert (out.headers[0], out.corrupt) == (None, 1)
    assert out.headers[1] is not None and bytes(into[1]) == bytes(ps[1].payload)
    assert small == bytearray(PAGE // 2)  # nothing was written past what it holds, or into it


def test_a_header_that_leaves_its_checksum_to_the_daemon_verifies_nothing_remotely() -> None:
    (page,) = pages(1, seed=13)
    deferred = page.header.encode_for_same_host()
    assert checksum_deferred(deferred)
    manifest = encode_manifest([ManifestEntry(deferred, PAGE)])
    reply = preamble(KIND_MANIFEST, 1, len(manifest)) + manifest + bytes(page.payload)
    into = [memoryview(bytearray(PAGE))]
    out, _ = _get([page.header.key], into, reply)
    assert (out.headers, out.corrupt) == ((None,), 1)
