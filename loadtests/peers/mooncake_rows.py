"""Mooncake Store's rows of `strata bench store --against mooncake`, and the Strata/Mooncake ratios.

The same batches as Strata's rows (`loadtests.bench_store.ShapeData`, in the same interleaved
rounds), through Mooncake's zero-copy batch API on the same buffers: with its storage in the
caller's process (same-host) and in a storage process over its TCP transport (remote). Each
ratio is oriented so that above 1 means Strata is better: throughput over throughput, or
Mooncake's p50 time over Strata's; Strata's side is its row as an engine pays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtests.bench_store import AS_PAID, BARE, SHAPES, Call, Samples, ShapeData, Timing
from loadtests.peers import mooncake


@dataclass(frozen=True, slots=True)
class MooncakeRatio:
    """Strata against Mooncake on one row, oriented so that above 1 means Strata is better:
    throughput over throughput, or Mooncake's p50 time over Strata's. `strata_over_mooncake_ratio`
    is Strata as an engine pays; `bare_over_mooncake_ratio` without the integrity work."""

    row: str
    shape: str
    unit: str  # "GB/s" or "ms"
    strata: float
    strata_bare: float | None
    mooncake: float
    strata_over_mooncake_ratio: float
    bare_over_mooncake_ratio: float | None


def bench_mooncake_path(
    label: str,
    peer: mooncake.MooncakeClient,
    bases: tuple[int, int],
    data: ShapeData,
    warm: Sequence[int],
    timed: Sequence[int],
    samples: Samples,
) -> None:
    """Mooncake's zero-copy batch put and get of the same pages from the same buffers (`bases`:
    the addresses of `data`'s source and destination arenas, registered with `peer`)."""
    src, dst = bases
    calls = [*warm, *timed]
    keys = {i: [f"{data.shape}-{i}-{j}" for j in range(data.count)] for i in calls}
    src_at = {i: [src + data.offset(i, j) for j in range(data.count)] for i in calls}
    dst_at = {i: [dst + data.offset(i, j) for j in range(data.count)] for i in calls}
    sizes = [data.page_bytes] * data.count
    last = timed[-1]
    try:
        samples.time(
            f"{label} put", data.shape, data.nbytes, "",
            lambda i: peer.put(keys[i], src_at[i], sizes), timed, warm,
        )
        data.clear_dst(last)
        samples.time(
            f"{label} get", data.shape, data.nbytes, "",
            lambda i: peer.get(keys[i], dst_at[i], sizes), timed, timed[:1],
        )
        if not data.same(last):
            raise mooncake.PeerFailed(f"{label} get returned wrong bytes")
    finally:
        peer.clear()


@contextlib.contextmanager
def mooncake_lookup_calls(label: str, peer: mooncake.MooncakeClient) -> Iterator[list[Call]]:
    """512 stored objects and Mooncake's calls for the same three measurements: `batch_is_exist`
    of all 512 keys (then the present prefix, as an engine would use it), of the 512 with the
    first missing, and a get of one missing key. Removed on exit."""
    arena = bytearray(512 * (64 << 10))
    base = peer.register(arena)
    keys = [f"lookup-{j}" for j in range(512)]
    miss_keys = ["lookup-missing", *keys[1:]]

    def hit(_: int) -> None:
        if peer.present(keys) != 512:
            raise mooncake.PeerFailed("batch_is_exist missed a stored key")

    def miss(_: int) -> None:
        if peer.present(miss_keys) != 0:
            raise mooncake.PeerFailed("batch_is_exist found a missing key")

    try:
        for start in range(0, 512, 64):
            peer.put(
                keys[start : start + 64],
                [base + j * (64 << 10) for j in range(start, start + 64)],
                [64 << 10] * 64,
            )
        yield [
            (f"{label} lookup 512 hit", "512 keys", hit),
            (f"{label} lookup 512 miss", "512 keys", miss),
            (f"{label} get miss", "1 key", lambda _: peer.get_missing("missing", base, 64 << 10)),
        ]
    finally:
        peer.clear()
        peer.unregister(base)


