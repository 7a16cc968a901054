"""Strata engines: a Llama-family model over a paged KV pool whose page is a store page (DESIGN §8).

The model half: `config` (the HF config.json, parsed), `checkpoint` (loading a local HF folder and
fingerprinting it into a `client.Scope`), `presets` (random-weight checkpoints for tests),
`tokenizer`, `kv_pool` (the paged pool), `kernels` (Triton kernels with torch references), `model`
(the decoder) and `reference` (a dense, cache-free forward: the correctness oracle).

The workers (DESIGN §1): `runtime` (a checkpoint loaded to serve), `sampling` and `output`
(per-request sampling, text and stop conditions), `requests` and `errors` (what workers take, give
and raise), `store_link` and `publisher` (pulling verified pages, publishing new ones in the
background), `prefill` (PrefillWorker), `scheduler` (continuous batching) with `decode`
(DecodeWorker) and `colocated` (ColocatedWorker, the chunked-prefill baseline) on top, `stream`
(TokenStream), `lifecycle` (draining), and the gRPC edge: `wire`, `server`, `worker_config`,
`cli_engine` (`strata prefill|decode|colocated`).

Importing this package imports nothing heavy; each module imports torch as it needs it.
"""

from __future__ import annotations
