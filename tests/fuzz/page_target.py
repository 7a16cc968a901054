"""A coverage-guided (atheris / libFuzzer) target over the page codec.

    python tests/fuzz/page_target.py [libFuzzer flags] [CORPUS_DIR ...]
    strata fuzz [--seconds N | --runs N] [--corpus DIR]

Each input's first byte picks how the rest is read: as raw page bytes, or as raw header bytes
whose header checksum is recomputed first (an adversary can always do that: xxh3 is not keyed),
which lets the fuzzer reach the checks behind the checksum. Seeds (`write_seeds`) are valid
headers and pages of the target's scope, so mutations start from well-formed input.

A crash is any exception other than the codec's typed errors (Corrupt, InvalidArgument), or a
broken property: a header that validates must be byte-identical to the one `make_header` builds
for its parent and tokens, and `quick_check` must accept exactly what decode + validate accept.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
from pathlib import Path

import atheris
import xxhash

with atheris.instrument_imports(include=["client.contract.page", "client.contract.scope"]):
    from client.contract.errors import Corrupt, InvalidArgument
    from client.contract.page import (
        PageHeader,
        decode_page,
        encode_page,
        header_bytes_for,
        make_header,
        quick_check,
    )
    from client.contract.scope import KVLayout, Scope, chain_key

SCOPE = Scope(
    model_id="fuzz",
    weights_revision="w",
    tokenizer_fingerprint="t",
    kv_dtype="float16",
    layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=4),
)
HEADER_BYTES = header_bytes_for(SCOPE.layout.page_tokens)


def reseal(raw: bytes) -> bytes:
    if len(raw) <= 8:
        return raw
    body = raw[:-8]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def canonical(header: PageHeader) -> bytes:
    return PageHeader(
        scope_digest=SCOPE.digest,
        key=chain_key(header.parent, header.tokens),
        parent=header.parent,
        tokens=header.tokens,
        dtype=SCOPE.kv_dtype,
        layout=SCOPE.layout,
        payload_bytes=SCOPE.page_payload_bytes,
        payload_checksum=header.payload_checksum,
    ).encode()


SELF_TEST = os.environ.get("STRATA_FUZZ_SELF_TEST") == "1"  # plant a bug: the harness must see it


def check(data: bytes) -> None:
    if not data:
        return
    raw = reseal(data[1:]) if data[0] & 1 else data[1:]
    accepted = False
    try:
        header = PageHeader.decode(raw)
    except Corrupt:
        header = None
    if header is not None:
        try:
            header.validate_for(SCOPE)
            accepted = True
        except InvalidArgument:
            pass
        if accepted and SELF_TEST:
            raise AssertionError("self test: a valid header counts as a failure")
        if accepted and raw[: header.header_bytes] != canonical(header):
            raise AssertionError(f"a non-canonical header validated: {raw.hex()}")
    quick = quick_check(raw[:HEADER_BYTES], SCOPE)
    if (quick is not None) != accepted:
        raise AssertionError(f"quick_check {quick} disagrees with decode+validate: {raw.hex()}")
    with contextlib.suppress(Corrupt):
        decode_page(raw)


def write_seeds(folder: Path) -> None:
    """A few valid headers and pages of SCOPE (each prefixed by its mode byte)."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = bytes(range(SCOPE.page_payload_bytes))
    first = make_header(SCOPE, SCOPE.digest, [1, 2, 3, 4], payload)
    second = make_header(SCOPE, first.key, [5, 6, 7, 8], payload)
    for name, blob in {
        "header-raw": b"\x00" + first.encode(),
        "header-sealed": b"\x01" + second.encode(),
        "page-raw": b"\x00" + encode_page(first, payload),
    }.items():
        (folder / name).write_bytes(blob)


def main() -> None:
    args = list(sys.argv)
    for arg in args[1:]:
        if not arg.startswith("-"):
            write_seeds(Path(arg))
    atheris.Setup(args, check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
