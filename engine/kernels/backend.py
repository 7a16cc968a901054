"""Which implementation a kernel call runs: the Triton kernel or its torch path."""

from __future__ import annotations

import os

import torch

BACKEND_ENV = "STRATA_KERNEL_BACKEND"
BACKENDS = ("auto", "triton", "torch")

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with the engine extra on Linux
    HAVE_TRITON = False


def select_backend(backend: str | None, device: torch.device) -> str:
    """Resolve `backend` ("auto", "triton", "torch"; None reads STRATA_KERNEL_BACKEND, default auto).

    "auto" runs Triton on CUDA tensors and the torch path elsewhere. Raises ValueError for an
    unknown name, or for "triton" when triton is not installed.
    """
    name = backend if backend is not None else os.environ.get(BACKEND_ENV, "auto")
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r} is not one of {BACKENDS}")
    if name == "auto":
        return "triton" if device.type == "cuda" and HAVE_TRITON else "torch"
    if name == "triton" and not HAVE_TRITON:
        raise ValueError("kernel backend 'triton' was asked for, but triton is not installed")
    return name
