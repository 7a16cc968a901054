"""Page keys of a prompt, computed from its segments without materializing tokens.

Page i covers tokens [i*P, (i+1)*P). Its key chains the previous page's key with the pieces of
content blocks it covers (block id, start, end), so two prompts get equal keys for a page exactly
when they have equal segments up to the end of that page — the same prefix property as the
store's hash chain over token ids (DESIGN §3). Only full pages get keys. The ints come from
Python's tuple hash of ints, which (unlike str hashing) is the same in every process.
"""

from __future__ import annotations

from loadtests.workload import Segment


def page_keys(segments: tuple[Segment, ...], page_tokens: int) -> tuple[int, ...]:
    keys: list[int] = []
    prev = 0
    pieces: list[tuple[int, int, int]] = []
    filled = 0
    for seg in segments:
        pos = 0
        while pos < seg.length:
            take = min(seg.length - pos, page_tokens - filled)
            pieces.append((seg.block, pos, pos + take))
            pos += take
            filled += take
            if filled == page_tokens:
                prev = hash((prev, *pieces))
                keys.append(prev)
                pieces.clear()
                filled = 0
    return tuple(keys)
