"""Principals and tokens: who may read, write and delete which namespaces (docs/security.md).

Pure: no gRPC here. Every transport (gRPC metadata, the same-host lane's HELLO, the TCP/UCX
first frame) hands the bearer token it got to `Authenticator.authenticate` once per call or
connection and asks the returned `Principal` about each request's namespace.

The tokens file (TOML, readable by the daemon's user only) names each principal and the sha256 of
its token; the token itself is never stored. A token is matched by hashing it and comparing that
hash with every principal's in constant time, so how long a refusal takes says nothing about
which hash was nearest.

Without a tokens file the daemon is OPEN: every call is allowed (the `OPEN` principal), and the
daemon refuses to listen on anything but loopback unless `server.allow_open` says otherwise.

A namespace is the `namespace` field of a request's scope; the daemon decodes the canonical
scope encoding each read and write carries, recomputes its digest and remembers digest ->
namespace (the digest is collision-resistant, so a digest names exactly one namespace), which is
what lets it filter Watch events and check deletes by key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import stat
import threading
import tomllib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from client.contract.errors import InvalidArgument, PermissionDenied, Unauthenticated
from client.contract.scope import Scope, base_namespace

log = logging.getLogger(__name__)

ALL = "*"
_SCOPE_CACHE = 4096  # distinct scope encodings decoded and kept
_NAMESPACE_MEMORY = 1 << 16  # digest -> namespace pairs remembered
_PRINCIPAL_KEYS = frozenset(
    {"name", "token_sha256", "read", "write", "delete", "operator", "trusted_local"}
)
BEARER = "bearer "


class AuthSettings(Protocol):
    """What `Authenticator.from_config` reads (kvstore.config.AuthConfig)."""

    @property
    def tokens_file(self) -> str: ...
    @property
    def shared_namespaces(self) -> tuple[str, ...]: ...


@dataclass(frozen=True, slots=True)
class Principal:
    """One caller's rights. `"*"` in `read` / `write` means every namespace.

    `shared` namespaces are readable by every principal and writable only by operators (the
    Authenticator fills it from `auth.shared_namespaces`). `delete` allows deleting (by scope or
    by key) in the namespaces the principal may write. Operators may also read every namespace's
    Watch events. `trusted_local` principals may use the same-host path. A right on a
    namespace covers its sub-namespaces, "<namespace>#..." (`client.contract.scope.base_namespace`: the
    router's cache_salt pages); a sub-namespace of a shared namespace is shared.
    """

    name: str
    read: frozenset[str] = frozenset()
    write: frozenset[str] = frozenset()
    delete: bool = False
    operator: bool = False
    trusted_local: bool = False
    shared: frozenset[str] = field(default=frozenset())

    def may_read(self, namespace: str) -> bool:
        """A right on a namespace covers its sub-namespaces (`client.contract.scope.base_namespace`)."""
        base = base_namespace(namespace)
        return (
            ALL in self.read
            or namespace in self.read
            or base in self.read
            or namespace in self.shared
            or base in self.shared
        )

    def is_shared(self, namespace: str) -> bool:
        """A shared namespace, or a sub-namespace of one."""
        return namespace in self.shared or base_namespace(namespace) in self.shared

    def may_write(self, namespace: str) -> bool:
        if self.is_shared(namespace):
            return self.operator
        return (
            ALL in self.write or namespace in self.write or base_namespace(namespace) in self.write
        )

    def check_read(self, namespace: str) -> None:
        """Raise PermissionDenied unless this principal may read `namespace`."""
        if not self.may_read(namespace):
            raise PermissionDenied(f"principal {self.name!r} may not read namespace {namespace!r}")

    def check_write(self, namespace: str) -> None:
        """Raise PermissionDenied unless this principal may write `namespace` (a shared one:
        operators only)."""
        if not self.may_write(namespace):
            why = " (a shared namespace: operators only)" if self.is_shared(namespace) else ""
            raise PermissionDenied(
                f"principal {self.name!r} may not write namespace {namespace!r}{why}"
            )

    def check_delete(self, namespace: str) -> None:
        """Raise PermissionDenied unless this principal may delete in `namespace`."""
        if not self.delete:
            raise PermissionDenied(f"principal {self.name!r} may not delete")
        self.check_write(namespace)

    def check_operator(self, what: str) -> None:
        """Raise PermissionDenied unless this principal is an operator."""
        if not self.operator:
            raise PermissionDenied(f"principal {self.name!r} is not an operator: {what}")


OPEN = Principal(
    name="open",
    read=frozenset({ALL}),
    write=frozenset({ALL}),
    delete=True,
    operator=True,
    trusted_local=True,
)
"""The principal of every call to an OPEN daemon (no tokens file): everything allowed."""


def hash_token(token: str) -> str:
    """The hex sha256 of a token: what the tokens file stores."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` metadata pair, or None."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if text[: len(BEARER)].lower() == BEARER:
            return text[len(BEARER) :].strip() or None
        return None
    return None


def is_loopback(host: str) -> bool:
    """Whether a listen address is loopback only (a wildcard or a name other than localhost
    is not)."""
    bare = host.strip().removeprefix("[").removesuffix("]").lower()
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


class Authenticator:
    """Checks tokens against the tokens file; decodes scopes to namespaces; counts refusals.

    Thread-safe. `open` is True when no tokens file is configured (every call is `OPEN`).
    """

    def __init__(
        self,
        principals: Mapping[bytes, Principal] | None = None,
        *,
        shared_namespaces: Iterable[str] = (),
    ) -> None:
        """`principals`: sha256 digest of the token (32 bytes) -> its principal; None = OPEN."""
        self.open = principals is None
        self.shared = frozenset(shared_namespaces)
        self._principals = tuple((principals or {}).items())
        self._lock = threading.Lock()
        self._scopes: OrderedDict[bytes, tuple[bytes, str]] = OrderedDict()
        self._namespaces: OrderedDict[bytes, str] = OrderedDict()
        self._denied: dict[str, int] = {}
        self._logged: set[str] = set()

    @classmethod
    def from_config(cls, auth_cfg: AuthSettings) -> Authenticator:
        """OPEN without `tokens_file`; else the principals of the file. Raises InvalidArgument
        for an unreadable, group/world-readable or malformed file."""
        shared = tuple(auth_cfg.shared_namespaces)
        if not auth_cfg.tokens_file:
            return cls(None, shared_namespaces=shared)
        return cls(load_tokens(auth_cfg.tokens_file, shared), shared_namespaces=shared)

    @property
    def principals(self) -> tuple[Principal, ...]:
        return tuple(p for _, p in self._principals)

    def authenticate(self, token: str | None) -> Principal:
        """The principal holding `token`: OPEN on an open daemon; Unauthenticated when the
        token is missing or matches no principal."""
        if self.open:
            return OPEN
        if not token:
            raise Unauthenticated("no token: send 'authorization: Bearer <token>'")
        digest = hashlib.sha256(token.encode("utf-8", "replace")).digest()
        found: Principal | None = None
        for known, principal in self._principals:  # every entry compared: no early exit
            if hmac.compare_digest(known, digest):
                found = principal
        if found is None:
            raise Unauthenticated("the token matches no principal")
        return found

    def scope_namespace(self, scope_bytes: bytes) -> tuple[bytes, str]:
        """(digest, namespace) of a canonical scope encoding (decoded once, then cached).
        Raises InvalidArgument for a malformed or non-canonical encoding."""
        with self._lock:
            hit = self._scopes.get(scope_bytes)
            if hit is not None:
                self._scopes.move_to_end(scope_bytes)
                return hit
        scope = Scope.decode(scope_bytes)
        pair = (scope.digest, scope.namespace)
        with self._lock:
            self._scopes[scope_bytes] = pair
            if len(self._scopes) > _SCOPE_CACHE:
                self._scopes.popitem(last=False)
            self._remember(*pair)
        return pair

    def remember(self, digest: bytes, namespace: str) -> None:
        """Record that `digest` is a scope of `namespace` (what `namespace_of` answers)."""
        with self._lock:
            self._remember(digest, namespace)

    def _remember(self, digest: bytes, namespace: str) -> None:
        self._namespaces[digest] = namespace
        self._namespaces.move_to_end(digest)
        if len(self._namespaces) > _NAMESPACE_MEMORY:
            self._namespaces.popitem(last=False)

    def namespace_of(self, digest: bytes) -> str | None:
        """The namespace of a scope digest seen in a put or read since start, else None."""
        with self._lock:
            return self._namespaces.get(digest)

    def check_listen(self, host: str, allow_open: bool) -> None:
        """An open daemon listens on loopback only unless `allow_open`: InvalidArgument for
        another `host`; logs that it runs open (a warning when off loopback)."""
        if not self.open:
            log.info("auth: %d principals; every call needs a token", len(self._principals))
            return
        if is_loopback(host):
            log.info("auth: open (no auth.tokens_file): every call is allowed; loopback only")
            return
        if not allow_open:
            raise InvalidArgument(
                f"refusing to listen on {host!r} without auth: an open daemon serves every "
                "caller that reaches it. Set auth.tokens_file (docs/security.md), listen on "
                "loopback, or set server.allow_open = true"
            )
        log.warning(
            "auth: OPEN on %s (server.allow_open): every caller that reaches it may read, "
            "write and delete every namespace",
            host,
        )

    def denied(self, principal: Principal | None, what: str) -> None:
        """Count a refusal (`strata_auth_denied_total{reason=what}`) and log it, once per
        principal (None: a caller without a valid token)."""
        name = principal.name if principal is not None else "<no valid token>"
        with self._lock:
            self._denied[what] = self._denied.get(what, 0) + 1
            first = name not in self._logged
            self._logged.add(name)
        if first:
            log.warning(
                "refused a call of %s (%s); further refusals of this principal are counted "
                "in strata_auth_denied_total, not logged",
                name,
                what,
            )

    def denied_counts(self) -> dict[str, int]:
        """Refusals so far, by reason."""
        with self._lock:
            return dict(self._denied)


def load_tokens(path: str | Path, shared: Iterable[str] = ()) -> dict[bytes, Principal]:
    """Parse a tokens file (see the module docstring) into token digest -> Principal.

    Refuses (InvalidArgument) a file that others than its owner may read, an unknown key, a
    malformed hash, and two principals with one name or one token."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise InvalidArgument(f"cannot read tokens file {path}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InvalidArgument(
            f"tokens file {path} is open to group or others (mode {stat.S_IMODE(mode):04o}): "
            f"run `chmod 600 {path}`"
        )
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise InvalidArgument(f"cannot read tokens file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"tokens file {path} is not valid TOML: {exc}") from None
    extra = set(data) - {"principal"}
    if extra:
        raise InvalidArgument(f"tokens file {path}: unknown keys {sorted(extra)}")
    entries = data.get("principal", [])
    if not isinstance(entries, list) or not entries:
        raise InvalidArgument(f"tokens file {path}: needs at least one [[principal]]")
    shared_set = frozenset(shared)
    out: dict[bytes, Principal] = {}
    names: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"tokens file {path}, principal {i + 1}"
        principal, digest = _principal(entry, where, shared_set)
        if principal.name in names:
            raise InvalidArgument(f"{where}: name {principal.name!r} used twice")
        if digest in out:
            raise InvalidArgument(f"{where}: the same token as {out[digest].name!r}")
        names.add(principal.name)
        out[digest] = principal
    return out


def _principal(entry: object, where: str, shared: frozenset[str]) -> tuple[Principal, bytes]:
    if not isinstance(entry, dict):
        raise InvalidArgument(f"{where}: must be a table")
    unknown = set(entry) - _PRINCIPAL_KEYS
    if unknown:
        raise InvalidArgument(f"{where}: unknown keys {sorted(unknown)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}: needs a non-empty name")
    hexdigest = entry.get("token_sha256")
    try:
        if not isinstance(hexdigest, str) or len(hexdigest) != 64:
            raise ValueError
        digest = bytes.fromhex(hexdigest)
    except ValueError:
        raise InvalidArgument(
            f"{where} ({name}): token_sha256 must be 64 hex digits (the sha256 of the token)"
        ) from None
    lists: dict[str, frozenset[str]] = {}
    for key in ("read", "write"):
        value = entry.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidArgument(f"{where} ({name}): {key} must be a list of namespaces")
        lists[key] = frozenset(value)
    flags: dict[str, bool] = {}
    for key in ("delete", "operator", "trusted_local"):
        value = entry.get(key, False)
        if not isinstance(value, bool):
            raise InvalidArgument(f"{where} ({name}): {key} must be true or false")
        flags[key] = value
    principal = Principal(
        name=name,
        read=lists["read"],
        write=lists["write"],
        delete=flags["delete"],
        operator=flags["operator"],
        trusted_local=flags["trusted_local"],
        shared=shared,
    )
    return principal, digest
