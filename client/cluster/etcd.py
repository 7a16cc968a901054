"""A small etcd v3 client over the JSON gRPC gateway (`POST /v3/...`), with urllib only.

Shared by the daemon (which registers itself, kvstore/cluster.py) and the cluster client (which
watches the member set): it imports nothing but the standard library and `client.contract.errors`, so
`kvstore` may use it as a shared definition (DESIGN §2). Keys and values travel base64-encoded;
int64 fields come back as JSON strings. Every call has a deadline; a failure of every endpoint
raises `EtcdUnavailable` (an `Unavailable`), so callers can keep their last known state.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from client.contract.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

JsonObject = dict[str, object]


class EtcdUnavailable(Unavailable):
    """No etcd endpoint answered (or one answered with an error) within the deadline."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class RangeResult:
    """The key-values of a range read and the store revision it was read at."""

    kvs: tuple[KeyValue, ...]
    revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change under a watched prefix. `kind` is "PUT" or "DELETE"."""

    kind: str
    kv: KeyValue


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of the range of keys starting with `prefix` (etcd's convention)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"  # every key


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: object) -> bytes:
    return base64.b64decode(str(value)) if value else b""


def _int(value: object) -> int:
    if value is None or value == "":
        return 0
    if isinstance(value, int | str):
        return int(value)
    raise EtcdUnavailable(f"etcd answered a non-integer: {value!r}")


def _kv(raw: object) -> KeyValue:
    if not isinstance(raw, dict):
        raise EtcdUnavailable(f"etcd answered a malformed key-value: {raw!r}")
    return KeyValue(
        key=_unb64(raw.get("key")),
        value=_unb64(raw.get("value")),
        mod_revision=_int(raw.get("mod_revision")),
        lease=_int(raw.get("lease")),
    )


def _normalise(endpoint: str) -> str:
    endpoint = endpoint.strip().rstrip("/")
    if not endpoint:
        raise InvalidArgument("empty etcd endpoint")
    return endpoint if "://" in endpoint else f"http://{endpoint}"


def parse_endpoints(text: str | Sequence[str]) -> tuple[str, ...]:
    """ "127.0.0.1:2379,http://h:2379" (or a list) -> ("http://127.0.0.1:2379", "http://h:2379")."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(_normalise(e) for e in items if e.strip())


