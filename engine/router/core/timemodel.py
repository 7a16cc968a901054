"""The time model: how long a worker takes to prefill, to run a decode step, and to pull pages.

Its coefficients come from profiling a worker on its machine (`strata profile`, engine/profile.py)
and are fitted here by least squares; nothing in it is hard-coded. The forms follow what a
decoder does:

- prefill of `n` new tokens after `c` cached ones:
  `fixed + per_token * n + per_cached_token * c + attention * n * (c + n / 2)`
  (projections and MLP grow with n; causal attention with the pairs of query and key tokens);
  zero when there is nothing to compute.
- one decode step of a batch of `b` requests holding `ctx` context tokens in all:
  `fixed + per_request * b + per_context_token * ctx`; zero for an empty batch.
- pulling `nbytes` of pages from a tier over a path (same host = shared memory, remote = the
  network): `fixed + nbytes * seconds_per_byte`, one pair per (tier, path) that was profiled. A
  path that was not profiled is priced as the slowest profiled path of that tier, else of any
  tier; with no pull profile at all a pull costs nothing (the model then prefers hits, as cache
  affinity does).

A `TimeModel` carries where it came from (`Provenance`: machine, checkpoint, date) and, when it
was fitted, the samples it was fitted on, so a profile file can be checked against itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from engine.router.core.types import TIERS

FORMAT = "strata-timemodel"
VERSION = 1


@dataclass(frozen=True, slots=True)
class PrefillCoeffs:
    fixed_s: float
    per_token_s: float
    per_cached_token_s: float
    attention_s: float

    def seconds(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        n, c = float(new_tokens), float(max(cached_tokens, 0))
        return (
            self.fixed_s
            + self.per_token_s * n
            + self.per_cached_token_s * c
            + self.attention_s * n * (c + n / 2.0)
        )

    @staticmethod
    def features(new_tokens: int, cached_tokens: int) -> tuple[float, float, float, float]:
        n, c = float(new_tokens), float(cached_tokens)
        return (1.0, n, c, n * (c + n / 2.0))


@dataclass(frozen=True, slots=True)
class DecodeCoeffs:
    fixed_s: float
    per_request_s: float
    per_context_token_s: float

    def seconds(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.fixed_s + self.per_request_s * batch + self.per_context_token_s * context_tokens

    @staticmethod
    def features(batch: int, context_tokens: int) -> tuple[float, float, float]:
        return (1.0, float(batch), float(context_tokens))


@dataclass(frozen=True, slots=True)
class PullCoeffs:
    """Pulling from one tier over one path: `fixed_s + nbytes * s_per_byte`."""

    tier: str
    same_host: bool
    fixed_s: float
    s_per_byte: float

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"unknown tier {self.tier!r} (known: {', '.join(TIERS)})")

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + self.s_per_byte * nbytes if nbytes > 0 else 0.0

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.s_per_byte if self.s_per_byte > 0 else math.inf


@dataclass(frozen=True, slots=True)
class PrefillSample:
    new_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    batch: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PullSample:
    tier: str
    same_host: bool
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Samples:
    """Measured points a time model is fitted on (and checked against)."""

    prefill: tuple[PrefillSample, ...] = ()
    decode: tuple[DecodeSample, ...] = ()
    pull: tuple[PullSample, ...] = ()


@dataclass(frozen=True, slots=True)
class Machine:
    cpu_model: str = ""
    cores: int = 0
    torch_device: str = ""
    hostname: str = ""


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where a time model came from: the machine, the checkpoint (path and fingerprint), when."""

    machine: Machine = field(default_factory=Machine)
    checkpoint_path: str = ""
    checkpoint_fingerprint: str = ""
    created: str = ""  # ISO 8601, UTC
    store: str = ""  # the store address pulls were measured against ("" = none)
    note: str = ""


