"""The paged KV pool: one tensor whose page is exactly one store page payload (DESIGN §4, §8).

Shape `[num_pages, layers, 2 (K, V), page_tokens, kv_heads, head_dim]`, page-first and contiguous,
so `tensor[p]` has the bytes of a store page payload `[layers][K,V][page_tokens][kv_heads][head_dim]`
and publishing or pulling a page is a single copy with no reshaping.

A sequence owns a block table: the list of its page ids, in order. Its token `i` lives in slot
`block_table[i // page_tokens] * page_tokens + i % page_tokens`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from client import KVLayout

# Torch dtypes a pool may hold, by the KV dtype name a `Scope` uses.
KV_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}

Buffer = bytes | bytearray | memoryview


class PoolExhausted(RuntimeError):
    """`allocate` asked for more pages than the pool has free."""


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The `Scope.kv_dtype` name of a torch dtype; raises ValueError for one a pool cannot hold."""
    try:
        return KV_DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"KV dtype {dtype} is not supported; use one of {list(KV_DTYPE_NAMES)}"
        ) from None


class PagedKVPool:
    """A fixed set of KV pages on one device, with a free list. Not thread-safe.

    `allocate`/`free` mutate the free list only; page contents are written by the model (through
    `key_cache`/`value_cache` views) or by `load_page`.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.dtype = dtype
        self.kv_dtype = kv_dtype_name(dtype)
        self.device = torch.device(device)
        self.tensor = torch.zeros(
            (
                num_pages,
                layout.num_layers,
                2,
                layout.page_tokens,
                layout.num_kv_heads,
                layout.head_dim,
            ),
            dtype=dtype,
            device=self.device,
        )
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def page_tokens(self) -> int:
        return self.layout.page_tokens

    @property
    def page_payload_bytes(self) -> int:
        """Bytes of one page: `layout.payload_bytes(kv_dtype)`."""
        return self.layout.payload_bytes(self.kv_dtype)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free page ids (lowest first). Raises PoolExhausted, taking none, if short."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            raise PoolExhausted(
                f"asked for {count} pages, {len(self._free)} of {self.num_pages} free"
            )
        pages = [self._free.pop() for _ in range(count)]
        self._used.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the free list. Raises ValueError (freeing none) for a page not in use."""
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"pages {bad or list(pages)} are not allocated (or repeat)")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a sequence of `num_tokens` tokens needs."""
        return -(-num_tokens // self.page_tokens)

    def key_cache(self, layer: int) -> torch.Tensor:
        """View `[num_pages, page_tokens, kv_heads, head_dim]` of layer `layer`'s keys (strided)."""
        return self.tensor[:, layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        """View `[num_pages, page_tokens, kv_heads, head_dim]` of layer `layer`'s values (strided)."""
        return self.tensor[:, layer, 1]

    def slot_mapping(self, block_table: Sequence[int], start: int, count: int) -> torch.Tensor:
        """Slots (int64, on the pool's device) of tokens `start .. start+count` of a sequence."""
        if start < 0 or count < 0 or self.pages_for(start + count) > len(block_table):
            raise ValueError(
                f"block table of {len(block_table)} pages cannot hold tokens [{start}, {start + count})"
            )
        table = torch.tensor(block_table, dtype=torch.int64)
        idx = torch.arange(start, start + count, dtype=torch.int64)
        slots = table[idx // self.page_tokens] * self.page_tokens + idx % self.page_tokens
        return slots.to(self.device)

    def gather(
        self, block_table: Sequence[int], num_tokens: int, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first `num_tokens` tokens at `layer`: two `[num_tokens, kv_heads, head_dim]`."""
        need = self.pages_for(num_tokens)
        if need > len(block_table):
            raise ValueError(
                f"block table of {len(block_table)} pages cannot hold {num_tokens} tokens"
            )
        lay = self.layout
        pages = torch.tensor(list(block_table[:need]), dtype=torch.int64, device=self.device)
        kv = self.tensor[pages, layer]  # [need, 2, page_tokens, kv_heads, head_dim], a copy
        k = kv[:, 0].reshape(need * lay.page_tokens, lay.num_kv_heads, lay.head_dim)[:num_tokens]
        v = kv[:, 1].reshape(need * lay.page_tokens, lay.num_kv_heads, lay.head_dim)[:num_tokens]
        return k, v

    def page_bytes_view(self, page: int) -> memoryview:
        """Zero-copy, writable byte view of page `page`'s payload. CPU pools only."""
        self._check_page(page)
        if self.device.type != "cpu":
            raise ValueError("page_bytes_view needs a CPU pool; copy the page to host first")
        flat = self.tensor[page].reshape(-1).view(torch.uint8)
        return memoryview(flat.numpy().data).cast("B")

    def read_page(self, page: int) -> bytes:
        """A copy of page `page`'s payload bytes, from any device."""
        self._check_page(page)
        return self.tensor[page].reshape(-1).view(torch.uint8).cpu().numpy().tobytes()

    def load_page(self, page: int, payload: Buffer | torch.Tensor) -> None:
        """Copy a store page payload into page `page`. Raises ValueError on a size mismatch."""
        self._check_page(page)
        want = self.page_payload_bytes
        if isinstance(payload, torch.Tensor):
            src = payload.reshape(-1).view(torch.uint8) if payload.is_contiguous() else None
            if src is None or src.numel() != want:
                raise ValueError(f"payload tensor must be contiguous and {want} bytes")
            self.tensor[page].reshape(-1).view(torch.uint8).copy_(src)
            return
        view = memoryview(payload).cast("B")
        if view.nbytes != want:
            raise ValueError(f"payload is {view.nbytes} bytes, a page is {want}")
        if self.device.type == "cpu":
            self.page_bytes_view(page)[:] = view
            return
        with warnings.catch_warnings():  # frombuffer warns on read-only buffers; we only read it
            warnings.simplefilter("ignore", UserWarning)
            host = torch.frombuffer(view, dtype=torch.uint8)
        self.tensor[page].reshape(-1).view(torch.uint8).copy_(host)

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is out of range [0, {self.num_pages})")
