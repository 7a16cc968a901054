"""The DRAM tier: one POSIX shared-memory segment, carved into slots by a buddy allocator.

The segment is the file `/dev/shm/<segment_name>`, created by the daemon with mode 0600 and
mapped shared. Same-host clients map the same file themselves and copy pages straight into
reserved slots or out of leased slots (DESIGN §6), so an offset handed out here is what the
client is told. `multiprocessing.shared_memory` is deliberately not used: its resource tracker
unlinks segments behind the owner's back.

Views and their lifetime: `view()` returns a slice of one memoryview of the whole map; nothing is
copied. A view stays valid (it keeps the mapping alive) until it is released, even after
`close()`. Callers should release views when done (`with tier.view(o, n) as v: ...`, or
`v.release()`); `close()` never raises BufferError because of views still alive: it unlinks the
file at once and the unmapping then happens when the last view is released or collected.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import struct
import uuid
from pathlib import Path

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.tiers.slots import SlotSpace

__all__ = [
    "SHM_DIR",
    "DramTier",
    "ephemeral_segment_name",
    "reclaim_ephemeral_segments",
    "segment_path",
]

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
GENERATION = struct.Struct("=Q")  # one slot generation counter (host byte order: same host)
_GEN_MASK = (1 << 64) - 1

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def segment_path(segment_name: str) -> Path:
    """The file that backs segment `segment_name`; raises InvalidArgument for a malformed name."""
    if not segment_name or "/" in segment_name or segment_name in (".", ".."):
        raise InvalidArgument(f"bad shared-memory segment name {segment_name!r}")
    return SHM_DIR / segment_name


_EPHEMERAL = re.compile(r"^strata-(\d+)-[0-9a-f]{8}$")


def ephemeral_segment_name() -> str:
    """A segment name of its own for a daemon on an ephemeral port: `strata-<pid>-<random>`."""
    return f"strata-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def reclaim_ephemeral_segments(folder: Path = SHM_DIR) -> int:
    """Unlink the ephemeral segments (see `ephemeral_segment_name`) of this user that no daemon
    holds: a daemon killed, or a test run that crashed, leaves its segment behind, and tmpfs
    keeps its memory until someone removes it. Returns how many were removed.

    A live daemon holds an exclusive `flock` on its segment file for its whole life, so "no
    daemon holds it" is asked of the kernel, not only read from the pid in the name: a daemon in
    another PID namespace sharing /dev/shm (a container) has a pid this process cannot see, and
    its segment is left alone all the same. A segment whose pid runs here is kept too."""
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        m = _EPHEMERAL.match(name)
        if m is None or _alive(int(m.group(1))):  # a pid alive here: kept, held or not
            continue
        path = folder / name
        try:
            if path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        fd = _lock_if_unheld(path)
        if fd is None:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        finally:
            os.close(fd)
        removed += 1
    if removed:
        log.info("dram tier: removed %d segments left by daemons that are gone", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _lock_if_unheld(path: Path) -> int | None:
    """A descriptor of `path` holding its exclusive flock, or None when a daemon holds the lock
    (or the file cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class DramTier(SlotSpace):
    """A shared-memory slab of `capacity_bytes` with buddy-allocated slots.

    Creating it creates (or replaces a stale) `/dev/shm/<segment_name>` and maps it; raises
    Unavailable if the segment cannot be created or mapped, InvalidArgument for a bad name or
    capacity. `allocate`/`free` are thread-safe; `view` is lock-free.
    """

    def __init__(self, capacity_bytes: int, segment_name: str, min_block_bytes: int = 4096) -> None:
        super().__init__(capacity_bytes, min_block_bytes)
        self._name = segment_name
        self._path = segment_path(segment_name)
        slots = self._alloc.capacity_bytes
        self._granule = min_block_bytes
        entries = slots // min_block_bytes
        table = -(-entries * GENERATION.size // 4096) * 4096
        size = slots + table  # the slots, then the generation table (same-host read fence)
        fd = self._create_file()
        try:
            os.ftruncate(fd, size)
            # Allocate the memory now (a /dev/shm too small fails here, clearly, not with SIGBUS
            # on some later write) and map it populated, so no copy pays for page faults.
            os.posix_fallocate(fd, 0, size)
            self._map: mmap.mmap | None = mmap.mmap(
                fd,
                size,
                flags=mmap.MAP_SHARED | _MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as exc:
            os.close(fd)
            self._path.unlink(missing_ok=True)
            raise Unavailable(
                f"cannot size or map shared-memory segment {self._path}: {exc}"
            ) from exc
        self._inode = os.fstat(fd).st_ino
        self._lock_fd = fd  # kept open: it holds the segment's flock (see `_create_file`)
        self._whole: memoryview | None = memoryview(self._map)
        self._size = size
        # one counter per granule; a slot's counter is the one of its first granule
        self._gens: memoryview | None = self._whole[slots : slots + entries * 8].cast("Q")
        self._unlinked = False
        log.info("dram tier: segment %s, %d bytes", self._path, size)

    def _create_file(self) -> int:
        """Create the segment file and take its exclusive flock (held for the tier's life: it
        tells other daemons the segment is in use). A file of that name that no daemon holds is
        stale and replaced; one a running daemon holds is left alone (Unavailable)."""
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC
        try:
            fd = os.open(self._path, flags, 0o600)
        except FileExistsError:
            stale = _lock_if_unheld(self._path)
            if stale is None:
                raise Unavailable(
                    f"shared-memory segment {self._path} is in use by a running daemon "
                    "(choose another dram.segment_name or server.port)"
                ) from None
            log.warning(
                "dram tier: replacing stale shared-memory segment %s (left by a crashed daemon?)",
                self._path,
            )
            try:
                self._path.unlink(missing_ok=True)
            finally:
                os.close(stale)
            try:
                fd = os.open(self._path, flags, 0o600)
            except OSError as exc:
                raise Unavailable(
                    f"cannot create shared-memory segment {self._path}: {exc}"
                ) from exc
        except OSError as exc:
            raise Unavailable(f"cannot create shared-memory segment {self._path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:  # someone opened the new file and locked it first
            os.close(fd)
            raise Unavailable(f"shared-memory segment {self._path} is in use: {exc}") from exc
        return fd

    # ---- queries -------------------------------------------------------------------------------

    @property
    def segment_name(self) -> str:
        return self._name

    @property
    def path(self) -> Path:
        return self._path

    @property
    def size_bytes(self) -> int:
        """Size of the segment file: what a client maps (the slots, then the generation
        table)."""
        return self._size

    @property
    def generations_offset(self) -> int:
        """Where the slot generation table starts in the segment (after the slots)."""
        return self._alloc.capacity_bytes

    @property
    def generation_granule_bytes(self) -> int:
        return self._granule

    # ---- the slot fence ------------------------------------------------------------------------

    def generation(self, offset: int) -> int:
        """The generation of the slot at `offset`: it changes every time the slot is freed, so
        a copy out of a slot that ends with the generation it started with read no reused
        slot. Read-only, lock free (same-host clients read the same counter in the segment)."""
        gens = self._gens
        if gens is None:
            raise Unavailable(f"dram tier {self._name} is closed")
        return int(gens[offset // self._granule])

    def free(self, offset: int) -> int:
        """Release the slot at `offset` and advance its generation (before anyone can be given
        the slot again); mutates. Returns the slot size. Raises as `SlotSpace.free`."""
        with self._lock:
            size = self._alloc.free(offset)
            gens = self._gens
            if gens is not None:
                i = offset // self._granule
                gens[i] = (gens[i] + 1) & _GEN_MASK
            return size

    @property
    def closed(self) -> bool:
        return self._whole is None

    # ---- slots ---------------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        self._check_open()

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable, zero-copy view of `nbytes` at `offset` of the segment. Pure.

        Raises InvalidArgument if the range is not inside the segment, Unavailable after
        `close()`. The range need not be one slot (the store checks slot bounds). Release the
        view when done; see the module docstring for lifetime rules.
        """
        whole = self._whole
        if whole is None:
            raise Unavailable(f"dram tier {self._name} is closed")
        slots = self._alloc.capacity_bytes
        if offset < 0 or nbytes < 0 or offset + nbytes > slots:
            raise InvalidArgument(
                f"range [{offset}, {offset + nbytes}) is outside the {slots} bytes of slots"
            )
        return whole[offset : offset + nbytes]

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self, unlink: bool = True) -> None:
        """Release this tier's mapping and (by default) unlink the segment file; idempotent.

        Never raises BufferError: if views handed out by `view()` are still alive, the memory
        stays mapped until the last of them is released, and a warning is logged.
        With `unlink=False` the file stays in /dev/shm (for a hand-over or post-mortem).
        """
        if self._whole is None and (self._unlinked or not unlink):
            return
        whole, self._whole = self._whole, None
        mapping, self._map = self._map, None
        gens, self._gens = self._gens, None
        if gens is not None:
            gens.release()
        if whole is not None:
            whole.release()
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                log.warning(
                    "dram tier: views of segment %s are still alive; it is unmapped when they are "
                    "released",
                    self._path,
                )
        if unlink and not self._unlinked:
            self._unlinked = True
            try:
                # Only unlink our own file, not a segment another daemon created under this name.
                if os.stat(self._path).st_ino == self._inode:
                    self._path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("dram tier: cannot unlink segment %s: %s", self._path, exc)
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
        log.info("dram tier: segment %s closed", self._path)

    def __enter__(self) -> DramTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._whole is None:
            raise Unavailable(f"dram tier {self._name} is closed")

    def __repr__(self) -> str:
        return (
            f"DramTier(segment={self._name!r}, capacity_bytes={self.capacity_bytes}, "
            f"used_bytes={self.used_bytes})"
        )
