"""Per-request sampling: greedy, temperature, top-k, top-p, a seed; the stop conditions' values.

`SamplingParams` is checked when it is built and raises `SamplingError` (an `InvalidRequest`, so
a `ValueError`) naming the bad field. `Sampler` draws one token from a row of logits.

Seeded draws are a function of (seed, step), not of how many draws came before: step `i` (the
i-th produced token, 0 = the one prefill produces) re-seeds the request's `torch.Generator`
with a mix of the two. So a request whose prefill and decode run on different workers, or whose
decode moves to another worker midway, draws exactly what one worker would have drawn.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
DEFAULT_MAX_TOKENS = 16
_MASK64 = (1 << 64) - 1


class SamplingError(InvalidRequest):
    """A sampling value out of range (gRPC INVALID_ARGUMENT)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops. Frozen; validated on construction.

    temperature 0 is greedy (top_p, top_k and seed then change nothing). `max_tokens` counts
    every produced token, prefill's first one included. Generation stops after a token in
    `stop_token_ids` or (unless `ignore_eos`) one of the model's EOS ids, or when the produced
    text contains a string of `stop` (the text from it on is not returned).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, int | float) or isinstance(p, bool) or not 0 < p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MASK64):
            raise SamplingError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS or any(not _is_int(i) or i < 0 for i in ids):
            raise SamplingError(
                f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ints >= 0, got {ids!r:.200}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise SamplingError(
                    f"each stop string must be a non-empty str of at most {MAX_STOP_CHARS} "
                    f"characters, got {s!r:.80}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise SamplingError for a stop token id outside [0, vocab_size)."""
        bad = [i for i in self.stop_token_ids if i >= vocab_size]
        if bad:
            raise SamplingError(
                f"stop token ids {bad} are outside the vocabulary [0, {vocab_size})"
            )


def step_seed(seed: int, step: int) -> int:
    """The generator seed of draw `step` of a request seeded with `seed` (splitmix64 mixing)."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Draws the tokens of one request. Not thread-safe (one generator per request).

    Without a seed in the params one is chosen at random here, once per request.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._generator: torch.Generator | None = None

    def sample(self, logits: torch.Tensor, step: int) -> int:
        """The token of draw `step` from float logits `[vocab]`."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits.float() / p.temperature
        vocab = scores.shape[-1]
        if 0 < p.top_k < vocab:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # drop a token when the tokens ranked above it already reach top_p (the first stays)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            ordered = ordered.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
        probs = torch.softmax(scores, dim=-1)
        generator = self._generator_for(probs.device)
        generator.manual_seed(step_seed(self.seed, step))
        return int(torch.multinomial(probs, 1, generator=generator))

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        return self._generator
