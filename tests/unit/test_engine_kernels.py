"""Triton kernels against their torch references on CPU, under TRITON_INTERPRET=1 (STYLE: Tests),
and the torch paths the CPU engine runs (pages gathered for one fused attention call; the
contiguous rows of `KVRows`) against both.

Triton decides at `@triton.jit` time whether a kernel is interpreted, so the Triton side runs in
a child process started with TRITON_INTERPRET=1 and STRATA_KERNEL_BACKEND=triton. The child
builds the inputs, runs the Triton kernels, and saves inputs and outputs; this process computes
the torch references on the same inputs and compares. The wrappers' argument checks run here.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from client import KVLayout
from engine.checkpoint import load_checkpoint
from engine.kernels import (
    dense_decode_attention,
    paged_decode_attention,
    paged_decode_attention_gathered,
    paged_decode_attention_reference,
    select_backend,
    write_kv,
    write_kv_reference,
)
from engine.kv_pool import PagedKVPool
from engine.kv_rows import KVRows
from engine.model import DecoderModel
from engine.presets import init_checkpoint
from engine.reference import dense_logits

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]

# (name, dtype, layers, kv_heads, head_dim, page_tokens, pages, tokens written)
WRITE_CASES = {
    "f32_partial_pages": ("float32", 2, 2, 16, 4, 10, 9),
    "f16_odd_row_width": ("float16", 1, 3, 24, 6, 5, 5),
}
# (name, dtype, q_heads, kv_heads, head_dim, page_tokens, pages, seq_lens, table dtype, scale)
ATTENTION_CASES = {
    "gqa_partial_last_page": ("float32", 4, 2, 16, 4, 16, [1, 9, 16], "int32", None),
    "mqa_non_pow2_f16": ("float16", 8, 1, 24, 6, 14, [7, 30], "int32", None),
    "mha_many_lengths": ("float32", 2, 2, 32, 16, 12, [33, 5, 16, 48], "int64", 0.3),
}

CHILD = textwrap.dedent(
    """
    import ast
    import sys
    import torch
    import engine.kernels.cache_write as cache_write
    import engine.kernels.paged_attention as paged_attention
    from client import KVLayout
    from engine.checkpoint import load_checkpoint
    from engine.kernels import paged_decode_attention, select_backend, write_kv
    from engine.kv_pool import PagedKVPool
    from engine.model import DecoderModel

    out_path, ckpt_dir, write_cases, attention_cases = sys.argv[1], sys.argv[2], ast.literal_eval(sys.argv[3]), ast.literal_eval(sys.argv[4])
    gen = torch.Generator().manual_seed(1234)
    result = {
        "backend": select_backend(None, torch.device("cpu")),
        "kernel_types": [type(cache_write._write_kv_kernel).__name__,
                         type(paged_attention._paged_decode_kernel).__name__],
    }
    for name, (dtype, layers, heads, dim, page, pages, n) in write_cases.items():
        dt = getattr(torch, dtype)
        pool = PagedKVPool(KVLayout(layers, heads, dim, page), pages, dt)
        pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))
        before = pool.tensor.clone()
        slots = torch.randperm(pages * page, generator=gen)[:n]
        slots[n // 2] = -1  # a padding row: skipped
        key = torch.randn(n, heads, dim, generator=gen).to(dt)
        value = torch.randn(n, heads, dim, generator=gen).to(dt)
        layer = layers - 1
        write_kv(key, value, pool.key_cache(layer), pool.value_cache(layer), slots)
        result[name] = dict(before=before, key=key, value=value, slots=slots, layer=layer, after=pool.tensor)
    for name, (dtype, qh, kvh, dim, page, pages, lens, tdt, scale) in attention_cases.items():
        dt = getattr(torch, dtype)
        pool = PagedKVPool(KVLayout(1, kvh, dim, page), pages, dt)
        pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))
        width = max(-(-n // page) for n in lens) + 1
        tables = torch.stack([torch.randperm(pages, generator=gen)[:width] for _ in lens]).to(getattr(torch, tdt))
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        query = torch.randn(len(lens), qh, dim, generator=gen).to(dt)
        out = paged_decode_attention(query, pool.key_cache(0), pool.value_cache(0), tables, seq_lens, scale=scale)
        result[name] = dict(pool=pool.tensor, query=query, tables=tables, seq_lens=seq_lens, scale=scale, out=out)

    ckpt = load_checkpoint(ckpt_dir)
    model = DecoderModel.from_state_dict(ckpt.config, ckpt.state_dict)
    pool = PagedKVPool(model.kv_layout(4), 12)
    tables = [[7, 2, 9, 0], [3, 11, 5, 1]]
    prompts = [[5, 9, 44, 100, 7, 3, 12], [77, 31, 8, 250, 19, 64, 2, 90, 13, 41]]
    for prompt, table in zip(prompts, tables):
        model(torch.tensor(prompt), None, pool, table, 0)
    steps, tokens, ctx = [], [11, 22], [len(p) for p in prompts]
    for _ in range(3):
        logits = model.decode_step(torch.tensor(tokens), None, pool, tables, ctx)
        steps.append(logits)
        ctx = [c + 1 for c in ctx]
        tokens = [int(t) for t in logits.argmax(-1)]
    result["model"] = dict(prompts=prompts, tables=tables, steps=steps)
    torch.save(result, out_path)
    """
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_kernels")
    init_checkpoint(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def triton_run(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, object]:
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "STRATA_KERNEL_BACKEND": "triton",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(out),
            str(tiny_dir),
            repr(WRITE_CASES),
            repr(ATTENTION_CASES),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: dict[str, object] = torch.load(out)
    return results


def test_child_ran_the_interpreted_triton_kernels(triton_run: dict[str, object]) -> None:
    assert triton_run["backend"] == "triton"
    assert triton_run["kernel_types"] == ["InterpretedFunction", "InterpretedFunction"]


@pytest.mark.parametrize("case", sorted(WRITE_CASES))
def test_write_kv_matches_reference(
    triton_run: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    r = triton_run[case]
    want = r["before"].clone()
    layer = int(r["layer"])
    write_kv_reference(r["key"], r["value"], want[:, layer, 0], want[:, layer, 1], r["slots"])
    assert torch.equal(r["after"], want)
    # The reference itself: every written row is where its slot says, everything else untouched.
    page_tokens = want.shape[3]
    changed = (want != r["before"]).flatten(2).any(-1)
    assert changed.sum() > 0
    for n, slot in enumerate(r["slots"].tolist()):
        if slot >= 0:
            assert torch.equal(want[slot // page_tokens, layer, 0, slot % page_tokens], r["key"][n])
            assert torch.equal(
                want[slot // page_tokens, layer, 1, slot % page_tokens], r["value"][n]
            )
    other_layers = [i for i in range(want.shape[1]) if i != layer]
    assert torch.equal(want[:, other_layers], r["before"][:, other_layers])


def _naive_decode(r: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sequence by sequence, head by head: gather the tokens, softmax, weighted sum (float64)."""
    pool, query, tables, lens = r["pool"].double(), r["query"].double(), r["tables"], r["seq_lens"]
    page_tokens, kv_heads, dim = pool.shape[3], pool.shape[4], pool.shape[5]
    scale = r["scale"] if r["scale"] is not None else 1 / math.sqrt(dim)
    group = query.shape[1] // kv_heads
    out = torch.zeros_like(query)
    for b in range(query.shape[0]):
        idx = range(int(lens[b]))
        keys = torch.stack(
            [pool[int(tables[b, i // page_tokens]), 0, 0, i % page_tokens] for i in idx]
        )
        values = torch.stack(
            [pool[int(tables[b, i // page_tokens]), 0, 1, i % page_tokens] for i in idx]
        )
        for h in range(query.shape[1]):
            weights = torch.softmax(keys[:, h // group] @ query[b, h] * scale, dim=0)
            out[b, h] = weights @ values[:, h // group]
    return out


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_decode_attention_matches_reference(
    triton_run: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    r = triton_run[case]
    pool = r["pool"]
    want = paged_decode_attention_reference(
        r["query"], pool[:, 0, 0], pool[:, 0, 1], r["tables"], r["seq_lens"], scale=r["scale"]
    )
    tol = 1e-5 if r["query"].dtype == torch.float32 else 2e-3
    assert r["out"].dtype == r["query"].dtype and r["out"].shape == r["query"].shape
    torch.testing.assert_close(r["out"], want, atol=tol, rtol=0)
    torch.testing.assert_close(want.double(), _naive_decode(r), atol=tol, rtol=0)


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_torch_attention_paths_match_triton_and_reference(
    triton_run: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    r = triton_run[case]
    pool, query, tables, lens = r["pool"], r["query"], r["tables"], r["seq_lens"]
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    want = paged_decode_attention_reference(query, kc, vc, tables, lens, scale=r["scale"])
    tol = 1e-5 if query.dtype == torch.float32 else 2e-3
    gathered = paged_decode_attention(
        query, kc, vc, tables, lens, scale=r["scale"], backend="torch"
    )
    assert gathered.dtype == query.dtype and gathered.shape == query.shape
    # each sequence's pages as one block [kv_heads, span, head_dim], padded to the longest
    page = kc.shape[1]
    span = int(lens.max())
    width = -(-span // page)
    blocks = [
        torch.cat([torch.stack([c[p] for p in row[:width].tolist()]) for row in tables])
        .reshape(len(lens), width * page, *c.shape[2:])[:, :span]
        .transpose(1, 2)
        for c in (kc, vc)
    ]
    dense = dense_decode_attention(query, blocks[0], blocks[1], lens, scale=r["scale"])
    for got in (gathered, dense):
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        torch.testing.assert_close(got, r["out"], atol=2 * tol, rtol=0)


def test_model_decode_under_triton_matches_torch(
    triton_run: dict[str, dict[str, list[torch.Tensor]]], tiny_dir: Path
) -> None:
    r = triton_run["model"]
    ckpt = load_checkpoint(tiny_dir)
    model = DecoderModel.from_state_dict(ckpt.config, ckpt.state_dict)
    pool = PagedKVPool(model.kv_layout(4), 12)
    for prompt, table in zip(r["prompts"], r["tables"], strict=True):
        model(torch.tensor(prompt), None, pool, table, 0)
    mirrored = PagedKVPool(model.kv_layout(4), 12)
    mirrored.tensor.copy_(pool.tensor)
    rows = KVRows(mirrored, max_rows=2, max_tokens=16)
    handles = [rows.attach(16), rows.attach(16)]
    tokens, ctx = [11, 22], [len(p) for p in r["prompts"]]
    seqs = [[*p, t] for p, t in zip(r["prompts"], tokens, strict=True)]
    for got in r["steps"]:
        want = model.decode_step(torch.tensor(tokens), None, pool, r["tables"], ctx)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        step = rows.prepare(handles, r["tables"], ctx)  # the CPU engine's path: K/V in rows
        in_rows = model.decode_step(
            torch.tensor(tokens), None, mirrored, r["tables"], ctx, rows=step
        )
        torch.testing.assert_close(got, in_rows, atol=1e-4, rtol=0)
        for b, seq in enumerate(seqs):
            torch.testing.assert_close(
                got[b], dense_logits(model, torch.tensor(seq))[-1], atol=2e-4, rtol=0
            )
        ctx = [c + 1 for c in ctx]
        tokens = [int(t) for t in want.argmax(-1)]
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.append(tok)


def _caches(
    pages: int = 4, page_tokens: int = 4, heads: int = 2, dim: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    pool = PagedKVPool(KVLayout(2, heads, dim, page_tokens), pages)
    return pool.key_cache(1), pool.value_cache(1)


def test_write_kv_rejects_bad_arguments() -> None:
    kc, vc = _caches()
    k = torch.zeros(3, 2, 8)
    slots = torch.tensor([0, 1, 2])
    write_kv(k, k, kc, vc, slots)  # the baseline call is fine
    bad = [
        ((torch.zeros(3, 16), k, kc, vc, slots), "key and value"),
        ((k, torch.zeros(3, 2, 4), kc, vc, slots), "key and value"),
        ((torch.zeros(3, 3, 8), torch.zeros(3, 3, 8), kc, vc, slots), "rows"),
        ((k, k, kc, vc, torch.tensor([0, 1])), "slot_mapping"),
        ((k, k, kc, vc, torch.tensor([0.0, 1.0, 2.0])), "int32 or int64"),
        ((k, k, kc, vc, torch.tensor([0, 1, 16])), "past the cache"),
        ((k.half(), k.half(), kc, vc, slots), "dtype"),
        ((k, k, kc, kc[:, :2], slots), "key_cache and value_cache"),
        ((torch.zeros(3, 8, 2).transpose(1, 2), k, kc, vc, slots), "stride"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            write_kv(*args)


def test_paged_decode_attention_rejects_bad_arguments() -> None:
    kc, vc = _caches()
    q = torch.zeros(2, 4, 8)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    assert paged_decode_attention(q, kc, vc, tables, lens).shape == (2, 4, 8)
    bad = [
        ((torch.zeros(2, 32), kc, vc, tables, lens), "query"),
        ((torch.zeros(2, 3, 8), kc, vc, tables, lens), "multiple"),
        ((torch.zeros(2, 4, 16), kc, vc, tables, lens), "head_dim"),
        ((q, kc, vc, tables[:1], lens), "block_tables"),
        ((q, kc, vc, tables, lens[:1]), "seq_lens"),
        ((q, kc, vc, tables.float(), lens), "int32 or int64"),
        ((q, kc, vc, tables, torch.tensor([5, 9], dtype=torch.int32)), "more than"),
        ((q, kc, vc, tables, torch.tensor([0, 8], dtype=torch.int32)), ">= 1"),
        ((q, kc, vc, torch.tensor([[0, 1], [2, 4]], dtype=torch.int32), lens), "page id"),
        ((q.half(), kc, vc, tables, lens), "dtype"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            paged_decode_attention(*args)


def test_dense_decode_attention_rejects_bad_arguments() -> None:
    q = torch.zeros(2, 4, 8)
    k = torch.zeros(2, 2, 6, 8)
    lens = torch.tensor([5, 6])
    assert dense_decode_attention(q, k, k, lens).shape == (2, 4, 8)
    assert dense_decode_attention(q[:0], k[:0], k[:0]).shape == (0, 4, 8)
    bad = [
        ((torch.zeros(2, 32), k, k, lens), "query"),
        ((q, k[0], k[0], lens), "keys and values"),
        ((q, k, k[:, :, :5], lens), "keys and values"),
        ((torch.zeros(3, 4, 8), k, k, lens), "do not fit"),
        ((torch.zeros(2, 3, 8), k, k, lens), "multiple"),
        ((q, k[:, :, :0], k[:, :, :0], None), "no position"),
        ((q.half(), k, k, lens), "dtype"),
        ((q, k, k, lens[:1]), "seq_lens"),
        ((q, k, k, lens.float()), "int32 or int64"),
        ((q, k, k, torch.tensor([0, 6])), r"\[1, 6\]"),
        ((q, k, k, torch.tensor([5, 7])), r"\[1, 6\]"),
        ((q, torch.zeros(2, 2, 8, 6).transpose(2, 3), k, lens), "stride"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            dense_decode_attention(*args)


def test_gathered_path_reads_only_the_pages_it_needs() -> None:
    kc, vc = _caches(pages=6)
    gen = torch.Generator().manual_seed(3)
    kc.copy_(torch.randn(kc.shape, generator=gen))
    vc.copy_(torch.randn(vc.shape, generator=gen))
    q = torch.randn(2, 4, 8, generator=gen)
    lens = torch.tensor([3, 7], dtype=torch.int32)
    # tables far wider than the lengths, with junk past each sequence's pages
    tables = torch.tensor([[4, -7, 99, 0], [1, 5, 12345, -1]], dtype=torch.int32)
    want = paged_decode_attention_reference(q, kc, vc, tables, lens)
    torch.testing.assert_close(paged_decode_attention_gathered(q, kc, vc, tables, lens), want)
    full = torch.tensor([8, 8], dtype=torch.int32)  # both sequences fill their pages: no mask
    torch.testing.assert_close(
        paged_decode_attention_gathered(q, kc, vc, tables[:, :2].abs() % 6, full),
        paged_decode_attention_reference(q, kc, vc, tables[:, :2].abs() % 6, full),
    )


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("STRATA_KERNEL_BACKEND", raising=False)
    assert select_backend(None, cpu) == "torch"
    assert select_backend("torch", cuda) == "torch"
    monkeypatch.setenv("STRATA_KERNEL_BACKEND", "triton")
    assert select_backend(None, cpu) == "triton"
    with pytest.raises(ValueError, match="backend"):
        select_backend("cuda", cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernels_match_reference_on_cuda() -> None:
    gen = torch.Generator().manual_seed(7)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        pool = PagedKVPool(KVLayout(2, 2, 64, 16), 32, dtype, "cuda")
        pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))
        want = pool.tensor.clone()
        slots = torch.randperm(32 * 16, generator=gen)[:40]
        key = torch.randn(40, 2, 64, generator=gen).to(dtype)
        value = torch.randn(40, 2, 64, generator=gen).to(dtype)
        write_kv(key.cuda(), value.cuda(), pool.key_cache(1), pool.value_cache(1), slots.cuda())
        write_kv_reference(key.cuda(), value.cuda(), want[:, 1, 0], want[:, 1, 1], slots.cuda())
        assert torch.equal(pool.tensor, want)

        lens = torch.tensor([1, 16, 17, 300, 77], dtype=torch.int32)
        tables = torch.stack([torch.randperm(32, generator=gen)[:20] for _ in lens]).to(torch.int32)
        query = torch.randn(5, 8, 64, generator=gen).to(dtype).cuda()
        args = (query, pool.key_cache(0), pool.value_cache(0), tables.cuda(), lens.cuda())
        got = paged_decode_attention(*args)
        torch.testing.assert_close(
            got.float(), paged_decode_attention_reference(*args).float(), atol=tol, rtol=0
        )
