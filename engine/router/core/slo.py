"""SLO classes and the admission configuration: a frozen tree the shell builds from TOML or JSON.

The file format (TOML shown; JSON with the same keys works too):

    [admission]
    default_class = "standard"     # used when a request names no class
    mode = "predicted"             # or "current" (the baseline: decode load as reported now)
    share_window_s = 5.0           # how far back a class's admitted work rate looks
    low_hit_share = 0.3            # part of each class's share kept for low-hit requests (0: off)
    low_hit_ratio = 0.5            # low-hit: under this fraction of the prompt found in the store

    [[admission.classes]]
    name = "interactive"
    ttft_s = 0.5                   # TTFT target, seconds ("inf" or absent = none)
    tpot_s = 0.05                  # TPOT target, seconds
    priority = 1                   # higher borrows idle capacity first
    share = 2.0                    # weight of its guaranteed share of prefill capacity

`AdmissionConfig.from_mapping(data["admission"])` builds it and rejects unknown keys, bad values
and a default class that is not listed. Without a configuration there is one class, "default",
with no targets: nothing is refused for its SLO.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

MODES = ("predicted", "current")


@dataclass(frozen=True, slots=True)
class SloClass:
    name: str
    ttft_s: float = math.inf
    tpot_s: float = math.inf
    priority: int = 0
    share: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an SLO class needs a name")
        if not self.ttft_s > 0 or not self.tpot_s > 0:
            raise ValueError(f"class {self.name!r}: targets must be > 0 seconds")
        if not self.share > 0 or math.isinf(self.share):
            raise ValueError(f"class {self.name!r}: share must be a positive number")

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> SloClass:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"SLO class: unknown keys {', '.join(unknown)}")
        if "name" not in data:
            raise ValueError("SLO class: missing name")
        try:
            return cls(
                name=str(data["name"]),
                ttft_s=_seconds(data.get("ttft_s", math.inf)),
                tpot_s=_seconds(data.get("tpot_s", math.inf)),
                priority=int(data.get("priority", 0)),  # type: ignore[call-overload]
                share=float(data.get("share", 1.0)),  # type: ignore[arg-type]
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"SLO class {data.get('name')!r}: {exc}") from exc


def _seconds(value: object) -> float:
    if isinstance(value, str) and value.strip().lower() in ("inf", "none", ""):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected seconds as a number, got {value!r}")
    return float(value)


def _number(data: Mapping[str, object], key: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"admission.{key} must be a number, got {value!r}")
    return float(value)


DEFAULT_CLASS = SloClass("default")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    classes: tuple[SloClass, ...] = field(default=(DEFAULT_CLASS,))
    default_class: str = "default"
    mode: str = "predicted"
    share_window_s: float = 5.0
    low_hit_share: float = 0.0  # part of each class's share kept for low-hit requests (0 = off)
    low_hit_ratio: float = 0.5  # a request is low-hit below this fraction of prompt tokens hit
    # a predicted TPOT must leave this part of its target free (admission fills a batch up to
    # the target, so with none about half the admitted requests of a full batch end just over)
    tpot_margin: float = 0.0

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names:
            raise ValueError("admission needs at least one SLO class")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate SLO class names in {names}")
        if self.default_class not in names:
            raise ValueError(f"default class {self.default_class!r} is not among {names}")
        if self.mode not in MODES:
            raise ValueError(f"admission mode must be one of {MODES}, got {self.mode!r}")
        if not self.share_window_s > 0:
            raise ValueError(f"share_window_s must be > 0, got {self.share_window_s}")
        if not 0.0 <= self.low_hit_share < 1.0:
            raise ValueError(f"low_hit_share must be in [0, 1), got {self.low_hit_share}")
        if not 0.0 <= self.tpot_margin < 1.0:
            raise ValueError(f"tpot_margin must be in [0, 1), got {self.tpot_margin}")
        if not 0.0 < self.low_hit_ratio <= 1.0:
            raise ValueError(f"low_hit_ratio must be in (0, 1], got {self.low_hit_ratio}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> AdmissionConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"admission: unknown keys {', '.join(unknown)}")
        raw = data.get("classes", [])
        if not isinstance(raw, list) or not all(isinstance(c, Mapping) for c in raw):
            raise ValueError("admission.classes must be a list of tables")
        classes = tuple(SloClass.from_mapping(c) for c in raw) or (DEFAULT_CLASS,)
        default = data.get("default_class", classes[0].name)
        return cls(
            classes=classes,
            default_class=str(default),
            mode=str(data.get("mode", "predicted")),
            share_window_s=_number(data, "share_window_s", 5.0),
            low_hit_share=_number(data, "low_hit_share", 0.0),
            low_hit_ratio=_number(data, "low_hit_ratio", 0.5),
        )

    def by_name(self, name: str) -> SloClass | None:
        for slo in self.classes:
            if slo.name == name:
                return slo
        return None

    def share_fraction(self, name: str) -> float:
        total = sum(c.share for c in self.classes)
        slo = self.by_name(name)
        return slo.share / total if slo is not None else 0.0
