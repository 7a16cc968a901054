"""API keys at the router: who is calling, which namespace their pages live in, and their limits.

The key file (TOML; `strata router --api-keys FILE`, `strata up --api-keys FILE`):

    [[keys]]
    key = "sk-acme-0123456789abcdef"  # the secret itself, or instead:
    # key_sha256 = "<hex SHA-256 of the key>"  (the file then holds no secret)
    tenant = "acme"                  # the tenant (admission shares and metrics use it)
    namespace = "acme"               # the namespace its pages live in (default: the tenant)
    slo_classes = ["standard"]       # SLO classes it may use (default: all)
    requests_per_s = 5               # request rate limit (default: none)
    request_burst = 10               # requests it may send at once (default: max(1, rate))
    tokens_per_s = 20000             # prompt + max_tokens per second (default: none)
    token_burst = 40000              # tokens at once (default: one second's worth)
    share = 1.0                      # the tenant's weight in admission shares (default 1)
    debug = false                    # may read /debug/* (default: no)

Several keys may name the same tenant (a tenant's keys share its namespace; each key has its own
buckets; the tenant's `share` is taken from its first key). The namespace is derived from the key
alone: whatever a request says about namespaces is ignored; its optional `cache_salt` isolates
further within the key's namespace (`core.tenancy.salted_namespace`).

Keys are kept only as SHA-256 digests and compared with `hmac.compare_digest` against every
entry (no early exit), so the time an answer takes does not depend on how much of a key matched.
The key is read from `Authorization: Bearer KEY` or `x-api-key: KEY`.

Without a key file the router is open: every request is the anonymous tenant "" in namespace "".
"""

from __future__ import annotations

import hashlib
import hmac
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.router.core.errors import ErrorKind
from engine.router.core.tenancy import Limits, RateLimiter, check_namespace, salted_namespace
from engine.router.http_errors import HttpError

_KEYS = {
    "key",
    "key_sha256",
    "tenant",
    "namespace",
    "slo_classes",
    "requests_per_s",
    "request_burst",
    "tokens_per_s",
    "token_burst",
    "share",
    "debug",
}
MIN_KEY_CHARS = 16


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One configured key (its digest only) and what it may do."""

    key_id: str  # "tenant/<n>": names the key in logs and buckets, never the secret
    digest: bytes  # SHA-256 of the key
    tenant: str
    namespace: str
    slo_classes: frozenset[str]  # empty: every class
    limits: Limits
    share: float = 1.0
    debug: bool = False


@dataclass(frozen=True, slots=True)
class Grant:
    """A request's caller: its key (None when the router is open) and its namespace."""

    key: ApiKey | None
    tenant: str
    namespace: str
    charged_tokens: int = 0


