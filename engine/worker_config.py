"""The configuration of one engine worker process, built once at its entry point.

Layers, lowest first: the defaults here < `STRATA_ENGINE_<FIELD>` environment variables (e.g.
`STRATA_ENGINE_PAGE_TOKENS=32`) < command-line flags. Unknown variables are ignored; a value that
does not parse is a `ValueError` naming its source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.store_spec import parse_store

ROLES = ("prefill", "decode", "colocated")
DEFAULT_PORTS = {"prefill": 7710, "decode": 7720, "colocated": 7730}
ENV_PREFIX = "STRATA_ENGINE_"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker process needs. Zero means "the default" where noted."""

    role: str
    model: str  # a checkpoint folder (config.json, *.safetensors, tokenizer.json)
    store: str = ""  # the store daemon's address; "" runs without a store
    host: str = "127.0.0.1"
    port: int = -1  # -1: the role's default port; 0: any free port
    device: str = "cpu"
    page_tokens: int = 16
    chunk_tokens: int = 256  # most tokens one forward pass takes
    max_context: int = 0  # 0: the model's max_position_embeddings
    max_batch: int = 32  # decode, colocated
    step_token_budget: int = 512  # colocated: tokens one step spends (decodes + prompt chunks)
    kv_capacity_tokens: int = 0  # decode, colocated: KV pool size; 0: the scheduler's default
    max_waiting: int = 1024  # decode, colocated: queued requests before RESOURCE_EXHAUSTED
    store_timeout_s: float = 5.0  # deadline of each store call
    store_retry_after_s: float = 1.0  # after the store was unavailable, skip it this long
    publish_timeout_s: float = 5.0  # prefill: how long an answer waits for its pages' puts
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight work may take
    rpc_threads: int = 64
    etcd: str = ""  # etcd endpoints to register in, for routers that watch them ("" = none)
    cluster: str = "default"  # the cluster name the registration goes under
    advertise: str = ""  # the address routers reach this worker at (default host:port)
    # The store principal's token ($STRATA_ENGINE_STORE_TOKEN; "" = $STRATA_STORE_TOKEN, or
    # none for an open store). No flag: a token on a command line is visible to every user.
    store_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.model:
            raise ValueError("a model checkpoint folder is required")
        if not -1 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (or -1: default), got {self.port}")
        positive = ("page_tokens", "chunk_tokens", "max_batch", "max_waiting", "rpc_threads")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_context", "kv_capacity_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.store:
            parse_store(self.store)  # ValueError for a malformed store string
        for name in ("store_timeout_s", "publish_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def bind_port(self) -> int:
        return DEFAULT_PORTS[self.role] if self.port == -1 else self.port


def load_worker_config(
    role: str,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> WorkerConfig:
    """Defaults < `env` (STRATA_ENGINE_*; pass {} for none) < `overrides` (field name → value,
    None meaning "not given"). Raises ValueError for an unknown field or a bad value."""
    fields = {f.name: f for f in dataclasses.fields(WorkerConfig) if f.name != "role"}
    values: dict[str, object] = {}
    for key, raw in (env or {}).items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name in fields:
                values[name] = _parse(name, fields[name].type, raw, f"${key}")
    for name, value in (overrides or {}).items():
        if name not in fields:
            raise ValueError(f"unknown worker setting {name!r}")
        if value is not None:
            values[name] = (
                _parse(name, fields[name].type, value, f"--{name.replace('_', '-')}")
                if isinstance(value, str)
                else value
            )
    if "model" not in values:
        raise ValueError("a model checkpoint folder is required (--model or $STRATA_ENGINE_MODEL)")
    return WorkerConfig(role=role, **values)  # type: ignore[arg-type]


def _parse(name: str, kind: object, raw: str, source: str) -> object:
    text = raw.strip()
    try:
        if kind in (int, "int"):
            return int(text)
        if kind in (float, "float"):
            return float(text)
    except ValueError:
        what = "an integer" if kind in (int, "int") else "a number"
        raise ValueError(f"{source}: {name} must be {what}, got {raw!r}") from None
    return text
