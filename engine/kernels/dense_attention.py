"""`dense_decode_attention`: one query token per sequence over keys and values that lie as one
block per sequence, the whole batch in one call of torch's fused attention.

This is the CPU decode path (DESIGN §8). A batch's keys are a `[B, kv_heads, span, head_dim]`
tensor (any strides with a unit last one: `engine.kv_rows` hands out strided views of its rows),
sequence b using its first `seq_lens[b]` positions. Grouped-query attention costs no copy: the
query heads that share a KV head become that head's query rows (`[B, kv_heads, group, head_dim]`),
which `scaled_dot_product_attention` takes as is; a decode query sees every cached token, so only
the padding past a sequence's length is masked.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def dense_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of `query` `[B, q_heads, head_dim]` over `keys`/`values` `[B, kv_heads, span,
    head_dim]`, sequence b over its first `seq_lens[b]` positions (None: all `span`).

    Returns a new `[B, q_heads, head_dim]` tensor in the query's dtype. Positions past a
    sequence's length must hold finite values (they are masked, and a NaN there would still
    poison the sum). `scale` defaults to 1/sqrt(head_dim). Raises ValueError on a shape, dtype,
    device or stride mismatch, and (CPU) on a length outside [1, span].
    """
    _check(query, keys, values, seq_lens)
    batch, q_heads, head_dim = query.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if batch == 0:
        return torch.empty_like(query)
    q = query.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    mask = None
    if seq_lens is not None:
        positions = torch.arange(span, device=query.device)
        mask = (positions[None, :] < seq_lens.to(torch.int64)[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, q_heads, head_dim)


def _check(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor | None,
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [B, q_heads, head_dim], got {tuple(query.shape)}")
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(
            "keys and values must both be [B, kv_heads, span, head_dim], got "
            f"{tuple(keys.shape)}, {tuple(values.shape)}"
        )
    batch, q_heads, head_dim = query.shape
    if keys.shape[0] != batch or keys.shape[3] != head_dim:
        raise ValueError(
            f"keys {tuple(keys.shape)} do not fit a query of {batch} sequences, head_dim {head_dim}"
        )
    kv_heads, span = keys.shape[1], keys.shape[2]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    if span == 0:
        raise ValueError("keys hold no position")
    if query.dtype != keys.dtype or values.dtype != keys.dtype:
        raise ValueError(
            f"query, keys and values must share one dtype, got {query.dtype}, {keys.dtype}, "
            f"{values.dtype}"
        )
    tensors = (query, keys, values) if seq_lens is None else (query, keys, values, seq_lens)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if query.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("query, keys and values need unit stride on head_dim")
    if seq_lens is None:
        return
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [{batch}], got {tuple(seq_lens.shape)}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be int32 or int64, got {seq_lens.dtype}")
    if seq_lens.device.type == "cpu" and batch:
        low, high = int(seq_lens.min()), int(seq_lens.max())
        if low < 1 or high > span:
            raise ValueError(f"seq_lens must lie in [1, {span}], got [{low}, {high}]")
