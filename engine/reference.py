"""A dense, cache-free forward pass: the correctness oracle for the paged model (DESIGN §8).

It shares the model's weights, projections and RoPE, but attends with a plain float32 softmax over
the whole sequence under an explicit causal mask: no pool, no slots, no kernels, no SDPA. The paged
`DecoderModel.forward` / `decode_step` must agree with it to floating-point tolerance.
"""

from __future__ import annotations

import math

import torch

from engine.model import DecoderModel


@torch.inference_mode()
def dense_logits(model: DecoderModel, input_ids: torch.Tensor) -> torch.Tensor:
    """float32 logits `[T, vocab]` of every position of `input_ids` (positions 0..T-1)."""
    c = model.config
    ids = input_ids.to(model.device).reshape(-1)
    count = ids.shape[0]
    cos, sin = model.rotary.cos_sin(torch.arange(count))
    causal = torch.ones(count, count, dtype=torch.bool, device=model.device).tril()
    group = c.num_attention_heads // c.num_key_value_heads
    x = model.model.embed_tokens(ids)
    for layer in model.model.decoder_layers():
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
        k = k.float().repeat_interleave(group, dim=1)  # [T, heads, head_dim]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(c.head_dim)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v).to(x.dtype)
        x = x + layer.self_attn.o_proj(out.reshape(count, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.logits(x)


def greedy_generate(model: DecoderModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `prompt` by recomputing `dense_logits` each step (slow, exact)."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        logits = dense_logits(model, torch.tensor(tokens, dtype=torch.int64))
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) :]
