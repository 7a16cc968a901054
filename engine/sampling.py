"""Per-request sampling: greedy, temperature, top-k, top-p, a seed; the stop conditions' values.

`SamplingParams` is checked when it is built and raises `SamplingError` (an `InvalidRequest`, so
a `ValueError`) naming the bad field. `Sampler` holds one request's params and seed;
`sample_tokens` draws the next token of every request of a batch at once, on tensors (one
argmax for the greedy rows; for the others temperature, top-k and top-p masks applied to all rows
together, then one inverse-CDF draw each). `Sampler.sample` is the same draw for one row.

Seeded draws are a function of (seed, step), not of how many draws came before: draw `i` (the
i-th produced token, 0 = the one prefill produces) takes its uniform number from a mix of the
two (splitmix64). So a request whose prefill and decode run on different workers, or whose
decode moves to another worker midway, or that shares its batch with other requests, draws
exactly what one worker would have drawn for it alone.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
DEFAULT_MAX_TOKENS = 16
_MASK64 = (1 << 64) - 1
_UNIT = 2.0**-53


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
    """The sampling state of one request: its params and its seed (without a seed in the params
    one is chosen at random here, once per request). Draws are pure functions of (seed, step)."""

    __slots__ = ("params", "seed")

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)

    def uniform(self, step: int) -> float:
        """The uniform number in [0, 1) of draw `step` (53 bits of its step seed)."""
        return (step_seed(self.seed, step) >> 11) * _UNIT

    def sample(self, logits: torch.Tensor, step: int) -> int:
        """The token of draw `step` from float logits `[vocab]`."""
        return sample_tokens(logits.reshape(1, -1), (self,), (step,))[0]


def sample_tokens(
    logits: torch.Tensor, samplers: Sequence[Sampler], steps: Sequence[int]
) -> list[int]:
    """The next token of each row of `logits` `[B, vocab]`: row b drawn by `samplers[b]` as its
    draw `steps[b]`. Greedy rows take the argmax (one call for the batch). The others are scaled
    by their temperatures and drawn by inverse CDF with their uniform numbers, all rows in the
    same tensor operations: over the vocabulary in its own order, or, for rows with a top-k or
    top-p, over it sorted, cut to the top-k and the top-p (a token is dropped when the tokens
    ranked above it reach top_p; the first always stays). A row's token depends on its logits,
    params, seed and step only, never on the other rows. Raises ValueError on mismatched
    lengths."""
    batch = logits.shape[0] if logits.dim() == 2 else -1
    if batch != len(samplers) or batch != len(steps):
        raise ValueError(
            f"logits {tuple(logits.shape)}, {len(samplers)} samplers, {len(steps)} steps"
        )
    chosen = logits.argmax(dim=-1).tolist()
    vocab = logits.shape[-1]
    plain: list[int] = []
    cut: list[int] = []
    for b, sampler in enumerate(samplers):
        p = sampler.params
        if not p.greedy:
            (cut if 0 < p.top_k < vocab or p.top_p < 1.0 else plain).append(b)
    for rows, ordered in ((plain, False), (cut, True)):
        if rows:
            drawn = _draw(
                logits, rows, [samplers[b] for b in rows], [steps[b] for b in rows], ordered
            )
            for b, token in zip(rows, drawn, strict=True):
                chosen[b] = token
    return chosen


def _draw(
    logits: torch.Tensor,
    rows: list[int],
    samplers: list[Sampler],
    steps: list[int],
    ordered: bool,
) -> list[int]:
    """Inverse-CDF draws of `rows` of `logits` (sorted and cut first when `ordered`)."""
    params = [s.params for s in samplers]
    device = logits.device
    scores = logits[rows].float()
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scores = scores / temps[:, None]
    vocab = scores.shape[-1]
    order = None
    if ordered:
        scores, order = torch.sort(scores, dim=-1, descending=True)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        rank = torch.arange(vocab, device=device)
        keep = rank[None, :] < torch.tensor(ks, device=device)[:, None]
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        above = torch.cumsum(probs, dim=-1) - probs
        tops = [p.top_p if p.top_p < 1.0 else math.inf for p in params]  # 1: keep every token
        limit = torch.tensor(tops, dtype=torch.float32, device=device)
        scores = scores.masked_fill(above >= limit[:, None], float("-inf"))
    cdf = torch.cumsum(torch.softmax(scores, dim=-1), dim=-1)
    total = cdf[:, -1:]
    u = torch.tensor(
        [s.uniform(step) for s, step in zip(samplers, steps, strict=True)],
        dtype=torch.float32,
        device=device,
    )[:, None]
    # below the total: rounding of u * total must not reach into a zero-probability tail
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    if order is not None:
        picked = order.gather(-1, picked)
    tokens: list[int] = picked[:, 0].tolist()
    return tokens
