"""The cluster spec (TOML): engines and their roles, hosts, pools, the store, the router's view.

    name = "8-colocated"
    time_model = "../fits/preble_mistral7b_a6000.json"  # a `strata profile` JSON or a shipped fit
    hosts = 4                  # engines are spread over hosts round robin
    colocated = 8              # or prefill = 2, decode = 1 (xPyD); 2..64 engines in all
    gpus_per_engine = 1        # tensor parallel degree (for per-GPU goodput)
    page_tokens = 16
    kv_bytes_per_token = 131072
    max_batch = 64             # decode batch limit per engine
    pool_pages = 16384         # paged KV pool per engine
    prefill_batch_tokens = 8192
    chunk_tokens = 0           # co-located chunked prefill: token budget per iteration (0 = off)
    request_overhead_s = 0.0   # serving path per request (router, RPCs, sampling) before its first token
    token_overhead_s = 0.0     # serving path per decode iteration (host scheduling, streaming)
    handoff_s = 0.0            # xPyD: per request, first token -> decode join, beyond the KV pull
    prefill_contention = 1.0   # a prefill iteration's slowdown while another engine of its host computes
    decode_contention = 1.0    # a decode iteration's slowdown while another engine of its host computes
    prefill_jitter = []        # measured multipliers of prefill compute; each prefill takes a seeded draw
    [store]
    mode = "global"            # global (Strata) | per_engine (local prefix caches) | none
    dram = "64GiB"             # per host
    ssd = "0"
    [router]
    policy = "strata"          # the default; `--policies` overrides
    admission = "off"          # off | predicted | current
    report_interval_s = 0.1    # how stale the load reports are
    drain_s = 600              # how long past the last arrival unfinished requests may run

`load_cluster(path)` reads and checks one (raises ClusterError naming the key).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

STORE_MODES = ("global", "per_engine", "none")
ADMISSION_MODES = ("off", "predicted", "current")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$")
_UNITS = {
    None: 1,
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


class ClusterError(ValueError):
    """A cluster file that cannot be used; the message names the key."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    name: str
    time_model: str
    hosts: int = 1
    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    gpus_per_engine: int = 1
    page_tokens: int = 16
    kv_bytes_per_token: int = 131072
    max_batch: int = 64
    pool_pages: int = 16384
    prefill_batch_tokens: int = 8192
    chunk_tokens: int = 0
    request_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    handoff_s: float = 0.0
    prefill_contention: float = 1.0
    decode_contention: float = 1.0
    prefill_jitter: tuple[float, ...] = ()
    store: str = "global"
    dram_bytes: int = 64 << 30
    ssd_bytes: int = 0
    policy: str = "strata"
    admission: str = "off"
    report_interval_s: float = 0.1
    drain_s: float = 600.0
    source: str = ""

    @property
    def engines(self) -> int:
        return self.colocated + self.prefill + self.decode

    @property
    def gpus(self) -> int:
        return self.engines * self.gpus_per_engine

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.kv_bytes_per_token

    @property
    def layout(self) -> str:
        if self.colocated and not (self.prefill or self.decode):
            return f"{self.colocated} co-located"
        parts = [f"{self.prefill}P{self.decode}D"] if self.prefill or self.decode else []
        if self.colocated:
            parts.append(f"{self.colocated} co-located")
        return " + ".join(parts)

    def with_(self, **changes: object) -> ClusterSpec:
        spec = replace(self, **changes)  # type: ignore[arg-type]
        validate(spec)
        return spec


