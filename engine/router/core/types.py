"""The values a routing decision is made of: snapshots in (workers, request, store answer), a decision out.

Every type is a frozen, slotted dataclass so a decision is a pure function of its inputs: the
shell copies its registry into `WorkerView`s and the store's lookup into a `PrefixHit`, calls
`RouterCore.decide`, and acts on the `Placement` or `Refusal` it gets back.

Times are seconds as floats; `now` and every `*_at_s` are on the caller's clock (wall time in the
shell, virtual time in the simulator). Tier names are the strings in `TIERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import overload

TIERS = ("gpu", "dram", "ssd")


class Role(StrEnum):
    """What a worker does: prefill only, decode only, or both in one process (the baseline)."""

    prefill = "prefill"
    decode = "decode"
    colocated = "colocated"


@dataclass(frozen=True, slots=True)
class PendingJoin:
    """A request the router dispatched to a decode worker that the worker's report does not show yet.

    `join_at_s` is when it is predicted (or known) to join the decode batch, i.e. when its prefill
    finishes; it then runs for up to `max_tokens` steps with `context_tokens` of context.
    """

    request_id: str
    join_at_s: float
    context_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the router saw it at decision time (a copy; nothing here is live).

    - `worker_id` is its address ("host:port"); `host_id` names the machine, so the policy can
      tell a same-host pull (shared memory) from a remote one.
    - Prefill load: `queued_prefill_tokens` (tokens still to compute, all queued requests) and
      `queued_requests`. Decode load: `running_requests` (the batch) and `running_context_tokens`
      (the batch's total context), `max_batch`, `free_pages`.
    - `running_remaining_tokens`: for each running request, the most tokens it may still
      generate, when the worker reports it (empty = unknown: every running request is assumed to
      stay). Predicted-load admission uses it to see departures.
    - `pending_joins`: dispatches not yet in the report, added by `DispatchLedger.apply`.
    - `step_token_budget`: a co-located worker's tokens per step (0 = unknown): its prefill
      chunks share steps with its decode batch, so each chunk also pays a decode step.
    - `report_age_s`: how old the load report is (`now` minus the time it was taken).
    - `queued_are_prompts`: the report counts each queued request at its whole prompt (a worker
      cannot know its hits before its lookup); the dispatch ledger then takes the hit tokens of
      the router's own dispatches in the report back out (`DispatchLedger.apply`).
    """

    worker_id: str
    role: Role
    host_id: str
    model: str
    page_tokens: int
    healthy: bool = True
    queued_prefill_tokens: int = 0
    queued_requests: int = 0
    running_requests: int = 0
    running_context_tokens: int = 0
    free_pages: int = 0
    max_batch: int = 64
    report_age_s: float = 0.0
    running_remaining_tokens: tuple[int, ...] = ()
    pending_joins: tuple[PendingJoin, ...] = ()
    step_token_budget: int = 0
    queued_are_prompts: bool = False

    @property
    def does_prefill(self) -> bool:
        return self.role in (Role.prefill, Role.colocated)

    @property
    def does_decode(self) -> bool:
        return self.role in (Role.decode, Role.colocated)


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The store's answer for a request's page keys: the longest present prefix, page by page.

    `tiers[i]` is the tier holding hit page i ("gpu", "dram", "ssd") and `node_hosts[i]` the host id
    of the store node that holds it; both have `hit_pages` entries.
    """

    hit_pages: int = 0
    tiers: tuple[str, ...] = ()
    node_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.hit_pages < 0:
            raise ValueError(f"hit_pages must be >= 0, got {self.hit_pages}")
        if len(self.tiers) != self.hit_pages or len(self.node_hosts) != self.hit_pages:
            raise ValueError(
                f"a PrefixHit of {self.hit_pages} pages needs as many tiers and node hosts "
                f"(got {len(self.tiers)} and {len(self.node_hosts)})"
            )
        for tier in self.tiers:
            if tier not in TIERS:
                raise ValueError(f"unknown tier {tier!r} (known: {', '.join(TIERS)})")

    @classmethod
    def none(cls) -> PrefixHit:
        """A miss, or a store that did not answer: nothing to pull."""
        return cls()

    @classmethod
    def uniform(cls, hit_pages: int, tier: str, node_host: str) -> PrefixHit:
        """`hit_pages` pages all in one tier on one node (a convenience for the shell and tests)."""
        return cls(hit_pages, (tier,) * hit_pages, (node_host,) * hit_pages)


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the router knows of a request when it places it.

    `prompt_tokens` is the tokenized prompt's length, `max_tokens` the generation limit,
    `slo_class` the class name ("" = the default class), `prefix` the store's answer for its page
    keys, `page_tokens`/`page_bytes` the page geometry of the model's scope, `model` the requested
    model ("" = any), `tenant` the tenant ("" = none).
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    slo_class: str = ""
    prefix: PrefixHit = field(default_factory=PrefixHit.none)
    page_tokens: int = 16
    page_bytes: int = 0
    tenant: str = ""
    model: str = ""

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        if self.page_bytes < 0:
            raise ValueError(f"page_bytes must be >= 0, got {self.page_bytes}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One (prefill, decode) pair the policy priced, and why it lost ("" for the winner)."""

    prefill_id: str
    decode_id: str
    predicted_ttft_s: float
    predicted_tpot_s: float
    cost: float
    rejected_because: str = ""
    hit_tokens_used: int = 0
    queue_s: float = 0.0
    pull_s: float = 0.0
    compute_s: float = 0.0


