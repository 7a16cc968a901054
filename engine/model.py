"""A Llama-family decoder over the paged KV pool (DESIGN §8).

Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 share one shape: RMSNorm, RoPE, grouped-query attention
(optionally with q/k/v bias, or per-head RMSNorm on q and k), a SwiGLU MLP, and an lm_head that
may be tied to the embeddings. Module names follow the Hugging Face tensor names
(`model.layers.N.self_attn.q_proj.weight`, ...), so a checkpoint's state dict loads as is.

Two entry points, both reading and writing KV only through a `PagedKVPool`:
- `forward`: one sequence's new tokens (a prefill chunk), attending over its cached pages plus
  themselves, causally; writes their K/V into the pool.
- `decode_step`: one new token for each of B sequences, with paged decode attention, or, given
  `KVRows` (the CPU engine), attention over each sequence's contiguous row of K/V.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from client import KVLayout
from engine.config import ModelConfig
from engine.kernels import dense_decode_attention, paged_decode_attention, write_kv
from engine.kv_pool import PagedKVPool
from engine.kv_rows import RowStep
from engine.rope import Rotary

# Tensors some checkpoints carry that the model recomputes; dropped on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class RMSNorm(nn.Module):
    """`x / rms(x) * weight`, the normalisation computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """The projections of one attention layer; the attention itself runs over the pool."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(
            c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias
        )
        self.k_proj = nn.Linear(
            c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias
        )
        self.v_proj = nn.Linear(
            c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias
        )
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[T, heads, head_dim]`, k and v `[T, kv_heads, head_dim]`, with RoPE applied to q and k."""
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin), v


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    """The `model.*` tensors: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers, in order (typed; `layers` is an nn.ModuleList)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]


class DecoderModel(nn.Module):
    """The whole causal LM. Build with `from_state_dict`; inference only (no autograd)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = Rotary(config, device)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> DecoderModel:
        """Build the model around `state_dict`'s tensors (HF names), cast to `dtype` on `device`.

        Raises ValueError naming the missing / unexpected / misshapen tensors.
        """
        with torch.device("meta"):
            model = cls(config)
        model.rotary = Rotary(config, device)
        wanted = model.state_dict()
        tensors = {
            name: t.to(device=device, dtype=dtype)
            for name, t in state_dict.items()
            if not name.endswith(_IGNORED_SUFFIXES)
            and not (config.tie_word_embeddings and name == "lm_head.weight")
        }
        missing = sorted(set(wanted) - set(tensors))
        unexpected = sorted(set(tensors) - set(wanted))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit the config: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        shapes = [n for n, t in tensors.items() if t.shape != wanted[n].shape]
        if shapes:
            n = shapes[0]
            raise ValueError(
                f"tensor {n} is {tuple(tensors[n].shape)}, config wants {tuple(wanted[n].shape)}"
            )
        model.load_state_dict(tensors, strict=True, assign=True)
        model.eval().requires_grad_(False)
        return model

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def kv_layout(self, page_tokens: int) -> KVLayout:
        """The layout of this model's KV pages with `page_tokens` tokens a page."""
        c = self.config
        return KVLayout(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, page_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states `[T, hidden]` (the final norm applied here)."""
        h = self.model.norm(hidden)
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(h, weight).float()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        kv: PagedKVPool,
        block_table: Sequence[int],
        context_len_before: int,
        *,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run one sequence's next `T = len(input_ids)` tokens (a prefill chunk, or one decode token).

        The sequence already has `context_len_before` tokens' KV in `kv` along `block_table`, which
        must have pages for `context_len_before + T` tokens. Writes the new tokens' K/V into their
        slots (mutating the pool) and returns float32 logits: `[vocab]` of the last token, or
        `[T, vocab]` with `all_logits`. `positions` (RoPE positions) default to
        `context_len_before + arange(T)`. Raises ValueError on a pool that does not fit the model.
        """
        self._check_pool(kv)
        ids = input_ids.to(self.device).reshape(-1)
        count = ids.shape[0]
        if count == 0:
            raise ValueError("forward needs at least one token")
        start = context_len_before
        if positions is None:
            positions = torch.arange(start, start + count)
        cos, sin = self.rotary.cos_sin(positions.reshape(-1))
        slots = kv.slot_mapping(block_table, start, count)
        total = start + count
        mask = None
        if start:
            key_idx = torch.arange(total, device=self.device)
            query_idx = torch.arange(start, total, device=self.device)
            mask = key_idx[None, :] <= query_idx[:, None]

        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.decoder_layers()):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            write_kv(k, v, kv.key_cache(i), kv.value_cache(i), slots)
            if start:
                k, v = kv.gather(block_table, total, i)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            x = x + attn.o_proj(out[0].transpose(0, 1).reshape(count, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.logits(x) if all_logits else self.logits(x[-1:])[0]

    @torch.inference_mode()
    def decode_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        kv: PagedKVPool,
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        *,
        rows: RowStep | None = None,
    ) -> torch.Tensor:
        """One new token for each of B sequences; returns float32 logits `[B, vocab]`.

        Sequence b has `context_lens[b]` tokens cached along `block_tables[b]`, which must have a
        page for token index `context_lens[b]` (where this step writes its K/V). `positions`
        default to `context_lens`. With `rows` (`KVRows.prepare` for the same sequences, in the
        same order) attention reads each sequence's contiguous row and the new K/V go to the
        rows too; without, it runs `paged_decode_attention` over the pages. Mutates the pool
        (and the rows); raises ValueError on mismatched lengths.
        """
        self._check_pool(kv)
        ids = tokens.to(self.device).reshape(-1)
        batch = ids.shape[0]
        if not batch == len(block_tables) == len(context_lens):
            raise ValueError(
                f"{batch} tokens, {len(block_tables)} block tables, {len(context_lens)} context lengths"
            )
        if rows is not None and (rows.count != batch or rows.rows.pool is not kv):
            raise ValueError(f"rows plan {rows.count} sequences of another pool or batch")
        if positions is None:
            positions = torch.tensor(list(context_lens), dtype=torch.int64)
        cos, sin = self.rotary.cos_sin(positions.reshape(-1))
        page_tokens = kv.page_tokens
        slot_list = []
        for b, (table, ctx) in enumerate(zip(block_tables, context_lens, strict=True)):
            if ctx < 0 or ctx // page_tokens >= len(table):
                raise ValueError(
                    f"sequence {b}: block table of {len(table)} pages has no slot for token {ctx}"
                )
            slot_list.append(table[ctx // page_tokens] * page_tokens + ctx % page_tokens)
        slots = torch.tensor(slot_list, dtype=torch.int64).to(self.device)
        tables = seq_lens = None
        if rows is None:
            width = max((len(t) for t in block_tables), default=1)
            table_rows = torch.zeros((batch, max(width, 1)), dtype=torch.int32)
            for b, table in enumerate(block_tables):
                table_rows[b, : len(table)] = torch.tensor(list(table), dtype=torch.int32)
            tables = table_rows.to(self.device)
            seq_lens = torch.tensor([c + 1 for c in context_lens], dtype=torch.int32).to(
                self.device
            )

        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.decoder_layers()):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            write_kv(k, v, kv.key_cache(i), kv.value_cache(i), slots)
            if rows is not None:
                rows.write(i, k, v)
                out = dense_decode_attention(q, rows.keys(i), rows.values(i), rows.lengths)
            else:
                assert tables is not None and seq_lens is not None
                out = paged_decode_attention(
                    q, kv.key_cache(i), kv.value_cache(i), tables, seq_lens
                )
            x = x + attn.o_proj(out.reshape(batch, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.logits(x)

    def _check_pool(self, kv: PagedKVPool) -> None:
        c = self.config
        want = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        got = (kv.layout.num_layers, kv.layout.num_kv_heads, kv.layout.head_dim)
        if got != want:
            raise ValueError(f"pool layout (layers, kv_heads, head_dim) {got} != model's {want}")
        if kv.dtype != self.dtype or kv.tensor.device != self.device:
            raise ValueError(
                f"pool is {kv.dtype} on {kv.tensor.device}, model is {self.dtype} on {self.device}"
            )