# Strata's row against Mooncake's: (comparison, Strata row, Mooncake row).
_THROUGHPUT_PAIRS = (
    ("same-host put", "same-host put", "mooncake same-host put"),
    ("same-host get", "same-host get", "mooncake same-host get"),
    ("remote put", "remote TCP put", "mooncake remote put"),
    ("remote get", "remote TCP get", "mooncake remote get"),
)
_LATENCY_PAIRS = (
    ("same-host missing get p50", "same-host get miss", "mooncake same-host get miss"),
    ("remote missing get p50", "remote TCP get miss", "mooncake remote get miss"),
    ("same-host lookup 512 p50", "same-host lookup 512 hit", "mooncake same-host lookup 512 hit"),
    ("remote lookup 512 p50", "remote TCP lookup 512 hit", "mooncake remote lookup 512 hit"),
)


def mooncake_ratios(rows: Sequence[Timing]) -> list[MooncakeRatio]:
    """Every Strata/Mooncake pair measured in `rows`, above 1 meaning Strata is better."""
    def find(name: str, shape: str, cost: str) -> Timing | None:
        return next((r for r in rows if (r.name, r.shape, r.cost) == (name, shape, cost)), None)

    out: list[MooncakeRatio] = []
    for shape in SHAPES:
        for what, ours, theirs in _THROUGHPUT_PAIRS:
            paid, bare, peer = find(ours, shape, AS_PAID), find(ours, shape, BARE), find(theirs, shape, "")
            if paid is None or peer is None or not peer.gb_per_s:
                continue
            out.append(
                MooncakeRatio(
                    what, shape, "GB/s", paid.gb_per_s, bare.gb_per_s if bare else None,
                    peer.gb_per_s, paid.gb_per_s / peer.gb_per_s,
                    bare.gb_per_s / peer.gb_per_s if bare else None,
                )
            )
    for what, ours, theirs in _LATENCY_PAIRS:
        mine = next((r for r in rows if r.name == ours), None)
        peer = next((r for r in rows if r.name == theirs), None)
        if mine is not None and peer is not None and mine.p50_ms:
            out.append(
                MooncakeRatio(
                    what, mine.shape, "ms", mine.p50_ms, None, peer.p50_ms,
                    peer.p50_ms / mine.p50_ms, None,
                )
            )
    return out


def print_ratios(ratios: Sequence[MooncakeRatio]) -> None:
    print(f"\n{'Strata / Mooncake (above 1: Strata better)':<44} {'batch':<10} "
          f"{'Strata':>9} {'bare':>9} {'Mooncake':>9} {'as paid':>8} {'bare':>6}")
    for m in ratios:
        bare = f"{m.strata_bare:.3f}" if m.strata_bare is not None else ""
        bare_ratio = f"{m.bare_over_mooncake_ratio:.2f}" if m.bare_over_mooncake_ratio is not None else ""
        print(f"{m.row + ' (' + m.unit + ')':<44} {m.shape:<10} {m.strata:>9.3f} {bare:>9} "
              f"{m.mooncake:>9.3f} {m.strata_over_mooncake_ratio:>8.2f} {bare_ratio:>6}")


@contextlib.contextmanager
def mooncake_peers(
    folder: Path, segment_bytes: int
) -> Iterator[tuple[mooncake.MooncakeClient, mooncake.MooncakeClient]]:
    """Mooncake's master and storage process on loopback, and two clients here: one with its
    storage in this process (same-host), one without (remote, over Mooncake's TCP transport).
    Both storages are written through once before anything is timed (Strata's DRAM segment is
    mapped populated, so neither side's timed calls pay first-touch page faults). Mooncake's
    native log goes to `folder`/mooncake-native.log meanwhile."""
    folder.mkdir(parents=True, exist_ok=True)
    with (
        mooncake.native_log_to(folder / "mooncake-native.log"),
        mooncake.MooncakeMaster(folder) as master,
        mooncake.MooncakeHolder(master.address, segment_bytes, folder / "mooncake-holder.log"),
    ):
        local = mooncake.MooncakeClient(master.address, segment_bytes)
        try:
            remote = mooncake.MooncakeClient(master.address, 0)
            try:
                for peer in (local, remote):
                    peer.prime(segment_bytes * 4 // 5)
                yield local, remote
            finally:
                remote.close()
        finally:
            local.close()
