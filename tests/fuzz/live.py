"""A live daemon to fuzz: a `strata serve` child process on loopback, a legitimate tenant's pages
stored in it before the first case, and the checks to run after the last.

    with LiveDaemon(tmp_path) as live:
        ... send fuzzed calls to live.address (live.world says what the fuzzer may know) ...
        live.finish()   # raises AssertionError naming what broke

`finish` checks that the daemon process is still running and answers, that its output holds
no traceback, that every page it serves is well-formed (rpc_calls.audit over every key its event
stream reported stored), and that the legitimate tenant's pages are served byte-identical
through the SDK. The legitimate tenant's scope and keys are never handed to the fuzzer.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import grpc
from fuzz.rpc_calls import SERVICE, Watcher, audit, healthy, private_channel
from fuzz.rpc_strategies import FUZZ_SCOPE, OTHER_SCOPE, World

from client import KVLayout, Scope, StoreClient, build_pages
from kvstore.auth import hash_token
from kvstore_pb import store_pb2 as pb
from loadtests.daemon import DaemonProcess

MAX_KEYS = 64
CONFIG = f"""
[server]
ucx = false
tcp = true
workers = 8

[limits]
max_keys_per_call = {MAX_KEYS}
chunk_bytes = 65536
max_message_bytes = 327680
lease_ttl_ms = 2000
max_reserve_lease_ms = 2000
"""
# With auth on: the fuzzer's principal holds namespace "fuzz" (and may delete there), the
# legitimate tenant "legit", the operator (the audit's reader) everything.
TOKENS = {
    "fuzzer": "fuzz-token-0123456789abcdef",
    "legit": "legit-token-0123456789abcdef",
    "ops": "ops-token-0123456789abcdef",
}
TOKENS_TOML = "".join(
    f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{hash_token(TOKENS[name])}"\n'
    f"read = {rights}\nwrite = {rights}\ndelete = true\noperator = {str(name == 'ops').lower()}\n"
    "trusted_local = true\n\n"  # the fuzzer too: it reaches Reserve and Acquire
    for name, rights in (("fuzzer", '["fuzz"]'), ("legit", '["legit"]'), ("ops", '["*"]'))
)


def bearer(who: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `who`'s token (None: no token; an unknown name: a wrong one)."""
    if who is None:
        return ()
    return (("authorization", f"Bearer {TOKENS.get(who, who + '-not-a-token')}"),)


LEGIT_SCOPE = Scope(
    model_id="legit/model",
    weights_revision="w",
    tokenizer_fingerprint="t",
    kv_dtype="float16",
    layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=16),
    namespace="legit",
)


def _pages(scope: Scope, count: int, seed: int) -> list:  # type: ignore[type-arg]
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(count * scope.layout.page_tokens)]
    return build_pages(
        scope, tokens, [rng.randbytes(scope.page_payload_bytes) for _ in range(count)]
    )


class LiveDaemon:
    """`auth`: the daemon checks principals (TOKENS); else it runs open on loopback."""

    def __init__(
        self, folder: Path, *, dram: str = "32MiB", ssd: str = "64MiB", auth: bool = True
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "fuzz.toml"
        text = CONFIG
        self.auth = auth
        if auth:
            tokens = folder / "tokens.toml"
            tokens.write_text(TOKENS_TOML)
            tokens.chmod(0o600)
            text += f'\n[auth]\ntokens_file = "{tokens}"\n'
        config.write_text(text)
        self.process = DaemonProcess(
            folder / "data", dram=dram, ssd=ssd, extra=["--config", str(config)]
        )
        self.channel: grpc.Channel | None = None
        self.watcher: Watcher | None = None
        self.legit: list = []  # type: ignore[type-arg]
        self.world = World(FUZZ_SCOPE, OTHER_SCOPE, (), MAX_KEYS)
        self._clients: list[StoreClient] = []

    @property
    def address(self) -> str:
        return self.process.address

    def metadata(self, who: str | None) -> tuple[tuple[str, str], ...]:
        return bearer(who) if self.auth else ()

    def node_info(self) -> pb.NodeInfoResponse:
        assert self.channel is not None
        raw = self.channel.unary_unary(SERVICE + "NodeInfo")(
            b"", timeout=10, metadata=self.metadata("ops") or None
        )
        return pb.NodeInfoResponse.FromString(raw)

    def _client(self, who: str, *, shared_memory: bool) -> StoreClient:
        token = TOKENS[who] if self.auth else None
        client = StoreClient(self.address, shared_memory=shared_memory, token=token)
        client.connect()
        self._clients.append(client)
        return client

    def start(self) -> LiveDaemon:
        """Start the daemon and store the first pages; on any failure the daemon is stopped."""
        self.process.start()
        try:
            return self._populate()
        except BaseException:
            self.stop()
            raise

    def _populate(self) -> LiveDaemon:
        self.channel = grpc.insecure_channel(self.address)
        self.watcher = Watcher(self.channel, self.metadata("ops")).start()
        shm = self._client("legit", shared_memory=True)
        rpc = self._client("legit", shared_memory=False)
        fuzzer = self._client("fuzzer", shared_memory=False)
        self.legit = _pages(LEGIT_SCOPE, 8, seed=1)
        assert shm.put(LEGIT_SCOPE, self.legit[:4]).stored == 4
        assert rpc.put(LEGIT_SCOPE, self.legit[4:]).stored == 4
        known = _pages(FUZZ_SCOPE, 6, seed=2)
        assert fuzzer.put(FUZZ_SCOPE, known).stored == 6
        keys = [p.header.key for p in self.legit + known]
        assert self.watcher.wait_for(keys), "the event stream did not report the first puts"
        self.world = World(FUZZ_SCOPE, OTHER_SCOPE, tuple(p.header.key for p in known), MAX_KEYS)
        return self

    def finish(self) -> None:
        """The end-of-run properties (see the module docstring)."""
        assert self.process.proc is not None and self.process.proc.poll() is None, (
            "the daemon died:\n" + "\n".join(self.process.output[-40:])
        )
        assert self.channel is not None and self.watcher is not None
        ops = self.metadata("ops")
        assert healthy(self.channel, 10.0, ops) is None
        assert not self.watcher.error, self.watcher.error
        scopes = {**self.world.scopes, LEGIT_SCOPE.digest: LEGIT_SCOPE}
        with private_channel(self.address) as channel:
            report = audit(channel, self.watcher.live(), scopes, metadata=ops)
        assert not report.bad, report.bad[:10]
        assert report.served >= len(self.legit)
        print(f"audit: {report.served} pages served, all well-formed; {report.missing} misses")
        for client in self._clients[:2]:  # the shared-memory and the gRPC client
            into = [bytearray(LEGIT_SCOPE.page_payload_bytes) for _ in self.legit]
            result = client.get(
                LEGIT_SCOPE,
                [p.header.key for p in self.legit],
                into,
                tokens=[p.header.tokens for p in self.legit],
            )
            got = [
                bytes(b) if h is not None else None
                for h, b in zip(result.headers, into, strict=True)
            ]
            assert got == [bytes(p.payload) for p in self.legit], "the legitimate pages changed"
        tracebacks = [n for n, line in enumerate(self.process.output) if "Traceback" in line]
        assert not tracebacks, "\n".join(self.process.output[tracebacks[0] : tracebacks[0] + 40])

    def stop(self) -> None:
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        if self.watcher is not None:
            self.watcher.stop()
        if self.channel is not None:
            self.channel.close()
        self.process.stop()

    def __enter__(self) -> LiveDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
