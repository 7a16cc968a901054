"""SSD admission and write mode policies."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.index import PageEntry
from kvstore.policy import AlwaysAdmit, SecondHitAdmit, WriteMode, make_admission

pytestmark = pytest.mark.unit


def entry(hits: int) -> PageEntry:
    return PageEntry(b"k" * 16, b"p" * 16, b"s" * 16, b"", 10, dram=0, hits=hits)


def test_always_admits_everything() -> None:
    policy = make_admission("always")
    assert isinstance(policy, AlwaysAdmit)
    assert [policy.admit(entry(h)) for h in (0, 1, 5)] == [True, True, True]


def test_second_hit_admits_pages_read_after_their_write() -> None:
    policy = make_admission("second-hit")
    assert isinstance(policy, SecondHitAdmit) and policy.name == "second-hit"
    assert [policy.admit(entry(h)) for h in (0, 1, 2)] == [False, True, True]


def test_unknown_admission() -> None:
    with pytest.raises(InvalidArgument, match="second-hit"):
        make_admission("never")


def test_write_mode_parse() -> None:
    assert WriteMode.parse("write-back") is WriteMode.WRITE_BACK
    assert WriteMode.parse("write-through") is WriteMode.WRITE_THROUGH
    with pytest.raises(InvalidArgument, match="write-back"):
        WriteMode.parse("WRITE_BACK")
