"""`ColocatedWorker`: prefill and decode in one process, the baseline disaggregation must beat.

Requests arrive with just a prompt. Each scheduler step spends a token budget (Sarathi-style
chunked prefill): one token for every request that is decoding, the rest on prompt chunks of
the requests still prefilling, oldest first. So a long prompt delays the running decodes by at
most one budget per step instead of stalling them for its whole prefill. With a store, prompt
prefixes are pulled from it (io class NORMAL) and full pages are published, as in the
disaggregated workers; without one, it computes everything.

Programmatic use (benchmarks):

    worker = ColocatedWorker(checkpoint_dir, None, step_token_budget=512, max_batch=32)
    result = worker.generate(prompt_ids, SamplingParams(max_tokens=64))
    result.token_times_s  # per-token timestamps: TTFT and TPOT
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from client import IoClass
from engine.checkpoint import Checkpoint
from engine.requests import DecodeRequest, DecodeResult
from engine.runtime import ModelRuntime, as_runtime
from engine.sampling import SamplingParams
from engine.scheduler import BatchScheduler, SchedulerOptions
from engine.store_link import PageStore, StoreLink

__all__ = ["ColocatedWorker"]


class ColocatedWorker(BatchScheduler):
    """Serves whole requests (prompt in, tokens out) with chunked prefill under a per-step token
    budget. Thread-safe `submit`; `stop()` to end."""

    role = "colocated"

    def __init__(
        self,
        model: ModelRuntime | Checkpoint | str | Path,
        store: PageStore | None = None,
        *,
        page_tokens: int | None = None,
        max_context: int | None = None,
        device: torch.device | str | None = None,
        max_batch: int = 32,
        step_token_budget: int = 512,
        chunk_tokens: int = 256,
        kv_capacity_tokens: int | None = None,
        max_waiting: int = 1024,
        store_retry_after_s: float = 1.0,
    ) -> None:
        runtime = as_runtime(model, page_tokens=page_tokens, max_context=max_context, device=device)
        options = SchedulerOptions(
            max_batch=max_batch,
            chunk_tokens=chunk_tokens,
            step_token_budget=step_token_budget,
            kv_capacity_tokens=kv_capacity_tokens,
            pull_io_class=IoClass.NORMAL,
            max_waiting=max_waiting,
        )
        super().__init__(runtime, StoreLink(store, retry_after_s=store_retry_after_s), options)

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        namespace: str = "",
        request_id: str = "",
    ) -> DecodeResult:
        """Submit a prompt and wait for the whole result."""
        request = DecodeRequest(
            tuple(prompt_token_ids),
            (),
            sampling if sampling is not None else SamplingParams(),
            namespace,
            request_id,
        )
        return self.submit(request).result()
