"""How the command line's client commands (`health`, `generate --server`) reach a server.

They speak to `serve`'s client port as any gRPC client would: plaintext or TLS (trusting
a given CA, or the system's), with a client certificate for mutual TLS, and an API key
as `authorization: Bearer <key>` metadata on every call. Kept apart from the router so
that `health`, which a container runs every few seconds, imports grpc and nothing heavier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import grpc

from text_generation_server.settings.serve_flags import check_api_key


@dataclass(frozen=True)
class ClientOptions:
    """What a client needs to be let in: an API key and/or TLS settings."""

    api_key: str | None = None
    tls: bool = False  # TLS even with no file below: the system's trusted CAs check the server
    ca_path: str | None = None  # CA certificates that sign the server's certificate
    cert_path: str | None = None  # client certificate chain, for mutual TLS
    key_path: str | None = None  # its private key
    server_name: str | None = None  # the name the server's certificate must carry, if not the host dialled

    def __post_init__(self) -> None:
        if (self.cert_path is None) != (self.key_path is None):
            raise ValueError("--tls-client-cert-path and --tls-client-key-path go together")
        if self.api_key is not None:
            check_api_key(self.api_key, "--api-key")

    @property
    def uses_tls(self) -> bool:
        return self.tls or any(v is not None for v in (self.ca_path, self.cert_path, self.key_path, self.server_name))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Per-call metadata: the key, when there is one. (Call credentials would refuse a
        plaintext channel, and a key on a loopback port without TLS is a valid setup.)"""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_path, "--tls-ca-path"),
            private_key=_read(self.key_path, "--tls-client-key-path"),
            certificate_chain=_read(self.cert_path, "--tls-client-cert-path"),
        )

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to `target` (host:port) with gRPC channel `options`; ValueError naming the
        flag for an unreadable file."""
        if not self.uses_tls:
            return grpc.insecure_channel(target, options=list(options))
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(target, self.credentials(), options=list(options))


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def client_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key a client sends: --api-key (the first, when API_KEY lists several as serve takes
    them), else the first key of --api-key-file."""
    if api_key is not None:
        keys = [k.strip() for k in api_key.split(",") if k.strip()]
        if keys:
            return keys[0]
    if api_key_file is not None:
        text = (_read(api_key_file, "--api-key-file") or b"").decode(errors="replace")
        for line in text.splitlines():
            if line.strip() and not line.strip().startswith("#"):
                return line.strip()
        raise ValueError(f"--api-key-file {api_key_file}: holds no key")
    return None


def target(hostname: str, port: int) -> str:
    """host:port, with an IPv6 address in brackets."""
    host = f"[{hostname}]" if ":" in hostname and not hostname.startswith("[") else hostname
    return f"{host}:{port}"
