"""Which store a worker or the router talks to, from one command-line string (DESIGN §7).

- `HOST:PORT`: one daemon (`client.StoreClient`);
- `HOST:PORT,HOST:PORT,...`: a cluster of these daemons, fixed (`client.ClusterClient`);
- `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]`: a cluster whose members register in etcd
  (cluster name "default" unless given).

Workers and the router parse the same string, so the router's lookups see the pages the workers
publish. Imports no torch (the router uses it too).
"""

from __future__ import annotations

from dataclasses import dataclass

from client import ClusterClient, StoreClient

ETCD_SCHEME = "etcd://"


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """A parsed store string. Exactly one of `addresses` (one or more daemons) or
    `etcd_endpoints` is non-empty."""

    addresses: tuple[str, ...] = ()
    etcd_endpoints: tuple[str, ...] = ()
    cluster: str = "default"

    @property
    def single(self) -> bool:
        """One daemon, no cluster."""
        return len(self.addresses) == 1

    def open(
        self, *, timeout_s: float = 5.0, token: str | None = None
    ) -> StoreClient | ClusterClient:
        """A client of this store (not yet connected: the first call connects). `token`: the
        bearer token of the caller's principal on daemons with auth on (None: the clients'
        default, $STRATA_STORE_TOKEN). The token is not part of the store string."""
        if self.single:
            return StoreClient(self.addresses[0], timeout_s=timeout_s, retries=1, token=token)
        if self.addresses:
            return ClusterClient(addresses=list(self.addresses), timeout_s=timeout_s, token=token)
        return ClusterClient(
            etcd_endpoints=list(self.etcd_endpoints),
            cluster=self.cluster,
            timeout_s=timeout_s,
            token=token,
        )

    def __str__(self) -> str:
        if self.addresses:
            return ",".join(self.addresses)
        return f"{ETCD_SCHEME}{','.join(self.etcd_endpoints)}/{self.cluster}"


def parse_store(text: str) -> StoreSpec | None:
    """The store `text` names; None for "" (no store). ValueError for a malformed string."""
    text = text.strip()
    if not text:
        return None
    if text.startswith(ETCD_SCHEME):
        rest = text[len(ETCD_SCHEME) :]
        hosts, _, cluster = rest.partition("/")
        endpoints = tuple(h.strip() for h in hosts.split(",") if h.strip())
        if not endpoints:
            raise ValueError(f"store {text!r}: no etcd endpoint after {ETCD_SCHEME}")
        for endpoint in endpoints:
            _check_address(endpoint, text)
        if "/" in cluster:
            raise ValueError(f"store {text!r}: the cluster name may not contain '/'")
        return StoreSpec(
            etcd_endpoints=tuple(f"http://{e}" for e in endpoints), cluster=cluster or "default"
        )
    addresses = tuple(a.strip() for a in text.split(",") if a.strip())
    for address in addresses:
        _check_address(address, text)
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"store {text!r} names a daemon twice")
    return StoreSpec(addresses=addresses)


def _check_address(address: str, text: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store {text!r}: {address!r} is not HOST:PORT")
