"""The SSD tier's RocksDB layout: column families, opening, header iteration and salvage.

Two column families share the 16-byte page key: the headers family holds each page's encoded
PageHeader (small, so a restart scan reads these and not the payloads) and `payloads` holds
where the payload is in the tier's segment files (kvstore/tiers/segments.py): payloads never
pass through RocksDB, its compactions or its block cache. Nothing is compressed: the values are
mostly digests and offsets.

The default family also holds the namespace of each scope digest the tier's pages may carry
(`_NAMESPACE_PREFIX` + digest -> namespace, written once per digest before its pages), so a
restart knows whose pages it rebuilt (quotas, Watch filtering, deletes by key under auth).

Salvage: a damaged block in an SST file of the headers would make every later compaction of that
file fail, and RocksDB then refuses all writes. So the scan copies every header that passes its
own checks into a fresh headers family (`headers.<generation>`), switches to it with one synced
write of a pointer in the default family, and drops the damaged one. A crash at any point leaves
either the old or the new family current; `open_rocks` drops the other.

rocksdict notes: everything is opened in raw mode (bytes in, bytes out, no pickling) and values
must be `bytes`. Column-family objects, handles and iterators each keep RocksDB open: a DB is only
closed (and its LOCK released) once all of them are gone. `items()` iterators stop silently on a
RocksDB error, so iteration here uses `iter()` and checks `status()`. RocksDB errors arrive as
plain `Exception`s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rocksdict import (
    ColumnFamily,
    DbClosedError,
    DBCompressionType,
    DBRecoveryMode,
    Options,
    Rdict,
    ReadOptions,
    WriteBatch,
    WriteOptions,
)

from kvstore.errors import Corrupt, Unavailable

__all__ = [
    "HEADERS_CF",
    "PAYLOADS_CF",
    "RocksHandles",
    "delete_namespaces",
    "has_headers",
    "iterate_headers",
    "open_rocks",
    "put_namespace",
    "read_namespaces",
    "rocks_error",
    "salvage_headers",
]

log = logging.getLogger(__name__)

HEADERS_CF = "headers"
PAYLOADS_CF = "payloads"
# In the default column family: the name of the current headers family.
_CURRENT_HEADERS_KEY = b"strata/current-headers-cf"
_SALVAGE_BATCH = 1024
# In the default family: the namespace (UTF-8) of a scope digest, under this prefix + digest.
_NAMESPACE_PREFIX = b"strata/namespace/"


@dataclass(frozen=True, slots=True)
class RocksHandles:
    """Everything that keeps one RocksDB instance open; drop all of it before `db.close()`."""

    db: Rdict
    headers_name: str
    headers: Rdict
    payloads: Rdict
    headers_cf: ColumnFamily
    payloads_cf: ColumnFamily


def rocks_error(what: str, exc: Exception, *, reading: bool = False) -> Corrupt | Unavailable:
    """Map a rocksdict exception: corruption met by a read -> Corrupt, anything else -> Unavailable."""
    if isinstance(exc, DbClosedError):
        return Unavailable(f"ssd tier is closed ({what})")
    message = str(exc)
    if reading and ("Corruption" in message or "checksum mismatch" in message.lower()):
        return Corrupt(f"ssd tier {what}: {message}")
    return Unavailable(f"ssd tier {what} failed: {message}")


def _is_headers(name: str) -> bool:
    return name == HEADERS_CF or name.startswith(HEADERS_CF + ".")


def _header_options() -> Options:
    opts = Options(raw_mode=True)
    opts.set_compression_type(DBCompressionType.none())
    return opts


def _payload_options() -> Options:
    """The payloads family holds each payload's location in the segment files (20 bytes)."""
    opts = Options(raw_mode=True)
    opts.set_compression_type(DBCompressionType.none())
    return opts


def open_rocks(path: Path) -> RocksHandles:
    """Open (or create) the database at `path`; drops a headers family left by a broken salvage.

    Raises Unavailable when RocksDB cannot open it (e.g. another process holds its LOCK).
    """
    db_opts = Options(raw_mode=True)
    db_opts.create_if_missing(True)
    db_opts.create_missing_column_families(True)
    db_opts.set_wal_recovery_mode(DBRecoveryMode.point_in_time())
    db_opts.set_keep_log_file_num(4)
    try:
        # RocksDB must open every existing column family, a leftover headers.N included.
        names = Rdict.list_cf(str(path)) if (path / "CURRENT").exists() else []
        families = {name: _header_options() for name in names if _is_headers(name)}
        if not families:
            families[HEADERS_CF] = _header_options()
        families[PAYLOADS_CF] = _payload_options()
        db = Rdict(str(path), db_opts, column_families=families)
    except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
        raise Unavailable(f"cannot open ssd tier at {path}: {exc}") from exc
    try:
        pointer = db.get(_CURRENT_HEADERS_KEY)
        current = pointer.decode() if isinstance(pointer, bytes) else HEADERS_CF
        if current not in families:
            db.create_column_family(current, _header_options())
        for name in families:
            if _is_headers(name) and name != current:
                log.warning("ssd tier: dropping %s, left by an interrupted salvage", name)
                db.drop_column_family(name)
        return RocksHandles(
            db=db,
            headers_name=current,
            headers=db.get_column_family(current),
            payloads=db.get_column_family(PAYLOADS_CF),
            headers_cf=db.get_column_family_handle(current),
            payloads_cf=db.get_column_family_handle(PAYLOADS_CF),
        )
    except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
        db.close()
        raise Unavailable(f"cannot open ssd tier at {path}: {exc}") from exc


