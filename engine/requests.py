"""The requests the engine workers take and the results they give (the errors are in
`engine.errors`, re-exported here)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from client import Tier
from engine.errors import EngineStopping, InvalidRequest
from engine.sampling import SamplingParams

__all__ = [
    "DecodeRequest",
    "DecodeResult",
    "DecodeStats",
    "EngineStopping",
    "FinishReason",
    "InvalidRequest",
    "PrefillResult",
    "PrefillTimings",
    "TierTokens",
    "TokenEvent",
    "validate_prompt",
]


class FinishReason(enum.StrEnum):
    """Why a request ended: a stop token, id or string; its token or context limit; or it was
    cancelled (the caller went away, or the worker stopped before it could finish)."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


def validate_prompt(token_ids: Sequence[int], *, vocab_size: int, max_context: int) -> list[int]:
    """The prompt as a list of ints; InvalidRequest if it is empty, has an id outside the
    vocabulary, or leaves no room in the context for one produced token."""
    ids = list(token_ids)
    if not ids:
        raise InvalidRequest("the prompt is empty")
    if len(ids) >= max_context:
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens; the context holds {max_context} "
            "(the prompt must leave room for at least one produced token)"
        )
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    return ids


@dataclass(frozen=True, slots=True)
class TierTokens:
    """Prompt tokens served from the store, by the fastest tier that held each page."""

    gpu: int = 0
    dram: int = 0
    ssd: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.dram + self.ssd

    @classmethod
    def of_pages(cls, tiers: Sequence[Tier], page_tokens: int) -> TierTokens:
        """Tokens of full pages found in `tiers` (one entry per page)."""
        return cls(
            gpu=page_tokens * sum(1 for t in tiers if t is Tier.GPU),
            dram=page_tokens * sum(1 for t in tiers if t is Tier.DRAM),
            ssd=page_tokens * sum(1 for t in tiers if t is Tier.SSD),
        )


@dataclass(frozen=True, slots=True)
class PrefillTimings:
    """Seconds spent in each phase of one prefill (wall clock; device work is synchronised)."""

    queue_s: float = 0.0
    lookup_s: float = 0.0
    pull_s: float = 0.0
    compute_s: float = 0.0
    sample_s: float = 0.0
    publish_wait_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill gives back: the first token, the prompt's page keys, and how it went.

    `finish_reason` is None when the request goes on to a decode worker, else STOP or LENGTH
    (the first token already ends it). `published_pages` counts pages this prefill stored in
    the store by the time it returned (publishing may still be going on when the worker does
    not wait for it).
    """

    request_id: str
    first_token: int
    first_text: str
    finish_reason: FinishReason | None
    prompt_token_ids: tuple[int, ...]
    page_keys: tuple[bytes, ...]
    hit_tokens: TierTokens
    computed_tokens: int
    published_pages: int
    rejected_pages: int
    timings: PrefillTimings

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Continue a request: its prompt and the tokens produced so far (prefill's first token, or
    everything an earlier decode worker streamed before it went away). `sampling.max_tokens`
    counts `output_token_ids` too. An empty `output_token_ids` makes the worker produce the
    first token itself (the co-located role)."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    namespace: str = ""
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class DecodeStats:
    """How a decode request was served: store hits, recomputation, publishing, waiting."""

    hit_tokens: TierTokens = TierTokens()
    computed_tokens: int = 0
    published_pages: int = 0
    rejected_pages: int = 0
    queue_s: float = 0.0
    pull_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step of a decode stream. `token_id` is None only on a last event that carries no
    token (a request that was already finished, or was cancelled); `finish_reason` and `stats`
    are set on the last event only. `time_s` is `time.monotonic()` when the token was sampled."""

    index: int
    token_id: int | None
    text: str
    finish_reason: FinishReason | None = None
    stats: DecodeStats | None = None
    time_s: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """A whole decode stream, collected: the new tokens (not those the request came with)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    stats: DecodeStats
    token_times_s: tuple[float, ...]
