"""The gRPC edge of the engine workers: servicers, `create_server`, and `EngineServer`.

The servicers only convert messages (`engine.wire`) and map errors to status codes:
InvalidRequest → INVALID_ARGUMENT, EngineStopping → UNAVAILABLE, EngineBusy →
RESOURCE_EXHAUSTED, anything else → INTERNAL (logged). A decode stream whose caller goes away
is cancelled in the worker, freeing its pages; one asked for `batch_s` sends its tokens in
batches (`batched`).

`EngineServer(config)` loads the model, connects the store client, builds the worker of
`config.role` and serves it; `stop()` is what SIGTERM runs: stop accepting, let in-flight work
finish (bounded by `drain_timeout_s`), finish publishing, close.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client import ClusterClient, StoreClient, StrataError, host_id
from engine.colocated import ColocatedWorker
from engine.decode import DecodeWorker
from engine.errors import EngineBusy, EngineStopping, InvalidRequest
from engine.prefill import PrefillWorker
from engine.requests import TokenEvent
from engine.router.membership import WorkerRegistration, encode_record
from engine.runtime import ModelRuntime
from engine.store_link import PageStore
from engine.store_spec import parse_store
from engine.wire import (
    decode_request_from_proto,
    prefill_response,
    sampling_from_proto,
    token_event_to_proto,
)
from engine.worker_config import WorkerConfig
from kvstore_pb import engine_pb2 as pb
from kvstore_pb import engine_pb2_grpc

log = logging.getLogger(__name__)

PREFILL_SERVICE = "strata.engine.v1.Prefill"
DECODE_SERVICE = "strata.engine.v1.Decode"
WORKER_SERVICE = "strata.engine.v1.Worker"

Worker = PrefillWorker | DecodeWorker | ColocatedWorker

_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (EngineStopping, grpc.StatusCode.UNAVAILABLE),
    (EngineBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    """End the call with the status code of `exc` (raises, as context.abort does)."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            context.abort(code, str(exc))
    log.exception("request failed", exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


class PrefillLoad:
    """The prompt tokens of the prefills a worker has accepted and not answered (thread-safe):
    the prefill worker's queue, as the router's load reports give it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens = 0
        self.requests = 0
        self.served = 0

    def enter(self, tokens: int) -> None:
        with self._lock:
            self.tokens += tokens
            self.requests += 1

    def exit(self, tokens: int) -> None:
        with self._lock:
            self.tokens -= tokens
            self.requests -= 1
            self.served += 1

    def snapshot(self) -> tuple[int, int, int]:
        """(queued tokens, requests in flight, requests answered)."""
        with self._lock:
            return self.tokens, self.requests, self.served


class PrefillServicer(engine_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, load: PrefillLoad | None = None) -> None:
        self.worker = worker
        self.load = load or PrefillLoad()

    def Prefill(
        self, request: pb.PrefillRequest, context: grpc.ServicerContext
    ) -> pb.PrefillResponse:
        tokens = len(request.token_ids) or len(request.prompt_text) // 4 + 1
        self.load.enter(tokens)
        try:
            result = self.worker.prefill(
                list(request.token_ids),
                sampling_from_proto(request.sampling),
                text=request.prompt_text,
                namespace=request.namespace,
                request_id=request.request_id,
            )
        except Exception as exc:
            _abort(context, exc)
            raise  # unreachable: abort raises
        finally:
            self.load.exit(tokens)
        return prefill_response(result, with_prompt_ids=bool(request.prompt_text))


class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker | ColocatedWorker) -> None:
        self.worker = worker

    def Decode(
        self, request: pb.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TokenEvent]:
        try:
            stream = self.worker.submit(decode_request_from_proto(request, self.worker.runtime))
        except Exception as exc:
            _abort(context, exc)
            raise
        context.add_callback(stream.cancel)
        try:
            if request.batch_s > 0:
                yield from batched(stream, request.batch_s)
                return
            for event in stream:
                yield token_event_to_proto(event)
        except Exception as exc:
            _abort(context, exc)


def batched(
    events: Iterable[TokenEvent], batch_s: float, clock: Callable[[], float] = time.monotonic
) -> Iterator[pb.TokenEvent]:
    """A decode stream in batches (`DecodeRequest.batch_s`): each message has every token since
    the last one sent (`token_ids`, the first at `index`) and their text joined, sent when the
    last was sent `batch_s` ago (by `clock`) or when the stream ends (its finish reason and stats)."""
    index: int | None = None
    ids: list[int] = []
    texts: list[str] = []
    sent = clock()
    for event in events:
        if index is None:
            index = event.index
        if event.token_id is not None:
            ids.append(event.token_id)
        texts.append(event.text)
        now = clock()
        if event.finish_reason is None and now - sent < batch_s:
            continue
        msg = token_event_to_proto(
            dataclasses.replace(
                event,
                index=event.index if index is None else index,
                token_id=None,
                text="".join(texts),
            )
        )
        msg.token_ids.extend(ids)
        yield msg
        index, ids, texts, sent = None, [], [], now


class WorkerServicer(engine_pb2_grpc.WorkerServicer):
    """`Describe` (what the worker is: role, scope, page size, host) and `Load` (how loaded it
    is now), for the router's registry."""

    def __init__(
        self,
        config: WorkerConfig,
        worker: Worker,
        prefill_load: PrefillLoad,
        accepting: Callable[[], bool],
    ) -> None:
        self.config = config
        self.worker = worker
        self.prefill_load = prefill_load
        self.accepting = accepting

    def Describe(
        self, request: pb.DescribeRequest, context: grpc.ServicerContext
    ) -> pb.WorkerDescription:
        return describe(self.config, self.worker, include_tokenizer=request.include_tokenizer)

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadReport:
        worker = self.worker
        if isinstance(worker, PrefillWorker):
            tokens, requests, served = self.prefill_load.snapshot()
            return pb.LoadReport(
                queued_prefill_tokens=max(0, tokens),
                queued_requests=max(0, requests - 1),
                running_requests=min(1, max(0, requests)),
                free_pages=worker.pool.num_free,
                accepting=self.accepting(),
                served_requests=served,
            )
        load = worker.load()
        return pb.LoadReport(
            queued_prefill_tokens=load.queued_prefill_tokens,
            queued_requests=load.queued_requests,
            running_requests=load.running_requests,
            running_context_tokens=load.running_context_tokens,
            free_pages=load.free_pages,
            accepting=self.accepting(),
            running_remaining_tokens=list(load.running_remaining_tokens),
        )


def describe(
    config: WorkerConfig, worker: Worker, *, include_tokenizer: bool
) -> pb.WorkerDescription:
    """The worker's `WorkerDescription`: the fields of its scope (namespace "") and its limits."""
    runtime = worker.runtime
    scope = runtime.scope()
    layout, shard = scope.layout, scope.shard
    pool = worker.pool
    msg = pb.WorkerDescription(
        role=config.role,
        model_id=scope.model_id,
        weights_revision=scope.weights_revision,
        tokenizer_fingerprint=scope.tokenizer_fingerprint,
        kv_dtype=scope.kv_dtype,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        page_tokens=layout.page_tokens,
        adapter_id=scope.adapter_id,
        adapter_fingerprint=scope.adapter_fingerprint,
        tp_rank=shard.tp_rank,
        tp_size=shard.tp_size,
        pp_stage=shard.pp_stage,
        pp_size=shard.pp_size,
        host_id=host_id(),
        max_batch=1 if config.role == "prefill" else config.max_batch,
        max_context=runtime.max_context,
        page_payload_bytes=scope.page_payload_bytes,
        total_pages=pool.num_pages,
        vocab_size=runtime.vocab_size,
        store=config.store,
        eos_token_ids=list(runtime.eos_ids),
        step_token_budget=config.step_token_budget if config.role == "colocated" else 0,
    )
    if include_tokenizer:
        folder = Path(runtime.checkpoint.path)
        msg.tokenizer_json = (folder / "tokenizer.json").read_bytes()
        cfg = folder / "tokenizer_config.json"
        if cfg.exists():
            msg.tokenizer_config_json = cfg.read_bytes()
        template = folder / "chat_template.jinja"  # newer checkpoints keep it apart
        if template.exists():
            msg.chat_template = template.read_text()
    return msg


def create_server(
    config: WorkerConfig, worker: Worker, accepting: Callable[[], bool] = lambda: True
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build and bind (not start) the gRPC server of `worker` on config.host:bind_port (port 0:
    any free port). Returns (server, bound port, health servicer). Raises OSError when the
    address cannot be bound."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.rpc_threads, thread_name_prefix=f"{config.role}-rpc"),
        options=[("grpc.so_reuseport", 0)],
    )
    address = f"{config.host}:{config.bind_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot listen on {address} (in use?)")
    prefill_load = PrefillLoad()
    if isinstance(worker, PrefillWorker):
        engine_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker, prefill_load), server)
    else:
        engine_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server)
    engine_pb2_grpc.add_WorkerServicer_to_server(
        WorkerServicer(config, worker, prefill_load, accepting), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, port, health_servicer


def build_worker(config: WorkerConfig, runtime: ModelRuntime, store: PageStore | None) -> Worker:
    """The worker of `config.role` over `runtime` and `store`."""
    if config.role == "prefill":
        return PrefillWorker(
            runtime,
            store,
            chunk_tokens=config.chunk_tokens,
            publish_timeout_s=config.publish_timeout_s,
            store_retry_after_s=config.store_retry_after_s,
        )
    common = {
        "max_batch": config.max_batch,
        "chunk_tokens": config.chunk_tokens,
        "kv_capacity_tokens": config.kv_capacity_tokens or None,
        "max_waiting": config.max_waiting,
        "store_retry_after_s": config.store_retry_after_s,
    }
    if config.role == "decode":
        return DecodeWorker(runtime, store, **common)  # type: ignore[arg-type]
    return ColocatedWorker(
        runtime,
        store,
        step_token_budget=config.step_token_budget,
        **common,  # type: ignore[arg-type]
    )


class EngineServer:
    """One worker process's server. `start()` returns the bound address once it serves."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        runtime: ModelRuntime | None = None,
        store: PageStore | None = None,
    ) -> None:
        """`runtime` and `store` default to what `config` names (tests pass their own)."""
        self.config = config
        self.runtime = runtime or ModelRuntime(
            config.model,
            page_tokens=config.page_tokens,
            max_context=config.max_context or None,
            device=config.device,
        )
        self._own_store: StoreClient | ClusterClient | None = None
        if store is None and config.store:
            spec = parse_store(config.store)
            assert spec is not None
            self._own_store = spec.open(
                timeout_s=config.store_timeout_s, token=config.store_token or None
            )
            store = self._own_store
        self.store = store
        self.worker = build_worker(config, self.runtime, store)
        self.server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self.port = 0
        self._stopped = threading.Event()
        self._accepting = False
        self._registration: WorkerRegistration | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> str:
        """Bind, start serving, report SERVING; returns "host:port". Raises OSError."""
        if isinstance(self._own_store, StoreClient):
            try:
                node = self._own_store.connect()
                log.info(
                    "store %s at %s (%s path)",
                    node.node_id,
                    self.config.store,
                    self._own_store.transport,
                )
            except StrataError as exc:
                log.warning(
                    "store at %s not reachable yet (%s); computing without it until it is",
                    self.config.store,
                    exc,
                )
        server, port, health_servicer = create_server(
            self.config, self.worker, lambda: self._accepting
        )
        server.start()
        self.server, self.port, self._health = server, port, health_servicer
        service = PREFILL_SERVICE if self.config.role == "prefill" else DECODE_SERVICE
        for name in ("", service, WORKER_SERVICE):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._accepting = True
        log.info("%s worker listening at %s", self.config.role, self.address)
        if self.config.etcd:
            advertise = self.config.advertise or self.address
            record = encode_record(advertise, self.config.role, self.runtime.checkpoint.model_id)
            self._registration = WorkerRegistration(
                self.config.etcd, self.config.cluster, advertise, record
            )
            self._registration.start()
        return self.address

    @property
    def accepting(self) -> bool:
        """True from `start()` until `stop()` has made the server refuse new calls."""
        return self._accepting

    @property
    def in_flight(self) -> int:
        return self.worker.in_flight

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop accepting (health NOT_SERVING, new calls refused), let in-flight work finish for
        up to `timeout_s` (default: config.drain_timeout_s), finish publishing, close. True if
        nothing was cut short. Idempotent."""
        if self._stopped.is_set():
            return True
        self._stopped.set()
        grace = self.config.drain_timeout_s if timeout_s is None else timeout_s
        if self._registration is not None:
            self._registration.stop()  # routers stop sending here first
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        done = self.server.stop(grace) if self.server is not None else None
        self._accepting = False
        drained = self.worker.stop(grace)
        if done is not None:
            done.wait(grace)
        if self._own_store is not None:
            self._own_store.close()
        log.info("%s worker stopped%s", self.config.role, "" if drained else " (work cut short)")
        return drained
