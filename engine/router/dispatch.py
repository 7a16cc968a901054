"""Prefill → decode orchestration with failover (DESIGN §1, §9): the router's I/O for one request.

`Dispatcher.start(job)`:
1. asks the store which of the prompt's pages exist (a miss when it fails), copies the registry
   into worker views and calls `RouterCore.decide` (placement, admission, ledger); a refusal
   becomes an `HttpError` (429 with Retry-After, or 503);
2. for a disaggregated placement, runs `Prefill` on the chosen prefill worker; a prefill that
   fails (the worker is down, times out, errs or is busy) marks that worker failed and the
   request is decided again without it, up to `max_attempts` times.

It returns a `Run`, whose `tokens()` streams the first token and then the chosen decode
worker's `Decode` stream (`output_token_ids=[first]`, opened as soon as the Prefill answers, so
the worker pulls while the first token goes out); a co-located worker takes `Decode` alone. The
stream's last event (its finish reason) ends the run; the call's trailing status is not awaited,
and the call is not cancelled either: it ends by itself (cancelled only if still open
FINISHED_STREAM_GRACE_S later).
A decode stream that breaks before its last event is resumed on another decode-capable worker,
the one `RouterCore.resume` prices cheapest for the rest of the request, from the tokens produced
so far (`DecodeRequest.output_token_ids`): the worker pulls the pages
of prompt + output from the store, recomputes the tail and continues. Events are accepted by
index, so the caller sees every token exactly once, in order. Closing the run (the client went
away) cancels the gRPC stream, and the worker frees the request's pages.

Observed TTFT (from `Job.received_at`, the request's arrival at the router) and TPOT go to the
core's admission hooks and the prediction tracker. What the next decision does not need — the
decision's and the prefill's metrics and `/debug/decisions` record, the live calibration — is
`Run.deferred` to the run's end (or its DEFERRED_UNTIL_TOKENS-th token), so the router's CPU
stays off the cores the workers compute the request on; the ledger is updated at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from client import Scope
from engine.router.core.errors import ErrorKind
from engine.router.core.router import RouterCore, explain
from engine.router.core.types import (
    Placement,
    PrefixHit,
    Refusal,
    RefusalReason,
    RequestView,
)
from engine.router.http_errors import HttpError
from engine.router.lookup import StoreLookup
from engine.router.metrics import FinishedRequest, RouterMetrics
from engine.router.registry import ModelInfo, Registry
from kvstore_pb import engine_pb2 as pb

log = logging.getLogger(__name__)

# Status codes after which another worker may succeed where this one failed.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
    }
)
# The drift log looks at the prediction tracker at most this often (seconds of the clock).
DRIFT_CHECK_S = 1.0
# A run's decision and prefill bookkeeping waits for its end, or for this many output tokens.
DEFERRED_UNTIL_TOKENS = 32
# A non-streamed run's Decode sends its tokens in batches at most this old (DecodeRequest.batch_s)
DECODE_BATCH_S = 0.25
# A Decode stream whose last event came is left to end by itself (its status follows the event:
# no cancel sent, nothing for the worker to undo); one still open this much later is cancelled.
FINISHED_STREAM_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class Job:
    """One request, tokenized and checked."""

    request_id: str
    model: ModelInfo
    prompt_ids: tuple[int, ...]
    sampling: pb.SamplingParams
    max_tokens: int
    slo_class: str = ""
    tenant: str = ""
    namespace: str = ""  # the scope namespace its pages live in (from its API key and salt)
    # when the router received it, on the dispatcher's clock (0: when dispatching starts); its
    # TTFT, exported and scored against the prediction, counts from here
    received_at: float = 0.0
    # answered whole (not streamed): its Decode sends tokens in batches of DECODE_BATCH_S
    # (DecodeRequest.batch_s), not one message per token; a resume continues from the last batch
    whole: bool = False

    @property
    def scope(self) -> Scope:
        """The model's scope in this job's namespace."""
        scope = self.model.scope
        return dataclasses.replace(scope, namespace=self.namespace) if self.namespace else scope


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One decision as GET /debug/decisions shows it. `as_dict` explains it (each candidate's
    predicted cost and why it lost) when the record is read, not when the decision is made: an
    explanation costs about as much CPU as the decision itself."""

    request_id: str
    slo_class: str
    prompt_tokens: int
    hit: PrefixHit
    decision: Placement | Refusal
    resumed_after: int | None = None  # a resume's record: placed after this many output tokens

    def as_dict(self) -> dict[str, object]:
        hit = self.hit
        return {
            "request_id": self.request_id,
            **(
                {"resumed_after_tokens": self.resumed_after}
                if self.resumed_after is not None
                else {}
            ),
            "slo_class": self.slo_class,
            "prompt_tokens": self.prompt_tokens,
            "prefix": {
                "hit_pages": hit.hit_pages,
                "tiers": list(hit.tiers),
                "node_hosts": list(hit.node_hosts),
            },
            **explain(self.decision),
        }


