"""The paged KV pool (DESIGN §4, §8): a pool page has exactly the bytes of a store page payload."""

from __future__ import annotations

import pytest
import torch

from client import KVLayout, Scope, decode_page, encode_page, make_header
from engine.kv_pool import PagedKVPool, PoolExhausted
from engine.kv_rows import KVRow, KVRows

pytestmark = pytest.mark.unit

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, page_tokens=4)


def _filled(dtype: torch.dtype = torch.float32, pages: int = 6) -> PagedKVPool:
    pool = PagedKVPool(LAYOUT, pages, dtype)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(0)))
    return pool


@pytest.mark.parametrize(
    ("dtype", "name"),
    [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")],
)
def test_page_view_is_the_store_payload(dtype: torch.dtype, name: str) -> None:
    pool = _filled(dtype)
    assert pool.tensor.shape == (6, 3, 2, 4, 2, 8) and pool.tensor.is_contiguous()
    assert pool.kv_dtype == name
    assert (
        pool.page_payload_bytes == LAYOUT.payload_bytes(name) == 3 * 2 * 4 * 2 * 8 * dtype.itemsize
    )
    for page in (0, 4):
        view = pool.page_bytes_view(page)
        assert view.nbytes == LAYOUT.payload_bytes(name)
        assert bytes(view) == pool.tensor[page].contiguous().view(torch.uint8).numpy().tobytes()
        assert bytes(view) == pool.read_page(page)
    # Payload order is [layers][K,V][page_tokens][kv_heads][head_dim]: element (layer, kv, t, h, d).
    flat = pool.tensor[2].reshape(-1)
    layer, kv, t, h, d = 1, 1, 3, 0, 5
    assert flat[(((layer * 2 + kv) * 4 + t) * 2 + h) * 8 + d] == pool.tensor[2, layer, kv, t, h, d]
    assert torch.equal(pool.key_cache(layer)[2, t, h], pool.tensor[2, layer, 0, t, h])
    assert torch.equal(pool.value_cache(layer)[2, t, h], pool.tensor[2, layer, 1, t, h])


def test_page_view_is_zero_copy() -> None:
    pool = _filled()
    view = pool.page_bytes_view(3)
    pool.tensor[3].fill_(2.0)
    assert bytes(view[:4]) == torch.tensor([2.0]).numpy().tobytes()
    view[:] = bytes(len(view))
    assert torch.count_nonzero(pool.tensor[3]) == 0
    assert torch.count_nonzero(pool.tensor[2]) > 0


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "tensor"])
def test_load_page_round_trip(kind: str) -> None:
    src = _filled(torch.bfloat16)
    dst = PagedKVPool(LAYOUT, 6, torch.bfloat16)
    payload = src.read_page(1)
    buffer = {
        "bytes": payload,
        "bytearray": bytearray(payload),
        "memoryview": memoryview(payload),
        "tensor": src.tensor[1],
    }[kind]
    dst.load_page(4, buffer)
    assert torch.equal(dst.tensor[4], src.tensor[1])
    assert torch.count_nonzero(dst.tensor[:4].float()) == 0
    with pytest.raises(ValueError, match="bytes"):
        dst.load_page(0, payload[:-2])
    with pytest.raises(ValueError, match="out of range"):
        dst.load_page(6, payload)


def test_publish_and_pull_through_the_page_codec() -> None:
    """One copy each way: a pool page → encoded store page → another pool's page."""
    scope = Scope(
        model_id="m",
        weights_revision="w",
        tokenizer_fingerprint="t",
        kv_dtype="float32",
        layout=LAYOUT,
    )
    pool = _filled()
    tokens = [5, 6, 7, 8]
    stored = encode_page(
        make_header(scope, scope.digest, tokens, pool.page_bytes_view(2)), pool.page_bytes_view(2)
    )
    header, payload = decode_page(stored)
    header.validate_for(scope)
    other = PagedKVPool(LAYOUT, 2)
    other.load_page(1, payload)
    assert torch.equal(other.tensor[1], pool.tensor[2])


