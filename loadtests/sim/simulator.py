"""The simulator: a workload's requests through simulated engines and stores, placed and admitted
by the router's real `RouterCore` (engine.router.core), on a virtual clock.

Per request: on arrival the router gets the store's answer for its page keys (`PrefixHit`) and
the workers' last load reports (taken every `report_interval_s`, so they are as stale as a real
router's), and decides; a refusal is recorded as a 429; a placement goes to the prefill engine's
queue. The engine looks the prefix up again when it starts (the answer may have changed), pulls
and computes; the first token is fed back to the core (`on_first_token`), and in xPyD the KV goes
to the decode engine through the store (global) or directly (per-engine caches, no store); the
finish is fed back too (`on_finish`). Every random stream is seeded apart (router decisions
here, the workload's own streams in the workload); raw per-request events become `RequestRecord`s
and every metric is computed at the end from them (`loadtests.report`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from engine.router.core import (
    Admission,
    AdmissionConfig,
    DispatchLedger,
    Placement,
    Policy,
    PrefixHit,
    PullCoeffs,
    Refusal,
    RequestView,
    Role,
    RouterCore,
    SloClass,
    TimeModel,
    WorkerView,
    build_policy,
)
from loadtests.report.records import Breakdown, ClassTarget, RequestRecord, RunResult, Sample
from loadtests.sim.baselines import RandomPlacement
from loadtests.sim.cluster import ClusterSpec
from loadtests.sim.engine import Job, SimEngine
from loadtests.sim.loop import EventLoop, SimError
from loadtests.sim.pages import page_keys
from loadtests.sim.store import GlobalStore
from loadtests.workload import Request, WorkloadSpec
from loadtests.workload.generate import stream

SIM_POLICIES = ("strata", "round_robin", "least_load", "longest_prefix", "random")


def make_policy(name: str) -> Policy:
    if name == "random":
        return RandomPlacement()
    return build_policy(name)


# the simulator's admission keeps 5% of each TPOT target free (AdmissionConfig.tpot_margin)
SIM_TPOT_MARGIN = 0.05


def admission_config(
    workload: WorkloadSpec, mode: str, tpot_margin: float = SIM_TPOT_MARGIN
) -> AdmissionConfig:
    """The workload's classes as SLO classes; `off` keeps the shares but drops the targets.
    `tpot_margin`: the part of each TPOT target a predicted TPOT must leave free."""
    classes = tuple(
        SloClass(
            c.name,
            ttft_s=c.ttft_s if mode != "off" else math.inf,
            tpot_s=c.tpot_s if mode != "off" else math.inf,
            priority=c.priority,
            share=c.share or 1.0,
        )
        for c in workload.classes
    )
    return AdmissionConfig(
        classes=classes,
        default_class=classes[0].name,
        mode="predicted" if mode == "off" else mode,
        tpot_margin=tpot_margin,
    )


def router_model(model: TimeModel, cluster: ClusterSpec) -> TimeModel:
    """The time model as the router should price pulls for this store mode.

    Per-engine caches cannot be pulled from another engine: a hit is free on the engine that
    holds it (it is already in its pool) and unusable elsewhere (priced infinite, so the estimate
    recomputes). The global store keeps the profiled pull costs."""
    if cluster.store != "per_engine":
        return model
    return dataclasses.replace(
        model,
        pulls=(PullCoeffs("gpu", True, 0.0, 0.0), PullCoeffs("gpu", False, math.inf, math.inf)),
    )


class Simulator:
    def __init__(
        self,
        cluster: ClusterSpec,
        workload: WorkloadSpec,
        model: TimeModel,
        *,
        policy: str | None = None,
        admission: str | None = None,
        seed: int | None = None,
        tpot_margin: float = SIM_TPOT_MARGIN,
    ) -> None:
        self.cluster = cluster
        self.workload = workload
        self.model = model
        self.policy_name = policy or cluster.policy
        self.admission_mode = admission or cluster.admission
        self.seed = workload.seed if seed is None else seed
        self.loop = EventLoop()
        self.rng = stream(self.seed, "router", self.policy_name)
        rmodel = router_model(model, cluster)
        self.core = RouterCore(
            make_policy(self.policy_name),
            Admission(admission_config(workload, self.admission_mode, tpot_margin), model=rmodel),
            rmodel,
            DispatchLedger(),
        )
        hosts = [f"host{h}" for h in range(cluster.hosts)]
        roles = (
            [Role.prefill] * cluster.prefill
            + [Role.decode] * cluster.decode
            + [Role.colocated] * cluster.colocated
        )
        self.engines: list[SimEngine] = []
        for i, role in enumerate(roles):
            host = hosts[i % len(hosts)]
            worker_id = f"{host}:{9000 + i}"
            view_host = worker_id if cluster.store == "per_engine" else host
            self.engines.append(SimEngine(self, worker_id, host, role, view_host))
        self.by_id = {e.worker_id: e for e in self.engines}
        page_bytes = cluster.page_bytes
        self.store = (
            GlobalStore(hosts, cluster.dram_bytes // page_bytes, cluster.ssd_bytes // page_bytes)
            if cluster.store == "global"
            else None
        )
        self.bytes_moved = 0
        self._records: dict[str, RequestRecord] = {}
        self._jobs: dict[str, Job] = {}
        self._views: tuple[WorkerView, ...] = ()
        self._report_t = 0.0
        self._samples: list[Sample] = []
        self._arrivals_left = 0
        self.times: list[float] = []  # the clock at every arrival and completion (invariant checks)

    # -- the router's side ----------------------------------------------------------------------
    def _report(self) -> None:
        self._views = tuple(e.report() for e in self.engines)
        self._report_t = self.loop.now
        self._samples.append(
            Sample(
                self.loop.now,
                sum(e.queued for e in self.engines),
                sum(len(e.running) for e in self.engines),
            )
        )
        if self._arrivals_left or self._jobs:
            self.loop.after(self.cluster.report_interval_s, self._report)

    def _stale_views(self) -> list[WorkerView]:
        age = self.loop.now - self._report_t
        return [dataclasses.replace(v, report_age_s=age) for v in self._views]

    def _prefix_hit(self, keys: tuple[int, ...], views: Sequence[WorkerView]) -> PrefixHit:
        if self.store is not None:
            hits = self.store.lookup(keys)
            return PrefixHit(len(hits), tuple(t for t, _ in hits), tuple(h for _, h in hits))
        if self.cluster.store == "per_engine":
            # The engine holding the longest prefix (ties: the least loaded in the last reports).
            load = {v.worker_id: (v.queued_prefill_tokens, v.running_requests) for v in views}
            best: tuple[int, tuple[int, int], str] | None = None
            for e in self.engines:
                if e.cache is None or e.role is Role.decode:
                    continue
                n = e.cache.prefix(keys)
                if n == 0:
                    continue
                cand = (-n, load.get(e.worker_id, (0, 0)), e.worker_id)
                if best is None or cand < best:
                    best = cand
            if best is not None:
                return PrefixHit.uniform(-best[0], "gpu", best[2])
        return PrefixHit.none()

    def _arrive(self, req: Request) -> None:
        self._arrivals_left -= 1
        now = self.loop.now
        self.times.append(now)
        c = self.cluster
        keys = page_keys(req.segments, c.page_tokens)
        pages_needed = -(-(req.prompt_tokens + req.max_tokens) // c.page_tokens)
        if pages_needed > c.pool_pages:
            self._record_unserved(
                req, "failed", f"needs {pages_needed} pages, the pool has {c.pool_pages}"
            )
            return
        views = self._stale_views()
        view = RequestView(
            req.request_id,
            req.prompt_tokens,
            req.max_tokens,
            req.slo_class,
            self._prefix_hit(keys, views),
            c.page_tokens,
            c.page_bytes,
        )
        decision = self.core.decide(view, views, now, self.rng)
        if isinstance(decision, Refusal):
            self._record_unserved(req, "refused", f"{decision.reason}: {decision.detail}", 429)
            return
        job = Job(req, keys, decision, now, pages_needed)
        self._jobs[req.request_id] = job
        self.by_id[decision.prefill_id].enqueue_prefill(job)

    def _record_unserved(self, req: Request, status: str, error: str, http: int = 0) -> None:
        self._records[req.request_id] = RequestRecord(
            req.request_id,
            req.slo_class,
            status,
            req.arrival_s,
            req.arrival_s,
            prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens,
            http_status=http,
            error=error,
        )

    # -- callbacks from the engines -------------------------------------------------------------
    def lookup_for_prefill(self, engine: SimEngine, job: Job) -> None:
        """Set the job's hit pages, pull time and tokens to compute, as the engine sees them now."""
        c, model = self.cluster, self.model
        prompt = job.req.prompt_tokens
        usable = min(len(job.keys), (prompt - 1) // c.page_tokens)
        recompute = model.prefill_s(prompt, 0)
        job.new_tokens, job.cached_tokens, job.pull_s = prompt, 0, 0.0
        if usable == 0:
            return
        if self.store is not None:
            hits = self.store.lookup(job.keys[:usable])
            if not hits:
                return
            groups: dict[tuple[str, bool], int] = {}
            for tier, host in hits:
                k = (tier, host == engine.host)
                groups[k] = groups.get(k, 0) + 1
            pull = sum(model.pull_s(n * c.page_bytes, t, same) for (t, same), n in groups.items())
            n = len(hits)
            tiers = {
                t: sum(v for (tt, _), v in groups.items() if tt == t) * c.page_tokens
                for t, _ in groups
            }
        elif engine.cache is not None:
            n = engine.cache.prefix(job.keys[:usable])
            if n == 0:
                return
            pull, tiers = 0.0, {"gpu": n * c.page_tokens}
        else:
            return
        hit_tokens = n * c.page_tokens
        compute = model.prefill_s(prompt - hit_tokens, hit_tokens)
        if pull + compute >= recompute:
            return
        if self.store is not None:
            self.store.get(job.keys[:n])
            self.bytes_moved += n * c.page_bytes
        elif engine.cache is not None:
            engine.cache.use(job.keys[:n])
        job.new_tokens, job.cached_tokens, job.pull_s = prompt - hit_tokens, hit_tokens, pull
        job.hit_tokens = tiers

    def first_token(self, engine: SimEngine, job: Job) -> None:
        self.times.append(self.loop.now)
        self.core.on_first_token(job.req.request_id, self.loop.now)
        if self.store is not None:
            self.store.put(job.keys)
            self.bytes_moved += len(job.keys) * self.cluster.page_bytes
        else:
            engine.insert_cached(job.keys)

    def hand_to_decode(self, engine: SimEngine, job: Job) -> None:
        """Move the prompt's KV to the decode engine: pulled from the store, or sent directly."""
        c, model = self.cluster, self.model
        decode = self.by_id[job.placement.decode_id]
        nbytes = -(-job.req.prompt_tokens // c.page_tokens) * c.page_bytes
        if self.store is not None:
            local = sum(1 for k in job.keys if self.store.node_for(k).host == decode.host)
            remote = len(job.keys) - local
            t = model.pull_s(local * c.page_bytes, "dram", True) + model.pull_s(
                remote * c.page_bytes, "dram", False
            )
        else:
            t = model.pull_s(nbytes, "dram", engine.host == decode.host)
        self.bytes_moved += nbytes
        job.transfer_s = t
        self.loop.after(t, decode.enqueue_join, job)

    def finished(self, job: Job) -> None:
        now = self.loop.now
        self.times.append(now)
        self.core.on_finish(job.req.request_id, now, job.generated)
        del self._jobs[job.req.request_id]
        self._records[job.req.request_id] = self._record(job, "ok")

    def _record(self, job: Job, status: str) -> RequestRecord:
        req = job.req
        started = job.started
        first = job.first_token_s
        compute = (first - job.prefill_start_s - job.pull_s) if not math.isnan(first) else 0.0
        joined = job.join_s
        breakdown = Breakdown(
            queue_s=(job.prefill_start_s - job.dispatched_s)
            if started
            else self.loop.now - job.dispatched_s,
            prefill_s=max(0.0, compute),
            pull_s=job.pull_s + job.transfer_s,
            decode_queue_s=max(0.0, joined - first - job.transfer_s)
            if not math.isnan(joined)
            else 0.0,
            decode_s=(job.finish_s - joined) if not math.isnan(job.finish_s) else 0.0,
        )
        return RequestRecord(
            request_id=req.request_id,
            slo_class=req.slo_class,
            status=status,
            intended_s=req.arrival_s,
            sent_s=req.arrival_s,
            first_token_s=first,
            finish_s=job.finish_s,
            prompt_tokens=req.prompt_tokens,
            output_tokens=job.generated,
            max_tokens=req.max_tokens,
            hit_tokens=tuple(sorted(job.hit_tokens.items())),
            breakdown=breakdown,
            prefill_worker=job.placement.prefill_id,
            decode_worker=job.placement.decode_id,
            error="" if status == "ok" else "unfinished when the run ended",
        )

    # -- the run --------------------------------------------------------------------------------
    def run(
        self,
        requests: Sequence[Request],
        *,
        rate: float = 0.0,
        label: str = "",
        duration_s: float | None = None,
    ) -> RunResult:
        if self.loop.events:
            raise SimError("a Simulator runs once; build a new one")
        self._arrivals_left = len(requests)
        self.loop.at(0.0, self._report)  # first, so arrivals at t=0 see the workers
        for req in requests:
            self.loop.at(req.arrival_s, self._arrive, req)
        end = (requests[-1].arrival_s if requests else 0.0) + self.cluster.drain_s
        self.loop.run(until=end)
        for job in list(self._jobs.values()):
            self._records[job.req.request_id] = self._record(job, "timeout")
        records = tuple(self._records[r.request_id] for r in requests)
        duration = duration_s or self.workload.duration_s
        evictions = (
            self.store.evictions
            if self.store is not None
            else sum(e.cache.evictions for e in self.engines if e.cache is not None)
        )
        offered = rate or (len(requests) / duration if duration > 0 else 0.0)
        return RunResult(
            label=label or f"{self.policy_name} @ {offered:.3g}/s",
            kind="sim",
            workload=self.workload.name,
            target_rate=offered,
            duration_s=duration,
            classes=tuple(ClassTarget(c.name, c.ttft_s, c.tpot_s) for c in self.workload.classes),
            records=records,
            samples=tuple(self._samples),
            policy=self.policy_name,
            cluster=f"{self.cluster.name} ({self.cluster.layout}, store {self.cluster.store})",
            gpus=self.cluster.gpus,
            bytes_moved=self.bytes_moved,
            evictions=evictions,
            seed=self.seed,
            notes=(f"admission {self.admission_mode}", f"{self.loop.events} events"),
        )


def simulate(
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    model: TimeModel,
    requests: Sequence[Request],
    *,
    policy: str | None = None,
    admission: str | None = None,
    rate: float = 0.0,
    label: str = "",
    duration_s: float | None = None,
    tpot_margin: float = SIM_TPOT_MARGIN,
) -> RunResult:
    """One simulated run (a fresh simulator)."""
    sim = Simulator(
        cluster, workload, model, policy=policy, admission=admission, tpot_margin=tpot_margin
    )
    return sim.run(requests, rate=rate, label=label, duration_s=duration_s)


__all__ = ["SIM_POLICIES", "Placement", "Simulator", "make_policy", "simulate"]
