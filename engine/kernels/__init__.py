"""Triton kernels for the paged KV pool, each with a torch reference (DESIGN §8).

- `write_kv`: scatter the K/V rows of N new tokens into pool slots (one token per program).
- `paged_decode_attention`: one query token per sequence over its block table (one
  (sequence, head) per program, online softmax page by page).
- `dense_decode_attention` (torch only): the same over K/V that lie as one block per sequence,
  the whole batch in one fused `scaled_dot_product_attention` call (the engine's CPU decode).

Each wrapper checks shapes, dtypes, strides and lengths, then dispatches: Triton for CUDA
tensors, torch for CPU ones (for attention a batched path: gather, then one fused attention
call). `backend="triton"` (or `STRATA_KERNEL_BACKEND=triton`) forces Triton, which on CPU
tensors needs `TRITON_INTERPRET=1` set before triton is first imported.
"""

from __future__ import annotations

from engine.kernels.backend import BACKEND_ENV, HAVE_TRITON, select_backend
from engine.kernels.cache_write import write_kv, write_kv_reference
from engine.kernels.dense_attention import dense_decode_attention
from engine.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_gathered,
    paged_decode_attention_reference,
)

__all__ = [
    "BACKEND_ENV",
    "HAVE_TRITON",
    "dense_decode_attention",
    "paged_decode_attention",
    "paged_decode_attention_gathered",
    "paged_decode_attention_reference",
    "select_backend",
    "write_kv",
    "write_kv_reference",
]
