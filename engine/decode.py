"""`DecodeWorker`: the decode half of a disaggregated engine (DESIGN §1, §8).

A request arrives with its prompt and the tokens produced so far (prefill's first token, or all
an earlier decode worker streamed before it went away). The worker pulls every page the store
has of those tokens (io class CRITICAL: a decode is waiting to start), recomputes the rest — at
least the partial tail page, all of it when the store has nothing — and joins the request to its
continuously batched decode loop. Tokens stream as they are sampled; each page of generated text
is published as it fills, so another worker can resume the request from the store.

Programmatic use (benchmarks):

    worker = DecodeWorker(checkpoint_dir, StoreClient(addr), page_tokens=16, max_batch=32)
    stream = worker.submit(DecodeRequest(prompt_ids, (first_token,), SamplingParams(max_tokens=64)))
    for event in stream: ...            # TokenEvent(index, token_id, text, finish_reason, ...)
    result = worker.generate(prompt_ids, (first_token,), SamplingParams(max_tokens=64))
    worker.stop()
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from engine.checkpoint import Checkpoint
from engine.requests import DecodeRequest, DecodeResult
from engine.runtime import ModelRuntime, as_runtime
from engine.sampling import SamplingParams
from engine.scheduler import BatchScheduler, SchedulerOptions
from engine.store_link import PageStore, StoreLink

__all__ = ["DecodeWorker"]


class DecodeWorker(BatchScheduler):
    """Continues requests from the store, batched. Thread-safe `submit`; `stop()` to end.

    `model` is a checkpoint (folder or loaded) or a ModelRuntime to share. `kv_capacity_tokens`
    sizes the KV pool (see SchedulerOptions).
    """

    role = "decode"

    def __init__(
        self,
        model: ModelRuntime | Checkpoint | str | Path,
        store: PageStore | None,
        *,
        page_tokens: int | None = None,
        max_context: int | None = None,
        device: torch.device | str | None = None,
        max_batch: int = 32,
        chunk_tokens: int = 256,
        kv_capacity_tokens: int | None = None,
        max_waiting: int = 1024,
        store_retry_after_s: float = 1.0,
    ) -> None:
        runtime = as_runtime(model, page_tokens=page_tokens, max_context=max_context, device=device)
        options = SchedulerOptions(
            max_batch=max_batch,
            chunk_tokens=chunk_tokens,
            kv_capacity_tokens=kv_capacity_tokens,
            max_waiting=max_waiting,
        )
        super().__init__(runtime, StoreLink(store, retry_after_s=store_retry_after_s), options)

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
        sampling: SamplingParams | None = None,
        *,
        namespace: str = "",
        request_id: str = "",
    ) -> DecodeResult:
        """Submit and wait for the whole result (the new tokens only)."""
        request = DecodeRequest(
            tuple(prompt_token_ids),
            tuple(output_token_ids),
            sampling if sampling is not None else SamplingParams(),
            namespace,
            request_id,
        )
        return self.submit(request).result()