@dataclass(frozen=True, slots=True)
class Token:
    """One produced token (or a last event without one: `token_id` None)."""

    index: int
    token_id: int | None
    text: str
    finish_reason: str = ""


@dataclass
class Run:
    """A request placed and (when disaggregated) prefilled; `tokens()` streams its output."""

    job: Job
    placement: Placement
    dispatcher: Dispatcher
    started_at: float
    prefill_id: str
    decode_id: str
    first: Token | None = None
    cached_tokens: int = 0
    produced: list[int] = field(default_factory=list)
    finish_reason: str = ""
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    resumes: int = 0
    failed: bool = False
    queue_s: float = 0.0  # time queued on workers (prefill + decode), as they report it
    # where the time went, as the workers report it (`timings`): the prefill's queue, lookup,
    # pull, compute, sampling and wait for its pages to publish; the decode worker's queue and
    # KV pull (summed over resumes)
    split: dict[str, float] = field(default_factory=dict)
    tokens_by_worker: dict[str, int] = field(default_factory=dict)
    view: RequestView | None = None  # what the core placed (a resume is placed from it)
    # bookkeeping of the decision and the prefill (metrics, /debug/decisions, calibration), run
    # when the run ends or has DEFERRED_UNTIL_TOKENS tokens: not while the workers compute it
    deferred: list[Callable[[], object]] = field(default_factory=list)
    _call: Any = None  # the grpc.aio stream call in progress
    _opened: Any = None  # a Decode call opened with the prefill's answer, not yet read
    _closed: bool = False

    def timings(self) -> dict[str, float]:
        """The latency split so far, in milliseconds (keys as in `split`, `_s` turned `_ms`),
        and `decode_ms` once a token came: the decode stream's time from the first token to the
        last as the router saw it, less the decode worker's queue and pull in it (what is left
        is its steps and their streaming)."""
        split = dict(self.split)
        if self.first_token_at:
            span = self.last_token_at - self.first_token_at
            if not self.placement.colocated:  # a co-located run queues and pulls before it
                span -= split.get("decode_queue_s", 0.0) + split.get("decode_pull_s", 0.0)
            split["decode_s"] = max(span, 0.0)
        return {k[:-2] + "_ms": round(v * 1e3, 3) for k, v in sorted(split.items())}

    async def tokens(self) -> AsyncIterator[Token]:
        """The output, each token once and in order; raises HttpError when no worker can
        continue it. Cancelling the consumer cancels the worker's stream."""
        d = self.dispatcher
        try:
            if self.first is not None:
                self.tokens_by_worker[self.prefill_id] = 1
                self._accept(self.first)
                yield self.first
                if self.first.finish_reason:
                    return
            tried: set[str] = set()
            for attempt in range(d.max_attempts):
                async for token in self._decode_once():
                    yield token
                if self.finish_reason:
                    return
                tried.add(self.decode_id)
                nxt = d.pick_resume(self, tried)
                if nxt is None:
                    raise HttpError(
                        ErrorKind.no_worker,
                        f"the decode worker failed after {len(self.produced)} token(s) and no "
                        "other decode worker is available",
                        retry_after_s=d.retry_after_s,
                    )
                log.info(
                    "request %s: resuming on %s after %d token(s) (attempt %d)",
                    self.job.request_id,
                    nxt,
                    len(self.produced),
                    attempt + 2,
                )
                self.decode_id = nxt
                self.resumes += 1
                if d.metrics is not None:
                    d.metrics.observe_retry("decode", "stream_broken")
            raise HttpError(
                ErrorKind.upstream_failed,
                f"decode failed on {d.max_attempts} workers",
                retry_after_s=d.retry_after_s,
            )
        except HttpError:
            self.failed = True
            raise
        finally:
            await self.close()

    async def _decode_once(self) -> AsyncIterator[Token]:
        """One Decode stream on `decode_id` from the tokens so far; ends early on a failure."""
        d, job = self.dispatcher, self.job
        call, self._opened = self._opened, None
        if call is None:
            call = self.open_decode(self.produced)
        if call is None:
            return
        self._call = call
        events = call.__aiter__()
        # the first event waits for the worker to pull and recompute; later ones for one step
        # (a batch: for its age too)
        batch_s = self._batch_s
        wait_s = d.stall_timeout_s(self.placement.predicted_ttft_s + batch_s, first=True)
        try:
            while True:
                try:
                    # a timer, not wait_for's task per event
                    async with asyncio.timeout(wait_s):
                        event = await events.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    d.registry.mark_failed(self.decode_id, f"no token for {wait_s:.1f} s")
                    return
                wait_s = d.stall_timeout_s(self.placement.predicted_tpot_s + batch_s, first=False)
                if event.HasField("stats") and not self.cached_tokens:
                    hit = event.stats.hit_tokens
                    if self.placement.colocated:
                        self.cached_tokens = hit.gpu + hit.dram + hit.ssd
                if event.finish_reason == "cancelled":
                    # the worker stopped before finishing: continue elsewhere
                    d.registry.mark_failed(self.decode_id, "cancelled the stream")
                    return
                if event.token_ids:  # a batch (DecodeRequest.batch_s)
                    pairs = [(event.index + i, t) for i, t in enumerate(event.token_ids)]
                elif event.HasField("token_id"):
                    pairs = [(event.index, event.token_id)]
                else:
                    pairs = []
                have = len(self.produced)
                fresh = [(i, t) for i, t in pairs if i >= have]
                if pairs and not fresh and not event.finish_reason:
                    continue  # tokens we already have
                if fresh and fresh[0][0] > have:
                    raise HttpError(
                        ErrorKind.upstream_failed,
                        f"worker {self.decode_id} skipped from token {have} to {fresh[0][0]}",
                    )
                if fresh and len(fresh) < len(pairs):
                    # a batch's text cannot be split between the tokens we have and the rest
                    raise HttpError(
                        ErrorKind.upstream_failed,
                        f"worker {self.decode_id} resent tokens {pairs[0][0]}..{have - 1}",
                    )
                if fresh:
                    worker = self.decode_id
                    self.tokens_by_worker[worker] = self.tokens_by_worker.get(worker, 0) + len(
                        fresh
                    )
                if event.HasField("stats"):
                    self.queue_s += event.stats.queue_s
                    split = self.split
                    split["decode_queue_s"] = split.get("decode_queue_s", 0.0) + event.stats.queue_s
                    split["decode_pull_s"] = split.get("decode_pull_s", 0.0) + event.stats.pull_s
                if event.HasField("stats") and d.metrics is not None:
                    # after the token is on its way (the next loop turn)
                    d.later(
                        functools.partial(
                            d.metrics.observe_decode,
                            self.decode_id,
                            event.stats,
                            bytes_per_token=job.model.page_bytes // max(1, job.model.page_tokens),
                        )
                    )
                # the event's text completes its last token (a batch's: all of them)
                for i, t in fresh[:-1]:
                    token = Token(i, t, "")
                    self._accept(token)
                    yield token
                last_index, last_id = fresh[-1] if fresh else (event.index, None)
                text = event.text if fresh or not pairs else ""
                token = Token(last_index, last_id, text, event.finish_reason)
                self._accept(token)
                yield token
                if event.finish_reason:
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise HttpError(ErrorKind.invalid_request, exc.details() or "invalid") from None
            if exc.code() not in RETRYABLE:
                raise HttpError(
                    ErrorKind.upstream_failed, f"{exc.code().name}: {exc.details()}"
                ) from None
            d.registry.mark_failed(self.decode_id, f"decode {exc.code().name}")
        finally:
            if not call.done():
                if self.finish_reason:
                    # the worker has sent its last event and its status follows on its own:
                    # cancelled only if it has not come within FINISHED_STREAM_GRACE_S
                    d.cancel_unless_done(call)
                else:
                    call.cancel()
            self._call = None

    def open_decode(self, produced: list[int]) -> Any:
        """Start the Decode call on `decode_id` from the tokens `produced` (a grpc.aio call;
        None when the worker left the registry)."""
        d, job = self.dispatcher, self.job
        handle = d.registry.workers.get(self.decode_id)
        if handle is None:
            return None
        request = pb.DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_ids,
            output_token_ids=produced,
            sampling=job.sampling,
            namespace=job.namespace,
            batch_s=self._batch_s,
        )
        return handle.decode_stub().Decode(request, timeout=d.decode_timeout_s)

    @property
    def _batch_s(self) -> float:
        """DECODE_BATCH_S for a job that shows nothing before its end (`Job.whole`) after a
        prefill (a co-located run's first token comes in its Decode, so it is not batched)."""
        return DECODE_BATCH_S if self.job.whole and not self.placement.colocated else 0.0

    def flush(self) -> None:
        """Run the deferred bookkeeping (once)."""
        deferred, self.deferred = self.deferred, []
        for fn in deferred:
            fn()

    def _accept(self, token: Token) -> None:
        now = self.dispatcher.clock()
        if token.token_id is not None:
            self.produced.append(token.token_id)
            if len(self.produced) == DEFERRED_UNTIL_TOKENS and self.deferred:
                self.dispatcher.later(self.flush)
            if not self.first_token_at:
                self.first_token_at = now
                self.dispatcher.on_first_token(self, now)
            self.last_token_at = now
        if token.finish_reason:
            self.finish_reason = token.finish_reason

    async def close(self) -> None:
        """Cancel the worker's stream if it still runs; report the request finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for call in (self._call, self._opened):
            if call is not None and not call.done():
                call.cancel()
        self._opened = None
        self.dispatcher.on_finish(self)


class Dispatcher:
    """Places, prefills and streams requests. Runs on the router's event loop."""

    def __init__(
        self,
        registry: Registry,
        lookup: StoreLookup,
        core: RouterCore,
        *,
        metrics: RouterMetrics | None = None,
        seed: int = 0,
        max_attempts: int = 3,
        prefill_timeout_s: float = 120.0,
        decode_timeout_s: float = 3600.0,
        min_stall_s: float = 10.0,
        stall_factor: float = 20.0,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        decisions: collections.deque[DecisionRecord] | None = None,
        finished_stream_grace_s: float = FINISHED_STREAM_GRACE_S,
    ) -> None:
        self.registry = registry
        self.finished_stream_grace_s = finished_stream_grace_s
        self.lookup = lookup
        self.core = core
        self.metrics = metrics
        self.decisions = decisions if decisions is not None else collections.deque(maxlen=256)
        self.rng = random.Random(seed)
        self.max_attempts = max_attempts
        self.prefill_timeout_s = prefill_timeout_s
        self.decode_timeout_s = decode_timeout_s
        self.min_stall_s = min_stall_s
        self.stall_factor = stall_factor
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.in_flight: dict[str, Run] = {}
        self._drifted: dict[str, bool] = {}
        self._drift_checked_at = -math.inf  # clock of the last drift check
        self._drift_pending = False  # a deferred check is scheduled on the loop
        self._calibration_far = False
        self.on_done: list[Callable[[Run], None]] = []  # called once per run that ends
        self.prefill_retries = 0
        self.decode_resumes = 0

    # ---- placing and prefilling ---------------------------------------------------------

    async def start(self, job: Job) -> Run:
        """Decide and prefill. Raises HttpError for a refusal, a bad request, or when every
        prefill attempt failed."""
        started = job.received_at or self.clock()
        model = job.model
        hit = await self.lookup.find(job.scope, job.prompt_ids)
        view = RequestView(
            request_id=job.request_id,
            prompt_tokens=len(job.prompt_ids),
            max_tokens=job.max_tokens,
            slo_class=job.slo_class,
            prefix=hit,
            page_tokens=model.page_tokens,
            page_bytes=model.page_bytes,
            tenant=job.tenant,
            model=model.model_id,
        )
        excluded: set[str] = set()
        last_error = ""
        for _ in range(self.max_attempts):
            now = self.clock()
            workers = tuple(
                w for w in self.registry.views(model.model_id, now) if w.worker_id not in excluded
            )
            decision = self.core.decide(view, workers, now, self.rng, received_at=started)
            decide_s = self.clock() - now
            if isinstance(decision, Refusal):
                self._record(job, hit, decision, decide_s)
                raise self._refused(decision, last_error)
            placement = decision
            run = Run(job, placement, self, started, placement.prefill_id, placement.decode_id)
            run.view = view
            if placement.colocated:
                run.deferred.append(functools.partial(self._record, job, hit, decision, decide_s))
                self.in_flight[job.request_id] = run
                return run
            sent = self.clock()
            try:
                reply = await self._prefill(placement.prefill_id, job, placement.predicted_ttft_s)
            except grpc.aio.AioRpcError as exc:
                self._record(job, hit, decision, decide_s)
                self.core.on_failed(job.request_id, self.clock())
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise HttpError(ErrorKind.invalid_request, exc.details() or "invalid") from None
                if exc.code() not in RETRYABLE:
                    raise HttpError(
                        ErrorKind.upstream_failed, f"prefill: {exc.code().name}: {exc.details()}"
                    ) from None
                last_error = f"prefill on {placement.prefill_id} failed: {exc.code().name}"
                self.registry.mark_failed(placement.prefill_id, f"prefill {exc.code().name}")
                excluded.add(placement.prefill_id)
                self.prefill_retries += 1
                if self.metrics is not None:
                    self.metrics.observe_retry("prefill", exc.code().name.lower())
                log.info("request %s: %s; trying another worker", job.request_id, last_error)
                continue
            done = self.clock()
            if not reply.finish_reason:
                # the decode worker starts pulling while the first token goes out
                run._opened = run.open_decode([reply.first_token])
            # the decision's and the prefill's metrics, the explanation and the calibration
            # wait for the run's end (or its DEFERRED_UNTIL_TOKENS tokens): the router's CPU
            # stays off the cores the decode worker's threads are computing on
            run.deferred += (
                functools.partial(self._record, job, hit, decision, decide_s),
                functools.partial(
                    self._observe_prefill, placement.prefill_id, job, hit, reply, done - sent, done
                ),
            )
            hit_tokens = reply.hit_tokens
            run.queue_s = reply.timings.queue_s
            t = reply.timings
            run.split.update(
                prefill_queue_s=t.queue_s,
                lookup_s=t.lookup_s,
                prefill_pull_s=t.pull_s,
                prefill_compute_s=t.compute_s,
                sample_s=t.sample_s,
                publish_wait_s=t.publish_wait_s,
            )
            run.cached_tokens = hit_tokens.gpu + hit_tokens.dram + hit_tokens.ssd
            run.first = Token(0, reply.first_token, reply.first_text, reply.finish_reason)
            self.in_flight[job.request_id] = run
            if run._opened is not None and job.whole:
                # grpc.aio sends a call's request from a task of its own: for an answer sent
                # whole, one loop turn here sends the Decode now, before the first token's
                # bookkeeping and the answer's set-up (else they ran first, ~0.2 ms of the
                # router's CPU, while the decode worker had not been asked yet). A stream's
                # first token goes to its client first, and its Decode leaves right after.
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    await run.close()  # the caller never gets the run: cancel its Decode here
                    raise
            return run
        raise HttpError(
            ErrorKind.no_worker,
            f"no prefill worker could serve the request ({last_error})",
            retry_after_s=self.retry_after_s,
        )

    def _record(
        self, job: Job, hit: PrefixHit, decision: Placement | Refusal, decide_s: float
    ) -> None:
        """A decision's explanation (/debug/decisions) and metrics."""
        self._explain(job, hit, decision)
        if self.metrics is not None:
            self.metrics.observe_decision(decision, job.slo_class, decide_s=decide_s)

    def _observe_prefill(
        self,
        worker: str,
        job: Job,
        hit: PrefixHit,
        reply: pb.PrefillResponse,
        took_s: float,
        done: float,
    ) -> None:
        """A prefill's metrics, and its timings to the live calibration."""
        model = job.model
        if self.metrics is not None:
            self.metrics.observe_prefill(
                worker,
                took_s,
                reply,
                now=done,
                expected_hit_tokens=hit.hit_pages * model.page_tokens,
                bytes_per_token=model.page_bytes // max(1, model.page_tokens),
            )
        self._calibrate(reply)

    def _calibrate(self, reply: pb.PrefillResponse) -> None:
        """The worker's own forward time (compute + sample) for its computed tokens after the
        hit ones, to the core's live calibration; logged when the profile is far off."""
        computed = reply.computed_tokens
        cached = max(0, reply.prompt_tokens - computed)
        seconds = reply.timings.compute_s + reply.timings.sample_s
        if not self.core.observe_prefill(computed, cached, seconds):
            return
        calibration = self.core.calibration
        assert calibration is not None
        far = calibration.drifted
        if far != self._calibration_far:
            self._calibration_far = far
            log.log(
                logging.WARNING if far else logging.INFO,
                "prefills run at %.2fx the profile's times (median of the last %d); predictions "
                "follow the live speed%s",
                calibration.scale,
                calibration.samples,
                ": profile this machine again (strata profile)" if far else "",
            )

    def stall_timeout_s(self, predicted_s: float, first: bool) -> float:
        """How long a worker may stay silent before the router gives up on it and goes
        elsewhere: `stall_factor` times the prediction, at least `min_stall_s` (a first event
        or a prefill includes queueing, so it gets the prefill bound)."""
        bound = max(self.min_stall_s, self.stall_factor * max(predicted_s, 0.0))
        return min(bound, self.prefill_timeout_s) if first else bound

    def _prefill(self, address: str, job: Job, predicted_ttft_s: float = 0.0) -> Any:
        """The Prefill call on `address`, started (a grpc.aio call: await it for the reply)."""
        handle = self.registry.workers.get(address)
        if handle is None:
            return _raise(_gone(address))
        request = pb.PrefillRequest(
            request_id=job.request_id,
            token_ids=list(job.prompt_ids),
            sampling=job.sampling,
            namespace=job.namespace,
        )
        return handle.prefill_stub().Prefill(
            request,
            timeout=min(self.prefill_timeout_s, self.stall_timeout_s(predicted_ttft_s, True)),
        )

    def pick_resume(self, run: Run, tried: set[str]) -> str | None:
        """Another worker to continue `run` on, not tried yet: the core's decode-only placement
        (`RouterCore.resume`: co-located for a co-located run) of the rest of the request,
        explained in /debug/decisions like any decision. None when no worker may take it."""
        job = run.job
        view = run.view or RequestView(
            request_id=job.request_id,
            prompt_tokens=len(job.prompt_ids),
            max_tokens=job.max_tokens,
            slo_class=job.slo_class,
            page_tokens=job.model.page_tokens,
            page_bytes=job.model.page_bytes,
            tenant=job.tenant,
            model=job.model.model_id,
        )
        now = self.clock()
        decision = self.core.resume(
            view,
            self.registry.views(job.model.model_id, now),
            now,
            produced=len(run.produced),
            colocated=run.placement.colocated,
            exclude=tried,
        )
        self._explain(job, view.prefix, decision, resumed_after=len(run.produced))
        if isinstance(decision, Refusal):
            return None
        self.decode_resumes += 1
        return decision.decode_id

    def _refused(self, refusal: Refusal, last_error: str) -> HttpError:
        if refusal.reason is RefusalReason.no_worker:
            detail = refusal.detail or "no worker can serve the request"
            if last_error:
                detail = f"{detail} ({last_error})"
            return HttpError(ErrorKind.no_worker, detail, retry_after_s=refusal.retry_after_s)
        turned_down = refusal.placement
        headers = (
            {
                "x-strata-predicted-ttft-ms": f"{turned_down.predicted_ttft_s * 1000:.3f}",
                "x-strata-predicted-tpot-ms": f"{turned_down.predicted_tpot_s * 1000:.3f}",
            }
            if turned_down is not None
            else {}
        )
        return HttpError(
            ErrorKind.rate_limited,
            f"refused by admission ({refusal.reason.value}, class "
            f"{refusal.slo_class or 'default'}): {refusal.detail}",
            retry_after_s=refusal.retry_after_s,
            headers=headers,
        )

    def _explain(
        self,
        job: Job,
        hit: PrefixHit,
        decision: Placement | Refusal,
        resumed_after: int | None = None,
    ) -> None:
        """Keep the decision for GET /debug/decisions (explained when read), and log its
        explanation at DEBUG. A resume's record says after how many output tokens it was placed."""
        record = DecisionRecord(
            job.request_id, job.slo_class, len(job.prompt_ids), hit, decision, resumed_after
        )
        self.decisions.append(record)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decision %s", record.as_dict())

    # ---- bookkeeping hooks --------------------------------------------------------------

    def _check_drift(self, now: float) -> None:
        """Log when the time model's TTFT or TPOT predictions start or stop being off (the
        tracker's drift flag), once per change. Looks at most once per DRIFT_CHECK_S of `now`
        (a check is two medians over up to 512 pairs, ~50 us: per request it was a measurable
        part of the router's CPU): a request that ends sooner after the last check leaves it to
        one deferred check on the running loop, so a change is still logged within that time
        when no further request comes (without a running loop it checks at once)."""
        since = now - self._drift_checked_at
        if since < DRIFT_CHECK_S:
            if self._drift_pending:
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self._drift_pending = True
                loop.call_later(DRIFT_CHECK_S - since, self._deferred_drift_check)
                return
        self._drift_checked_at = now
        tracker = self.core.tracker
        for kind in ("ttft", "tpot"):
            drifted = tracker.drifted(kind, now)
            if drifted != self._drifted.get(kind, False):
                self._drifted[kind] = drifted
                error = tracker.median_relative_error(kind, now)
                if drifted:
                    log.warning(
                        "the time model's %s predictions are off by a median %+.0f%%: "
                        "profile this machine again (strata profile)",
                        kind.upper(),
                        100 * error,
                    )
                else:
                    log.info("the time model's %s predictions are back on target", kind.upper())

    def _deferred_drift_check(self) -> None:
        self._drift_pending = False
        self._drift_checked_at = -math.inf
        self._check_drift(self.clock())

    def on_first_token(self, run: Run, now: float) -> None:
        self.core.on_first_token(run.job.request_id, now)

    def later(self, fn: Callable[..., object], *args: object) -> None:
        """`fn(*args)` on the running loop's next turn — after what the current task writes
        before it next waits, such as a response's bytes — or now without a running loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            fn(*args)
            return
        loop.call_soon(fn, *args)

    def cancel_unless_done(self, call: Any) -> None:
        """Cancel `call` (a finished stream) if it is still open `finished_stream_grace_s` from
        now; at once without a running loop. Its status normally comes just after its last
        event, so no cancel is sent: a cancel costs the router and the worker a round of
        gRPC work (RST_STREAM, the worker's cancel callback) for a stream that is ending."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            _cancel_if_open(call)
            return
        loop.call_later(self.finished_stream_grace_s, _cancel_if_open, call)

    def on_finish(self, run: Run) -> None:
        """The run ended (finished, failed or cancelled): release its bookkeeping (at once: the
        next decision sees it), record it (`later`: its metrics and the drift check wait for the
        answer's bytes to be written)."""
        if self.in_flight.pop(run.job.request_id, None) is None:
            return
        now = self.clock()
        for hook in self.on_done:
            hook(run)
        if run.deferred:
            self.later(run.flush)
        if run.finish_reason in ("stop", "length"):
            outcome = "ok"
            self.core.on_finish(run.job.request_id, now, len(run.produced))
            self.later(self._check_drift, now)
        else:
            outcome = "failed" if run.failed else "cancelled"
            self.core.on_failed(run.job.request_id, now)
        if self.metrics is None:
            return
        self.later(self._observe_finished, run, outcome, now)

    def _observe_finished(self, run: Run, outcome: str, now: float) -> None:
        assert self.metrics is not None
        self.metrics.observe_finished(
            FinishedRequest.of(
                run.placement,
                slo_class=run.job.slo_class,
                outcome=outcome,
                ttft_s=run.first_token_at - run.started_at if run.first_token_at else None,
                e2e_s=(run.last_token_at or now) - run.started_at,
                output_tokens=len(run.produced),
                queue_s=run.queue_s,
                tokens_by_worker=run.tokens_by_worker,
            ),
            now=now,
        )


def _cancel_if_open(call: Any) -> None:
    if not call.done():
        call.cancel()


async def _raise(exc: BaseException) -> None:
    raise exc


def _gone(address: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"worker {address} left the registry",
    )
