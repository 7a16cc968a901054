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
