"""SsdTier: round trips, restart, kill -9, on-disk corruption and the byte budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

import kvstore.tiers.ssd
from client.contract.page import HEADER_FIXED_BYTES, PageHeader, make_header
from client.contract.scope import KVLayout, Scope
from kvstore.errors import CapacityExhausted, Corrupt, InvalidArgument, Unavailable
from kvstore.tiers.rocks import HEADERS_CF, PAYLOADS_CF
from kvstore.tiers.ssd import SsdTier

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_tokens=16)


def make_scope() -> Scope:
    return Scope(
        model_id="test/tiny",
        weights_revision="w1",
        tokenizer_fingerprint="t1",
        kv_dtype="float16",
        layout=LAYOUT,
    )


def make_chain(count: int, marker: bytes = b"") -> list[tuple[PageHeader, bytes]]:
    """`count` chained pages of one scope; page i's payload repeats a text naming i.

    `marker`, if given, starts page 0's payload (and no other), so tests can find it on disk.
    """
    scope = make_scope()
    size = scope.page_payload_bytes
    pages: list[tuple[PageHeader, bytes]] = []
    parent = scope.digest
    for i in range(count):
        body = (marker if i == 0 else b"") + f"<page {i:05d} of the ssd tier test>".encode() * (
            size // 32 + 1
        )
        payload = body[:size]
        tokens = list(range(i * LAYOUT.page_tokens, (i + 1) * LAYOUT.page_tokens))
        header = make_header(scope, parent, tokens, payload)
        pages.append((header, payload))
        parent = header.key
    return pages


PAGE_BYTES = make_chain(1)[0][0].total_bytes


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "ssd"


@pytest.fixture
def tier(db_path: Path) -> Iterator[SsdTier]:
    t = SsdTier(db_path, 100 * PAGE_BYTES)
    yield t
    t.close()


def _flip_in_files(
    folder: Path, pattern: bytes, delta: int, suffixes: tuple[str, ...]
) -> list[str]:
    """Flip the byte `delta` past each occurrence of `pattern` in the named files; their names."""
    hit: list[str] = []
    for path in sorted(folder.rglob("*")):
        if path.suffix not in suffixes:
            continue
        data = path.read_bytes()
        at = data.find(pattern)
        if at < 0:
            continue
        with open(path, "r+b") as fh:
            fh.seek(at + delta)
            fh.write(bytes([data[at + delta] ^ 0x5A]))
        hit.append(path.name)
    return hit


def test_round_trip(tier: SsdTier) -> None:
    (header, payload), (other, _) = make_chain(2)
    assert tier.read(header.key) is None
    assert tier.write(header, payload) == header.total_bytes
    got = tier.read(header.key)
    assert got is not None
    assert got[0] == header
    assert got[1] == payload
    assert tier.contains(header.key)
    assert not tier.contains(other.key)
    assert tier.pages == 1
    assert tier.used_bytes == header.total_bytes
    # Idempotent: a second write of the same page changes nothing.
    assert tier.write(header, memoryview(bytearray(payload))) == header.total_bytes
    assert tier.used_bytes == header.total_bytes and tier.pages == 1
    assert tier.delete(header.key) == header.total_bytes
    assert tier.delete(header.key) == 0
    assert tier.read(header.key) is None
    assert tier.used_bytes == 0 and tier.pages == 0


def test_bad_arguments(tier: SsdTier) -> None:
    header, payload = make_chain(1)[0]
    with pytest.raises(InvalidArgument):
        tier.write(header, payload[:-1])
    with pytest.raises(InvalidArgument):
        tier.read(b"short")
    assert tier.used_bytes == 0


def test_a_restart_scan_names_the_scopes_of_its_pages_and_forgets_the_rest(db_path: Path) -> None:
    pages = make_chain(3)
    digest = pages[0][0].scope_digest
    gone = b"\x01" * 16  # a scope none of whose pages is on the tier
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    tier.name_scope(digest, "tenant-a")
    tier.name_scope(gone, "tenant-b")
    for header, payload in pages:
        tier.write(header, payload)
    tier.close()
    for expected in ({digest: "tenant-a"}, {digest: "tenant-a"}):  # the second: after pruning
        tier = SsdTier(db_path, 100 * PAGE_BYTES)
        try:
            assert tier.scan().namespaces == expected
        finally:
            tier.close()
    db = Rdict(
        str(db_path),
        Options(raw_mode=True),
        column_families={HEADERS_CF: Options(raw_mode=True), PAYLOADS_CF: Options(raw_mode=True)},
    )
    try:
        assert db.get(b"strata/namespace/" + gone) is None  # pruned from disk, not just hidden
        assert db.get(b"strata/namespace/" + digest) == b"tenant-a"
    finally:
        db.close()


def test_restart_rebuilds_from_headers(db_path: Path) -> None:
    pages = make_chain(5)
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    for header, payload in pages:
        tier.write(header, payload)
    tier.close()
    with pytest.raises(Unavailable):
        tier.read(pages[0][0].key)

    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    try:
        with pytest.raises(Unavailable, match="scan"):
            tier.contains(pages[0][0].key)
        result = tier.scan()
        assert result.dropped == 0 and result.complete
        assert sorted(h.key for h in result.headers) == sorted(h.key for h, _ in pages)
        assert set(result.headers) == {h for h, _ in pages}
        assert tier.used_bytes == sum(h.total_bytes for h, _ in pages)
        assert tier.pages == 5
        for header, payload in pages:
            assert tier.read(header.key) == (header, payload)
    finally:
        tier.close()


_KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_ssd_tier import make_chain
from kvstore.tiers.rocks import HEADERS_CF, PAYLOADS_CF
from kvstore.tiers.ssd import SsdTier
tier = SsdTier(Path({db!r}), 1 << 30)
for header, payload in make_chain({n}):
    tier.write(header, payload)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_pages_survive_kill_9(db_path: Path) -> None:
    n = 20
    script = _KILL_SCRIPT.format(tests=str(Path(__file__).parent), db=str(db_path), n=n)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    tier = SsdTier(db_path, 1 << 30)
    try:
        result = tier.scan()
        assert result.dropped == 0
        assert len(result.headers) == n
        for header, payload in make_chain(n):
            assert tier.read(header.key) == (header, payload)
    finally:
        tier.close()


def test_flipped_payload_byte_is_corrupt(db_path: Path) -> None:
    marker = b"@@STRATA-PAYLOAD-MARKER-7f3a9c@@"
    (header, payload), (good, good_payload) = make_chain(2, marker=marker)
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    tier.write(header, payload)
    tier.write(good, good_payload)
    tier.close()
    hit = _flip_in_files(db_path, marker, 5, (".seg", ".blob", ".sst"))
    assert hit == ["00000001.seg"], hit  # payloads live in segment files, never in RocksDB

    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    try:
        result = tier.scan()  # the header is intact: the payload is only checked on read
        assert {h.key for h in result.headers} == {header.key, good.key}
        with pytest.raises(Corrupt):
            tier.read(header.key)
        assert tier.read(good.key) == (good, good_payload)
        assert tier.delete(header.key) == header.total_bytes  # what the caller does next
        assert tier.read(header.key) is None
    finally:
        tier.close()


def test_flipped_header_byte_is_dropped_by_scan(db_path: Path) -> None:
    pages = make_chain(30)
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    for header, payload in pages:
        tier.write(header, payload)
    tier.close()
    bad = pages[1][0]
    # Flip a byte of the token ids inside the stored header (not the key, not the magic).
    hit = _flip_in_files(db_path, bad.encode(), HEADER_FIXED_BYTES + 1, (".sst",))
    assert hit, "header not found in any SST file"

    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    try:
        with pytest.raises(Corrupt):
            tier.read(bad.key)  # RocksDB's block checksum or the header checksum
        result = tier.scan()
        assert result.dropped == 1 and result.complete
        good = [page for page in pages if page[0] != bad]
        assert {h.key for h in result.headers} == {h.key for h, _ in good}
        assert tier.used_bytes == sum(h.total_bytes for h, _ in good)
        assert tier.read(bad.key) is None
        # The neighbours in the damaged block were salvaged, not lost.
        for header, payload in good:
            assert tier.read(header.key) == (header, payload)
        # The damaged file is gone, so compactions and writes keep working.
        tier._require_open().headers.compact_range(None, None)
        for header, payload in make_chain(35)[30:]:
            tier.write(header, payload)
        tier.flush()
    finally:
        tier.close()
    assert HEADERS_CF not in Rdict.list_cf(str(db_path))
    tier = SsdTier(db_path, 100 * PAGE_BYTES)  # the drop and the salvage are durable
    try:
        result = tier.scan()
        assert result.dropped == 0 and len(result.headers) == 34
        assert tier.read(pages[2][0].key) == pages[2]
    finally:
        tier.close()


def test_headers_family_left_by_an_interrupted_salvage_is_dropped(db_path: Path) -> None:
    pages = make_chain(3)
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    for header, payload in pages:
        tier.write(header, payload)
    tier.close()
    families = {HEADERS_CF: Options(raw_mode=True), PAYLOADS_CF: Options(raw_mode=True)}
    db = Rdict(str(db_path), Options(raw_mode=True), column_families=families)
    leftover = db.create_column_family(HEADERS_CF + ".1", Options(raw_mode=True))
    leftover[pages[0][0].key] = b"half-copied"
    del leftover
    db.close()
    del db

    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    try:
        assert sorted(Rdict.list_cf(str(db_path))) == ["default", HEADERS_CF, PAYLOADS_CF]
        result = tier.scan()
        assert result.dropped == 0
        assert {h.key for h in result.headers} == {h.key for h, _ in pages}
        assert tier.read(pages[0][0].key) == pages[0]
    finally:
        tier.close()


def test_missing_payload_is_caught(tier: SsdTier) -> None:
    (header, payload), (other, other_payload) = make_chain(2)
    tier.write(header, payload)
    tier.write(other, other_payload)
    tier._require_open().payloads.delete(header.key)  # white box: lose the payload only
    with pytest.raises(Corrupt, match="missing"):
        tier.read(header.key)
    result = tier.scan()
    assert result.dropped == 1
    assert [h.key for h in result.headers] == [other.key]
    assert tier.used_bytes == other.total_bytes


def test_capacity_is_enforced(db_path: Path) -> None:
    pages = make_chain(3)
    tier = SsdTier(db_path, 2 * PAGE_BYTES + PAGE_BYTES // 2)
    try:
        for header, payload in pages[:2]:
            tier.write(header, payload)
        header, payload = pages[2]
        with pytest.raises(CapacityExhausted) as info:
            tier.write(header, payload)
        assert info.value.retryable
        assert tier.used_bytes == 2 * PAGE_BYTES
        assert tier.pages == 2
        assert not tier.contains(header.key)
        assert tier.read(header.key) is None
        assert tier.delete(pages[0][0].key) == PAGE_BYTES
        assert tier.write(header, payload) == PAGE_BYTES
        assert tier.read(header.key) == (header, payload)
        assert tier.used_bytes == 2 * PAGE_BYTES
    finally:
        tier.close()


# ---- payload segment files ----------------------------------------------------------------------


def _segment_files(db_path: Path) -> list[str]:
    return sorted(p.name for p in (db_path / "segments").glob("*.seg"))


def test_sparse_segments_are_compacted_and_empty_ones_deleted(db_path: Path) -> None:
    tier = SsdTier(db_path, 400 * PAGE_BYTES)
    n = tier._files._segment_bytes // make_scope().page_payload_bytes  # payloads per file
    pages = make_chain(3 * n + 2)
    try:
        for header, payload in pages[: 3 * n]:
            tier.write(header, payload)
        assert len(_segment_files(db_path)) == 3
        for header, _ in pages[:n]:  # all of the first file: it goes at once
            tier.delete(header.key)
        assert "00000001.seg" not in _segment_files(db_path)
        for header, _ in pages[n : 2 * n - 5]:  # most of the second: compacted in steps
            tier.delete(header.key)
        assert "00000002.seg" in _segment_files(db_path)
        tier.write(*pages[3 * n])
        assert "00000002.seg" in _segment_files(db_path)  # a write never compacts
        step = 2 * make_scope().page_payload_bytes  # two pages per step: a bounded step
        assert tier.compact_step(step) == step
        assert "00000002.seg" in _segment_files(db_path)  # 3 of its 5 live pages left
        steps = 1
        while tier.compact_step(step):
            steps += 1
            assert steps < 10
        assert steps == 3  # 2 + 2 + 1 pages
        assert "00000002.seg" not in _segment_files(db_path)
        files = tier._files
        assert files.disk_bytes <= 2 * tier.used_bytes + files._segment_bytes
        live = pages[2 * n - 5 : 3 * n + 1]
        for header, payload in live:
            assert tier.read(header.key) == (header, payload)
    finally:
        tier.close()
    tier = SsdTier(db_path, 400 * PAGE_BYTES)  # the moved locations are durable
    try:
        result = tier.scan()
        assert result.dropped == 0 and {h.key for h in result.headers} == {h.key for h, _ in live}
        for header, payload in live:
            assert tier.read(header.key) == (header, payload)
    finally:
        tier.close()


def test_a_read_racing_a_compaction_finds_the_moved_payload(db_path: Path) -> None:
    tier = SsdTier(db_path, 400 * PAGE_BYTES)
    n = tier._files._segment_bytes // make_scope().page_payload_bytes
    pages = make_chain(2 * n + 1)
    try:
        for header, payload in pages[: 2 * n]:
            tier.write(header, payload)
        target, target_payload = pages[10]
        for header, _ in pages[:n]:
            if header is not target:
                tier.delete(header.key)
        real_read = tier._files.read_into
        raced = []

        def read_after_a_compaction(seg: int, offset: int, length: int, dest: memoryview) -> None:
            if not raced:  # between the location lookup and the read, the page moves
                raced.append(seg)
                tier._files.read_into = real_read  # type: ignore[method-assign]
                tier.write(*pages[2 * n])
                assert tier.compact_step() > 0  # segment 1 (one page live) is compacted
                assert f"{seg:08d}.seg" not in _segment_files(db_path)
            real_read(seg, offset, length, dest)

        tier._files.read_into = read_after_a_compaction  # type: ignore[method-assign]
        assert tier.read(target.key) == (target, target_payload)
        assert raced == [1]
    finally:
        tier.close()


def test_location_beyond_its_segment_file_is_dropped_by_scan(db_path: Path) -> None:
    pages = make_chain(3)
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    for header, payload in pages:
        tier.write(header, payload)
    tier.close()
    segment = db_path / "segments" / "00000001.seg"
    with open(segment, "r+b") as fh:  # a torn tail: the last payload is cut short
        fh.truncate(segment.stat().st_size - 100)
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    try:
        result = tier.scan()
        assert result.dropped == 1
        assert {h.key for h in result.headers} == {h.key for h, _ in pages[:2]}
        for header, payload in pages[:2]:
            assert tier.read(header.key) == (header, payload)
        assert tier.read(pages[2][0].key) is None
        tier.write(*pages[2])  # written again, into a new file
        assert tier.read(pages[2][0].key) == pages[2]
        assert _segment_files(db_path) == ["00000001.seg", "00000002.seg"]
    finally:
        tier.close()


def test_segments_on_a_file_system_without_direct_io(tmp_path: Path) -> None:
    """tmpfs refuses O_DIRECT: reads fall back to buffered ones."""
    folder = Path("/dev/shm") / f"strata-test-{os.getpid()}-{tmp_path.name}"
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    try:
        tier = SsdTier(folder, 100 * PAGE_BYTES)
        try:
            pages = make_chain(5)
            for header, payload in pages:
                tier.write(header, payload)
            for header, payload in pages:
                assert tier.read(header.key) == (header, payload)
        finally:
            tier.close()
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_read_into_with_the_known_header_reads_only_the_payload(tier: SsdTier) -> None:
    (header, payload), (other, other_payload) = make_chain(2)
    tier.write(header, payload)
    tier.write(other, other_payload)
    headers_family = tier._require_open().headers
    del headers_family[header.key]  # white box: the stored header is not consulted
    import mmap

    dest = mmap.mmap(-1, 1 << 20)
    try:
        assert tier.read_into(header.key, memoryview(dest), header) == header
        assert dest[: len(payload)] == payload
        with pytest.raises(InvalidArgument):
            tier.read_into(header.key, memoryview(dest), other)  # another page's header
        small = bytearray(len(other_payload))
        assert tier.read_into(other.key, memoryview(small), other) == other
        assert bytes(small) == other_payload
        tier.delete(other.key)
        assert tier.read_into(other.key, memoryview(small), other) is None
    finally:
        dest.close()


def test_the_memory_of_recorded_namespaces_is_bounded(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvstore.tiers.ssd, "_NAMED_MEMORY", 4)
    pages = make_chain(1)
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    try:
        for i in range(20):
            tier.name_scope(bytes([i]) * 16, f"ns-{i}")
        assert len(tier._named) <= 4
        tier.name_scope(pages[0][0].scope_digest, "tenant-a")
        tier.write(*pages[0])
    finally:
        tier.close()
    tier = SsdTier(db_path, 100 * PAGE_BYTES)
    try:  # the records are all on disk; the scan keeps the one with a page
        assert tier.scan().namespaces == {pages[0][0].scope_digest: "tenant-a"}
    finally:
        tier.close()