class CandidateList(Sequence[Candidate]):
    """A decision's priced candidates, the winner first, built when first read.

    A policy prices its pairs as plain numbers; the `Candidate` records (and the reason each
    lost) cost more to build than the decision itself, and only an explanation reads them.
    `build` returns all `count` candidates in order; it is called at most once and must be pure
    (a decision's inputs are frozen, so it gives what it would have given at decision time).
    The length is known without building. Equal to a tuple (or another list) of the same
    candidates.
    """

    __slots__ = ("_build", "_count", "_items")

    def __init__(self, count: int, build: Callable[[], Sequence[Candidate]]) -> None:
        if count < 1:
            raise ValueError(f"a candidate list holds at least its winner, got count {count}")
        self._count = count
        self._build: Callable[[], Sequence[Candidate]] | None = build
        self._items: tuple[Candidate, ...] | None = None

    def _all(self) -> tuple[Candidate, ...]:
        items = self._items
        if items is None:
            assert self._build is not None
            items = tuple(self._build())
            if len(items) != self._count:
                raise AssertionError(f"built {len(items)} candidates, announced {self._count}")
            self._items = items
            self._build = None
        return items

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Candidate: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Candidate, ...]: ...

    def __getitem__(self, index: int | slice) -> Candidate | tuple[Candidate, ...]:
        return self._all()[index]

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CandidateList | tuple):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs and what the router expects of it.

    `prefill_id == decode_id` for a co-located worker. `predicted_queue_s` is the part of the
    predicted TTFT spent waiting behind the worker's queue, `prefill_work_s` the part this request
    adds to that queue (pull + compute), `hit_tokens_used` the prefix tokens it pulls instead of
    computing. `candidates` lists the priced pairs, the winner first (a tuple, or a
    `CandidateList` that builds them when read).
    """

    prefill_id: str
    decode_id: str
    predicted_ttft_s: float
    predicted_tpot_s: float
    policy: str
    candidates: Sequence[Candidate] = ()
    predicted_queue_s: float = 0.0
    prefill_work_s: float = 0.0
    hit_tokens_used: int = 0

    @property
    def colocated(self) -> bool:
        return self.prefill_id == self.decode_id


class RefusalReason(StrEnum):
    no_worker = "no_worker"  # no healthy worker can serve the request (HTTP 503)
    ttft_slo = "ttft_slo"  # predicted TTFT breaks the class target (HTTP 429)
    tpot_slo = "tpot_slo"  # predicted TPOT breaks the class target (HTTP 429)
    class_share = "class_share"  # the class is past its share while others need theirs (429)
    rate_limited = "rate_limited"  # a tenant or key limit (429)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The request is not served now; the client may retry after `retry_after_s` (> 0)."""

    reason: RefusalReason
    retry_after_s: float
    detail: str
    slo_class: str = ""
    placement: Placement | None = None  # the placement admission turned down, when there was one


Decision = Placement | Refusal
