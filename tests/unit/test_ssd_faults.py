"""SSD fault injection: the hook chaos runs and the slow-disk measurement rely on, and the SSD
tier's answers to a disk that really fails."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from kvstore.config import load_config
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.tiers.faults import SsdFaults, faults_from_config
from kvstore.tiers.ssd import SsdTier
from tests.unit.test_ssd_tier import PAGE_BYTES, make_chain

pytestmark = pytest.mark.unit


def test_config_from_environment_reaches_the_tier(tmp_path: Path) -> None:
    config = load_config(
        env={
            "STRATA_SSD_FAULT_READ_ERROR_RATE": "1",
            "STRATA_SSD_FAULT_WRITE_DELAY_MS": "30",
        }
    )
    faults = faults_from_config(config.ssd)
    assert faults.read_error_rate == 1.0 and faults.write_delay_ms == 30 and faults.active
    assert not faults_from_config(load_config(env={}).ssd).active
    with pytest.raises(InvalidArgument):
        load_config(env={"STRATA_SSD_FAULT_READ_ERROR_RATE": "1.5"})
    with pytest.raises(InvalidArgument):
        load_config(env={"STRATA_SSD_FAULT_WRITE_DELAY_MS": "-1"})

    tier = SsdTier(tmp_path / "ssd", 100 * PAGE_BYTES, faults=faults)
    try:
        (header, payload), *_ = make_chain(1)
        started = time.monotonic()
        tier.write(header, payload)
        assert time.monotonic() - started >= 0.03  # the write waited for the slow disk
        with pytest.raises(Unavailable, match="injected"):
            tier.read(header.key)
        tier.faults = SsdFaults()  # the test hook: faults can be switched off at run time
        got = tier.read(header.key)
        assert got is not None and got[1] == payload
    finally:
        tier.close()


def test_error_rate_is_seeded_and_partial() -> None:
    a = SsdFaults(read_error_rate=0.5, seed=7)
    b = SsdFaults(read_error_rate=0.5, seed=7)

    def outcomes(f: SsdFaults) -> list[bool]:
        out = []
        for _ in range(200):
            try:
                f.before_read("x")
                out.append(True)
            except Unavailable:
                out.append(False)
        return out

    first = outcomes(a)
    assert first == outcomes(b)
    assert 40 < first.count(False) < 160


def test_write_error_leaves_the_tier_consistent(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path / "ssd", 100 * PAGE_BYTES, faults=SsdFaults(write_error_rate=1.0))
    try:
        (header, payload), *_ = make_chain(1)
        with pytest.raises(Unavailable):
            tier.write(header, payload)
        assert tier.pages == 0 and tier.used_bytes == 0
        assert tier.read(header.key) is None
    finally:
        tier.close()


def test_a_segment_file_replaced_by_a_directory_fails_reads_as_unavailable(
    tmp_path: Path,
) -> None:
    """A real failing file: the segment's path becomes a directory (EISDIR on open, even for
    root), so the read fails with an I/O error, not a checksum failure."""
    tier = SsdTier(tmp_path / "ssd", 100 * PAGE_BYTES)
    try:
        pages = make_chain(3)
        for header, payload in pages:
            tier.write(header, payload)
        tier.flush()
        tier._files.close()  # drop cached descriptors so the next read opens the path again
        segs = sorted((tmp_path / "ssd" / "segments").glob("*.seg"))
        assert segs
        for seg in segs:
            os.unlink(seg)
            os.mkdir(seg)
        with pytest.raises(Unavailable):
            tier.read(pages[0][0].key)
        for seg in segs:
            shutil.rmtree(seg)
    finally:
        tier.close()


def test_sync_writes_syncs_payloads_and_the_names_of_new_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sync_writes=True: every write's payload is fdatasync'ed before its record, and each new
    segment file's directory entry (and the new folders') are fsync'ed, so a power loss cannot
    leave a record naming a file that is not there."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def named(fd: int) -> str:
        return os.readlink(f"/proc/self/fd/{fd}")

    def fsync(fd: int) -> None:
        calls.append(("fsync", named(fd)))
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        calls.append(("fdatasync", named(fd)))
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    root = tmp_path / "ssd"
    # 4 MiB budget: 1 MiB segment files, so 100 pages of 16 KiB roll over to new files
    tier = SsdTier(root, 4 << 20, sync_writes=True)
    try:
        pages = make_chain(100)
        for header, payload in pages[:3]:
            tier.write(header, payload)
        segs = str(root / "segments")
        assert ("fsync", str(tmp_path)) in calls  # the new tier folder's own entry
        assert ("fsync", str(root)) in calls  # the new segments folder's entry
        assert ("fsync", segs) in calls  # the first segment file's entry
        first = str(root / "segments" / "00000001.seg")
        assert calls.count(("fdatasync", first)) == 3  # one per write, before its record
        calls.clear()
        for header, payload in pages[3:]:
            tier.write(header, payload)
        made = sorted(p.name for p in (root / "segments").glob("*.seg"))
        assert len(made) >= 2
        # every file created after the first got its directory entry synced
        assert calls.count(("fsync", segs)) >= len(made) - 1
        for name in made:
            assert ("fdatasync", f"{segs}/{name}") in calls
    finally:
        tier.close()
    # and the pages are all there after a reopen (a real run with sync_writes)
    again = SsdTier(root, 4 << 20, sync_writes=True)
    try:
        assert len(again.scan().headers) == 100
        for header, payload in pages:
            got = again.read(header.key)
            assert got is not None and got[1] == payload
    finally:
        again.close()


def test_without_sync_writes_nothing_is_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append(fd))
    tier = SsdTier(tmp_path / "ssd", 4 << 20)
    try:
        for header, payload in make_chain(3):
            tier.write(header, payload)
        assert calls == []
    finally:
        tier.close()
