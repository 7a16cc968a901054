"""The cluster simulator: the router's real core (engine.router.core) deciding on a virtual clock.

`cluster.py` reads a cluster TOML, `loop.py` is the event loop, `engine.py` the engine model,
`store.py` the stores, `pages.py` page keys, `simulator.py` ties them to `RouterCore`, `cli.py`
is `strata simulate`. No torch, no network: the simulator imports only the workload, the report
and the router's pure core.
"""
