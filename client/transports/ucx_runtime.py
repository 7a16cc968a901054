"""The one bulk-data runtime of a process: the asyncio loop every UCX and TCP data-path call
runs on, and ucxx bound to it.

ucxx keeps one application context (one UCX worker) per process, and its progress is tied to
the event loops that use it: each new loop starts the worker's progress thread again, and a
closed loop's progress task is finalized later, from whichever thread collects it. A process
that opened a loop per listener or per client (a test process runs many daemons) restarted the
worker's progress thread under live transfers, which could crash the process. So the daemon's
listeners and every client transport of a process share this one loop, started on first use in
a daemon thread and never closed; the ucxx context is created on it. The TCP path (which needs
no ucxx) runs on the same loop.

`ucxx` is imported here only, lazily: importing this module costs nothing.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from types import ModuleType

from client.contract.errors import Unavailable
from client.transports.ucx_protocol import prepare_environment

_START_TIMEOUT_S = 30.0

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_ucxx: ModuleType | None = None


def bulk_loop() -> asyncio.AbstractEventLoop:
    """The process's bulk-data loop (UCX and TCP paths), started on first use, never closed."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="strata-bulk", daemon=True).start()
            _loop = loop
        return _loop


def ucx_runtime() -> tuple[ModuleType, asyncio.AbstractEventLoop]:
    """(ucxx, the process's bulk loop with the UCX context bound to it), started on first use.
    Raises Unavailable when ucxx cannot be imported or its context cannot be created."""
    global _ucxx
    loop = bulk_loop()
    with _lock:
        if _ucxx is not None:
            return _ucxx, loop
        prepare_environment()
        try:
            ucxx = importlib.import_module("ucxx")
        except Exception as exc:  # ImportError, or a shared library it needs is missing
            raise Unavailable(f"ucxx is not usable here: {exc}") from None

        async def create_context() -> None:
            # the context binds its progress to the loop it is created on: this one
            ctx = ucxx.core._get_ctx()
            ctx.continuous_ucx_progress(loop)

        try:
            asyncio.run_coroutine_threadsafe(create_context(), loop).result(_START_TIMEOUT_S)
        except Exception as exc:
            raise Unavailable(f"the UCX context did not start: {exc!r}") from None
        _ucxx = ucxx
        return ucxx, loop
