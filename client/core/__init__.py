"""The client core: everything `StoreClient` and `AsyncStoreClient` share, with no I/O.

It checks and builds requests, picks the data path of a call (`route`), splits batches, decides
retries and deadlines (`retry`), and turns replies, stream messages and errors into results
(`replies`, `assembler`), lease releases and corrupt counts. Each operation (`lookup`, `get`,
`put`, `admin`) is a plan: a generator that yields the I/O steps it needs (`steps`) and returns
the call's result. The blocking shell (client/store_client.py) takes those steps with blocking
calls, the asyncio shell (client/async_client.py) with awaits, so every path and every fix
exists once and both clients have every path. An import-linter contract keeps this package free
of grpc, sockets, the event loop, UCX and shared memory.
"""
