"""The GPU tier: one torch uint8 slab on a device, carved into slots by a buddy allocator.

On CUDA the slab lives in device memory and host bytes move through two pinned staging buffers,
double-buffered so the host memcpy of one chunk overlaps the DMA of the other; every `write` and
`read_into` has completed (the stream is synchronized) when it returns. On `cpu` (tests, hosts
without a GPU) the slab is ordinary memory and copies are plain memcpy through a memoryview.

This is the only module of the daemon that imports torch, and only when a GpuTier is built: the
store runs without torch when the GPU tier is disabled.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.tiers.slots import SlotSpace

if TYPE_CHECKING:
    import torch

__all__ = ["STAGING_CHUNK_BYTES", "GpuTier"]

log = logging.getLogger(__name__)

STAGING_CHUNK_BYTES = 4 << 20

Buffer = bytes | bytearray | memoryview


def _host_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU uint8 tensor's memory (the tensor must outlive it)."""
    nbytes = int(tensor.numel())
    array = (ctypes.c_ubyte * nbytes).from_address(int(tensor.data_ptr()))
    return memoryview(array).cast("B")


def _byte_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise InvalidArgument("buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class GpuTier(SlotSpace):
    """A `capacity_bytes` slab on `device` ("cuda", "cuda:N" or "cpu") with buddy-allocated slots.

    Raises Unavailable if torch is not installed, CUDA is requested but not available, or the
    slab cannot be allocated; InvalidArgument for a malformed device string or capacity.
    `allocate`/`free` are thread-safe; copies on CUDA serialize on the staging buffers.
    """

    def __init__(self, capacity_bytes: int, device: str, min_block_bytes: int = 4096) -> None:
        try:
            import torch
        except ImportError as exc:
            raise Unavailable("the GPU tier needs torch, which is not installed") from exc
        self._torch = torch
        super().__init__(capacity_bytes, min_block_bytes)
        self._copy_lock = threading.Lock()
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgument(f"bad device {device!r}: {exc}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise Unavailable(f"GPU tier on {device!r}: CUDA is not available on this host")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            if index >= torch.cuda.device_count():
                raise Unavailable(f"GPU tier on {device!r}: no such CUDA device")
            dev = torch.device("cuda", index)
        elif dev.type != "cpu":
            raise InvalidArgument(f"GPU tier supports cuda and cpu devices, not {device!r}")
        self._device = dev
        size = self._alloc.capacity_bytes
        try:
            self._slab: torch.Tensor | None = torch.empty(size, dtype=torch.uint8, device=dev)
        except (RuntimeError, MemoryError) as exc:
            raise Unavailable(f"cannot allocate a {size}-byte slab on {dev}: {exc}") from exc
        self._host: memoryview | None = None
        self._staging: list[torch.Tensor] = []
        self._staging_views: list[memoryview] = []
        if dev.type == "cpu":
            self._host = _host_view(self._slab)
        else:
            self._stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
            self._events = [torch.cuda.Event(), torch.cuda.Event()]  # type: ignore[no-untyped-call]
            for _ in range(2):
                buf = torch.empty(STAGING_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                self._staging.append(buf)
                self._staging_views.append(_host_view(buf))
        log.info("gpu tier: %d-byte slab on %s", size, dev)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def device(self) -> str:
        """The slab's device, normalized ("cpu", "cuda:0", ...)."""
        return str(self._device)

    @property
    def slab(self) -> torch.Tensor:
        """The whole slab tensor (for CUDA IPC export); raises Unavailable after `close()`."""
        return self._open_slab()

    # ---- slots ---------------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        self._open_slab()

    # ---- copies --------------------------------------------------------------------------------

    def write(self, offset: int, src: Buffer) -> None:
        """Copy host bytes `src` into the slot at `offset`; mutates the slab, complete on return.

        Raises InvalidArgument unless `offset` is an allocated slot that `src` fits in;
        Unavailable after close.
        """
        data = _byte_view(src)
        slab = self._open_slab()
        self._check_range(offset, data.nbytes)
        if self._host is not None:
            self._host[offset : offset + data.nbytes] = data
            return
        torch = self._torch
        with self._copy_lock, torch.cuda.stream(self._stream):
            done = 0
            index = 0
            while done < data.nbytes:
                n = min(STAGING_CHUNK_BYTES, data.nbytes - done)
                event = self._events[index]
                event.synchronize()  # the DMA that last used this staging buffer has finished
                self._staging_views[index][:n] = data[done : done + n]
                slab[offset + done : offset + done + n].copy_(
                    self._staging[index][:n], non_blocking=True
                )
                event.record(self._stream)
                done += n
                index ^= 1
            self._stream.synchronize()

    def read_into(self, offset: int, nbytes: int, dst: memoryview) -> None:
        """Copy `nbytes` from the slab at `offset` into the host buffer `dst`. Pure for the slab.

        `dst` must be writable, C-contiguous and at least `nbytes` long. Raises InvalidArgument
        unless `offset` is the start of an allocated slot that holds `nbytes`; Unavailable after
        close.
        """
        out = _byte_view(dst)
        if out.readonly:
            raise InvalidArgument("read_into needs a writable destination buffer")
        if out.nbytes < nbytes:
            raise InvalidArgument(f"destination holds {out.nbytes} bytes, {nbytes} requested")
        slab = self._open_slab()
        self._check_range(offset, nbytes)
        if self._host is not None:
            out[:nbytes] = self._host[offset : offset + nbytes]
            return
        torch = self._torch
        chunks = [
            (start, min(STAGING_CHUNK_BYTES, nbytes - start))
            for start in range(0, nbytes, STAGING_CHUNK_BYTES)
        ]
        with self._copy_lock, torch.cuda.stream(self._stream):

            def issue(i: int) -> None:
                start, n = chunks[i]
                buf = self._staging[i % 2]
                buf[:n].copy_(slab[offset + start : offset + start + n], non_blocking=True)
                self._events[i % 2].record(self._stream)

            if chunks:
                issue(0)
            for i, (start, n) in enumerate(chunks):
                if i + 1 < len(chunks):
                    issue(i + 1)  # its buffer was drained by the previous iteration
                self._events[i % 2].synchronize()
                out[start : start + n] = self._staging_views[i % 2][:n]

    def read(self, offset: int, nbytes: int) -> bytes:
        """The `nbytes` at `offset` as a new bytes object; raises like `read_into`."""
        out = bytearray(nbytes)
        self.read_into(offset, nbytes, memoryview(out))
        return bytes(out)

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the slab and staging buffers; idempotent. Later calls raise Unavailable.

        Call it once copies in flight on other threads have returned: it does not wait for them.
        """
        if self._slab is None:
            return
        with self._copy_lock:
            if self._host is not None:
                self._host.release()
            for view in self._staging_views:
                view.release()
            self._host = None
            self._staging_views = []
            self._staging = []
            self._slab = None
        log.info("gpu tier on %s closed", self._device)

    def __enter__(self) -> GpuTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_slab(self) -> torch.Tensor:
        slab = self._slab
        if slab is None:
            raise Unavailable(f"gpu tier on {self._device} is closed")
        return slab

    def _check_range(self, offset: int, nbytes: int) -> None:
        with self._lock:
            size = self._alloc.block_bytes(offset)
        if nbytes < 0 or nbytes > size:
            raise InvalidArgument(f"{nbytes} bytes do not fit the {size}-byte slot at {offset}")

    def __repr__(self) -> str:
        return (
            f"GpuTier(device={self.device!r}, capacity_bytes={self.capacity_bytes}, "
            f"used_bytes={self.used_bytes})"
        )
