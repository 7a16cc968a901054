"""`paged_decode_attention`: one new query token per sequence, attending over its paged KV.

Sequence b's keys and values are its first `seq_lens[b]` tokens, laid out page by page along its
row of `block_tables`; its query heads map onto KV heads in groups (GQA).

Three implementations: the Triton kernel (CUDA; CPU under TRITON_INTERPRET=1), the torch path
the "torch" backend runs (the batch's pages gathered into one padded block per sequence, then
`dense_decode_attention`: one fused attention call for the whole batch), and the reference, the
definition both are tested against. The engine's CPU decode avoids even the gather: it keeps each
decoding sequence's K/V contiguous as it grows (`engine.kv_rows`).
"""

from __future__ import annotations

import math

import torch

from engine.kernels.backend import HAVE_TRITON, select_backend
from engine.kernels.dense_attention import dense_decode_attention

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_decode_kernel(
        query_ptr,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr,
        seq_lens_ptr,
        out_ptr,
        stride_qb,
        stride_qh,
        stride_ob,
        stride_oh,
        stride_cp,
        stride_ct,
        stride_ch,
        stride_bt,
        num_pages,
        scale,
        QUERIES_PER_KV: tl.constexpr,
        PAGE_TOKENS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per (sequence, query head); an online softmax walks the sequence's pages.
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        kv_head = head // QUERIES_PER_KV
        seq_len = tl.load(seq_lens_ptr + seq)
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        toks = tl.arange(0, BLOCK_T)
        q = tl.load(query_ptr + seq * stride_qb + head * stride_qh + dims, mask=dim_mask, other=0.0)
        q = q.to(tl.float32) * scale

        running_max = -float("inf")
        running_sum = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(0, tl.cdiv(seq_len, PAGE_TOKENS)):
            page = tl.load(block_tables_ptr + seq * stride_bt + i).to(tl.int64)
            tok_mask = (toks < PAGE_TOKENS) & (i * PAGE_TOKENS + toks < seq_len)
            pages = tl.zeros([BLOCK_T], dtype=tl.int64) + page  # broadcast before masking
            tok_mask = tok_mask & (pages >= 0) & (pages < num_pages)
            offs = (
                page * stride_cp + toks[:, None] * stride_ct + kv_head * stride_ch + dims[None, :]
            )
            mask2 = tok_mask[:, None] & dim_mask[None, :]
            k = tl.load(key_cache_ptr + offs, mask=mask2, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1)
            scores = tl.where(tok_mask, scores, -float("inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            # A page with no valid token (only a bad page id can cause one) must not make NaNs.
            correction = tl.where(new_max == -float("inf"), 1.0, tl.exp(running_max - new_max))
            probs = tl.exp(scores - new_max)
            probs = tl.where(tok_mask, probs, 0.0)
            v = tl.load(value_cache_ptr + offs, mask=mask2, other=0.0).to(tl.float32)
            acc = acc * correction + tl.sum(probs[:, None] * v, axis=0)
            running_sum = running_sum * correction + tl.sum(probs, axis=0)
            running_max = new_max
        out = acc / tl.maximum(running_sum, 1e-30)
        tl.store(
            out_ptr + seq * stride_ob + head * stride_oh + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=dim_mask,
        )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of `query` `[B, q_heads, head_dim]` over each sequence's first `seq_lens[b]` tokens.

    `key_cache`/`value_cache` are `[num_pages, page_tokens, kv_heads, head_dim]` views; `block_tables`
    is `[B, max_pages]` page ids (entries past a sequence's last page are ignored); `seq_lens` is
    `[B]` (each >= 1). Returns a new `[B, q_heads, head_dim]` tensor in the query's dtype. `scale`
    defaults to 1/sqrt(head_dim). Raises ValueError on a shape, dtype, device, stride or length
    mismatch (lengths and page ids are checked against the tables for CPU tensors).
    """
    _check(query, key_cache, value_cache, block_tables, seq_lens)
    head_dim = query.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if select_backend(backend, query.device) == "torch":
        return paged_decode_attention_gathered(
            query, key_cache, value_cache, block_tables, seq_lens, scale=scale
        )
    batch, q_heads, _ = query.shape
    num_pages, page_tokens, kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    if batch == 0:
        return out
    _paged_decode_kernel[(batch, q_heads)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        num_pages,
        scale,
        QUERIES_PER_KV=q_heads // kv_heads,
        PAGE_TOKENS=page_tokens,
        HEAD_DIM=head_dim,
        BLOCK_T=triton.next_power_of_2(page_tokens),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


def paged_decode_attention_gathered(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The torch path: one gather of the pages the batch reaches into `[B, span, kv_heads,
    head_dim]` blocks (one copy of the K/V read), then one fused attention over the batch."""
    batch = query.shape[0]
    num_pages, page_tokens, kv_heads, head_dim = key_cache.shape
    if batch == 0:
        return torch.empty_like(query)
    needed = max(1, -(-int(seq_lens.max()) // page_tokens))
    tables = block_tables[:, : min(needed, block_tables.shape[1])].to(torch.int64)
    tables = tables.clamp(0, num_pages - 1)  # entries past a sequence's pages are not read
    span = tables.shape[1] * page_tokens
    keys = key_cache[tables].reshape(batch, span, kv_heads, head_dim).transpose(1, 2)
    values = value_cache[tables].reshape(batch, span, kv_heads, head_dim).transpose(1, 2)
    lengths = None if bool((seq_lens == span).all()) else seq_lens
    return dense_decode_attention(query, keys, values, lengths, scale=scale)


def paged_decode_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The torch definition: gather each sequence's pages, mask past its length, softmax in float32."""
    batch, q_heads, head_dim = query.shape
    num_pages, page_tokens, kv_heads, _ = key_cache.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    tables = block_tables.to(torch.int64).clamp(0, num_pages - 1)
    if seq_lens.numel():  # only the pages some sequence reaches: tables may be padded far wider
        needed = max(1, -(-int(seq_lens.max()) // page_tokens))
        tables = tables[:, : min(needed, tables.shape[1])]
    span = tables.shape[1] * page_tokens
    keys = key_cache[tables].reshape(batch, span, kv_heads, head_dim).float()
    values = value_cache[tables].reshape(batch, span, kv_heads, head_dim).float()
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.einsum("bhgd,bshd->bhgs", q, keys) * scale
    valid = torch.arange(span, device=query.device)[None, :] < seq_lens.to(query.device)[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, values)
    return out.reshape(batch, q_heads, head_dim).to(query.dtype)


def _check(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [B, q_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [pages, page_tokens, kv_heads, head_dim], got "
            f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}"
        )
    batch, q_heads, head_dim = query.shape
    num_pages, page_tokens, kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, max_pages], got {tuple(block_tables.shape)}"
        )
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [{batch}], got {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride on its last dimension")
    if query.dtype != key_cache.dtype or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"query and caches must share one dtype, got {query.dtype}, {key_cache.dtype}, {value_cache.dtype}"
        )
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if (
        query.stride(-1) != 1
        or key_cache.stride(-1) != 1
        or key_cache.stride() != value_cache.stride()
    ):
        raise ValueError("query and caches need unit stride on head_dim; caches identical strides")
    if seq_lens.device.type == "cpu" and batch:
        if int(seq_lens.min()) < 1:
            raise ValueError("every sequence needs seq_lens >= 1")
        longest = int(seq_lens.max())
        if longest > block_tables.shape[1] * page_tokens:
            raise ValueError(
                f"a sequence of {longest} tokens needs more than the {block_tables.shape[1]} pages "
                f"of page_tokens={page_tokens} its block table has"
            )
        used = torch.arange(block_tables.shape[1])[None, :] * page_tokens < seq_lens[:, None]
        pages = block_tables[used]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            raise ValueError(f"block_tables holds a page id outside [0, {num_pages})")
