"""Prefix-tree generators, one per request class: each draw is a prompt (segments) and a length.

- tool_use: one system prompt, then one of `tools` tool prompts picked by Zipf(`zipf`) popularity,
  then a short unique question (the prefix tree: root → tool → leaf);
- agent: `sessions` concurrent sessions; each turn is the previous turn's prompt + its output +
  a new message, so every turn extends its session's context; a session that reaches its `turns`
  (or the context) ends and a new one takes its slot;
- doc_qa: a few long documents (uniform, or Zipf when `zipf` > 0), then a short question;
- chat: a unique prompt, nothing shared.
Each generator draws its fixed parts (system prompt, tools, documents) at construction from its own
seeded stream, and each request from the stream it is handed, so the requests are the same for
the same seed whatever the arrival process.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass
from typing import Protocol

from loadtests.workload.lengths import LengthDist
from loadtests.workload.requests import Segment
from loadtests.workload.spec import GeneratorSpec, ModelSpec, WorkloadError

_BLOCK_FLAG = 1 << 62  # generated blocks live above trace hash ids


def new_block(rng: random.Random) -> int:
    return rng.getrandbits(62) | _BLOCK_FLAG


@dataclass(frozen=True, slots=True)
class Draw:
    segments: tuple[Segment, ...]
    max_tokens: int
    session: str = ""
    turn: int = 0


class Generator(Protocol):
    def draw(self, rng: random.Random) -> Draw: ...


class Zipf:
    """Ranks 0..n-1 with P(k) ∝ 1/(k+1)^s (s = 0: uniform)."""

    def __init__(self, n: int, s: float) -> None:
        weights = [1.0 / (k + 1) ** s for k in range(n)]
        self._cum = list(itertools.accumulate(weights))

    def sample(self, rng: random.Random) -> int:
        return bisect.bisect_left(self._cum, rng.random() * self._cum[-1])


def _count(spec: GeneratorSpec, name: str, default: int) -> int:
    n = int(spec.number(name, default))
    if n < 1:
        raise WorkloadError(f"generator {spec.kind}: {name} must be >= 1, got {n}")
    return n


class ToolUse:
    def __init__(self, spec: GeneratorSpec, model: ModelSpec, rng: random.Random) -> None:
        self._scale = model.scale
        self._question = spec.length("question", LengthDist("uniform", 16, 96))
        self._output = spec.length("output", LengthDist("lognormal", 100, 0.5))
        system = spec.length("system", LengthDist.fixed(200))
        tool = spec.length("tool", LengthDist("lognormal", 1500, 0.4))
        self._system = Segment(new_block(rng), system.sample(rng, self._scale))
        n = _count(spec, "tools", 200)
        self._tools = [Segment(new_block(rng), tool.sample(rng, self._scale)) for _ in range(n)]
        self._zipf = Zipf(n, spec.number("zipf", 1.1))

    def draw(self, rng: random.Random) -> Draw:
        tool = self._tools[self._zipf.sample(rng)]
        question = Segment(new_block(rng), self._question.sample(rng, self._scale))
        return Draw((self._system, tool, question), self._output.sample(rng, self._scale))


class DocQa:
    def __init__(self, spec: GeneratorSpec, model: ModelSpec, rng: random.Random) -> None:
        self._scale = model.scale
        self._question = spec.length("question", LengthDist("uniform", 16, 64))
        self._output = spec.length("output", LengthDist("lognormal", 100, 0.5))
        doc = spec.length("document", LengthDist("lognormal", 8000, 0.3))
        n = _count(spec, "documents", 8)
        self._docs = [Segment(new_block(rng), doc.sample(rng, self._scale)) for _ in range(n)]
        self._zipf = Zipf(n, spec.number("zipf", 0.0))

    def draw(self, rng: random.Random) -> Draw:
        doc = self._docs[self._zipf.sample(rng)]
        question = Segment(new_block(rng), self._question.sample(rng, self._scale))
        return Draw((doc, question), self._output.sample(rng, self._scale))


class Chat:
    def __init__(self, spec: GeneratorSpec, model: ModelSpec, rng: random.Random) -> None:
        self._scale = model.scale
        self._prompt = spec.length("prompt", LengthDist("lognormal", 600, 1.0))
        self._output = spec.length("output", LengthDist("lognormal", 200, 0.8))

    def draw(self, rng: random.Random) -> Draw:
        prompt = Segment(new_block(rng), self._prompt.sample(rng, self._scale))
        return Draw((prompt,), self._output.sample(rng, self._scale))


@dataclass(slots=True)
class _Session:
    sid: str
    context: tuple[Segment, ...]
    turns_left: int
    turn: int = 0
    last_output: int = 0


class Agent:
    def __init__(self, spec: GeneratorSpec, model: ModelSpec, rng: random.Random) -> None:
        self._scale = model.scale
        self._limit = model.context_tokens
        self._first = spec.length("first", LengthDist("lognormal", 400, 0.5))
        self._turn = spec.length("turn", LengthDist("lognormal", 200, 0.6))
        self._output = spec.length("output", LengthDist("lognormal", 150, 0.5))
        self._turns = spec.length("turns", LengthDist("uniform", 3, 12))
        self._system = Segment(
            new_block(rng), spec.length("system", LengthDist.fixed(1000)).sample(rng, self._scale)
        )
        self._slots: list[_Session | None] = [None] * _count(spec, "sessions", 32)
        self._started = 0

    def _open(self, rng: random.Random) -> _Session:
        self._started += 1
        first = Segment(new_block(rng), self._first.sample(rng, self._scale))
        return _Session(f"s{self._started:06d}", (self._system, first), self._turns.sample(rng))

    def draw(self, rng: random.Random) -> Draw:
        slot = rng.randrange(len(self._slots))
        session = self._slots[slot]
        if session is not None:
            # The next turn: what the model said last time, then the new message.
            answer = Segment(new_block(rng), session.last_output)
            message = Segment(new_block(rng), self._turn.sample(rng, self._scale))
            extended = (*session.context, answer, message)
            if sum(s.length for s in extended) + session.last_output >= self._limit:
                session = None
            else:
                session.context = extended
                session.turn += 1
        if session is None:
            session = self._open(rng)
        out = self._output.sample(rng, self._scale)
        session.last_output = out
        session.turns_left -= 1
        self._slots[slot] = session if session.turns_left > 0 else None
        return Draw(session.context, out, session.sid, session.turn)


def build_generator(spec: GeneratorSpec, model: ModelSpec, rng: random.Random) -> Generator:
    """The generator of `spec.kind` (trace workloads are read by `trace.py` instead)."""
    kinds: dict[str, type[ToolUse] | type[DocQa] | type[Chat] | type[Agent]] = {
        "tool_use": ToolUse,
        "doc_qa": DocQa,
        "chat": Chat,
        "agent": Agent,
    }
    if spec.kind not in kinds:
        raise WorkloadError(f"generator {spec.kind!r} is not a seeded generator")
    return kinds[spec.kind](spec, model, rng)
