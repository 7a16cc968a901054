"""Movement policies (DESIGN §5): which demoted pages the SSD tier admits, and when SSD is written.

Each policy is a small class with one method, chosen by name from the config (`ssd.admission`,
`ssd.write_mode`), so a new policy is a new class, not a special case in the mover.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Protocol

from kvstore.errors import InvalidArgument

__all__ = [
    "AlwaysAdmit",
    "HitCounted",
    "SecondHitAdmit",
    "SsdAdmission",
    "WriteMode",
    "make_admission",
]


class HitCounted(Protocol):
    """What an admission policy reads of a page (kvstore.index.PageEntry satisfies it)."""

    @property
    def hits(self) -> int: ...


class SsdAdmission(Protocol):
    """Decides whether a page leaving DRAM is written to SSD (False: it is dropped instead)."""

    name: ClassVar[str]

    def admit(self, entry: HitCounted) -> bool:
        """Pure: reads the entry, mutates nothing, raises nothing."""
        ...


class AlwaysAdmit:
    """Every demoted page goes to SSD."""

    name: ClassVar[str] = "always"

    def admit(self, entry: HitCounted) -> bool:
        return True


class SecondHitAdmit:
    """Only pages hit twice go to SSD: written once and read at least once since (`hits >= 1`,
    as the index counts reads, not the write). One-off pages never cost an SSD write."""

    name: ClassVar[str] = "second-hit"

    def admit(self, entry: HitCounted) -> bool:
        return entry.hits >= 1


_ADMISSIONS: dict[str, type[AlwaysAdmit] | type[SecondHitAdmit]] = {
    AlwaysAdmit.name: AlwaysAdmit,
    SecondHitAdmit.name: SecondHitAdmit,
}


def make_admission(name: str) -> SsdAdmission:
    """The admission policy called `name` ("always" | "second-hit"); raises InvalidArgument."""
    cls = _ADMISSIONS.get(name)
    if cls is None:
        raise InvalidArgument(f"unknown ssd admission {name!r}; known: {sorted(_ADMISSIONS)}")
    return cls()


class WriteMode(enum.Enum):
    """When the SSD copy of a page is written."""

    WRITE_BACK = "write-back"  # on demotion from DRAM (the default)
    WRITE_THROUGH = "write-through"  # on every put, as well as the upper tier

    @classmethod
    def parse(cls, text: str) -> WriteMode:
        """Parse a config value ("write-back" | "write-through"); raises InvalidArgument."""
        try:
            return cls(text)
        except ValueError:
            known = [mode.value for mode in cls]
            raise InvalidArgument(f"unknown ssd write mode {text!r}; known: {known}") from None
