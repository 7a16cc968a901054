"""The reference steps `strata bench engine` times next to the decode worker, at one batch and
context: what the worker's tokens/s should be measured against.

- `ModelSteps.model_step`: the model's `decode_step` alone, called as the worker calls it (on
  CPU over `KVRows`, the sequences' contiguous K/V; on CUDA the Triton kernels over the pages):
  the worker's loop, sampling, streaming and publishing are what it leaves out.
- `ModelSteps.gathered_step`: the same step with attention over the pages, gathered into
  contiguous blocks at every step (`paged_decode_attention`'s torch path on CPU).
- `DenseStep`: the memory-bound limit. The same layers and weights, the same GQA shapes; each
  layer's K/V one contiguous `[B, kv_heads, tokens, head_dim]` tensor per batch, the new token
  written in place, one fused attention call with the query heads of a KV head as its query
  rows. A step reads the weights and every sequence's K/V once.

Each call is one decode step, one position further than the last (the sequences grow as they
do in decode). Caches hold random values of unit scale (finite, not denormal), seeded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import select_backend
from engine.kv_rows import KVRows
from engine.runtime import ModelRuntime


def time_call(runtime: ModelRuntime, fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes (device work included)."""
    began = time.perf_counter()
    fn()
    runtime.synchronize()
    return time.perf_counter() - began


class ModelSteps:
    """`batch` sequences of `context` tokens in a pool of their own, with room for `calls` more
    positions. `model_step` and `gathered_step` at the same position write the same K/V, so
    they alternate at one position, then `advance` moves to the next."""

    def __init__(
        self, runtime: ModelRuntime, batch: int, context: int, calls: int, seed: int
    ) -> None:
        self.runtime = runtime
        page = runtime.page_tokens
        pages = -(-(context + calls + 1) // page)
        self.pool = runtime.new_pool(batch * pages)
        gen = torch.Generator(device=self.pool.device).manual_seed(seed)
        self.pool.tensor.normal_(generator=gen)
        self.tables = [self.pool.allocate(pages) for _ in range(batch)]
        self.rows = None
        self.handles = []
        if select_backend(None, runtime.device) == "torch":
            self.rows = KVRows(self.pool, max_rows=batch, max_tokens=pages * page)
            self.handles = [self.rows.attach(pages * page) for _ in range(batch)]
        self.tokens = torch.randint(0, runtime.vocab_size, (batch,), generator=torch.Generator())
        self.context = context
        self._limit = context + calls

    def advance(self) -> None:
        """Step to the next position (raises RuntimeError past the room made for `calls`)."""
        if self.context + 1 > self._limit:
            raise RuntimeError("the reference steps ran past the positions they were sized for")
        self.context += 1

    def model_step(self) -> None:
        """One `decode_step` as the worker runs it (rows caught up with the pool first)."""
        ctx = [self.context] * len(self.tables)
        step_rows = None
        if self.rows is not None:
            step_rows = self.rows.prepare(self.handles, self.tables, ctx)
        self.runtime.model.decode_step(
            self.tokens, None, self.pool, self.tables, ctx, rows=step_rows
        )

    def gathered_step(self) -> None:
        """One `decode_step` over the pages, gathered at every step (no rows)."""
        ctx = [self.context] * len(self.tables)
        self.runtime.model.decode_step(self.tokens, None, self.pool, self.tables, ctx)


class DenseStep:
    """One decode step over contiguous K/V: `batch` sequences of `context` tokens growing by one
    a call, for up to `calls` calls."""

    def __init__(
        self, runtime: ModelRuntime, batch: int, context: int, calls: int, seed: int
    ) -> None:
        model = runtime.model
        c = model.config
        self.runtime = runtime
        gen = torch.Generator(device=model.device).manual_seed(seed)
        shape = (batch, c.num_key_value_heads, context + calls + 1, c.head_dim)
        self.keys = [self._random(shape, gen) for _ in range(c.num_hidden_layers)]
        self.values = [self._random(shape, gen) for _ in range(c.num_hidden_layers)]
        self.tokens = torch.randint(0, c.vocab_size, (batch,), generator=torch.Generator())
        self.context = context
        self._limit = context + calls

    def _random(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        model = self.runtime.model
        return torch.randn(shape, generator=gen, device=model.device, dtype=model.dtype)

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        if self.context + 1 > self._limit:
            raise RuntimeError("the dense step ran past the positions it was sized for")
        model = self.runtime.model
        c = model.config
        pos = self.context
        batch = self.tokens.shape[0]
        group = c.num_attention_heads // c.num_key_value_heads
        cos, sin = model.rotary.cos_sin(torch.full((batch,), pos, dtype=torch.int64))
        x = model.model.embed_tokens(self.tokens.to(model.device))
        for i, layer in enumerate(model.model.decoder_layers()):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            self.keys[i][:, :, pos] = k
            self.values[i][:, :, pos] = v
            out = F.scaled_dot_product_attention(
                q.reshape(batch, c.num_key_value_heads, group, c.head_dim),
                self.keys[i][:, :, : pos + 1],
                self.values[i][:, :, : pos + 1],
            )
            x = x + attn.o_proj(out.reshape(batch, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.context += 1
        return model.logits(x)
