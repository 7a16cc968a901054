"""Striping: one large remote batch split over parallel connections of the TCP data path.

One Python TCP stream on loopback tops out near 2 GB/s: the kernel's copy on each end is the
limit, and the socket calls release the GIL. So a batch whose payloads reach `min_bytes` is cut
into `stripes` contiguous sub-batches of about equal bytes (pages whole), each sent as its own
ordinary request on a connection of its own, at the same time (a `Together` step,
client/core/steps.py); the pages' results are merged back in order (client/core/get.py, put.py).

Pure: no I/O. `Striping` is part of a client's call settings; `STRIPES_ENV` and
`STRIPE_BYTES_ENV` give the defaults of a client made without them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from client.contract.errors import InvalidArgument
from client.contract.scope import Scope
from client.contract.types import Page

DEFAULT_STRIPES = 2  # four measured no better than two on a 2-core host (docs/benchmarks.md)
DEFAULT_STRIPE_MIN_BYTES = 8 << 20
MAX_STRIPES = 16
# A put whose later stripe follows more earlier pages than this, or needs more token ids of
# prefixes, goes whole (the paths would cost more than the stripes gain; the daemon takes at
# most 4 MiB of prefixes, kvstore/chain.py MAX_PREFIX_BYTES).
MAX_STRIPE_PARENTS = 64
MAX_STRIPE_PREFIX_TOKENS = 1 << 18
STRIPES_ENV = "STRATA_STORE_TCP_STRIPES"
STRIPE_BYTES_ENV = "STRATA_STORE_TCP_STRIPE_BYTES"

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_SIZE = re.compile(r"\s*(\d+)\s*([a-z]*)\s*")


@dataclass(frozen=True, slots=True)
class Striping:
    """How a client splits a large batch on the TCP data path: into `stripes` sub-batches (1 =
    never) once its payloads reach `min_bytes`."""

    stripes: int = 1
    min_bytes: int = DEFAULT_STRIPE_MIN_BYTES

    def __post_init__(self) -> None:
        if not 1 <= self.stripes <= MAX_STRIPES:
            raise InvalidArgument(f"tcp_stripes must be 1..{MAX_STRIPES}, not {self.stripes}")
        if self.min_bytes < 1:
            raise InvalidArgument(f"tcp_stripe_min_bytes must be >= 1, not {self.min_bytes}")


NO_STRIPING = Striping()
"""Every batch whole (the striping of call settings that name none)."""


def parse_bytes(text: str) -> int:
    """A size as written in the environment: "8388608", "8MiB", "512KiB"; InvalidArgument."""
    match = _SIZE.fullmatch(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise InvalidArgument(f"not a size: {text!r} (write e.g. 8MiB)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def resolve_striping(
    stripes: int | None, min_bytes: int | None, environ: Mapping[str, str] = os.environ
) -> Striping:
    """A client's striping: each option as given, else its environment variable, else the
    default (`DEFAULT_STRIPES` from `DEFAULT_STRIPE_MIN_BYTES`). InvalidArgument for a bad
    value."""
    if stripes is None:
        raw = environ.get(STRIPES_ENV, "").strip()
        try:
            stripes = int(raw) if raw else DEFAULT_STRIPES
        except ValueError:
            raise InvalidArgument(f"{STRIPES_ENV}={raw!r} is not a whole number") from None
    if min_bytes is None:
        raw = environ.get(STRIPE_BYTES_ENV, "").strip()
        min_bytes = parse_bytes(raw) if raw else DEFAULT_STRIPE_MIN_BYTES
    return Striping(stripes, min_bytes)


def stripe_ranges(sizes: Sequence[int], striping: Striping) -> list[range] | None:
    """The stripes of a batch of pages of `sizes` payload bytes: up to `striping.stripes`
    contiguous, non-empty ranges covering it, cut where the running byte count passes each
    equal share; None when the batch goes whole (striping off, one page, under `min_bytes`)."""
    count = min(striping.stripes, len(sizes))
    total = sum(sizes)
    if count < 2 or total < striping.min_bytes:
        return None
    ranges: list[range] = []
    start, running = 0, 0
    for i, size in enumerate(sizes):
        running += size
        cut = len(ranges) + 1
        # close this stripe once it holds its share, or when the pages left are one a stripe
        if running * count >= total * cut or len(sizes) - (i + 1) == count - cut:
            ranges.append(range(start, i + 1))
            start = i + 1
            if len(ranges) == count - 1:
                break
    ranges.append(range(start, len(sizes)))
    return ranges


def stripe_chain_prefixes(
    scope: Scope, pages: Sequence[Page], ranges: Sequence[range], prefix_tokens: Sequence[int]
) -> list[list[list[int]]] | None:
    """For each stripe of a batch of a put (`ranges` of the call's `pages`), the chain prefixes
    (kvstore/chain.py: token ids from the scope digest on) that let the daemon verify it when
    it arrives before the stripes ahead of it: for every page of an earlier stripe that a page
    of this one follows, the token ids of the path from a root to that page (through pages of
    the call, earlier batches included). A root is the scope digest,
    or, given `prefix_tokens` (the prompt's pages before `pages[0]`), the parent of `pages[0]`.
    None when such a page's path leads to a parent only the node knows (no prefix can vouch
    for it), or the paths pass `MAX_STRIPE_PARENTS` pages or `MAX_STRIPE_PREFIX_TOKENS` token
    ids: then the put goes whole. Pure."""
    index: dict[bytes, int] = {}
    for i, page in enumerate(pages):
        index.setdefault(page.header.key, i)
    stripe_of = [-1] * len(pages)  # pages outside `ranges` (an earlier batch) are stored by now
    for k, r in enumerate(ranges):
        for i in r:
            stripe_of[i] = k
    out: list[list[list[int]]] = []
    for k, r in enumerate(ranges):
        needed = sorted(
            {
                j
                for i in r
                if (j := index.get(pages[i].header.parent, -1)) >= 0 and 0 <= stripe_of[j] < k
            }
        )
        if len(needed) > MAX_STRIPE_PARENTS:
            return None
        prefixes: list[list[int]] = []
        for j in needed:
            path = _path_to(scope, pages, index, j, prefix_tokens)
            if path is None:
                return None
            prefixes.append(path)
        kept = _deepest(prefixes)
        if sum(map(len, kept)) > MAX_STRIPE_PREFIX_TOKENS:
            return None
        out.append(kept)
    return out


def _path_to(
    scope: Scope,
    pages: Sequence[Page],
    index: dict[bytes, int],
    j: int,
    prefix_tokens: Sequence[int],
) -> list[int] | None:
    """The token ids from a root through page j (see `stripe_chain_prefixes`), or None."""
    chain = [j]
    for _ in range(len(pages)):  # a walk back through earlier pages of the call
        parent = pages[chain[-1]].header.parent
        if parent == scope.digest:
            base: Sequence[int] = ()
            break
        up = index.get(parent, -1)
        if 0 <= up < chain[-1]:
            chain.append(up)
            continue
        if prefix_tokens and parent == pages[0].header.parent:
            base = prefix_tokens
            break
        return None
    else:
        return None
    path = list(base)
    for i in reversed(chain):
        path.extend(pages[i].header.tokens)
    return path


def _deepest(prefixes: list[list[int]]) -> list[list[int]]:
    """`prefixes` without those another one starts with (every key a prefix chains to is
    vouched for, so a path's own start adds nothing)."""
    return [
        p
        for n, p in enumerate(prefixes)
        if not any(
            m != n and len(q) >= len(p) and q[: len(p)] == p and (len(q) > len(p) or m < n)
            for m, q in enumerate(prefixes)
        )
    ]


def first_failure(outcomes: Sequence[object], ranges: Sequence[range]) -> BaseException | None:
    """The error of the first stripe that failed with one (`outcomes` as a `Together` step
    sends them back, `ranges` the stripes' pages within the call), noted with the pages it
    covered; None when none did. The other stripes ran to their end: a put's pages in them are
    stored, as after a failed batch of an unstriped call."""
    for k, (outcome, r) in enumerate(zip(outcomes, ranges, strict=True)):
        if isinstance(outcome, BaseException):
            outcome.add_note(
                f"stripe {k + 1} of {len(ranges)} (pages {r.start}..{r.stop - 1} of the call) "
                "failed; the other stripes ran to their end"
            )
            return outcome
    return None