def test_allocate_and_free() -> None:
    pool = PagedKVPool(LAYOUT, 4)
    assert pool.allocate(2) == [0, 1] and pool.num_free == 2
    with pytest.raises(PoolExhausted):
        pool.allocate(3)
    assert pool.num_free == 2  # a refused allocation takes nothing
    rest = pool.allocate(2)
    assert rest == [2, 3] and pool.num_free == 0
    pool.free([1, 3])
    assert pool.num_free == 2 and sorted(pool.allocate(2)) == [1, 3]
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0, 0])
    pool.free([0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0])
    assert pool.pages_for(0) == 0 and pool.pages_for(4) == 1 and pool.pages_for(5) == 2


def test_slots_and_gather_follow_the_block_table() -> None:
    pool = _filled(pages=8)
    table = [5, 2, 7]
    assert pool.slot_mapping(table, 3, 3).tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    with pytest.raises(ValueError, match="cannot hold"):
        pool.slot_mapping(table, 10, 3)
    k, v = pool.gather(table, 10, layer=1)
    assert k.shape == v.shape == (10, 2, 8)
    for i in range(10):
        page, off = table[i // 4], i % 4
        assert torch.equal(k[i], pool.tensor[page, 1, 0, off])
        assert torch.equal(v[i], pool.tensor[page, 1, 1, off])
    with pytest.raises(ValueError, match="cannot hold"):
        pool.gather(table, 13, layer=0)


def test_pool_rejects_unsupported_dtype_and_size() -> None:
    with pytest.raises(ValueError, match="not supported"):
        PagedKVPool(LAYOUT, 2, torch.float64)
    with pytest.raises(ValueError, match="positive"):
        PagedKVPool(LAYOUT, 0)


def _row_tokens(rows: KVRows, row: KVRow, count: int) -> torch.Tensor:
    """`[count, layers, 2, kv_heads, head_dim]` of a row's first tokens, for comparing with pages."""
    return rows.tensor[row.index, :, :, :, :count].permute(3, 0, 1, 2, 4)


def _pool_tokens(pool: PagedKVPool, table: list[int], count: int) -> torch.Tensor:
    pages = pool.tensor[torch.tensor(table)]  # [n, layers, 2, page_tokens, kv_heads, head_dim]
    flat = pages.permute(0, 3, 1, 2, 4, 5).reshape(-1, *pages.shape[1:3], *pages.shape[4:])
    return flat[:count]


def test_rows_mirror_the_pool_and_plan_a_step() -> None:
    pool = _filled(pages=12)
    rows = KVRows(pool, max_rows=3, max_tokens=16)
    tables = [[5, 1, 9], [0, 7, 3, 2]]
    handles = [rows.attach(12), rows.attach(16)]
    assert [h.index for h in handles] == [0, 1] and rows.count == 2
    assert rows.capacity_tokens >= 16
    step = rows.prepare(handles, tables, [6, 13])  # copies tokens 0..5 and 0..12 from the pool
    assert [h.length for h in handles] == [7, 14]
    for h, table, n in zip(handles, tables, [6, 13], strict=True):
        torch.testing.assert_close(_row_tokens(rows, h, n), _pool_tokens(pool, table, n))
    assert step.in_order and step.span == 14 and step.lengths is not None
    assert step.lengths.tolist() == [7, 14] and step.positions.tolist() == [6, 13]
    # the step's new K/V land at each row's position; the views are the rows themselves
    key = torch.randn(2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    value = torch.randn(2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    step.write(2, key, value)
    keys = step.keys(2)
    assert keys.shape == (2, LAYOUT.num_kv_heads, 14, LAYOUT.head_dim)
    assert keys.data_ptr() == rows.tensor[0, 2, 0].data_ptr()  # a view, not a copy
    torch.testing.assert_close(keys[0, :, 6], key[0])
    torch.testing.assert_close(step.values(2)[1, :, 13], value[1])
    # a row already caught up copies nothing more: its values stay what the step wrote
    pool.tensor[5].zero_()
    rows.prepare(handles, tables, [7, 14])
    torch.testing.assert_close(rows.tensor[0, 2, 0, :, 6], key[0])


def test_rows_release_compacts_and_growth_keeps_rows() -> None:
    pool = _filled(pages=12)
    rows = KVRows(pool, max_rows=3, max_tokens=40)
    tables = [[0, 1], [2, 3], [4, 5]]
    handles = [rows.attach(8) for _ in tables]
    assert rows.capacity_tokens == 8
    rows.prepare(handles, tables, [3, 5, 6])
    before = _row_tokens(rows, handles[2], 7).clone()
    rows.release(handles[0])  # the last row moves into row 0
    assert handles[0].index == -1 and handles[2].index == 0 and rows.count == 2
    torch.testing.assert_close(_row_tokens(rows, handles[2], 7), before)
    step = rows.prepare([handles[1], handles[2]], [tables[1], tables[2]], [6, 7])
    assert not step.in_order and step.index.tolist() == [1, 0]
    # out of order, the views are copies in the batch's order
    torch.testing.assert_close(step.keys(0)[1, :, :7], rows.tensor[0, 0, 0, :, :7])
    # a longer sequence grows the capacity; the rows in use keep their tokens
    kept = _row_tokens(rows, handles[1], 6).clone()
    longer = rows.attach(30)
    assert rows.capacity_tokens >= 30 and longer.index == 2
    torch.testing.assert_close(_row_tokens(rows, handles[1], 6), kept)
    assert bool(torch.isfinite(rows.tensor[:3]).all())  # padding is zeros, never garbage


def test_rows_refuse_misuse() -> None:
    pool = _filled(pages=12)
    rows = KVRows(pool, max_rows=2, max_tokens=8)
    a, b = rows.attach(8), rows.attach(8)
    with pytest.raises(ValueError, match="all 2 rows"):
        rows.attach(8)
    with pytest.raises(ValueError, match="capacity"):
        KVRows(pool, max_rows=2, max_tokens=8).attach(9)
    with pytest.raises(ValueError, match="past the row's capacity"):
        rows.prepare([a], [[0, 1]], [8])
    rows.prepare([a], [[0, 1]], [5])
    with pytest.raises(ValueError, match="holds 6 tokens"):
        rows.prepare([a], [[0, 1]], [3])
    with pytest.raises(ValueError, match="cannot hold"):
        rows.prepare([b], [[2]], [6])
    rows.release(b)
    with pytest.raises(ValueError, match="not in use"):
        rows.release(b)
    with pytest.raises(ValueError, match="not in use"):
        rows.prepare([b], [[2, 3]], [1])
    with pytest.raises(ValueError, match="1 rows, 2 block tables"):
        rows.prepare([a], [[0, 1], [2, 3]], [6, 1])


def test_rows_copy_long_sequences_in_pieces_and_stop_at_their_capacity() -> None:
    pool = _filled(pages=30)
    rows = KVRows(pool, max_rows=2, max_tokens=90)
    long_table = list(range(29, 6, -1))  # 23 pages: three pieces of copying
    row = rows.attach(90)
    rows.prepare([row], [long_table], [37])  # the first 37 tokens (whole pages: 40)
    torch.testing.assert_close(_row_tokens(rows, row, 40), _pool_tokens(pool, long_table, 40))
    rows.prepare([row], [long_table], [38])  # caught up already: nothing copied
    pool.tensor[long_table[:9]] = 0.0  # pages the next catch-up must not need
    rows.prepare([row], [long_table], [89])  # copies from page 9 (token 36) on
    got, want = _row_tokens(rows, row, 89), _pool_tokens(pool, long_table, 89)
    torch.testing.assert_close(got[36:], want[36:])
    assert bool((got[:36] != 0).all())  # the first 36 tokens were not copied again
    short = KVRows(pool, max_rows=1, max_tokens=10)  # a capacity that ends inside a page
    tail = short.attach(10)
    assert short.capacity_tokens == 10
    short.prepare([tail], [[3, 4, 5]], [9])
    torch.testing.assert_close(_row_tokens(short, tail, 9), _pool_tokens(pool, [3, 4, 5], 9))