@dataclass(frozen=True, slots=True)
class TimeModel:
    prefill: PrefillCoeffs
    decode: DecodeCoeffs
    pulls: tuple[PullCoeffs, ...] = ()
    provenance: Provenance = field(default_factory=Provenance)
    samples: Samples = field(default_factory=Samples)
    # (tier, same_host) -> the line it is priced with, filled on first use
    _pull_table: dict[tuple[str, bool], object] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to compute `new_tokens` after `cached_tokens` already in the pool."""
        return self.prefill.seconds(new_tokens, cached_tokens)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds of one decode step of `batch` requests with `context_tokens` context in all."""
        return self.decode.seconds(batch, context_tokens)

    def pull_s(self, nbytes: int, tier: str, same_host: bool) -> float:
        """Seconds to pull `nbytes` of pages from `tier`, same host or remote (see module doc)."""
        if nbytes <= 0:
            return 0.0
        coeffs = self.pull_coeffs(tier, same_host)
        return coeffs.seconds(nbytes) if coeffs is not None else 0.0

    def pull_coeffs(self, tier: str, same_host: bool) -> PullCoeffs | None:
        """The line pulls from `tier` over that path are priced with (see the module doc)."""
        found = self._pull_table.get((tier, same_host), _UNSET)
        if found is _UNSET:
            found = _pull_line(self.pulls, tier, same_host)
            self._pull_table[(tier, same_host)] = found
        return found  # type: ignore[return-value]

    def queue_drain_s(self, queued_tokens: int, queued_requests: int) -> float:
        """Seconds to drain a prefill queue of `queued_tokens` over `queued_requests` requests.

        The report gives totals only, so the requests are taken as equal in size and cache-free
        (their tokens are the ones still to compute).
        """
        if queued_tokens <= 0:
            return 0.0
        requests = max(queued_requests, 1)
        each = queued_tokens / requests
        p = self.prefill
        return requests * (p.fixed_s + p.per_token_s * each + p.attention_s * each * each / 2.0)

    @classmethod
    def fit(cls, samples: Samples, provenance: Provenance | None = None) -> TimeModel:
        """Least-squares coefficients (relative error, non-negative) for every part with samples."""
        from engine.router.core.fit import fit_time_model

        return fit_time_model(samples, provenance or Provenance())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_dict(self) -> dict[str, object]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "pulls": [asdict(p) for p in self.pulls],
            "provenance": asdict(self.provenance),
            "samples": asdict(self.samples),
        }

    @classmethod
    def from_json(cls, text: str) -> TimeModel:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"time model is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("time model JSON must be an object")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TimeModel:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a time model (format {data.get('format')!r}, want {FORMAT!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"time model version {data.get('version')!r} (this reads {VERSION})")
        try:
            prov = _mapping(data.get("provenance", {}))
            machine = _build(Machine, _mapping(prov.get("machine", {})))
            provenance = _build(
                Provenance, {k: v for k, v in prov.items() if k != "machine"}, machine=machine
            )
            raw = _mapping(data.get("samples", {}))
            samples = Samples(
                prefill=tuple(_build(PrefillSample, _mapping(s)) for s in _list(raw, "prefill")),
                decode=tuple(_build(DecodeSample, _mapping(s)) for s in _list(raw, "decode")),
                pull=tuple(_build(PullSample, _mapping(s)) for s in _list(raw, "pull")),
            )
            return cls(
                prefill=_build(PrefillCoeffs, _mapping(data.get("prefill"))),
                decode=_build(DecodeCoeffs, _mapping(data.get("decode"))),
                pulls=tuple(_build(PullCoeffs, _mapping(p)) for p in _list(data, "pulls")),
                provenance=provenance,
                samples=samples,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed time model: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Write the model as JSON (atomically: a temporary file renamed into place)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        tmp.replace(target)

    @classmethod
    def load(cls, path: str | Path) -> TimeModel:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


_T = TypeVar("_T")
_ACCEPTS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}


def _build(cls: type[_T], raw: Mapping[str, object], **given: object) -> _T:
    """An instance of the flat dataclass `cls` from JSON values, each checked against its
    field's type (float, int, bool, str); unknown or missing keys are a TypeError."""
    values: dict[str, object] = dict(given)
    names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown keys {', '.join(unknown)}")
    for name, f in names.items():
        if name in values:
            continue
        if name not in raw:
            if f.default is MISSING:
                raise TypeError(f"{cls.__name__}: missing {name}")
            continue
        value = raw[name]
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind == "float" and number:
            values[name] = float(value)  # type: ignore[arg-type]
        elif _ACCEPTS.get(kind, lambda v: False)(value):
            values[name] = value
        else:
            raise TypeError(f"{cls.__name__}.{name}: expected {kind}, got {value!r}")
    return cls(**values)


_UNSET = object()


def _pull_line(pulls: tuple[PullCoeffs, ...], tier: str, same_host: bool) -> PullCoeffs | None:
    exact = [p for p in pulls if p.tier == tier and p.same_host == same_host]
    if exact:
        return exact[0]
    pool = [p for p in pulls if p.tier == tier] or list(pulls)
    if not pool:
        return None
    return max(pool, key=lambda p: (p.s_per_byte, p.fixed_s))


def _mapping(value: object) -> dict[str, object]:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value


def _list(data: Mapping[str, object], key: str) -> list[object]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise TypeError(f"{key} must be a list")
    return value
