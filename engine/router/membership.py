"""Workers registered in etcd: the leased key a worker writes, and the router's watch of them.

A worker given `--etcd` registers under `/strata/<cluster>/workers/<address>` with a lease it
keeps alive from a thread (`WorkerRegistration`, the daemon's own way: client.cluster.membership); the
value is a small JSON record (address, role, model). A clean stop revokes the lease, a crash
lets it run out, so the key set is the set of live workers. The router's `WorkerWatch` reads the
prefix every `period_s` and makes the registry's etcd-sourced workers that set (the registry's
own polling still decides who is alive right now). An unreachable etcd keeps the last set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

from client import EtcdClient, EtcdUnavailable

log = logging.getLogger(__name__)


def workers_prefix(cluster: str) -> bytes:
    if not cluster or "/" in cluster:
        raise ValueError(f"bad cluster name {cluster!r} (non-empty, no '/')")
    return f"/strata/{cluster}/workers/".encode()


def encode_record(address: str, role: str, model: str) -> bytes:
    return json.dumps({"address": address, "role": role, "model": model}, sort_keys=True).encode()


def decode_address(value: bytes) -> str | None:
    try:
        raw = json.loads(value)
        address = raw["address"]
    except (ValueError, TypeError, KeyError):
        return None
    return address if isinstance(address, str) and address else None


class WorkerRegistration:
    """A worker's leased key in etcd, refreshed every third of `ttl_s` from a thread."""

    def __init__(
        self, endpoints: str, cluster: str, address: str, record: bytes, *, ttl_s: int = 5
    ) -> None:
        self.etcd = EtcdClient(endpoints, timeout_s=2.0)
        self.key = workers_prefix(cluster) + address.encode()
        self.record = record
        self.ttl_s = max(2, ttl_s)
        self._lease = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-register", daemon=True)

    def start(self) -> None:
        self._register()
        self._thread.start()

    def _register(self) -> None:
        try:
            lease, _ = self.etcd.grant(self.ttl_s)
            self.etcd.put(self.key, self.record, lease=lease)
            self._lease = lease
            log.info("registered in etcd as %s", self.key.decode())
        except EtcdUnavailable as exc:
            self._lease = 0
            log.warning("etcd registration failed (%s); retrying", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self._lease or self.etcd.keepalive(self._lease) == 0:
                    self._register()
            except EtcdUnavailable as exc:
                log.warning("etcd keepalive failed (%s)", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self._lease:
            try:
                self.etcd.revoke(self._lease)
            except EtcdUnavailable:
                log.warning("could not deregister from etcd; the lease will run out")
            self._lease = 0


class WorkerWatch:
    """Keeps the registry's etcd-sourced workers equal to the registered set."""

    def __init__(self, endpoints: str, cluster: str, registry: object, *, period_s: float = 0.5):
        self.etcd = EtcdClient(endpoints, timeout_s=1.0)
        self.prefix = workers_prefix(cluster)
        self.registry = registry
        self.period_s = period_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="strata-worker-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            found = await asyncio.to_thread(self.etcd.get_prefix, self.prefix)
        except EtcdUnavailable as exc:
            log.warning("etcd unreachable (%s); keeping the last known workers", exc)
            return
        addresses = [a for kv in found.kvs if (a := decode_address(kv.value))]
        for gone in self.registry.set_dynamic(addresses):  # type: ignore[attr-defined]
            await self.registry.remove(gone)  # type: ignore[attr-defined]
