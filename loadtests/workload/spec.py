"""The workload spec (TOML): model, arrival process, request classes with SLOs and generators.

    name = "tool_use"
    seed = 7
    duration_s = 60
    [model]                      # what the prompts are for
    context_tokens = 32768       # lengths are scaled by context_tokens / reference_context
    reference_context = 32768
    vocab_size = 32000           # token ids fall in [token_low, vocab_size)
    [arrival]
    process = "poisson"          # poisson | gamma (cv) | onoff (on_s, off_s) | ramp (rate_end) | trace
    rate = 8.0                   # requests/s (the mean rate; a sweep overrides it)
    [[classes]]
    name = "interactive"
    weight = 1.0                 # share of arrivals
    ttft_s = 1.0                 # SLO: time to first token
    tpot_s = 0.1                 # SLO: time per output token
    [classes.generator]
    kind = "tool_use"            # tool_use | agent | doc_qa | chat | trace (see generators.py)
    ...

`load_workload(path)` reads and checks a file; `parse_workload(table, base_dir)` a parsed table.
Every bad value raises `WorkloadError` naming the key. The spec is frozen and carries no state.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.workload.lengths import LengthDist, LengthError

ARRIVALS = ("poisson", "gamma", "onoff", "ramp", "trace")
GENERATORS = ("tool_use", "agent", "doc_qa", "chat", "trace")


class WorkloadError(ValueError):
    """A workload file or table that cannot be used; the message names the key."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    context_tokens: int = 32768
    reference_context: int = 32768
    vocab_size: int = 32000
    token_low: int = 3

    @property
    def scale(self) -> float:
        return self.context_tokens / self.reference_context


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    process: str = "poisson"
    rate: float = 1.0
    cv: float = 1.0  # gamma
    on_s: float = 5.0  # onoff
    off_s: float = 5.0
    rate_end: float = 0.0  # ramp: from `rate` to `rate_end` over the duration


@dataclass(frozen=True, slots=True)
class GeneratorSpec:
    """A generator and its options: lengths as `LengthDist`, counts and exponents as numbers."""

    kind: str
    lengths: tuple[tuple[str, LengthDist], ...] = ()
    numbers: tuple[tuple[str, float], ...] = ()
    path: str = ""  # trace: the Mooncake-format file (resolved against the spec's folder)

    def length(self, name: str, default: LengthDist) -> LengthDist:
        return dict(self.lengths).get(name, default)

    def number(self, name: str, default: float) -> float:
        return dict(self.numbers).get(name, default)


@dataclass(frozen=True, slots=True)
class ClassSpec:
    name: str
    ttft_s: float
    tpot_s: float
    generator: GeneratorSpec
    weight: float = 1.0
    priority: int = 0
    share: float = 0.0  # admission share (0 = no reserved share)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    seed: int
    duration_s: float
    arrival: ArrivalSpec
    classes: tuple[ClassSpec, ...]
    model: ModelSpec = field(default_factory=ModelSpec)
    source: str = ""  # the file it was read from, for reports

    def slo(self, class_name: str) -> ClassSpec:
        for c in self.classes:
            if c.name == class_name:
                return c
        raise KeyError(class_name)


_LENGTH_KEYS = {
    "tool_use": ("system", "tool", "question", "output"),
    "agent": ("system", "first", "turn", "output", "turns"),
    "doc_qa": ("document", "question", "output"),
    "chat": ("prompt", "output"),
    "trace": (),
}
_NUMBER_KEYS = {
    "tool_use": ("tools", "zipf"),
    "agent": ("sessions",),
    "doc_qa": ("documents", "zipf"),
    "chat": (),
    "trace": ("block_tokens", "output_scale", "time_scale", "max_requests", "start_s"),
}


