"""`write_kv`: scatter the K and V rows of N new tokens into their pool slots.

A slot is `page_id * page_tokens + offset`. A negative slot means "skip this row" (padding).
"""

from __future__ import annotations

import torch

from engine.kernels.backend import HAVE_TRITON, select_backend

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _write_kv_kernel(
        key_ptr,
        value_ptr,
        key_cache_ptr,
        value_cache_ptr,
        slot_ptr,
        stride_kn,
        stride_kh,
        stride_vn,
        stride_vh,
        stride_cp,
        stride_ct,
        stride_ch,
        num_slots,
        PAGE_TOKENS: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per token row: all of its heads, K and V.
        n = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + n).to(tl.int64)
        idx = tl.arange(0, BLOCK)
        head = idx // HEAD_DIM
        dim = idx % HEAD_DIM
        slots = (
            tl.zeros([BLOCK], dtype=tl.int64) + slot
        )  # broadcast: the interpreter rejects scalar masks
        mask = (idx < NUM_HEADS * HEAD_DIM) & (slots >= 0) & (slots < num_slots)
        page = slot // PAGE_TOKENS
        offset = slot % PAGE_TOKENS
        dst = page * stride_cp + offset * stride_ct + head * stride_ch + dim
        k = tl.load(key_ptr + n * stride_kn + head * stride_kh + dim, mask=mask)
        v = tl.load(value_ptr + n * stride_vn + head * stride_vh + dim, mask=mask)
        tl.store(key_cache_ptr + dst, k, mask=mask)
        tl.store(value_cache_ptr + dst, v, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write `key[n]`, `value[n]` (`[N, kv_heads, head_dim]`) into slot `slot_mapping[n]` of the caches.

    The caches are `[num_pages, page_tokens, kv_heads, head_dim]` views (e.g. `PagedKVPool.key_cache`)
    with unit stride on the last dimension. Mutates the caches in place. Raises ValueError on a shape,
    dtype, device or stride mismatch, and (for CPU tensors, where the check is free) on a slot
    past the end of the cache; the kernel also skips such slots rather than write out of bounds.
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    if select_backend(backend, key.device) == "torch":
        write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
        return
    n, heads, head_dim = key.shape
    if n == 0:
        return
    num_pages, page_tokens = key_cache.shape[:2]
    _write_kv_kernel[(n,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_pages * page_tokens,
        PAGE_TOKENS=page_tokens,
        NUM_HEADS=heads,
        HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(heads * head_dim),
    )


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The torch definition of `write_kv` (no checks beyond indexing's own)."""
    page_tokens = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    pages, offsets = slots // page_tokens, slots % page_tokens
    key_cache[pages, offsets] = key[keep]
    value_cache[pages, offsets] = value[keep]


def _check(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [N, heads, head_dim], got {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [pages, page_tokens, heads, head_dim], got "
            f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}"
        )
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"rows are {tuple(key.shape[1:])} but cache rows are {tuple(key_cache.shape[2:])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or not slot_mapping.is_contiguous():
        raise ValueError(
            f"slot_mapping must be contiguous int32 or int64, got {slot_mapping.dtype}"
        )
    dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    if len(dtypes) != 1:
        raise ValueError(
            f"key, value and caches must share one dtype, got {sorted(map(str, dtypes))}"
        )
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need unit stride on head_dim")
    if key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride():
        raise ValueError("caches need unit stride on head_dim and identical strides")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        limit = key_cache.shape[0] * key_cache.shape[1]
        if int(slot_mapping.max()) >= limit:
            raise ValueError(f"slot {int(slot_mapping.max())} is past the cache's {limit} slots")
