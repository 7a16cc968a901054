"""The framing of the UCX data path (client/transports/ucx_protocol.py): pure, no ucxx needed."""

from __future__ import annotations

import pytest

from client.contract.errors import (
    CapacityExhausted,
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    StrataError,
    Unavailable,
)
from client.transports.ucx_protocol import (
    KIND_GET,
    PREAMBLE,
    ManifestEntry,
    ProtocolError,
    decode_error,
    decode_manifest,
    decode_put,
    encode_error,
    encode_manifest,
    encode_put,
    format_address,
    parse_address,
    parse_preamble,
    preamble,
)

pytestmark = pytest.mark.unit


def test_preamble_round_trip_and_refusals() -> None:
    raw = preamble(KIND_GET, 7, 1234)
    assert len(raw) == PREAMBLE.size == 16
    frame = parse_preamble(raw, 1 << 20)
    assert (frame.kind, frame.aux, frame.meta_bytes) == (KIND_GET, 7, 1234)
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_preamble(raw, 1000)
    with pytest.raises(ProtocolError, match="not a Strata"):
        parse_preamble(b"\0" * PREAMBLE.size, 1 << 20)


def test_put_request_round_trip() -> None:
    headers = [b"h" * 100, b"", b"x" * 3]
    begin, got = decode_put(encode_put(b"begin", headers), 3)
    assert (begin, got) == (b"begin", headers)
    meta = encode_put(b"begin", headers)
    with pytest.raises(InvalidArgument, match="truncated"):
        decode_put(meta[:-1], 3)
    with pytest.raises(InvalidArgument, match="trailing"):
        decode_put(meta, 2)


def test_manifest_round_trip() -> None:
    entries = [ManifestEntry(b"hdr", 1 << 20), ManifestEntry(b"", 0), ManifestEntry(b"h2", 5)]
    got = decode_manifest(encode_manifest(entries), 3)
    assert got == entries and [e.present for e in got] == [True, False, True]
    with pytest.raises(ProtocolError):
        decode_manifest(encode_manifest(entries), 2)
    with pytest.raises(ProtocolError):
        decode_manifest(encode_manifest(entries)[:-1], 3)


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgument("bad key"),
        CapacityExhausted("full", retry_after_s=1.25),
        Corrupt("checksum"),
        DeadlineExceeded("late"),
        Unavailable("closing"),
    ],
)
def test_errors_keep_their_type(error: StrataError) -> None:
    back = decode_error(*encode_error(error))
    assert type(back) is type(error) and str(back) == str(error)
    if isinstance(error, CapacityExhausted):
        assert isinstance(back, CapacityExhausted) and back.retry_after_s == 1.25


def test_unexpected_errors_are_internal() -> None:
    back = decode_error(*encode_error(RuntimeError("boom")))
    assert type(back) is StrataError and "boom" in str(back)


def test_addresses() -> None:
    assert parse_address(format_address("10.0.0.5", 4000)) == ("10.0.0.5", 4000)
    assert parse_address(format_address("::1", 4000)) == ("::1", 4000)
    assert parse_address("ucx://0.0.0.0:4000", "store-7") == ("store-7", 4000)
    for bad in ("lane:/x", "ucx://host", "ucx://host:0", "ucx://:12"):
        with pytest.raises(InvalidArgument):
            parse_address(bad)