def load_workload(path: str | Path) -> WorkloadSpec:
    """Read and check a workload TOML file (raises WorkloadError)."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise WorkloadError(f"workload file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{p}: not valid TOML: {exc}") from None
    return parse_workload(raw, base_dir=p.parent, source=str(p))


def _num(
    table: Mapping[str, object], key: str, default: float, where: str, *, positive: bool = False
) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WorkloadError(f"{where}.{key} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise WorkloadError(f"{where}.{key} must be {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def _check_keys(table: Mapping[str, object], allowed: set[str], where: str) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise WorkloadError(f"{where}: unknown keys {extra} (known: {sorted(allowed)})")


def _table(raw: object, where: str) -> Mapping[str, object]:
    if not isinstance(raw, Mapping):
        raise WorkloadError(f"{where} must be a table")
    return raw


def _generator(raw: object, where: str, base_dir: Path) -> GeneratorSpec:
    table = _table(raw, where)
    kind = table.get("kind")
    if kind not in GENERATORS:
        raise WorkloadError(f"{where}.kind must be one of {', '.join(GENERATORS)}, got {kind!r}")
    length_keys, number_keys = _LENGTH_KEYS[kind], _NUMBER_KEYS[kind]
    _check_keys(table, {"kind", "path", *length_keys, *number_keys}, where)
    try:
        lengths = tuple(
            (k, LengthDist.parse(table[k], f"{where}.{k}")) for k in length_keys if k in table
        )
    except LengthError as exc:
        raise WorkloadError(str(exc)) from None
    numbers = tuple((k, _num(table, k, 0, where)) for k in number_keys if k in table)
    path = ""
    if kind == "trace":
        raw_path = table.get("path")
        if not isinstance(raw_path, str) or not raw_path:
            raise WorkloadError(f"{where}.path: a trace generator needs the trace file's path")
        path = (
            str((base_dir / raw_path).resolve()) if not Path(raw_path).is_absolute() else raw_path
        )
    elif "path" in table:
        raise WorkloadError(f"{where}.path is only for kind = 'trace'")
    return GeneratorSpec(kind, lengths, numbers, path)


def parse_workload(
    raw: Mapping[str, object], base_dir: Path = Path("."), source: str = ""
) -> WorkloadSpec:
    """Check a parsed TOML table and build the spec (raises WorkloadError)."""
    _check_keys(raw, {"name", "seed", "duration_s", "model", "arrival", "classes"}, "workload")
    name = raw.get("name", Path(source).stem if source else "workload")
    if not isinstance(name, str):
        raise WorkloadError("workload.name must be a string")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise WorkloadError(f"workload.seed must be an int, got {seed!r}")
    duration = _num(raw, "duration_s", 60.0, "workload", positive=True)

    mt = _table(raw.get("model", {}), "model")
    _check_keys(mt, {"context_tokens", "reference_context", "vocab_size", "token_low"}, "model")
    context = int(_num(mt, "context_tokens", 32768, "model", positive=True))
    model = ModelSpec(
        context_tokens=context,
        reference_context=int(_num(mt, "reference_context", context, "model", positive=True)),
        vocab_size=int(_num(mt, "vocab_size", 32000, "model", positive=True)),
        token_low=int(_num(mt, "token_low", 3, "model")),
    )
    if model.vocab_size <= model.token_low:
        raise WorkloadError("model.vocab_size must be above model.token_low")

    at = _table(raw.get("arrival", {}), "arrival")
    _check_keys(at, {"process", "rate", "cv", "on_s", "off_s", "rate_end"}, "arrival")
    process = at.get("process", "poisson")
    if process not in ARRIVALS:
        raise WorkloadError(
            f"arrival.process must be one of {', '.join(ARRIVALS)}, got {process!r}"
        )
    rate = _num(at, "rate", 1.0, "arrival", positive=process != "trace")
    arrival = ArrivalSpec(
        process=str(process),
        rate=rate,
        cv=_num(at, "cv", 1.0, "arrival", positive=True),
        on_s=_num(at, "on_s", 5.0, "arrival", positive=True),
        off_s=_num(at, "off_s", 5.0, "arrival"),
        rate_end=_num(at, "rate_end", rate, "arrival"),
    )

    raw_classes = raw.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise WorkloadError("workload needs at least one [[classes]] table")
    classes: list[ClassSpec] = []
    for i, rc in enumerate(raw_classes):
        where = f"classes[{i}]"
        ct = _table(rc, where)
        _check_keys(
            ct, {"name", "weight", "ttft_s", "tpot_s", "priority", "share", "generator"}, where
        )
        cname = ct.get("name")
        if not isinstance(cname, str) or not cname:
            raise WorkloadError(f"{where}.name must be a non-empty string")
        if any(c.name == cname for c in classes):
            raise WorkloadError(f"{where}.name {cname!r} is used twice")
        if "generator" not in ct:
            raise WorkloadError(f"{where} ({cname}) needs a [classes.generator] table")
        classes.append(
            ClassSpec(
                name=cname,
                ttft_s=_num(ct, "ttft_s", 1.0, where, positive=True),
                tpot_s=_num(ct, "tpot_s", 0.1, where, positive=True),
                generator=_generator(ct["generator"], f"{where}.generator", base_dir),
                weight=_num(ct, "weight", 1.0, where, positive=True),
                priority=int(_num(ct, "priority", 0, where)),
                share=_num(ct, "share", 0.0, where),
            )
        )
    traces = [c for c in classes if c.generator.kind == "trace"]
    if traces and len(classes) > 1:
        raise WorkloadError("a trace workload has exactly one class (the trace decides the mix)")
    if process == "trace" and not traces:
        raise WorkloadError("arrival.process = 'trace' needs a class with generator kind = 'trace'")
    return WorkloadSpec(name, seed, duration, arrival, tuple(classes), model, source)
