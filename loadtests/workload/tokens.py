"""Token ids of content blocks and prompts: a counter-mode BLAKE2b stream per block.

`block_token_ids(block, length, vocab_size, low)` is a pure function: token j of block b is read
from BLAKE2b(b, j // 32), so any prefix of a block is the same tokens whatever length is asked
for, and the ids are the same on every machine and Python version. Ids fall in
[low, vocab_size) so special tokens (BOS, EOS, PAD at the bottom of the vocabulary) never appear.
"""

from __future__ import annotations

import functools
import hashlib
import struct

from loadtests.workload.requests import Request
from loadtests.workload.spec import ModelSpec

_PER_DIGEST = 32  # 64 bytes of digest → 32 uint16 values
_UNPACK = struct.Struct("<32H")


@functools.lru_cache(maxsize=4096)
def _block(block: int, chunks: int, vocab_size: int, low: int) -> tuple[int, ...]:
    span = vocab_size - low
    out: list[int] = []
    for c in range(chunks):
        digest = hashlib.blake2b(struct.pack("<QQ", block, c), digest_size=64).digest()
        out.extend(low + v % span for v in _UNPACK.unpack(digest))
    return tuple(out)


def block_token_ids(block: int, length: int, vocab_size: int, low: int = 3) -> tuple[int, ...]:
    """The first `length` token ids of content block `block`."""
    if vocab_size <= low:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids above {low}")
    chunks = -(-length // _PER_DIGEST)
    # Round the cached size up to a power of two so prefixes of one block share an entry.
    cached = 1 << max(0, (chunks - 1).bit_length())
    return _block(block, cached, vocab_size, low)[:length]


def request_token_ids(request: Request, model: ModelSpec) -> list[int]:
    """The prompt of `request` as token ids in `model`'s vocabulary."""
    ids: list[int] = []
    for seg in request.segments:
        ids.extend(block_token_ids(seg.block, seg.length, model.vocab_size, model.token_low))
    return ids
