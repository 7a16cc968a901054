"""The daemon's config tree: defaults < TOML file < STRATA_* env < overrides; sizes; errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvstore.config import (
    StoreConfig,
    format_size,
    load_config,
    parse_size,
)
from kvstore.errors import InvalidArgument

pytestmark = pytest.mark.unit

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "strata.toml"
    path.write_text(text)
    return path


# ---- defaults ----------------------------------------------------------------------------------


def test_defaults() -> None:
    c = load_config(env={})
    assert c == StoreConfig()
    assert c.data_dir == ""
    assert (c.server.host, c.server.port, c.server.metrics_port) == ("127.0.0.1", 7700, 7701)
    assert (c.server.unix_socket, c.server.metrics_host, c.server.workers) == ("", "127.0.0.1", 16)
    assert c.server.node_id == ""
    assert c.dram.capacity_bytes == 1 * GiB
    assert c.dram.segment_name == ""
    assert (c.dram.low_watermark, c.dram.high_watermark) == (0.85, 0.95)
    assert c.ssd.enabled is True
    assert c.ssd.path == ""
    assert c.ssd.capacity_bytes == 8 * GiB
    assert (c.ssd.admission, c.ssd.write_mode) == ("always", "write-back")
    assert c.ssd.sync_writes is False
    assert (c.gpu.enabled, c.gpu.device, c.gpu.capacity_bytes) == (False, "cuda", 1 * GiB)
    assert c.limits.max_keys_per_call == 4096
    assert c.limits.max_page_bytes == 64 * MiB
    assert c.limits.max_message_bytes == 72 * MiB
    assert c.limits.chunk_bytes == 4 * MiB
    assert (c.limits.lease_ttl_ms, c.limits.max_lease_ttl_ms) == (30_000, 600_000)
    assert (c.io.concurrency, c.io.background_bytes_per_s) == (4, 512 * MiB)
    assert StoreConfig().validate() is not None


def test_config_is_frozen() -> None:
    c = StoreConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.server.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.data_dir = "/x"  # type: ignore[misc]


def test_derived_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = StoreConfig()
    assert c.data_path == tmp_path / "cache" / "strata"
    assert c.ssd_path == tmp_path / "cache" / "strata" / "ssd"
    assert c.unix_socket_path == tmp_path / "cache" / "strata" / "strata-7700.sock"
    assert re.fullmatch(r"strata-[A-Za-z0-9_.-]+-7700", c.segment_name), c.segment_name

    c = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path / "data"),
            "ssd.path": str(tmp_path / "fast"),
            "server.unix_socket": "off",
            "dram.segment_name": "seg",
        },
    )
    assert c.data_path == tmp_path / "data"
    assert c.ssd_path == tmp_path / "fast"
    assert c.unix_socket_path is None
    assert c.segment_name == "seg"
    c = load_config(env={}, overrides={"server.unix_socket": "/run/s.sock"})
    assert c.unix_socket_path == Path("/run/s.sock")


# ---- precedence --------------------------------------------------------------------------------

FILE = """
data_dir = "/from/file"
[server]
host = "0.0.0.0"
port = 1000
workers = 3
metrics_port = 1001
[ssd]
admission = "second-hit"
capacity_bytes = "2GiB"
[dram]
capacity_bytes = "256MiB"
"""

ENV = {
    "STRATA_SERVER_PORT": "2000",  # beats the file
    "STRATA_SERVER_WORKERS": "5",  # beats the file, loses to the override
    "STRATA_GPU_DEVICE": "cpu",  # only the environment sets it
    "STRATA_DRAM_CAPACITY_BYTES": "512MiB",  # beats the file
    "STRATA_DATA_DIR": "/from/env",
    "STRATA_UNRELATED": "ignored",  # not a section: ignored
    "OTHER_SERVER_PORT": "9",  # not ours
}

OVERRIDES = {
    "server.workers": "7",
    "ssd.write_mode": "write-through",  # only the override sets it
    "data_dir": "/from/overrides",
}


def test_precedence(tmp_path: Path) -> None:
    path = _toml(tmp_path, FILE)
    c = load_config(file=path, env=ENV, overrides=OVERRIDES)
    assert c.io.concurrency == 4  # default: nobody sets it
    assert c.server.host == "0.0.0.0"  # file only
    assert c.server.metrics_port == 1001  # file only
    assert c.ssd.admission == "second-hit"  # file only
    assert c.ssd.capacity_bytes == 2 * GiB  # file only
    assert c.server.port == 2000  # env over file
    assert c.dram.capacity_bytes == 512 * MiB  # env over file
    assert c.gpu.device == "cpu"  # env only
    assert c.server.workers == 7  # overrides over env over file
    assert c.ssd.write_mode == "write-through"  # overrides only
    assert c.data_dir == "/from/overrides"


def test_each_layer_alone(tmp_path: Path) -> None:
    path = _toml(tmp_path, FILE)
    only_file = load_config(file=path, env={})
    assert (only_file.server.port, only_file.server.workers) == (1000, 3)
    assert only_file.data_dir == "/from/file"
    assert only_file.gpu.device == "cuda"

    file_env = load_config(file=path, env=ENV)
    assert (file_env.server.port, file_env.server.workers) == (2000, 5)
    assert file_env.data_dir == "/from/env"
    assert file_env.ssd.write_mode == "write-back"

    only_overrides = load_config(env={}, overrides={"server.port": "3000"})
    assert only_overrides.server.port == 3000
    assert only_overrides.server.host == "127.0.0.1"


def test_strata_config_names_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[server]\nport = 4242\n")
    assert load_config(env={"STRATA_CONFIG": str(path)}).server.port == 4242
    # an explicit file beats STRATA_CONFIG
    other = tmp_path / "other.toml"
    other.write_text("[server]\nport = 4343\n")
    assert load_config(file=other, env={"STRATA_CONFIG": str(path)}).server.port == 4343


def test_reads_the_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("STRATA_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STRATA_SERVER_PORT", "4444")
    monkeypatch.setenv("STRATA_SSD_ENABLED", "off")
    c = load_config()
    assert c.server.port == 4444
    assert c.ssd.enabled is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", True),
        ("true", True),
        ("Yes", True),
        ("on", True),
        ("0", False),
        ("FALSE", False),
        ("no", False),
        ("off", False),
    ],
)
def test_booleans_from_strings(text: str, expected: bool) -> None:
    assert load_config(env={"STRATA_SSD_SYNC_WRITES": text}).ssd.sync_writes is expected


def test_typed_values_from_toml(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        "[ssd]\nsync_writes = true\ncapacity_bytes = 65536\n"
        "[dram]\nhigh_watermark = 0.9\nlow_watermark = 0.5\ncapacity-bytes = 4194304\n",
    )
    c = load_config(file=path, env={})
    assert c.ssd.sync_writes is True
    assert c.ssd.capacity_bytes == 64 * KiB
    assert (c.dram.high_watermark, c.dram.low_watermark) == (0.9, 0.5)
    assert c.dram.capacity_bytes == 4 * MiB  # dashes in keys are accepted as underscores


# ---- sizes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("64KiB", 64 * KiB),
        ("1.5GiB", 3 * GiB // 2),
        ("100", 100),
        ("0", 0),
        ("100B", 100),
        ("1TiB", 1 << 40),
        ("4gib", 4 * GiB),
        (" 4 GiB ", 4 * GiB),
        ("4KB", 4000),
        ("2MB", 2_000_000),
        ("1GB", 10**9),
        (65536, 65536),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "GiB", "4G", "4 Gib bytes", "-1", "1e3", "four", "4.GiB", ".5GiB", "4XiB", "4 4GiB", -1],
)
def test_parse_size_rejects(text: str | int) -> None:
    with pytest.raises(InvalidArgument, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (GiB, "1GiB"),
        (3 * GiB // 2, "1.5GiB"),
        (512 * MiB, "512MiB"),
        (64 * KiB, "64KiB"),
        (100, "100B"),
        (1 << 40, "1TiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text
    assert parse_size(format_size(n)) == n


def test_sizes_in_every_layer(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[gpu]\ncapacity_bytes = "64KiB"\n')
    c = load_config(
        file=path,
        env={"STRATA_LIMITS_CHUNK_BYTES": "1MiB"},
        overrides={"io.background_bytes_per_s": "1.5GiB"},
    )
    assert c.gpu.capacity_bytes == 64 * KiB
    assert c.limits.chunk_bytes == MiB
    assert c.io.background_bytes_per_s == 3 * GiB // 2


# ---- unknown keys and bad types ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("bogus = 1\n", "bogus"),
        ("[bogus]\nx = 1\n", "bogus"),
        ("[server]\nbogus_port = 1\n", "bogus_port"),
        ("[dram.deeper]\nx = 1\n", "deeper"),
    ],
)
def test_unknown_keys_in_the_file(tmp_path: Path, toml: str, key: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"unknown config key.*{key}"):
        load_config(file=_toml(tmp_path, toml), env={})


def test_unknown_keys_in_env_and_overrides() -> None:
    with pytest.raises(InvalidArgument, match=r"dram.*bogus"):
        load_config(env={"STRATA_DRAM_BOGUS": "1"})
    with pytest.raises(InvalidArgument, match=r"server.*nope"):
        load_config(env={}, overrides={"server.nope": "1"})
    with pytest.raises(InvalidArgument, match="nope"):
        load_config(env={}, overrides={"nope": "1"})


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[server]\nport = "abc"\n', "server.port"),
        ("[server]\nport = 1.5\n", "server.port"),
        ("[server]\nport = true\n", "server.port"),
        ("[server]\nworkers = [1]\n", "server.workers"),
        ('[ssd]\nenabled = "maybe"\n', "ssd.enabled"),
        ("[ssd]\nenabled = 2\n", "ssd.enabled"),
        ('[dram]\nhigh_watermark = "high"\n', "dram.high_watermark"),
        ("[dram]\nhigh_watermark = true\n", "dram.high_watermark"),
        ("[dram]\ncapacity_bytes = true\n", "dram.capacity_bytes"),
        ("server = 5\n", "server"),
        ('[limits]\nlease_ttl_ms = "30s"\n', "limits.lease_ttl_ms"),
    ],
)
def test_bad_types_in_the_file(tmp_path: Path, toml: str, key: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(key)):
        load_config(file=_toml(tmp_path, toml), env={})


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"STRATA_SERVER_PORT": "http"}, "server.port"),
        ({"STRATA_IO_CONCURRENCY": "4.5"}, "io.concurrency"),
        ({"STRATA_SSD_SYNC_WRITES": "perhaps"}, "ssd.sync_writes"),
        ({"STRATA_DRAM_LOW_WATERMARK": "low"}, "dram.low_watermark"),
    ],
)
def test_bad_values_in_the_environment(env: dict[str, str], key: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(key)):
        load_config(env=env)


def test_bad_sizes_are_invalid(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="lots"):
        load_config(file=_toml(tmp_path, '[dram]\ncapacity_bytes = "lots"\n'), env={})
    with pytest.raises(InvalidArgument, match="negative"):
        load_config(file=_toml(tmp_path, "[dram]\ncapacity_bytes = -5\n"), env={})
    with pytest.raises(InvalidArgument, match="4 gigs"):
        load_config(env={"STRATA_DRAM_CAPACITY_BYTES": "4 gigs"})


@pytest.mark.parametrize(
    ("toml", "env"),
    [
        ('[dram]\ncapacity_bytes = "lots"\n', {}),
        ("[dram]\ncapacity_bytes = -5\n", {}),
        ("", {"STRATA_DRAM_CAPACITY_BYTES": "4 gigs"}),
    ],
    ids=["file-text", "file-negative", "env"],
)
def test_bad_sizes_name_the_key(tmp_path: Path, toml: str, env: dict[str, str]) -> None:
    with pytest.raises(InvalidArgument, match=r"dram\.capacity_bytes"):
        load_config(file=_toml(tmp_path, toml), env=env)


def test_overrides_that_clash() -> None:
    with pytest.raises(InvalidArgument, match="server"):
        load_config(env={}, overrides={"server": "5"})
    with pytest.raises(InvalidArgument, match="server"):
        load_config(env={}, overrides={"server": "5", "server.port": "1"})


def test_unreadable_or_invalid_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_config(file=tmp_path / "missing.toml", env={})
    with pytest.raises(InvalidArgument, match="TOML"):
        load_config(file=_toml(tmp_path, "[server\nport = 1\n"), env={})


@pytest.mark.parametrize("value", ["5", "true", "[1, 2]", "{ a = 1 }"])
def test_non_string_for_a_string_field(tmp_path: Path, value: str) -> None:
    with pytest.raises(InvalidArgument, match=r"server\.host"):
        load_config(file=_toml(tmp_path, f"[server]\nhost = {value}\n"), env={})


def test_fractional_bytes_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        load_config(file=_toml(tmp_path, "[ssd]\ncapacity_bytes = 1.5\n"), env={})


# ---- validate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "changes", "match"),
    [
        ("ssd", {"admission": "never"}, "ssd.admission"),
        ("ssd", {"write_mode": "write-around"}, "ssd.write_mode"),
        ("dram", {"low_watermark": 0.0}, "watermark"),
        ("dram", {"low_watermark": 0.96}, "watermark"),
        ("dram", {"high_watermark": 1.01}, "watermark"),
        ("dram", {"capacity_bytes": 1023 * KiB}, "dram.capacity_bytes"),
        ("limits", {"chunk_bytes": 0}, "chunk_bytes"),
        ("limits", {"max_keys_per_call": 0}, "max_keys_per_call"),
        ("limits", {"max_keys_per_call": -1}, "max_keys_per_call"),
        ("limits", {"chunk_bytes": 72 * MiB}, "max_message_bytes"),
        ("limits", {"max_message_bytes": 4 * MiB}, "max_message_bytes"),
        ("io", {"concurrency": 0}, "io.concurrency"),
    ],
)
def test_validate_rejects(section: str, changes: dict[str, object], match: str) -> None:
    base = StoreConfig()
    bad = dataclasses.replace(
        base, **{section: dataclasses.replace(getattr(base, section), **changes)}
    )
    with pytest.raises(InvalidArgument, match=re.escape(match)):
        bad.validate()
    # load_config validates the tree it builds
    overrides = {f"{section}.{key}": str(value) for key, value in changes.items()}
    with pytest.raises(InvalidArgument, match=re.escape(match)):
        load_config(env={}, overrides=overrides)


def test_validate_accepts_edges() -> None:
    c = load_config(
        env={},
        overrides={
            "dram.low_watermark": "1",
            "dram.high_watermark": "1",
            "dram.capacity_bytes": "1MiB",
            "limits.chunk_bytes": "1",
            "limits.max_message_bytes": str(1 + (1 << 16)),
            "ssd.admission": "second-hit",
        },
    )
    assert c.validate() is c
    assert c.dram.capacity_bytes == MiB


def test_a_wildcard_listen_address_is_not_advertised() -> None:
    import socket

    from kvstore.server import reachable_host

    assert reachable_host("127.0.0.1") == "127.0.0.1"
    for wildcard in ("0.0.0.0", "::", ""):
        assert reachable_host(wildcard) == socket.gethostname()
