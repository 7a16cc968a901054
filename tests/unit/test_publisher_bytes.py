"""The publisher's queue is bounded in payload bytes as well as in pages (4096 pages of 2 MiB
would otherwise queue 8 GiB)."""

from __future__ import annotations

import threading

import pytest

from client import KVLayout, Scope
from engine.publisher import Publisher, PublishJob

pytestmark = pytest.mark.unit

SCOPE = Scope(
    model_id="m",
    weights_revision="w",
    tokenizer_fingerprint="t",
    kv_dtype="float16",
    layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4),
)


def job(pages: int) -> PublishJob:
    size = SCOPE.page_payload_bytes
    return PublishJob(
        SCOPE,
        SCOPE.digest,
        tuple(tuple(range(i * 4, i * 4 + 4)) for i in range(pages)),
        tuple(bytes([i]) * size for i in range(pages)),
    )


def test_a_job_beyond_the_byte_bound_is_dropped() -> None:
    release = threading.Event()

    def slow_put(j: PublishJob) -> tuple[int, int]:
        release.wait(10)
        return len(j.payloads), 0

    size = SCOPE.page_payload_bytes
    publisher = Publisher(slow_put, max_pending_pages=1000, max_pending_bytes=5 * size)
    try:
        first, second = publisher.submit(job(3)), publisher.submit(job(2))
        dropped = publisher.submit(job(1))  # 6 pages' bytes would be pending: dropped
        assert first.queued and second.queued and not dropped.queued
        release.set()
        assert publisher.drain(10)
        assert publisher.submit(job(5)).queued  # the bytes were given back as jobs finished
        assert publisher.drain(10)
    finally:
        release.set()
        publisher.close(1)
