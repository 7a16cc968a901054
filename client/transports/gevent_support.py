"""gevent support for `StoreClient` (locust runs its users as greenlets).

In a gevent monkey-patched process, call `init()` after `gevent.monkey.patch_all()` and before
creating any client or other gRPC object. It runs `grpc.experimental.gevent.init_gevent()`, which
makes gRPC's blocking calls yield to the gevent hub instead of blocking every greenlet.
"""

from __future__ import annotations

import importlib
import threading

_lock = threading.Lock()
_initialized = False


def init() -> None:
    """Make gRPC cooperate with gevent. Idempotent; requires gevent to be installed."""
    global _initialized
    with _lock:
        if _initialized:
            return
        # Imported by name: the module needs gevent, and type stubs of grpc leave it out.
        grpc_gevent = importlib.import_module("grpc.experimental.gevent")
        grpc_gevent.init_gevent()
        _initialized = True


def initialized() -> bool:
    """True once `init()` has run in this process."""
    return _initialized
