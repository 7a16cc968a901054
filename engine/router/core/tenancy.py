"""Per-key rate limits as token buckets, and the namespace a request's pages are keyed under.

A key has two buckets: requests (one per request) and tokens (prompt + max_tokens per request).
A request passes only when both buckets hold enough; then both are charged together, so a
request refused by one bucket costs nothing in the other. A refusal says how long until both
would hold enough (`retry_after_s`), computed from the refill rates. `refund` gives back what a
request was charged and did not use (it was refused by admission, or ended early), never past
the bucket's size.

Namespaces: a request's pages live under its key's namespace, never one the request names; a
`cache_salt` isolates further within it. The salt is hashed (BLAKE2b-128, hex), so the combined
namespace has a fixed shape, `"<namespace>#<32 hex>"`, and since a configured namespace may not
contain "#", two different (namespace, salt) pairs never give the same string.

Pure: time is the `now` argument (seconds, any monotonic origin); no clock, no I/O.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

SALT_SEPARATOR = "#"
MAX_SALT_CHARS = 256


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits: `*_per_s` refill rates (inf = unlimited), `*_burst` bucket sizes (the most
    that may be spent at once; defaults to one second of refill, at least one request and at least
    the rate)."""

    requests_per_s: float = math.inf
    tokens_per_s: float = math.inf
    request_burst: float = 0.0
    token_burst: float = 0.0

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 (or absent for no limit), got {value}")
        for name in ("request_burst", "token_burst"):
            value = getattr(self, name)
            if value < 0 or math.isnan(value) or math.isinf(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not self.request_burst and not math.isinf(self.requests_per_s):
            object.__setattr__(self, "request_burst", max(1.0, self.requests_per_s))
        if not self.token_burst and not math.isinf(self.tokens_per_s):
            object.__setattr__(self, "token_burst", self.tokens_per_s)


@dataclass(slots=True)
class Bucket:
    """A token bucket: `level` of `size`, refilled at `rate` per second since `at_s`."""

    rate: float
    size: float
    level: float = -1.0  # -1: full (set on first use)
    at_s: float = -math.inf

    def current(self, now: float) -> float:
        if math.isinf(self.rate):
            return math.inf
        if self.level < 0:
            return self.size
        if now <= self.at_s:
            return self.level
        return min(self.size, self.level + (now - self.at_s) * self.rate)

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0.0: now; inf: never, it exceeds the size)."""
        have = self.current(now)
        if have >= amount:
            return 0.0
        if amount > self.size:
            return math.inf
        return (amount - have) / self.rate

    def take(self, amount: float, now: float) -> None:
        if math.isinf(self.rate):
            return
        self.level = self.current(now) - amount
        self.at_s = max(now, self.at_s)

    def give(self, amount: float, now: float) -> None:
        if math.isinf(self.rate):
            return
        self.level = min(self.size, self.current(now) + amount)
        self.at_s = max(now, self.at_s)


@dataclass(frozen=True, slots=True)
class Limited:
    """A refusal by a key's limits: which bucket, and when to try again."""

    bucket: str  # "requests" or "tokens"
    retry_after_s: float  # inf: the request is larger than the bucket can ever hold
    detail: str


@dataclass(slots=True)
class RateLimiter:
    """The buckets of every key, by key id. Mutates only itself."""

    _buckets: dict[str, tuple[Bucket, Bucket]] = field(default_factory=dict)

    def _of(self, key_id: str, limits: Limits) -> tuple[Bucket, Bucket]:
        pair = self._buckets.get(key_id)
        if pair is None:
            pair = (
                Bucket(limits.requests_per_s, limits.request_burst),
                Bucket(limits.tokens_per_s, limits.token_burst),
            )
            self._buckets[key_id] = pair
        return pair

    def charge(self, key_id: str, limits: Limits, tokens: int, now: float) -> Limited | None:
        """Charge one request of `tokens` tokens to `key_id`, or say why not (nothing charged)."""
        requests, token_bucket = self._of(key_id, limits)
        wait_requests = requests.wait_s(1.0, now)
        wait_tokens = token_bucket.wait_s(float(tokens), now)
        if wait_requests > 0 or wait_tokens > 0:
            if wait_tokens >= wait_requests:
                if math.isinf(wait_tokens):
                    detail = (
                        f"the request needs {tokens} tokens (prompt + max_tokens); this key's "
                        f"token bucket holds at most {limits.token_burst:.0f}"
                    )
                else:
                    detail = f"past the token rate limit ({limits.tokens_per_s:g} tokens/s)"
                return Limited("tokens", max(wait_requests, wait_tokens), detail)
            detail = f"past the request rate limit ({limits.requests_per_s:g} requests/s)"
            return Limited("requests", max(wait_requests, wait_tokens), detail)
        requests.take(1.0, now)
        token_bucket.take(float(tokens), now)
        return None

    def refund(self, key_id: str, requests: int, tokens: int, now: float) -> None:
        """Give back `requests` requests and `tokens` tokens charged and not used."""
        pair = self._buckets.get(key_id)
        if pair is None:
            return
        if requests > 0:
            pair[0].give(float(requests), now)
        if tokens > 0:
            pair[1].give(float(tokens), now)


def check_namespace(namespace: str) -> str:
    """A configured namespace, checked: printable, no "#" (it separates the salt)."""
    if SALT_SEPARATOR in namespace:
        raise ValueError(f"namespace {namespace!r} may not contain {SALT_SEPARATOR!r}")
    if not namespace.isprintable():
        raise ValueError(f"namespace {namespace!r} must be printable")
    return namespace


def salted_namespace(namespace: str, cache_salt: str | None) -> str:
    """The namespace a request's pages live under: its key's namespace, then its salt (hashed)."""
    if not cache_salt:
        return namespace
    digest = hashlib.blake2b(
        cache_salt.encode("utf-8", "surrogatepass"), digest_size=16, person=b"strata-salt-v1"
    ).hexdigest()
    return f"{namespace}{SALT_SEPARATOR}{digest}"