def parse_size(value: object, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ClusterError(f"{where}: a size like '64GiB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def validate(spec: ClusterSpec) -> None:
    if not 1 <= spec.engines <= 64:
        raise ClusterError(f"a cluster has 1 to 64 engines, this one {spec.engines}")
    if bool(spec.prefill) != bool(spec.decode):
        raise ClusterError("prefill and decode engines come together (xPyD needs both)")
    for key in (
        "hosts",
        "gpus_per_engine",
        "page_tokens",
        "kv_bytes_per_token",
        "max_batch",
        "pool_pages",
        "prefill_batch_tokens",
    ):
        if getattr(spec, key) < 1:
            raise ClusterError(f"{key} must be >= 1, got {getattr(spec, key)}")
    if spec.chunk_tokens < 0:
        raise ClusterError("chunk_tokens must be >= 0")
    if spec.request_overhead_s < 0 or spec.token_overhead_s < 0:
        raise ClusterError("request_overhead_s and token_overhead_s must be >= 0")
    if spec.handoff_s < 0:
        raise ClusterError("handoff_s must be >= 0")
    if spec.prefill_contention < 1 or spec.decode_contention < 1:
        raise ClusterError("prefill_contention and decode_contention must be >= 1")
    if any(not (x > 0 and math.isfinite(x)) for x in spec.prefill_jitter):
        raise ClusterError("prefill_jitter holds positive finite multipliers")
    if spec.store not in STORE_MODES:
        raise ClusterError(
            f"store.mode must be one of {', '.join(STORE_MODES)}, got {spec.store!r}"
        )
    if spec.admission not in ADMISSION_MODES:
        raise ClusterError(f"router.admission must be one of {', '.join(ADMISSION_MODES)}")
    if spec.report_interval_s <= 0 or spec.drain_s <= 0:
        raise ClusterError("router.report_interval_s and router.drain_s must be > 0")


def _int(table: Mapping[str, object], key: str, default: int) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClusterError(f"{key} must be an int, got {value!r}")
    return value


def _float(table: Mapping[str, object], key: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClusterError(f"{key} must be a number, got {value!r}")
    return float(value)


def _floats(table: Mapping[str, object], key: str) -> tuple[float, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int | float) for v in value
    ):
        raise ClusterError(f"{key} must be a list of numbers, got {value!r}")
    return tuple(float(v) for v in value)


def load_cluster(path: str | Path) -> ClusterSpec:
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ClusterError(f"cluster file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterError(f"{p}: not valid TOML: {exc}") from None
    top = {
        "name",
        "time_model",
        "hosts",
        "colocated",
        "prefill",
        "decode",
        "gpus_per_engine",
        "page_tokens",
        "kv_bytes_per_token",
        "max_batch",
        "pool_pages",
        "prefill_batch_tokens",
        "chunk_tokens",
        "request_overhead_s",
        "token_overhead_s",
        "handoff_s",
        "prefill_contention",
        "decode_contention",
        "prefill_jitter",
        "store",
        "router",
    }
    extra = sorted(set(raw) - top)
    if extra:
        raise ClusterError(f"{p}: unknown keys {extra}")
    store = raw.get("store", {})
    router = raw.get("router", {})
    if not isinstance(store, Mapping) or not isinstance(router, Mapping):
        raise ClusterError(f"{p}: [store] and [router] must be tables")
    for table, keys, where in (
        (store, {"mode", "dram", "ssd"}, "store"),
        (router, {"policy", "admission", "report_interval_s", "drain_s"}, "router"),
    ):
        bad = sorted(set(table) - keys)
        if bad:
            raise ClusterError(f"{p}: [{where}] unknown keys {bad}")
    tm = raw.get("time_model")
    if not isinstance(tm, str) or not tm:
        raise ClusterError(f"{p}: time_model (a profile or fit JSON path) is required")
    tm_expanded = Path(tm).expanduser()
    tm_path = str(tm_expanded if tm_expanded.is_absolute() else (p.parent / tm).resolve())
    spec = ClusterSpec(
        name=str(raw.get("name", p.stem)),
        time_model=tm_path,
        hosts=_int(raw, "hosts", 1),
        colocated=_int(raw, "colocated", 0),
        prefill=_int(raw, "prefill", 0),
        decode=_int(raw, "decode", 0),
        gpus_per_engine=_int(raw, "gpus_per_engine", 1),
        page_tokens=_int(raw, "page_tokens", 16),
        kv_bytes_per_token=_int(raw, "kv_bytes_per_token", 131072),
        max_batch=_int(raw, "max_batch", 64),
        pool_pages=_int(raw, "pool_pages", 16384),
        prefill_batch_tokens=_int(raw, "prefill_batch_tokens", 8192),
        chunk_tokens=_int(raw, "chunk_tokens", 0),
        request_overhead_s=_float(raw, "request_overhead_s", 0.0),
        token_overhead_s=_float(raw, "token_overhead_s", 0.0),
        handoff_s=_float(raw, "handoff_s", 0.0),
        prefill_contention=_float(raw, "prefill_contention", 1.0),
        decode_contention=_float(raw, "decode_contention", 1.0),
        prefill_jitter=_floats(raw, "prefill_jitter"),
        store=str(store.get("mode", "global")),
        dram_bytes=parse_size(store.get("dram", 64 << 30), "store.dram"),
        ssd_bytes=parse_size(store.get("ssd", 0), "store.ssd"),
        policy=str(router.get("policy", "strata")),
        admission=str(router.get("admission", "off")),
        report_interval_s=_float(router, "report_interval_s", 0.1),
        drain_s=_float(router, "drain_s", 600.0),
        source=str(p),
    )
    validate(spec)
    return spec
