"""The SDK's TLS options: how a client checks the daemon's certificate (and shows its own).

`TlsOptions` is given to StoreClient / AsyncStoreClient as `tls=`; `tls=None` takes the
environment's defaults (`STRATA_STORE_TLS_CA`, `STRATA_STORE_TLS_CERT`, `STRATA_STORE_TLS_KEY`,
`STRATA_STORE_TLS_SERVER_NAME`; none set = plaintext), `tls=False` is plaintext whatever the
environment says. A client with TLS never falls back to plaintext: gRPC goes over a secure
channel, the TCP data path over TLS, and the UCX data path (which cannot be encrypted here) is
never used by it. The same-host lane and shared memory stay as they are: they never leave the
host, and the daemon decides who may use them (docs/security.md).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from client.contract.errors import InvalidArgument

ENV_CA = "STRATA_STORE_TLS_CA"
ENV_CERT = "STRATA_STORE_TLS_CERT"
ENV_KEY = "STRATA_STORE_TLS_KEY"
ENV_SERVER_NAME = "STRATA_STORE_TLS_SERVER_NAME"


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """`ca_file`: PEM CA bundle the daemon's certificate must chain to ("" = the system's).
    `cert_file` + `key_file`: this client's certificate, for a daemon that asks for one.
    `server_name`: the name to check the certificate against ("" = the host dialled)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("TLS: cert_file and key_file go together")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsOptions | None:
        """The environment's options, or None when it sets none."""
        env = os.environ if env is None else env
        ca, cert, key = env.get(ENV_CA, ""), env.get(ENV_CERT, ""), env.get(ENV_KEY, "")
        name = env.get(ENV_SERVER_NAME, "")
        if not (ca or cert or key):
            return None
        return cls(ca_file=ca, cert_file=cert, key_file=key, server_name=name)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC credentials; InvalidArgument when a file cannot be read."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )

    def channel_options(self) -> list[tuple[str, int | str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """The client-side context of the TCP data path: the daemon's certificate is verified
        (chain and name), TLS 1.2 or later. InvalidArgument when a file cannot be loaded."""
        ctx = ssl.create_default_context(cafile=self.ca_file or None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert_file:
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as exc:
                raise InvalidArgument(f"TLS: cannot load {self.cert_file}: {exc}") from None
        return ctx


def resolve_tls(tls: TlsOptions | bool | None) -> TlsOptions | None:
    """A client's `tls=` argument: options as given, True = system CAs, False = plaintext,
    None = the environment's (plaintext when it sets none)."""
    if tls is None:
        return TlsOptions.from_env()
    if tls is True:
        return TlsOptions()
    if tls is False:
        return None
    return tls


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"TLS: cannot read {path}: {exc.strerror}") from None


def open_channel(
    address: str, options: Sequence[tuple[str, int | str]], tls: TlsOptions | None
) -> grpc.Channel:
    """A blocking gRPC channel to `address`: over TLS when `tls` is set, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


def open_aio_channel(
    address: str, options: Sequence[tuple[str, int | str]], tls: TlsOptions | None
) -> grpc.aio.Channel:
    """An asyncio gRPC channel to `address`: over TLS when `tls` is set, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )
