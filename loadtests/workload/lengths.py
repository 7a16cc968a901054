"""Length distributions for prompt parts and outputs, written at a reference context and scaled.

A `LengthDist` is `fixed` (value), `uniform` (low, high, inclusive), `lognormal` (mean, cv) or
`normal` (mean, std). `sample(rng, scale)` draws one length, multiplies it by `scale` (the
model's context over the spec's reference context) and rounds to an int of at least `minimum`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "lognormal", "normal")


class LengthError(ValueError):
    """A length distribution table that cannot be used."""


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str
    a: float  # fixed: value; uniform: low; lognormal/normal: mean
    b: float = 0.0  # uniform: high; lognormal: cv; normal: std
    minimum: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LengthError(f"unknown length dist {self.kind!r} (known: {', '.join(KINDS)})")
        if self.a < 0 or self.b < 0:
            raise LengthError(f"length dist {self.kind} needs non-negative parameters")
        if self.kind == "uniform" and self.b < self.a:
            raise LengthError(f"uniform lengths need low <= high, got {self.a} > {self.b}")
        if self.kind == "lognormal" and self.a <= 0:
            raise LengthError("lognormal lengths need mean > 0")

    @classmethod
    def fixed(cls, value: int) -> LengthDist:
        return cls("fixed", float(value))

    @classmethod
    def parse(cls, raw: object, where: str) -> LengthDist:
        """From a TOML value: an int (fixed) or a table `{dist = ..., ...}`."""
        if isinstance(raw, bool):
            raise LengthError(f"{where}: a length is an int or a table, not a bool")
        if isinstance(raw, int):
            return cls.fixed(raw)
        if not isinstance(raw, Mapping):
            raise LengthError(
                f"{where}: a length is an int or a table like {{dist='fixed', value=64}}"
            )
        kind = raw.get("dist", "fixed")
        params = {
            "fixed": ("value", None),
            "uniform": ("low", "high"),
            "lognormal": ("mean", "cv"),
            "normal": ("mean", "std"),
        }
        if kind not in params:
            raise LengthError(f"{where}: unknown dist {kind!r} (known: {', '.join(KINDS)})")
        first, second = params[kind]
        allowed = {"dist", "min", first} | ({second} if second else set())
        extra = set(raw) - allowed
        if extra:
            raise LengthError(f"{where}: unexpected keys {sorted(extra)} for dist {kind!r}")
        try:
            a = float(raw[first])
            b = float(raw[second]) if second else 0.0
        except KeyError as exc:
            raise LengthError(f"{where}: dist {kind!r} needs {exc.args[0]!r}") from None
        except (TypeError, ValueError):
            raise LengthError(f"{where}: parameters must be numbers") from None
        try:
            return cls(kind, a, b, int(raw.get("min", 1)))
        except LengthError as exc:
            raise LengthError(f"{where}: {exc}") from None

    def sample(self, rng: random.Random, scale: float = 1.0) -> int:
        """One length (pure given the rng state)."""
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "lognormal":
            sigma2 = math.log1p(self.b * self.b)
            x = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        else:
            x = rng.gauss(self.a, self.b)
        return max(self.minimum, round(x * scale))

    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def to_json(self) -> dict[str, float | str | int]:
        return {"dist": self.kind, "a": self.a, "b": self.b, "min": self.minimum}
