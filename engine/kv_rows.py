"""`KVRows`: each decoding sequence's keys and values as one contiguous block that grows with it,
mirroring its pages in a `PagedKVPool`, so a decode step on CPU reads the batch's K/V in place
(DESIGN §8).

The pool stays the source of truth: prefill, pulls from the store and publishing work on its
pages. A row copies its sequence's pages once, when the sequence starts decoding (`prepare`
catches a row up with the pool), and from then on every decode step writes the new token into
both. Attention over the batch then reads one strided view `[B, kv_heads, span, head_dim]` a
layer, which is the memory-bound minimum; gathering the pages at every step instead reads and
writes every cached token once more.

Layout: `[max_rows, layers, 2 (K, V), kv_heads, capacity_tokens, head_dim]`. The rows in use are
`0 .. count-1` (releasing a row moves the last one into its place), so a batch taken in row
order is a slice of the tensor, not a copy. The tensor is allocated empty (memory the OS maps
only when touched), a row is zeroed the first time it is used (so the padding past a shorter
row's length is finite), and the capacity grows, by half again at least, when a longer
sequence attaches.

Costs: the memory of the decoding sequences' K/V a second time, one copy of a sequence's K/V
when it joins, one row's copy when a row other than the last is released. Not thread-safe:
the worker's scheduler thread owns it, as it owns the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_pool import PagedKVPool

_SYNC_PAGES = 8  # pages a row copies from the pool at a time


class KVRow:
    """One sequence's row: its `index` (which changes when rows are compacted), the `length`
    of its tokens mirrored, the `capacity` in tokens it may grow to."""

    __slots__ = ("capacity", "index", "length")

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index
        self.length = 0
        self.capacity = capacity


@dataclass(frozen=True, slots=True, eq=False)
class RowStep:
    """One decode step over rows (from `KVRows.prepare`): row `index[b]` gets sequence b's new
    token at `positions[b]`, then attends over its first `lengths[b]` tokens (None: all
    `span`). `in_order` says the rows are 0..B-1, so the views need no copy."""

    rows: KVRows
    index: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor | None
    span: int
    in_order: bool

    @property
    def count(self) -> int:
        return int(self.index.shape[0])

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new K and V rows (`[B, kv_heads, head_dim]`) of `layer`."""
        tensor = self.rows.tensor
        tensor[:, layer, 0][self.index, :, self.positions] = key
        tensor[:, layer, 1][self.index, :, self.positions] = value

    def keys(self, layer: int) -> torch.Tensor:
        """`[B, kv_heads, span, head_dim]`: a view when `in_order`, else a copy."""
        return self._take(layer, 0)

    def values(self, layer: int) -> torch.Tensor:
        return self._take(layer, 1)

    def _take(self, layer: int, which: int) -> torch.Tensor:
        tensor = self.rows.tensor
        if self.in_order:
            return tensor[: self.count, layer, which, :, : self.span]
        return tensor[:, layer, which, :, : self.span].index_select(0, self.index)


