"""What both bulk servers (kvstore/tcp_server.py, kvstore/ucx_server.py) send for a get: the
manifest of an acquisition's pages (framing in client/transports/ucx_protocol.py) and the DRAM
views of the payloads that follow it, in order. Pure over the pinned slots: no I/O here."""

from __future__ import annotations

from client.transports.ucx_protocol import ManifestEntry, ProtocolError, encode_manifest
from kvstore.store import Acquisition, Store
from kvstore.tiers.dram import DramTier

_ABSENT = ManifestEntry(b"", 0)


def acquired_manifest(acq: Acquisition, dram: DramTier) -> tuple[bytes, list[memoryview], int]:
    """(the manifest's bytes, the payload views to send after it, their total bytes) for the
    pages `acq` holds pinned in `dram` (a miss is an absent entry and sends nothing)."""
    entries: list[ManifestEntry] = []
    views: list[memoryview] = []
    for page in acq.pages:
        if page is None:
            entries.append(_ABSENT)
            continue
        entries.append(ManifestEntry(page.header, page.length))
        if page.length:
            views.append(dram.view(page.offset, page.length))
    return encode_manifest(entries), views, sum(v.nbytes for v in views)


def check_sent_from_held_slots(acq: Acquisition, store: Store) -> None:
    """After a get's payloads were sent: ProtocolError (the connection is to end; counted in
    `stale_fenced`) if any page left its DRAM slot meanwhile. Not reached while the lease holds
    (the send is bounded by half of it); a clock that jumped could let one go."""
    generation = store.tiers.dram.generation
    if any(page is not None and generation(page.offset) != page.generation for page in acq.pages):
        with store.counters.lock:
            store.counters.stale_fenced += 1
        raise ProtocolError("a page left its slot while being sent")
