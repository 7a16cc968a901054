"""The one UCX runtime of a process: ucxx and the asyncio loop every UCX call runs on.

ucxx keeps one application context (one UCX worker) per process, and its progress is tied to
the event loops that use it: each new loop starts the worker's progress thread again, and a
closed loop's progress task is finalized later, from whichever thread collects it. A process
that opened a loop per listener or per client (a test process runs many daemons) restarted the
worker's progress thread under live transfers, which could crash the process. So the daemon's
listener and every client transport of a process share this one loop, started on first use in a
daemon thread and never closed; the ucxx context is created on it.

`ucxx` is imported here only, lazily: importing this module costs nothing.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from types import ModuleType

from client.errors import Unavailable
from client.ucx_protocol import prepare_environment

_START_TIMEOUT_S = 30.0

_lock = threading.Lock()
_runtime: tuple[ModuleType, asyncio.AbstractEventLoop] | None = None


def ucx_runtime() -> tuple[ModuleType, asyncio.AbstractEventLoop]:
    """(ucxx, the process's UCX loop), started on first use. Raises Unavailable when ucxx cannot
    be imported or its context cannot be created."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        prepare_environment()
        try:
            ucxx = importlib.import_module("ucxx")
        except Exception as exc:  # ImportError, or a shared library it needs is missing
            raise Unavailable(f"ucxx is not usable here: {exc}") from None
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="strata-ucx", daemon=True).start()

        async def create_context() -> None:
            # the context binds its progress to the loop it is created on: this one
            ctx = ucxx.core._get_ctx()
            ctx.continuous_ucx_progress(loop)

        try:
            asyncio.run_coroutine_threadsafe(create_context(), loop).result(_START_TIMEOUT_S)
        except Exception as exc:
            loop.call_soon_threadsafe(loop.stop)
            raise Unavailable(f"the UCX context did not start: {exc!r}") from None
        _runtime = (ucxx, loop)
        return _runtime
