"""`RouterService`: the router's parts put together — registry, store lookup, the pure core,
dispatcher, metrics — and the per-request work the routes share (model, SLO class, prompt,
sampling checks). The routes in `engine.router.app` stay thin over it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from dataclasses import dataclass

from engine.router.config import RouterConfig
from engine.router.core.admission import Admission
from engine.router.core.calibration import PrefillCalibration
from engine.router.core.errors import ErrorKind
from engine.router.core.ledger import DispatchLedger
from engine.router.core.policies import build_policy
from engine.router.core.prediction import PredictionTracker
from engine.router.core.router import RouterCore
from engine.router.core.timemodel import TimeModel
from engine.router.dispatch import Dispatcher, Job, Run
from engine.router.http_errors import HttpError
from engine.router.lookup import StoreLookup
from engine.router.membership import WorkerWatch
from engine.router.metrics import RouterMetrics
from engine.router.protocol import ChatCompletionRequest, CompletionRequest
from engine.router.registry import ModelInfo, Registry
from engine.router.tenancy import Grant, load_tenancy
from engine.store_spec import parse_store
from kvstore_pb import engine_pb2 as pb

log = logging.getLogger(__name__)

SLO_HEADER = "x-strata-slo-class"
OPEN = Grant(None, "", "")  # the caller of a router without API keys


@dataclass(frozen=True, slots=True)
class Prepared:
    job: Job
    response_id: str
    created: int
    grant: Grant = OPEN


class RouterService:
    """Everything behind the routes. `start()`/`stop()` on the server's event loop."""

    def __init__(self, config: RouterConfig, time_model: TimeModel) -> None:
        self.config = config
        self.time_model = time_model
        self.registry = Registry(
            config.workers,
            poll_s=config.poll_s,
            drop_after_s=config.drop_after_s,
            rpc_timeout_s=config.rpc_timeout_s,
        )
        self.lookup = StoreLookup(parse_store(config.store))
        # API keys (or open): tenants, namespaces, limits; tenants also split admission shares
        self.tenancy = load_tenancy(
            config.api_keys, tuple(c.name for c in config.admission.classes)
        )
        tenants = self.tenancy.table.shares() if self.tenancy.table is not None else None
        self.tracker = PredictionTracker()  # scored by the core (first token, finish)
        self.core = RouterCore(
            build_policy(config.policy),
            Admission(config.admission, model=time_model, tenants=tenants),
            time_model,
            DispatchLedger(),
            tracker=self.tracker,
            # the workers' live prefill speed
            calibration=PrefillCalibration(time_model) if config.calibrate else None,
        )
        self.metrics = RouterMetrics(tracker=self.tracker, calibration=self.core.calibration)
        self.metrics.set_slo_classes(config.admission.classes)
        self.dispatcher = Dispatcher(
            self.registry,
            self.lookup,
            self.core,
            metrics=self.metrics,
            seed=config.seed,
            max_attempts=config.max_attempts,
            min_stall_s=config.min_stall_s,
            decisions=collections.deque(maxlen=max(1, config.debug_decisions)),
        )
        self._grants: dict[str, Grant] = {}  # request id -> its caller, while it runs
        self.dispatcher.on_done.append(self._reconcile)
        self.watch = (
            WorkerWatch(config.etcd, config.cluster, self.registry) if config.etcd else None
        )
        self._metrics_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.registry.start()
        if self.watch is not None:
            await self.watch.start()
        self._metrics_task = asyncio.create_task(self._observe_loads(), name="strata-loads")

    async def stop(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        if self.watch is not None:
            await self.watch.stop()
        for run in list(self.dispatcher.in_flight.values()):
            await run.close()
        await self.registry.stop()
        await asyncio.to_thread(self.lookup.close)

    async def _observe_loads(self) -> None:
        while True:
            await self.registry.wait_poll()
            now = self.registry.clock()
            views = [v for m in self.registry.models for v in self.registry.views(m, now)]
            self.metrics.observe_worker_loads(views, now)

    # ---- per request --------------------------------------------------------------------

    def model(self, name: str) -> ModelInfo:
        """The served model `name`: 503 when no worker has described itself yet, 404 when
        workers serve other models."""
        model = self.registry.models.get(name)
        if model is not None:
            return model
        if not self.registry.models:
            raise HttpError(
                ErrorKind.no_worker,
                "no worker is serving yet (none registered, or none answers)",
                retry_after_s=1.0,
            )
        raise HttpError(
            ErrorKind.unknown_model,
            f"model {name!r} is not served here (served: {', '.join(sorted(self.registry.models))})",
            param="model",
        )

    def slo_class(self, header: str | None, body: str | None) -> str:
        name = (header or body or "").strip() or self.config.admission.default_class
        if self.config.admission.by_name(name) is None:
            known = ", ".join(c.name for c in self.config.admission.classes)
            raise HttpError(
                ErrorKind.invalid_request,
                f"unknown SLO class {name!r} (known: {known})",
                param="slo_class",
            )
        return name

    def prepare(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        slo_header: str | None,
        grant: Grant | None = None,
        *,
        received_at: float = 0.0,
    ) -> Prepared:
        """Model, class, prompt tokens and sampling of a request, checked against the caller's
        key (`grant`: its class allowed, its limits charged, its namespace); HttpError for a bad
        one. `received_at`: when its bytes started to arrive, on the dispatcher's clock (0: when
        it is dispatched); its TTFT is measured and scored from there."""
        model = self.model(req.model)
        slo = self.slo_class(slo_header, req.slo_class)
        if isinstance(req, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = model.text.chat_ids(model.model_id, messages)
            max_tokens = req.max_completion_tokens or req.max_tokens
        elif isinstance(req.prompt, str):
            ids = model.text.encode(req.prompt)
            max_tokens = req.max_tokens or 16
        else:
            ids = list(req.prompt)
            bad = next((t for t in ids if t >= model.vocab_size), None)
            if bad is not None:
                raise HttpError(
                    ErrorKind.invalid_request,
                    f"token id {bad} is outside the vocabulary [0, {model.vocab_size})",
                    param="prompt",
                )
            max_tokens = req.max_tokens or 16
        if not ids:
            raise HttpError(ErrorKind.invalid_request, "the prompt is empty", param="prompt")
        room = model.max_context - len(ids)
        if room < 1:
            raise HttpError(
                ErrorKind.context_length,
                f"the prompt has {len(ids)} tokens; the model's context is {model.max_context}",
                param="prompt",
            )
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise HttpError(
                ErrorKind.context_length,
                f"the prompt ({len(ids)} tokens) and max_tokens ({max_tokens}) exceed the "
                f"model's context of {model.max_context} tokens",
                param="max_tokens",
            )
        sampling = pb.SamplingParams(
            temperature=req.temperature or 0.0,
            top_k=req.top_k or 0,
            max_tokens=max_tokens,
            stop=req.stop_list(),
            ignore_eos=req.ignore_eos,
        )
        if req.top_p is not None:
            sampling.top_p = req.top_p
        if req.seed is not None:
            sampling.seed = req.seed
        caller = self.tenancy.admit(
            grant or OPEN,
            slo,
            len(ids) + max_tokens,
            time.monotonic(),
            req.cache_salt,
        )
        prefix = "chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        job = Job(
            request_id,
            model,
            tuple(ids),
            sampling,
            max_tokens,
            slo,
            tenant=caller.tenant,
            namespace=caller.namespace,
            received_at=received_at,
            whole=not req.stream,
        )
        return Prepared(job, request_id, int(time.time()), caller)

    async def dispatch(self, prepared: Prepared) -> Run:
        """Place and prefill a prepared request; a refusal gives the caller's limits back what
        the request was charged (it did not run)."""
        try:
            run = await self.dispatcher.start(prepared.job)
        except HttpError:
            self.tenancy.refund(
                prepared.grant,
                requests=1,
                tokens=prepared.grant.charged_tokens,
                now=time.monotonic(),
            )
            raise
        if prepared.grant.charged_tokens:
            self._grants[prepared.job.request_id] = prepared.grant
        return run

    def _reconcile(self, run: Run) -> None:
        """A run ended: its key gets back the max_tokens it was charged and did not produce."""
        grant = self._grants.pop(run.job.request_id, None)
        if grant is None:
            return
        used = len(run.job.prompt_ids) + len(run.produced)
        unused = grant.charged_tokens - used
        if unused > 0:
            self.tenancy.refund(grant, requests=0, tokens=unused, now=time.monotonic())