def digest_of(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def _float(entry: Mapping[str, object], name: str, default: float) -> float:
    value = entry.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _key(entry: Mapping[str, object], index: int) -> ApiKey:
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise ValueError(f"unknown settings {', '.join(unknown)}")
    tenant = entry.get("tenant")
    if not isinstance(tenant, str) or not tenant or "@" in tenant or not tenant.isprintable():
        raise ValueError("tenant must be a non-empty printable string without '@'")
    secret, hashed = entry.get("key"), entry.get("key_sha256")
    if (secret is None) == (hashed is None):
        raise ValueError("give exactly one of key and key_sha256")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < MIN_KEY_CHARS:
            raise ValueError(f"key must be a string of at least {MIN_KEY_CHARS} characters")
        digest = digest_of(secret)
    else:
        try:
            digest = bytes.fromhex(str(hashed))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError("key_sha256 must be 64 hex digits")
    namespace = entry.get("namespace", tenant)
    if not isinstance(namespace, str):
        raise ValueError("namespace must be a string")
    classes = entry.get("slo_classes", [])
    if not isinstance(classes, list) or not all(isinstance(c, str) and c for c in classes):
        raise ValueError("slo_classes must be a list of class names")
    debug = entry.get("debug", False)
    if not isinstance(debug, bool):
        raise ValueError("debug must be true or false")
    limits = Limits(
        requests_per_s=_float(entry, "requests_per_s", math.inf),
        tokens_per_s=_float(entry, "tokens_per_s", math.inf),
        request_burst=_float(entry, "request_burst", 0.0),
        token_burst=_float(entry, "token_burst", 0.0),
    )
    share = _float(entry, "share", 1.0)
    if not share > 0 or math.isinf(share):
        raise ValueError("share must be a positive number")
    return ApiKey(
        key_id=f"{tenant}/{index}",
        digest=digest,
        tenant=tenant,
        namespace=check_namespace(namespace),
        slo_classes=frozenset(classes),
        limits=limits,
        share=share,
        debug=debug,
    )


@dataclass(frozen=True, slots=True)
class KeyTable:
    keys: tuple[ApiKey, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("the key file lists no keys")
        digests = [k.digest for k in self.keys]
        if len(set(digests)) != len(digests):
            raise ValueError("the same key is listed twice")

    @classmethod
    def load(cls, path: str | Path, slo_classes: tuple[str, ...] = ()) -> KeyTable:
        """The keys of the TOML file at `path`; ValueError naming the entry at fault. With
        `slo_classes` given, every class a key names must be one of them."""
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"API key file {path}: {exc}") from None
        if set(data) - {"keys"}:
            raise ValueError(f"API key file {path}: only [[keys]] tables are allowed")
        entries = data.get("keys", [])
        if not isinstance(entries, list):
            raise ValueError(f"API key file {path}: keys must be [[keys]] tables")
        keys = []
        for index, entry in enumerate(entries):
            try:
                key = _key(entry, index)
                unknown = sorted(key.slo_classes - set(slo_classes)) if slo_classes else []
                if unknown:
                    raise ValueError(f"unknown SLO classes {', '.join(unknown)}")
            except ValueError as exc:
                raise ValueError(f"API key file {path}, key #{index + 1}: {exc}") from None
            keys.append(key)
        try:
            return cls(tuple(keys))
        except ValueError as exc:
            raise ValueError(f"API key file {path}: {exc}") from None

    def find(self, secret: str) -> ApiKey | None:
        """The entry of `secret`, compared in constant time against every entry."""
        presented = digest_of(secret)
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(presented, key.digest) and found is None:
                found = key
        return found

    def shares(self) -> dict[str, float]:
        """tenant -> admission share weight (a tenant's first key sets it)."""
        out: dict[str, float] = {}
        for key in self.keys:
            out.setdefault(key.tenant, key.share)
        return out


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request presents: `Authorization: Bearer KEY`, else `x-api-key`."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    if x_api_key and x_api_key.strip():
        return x_api_key.strip()
    return None


class Tenancy:
    """The router's gate: authenticate, check the class, charge the limits, name the namespace.

    `table` None: open (anonymous tenant, namespace "", no limits)."""

    def __init__(self, table: KeyTable | None) -> None:
        self.table = table
        self.limiter = RateLimiter()

    @property
    def enforced(self) -> bool:
        return self.table is not None

    def authenticate(self, authorization: str | None, x_api_key: str | None) -> Grant:
        """The caller's grant; HttpError 401 (invalid_api_key) for a missing or wrong key."""
        if self.table is None:
            return Grant(None, "", "")
        secret = presented_key(authorization, x_api_key)
        if secret is None:
            raise HttpError(
                ErrorKind.unauthorized,
                "no API key: send Authorization: Bearer KEY",
                headers={"WWW-Authenticate": "Bearer"},
            )
        key = self.table.find(secret)
        if key is None:
            raise HttpError(
                ErrorKind.unauthorized,
                "incorrect API key provided",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return Grant(key, key.tenant, key.namespace)

    def check_debug(self, grant: Grant) -> None:
        if grant.key is not None and not grant.key.debug:
            raise HttpError(ErrorKind.forbidden, "this API key may not read /debug endpoints")

    def admit(
        self, grant: Grant, slo_class: str, tokens: int, now: float, cache_salt: str | None
    ) -> Grant:
        """The grant for one request: its class allowed (403 otherwise), its limits charged
        (429 with Retry-After otherwise), its namespace salted."""
        key = grant.key
        namespace = salted_namespace(grant.namespace, cache_salt)
        if key is None:
            return Grant(None, grant.tenant, namespace)
        if key.slo_classes and slo_class not in key.slo_classes:
            allowed = ", ".join(sorted(key.slo_classes))
            raise HttpError(
                ErrorKind.forbidden,
                f"this API key may not use SLO class {slo_class!r} (allowed: {allowed})",
                param="slo_class",
            )
        limited = self.limiter.charge(key.key_id, key.limits, tokens, now)
        if limited is not None:
            if math.isinf(limited.retry_after_s):
                raise HttpError(ErrorKind.invalid_request, limited.detail, param="max_tokens")
            raise HttpError(
                ErrorKind.rate_limited,
                f"{limited.detail} for this API key",
                retry_after_s=limited.retry_after_s,
                headers={"x-strata-limited-by": limited.bucket},
            )
        return Grant(key, grant.tenant, namespace, charged_tokens=tokens)

    def refund(self, grant: Grant, *, requests: int, tokens: int, now: float) -> None:
        """Give back what a request was charged and did not use."""
        if grant.key is not None:
            self.limiter.refund(grant.key.key_id, requests, tokens, now)


def load_tenancy(path: str, slo_classes: tuple[str, ...]) -> Tenancy:
    """The gate for the key file at `path` ("" = open)."""
    return Tenancy(KeyTable.load(path, slo_classes) if path else None)
