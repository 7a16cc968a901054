"""`strata bench keys`: what the collision-resistant key schema costs, side by side in one run.

Times, for the same token ids: page keys of key schema 2 (BLAKE2b-128, what `client.page_keys`
computes) against schema 1's xxh3-128 over the same bytes, per page and for a whole chain, and
puts both next to building the page's header (the payload checksum over a real payload size), so
the key's share of what a put pays is visible. Prints a table and writes JSON.

    strata bench keys [--pages 512] [--page-tokens 16] [--payload-bytes 1MiB] [--json PATH]

What a row leaves out: nothing of the network or the store; these are CPU costs in the caller.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections.abc import Callable, Sequence

import xxhash

from client import KVLayout, Scope, make_header, page_keys


def _parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    low = text.strip().lower()
    for suffix, factor in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * factor)
    return int(low)


def _best_of(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls (the least disturbed by other work)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _xxh3_chain(digest: bytes, tokens: Sequence[int], page: int) -> list[bytes]:
    keys = []
    parent = digest
    for start in range(0, len(tokens) - page + 1, page):
        parent = xxhash.xxh3_128_digest(
            parent + struct.pack(f"<{page}I", *tokens[start : start + page])
        )
        keys.append(parent)
    return keys


def run(pages: int, page_tokens: int, payload_bytes: int, repeats: int) -> dict[str, float]:
    head_dim = 128
    kv_heads = 8
    layers = max(1, payload_bytes // (2 * page_tokens * kv_heads * head_dim * 2))
    scope = Scope(
        model_id="bench/keys",
        weights_revision="w",
        tokenizer_fingerprint="t",
        kv_dtype="float16",
        layout=KVLayout(layers, kv_heads, head_dim, page_tokens),
    )
    tokens = list(range(pages * page_tokens))
    payload = bytes(scope.page_payload_bytes)
    blake_s = _best_of(lambda: page_keys(scope, tokens), repeats)
    xxh3_s = _best_of(lambda: _xxh3_chain(scope.digest, tokens, page_tokens), repeats)
    first = tokens[:page_tokens]
    header_s = _best_of(lambda: make_header(scope, scope.digest, first, payload), repeats)
    return {
        "pages": pages,
        "page_tokens": page_tokens,
        "payload_bytes": scope.page_payload_bytes,
        "blake2b_chain_s": blake_s,
        "xxh3_chain_s": xxh3_s,
        "blake2b_per_key_us": blake_s / pages * 1e6,
        "xxh3_per_key_us": xxh3_s / pages * 1e6,
        "blake2b_over_xxh3_ratio": blake_s / xxh3_s,
        "header_build_us": header_s * 1e6,
        "key_share_of_header_build_ratio": (blake_s / pages) / header_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata bench keys", description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=512, help="pages in the chain (default 512)")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--payload-bytes", default="1MiB", help="payload size for the header row")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats; the fastest counts")
    p.add_argument("--json", help="write the results here")
    ns = p.parse_args(argv)
    if ns.pages < 1 or ns.page_tokens < 1 or ns.repeats < 1:
        print(
            "strata bench keys: --pages, --page-tokens and --repeats must be >= 1", file=sys.stderr
        )
        return 2
    r = run(ns.pages, ns.page_tokens, _parse_size(ns.payload_bytes), ns.repeats)
    print(f"page keys, {r['pages']} pages of {r['page_tokens']} tokens (fastest of {ns.repeats})")
    print(
        f"  BLAKE2b-128 (schema 2): {r['blake2b_per_key_us']:.2f} µs/key, "
        f"chain {r['blake2b_chain_s'] * 1e3:.3f} ms"
    )
    print(
        f"  xxh3-128 (schema 1):    {r['xxh3_per_key_us']:.2f} µs/key, "
        f"chain {r['xxh3_chain_s'] * 1e3:.3f} ms"
    )
    print(f"  ratio BLAKE2b / xxh3:   {r['blake2b_over_xxh3_ratio']:.2f}x")
    print(
        f"  header build ({r['payload_bytes']} B payload checksum): {r['header_build_us']:.1f} µs; "
        f"one key is {r['key_share_of_header_build_ratio']:.1%} of it"
    )
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(r, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
