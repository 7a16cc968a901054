"""The errors engine workers raise on purpose; the gRPC edge maps each to one status code.

A store that misses, is down or serves a bad page is never one of them: the worker computes
instead (DESIGN §1).
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that can never be served as given: an empty or too long prompt, a token id
    outside the vocabulary, a bad sampling value (gRPC INVALID_ARGUMENT)."""


class EngineStopping(RuntimeError):
    """The worker is shutting down and takes no new requests (gRPC UNAVAILABLE)."""


class EngineBusy(RuntimeError):
    """The worker's queue of waiting requests is full; retry later (gRPC RESOURCE_EXHAUSTED)."""
