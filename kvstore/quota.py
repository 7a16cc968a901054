"""Per-namespace byte quotas per tier: the `[[quota]]` tables of the daemon's config.

```toml
[[quota]]
namespace = "tenant-a"
dram = "4GiB"        # payload bytes this namespace may hold in DRAM (0 or absent: no limit)
ssd = "64GiB"        # ... on SSD

[[quota]]
default = true       # every namespace without a table of its own
dram = "1GiB"
```

A namespace's usage is the payload bytes of its pages resident in a tier (the index keeps them
per scope digest; the daemon learns a digest's namespace from the scope of each put). What a
quota does (kvstore/store.py, kvstore/movement.py):

- a put of a namespace at its DRAM quota first moves that namespace's own least-valuable pages
  out of DRAM (to SSD, as any eviction); when none can go (all leased or being written), the put
  is refused with CapacityExhausted (RESOURCE_EXHAUSTED, with a retry hint) and nothing changes;
- a page of a namespace at its SSD quota is written to SSD only after that namespace's own SSD
  pages make room (else it stays out of SSD, as when the SSD tier is full);
- whenever a tier must make room, pages of namespaces over their share of it go first.

Other namespaces keep serving throughout. Pages rebuilt from SSD at a restart count toward their
namespace once a put of their scope names it. Pure (no I/O); frozen values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.keys import Tier

__all__ = ["NamespaceQuota", "Quotas", "parse_quotas"]

_KEYS = {"namespace", "dram", "ssd", "default"}


@dataclass(frozen=True, slots=True)
class NamespaceQuota:
    """One `[[quota]]` table. A limit of 0 is no limit; `default` applies to every namespace
    without a table of its own (its `namespace` is then empty)."""

    namespace: str = ""
    dram_bytes: int = 0
    ssd_bytes: int = 0
    default: bool = False

    def limit(self, tier: Tier) -> int:
        if tier == Tier.DRAM:
            return self.dram_bytes
        if tier == Tier.SSD:
            return self.ssd_bytes
        return 0


def parse_quotas(items: object) -> tuple[NamespaceQuota, ...]:
    """The `[[quota]]` tables of a parsed TOML document. Raises InvalidArgument naming what is
    wrong: not a list of tables, an unknown key, a bad size, a namespace given twice, two
    defaults, a table that is neither named nor the default."""
    from kvstore.config import parse_size  # config imports this module; sizes parse there

    if not isinstance(items, Sequence) or isinstance(items, str | bytes):
        raise InvalidArgument("quota must be an array of tables ([[quota]])")
    out: list[NamespaceQuota] = []
    seen: set[str] = set()
    defaults = 0
    for i, item in enumerate(items):
        where = f"quota[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidArgument(f"{where} must be a table")
        unknown = set(item) - _KEYS
        if unknown:
            raise InvalidArgument(
                f"unknown key(s) {sorted(unknown)} in {where}; known: {sorted(_KEYS)}"
            )
        default = item.get("default", False)
        if not isinstance(default, bool):
            raise InvalidArgument(f"{where}.default must be true or false")
        namespace = item.get("namespace", "")
        if not isinstance(namespace, str):
            raise InvalidArgument(f"{where}.namespace must be a string")
        if default == ("namespace" in item):  # namespace = "" names the empty namespace
            raise InvalidArgument(
                f'{where} needs exactly one of namespace = "..." or default = true'
            )
        sizes = []
        for key in ("dram", "ssd"):
            value = item.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise InvalidArgument(f"{where}.{key}: not a size: {value!r}")
            try:
                sizes.append(parse_size(value))
            except InvalidArgument as exc:
                raise InvalidArgument(f"{where}.{key}: {exc}") from None
        if default:
            defaults += 1
            if defaults > 1:
                raise InvalidArgument("more than one [[quota]] with default = true")
        elif namespace in seen:
            raise InvalidArgument(f"namespace {namespace!r} has two [[quota]] tables")
        seen.add(namespace)
        out.append(NamespaceQuota(namespace, sizes[0], sizes[1], default))
    return tuple(out)


class Quotas:
    """The limits in force: `limit(namespace, tier)` in payload bytes, 0 = none."""

    def __init__(self, quotas: Sequence[NamespaceQuota] = ()) -> None:
        self._named = {q.namespace: q for q in quotas if not q.default}
        self._default = next((q for q in quotas if q.default), None)

    @property
    def enabled(self) -> bool:
        return bool(self._named) or self._default is not None

    def of(self, namespace: str) -> NamespaceQuota | None:
        return self._named.get(namespace, self._default)

    def limit(self, namespace: str, tier: Tier) -> int:
        quota = self.of(namespace)
        return quota.limit(tier) if quota is not None else 0

    def named(self) -> tuple[str, ...]:
        """The namespaces with a table of their own."""
        return tuple(self._named)
