"""The router (DESIGN §9): the front door that places requests and admits them against their SLO.

`engine.router.core` is the pure half: value types, the time model, the placement policies,
admission, the dispatch ledger and the prediction tracker. It takes time as an argument, draws
randomness only from an `rng` passed in, and imports neither torch, grpc, nor the HTTP framework,
so the simulator runs the very same objects on a virtual clock (an import-linter contract and
tests/unit/test_router_purity.py enforce that). Everything else in this package is the I/O shell
around it (HTTP edge, worker registry, metrics).

Importing this package imports nothing heavy.
"""

from __future__ import annotations