class EtcdClient:
    """Blocking etcd v3 client. Thread-safe; holds no connection between calls.

    Each call tries the endpoints in turn, starting with the last one that answered, within one
    deadline of `timeout_s`.
    """

    def __init__(self, endpoints: str | Sequence[str], *, timeout_s: float = 2.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        if not self.endpoints:
            raise InvalidArgument("EtcdClient needs at least one endpoint")
        if timeout_s <= 0:
            raise InvalidArgument("timeout_s must be > 0")
        self.timeout_s = timeout_s
        self._preferred = 0
        self._lock = threading.Lock()

    # ---- calls -----------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Write `key` (attached to `lease` when non-zero); returns the new store revision."""
        body: JsonObject = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return self._revision(self._post("/v3/kv/put", body))

    def get_prefix(self, prefix: bytes) -> RangeResult:
        """Every key starting with `prefix`, with the revision of the read."""
        body: JsonObject = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        reply = self._post("/v3/kv/range", body)
        raw = reply.get("kvs") or []
        if not isinstance(raw, list):
            raise EtcdUnavailable("etcd answered a malformed range")
        return RangeResult(kvs=tuple(_kv(x) for x in raw), revision=self._revision(reply))

    def delete(self, key: bytes) -> int:
        """Delete `key`; returns how many keys went (0 or 1)."""
        return _int(self._post("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted"))

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease; returns (lease id, granted TTL in seconds)."""
        reply = self._post("/v3/lease/grant", {"TTL": str(ttl_s), "ID": "0"})
        lease, ttl = _int(reply.get("ID")), _int(reply.get("TTL"))
        if not lease or ttl <= 0:
            raise EtcdUnavailable(f"etcd refused a lease: {reply.get('error', reply)!r}")
        return lease, ttl

    def keepalive(self, lease: int) -> int:
        """Refresh `lease` once; returns its TTL, 0 when the lease no longer exists."""
        reply = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        result = reply.get("result", reply)
        if not isinstance(result, dict):
            raise EtcdUnavailable("etcd answered a malformed keepalive")
        return max(_int(result.get("TTL")), 0)

    def revoke(self, lease: int) -> None:
        """End `lease` now; the keys attached to it are deleted."""
        self._post("/v3/lease/revoke", {"ID": str(lease)})

    def watch_prefix(
        self, prefix: bytes, *, start_revision: int, idle_timeout_s: float
    ) -> Iterator[WatchEvent]:
        """Events under `prefix` from `start_revision` on, until `idle_timeout_s` passes without
        one (or the stream ends). A caller re-reads the range and watches again: each stream is
        bounded in time, and nothing between a read and its watch can be missed."""
        body: JsonObject = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        response = self._open("/v3/watch", body, idle_timeout_s)
        try:
            while True:
                try:
                    line = response.readline()
                except (TimeoutError, OSError, http.client.HTTPException):
                    return  # idle (or the stream broke): the caller re-reads and re-watches
                if not line:
                    return
                if not line.strip():
                    continue
                message = json.loads(line)
                result = message.get("result") if isinstance(message, dict) else None
                if not isinstance(result, dict):
                    raise EtcdUnavailable(f"etcd watch failed: {message!r}")
                if result.get("canceled"):
                    raise EtcdUnavailable(f"etcd cancelled the watch: {result!r}")
                for raw in cast(list[object], result.get("events") or []):
                    if isinstance(raw, dict):
                        kind = str(raw.get("type") or "PUT")
                        yield WatchEvent(kind=kind, kv=_kv(raw.get("kv")))
        finally:
            response.close()

    # ---- plumbing --------------------------------------------------------------------------

    @staticmethod
    def _revision(reply: JsonObject) -> int:
        header = reply.get("header")
        return _int(header.get("revision")) if isinstance(header, dict) else 0

    def _order(self) -> list[int]:
        with self._lock:
            first = self._preferred
        n = len(self.endpoints)
        return [(first + i) % n for i in range(n)]

    def _open(self, path: str, body: JsonObject, timeout_s: float) -> http.client.HTTPResponse:
        data = json.dumps(body).encode()
        errors: list[str] = []
        for i in self._order():
            url = self.endpoints[i] + path
            request = urllib.request.Request(
                url, data=data, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                response = urllib.request.urlopen(request, timeout=timeout_s)
            except urllib.error.HTTPError as exc:  # it answered: an error, not an outage
                detail = exc.read()[:300].decode(errors="replace")
                exc.close()
                raise EtcdUnavailable(f"etcd {path}: HTTP {exc.code}: {detail}") from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                errors.append(f"{url}: {exc}")
                continue
            with self._lock:
                self._preferred = i
            return cast(http.client.HTTPResponse, response)
        raise EtcdUnavailable("etcd unreachable: " + "; ".join(errors))

    def _post(self, path: str, body: JsonObject) -> JsonObject:
        response = self._open(path, body, self.timeout_s)
        try:
            raw = response.read()
        except (TimeoutError, OSError, http.client.HTTPException) as exc:
            raise EtcdUnavailable(f"etcd {path}: {exc}") from None
        finally:
            response.close()
        # a streaming endpoint (keepalive) answers one JSON object per line
        first = raw.split(b"\n", 1)[0] if raw.strip() else b"{}"
        try:
            reply = json.loads(first)
        except ValueError:
            raise EtcdUnavailable(f"etcd {path} answered non-JSON: {first[:200]!r}") from None
        if not isinstance(reply, dict):
            raise EtcdUnavailable(f"etcd {path} answered {reply!r}")
        if "error" in reply and "result" not in reply:
            raise EtcdUnavailable(f"etcd {path}: {reply['error']!r}")
        return reply
