"""The daemon's configuration: one frozen tree, built once at the entry point.

Precedence, lowest to highest: defaults < TOML file (`--config PATH` or `STRATA_CONFIG`) <
`STRATA_<SECTION>_<FIELD>` environment variables < command-line `--set section.field=value` (and
the dedicated flags of `strata serve`). Sizes are written like `4GiB`, `512MiB`, `64KiB`;
durations in milliseconds or seconds as the field name says.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import InvalidArgument
from kvstore.quota import NamespaceQuota, parse_quotas

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """`4GiB` -> 4294967296; plain integers are bytes. Raises InvalidArgument otherwise."""
    if isinstance(text, int):
        if text < 0:
            raise InvalidArgument(f"size must not be negative: {text}")
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise InvalidArgument(f"not a size: {text!r} (write e.g. 4GiB, 512MiB, 65536)")
    number, unit = match.groups()
    value = float(number) * _UNITS[(unit or "b").lower()]
    if value != int(value):
        raise InvalidArgument(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(n_bytes: int) -> str:
    """1073741824 -> '1GiB'; used in logs and the startup banner."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n_bytes >= scale:
            value = n_bytes / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n_bytes}B"


def default_cache_dir() -> Path:
    """A per-user cache folder: $XDG_CACHE_HOME/strata or ~/.cache/strata."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 7700
    # The same-host lane's unix socket ("" = <data_dir>/strata-<port>.sock, "off" = no lane).
    unix_socket: str = ""
    metrics_port: int = 7701  # 0 = pick a free port; -1 = no metrics endpoint
    metrics_host: str = "127.0.0.1"
    workers: int = 16
    # Streaming calls (Put, Get, Watch) served at once, each holding a server thread for its
    # life; the rest are refused at once with RESOURCE_EXHAUSTED and a retry hint, so unary
    # calls always find a thread. 0 = workers less a quarter (at least 2). Per client
    # (connection): at most max_streams_per_client, and at most half of the slots.
    max_streams: int = 0
    max_streams_per_client: int = 4
    node_id: str = ""  # "" = derived from host and port
    # The UCX bulk data path (needs the `ucx` extra): true = serve it when ucxx imports.
    ucx: bool = True
    ucx_port: int = 0  # 0 = any free port (advertised in NodeInfo)
    # The TCP bulk data path (remote put/get over plain sockets, the UCX framing): true = serve it.
    tcp: bool = True
    tcp_port: int = 0  # 0 = any free port (advertised in NodeInfo)
    # A TCP data connection with no frame for this long is closed (its thread freed; a client
    # opens another when it needs one), so idle connections cannot hold the connection cap.
    tcp_idle_timeout_s: float = 120.0
    # After answering a call, a TCP data or lane connection's thread polls its socket for the
    # next request this long (non-blocking tries, yielding the CPU) before it sleeps in the
    # kernel: a burst of calls pays no wake-up. 0 = sleep at once. At most 1000.
    reply_poll_us: float = 50.0
    # Without auth.tokens_file the daemon is open (every call allowed): it then listens on
    # loopback only, unless this says that an open daemon on another address is intended.
    allow_open: bool = False


@dataclass(frozen=True, slots=True)
class DramConfig:
    capacity_bytes: int = 1 << 30
    # Name of the POSIX shared-memory segment ("" = strata-<user>-<port>).
    segment_name: str = ""
    # Demote in the background above high, down to low (fractions of capacity).
    high_watermark: float = 0.95
    low_watermark: float = 0.85


@dataclass(frozen=True, slots=True)
class SsdConfig:
    enabled: bool = True
    path: str = ""  # "" = <data_dir>/ssd
    capacity_bytes: int = 8 << 30
    # "always" or "second-hit" (admit a demoted page only if it was read at least once).
    admission: str = "always"
    # "write-back" (SSD written on demotion) or "write-through" (every put also goes to SSD).
    write_mode: str = "write-back"
    # fsync every write batch (slower; survives power loss, not just a process crash).
    sync_writes: bool = False
    # Fault injection (tests, chaos runs, the slow-disk measurement; never in production):
    # the probability that a payload read / write fails with an I/O error, and a delay before
    # every payload read / write. See kvstore/tiers/faults.py.
    fault_read_error_rate: float = 0.0
    fault_write_error_rate: float = 0.0
    fault_read_delay_ms: int = 0
    fault_write_delay_ms: int = 0
    fault_seed: int = 0


@dataclass(frozen=True, slots=True)
class GpuConfig:
    enabled: bool = False
    device: str = "cuda"  # "cpu" in tests
    capacity_bytes: int = 1 << 30


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_keys_per_call: int = 4096
    max_page_bytes: int = 64 << 20
    max_message_bytes: int = 72 << 20
    chunk_bytes: int = 4 << 20
    lease_ttl_ms: int = 30_000
    max_lease_ttl_ms: int = 600_000
    # The slots of an expired same-host reservation whose writer process the daemon cannot see
    # (another PID namespace) are freed after this long; see kvstore/fence.py.
    quarantine_max_ms: int = 3_600_000
    # Reservations: DRAM bytes one client may hold reserved at once (0 = half of the DRAM tier),
    # and the longest lease a reservation gets (a longer one asked for is cut to this).
    max_reserved_bytes_per_client: int = 0
    max_reserve_lease_ms: int = 60_000
    # Keys verified on put that the daemon remembers after they leave the index, so the child
    # of an evicted page still verifies (kvstore/chain.py; about 140 bytes a key).
    chain_memory_keys: int = 65536


@dataclass(frozen=True, slots=True)
class IoConfig:
    # Data operations running at once; the rest queue, critical before normal before background.
    concurrency: int = 4
    # Cap on background bytes per second (demotion, write-through, prefetch); 0 = no cap.
    background_bytes_per_s: int = 512 << 20


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    # Comma-separated etcd client URLs ("" = a single node, no cluster membership).
    etcd_endpoints: str = ""
    name: str = "default"  # members register under /strata/<name>/members/<node_id>
    lease_ttl_s: int = 10  # a dead daemon leaves the member set within about this long
    advertise_address: str = ""  # "" = server.host:<bound port>
    etcd_timeout_ms: int = 2000

    @property
    def enabled(self) -> bool:
        return bool(self.etcd_endpoints.strip())


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS for gRPC and the TCP data path (docs/security.md, "Transport security")."""

    cert: str = ""  # PEM server certificate (chain); "" = plaintext listeners
    key: str = ""  # PEM private key of `cert`
    # PEM CA bundle: set = every gRPC and TCP data-path client must show a certificate it signed.
    client_ca: str = ""
    # Refuse plaintext: no insecure gRPC port, a plaintext TCP data-path connection is closed
    # at once, and the UCX data path (which cannot be encrypted here) is not started.
    require: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.cert)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Principals and namespaces (docs/security.md; kvstore/auth.py reads it)."""

    # TOML file of [[principal]] tables (name, token_sha256, read, write, delete, operator,
    # trusted_local), readable by the daemon's user only. "" = the daemon is open.
    tokens_file: str = ""
    # Namespaces every principal may read and only operators may write (published prompts).
    shared_namespaces: tuple[str, ...] = ()
    # Users (besides the daemon's own) whose trusted_local principals get the same-host path.
    local_uids: tuple[int, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.tokens_file)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    data_dir: str = ""  # "" = the per-user cache folder
    server: ServerConfig = field(default_factory=ServerConfig)
    dram: DramConfig = field(default_factory=DramConfig)
    ssd: SsdConfig = field(default_factory=SsdConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    io: IoConfig = field(default_factory=IoConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    # [[quota]] tables: per-namespace byte quotas per tier (kvstore/quota.py); file only
    quota: tuple[NamespaceQuota, ...] = ()

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir) if self.data_dir else default_cache_dir()

    @property
    def ssd_path(self) -> Path:
        return Path(self.ssd.path) if self.ssd.path else self.data_path / "ssd"

    @property
    def unix_socket_path(self) -> Path | None:
        if self.server.unix_socket == "off":
            return None
        if self.server.unix_socket:
            return Path(self.server.unix_socket)
        return self.data_path / f"strata-{self.server.port}.sock"

    @property
    def stream_slots(self) -> int:
        """Streaming calls served at once (`server.max_streams`; 0 = all server threads but a
        quarter of them, at least 2, kept for unary calls)."""
        workers = self.server.workers
        return self.server.max_streams or max(1, workers - max(2, workers // 4))

    @property
    def streams_per_client(self) -> int:
        """`server.max_streams_per_client`, at most half the stream slots (at least 1)."""
        return max(1, min(self.server.max_streams_per_client, self.stream_slots // 2))

    @property
    def reserved_bytes_per_client(self) -> int:
        """`limits.max_reserved_bytes_per_client`, 0 = half of the DRAM tier."""
        return self.limits.max_reserved_bytes_per_client or self.dram.capacity_bytes // 2

    @property
    def segment_name(self) -> str:
        if self.dram.segment_name:
            return self.dram.segment_name
        return f"strata-{_user()}-{self.server.port}"

    def validate(self) -> StoreConfig:
        """Raise InvalidArgument on an inconsistent config; return self."""
        if self.ssd.admission not in ("always", "second-hit"):
            raise InvalidArgument(
                f"ssd.admission must be always|second-hit, not {self.ssd.admission!r}"
            )
        if self.ssd.write_mode not in ("write-back", "write-through"):
            raise InvalidArgument(
                f"ssd.write_mode must be write-back|write-through, not {self.ssd.write_mode!r}"
            )
        if not 0 < self.dram.low_watermark <= self.dram.high_watermark <= 1:
            raise InvalidArgument("need 0 < dram.low_watermark <= dram.high_watermark <= 1")
        if self.dram.capacity_bytes < 1 << 20:
            raise InvalidArgument("dram.capacity_bytes must be at least 1MiB")
        if self.limits.chunk_bytes <= 0 or self.limits.max_keys_per_call <= 0:
            raise InvalidArgument(
                "limits.chunk_bytes and limits.max_keys_per_call must be positive"
            )
        if self.limits.max_message_bytes < self.limits.chunk_bytes + (1 << 16):
            raise InvalidArgument("limits.max_message_bytes must exceed limits.chunk_bytes + 64KiB")
        for rate in (self.ssd.fault_read_error_rate, self.ssd.fault_write_error_rate):
            if not 0.0 <= rate <= 1.0:
                raise InvalidArgument("ssd.fault_*_error_rate must be in [0, 1]")
        if self.ssd.fault_read_delay_ms < 0 or self.ssd.fault_write_delay_ms < 0:
            raise InvalidArgument("ssd.fault_*_delay_ms must not be negative")
        if not self.server.tcp_idle_timeout_s > 0:
            raise InvalidArgument("server.tcp_idle_timeout_s must be positive")
        if not 0 <= self.server.reply_poll_us <= 1000:
            raise InvalidArgument("server.reply_poll_us must be in [0, 1000]")
        if self.server.max_streams < 0 or self.server.max_streams_per_client <= 0:
            raise InvalidArgument(
                "server.max_streams must be >= 0 and server.max_streams_per_client positive"
            )
        if self.limits.max_reserve_lease_ms <= 0:
            raise InvalidArgument("limits.max_reserve_lease_ms must be positive")
        if self.io.concurrency <= 0:
            raise InvalidArgument("io.concurrency must be positive")
        if bool(self.tls.cert) != bool(self.tls.key):
            raise InvalidArgument("tls.cert and tls.key go together: set both or neither")
        if (self.tls.require or self.tls.client_ca) and not self.tls.cert:
            raise InvalidArgument("tls.require and tls.client_ca need tls.cert and tls.key")
        if self.cluster.enabled:
            if not self.cluster.name or "/" in self.cluster.name:
                raise InvalidArgument("cluster.name must be non-empty and contain no '/'")
            if self.cluster.lease_ttl_s < 1 or self.cluster.etcd_timeout_ms <= 0:
                raise InvalidArgument(
                    "cluster.lease_ttl_s and cluster.etcd_timeout_ms must be positive"
                )
        return self


def _user() -> str:
    try:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", getpass.getuser())
    except (KeyError, OSError):
        return str(os.getuid())


# ---- building the tree from layered sources ---------------------------------------------------


def _coerce(value: object, annotation: object, where: str) -> object:
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise InvalidArgument(f"{where}: unsupported field type {annotation!r}")
        if isinstance(value, str):  # environment / --set: comma-separated
            items: list[object] = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, list | tuple):
            items = list(value)
        else:
            raise InvalidArgument(f"{where}: not a list: {value!r}")
        return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(items))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise InvalidArgument(f"{where}: not a boolean: {value!r}")
    if annotation is int:
        if where.endswith("_bytes") or where.endswith("_per_s"):
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise InvalidArgument(f"{where}: not a size: {value!r}")
            try:
                return parse_size(value)
            except InvalidArgument as exc:
                raise InvalidArgument(f"{where}: {exc}") from None
        try:
            return int(str(value))
        except ValueError:
            raise InvalidArgument(f"{where}: not an integer: {value!r}") from None
    if annotation is float:
        try:
            return float(str(value))
        except ValueError:
            raise InvalidArgument(f"{where}: not a number: {value!r}") from None
    if annotation is str:
        if not isinstance(value, str):
            raise InvalidArgument(f"{where}: not a string: {value!r}")
        return value
    raise InvalidArgument(f"{where}: unsupported field type {annotation!r}")


def _apply(base: object, updates: Mapping[str, object], where: str) -> object:
    hints = typing.get_type_hints(type(base))
    known = {f.name for f in dataclasses.fields(base)}  # type: ignore[arg-type]
    changes: dict[str, object] = {}
    for name, value in updates.items():
        key = name.replace("-", "_")
        if key not in known:
            raise InvalidArgument(f"unknown config key {where}{name!r}; known: {sorted(known)}")
        annotation = hints[key]
        current = getattr(base, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, Mapping):
                raise InvalidArgument(f"config section {where}{key} must be a table")
            changes[key] = _apply(current, value, f"{where}{key}.")
        else:
            if isinstance(annotation, types.UnionType):
                raise InvalidArgument(f"{where}{key}: unsupported union field")
            changes[key] = _coerce(value, annotation, f"{where}{key}")
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]


def _nest(flat: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for dotted, value in flat.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise InvalidArgument(f"config key {dotted!r} conflicts with another setting")
            node = child
        node[parts[-1]] = value
    return out


def _env_settings(env: Mapping[str, str]) -> dict[str, str]:
    """STRATA_DRAM_CAPACITY_BYTES=4GiB -> {"dram.capacity_bytes": "4GiB"}; STRATA_DATA_DIR too."""
    sections = {f.name for f in dataclasses.fields(StoreConfig) if f.name != "data_dir"}
    flat: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith("STRATA_") or name == "STRATA_CONFIG":
            continue
        rest = name[len("STRATA_") :].lower()
        if rest == "data_dir":
            flat["data_dir"] = value
            continue
        section, _, key = rest.partition("_")
        if section in sections and key:
            flat[f"{section}.{key}"] = value
    return flat


def load_config(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> StoreConfig:
    """Build the config tree: defaults < file < STRATA_* env < overrides ("section.key" -> value)."""
    env = os.environ if env is None else env
    config: object = StoreConfig()
    path = file or env.get("STRATA_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise InvalidArgument(f"cannot read config file {path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"config file {path} is not valid TOML: {exc}") from None
        quotas = parse_quotas(data.pop("quota", []))
        config = _apply(config, data, "")
        config = dataclasses.replace(config, quota=quotas)  # type: ignore[type-var]
    config = _apply(config, _nest(_env_settings(env)), "")
    if overrides:
        config = _apply(config, _nest(dict(overrides)), "")
    assert isinstance(config, StoreConfig)
    return config.validate()
