"""The daemon's TLS material (config `[tls]`): gRPC server credentials and the SSL context of the
TCP data path, both built from the same PEM files once at start-up.

Without `tls.cert` the daemon serves plaintext (as before). With it, gRPC is served over TLS
only (one port cannot speak both), the TCP data path speaks TLS (and plaintext too unless
`tls.require`), and with `tls.client_ca` every client must present a certificate that CA signed.
`tls.require` also keeps the UCX data path off: UCX here cannot encrypt its traffic.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.config import TlsConfig
from kvstore.errors import InvalidArgument

# The first byte of a TLS connection (a handshake record); a plaintext data-path connection
# starts with the framing's magic (client/transports/ucx_protocol.py), whose first byte is 0x55.
TLS_HANDSHAKE_BYTE = 0x16


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The PEM material of `[tls]`, read once. `require`: refuse plaintext."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes  # b"" = client certificates not asked for
    require: bool
    cert_path: str
    key_path: str
    client_ca_path: str

    @classmethod
    def from_config(cls, tls: TlsConfig) -> ServerTls | None:
        """None when TLS is off; InvalidArgument when a file cannot be read or is no PEM."""
        if not tls.enabled:
            return None
        return cls(
            cert_chain=_read_pem("tls.cert", tls.cert),
            private_key=_read_pem("tls.key", tls.key),
            client_ca=_read_pem("tls.client_ca", tls.client_ca) if tls.client_ca else b"",
            require=tls.require,
            cert_path=tls.cert,
            key_path=tls.key,
            client_ca_path=tls.client_ca,
        )

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca or None,
            require_client_auth=bool(self.client_ca),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The server-side context of the TCP data path (TLS 1.2 or later). InvalidArgument
        when the key does not match the certificate."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_path, self.key_path)
            if self.client_ca_path:
                ctx.load_verify_locations(cafile=self.client_ca_path)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (ssl.SSLError, OSError) as exc:
            raise InvalidArgument(
                f"tls: cannot load {self.cert_path} / {self.key_path}: {exc}"
            ) from None
        return ctx

    def describe(self) -> str:
        parts = ["tls"]
        if self.client_ca:
            parts.append("client certificates required")
        parts.append("plaintext refused" if self.require else "plaintext data path accepted")
        return ", ".join(parts)


def _read_pem(what: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{what}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"{what}: {path} is not a PEM file")
    return data
