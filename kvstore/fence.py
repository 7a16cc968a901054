"""Fencing stale same-host writers: the quarantine of expired reservations' slots.

A same-host client copies payloads straight into the DRAM slots it reserved (DESIGN §6). The
daemon cannot stop a client process that stalls (SIGSTOP, swap, a debugger) past its lease and
then resumes its copy, so the slots of a reservation that expires are not freed: they are
quarantined, with the reservation's keys released at once (another writer may put them), until
the holder is known to be done with them:

- it makes its late call on the lease (Commit, Abort or Release: its copy is over by then; the
  call is refused as LeaseExpired), or
- its process is gone: the pid it announced no longer exists, or is now another process (its
  start time in /proc differs), or
- (a holder whose process the daemon cannot see, e.g. another PID namespace) `max_age_s` passed.

A reservation made inside the daemon (the gRPC, TCP and UCX put paths) has the daemon as its
holder: always alive, so only its own late call (every such path ends with commit or abort)
frees the slots. Readers need no quarantine: they are fenced by slot generations (see
kvstore/tiers/dram.py `generation`), checked after each copy.

Pure bookkeeping: `Quarantine` holds offsets and says which may go; the store frees them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DAEMON", "Holder", "Quarantine", "probe_holder"]


@dataclass(frozen=True, slots=True)
class Holder:
    """Who writes into a reservation's slots: a process (pid and its start time in clock ticks,
    0 when the daemon could not see it) or the daemon itself (pid 0)."""

    pid: int
    start_ticks: int

    @property
    def in_daemon(self) -> bool:
        return self.pid == 0

    @property
    def visible(self) -> bool:
        return self.pid == 0 or self.start_ticks != 0

    def gone(self) -> bool:
        """True only when the holder's process certainly no longer runs. Reads /proc."""
        if self.pid == 0 or self.start_ticks == 0:
            return False
        return _start_ticks(self.pid) != self.start_ticks


DAEMON = Holder(0, 0)


def probe_holder(pid: int, segment: str | None = None) -> Holder:
    """The holder for a client that says it is process `pid` (its start time read now, while it
    is surely alive: it just made a call). A pid this daemon cannot see gives a holder that is
    never known to be gone.

    `segment`: the path of the DRAM segment, when the pid is only what the client claims (over
    gRPC; the lane has it from the kernel): a process that does not map the segment cannot be
    the writer (a client in another PID namespace names a pid that here is another process, whose
    exit says nothing of the writer), so it gives the unknown holder too."""
    if pid <= 0:
        return Holder(-1, 0)  # unknown process: never known to be gone
    holder = Holder(pid, _start_ticks(pid))
    if segment is not None and holder.start_ticks and not _maps(holder, segment):
        return Holder(-1, 0)
    return holder


_MAPPERS: set[Holder] = set()  # processes seen mapping the segment (a process keeps its map)
_MAPPERS_MAX = 4096


def _maps(holder: Holder, segment: str) -> bool:
    """Whether process `holder` maps the file `segment` (read from /proc/<pid>/maps; False when
    it cannot be read, e.g. another user's process)."""
    if holder in _MAPPERS:
        return True
    want = segment.encode()
    try:
        with open(f"/proc/{holder.pid}/maps", "rb") as fh:
            found = any(line.rstrip(b"\n").endswith(want) for line in fh)
    except OSError:
        return False
    if found:
        if len(_MAPPERS) >= _MAPPERS_MAX:
            _MAPPERS.clear()
        _MAPPERS.add(holder)
    return found


def _start_ticks(pid: int) -> int:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat), 0 when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return 0
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[19])  # field 22; rest starts at field 3
    except (IndexError, ValueError):
        return 0


@dataclass(frozen=True, slots=True)
class Quarantined:
    """The slots of one expired reservation, held until its holder is done."""

    holder: Holder
    offsets: tuple[int, ...]
    since_s: float


class Quarantine:
    """Expired reservations' slots by lease id. Not thread-safe (the store lock guards it)."""

    def __init__(self, max_age_s: float) -> None:
        self._max_age_s = max_age_s
        self._held: dict[int, Quarantined] = {}

    def hold(self, lease_id: int, holder: Holder, offsets: tuple[int, ...], now_s: float) -> None:
        if offsets:
            self._held[lease_id] = Quarantined(holder, offsets, now_s)

    def late_call(self, lease_id: int) -> tuple[int, ...] | None:
        """The holder of `lease_id` made its late call: the slots to free, or None when the lease
        was never quarantined."""
        q = self._held.pop(lease_id, None)
        return q.offsets if q is not None else None

    def sweep(self, now_s: float) -> list[tuple[int, ...]]:
        """Take out (and return) the slots whose holders are gone or whose time is up."""
        out: list[tuple[int, ...]] = []
        for lease_id, q in list(self._held.items()):
            if q.holder.gone() or (
                not q.holder.in_daemon
                and not q.holder.visible
                and now_s - q.since_s >= self._max_age_s
            ):
                del self._held[lease_id]
                out.append(q.offsets)
        return out

    @property
    def blocks(self) -> int:
        return sum(len(q.offsets) for q in self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._held
