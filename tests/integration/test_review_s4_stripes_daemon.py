"""A put that goes through whole is not refused when it is striped (client/core/stripes.py):
against a real daemon on loopback, a put of pages that branch (A0 A1 B1, B1 continuing A0 as A1
does) whose stripe holding B1 is reserved before the stripe holding its parent A0. The daemon's
chain check then knows A0 from nothing but the chain prefixes that stripe carries.

The call that carries A0 but not B1 (a stripe, not the whole put) is held on the daemon until
the call that carries B1 has returned (or HOLD_S, so a put that never sends that call still
ends); a put sent whole holds nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
from conftest import DaemonFactory, buffers, keys_of, make_scope, tokens_of
from test_ucx_path import MEDIUM

from client import PutStatus
from client.contract.page import PageHeader
from client.contract.scope import Scope
from client.contract.types import build_pages

pytestmark = pytest.mark.integration

HOLD_S = 5.0


def test_a_striped_put_of_a_branch_whose_later_stripe_lands_first_is_stored(
    daemon_factory: DaemonFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = daemon_factory(dram="64MiB", ssd=None, settings={"server.tcp": "true"})
    scope = make_scope(layout=MEDIUM)
    n = scope.layout.page_tokens
    a_tokens = [(7 * t) % 50_000 for t in range(2 * n)]
    size = scope.page_payload_bytes
    a0, a1 = build_pages(scope, a_tokens, [b"\x01" * size, b"\x02" * size])
    (b1,) = build_pages(scope, [*a_tokens[:n], *[9] * n], [b"\x03" * size], first_page=1)
    assert b1.header.parent == a0.header.key != a1.header.key
    pages = [a0, a1, b1]

    store = daemon.store
    reserve = store.reserve
    later_done = threading.Event()

    def held_reserve(s: Scope, raw_headers: Sequence[bytes], *a: Any, **k: Any) -> Any:
        keys = {PageHeader.decode(bytes(h)).key for h in raw_headers}
        if a0.header.key in keys and b1.header.key not in keys:
            later_done.wait(HOLD_S)  # the stripe holding A0 waits for the one holding B1
        try:
            return reserve(s, raw_headers, *a, **k)
        finally:
            if b1.header.key in keys:
                later_done.set()

    monkeypatch.setattr(store, "reserve", held_reserve)
    client = daemon.client(shared_memory=False, tcp_stripes=2, tcp_stripe_min_bytes=1)
    assert client.put(scope, pages).statuses == (PutStatus.STORED,) * 3
    assert client.transport == "tcp"

    into = buffers(scope, 3)
    got = client.get(scope, keys_of(pages), into, tokens=tokens_of(pages))
    assert got.hit_count == 3
    assert [bytes(b) for b in into] == [bytes(p.payload) for p in pages]
    daemon.check()
