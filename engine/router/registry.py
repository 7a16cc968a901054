"""The router's view of its workers: who they are (`Describe`) and how loaded (`Load`, polled).

Workers come from a static list (flags or the config file) and, with etcd, from the leased keys
workers register under (`engine.router.membership`). One asyncio task polls every worker's
unary `Load` every `poll_s` (in parallel, each call with a deadline; a worker whose last poll
has not ended is skipped, so a silent one does not hold up the others'); the first successful
contact also calls `Describe`, and the first worker of each model sends its tokenizer files too,
from which the router builds the model's `ModelText` and `Scope`. A worker whose last report is
older than `drop_after_s` — it went silent, died, or its host is unreachable — is left out of
every decision until it answers again, so a dead worker is dropped within
`drop_after_s + rpc_timeout_s` at most. A worker the dispatcher saw fail is also left out
(`mark_failed`) until a later poll finds it answering.

`views(now)` copies the live workers into the core's frozen `WorkerView`s: the snapshot a
decision is made on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from client import KVLayout, Scope, Shard
from engine.router.chat import ModelText
from engine.router.core.types import Role, WorkerView
from kvstore_pb import engine_pb2 as pb
from kvstore_pb import engine_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # a Describe with a real model's tokenizer.json (~10 MB) fits


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router needs of a served model: its scope (namespace ""), text side, limits."""

    model_id: str
    scope: Scope
    text: ModelText
    max_context: int
    vocab_size: int
    created: int

    @property
    def page_tokens(self) -> int:
        return self.scope.layout.page_tokens

    @property
    def page_bytes(self) -> int:
        return self.scope.page_payload_bytes


def scope_of(d: pb.WorkerDescription) -> Scope:
    """The Scope a worker keys its pages under (namespace ""), from its description."""
    return Scope(
        model_id=d.model_id,
        weights_revision=d.weights_revision,
        tokenizer_fingerprint=d.tokenizer_fingerprint,
        kv_dtype=d.kv_dtype,
        layout=KVLayout(d.num_layers, d.num_kv_heads, d.head_dim, d.page_tokens),
        adapter_id=d.adapter_id,
        adapter_fingerprint=d.adapter_fingerprint,
        shard=Shard(d.tp_rank, d.tp_size or 1, d.pp_stage, d.pp_size or 1),
    )


@dataclass(eq=False)
class WorkerHandle:
    """One worker's channel, stubs and the latest of what it told the router."""

    address: str
    channel: grpc.aio.Channel
    source: str  # "static" or "etcd"
    description: pb.WorkerDescription | None = None
    report: pb.LoadReport | None = None
    report_at: float = -1.0e18
    failed_until: float = 0.0
    errors: int = 0
    last_error: str = ""
    stubs: dict[str, object] = field(default_factory=dict)

    @property
    def role(self) -> Role | None:
        return Role(self.description.role) if self.description is not None else None

    # The generated stubs are typed for blocking channels; over a grpc.aio channel their calls
    # return awaitables and async iterators, hence Any. Each is built once per handle (one per
    # channel: a new channel is a new handle), not on every RPC.
    def worker_stub(self) -> Any:
        return self._stub("worker", engine_pb2_grpc.WorkerStub)

    def prefill_stub(self) -> Any:
        return self._stub("prefill", engine_pb2_grpc.PrefillStub)

    def decode_stub(self) -> Any:
        return self._stub("decode", engine_pb2_grpc.DecodeStub)

    def _stub(self, kind: str, make: Callable[[grpc.aio.Channel], object]) -> Any:
        stub = self.stubs.get(kind)
        if stub is None:
            stub = self.stubs[kind] = make(self.channel)
        return stub


