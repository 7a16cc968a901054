"""GpuTier: the slab on "cpu" here; the CUDA path runs where a GPU is present."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.tiers.gpu import STAGING_CHUNK_BYTES, GpuTier

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.unit

CAPACITY = 256 << 10
SLOT = 64 << 10

CUDA = torch.cuda.is_available()


@pytest.fixture
def tier() -> Iterator[GpuTier]:
    t = GpuTier(CAPACITY, "cpu")
    yield t
    t.close()


def test_round_trip_from_each_buffer_type(tier: GpuTier) -> None:
    assert tier.device == "cpu"
    assert tier.capacity_bytes == CAPACITY
    for src in (os.urandom(5000), bytearray(os.urandom(SLOT)), memoryview(os.urandom(777))):
        offset = tier.allocate(len(src))
        assert offset is not None
        tier.write(offset, src)
        assert tier.read(offset, len(src)) == bytes(src)
        tier.free(offset)
    assert tier.used_bytes == 0


def test_read_into_a_slice_of_a_host_buffer(tier: GpuTier) -> None:
    payload = os.urandom(3000)
    offset = tier.allocate(len(payload))
    assert offset is not None
    tier.write(offset, payload)
    host = bytearray(b"\xee" * 4000)
    tier.read_into(offset, len(payload), memoryview(host)[500:])
    assert host[:500] == b"\xee" * 500
    assert host[500:3500] == payload
    assert host[3500:] == b"\xee" * 500
    # Slots do not bleed into each other.
    other = tier.allocate(len(payload))
    assert other is not None
    tier.write(other, b"\x00" * len(payload))
    assert tier.read(offset, len(payload)) == payload


def test_allocate_until_full(tier: GpuTier) -> None:
    offsets = [tier.allocate(SLOT) for _ in range(CAPACITY // SLOT)]
    assert None not in offsets
    assert sorted(o for o in offsets if o is not None) == list(range(0, CAPACITY, SLOT))
    assert tier.used_bytes == CAPACITY
    assert tier.allocate(1) is None
    first = offsets[0]
    assert first is not None
    assert tier.free(first) == SLOT
    assert tier.allocate(SLOT) == first
    tier.check_integrity()


def test_bounds_are_checked(tier: GpuTier) -> None:
    offset = tier.allocate(4096)
    assert offset is not None
    with pytest.raises(InvalidArgument):
        tier.write(offset, b"x" * 4097)  # larger than the slot
    with pytest.raises(InvalidArgument):
        tier.write(offset + 4096, b"x")  # not an allocated slot
    with pytest.raises(InvalidArgument):
        tier.read(offset, 4097)
    with pytest.raises(InvalidArgument):
        tier.read_into(offset, 10, memoryview(bytearray(5)))
    with pytest.raises(InvalidArgument):
        tier.read_into(offset, 10, memoryview(bytes(10)))  # read-only destination
    with pytest.raises(InvalidArgument):
        tier.allocate(0)
    with pytest.raises(InvalidArgument):
        tier.allocate(CAPACITY + 1)


def test_closed_tier_is_unavailable() -> None:
    tier = GpuTier(CAPACITY, "cpu")
    offset = tier.allocate(10)
    assert offset is not None
    tier.close()
    tier.close()
    with pytest.raises(Unavailable):
        tier.write(offset, b"x")
    with pytest.raises(Unavailable):
        tier.read(offset, 1)
    with pytest.raises(Unavailable):
        tier.allocate(10)


def test_bad_devices() -> None:
    with pytest.raises(InvalidArgument):
        GpuTier(CAPACITY, "not-a-device")
    with pytest.raises(InvalidArgument):
        GpuTier(CAPACITY, "meta")


@pytest.mark.skipif(CUDA, reason="CUDA is present here")
def test_cuda_requested_without_cuda_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="CUDA is not available"):
        GpuTier(CAPACITY, "cuda")
    with pytest.raises(Unavailable, match="CUDA is not available"):
        GpuTier(CAPACITY, "cuda:0")


def test_missing_torch_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    with pytest.raises(Unavailable, match="needs torch"):
        GpuTier(CAPACITY, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_round_trip_across_staging_chunks() -> None:
    tier = GpuTier(64 << 20, "cuda")
    try:
        assert tier.device.startswith("cuda:")
        assert tier.slab.is_cuda
        nbytes = 2 * STAGING_CHUNK_BYTES + 12345  # three chunks, the last one partial
        payload = os.urandom(nbytes)
        offset = tier.allocate(nbytes)
        assert offset is not None
        tier.write(offset, payload)
        assert tier.read(offset, nbytes) == payload
        small = tier.allocate(100)
        assert small is not None
        tier.write(small, b"q" * 100)
        out = bytearray(100)
        tier.read_into(small, 100, memoryview(out))
        assert out == b"q" * 100
        # The bytes really are on the device.
        assert bytes(tier.slab[small : small + 100].cpu().tolist()) == b"q" * 100
    finally:
        tier.close()
