"""Tenants at the router without processes: token buckets, salted namespaces, the key file, the
gate (401 / 403 / 429 with Retry-After), tenant shares in admission (a flood of one tenant
cannot starve another's trickle of the same class), and the loopback rule of `strata router`."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections import Counter
from pathlib import Path

import pytest
from test_router_admission import MODEL, FakeCluster, RequestView, req, run

from engine.router.cli import is_loopback, serve
from engine.router.config import RouterConfig
from engine.router.core import (
    Admission,
    AdmissionConfig,
    DispatchLedger,
    RouterCore,
    SloClass,
    build_policy,
)
from engine.router.core.admission import UnknownTenant
from engine.router.core.errors import ErrorKind
from engine.router.core.tenancy import (
    Bucket,
    Limits,
    RateLimiter,
    check_namespace,
    salted_namespace,
)
from engine.router.http_errors import error_body, headers_of, status_of
from engine.router.tenancy import KeyTable, Tenancy, presented_key

pytestmark = pytest.mark.unit

SECRET_A = "sk-tenant-a-0123456789"
SECRET_B = "sk-tenant-b-9876543210"


# ---- buckets -----------------------------------------------------------------------------------


def test_a_bucket_refills_at_its_rate_up_to_its_size() -> None:
    b = Bucket(rate=2.0, size=4.0)
    assert b.current(0.0) == 4.0  # starts full
    b.take(4.0, 0.0)
    assert b.current(0.0) == 0.0
    assert b.wait_s(1.0, 0.0) == pytest.approx(0.5)
    assert b.current(1.0) == pytest.approx(2.0)
    assert b.current(100.0) == 4.0  # never past its size
    assert b.wait_s(5.0, 100.0) == math.inf  # more than it can ever hold
    b.give(10.0, 100.0)
    assert b.current(100.0) == 4.0
    assert Bucket(math.inf, 0.0).wait_s(1e12, 0.0) == 0.0


def test_limits_defaults_and_checks() -> None:
    limits = Limits(requests_per_s=0.5, tokens_per_s=100.0)
    assert (limits.request_burst, limits.token_burst) == (1.0, 100.0)
    assert Limits(requests_per_s=10).request_burst == 10.0
    for bad in ({"requests_per_s": 0}, {"tokens_per_s": -1}, {"token_burst": math.inf}):
        with pytest.raises(ValueError):
            Limits(**bad)  # type: ignore[arg-type]


def test_the_limiter_charges_both_buckets_or_neither() -> None:
    limiter = RateLimiter()
    limits = Limits(requests_per_s=1.0, request_burst=3.0, tokens_per_s=100.0, token_burst=200.0)
    assert limiter.charge("k", limits, 150, 0.0) is None
    refused = limiter.charge("k", limits, 150, 0.0)  # 50 tokens left
    assert refused is not None and refused.bucket == "tokens"
    assert refused.retry_after_s == pytest.approx(1.0)  # 100 more tokens at 100/s
    # nothing was charged by the refusal: one small request still passes, then requests run out
    assert limiter.charge("k", limits, 10, 0.0) is None
    assert limiter.charge("k", limits, 10, 0.0) is None
    by_rate = limiter.charge("k", limits, 10, 0.0)
    assert by_rate is not None and by_rate.bucket == "requests"
    assert by_rate.retry_after_s == pytest.approx(1.0)
    assert limiter.charge("k", limits, 10, 1.0) is None  # one request refilled
    too_big = limiter.charge("other", limits, 201, 0.0)
    assert too_big is not None and too_big.retry_after_s == math.inf
    # a refund gives back what was charged and not used
    limiter.refund("k", 1, 100, 1.0)
    assert limiter.charge("k", limits, 10, 1.0) is None


# ---- namespaces --------------------------------------------------------------------------------


def test_salted_namespaces_never_collide() -> None:
    assert salted_namespace("acme", None) == "acme" == salted_namespace("acme", "")
    salted = salted_namespace("acme", "s1")
    assert salted.startswith("acme#") and len(salted) == len("acme#") + 32
    assert salted != salted_namespace("acme", "s2")
    assert salted == salted_namespace("acme", "s1")  # stable: the same salt shares pages
    assert salted_namespace("a", "bc") != salted_namespace("ab", "c")
    assert salted_namespace("acme", "s1") != salted_namespace("other", "s1")
    with pytest.raises(ValueError):
        check_namespace("acme#x")  # would let a namespace imitate another's salted one
    with pytest.raises(ValueError):
        check_namespace("a\nb")


# ---- key file ----------------------------------------------------------------------------------


def write_keys(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


KEYS = f"""
[[keys]]
key = "{SECRET_A}"
tenant = "a"
slo_classes = ["standard"]
requests_per_s = 1
request_burst = 2
tokens_per_s = 100
token_burst = 100

