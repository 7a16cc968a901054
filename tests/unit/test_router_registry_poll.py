"""The registry's periodic polls: a worker that does not answer holds only its own poll, never
the other workers' reports (a poll round that waited for every call let one stopped worker age
every report past `drop_after_s`, and the router dropped them all)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from engine.router.registry import Registry, WorkerHandle
from kvstore_pb import engine_pb2 as pb

pytestmark = pytest.mark.unit


@dataclass
class Stub:
    """A worker's `Load`: answers at once, or never (`silent`)."""

    silent: bool = False
    calls: int = 0
    never: asyncio.Event = field(default_factory=asyncio.Event)

    async def Load(self, request: pb.LoadRequest, timeout: float) -> pb.LoadReport:
        self.calls += 1
        if self.silent:
            await self.never.wait()  # a stopped process: the call waits out its deadline
        return pb.LoadReport(accepting=True, free_pages=10)


def test_a_silent_worker_does_not_age_the_other_reports() -> None:
    now = [0.0]
    registry = Registry(poll_s=0.01, drop_after_s=0.05, clock=lambda: now[0])
    stubs = {"a:1": Stub(), "b:1": Stub(silent=True)}
    for address, stub in stubs.items():
        handle = WorkerHandle(address, cast(Any, None), "static")
        handle.description = pb.WorkerDescription(role="decode", model_id="m", page_tokens=16)
        handle.stubs["worker"] = stub
        registry.workers[address] = handle

    async def rounds() -> list[str]:
        polling: dict[str, asyncio.Task[None]] = {}
        for step in range(1, 6):
            now[0] = 0.1 * step  # every round is twice drop_after_s after the last
            await registry.poll_round(polling)
        live = [h.address for h in registry.live()]
        for task in polling.values():
            task.cancel()
        return live

    live = asyncio.run(rounds())
    assert live == ["a:1"]  # the answering worker's report is fresh, the silent one dropped
    assert registry.workers["a:1"].report_at == pytest.approx(0.5)
    assert stubs["a:1"].calls == 5
    assert stubs["b:1"].calls == 1  # its first poll still waits: never one on top of it
    assert registry.polls == 5