class Registry:
    """Workers by address. All methods run on the router's event loop."""

    def __init__(
        self,
        addresses: Iterable[str] = (),
        *,
        poll_s: float = 0.15,
        drop_after_s: float = 1.0,
        rpc_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if poll_s <= 0 or drop_after_s <= poll_s or rpc_timeout_s <= 0:
            raise ValueError("need poll_s > 0, drop_after_s > poll_s and rpc_timeout_s > 0")
        self.poll_s = poll_s
        self.drop_after_s = drop_after_s
        self.rpc_timeout_s = rpc_timeout_s
        self.clock = clock
        self.workers: dict[str, WorkerHandle] = {}
        self.models: dict[str, ModelInfo] = {}
        self._static = tuple(dict.fromkeys(addresses))
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self.polls = 0

    # ---- membership ---------------------------------------------------------------------

    def add(self, address: str, source: str = "static") -> None:
        if address in self.workers:
            return
        channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.enable_retries", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self.workers[address] = WorkerHandle(address, channel, source)
        log.info("worker %s added (%s)", address, source)

    async def remove(self, address: str) -> None:
        handle = self.workers.pop(address, None)
        if handle is not None:
            await handle.channel.close(grace=None)
            log.info("worker %s removed", address)

    def set_dynamic(self, addresses: Iterable[str]) -> list[str]:
        """Make the etcd-registered set `addresses`; returns the addresses to remove."""
        wanted = set(addresses)
        for address in sorted(wanted):
            self.add(address, "etcd")
        return [a for a, h in self.workers.items() if h.source == "etcd" and a not in wanted]

    # ---- polling ------------------------------------------------------------------------

    async def start(self) -> None:
        for address in self._static:
            self.add(address)
        await self.poll_once()
        self._task = asyncio.create_task(self._run(), name="strata-registry")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for address in list(self.workers):
            await self.remove(address)

    async def _run(self) -> None:
        polling: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(self.poll_s)
                try:
                    await self.poll_round(polling)
                except Exception:  # a bug: log it, keep polling
                    log.exception("registry poll failed")
        finally:
            for task in polling.values():
                task.cancel()

    async def poll_round(self, polling: dict[str, asyncio.Task[None]]) -> None:
        """One round of the periodic polls: every worker whose previous poll has ended is polled
        again (`polling` holds the polls in flight, by address, across rounds), and the round
        waits for them at most `poll_s`. A worker that does not answer (stopped, or its host
        gone: each call waits out its deadline, a Describe 5 s) so holds only its own polls,
        never the other workers' reports, which keep their age."""
        for address in [a for a, t in polling.items() if t.done() or a not in self.workers]:
            task = polling.pop(address)
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is not None:
                log.error("registry poll of %s failed", address, exc_info=task.exception())
        started = [
            polling.setdefault(a, asyncio.create_task(self._poll(h), name=f"strata-poll-{a}"))
            for a, h in list(self.workers.items())
            if a not in polling
        ]
        if started:
            await asyncio.wait(started, timeout=self.poll_s)
        self.polls += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def poll_once(self) -> None:
        """Ask every worker for its load (describing it first if needed), in parallel."""
        handles = list(self.workers.values())
        if handles:
            await asyncio.gather(*(self._poll(h) for h in handles))
        self.polls += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_poll(self) -> None:
        """Wait for the next completed poll round."""
        await self._changed.wait()

    async def _poll(self, h: WorkerHandle) -> None:
        stub = h.worker_stub()
        try:
            if h.description is None:
                timeout = max(5.0, self.rpc_timeout_s)
                described = await stub.Describe(pb.DescribeRequest(), timeout=timeout)
                if described.model_id not in self.models:  # the first of its model: its tokenizer
                    described = await stub.Describe(
                        pb.DescribeRequest(include_tokenizer=True), timeout=timeout
                    )
                self._learn(h, described)
            report = await stub.Load(pb.LoadRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if h.errors == 0 and h.report is not None:
                log.warning("worker %s stopped answering: %s", h.address, exc.code().name)
            h.errors += 1
            h.last_error = f"{exc.code().name}: {exc.details()}"
            if h.errors >= 3:
                h.description = None  # describe again when it answers (it may have restarted)
            return
        except ValueError as exc:  # a description the router cannot use: left out
            h.errors += 1
            if h.last_error != str(exc):
                log.warning("worker %s left out: %s", h.address, exc)
            h.last_error = str(exc)
            return
        if h.errors and h.report is not None:
            log.info("worker %s answers again", h.address)
        h.errors = 0
        h.last_error = ""
        h.report = report
        h.report_at = self.clock()
        if h.failed_until and h.report_at >= h.failed_until:
            h.failed_until = 0.0

    def _learn(self, h: WorkerHandle, d: pb.WorkerDescription) -> None:
        scope = scope_of(d)
        model = self.models.get(d.model_id)
        if model is None:
            if not d.tokenizer_json:
                raise ValueError("described itself without its tokenizer")
            text = ModelText(d.tokenizer_json, d.tokenizer_config_json, d.chat_template)
            if text.fingerprint != d.tokenizer_fingerprint:
                raise ValueError("its tokenizer.json does not match its tokenizer fingerprint")
            self.models[d.model_id] = ModelInfo(
                d.model_id, scope, text, d.max_context, d.vocab_size, int(time.time())
            )
            log.info("model %s served (page %d tokens)", d.model_id, d.page_tokens)
        elif model.scope != scope:
            raise ValueError(
                f"serves model {d.model_id} under another scope than the workers before it "
                "(different weights, tokenizer, dtype or page size)"
            )
        h.description = d
        log.info("worker %s is a %s worker of %s", h.address, d.role, d.model_id)

    # ---- decisions ----------------------------------------------------------------------

    def mark_failed(self, address: str, why: str) -> None:
        """Leave `address` out of decisions until a poll after `drop_after_s` finds it alive."""
        h = self.workers.get(address)
        if h is not None:
            h.failed_until = self.clock() + self.drop_after_s
            h.last_error = why
            log.warning("worker %s failed a request (%s); left out for now", address, why)

    def live(self, now: float | None = None) -> list[WorkerHandle]:
        """Workers that are described, accepting, reported within `drop_after_s`, not failed."""
        t = self.clock() if now is None else now
        return [
            h
            for h in self.workers.values()
            if h.description is not None
            and h.report is not None
            and h.report.accepting
            and t - h.report_at <= self.drop_after_s
            and t >= h.failed_until
        ]

    def views(self, model: str, now: float | None = None) -> tuple[WorkerView, ...]:
        """Frozen views of the live workers of `model`."""
        t = self.clock() if now is None else now
        out = []
        for h in self.live(t):
            d, r = h.description, h.report
            assert d is not None and r is not None
            if d.model_id != model:
                continue
            out.append(
                WorkerView(
                    worker_id=h.address,
                    role=Role(d.role),
                    host_id=d.host_id,
                    model=d.model_id,
                    page_tokens=d.page_tokens,
                    healthy=True,
                    queued_prefill_tokens=r.queued_prefill_tokens,
                    queued_requests=r.queued_requests,
                    running_requests=r.running_requests,
                    running_context_tokens=r.running_context_tokens,
                    free_pages=r.free_pages,
                    max_batch=max(1, d.max_batch),
                    report_age_s=max(0.0, t - h.report_at),
                    running_remaining_tokens=tuple(r.running_remaining_tokens),
                    step_token_budget=d.step_token_budget if d.role == Role.colocated else 0,
                    queued_are_prompts=True,  # workers count queued requests' whole prompts
                )
            )
        return tuple(out)

    def counts(self) -> dict[str, int]:
        """Live workers by role."""
        out = {r.value: 0 for r in Role}
        for h in self.live():
            assert h.description is not None
            out[h.description.role] += 1
        return out
