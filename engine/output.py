"""One request's produced tokens: the text they make, piece by piece, and when they end it.

Text is decoded incrementally (a piece is released once its bytes form whole characters), and
text that might be the start of a stop string is held back until it is clearly not one. What has
been released after token k is a function of the first k tokens alone, so a worker that resumes a
request replays the tokens produced so far (`replay`) and continues exactly where the previous
one left off.

The text of a stop token is never returned; nor is a stop string or anything after it. When a
request ends for another reason, everything held back is released with its last token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.requests import FinishReason
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class OutputText:
    """Tracks the produced tokens of one request. Not thread-safe.

    `limit` is how many tokens the request may produce in all (its max_tokens, cut to what the
    context has room for).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        *,
        limit: int,
        eos_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stop_strings = params.stop
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_ids)
        )
        self.limit = limit
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._text = ""  # decoded so far, in whole characters
        self._released = 0  # characters of _text already returned
        self._prefix = 0  # tokens [_prefix, _read) decode to the tail of _text
        self._read = 0

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._released]

    def replay(self, tokens: Iterable[int]) -> FinishReason | None:
        """Feed tokens produced earlier (by another worker) without returning their text; the
        finish reason if they already end the request (or there is no room for another)."""
        for token in tokens:
            if self.finish_reason is not None:
                break
            self.append(token)
        if self.finish_reason is None and len(self.tokens) >= self.limit:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason

    def append(self, token: int) -> tuple[str, FinishReason | None]:
        """Add a produced token; the text it releases and the finish reason if it ends the
        request. Raises RuntimeError after the request has finished."""
        if self.finish_reason is not None:
            raise RuntimeError("the request has finished")
        if token in self._stop_ids:
            self.tokens.append(token)
            self._read = self._prefix = len(self.tokens)  # its text is never decoded
            return self._finish(FinishReason.STOP)
        self.tokens.append(token)
        self._text += self._decode_new()
        start = self._released
        match = self._first_stop(start)
        if match is not None:
            self._released = match
            self.finish_reason = FinishReason.STOP
            return self._text[start:match], FinishReason.STOP
        self._released = max(start, len(self._text) - self._held_back())
        piece = self._text[start : self._released]
        if len(self.tokens) >= self.limit:
            rest, reason = self._finish(FinishReason.LENGTH)
            return piece + rest, reason
        return piece, None

    def _finish(self, reason: FinishReason) -> tuple[str, FinishReason]:
        """End the request, releasing everything held back; at LENGTH also the characters
        whose bytes are still incomplete (as replacement characters)."""
        if reason is FinishReason.LENGTH and self._read < len(self.tokens):
            done = self._tokenizer.decode(self.tokens[self._prefix : self._read])
            self._text += self._tokenizer.decode(self.tokens[self._prefix :])[len(done) :]
        piece = self._text[self._released :]
        self._released = len(self._text)
        self.finish_reason = reason
        return piece, reason

    def _decode_new(self) -> str:
        """Whole characters completed by the tokens since the last call ("" while a character's
        bytes are still incomplete)."""
        decode = self._tokenizer.decode
        done = decode(self.tokens[self._prefix : self._read])
        full = decode(self.tokens[self._prefix :])
        if len(full) <= len(done) or full.endswith(_INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return full[len(done) :]

    def _first_stop(self, start: int) -> int | None:
        """Where the earliest stop string begins at or after `start`, if any."""
        found = [i for s in self._stop_strings if (i := self._text.find(s, start)) >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a stop string could start with."""
        text = self._text
        longest = 0
        for s in self._stop_strings:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