[[keys]]
key_sha256 = "{hashlib.sha256(SECRET_B.encode()).hexdigest()}"
tenant = "b"
namespace = "bee"
share = 3
debug = true
"""


def test_the_key_file(tmp_path: Path) -> None:
    table = KeyTable.load(write_keys(tmp_path / "k.toml", KEYS), ("standard", "batch"))
    a, b = table.keys
    assert (a.tenant, a.namespace, a.slo_classes, a.debug) == ("a", "a", {"standard"}, False)
    assert (b.tenant, b.namespace, b.share, b.debug) == ("b", "bee", 3.0, True)
    assert a.limits == Limits(1.0, 100.0, 2.0, 100.0)
    assert SECRET_A not in repr(table) and SECRET_A.encode() not in a.digest
    assert table.find(SECRET_A) is a and table.find(SECRET_B) is b
    assert table.find(SECRET_A + "x") is None and table.find("") is None
    assert table.shares() == {"a": 1.0, "b": 3.0}
    bad = {
        "tenant": '[[keys]]\nkey = "0123456789abcdef"\n',
        "exactly one": '[[keys]]\ntenant = "a"\n',
        "at least 16": '[[keys]]\ntenant = "a"\nkey = "short"\n',
        "64 hex": '[[keys]]\ntenant = "a"\nkey_sha256 = "abc"\n',
        "unknown settings": '[[keys]]\ntenant = "a"\nkey = "0123456789abcdef"\nrate = 1\n',
        "unknown SLO": '[[keys]]\ntenant = "a"\nkey = "0123456789abcdef"\nslo_classes = ["x"]\n',
        "twice": '[[keys]]\ntenant = "a"\nkey = "0123456789abcdef"\n' * 2,
        "no keys": "",
        "may not contain": '[[keys]]\ntenant = "a"\nkey = "0123456789abcdef"\nnamespace = "a#"\n',
        "must be > 0": '[[keys]]\ntenant = "a"\nkey = "0123456789abcdef"\nrequests_per_s = 0\n',
    }
    for what, text in bad.items():
        with pytest.raises(ValueError, match=what):
            KeyTable.load(write_keys(tmp_path / "bad.toml", text), ("standard",))
    with pytest.raises(ValueError, match="API key file"):
        KeyTable.load(tmp_path / "missing.toml")


def test_presented_key() -> None:
    assert presented_key("Bearer abc", None) == "abc"
    assert presented_key("bearer  abc ", "zzz") == "abc"
    assert presented_key("Basic abc", "zzz") is None  # a wrong scheme is not a key
    assert presented_key(None, "abc") == "abc"
    assert presented_key(None, None) is None and presented_key("Bearer ", None) is None


# ---- the gate ----------------------------------------------------------------------------------


def _status(exc: pytest.ExceptionInfo[Exception]) -> int:
    return status_of(exc.value.kind)  # type: ignore[attr-defined]


def test_the_gate(tmp_path: Path) -> None:
    gate = Tenancy(KeyTable.load(write_keys(tmp_path / "k.toml", KEYS)))
    for auth in (None, "Bearer sk-not-a-key-at-all", "Basic " + SECRET_A):
        with pytest.raises(Exception) as exc:
            gate.authenticate(auth, None)
        assert _status(exc) == 401
        body = error_body(exc.value)  # type: ignore[arg-type]
        assert body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
        assert headers_of(exc.value)["WWW-Authenticate"] == "Bearer"  # type: ignore[arg-type]
    grant = gate.authenticate(f"Bearer {SECRET_A}", None)
    assert (grant.tenant, grant.namespace) == ("a", "a")
    assert gate.authenticate(None, SECRET_B).namespace == "bee"
    with pytest.raises(Exception) as exc:
        gate.admit(grant, "batch", 10, 0.0, None)  # a class the key may not use
    assert _status(exc) == 403 and exc.value.kind is ErrorKind.forbidden  # type: ignore[attr-defined]
    first = gate.admit(grant, "standard", 60, 0.0, "salt")
    assert first.namespace == salted_namespace("a", "salt") and first.charged_tokens == 60
    with pytest.raises(Exception) as exc:
        gate.admit(grant, "standard", 60, 0.0, None)  # 40 tokens left of 100
    assert _status(exc) == 429
    assert headers_of(exc.value)["Retry-After"] == "1"  # type: ignore[arg-type]
    assert headers_of(exc.value)["x-strata-limited-by"] == "tokens"  # type: ignore[arg-type]
    gate.admit(grant, "standard", 10, 0.0, None)  # the second request of the burst
    with pytest.raises(Exception) as exc:
        gate.admit(grant, "standard", 1, 0.0, None)
    assert _status(exc) == 429
    assert headers_of(exc.value)["x-strata-limited-by"] == "requests"  # type: ignore[arg-type]
    with pytest.raises(Exception) as exc:
        gate.admit(grant, "standard", 101, 10.0, None)  # can never fit: 400, not "retry"
    assert _status(exc) == 400
    # a refund (the request was refused downstream) lets the next one through
    gate.refund(first, requests=1, tokens=60, now=10.0)
    assert gate.admit(grant, "standard", 60, 10.0, None).tenant == "a"
    # debug endpoints: only a key marked debug
    with pytest.raises(Exception) as exc:
        gate.check_debug(grant)
    assert _status(exc) == 403
    gate.check_debug(gate.authenticate(None, SECRET_B))


def test_an_open_gate_lets_everyone_in_under_one_namespace() -> None:
    gate = Tenancy(None)
    grant = gate.authenticate(None, None)
    assert (grant.key, grant.tenant, grant.namespace) == (None, "", "")
    for _ in range(1000):
        gate.admit(grant, "any", 10**9, 0.0, None)
    assert gate.admit(grant, "any", 1, 0.0, "s").namespace == salted_namespace("", "s")
    gate.check_debug(grant)


# ---- tenant shares in admission ----------------------------------------------------------------


def _tenant(view: RequestView, tenant: str) -> RequestView:
    return dataclasses.replace(view, tenant=tenant)


def test_one_tenants_flood_cannot_starve_anothers_trickle() -> None:
    chat = SloClass("chat", ttft_s=0.3, tpot_s=1.0)
    config = AdmissionConfig(classes=(chat,), default_class="chat")
    # tenant a floods at 60 req/s (capacity ~36/s), tenant b trickles at 5 req/s, same class
    arrivals = [(i / 60, _tenant(req(f"a{i}", slo="chat"), "a")) for i in range(180)]
    arrivals += [(0.1 + i * 0.2, _tenant(req(f"b{i}", slo="chat"), "b")) for i in range(15)]
    admitted = {}
    for tenants in ({"a": 1.0, "b": 1.0}, None):
        admission = Admission(config, model=MODEL, tenants=tenants)
        core = RouterCore(build_policy("strata"), admission, MODEL, DispatchLedger())
        cluster = FakeCluster(n_prefill=2, n_decode=1, report_every_s=0.02)
        out = run(core, cluster, arrivals)
        admitted[bool(tenants)] = Counter(j.request.tenant for j in out.admitted)
        if tenants:
            assert out.attainment(chat) == 1.0
            assert all(r.slo_class == "chat" for _, r in out.refused)
            refused = Counter(v.tenant for v, _ in out.refused)
            assert refused["b"] <= 1 and refused["a"] > 50
            assert admission.group_of(arrivals[0][1]) == "chat@a"
    assert admitted[True]["b"] >= 14  # b keeps (nearly) all of its small demand
    assert admitted[True]["a"] > 60  # a's flood still uses the rest
    assert admitted[False]["b"] < admitted[True]["b"] // 2  # without tenant shares b starves


def test_a_tenant_without_a_share_is_a_typed_error() -> None:
    admission = Admission(AdmissionConfig(), tenants={"a": 1.0})
    with pytest.raises(UnknownTenant):
        admission.group_of(_tenant(req("x"), "stranger"))
    with pytest.raises(ValueError):
        Admission(AdmissionConfig(), tenants={"a": 0.0})


# ---- listening open --------------------------------------------------------------------------


def test_the_router_refuses_to_listen_open_off_loopback(tmp_path: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("h")
    config = RouterConfig(host="0.0.0.0", port=0, profile=str(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="--allow-open"):
        serve(config, banner=False)


def test_a_finished_run_gives_back_the_tokens_it_did_not_produce(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from engine.router.core.timemodel import DecodeCoeffs, PrefillCoeffs, TimeModel
    from engine.router.service import RouterService

    keys = write_keys(
        tmp_path / "k.toml",
        f'[[keys]]\nkey = "{SECRET_A}"\ntenant = "a"\ntokens_per_s = 0.001\ntoken_burst = 100\n',
    )
    model = TimeModel(PrefillCoeffs(0.01, 1e-5, 0.0, 0.0), DecodeCoeffs(0.01, 1e-4, 0.0))
    service = RouterService(RouterConfig(api_keys=str(keys)), model)
    assert service.core.admission.tenants == {"a": 1.0}
    gate = service.tenancy
    now = time.monotonic()  # the service's clock
    grant = gate.admit(gate.authenticate(f"Bearer {SECRET_A}", None), "default", 90, now, None)
    service._grants["r1"] = grant
    # 40 prompt tokens, max_tokens 50, stopped after 5: 45 of the 90 come back
    run = SimpleNamespace(
        job=SimpleNamespace(request_id="r1", prompt_ids=(1,) * 40), produced=[7] * 5
    )
    service._reconcile(run)  # type: ignore[arg-type]
    assert "r1" not in service._grants
    limits = grant.key.limits  # type: ignore[union-attr]
    assert gate.limiter.charge("a/0", limits, 55, time.monotonic()) is None  # 10 left + 45 back
    assert gate.limiter.charge("a/0", limits, 1, time.monotonic()) is not None


def test_strata_up_and_router_report_a_bad_key_file_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.router import cli, up

    bad = write_keys(tmp_path / "bad.toml", '[[keys]]\ntenant = "a"\nkey = "short"\n')
    assert up.main(["--preset", "tiny", "--port", "0", "--api-keys", str(bad)]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
    profile = tmp_path / "p.json"
    from engine.router.core.timemodel import DecodeCoeffs, PrefillCoeffs, TimeModel

    TimeModel(PrefillCoeffs(0.01, 1e-5, 0.0, 0.0), DecodeCoeffs(0.01, 1e-4, 0.0)).save(profile)
    code = cli.main(["--port", "0", "--profile", str(profile), "--api-keys", str(bad)])
    assert code == 2 and "key #1" in capsys.readouterr().err
