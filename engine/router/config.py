"""The router's configuration: a TOML file, then command-line flags over it.

    [router]
    host = "127.0.0.1"
    port = 8000
    workers = ["127.0.0.1:7710", "127.0.0.1:7720"]   # static worker addresses
    etcd = ""                 # "host:2379[,host:2379]": workers register there too
    cluster = "default"       # the etcd cluster name workers register under
    store = "127.0.0.1:7700"  # the store the workers use (HOST:PORT, a list, or etcd://...)
    profile = "profile.json"  # the time model (`strata profile`)
    policy = "strata"         # strata | round_robin | least_load | longest_prefix
    poll_s = 0.15             # load report period
    drop_after_s = 1.0        # a worker silent this long is left out of decisions
    max_attempts = 3          # workers tried for one prefill, and for one decode
    min_stall_s = 10.0        # a worker silent this long in a call (and 20x its prediction)
                              # is given up on: the prefill or decode goes to another
    debug_decisions = 256     # decisions kept for GET /debug/decisions
    calibrate = true          # price prefills at the speed the workers report (core/calibration)
    api_keys = ""             # API key file (engine.router.tenancy); "" = open, loopback only
    allow_open = false        # listen on a non-loopback host without API keys anyway

    [admission]               # SLO classes: see engine.router.core.slo
    default_class = "standard"
    [[admission.classes]]
    name = "standard"
    ttft_s = 2.0

Unknown keys are errors (a typo must not be silently ignored). The router keeps no other state:
restarted with the same file and flags, it serves as before.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.router.core.policies import POLICY_NAMES
from engine.router.core.slo import AdmissionConfig
from engine.store_spec import parse_store


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: tuple[str, ...] = ()
    etcd: str = ""
    cluster: str = "default"
    store: str = ""
    profile: str = ""
    policy: str = "strata"
    poll_s: float = 0.15
    drop_after_s: float = 1.0
    rpc_timeout_s: float = 1.0
    max_attempts: int = 3
    min_stall_s: float = 10.0
    debug_decisions: int = 256
    calibrate: bool = True
    seed: int = 0
    api_keys: str = ""
    allow_open: bool = False
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r} (known: {', '.join(POLICY_NAMES)})")
        if not self.poll_s > 0 or not self.drop_after_s > self.poll_s:
            raise ValueError("need poll_s > 0 and drop_after_s > poll_s")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not self.min_stall_s > 0:
            raise ValueError("min_stall_s must be > 0")
        parse_store(self.store)  # raises ValueError for a malformed store
        for address in self.workers:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker {address!r} is not HOST:PORT")


_SIMPLE = {f.name: f for f in dataclasses.fields(RouterConfig) if f.name != "admission"}


def load_router_config(
    path: str | Path | None = None, overrides: Mapping[str, object] | None = None
) -> RouterConfig:
    """The file at `path` (if any), then `overrides` (None values: not given). ValueError for
    an unknown key, a bad value or a file that does not parse."""
    values: dict[str, object] = {}
    admission = AdmissionConfig()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"router config {path}: {exc}") from None
        unknown = sorted(set(data) - {"router", "admission"})
        if unknown:
            raise ValueError(f"router config {path}: unknown tables {', '.join(unknown)}")
        router = data.get("router", {})
        bad = sorted(set(router) - set(_SIMPLE))
        if bad:
            raise ValueError(f"router config {path}: unknown [router] keys {', '.join(bad)}")
        values.update(router)
        if "admission" in data:
            admission = AdmissionConfig.from_mapping(data["admission"])
    for name, value in (overrides or {}).items():
        if name not in _SIMPLE:
            raise ValueError(f"unknown router setting {name!r}")
        if value is not None:
            values[name] = value
    if "workers" in values:
        raw = values["workers"]
        items = raw.split(",") if isinstance(raw, str) else list(raw)  # type: ignore[call-overload]
        values["workers"] = tuple(str(w).strip() for w in items if str(w).strip())
    return RouterConfig(admission=admission, **values)  # type: ignore[arg-type]
