"""Live load tests: the open-loop scheduler (`openloop.py`), the streaming HTTP user for the OpenAI
API (`http_user.py`), the gRPC store user with its reporting interceptor (`grpc_user.py`) and
`strata loadtest` (`runner.py`), which runs them headless under locust's library API.

Nothing here monkey-patches at import: `runner.main` patches its own process (gevent) before it
imports locust, so tests can import the scheduler and the user code with plain threads.
"""