def has_headers(h: RocksHandles) -> bool:
    """Whether the headers family holds any entry (True when RocksDB cannot tell). Pure.

    An iterator that hits a damaged block is merely not valid; its status tells the damage
    apart from an empty family (a damaged first block must not make the tier look empty and
    skip the scan that drops the damage and salvages the rest)."""
    it = h.headers.iter(ReadOptions())
    try:
        it.seek_to_first()
        if it.valid():
            return True
        it.status()  # raises on a RocksDB error
        return False
    except Exception:  # rocksdict reports RocksDB errors as plain Exception
        return True
    finally:
        del it


def iterate_headers(h: RocksHandles, verify: bool) -> tuple[list[tuple[bytes, bytes]], str | None]:
    """Every (key, header bytes) of the headers family in key order, and the error that ended it.

    `verify` turns RocksDB's block checksums on. Blocks read are not cached. Pure.
    """
    opts = ReadOptions()
    opts.set_verify_checksums(verify)
    opts.fill_cache(False)  # type: ignore[call-arg]  # the stub omits the argument
    entries: list[tuple[bytes, bytes]] = []
    it = h.headers.iter(opts)
    try:
        it.seek_to_first()
        while it.valid():
            entries.append((bytes(it.key()), bytes(it.value())))
            it.next()
        it.status()
    except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
        return entries, str(exc)
    finally:
        del it
    return entries, None


def salvage_headers(
    h: RocksHandles,
    keep: list[tuple[bytes, bytes]],
    bad: list[bytes],
    write_opts: WriteOptions,
) -> RocksHandles:
    """Move to a fresh headers family holding only `keep`; tombstone the payloads of `bad`.

    Mutates the database; returns the handles to use from now on (the old family is dropped).
    Raises Unavailable if RocksDB fails before the switch, which then has not happened.
    """
    _, _, suffix = h.headers_name.partition(".")
    new_name = f"{HEADERS_CF}.{int(suffix) + 1 if suffix.isdigit() else 1}"
    synced = WriteOptions()
    synced.sync = True
    try:
        if bad:  # their headers go with the old family; their payloads go first
            batch = WriteBatch(raw_mode=True)
            for key in bad:
                batch.delete(key, h.payloads_cf)
            h.db.write(batch, write_opts)
        new_headers = h.db.create_column_family(new_name, _header_options())
        new_cf = h.db.get_column_family_handle(new_name)
        for start in range(0, len(keep), _SALVAGE_BATCH):
            batch = WriteBatch(raw_mode=True)
            for key, value in keep[start : start + _SALVAGE_BATCH]:
                batch.put(key, value, new_cf)
            h.db.write(batch, write_opts)
        h.db.put(_CURRENT_HEADERS_KEY, new_name.encode(), synced)  # the switch
    except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
        raise rocks_error("salvage", exc) from exc
    try:
        h.db.drop_column_family(h.headers_name)
    except Exception as exc:  # it is dropped at the next open instead
        log.warning("ssd tier: cannot drop damaged %s yet: %s", h.headers_name, exc)
    log.warning("ssd tier: salvaged %d headers into %s", len(keep), new_name)
    return RocksHandles(
        db=h.db,
        headers_name=new_name,
        headers=new_headers,
        payloads=h.payloads,
        headers_cf=new_cf,
        payloads_cf=h.payloads_cf,
    )


def put_namespace(h: RocksHandles, digest: bytes, namespace: str, opts: WriteOptions) -> None:
    """Record that scope digest `digest` is of `namespace`. Mutates; raises Unavailable."""
    try:
        h.db.put(_NAMESPACE_PREFIX + digest, namespace.encode(), opts)
    except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
        raise rocks_error("namespace write", exc) from exc


def read_namespaces(h: RocksHandles) -> tuple[dict[bytes, str], str | None]:
    """Every recorded scope digest -> namespace, and the error that ended the read. Pure.

    A value that is not UTF-8 is left out (its digest then reads as unnamed)."""
    found: dict[bytes, str] = {}
    it = h.db.iter(ReadOptions())
    try:
        it.seek(_NAMESPACE_PREFIX)
        while it.valid():
            key = bytes(it.key())
            if not key.startswith(_NAMESPACE_PREFIX):
                break
            try:
                found[key[len(_NAMESPACE_PREFIX) :]] = bytes(it.value()).decode()
            except UnicodeDecodeError:
                log.warning("ssd tier: a namespace record that is not UTF-8 ignored")
            it.next()
        it.status()
    except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
        return found, str(exc)
    finally:
        del it
    return found, None


def delete_namespaces(h: RocksHandles, digests: list[bytes], opts: WriteOptions) -> None:
    """Forget the namespace records of `digests`. Mutates; raises Unavailable."""
    try:
        for start in range(0, len(digests), _SALVAGE_BATCH):
            batch = WriteBatch(raw_mode=True)
            for digest in digests[start : start + _SALVAGE_BATCH]:
                batch.delete(_NAMESPACE_PREFIX + digest)
            h.db.write(batch, opts)
    except Exception as exc:  # rocksdict reports RocksDB errors as plain Exception
        raise rocks_error("namespace delete", exc) from exc
