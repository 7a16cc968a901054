"""The request a workload produces: when it is due, its class, its prompt as segments, its length.

A `Segment` names a content block (`block`, a 63-bit id) and how many of its first tokens the
prompt takes. Block contents are fixed pseudo-random token ids (`tokens.block_token_ids`), so two
prompts that start with the same segments start with the same tokens, and a simulator can key
pages from the segments without materializing tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Segment:
    block: int
    length: int


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload (immutable; `arrival_s` counts from the run's start)."""

    index: int
    request_id: str
    arrival_s: float
    slo_class: str
    segments: tuple[Segment, ...]
    max_tokens: int
    session: str = ""  # agent session id ("" when the request belongs to none)
    turn: int = 0
    prompt_tokens: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", sum(s.length for s in self.segments))

    def to_json(self) -> dict[str, object]:
        return {
            "index": self.index,
            "request_id": self.request_id,
            "arrival_s": round(self.arrival_s, 9),
            "slo_class": self.slo_class,
            "segments": [[s.block, s.length] for s in self.segments],
            "max_tokens": self.max_tokens,
            "session": self.session,
            "turn": self.turn,
        }


def truncate_segments(segments: tuple[Segment, ...], limit: int) -> tuple[Segment, ...]:
    """The longest prefix of `segments` of at most `limit` tokens (the last one cut short)."""
    out: list[Segment] = []
    left = limit
    for seg in segments:
        if left <= 0:
            break
        take = min(seg.length, left)
        out.append(seg if take == seg.length else Segment(seg.block, take))
        left -= take
    return tuple(out)