class KVRows:
    """Up to `max_rows` rows over `pool`, each up to `max_tokens` tokens long."""

    def __init__(self, pool: PagedKVPool, *, max_rows: int, max_tokens: int) -> None:
        if max_rows < 1 or max_tokens < 1:
            raise ValueError(
                f"max_rows and max_tokens must be positive, got {max_rows}, {max_tokens}"
            )
        self.pool = pool
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        lay = pool.layout
        self._shape = (max_rows, lay.num_layers, 2, lay.num_kv_heads, lay.head_dim)
        self.tensor = self._empty(0)
        self._rows: list[KVRow] = []
        self._finite = 0  # rows 0.._finite-1 of the tensor hold finite values (zeroed once)

    @property
    def count(self) -> int:
        """Rows in use."""
        return len(self._rows)

    @property
    def capacity_tokens(self) -> int:
        return int(self.tensor.shape[4])

    def attach(self, capacity_tokens: int) -> KVRow:
        """A new, empty row (the next index) for a sequence of up to `capacity_tokens` tokens.
        Mutates: may grow the tensor (copying the rows in use). Raises ValueError when all rows
        are taken or the capacity is past `max_tokens`."""
        if len(self._rows) >= self.max_rows:
            raise ValueError(f"all {self.max_rows} rows are in use")
        if not 1 <= capacity_tokens <= self.max_tokens:
            raise ValueError(f"capacity {capacity_tokens} is outside [1, {self.max_tokens}]")
        if capacity_tokens > self.capacity_tokens:
            self._grow(capacity_tokens)
        row = KVRow(len(self._rows), capacity_tokens)
        if row.index >= self._finite:  # fresh memory; an earlier row's stale values are finite
            self.tensor[row.index].zero_()
            self._finite = row.index + 1
        self._rows.append(row)
        return row

    def release(self, row: KVRow) -> None:
        """Give `row` back; the last row moves into its place (its `index` changes). Raises
        ValueError for a row that is not in use here."""
        if not 0 <= row.index < len(self._rows) or self._rows[row.index] is not row:
            raise ValueError("the row is not in use in these rows")
        last = self._rows.pop()
        if last is not row:
            n = last.length
            self.tensor[row.index, :, :, :, :n] = self.tensor[last.index, :, :, :, :n]
            last.index = row.index
            self._rows[row.index] = last
        row.index = -1

    def prepare(
        self,
        rows: Sequence[KVRow],
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
    ) -> RowStep:
        """Make sequence b's row hold its first `context_lens[b]` tokens (copying from the pool
        along `block_tables[b]` what it lacks) and plan a decode step that writes token
        `context_lens[b]`: the row's length becomes one more. Raises ValueError for a row that
        is released or belongs elsewhere, that holds tokens past the context (its sequence moved
        back: it needs a fresh row), or that the new token would overflow."""
        if not len(rows) == len(block_tables) == len(context_lens):
            raise ValueError(
                f"{len(rows)} rows, {len(block_tables)} block tables, {len(context_lens)} lengths"
            )
        for row, table, ctx in zip(rows, block_tables, context_lens, strict=True):
            if not 0 <= row.index < len(self._rows) or self._rows[row.index] is not row:
                raise ValueError("a row is not in use in these rows")
            if ctx >= row.capacity:
                raise ValueError(f"token {ctx} is past the row's capacity of {row.capacity}")
            if row.length > ctx:
                raise ValueError(f"the row holds {row.length} tokens, the sequence has {ctx}")
            if row.length < ctx:
                self._sync(row, table, ctx)
            row.length = ctx + 1
        index = [row.index for row in rows]
        span = max(context_lens, default=0) + 1
        lengths = None
        if any(ctx + 1 != span for ctx in context_lens):
            lengths = torch.tensor([ctx + 1 for ctx in context_lens], dtype=torch.int64)
        device = self.tensor.device
        return RowStep(
            rows=self,
            index=torch.tensor(index, dtype=torch.int64, device=device),
            positions=torch.tensor(list(context_lens), dtype=torch.int64, device=device),
            lengths=None if lengths is None else lengths.to(device),
            span=span,
            in_order=index == list(range(len(index))),
        )

    def _sync(self, row: KVRow, table: Sequence[int], end: int) -> None:
        """Copy the pool's tokens `[row.length, end)` of the sequence along `table` into `row`
        (whole pages: the tokens below `row.length` are equal in both already), a few pages a
        copy (a small gather buffer the allocator reuses, instead of one the size of the
        sequence)."""
        page = self.pool.page_tokens
        first, last = row.length // page, -(-end // page)
        if last > len(table):
            raise ValueError(f"block table of {len(table)} pages cannot hold {end} tokens")
        lay = self.pool.layout
        cap = self.capacity_tokens
        for lo in range(first, last, _SYNC_PAGES):
            hi = min(last, lo + _SYNC_PAGES)
            ids = torch.tensor(list(table[lo:hi]), dtype=torch.int64, device=self.pool.device)
            src = self.pool.tensor[ids]  # [n, layers, 2, page_tokens, kv_heads, head_dim]
            stop = min(hi * page, cap)
            whole = (stop - lo * page) // page
            dst = self.tensor[row.index, :, :, :, lo * page : stop]
            if whole:
                shape = (lay.num_layers, 2, lay.num_kv_heads, whole, page, lay.head_dim)
                dst[:, :, :, : whole * page].view(shape).copy_(
                    src[:whole].permute(1, 2, 4, 0, 3, 5)
                )
            if whole < hi - lo:  # the row's capacity ends inside this page
                tail = stop - (lo + whole) * page
                dst[:, :, :, whole * page :] = src[whole, :, :, :tail].permute(0, 1, 3, 2, 4)

    def _grow(self, tokens: int) -> None:
        old = self.tensor
        cap = min(self.max_tokens, max(tokens, old.shape[4] * 3 // 2))
        page = self.pool.page_tokens
        cap = min(self.max_tokens, -(-cap // page) * page)
        new = self._empty(cap)
        for row in self._rows:
            new[row.index, :, :, :, old.shape[4] :].zero_()
            new[row.index, :, :, :, : old.shape[4]] = old[row.index]
        self.tensor = new
        self._finite = len(self._rows)

    def _empty(self, tokens: int) -> torch.Tensor:
        rows, layers, two, heads, dim = self._shape
        return torch.empty(
            (rows, layers, two, heads, tokens, dim), dtype=self.pool.dtype, device=self.pool.device
        )
