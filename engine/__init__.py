"""Strata engines: a Llama-family model over a paged KV pool whose page is a store page (DESIGN §8).

The model half lives here: `config` (the HF config.json, parsed), `checkpoint` (loading a local HF
folder and fingerprinting it into a `client.Scope`), `presets` (random-weight checkpoints for
tests), `tokenizer`, `kv_pool` (the paged pool), `kernels` (Triton kernels with torch references),
`model` (the decoder) and `reference` (a dense, cache-free forward: the correctness oracle).

Importing this package imports nothing heavy; each module imports torch as it needs it.
"""

from __future__ import annotations
