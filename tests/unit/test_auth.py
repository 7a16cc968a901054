"""kvstore/auth.py without a daemon: the tokens file, principals' rights, scope decoding, the
refusal counter, the loopback rule of an open daemon; and the SDK's half of the token."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest

from client.contract.errors import InvalidArgument, PermissionDenied, Unauthenticated
from client.contract.scope import SUB_NAMESPACE_SEPARATOR, KVLayout, Scope, base_namespace
from client.transports._wire import (
    STORE_METHODS,
    auth_metadata,
    error_from_status,
    resolve_token,
    with_token,
)
from engine.router.core.tenancy import SALT_SEPARATOR, salted_namespace
from kvstore.auth import (
    OPEN,
    Authenticator,
    Principal,
    bearer_token,
    hash_token,
    is_loopback,
    load_tokens,
    new_token,
)
from kvstore.config import AuthConfig, load_config

pytestmark = pytest.mark.unit

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16)


def _scope(namespace: str) -> Scope:
    return Scope("m", "w", "t", "float16", LAYOUT, namespace=namespace)


def _write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _entry(name: str, token: str, extra: str = "") -> str:
    return f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{hash_token(token)}"\n{extra}\n'


def test_hash_token_is_the_hex_sha256() -> None:
    assert hash_token("abc") == ("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    a, b = new_token(), new_token()
    assert a != b and len(a) >= 40


def test_a_tokens_file_maps_tokens_to_principals(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.toml",
        _entry("a", "tok-a", 'read = ["x", "y"]\nwrite = ["x"]\ndelete = true')
        + _entry("ops", "tok-ops", 'read = ["*"]\nwrite = ["*"]\noperator = true'),
    )
    auth = Authenticator.from_config(AuthConfig(tokens_file=str(path), shared_namespaces=("s",)))
    assert not auth.open
    a = auth.authenticate("tok-a")
    assert a == Principal(
        "a", frozenset({"x", "y"}), frozenset({"x"}), delete=True, shared=frozenset({"s"})
    )
    assert auth.authenticate("tok-ops").operator
    for bad in (None, "", "tok-b", "tok-a "):
        with pytest.raises(Unauthenticated):
            auth.authenticate(bad)


def test_an_open_authenticator_lets_everything_through() -> None:
    auth = Authenticator.from_config(AuthConfig())
    assert auth.open
    assert auth.authenticate(None) is OPEN and auth.authenticate("anything") is OPEN
    for ns in ("", "a", "shared"):
        OPEN.check_read(ns)
        OPEN.check_write(ns)
        OPEN.check_delete(ns)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o700 | 0o010])
def test_a_tokens_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = _write(tmp_path / "t.toml", _entry("a", "tok"), mode)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        load_tokens(path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "at least one"),
        ("[[principal]]\nname = 'a'\n", "token_sha256"),
        ("[[principal]]\nname = 'a'\ntoken_sha256 = 'abc'\n", "64 hex"),
        (_entry("a", "t", "colour = 'red'"), "unknown keys"),
        (_entry("a", "t", "read = 'x'"), "list of namespaces"),
        (_entry("a", "t", "delete = 'yes'"), "true or false"),
        (_entry("a", "t") + _entry("a", "u"), "used twice"),
        (_entry("a", "t") + _entry("b", "t"), "same token"),
        ("[[principal]\n", "not valid TOML"),
        ("other = 1\n" + _entry("a", "t"), "unknown keys"),
    ],
)
def test_a_malformed_tokens_file_is_refused(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        load_tokens(_write(tmp_path / "t.toml", text))


def test_a_missing_tokens_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_tokens(tmp_path / "absent.toml")


def test_rights_by_namespace() -> None:
    shared = frozenset({"pub"})
    tenant = Principal("t", frozenset({"a"}), frozenset({"a"}), shared=shared)
    deleter = Principal("d", frozenset({"a"}), frozenset({"a"}), delete=True, shared=shared)
    reader = Principal("r", frozenset({"*"}), frozenset(), shared=shared)
    ops = Principal("o", frozenset({"*"}), frozenset({"*"}), True, True, shared=shared)
    tenant.check_read("a")
    tenant.check_read("pub")  # shared: readable by all
    tenant.check_write("a")
    with pytest.raises(PermissionDenied, match="may not read namespace 'b'"):
        tenant.check_read("b")
    with pytest.raises(PermissionDenied, match="operators only"):
        tenant.check_write("pub")
    with pytest.raises(PermissionDenied, match="may not delete"):
        tenant.check_delete("a")
    deleter.check_delete("a")
    with pytest.raises(PermissionDenied):
        deleter.check_delete("b")
    with pytest.raises(PermissionDenied):
        deleter.check_delete("pub")
    reader.check_read("anything")
    with pytest.raises(PermissionDenied):
        reader.check_write("anything")
    ops.check_write("pub")
    ops.check_delete("pub")
    with pytest.raises(PermissionDenied):
        tenant.check_operator("watch everything")
    ops.check_operator("watch everything")
    # "*" in write never covers a shared namespace for a non-operator
    writer = Principal("w", frozenset(), frozenset({"*"}), shared=shared)
    with pytest.raises(PermissionDenied):
        writer.check_write("pub")


def test_rights_on_a_namespace_cover_its_sub_namespaces() -> None:
    """The router keys a request with a cache_salt under "<namespace>#<salt digest>": the
    tenant's engines hold rights on "<namespace>", which must cover it (else every salted
    request's store calls were PERMISSION_DENIED: no cache), and a shared namespace's
    sub-namespaces stay operators-only."""
    shared = frozenset({"pub"})
    tenant = Principal("t", frozenset({"a"}), frozenset({"a"}), delete=True, shared=shared)
    ops = Principal("o", frozenset(), frozenset(), operator=True, shared=shared)
    salted = salted_namespace("a", "user-1")
    assert salted.startswith("a" + SUB_NAMESPACE_SEPARATOR) and base_namespace(salted) == "a"
    assert SALT_SEPARATOR == SUB_NAMESPACE_SEPARATOR  # the router's and the store's agree
    for namespace in (salted, "a#", "a#x#y"):
        tenant.check_read(namespace)
        tenant.check_write(namespace)
        tenant.check_delete(namespace)
    for other in ("ab", "b#a", "#a", "", "b"):  # neither a nor one of its sub-namespaces
        assert not tenant.may_read(other) and not tenant.may_write(other), other
    tenant.check_read("pub#x")  # shared ones are readable by all, sub-namespaces too
    with pytest.raises(PermissionDenied, match="operators only"):
        tenant.check_write("pub#x")
    exact = Principal("e", frozenset(), frozenset({"pub#x"}), shared=shared)
    with pytest.raises(PermissionDenied, match="operators only"):
        exact.check_write("pub#x")  # naming a shared namespace's sub-namespace does not help
    ops.check_write("pub#x")


def test_scope_namespace_decodes_once_and_remembers_the_digest() -> None:
    auth = Authenticator(None)
    scope = _scope("tenant-a")
    assert auth.namespace_of(scope.digest) is None
    assert auth.scope_namespace(scope.encode()) == (scope.digest, "tenant-a")
    assert auth.namespace_of(scope.digest) == "tenant-a"
    assert auth.scope_namespace(scope.encode()) == (scope.digest, "tenant-a")  # cached
    for bad in (b"", b"garbage", scope.encode()[:-1], scope.encode() + b"\x00"):
        with pytest.raises(InvalidArgument):
            auth.scope_namespace(bad)


def test_refusals_are_counted_by_reason_and_logged_once_per_principal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    auth = Authenticator({})
    p = Principal("eve")
    with caplog.at_level(logging.WARNING, logger="kvstore.auth"):
        for _ in range(3):
            auth.denied(p, "read")
        auth.denied(p, "write")
        auth.denied(None, "unauthenticated")
        auth.denied(None, "unauthenticated")
    assert auth.denied_counts() == {"read": 3, "write": 1, "unauthenticated": 2}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "eve" in lines[0] and "<no valid token>" in lines[1]


def test_an_open_daemon_listens_on_loopback_only(caplog: pytest.LogCaptureFixture) -> None:
    auth = Authenticator(None)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        auth.check_listen(host, allow_open=False)
    for host in ("0.0.0.0", "", "::", "10.0.0.1", "example.org"):
        assert not is_loopback(host)
        with pytest.raises(InvalidArgument, match="allow_open"):
            auth.check_listen(host, allow_open=False)
    with caplog.at_level(logging.WARNING, logger="kvstore.auth"):
        auth.check_listen("0.0.0.0", allow_open=True)
    assert "OPEN" in caplog.text
    Authenticator({}).check_listen("0.0.0.0", allow_open=False)  # with tokens: anywhere


def test_bearer_token_from_metadata() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("x", "y"), ("Authorization", b"bearer abc")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token(None) is None and bearer_token([]) is None


def test_the_auth_section_of_the_config(tmp_path: Path) -> None:
    path = tmp_path / "store.toml"
    path.write_text(
        '[auth]\ntokens_file = "/etc/strata/tokens.toml"\nshared_namespaces = ["pub", "sys"]\n'
        "local_uids = [1001]\n[server]\nallow_open = true\n"
    )
    config = load_config(path, env={})
    assert config.auth == AuthConfig("/etc/strata/tokens.toml", ("pub", "sys"), (1001,))
    assert config.auth.enabled and config.server.allow_open
    env = {"STRATA_AUTH_SHARED_NAMESPACES": "a, b", "STRATA_AUTH_LOCAL_UIDS": "5,6"}
    from_env = load_config(env=env)
    assert from_env.auth.shared_namespaces == ("a", "b") and from_env.auth.local_uids == (5, 6)
    assert not from_env.auth.enabled and not from_env.server.allow_open
    with pytest.raises(InvalidArgument, match="not an integer"):
        load_config(env={"STRATA_AUTH_LOCAL_UIDS": "x"})
    with pytest.raises(InvalidArgument, match="not a list"):
        load_config(overrides={"auth.shared_namespaces": 3}, env={})  # type: ignore[dict-item]


def test_the_sdk_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRATA_STORE_TOKEN", raising=False)
    assert resolve_token(None) is None and auth_metadata(None) is None
    assert resolve_token("abc") == "abc"
    assert auth_metadata("abc") == (("authorization", "Bearer abc"),)
    monkeypatch.setenv("STRATA_STORE_TOKEN", "from-env")
    assert resolve_token(None) == "from-env" and resolve_token("given") == "given"
    assert resolve_token("") is None  # explicitly none, whatever the environment says
    for bad in (" padded", "new\nline", "tab\there", "caf\u00e9"):
        with pytest.raises(InvalidArgument):
            resolve_token(bad)


def test_auth_status_codes_map_to_typed_errors() -> None:
    assert isinstance(error_from_status(grpc.StatusCode.UNAUTHENTICATED, "x"), Unauthenticated)
    assert isinstance(error_from_status(grpc.StatusCode.PERMISSION_DENIED, "x"), PermissionDenied)


def test_a_token_stub_sends_the_metadata_on_every_method() -> None:
    seen: list[tuple[str, str, object]] = []

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, request: object, **kwargs: object) -> str:
            seen.append((self.name, "call", kwargs["metadata"]))
            return "reply"

        def future(self, request: object, **kwargs: object) -> str:
            seen.append((self.name, "future", kwargs["metadata"]))
            return "future"

    class Stub:
        def __getattr__(self, name: str) -> Method:
            return Method(name)

    stub = Stub()
    assert with_token(stub, None) is stub
    wrapped = with_token(stub, "abc")
    assert wrapped.Lookup("req", timeout=1.0) == "reply"
    assert wrapped.Release.future("req", timeout=1.0) == "future"
    assert wrapped.Watch("req") == "reply"
    bearer = (("authorization", "Bearer abc"),)
    assert seen == [
        ("Lookup", "call", bearer),
        ("Release", "future", bearer),
        ("Watch", "call", bearer),
    ]
    assert set(STORE_METHODS) >= {"NodeInfo", "Lookup", "Put", "Get", "Release", "Watch", "Delete"}
