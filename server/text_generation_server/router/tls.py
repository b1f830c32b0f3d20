"""TLS on the client gRPC port: certificate files checked at startup and re-read while serving.

grpcio asks a certificate-configuration fetcher before every TLS handshake
(grpc.dynamic_ssl_server_credentials). CertificateStore is that fetcher: it re-reads the
files when their stat changes (or when SIGHUP asks for it) and hands gRPC the new pair;
connections already open keep the session they negotiated, so streams in flight are not
dropped and only new connections see the new certificate. A replacement that does not
load (half written, key of another certificate) is logged and the current pair stays in
use, so a botched rotation never takes the port down.

The files are checked with the standard library's ssl module before gRPC sees them:
gRPC only reports a failed handshake per connection, long after startup, and never
names the file at fault.
"""

from __future__ import annotations

import hashlib
import os
import ssl
import threading
from dataclasses import dataclass

import grpc
from loguru import logger

from text_generation_server.settings.serve_args import ServeArgs


_PEM_BEGIN, _PEM_END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file and the flag."""


@dataclass(frozen=True)
class TlsFiles:
    """Where the server's certificate chain, its private key and (for mutual TLS) the client CA live."""

    cert_path: str
    key_path: str
    client_ca_path: str | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.cert_path, self.key_path) + ((self.client_ca_path,) if self.client_ca_path else ())


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of one consistent set of files, as gRPC takes them."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the leaf certificate (DER), as `openssl x509 -fingerprint -sha256` prints it:
        what an operator compares to tell which certificate is being served."""
        text = self.cert_chain.decode("ascii", errors="replace")
        start = text.index(_PEM_BEGIN)
        end = text.index(_PEM_END, start) + len(_PEM_END)
        der = ssl.PEM_cert_to_DER_cert(text[start:end])  # the leaf: the first of a chain
        return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.private_key, self.cert_chain)],
                                                         root_certificates=self.client_ca)


def tls_files(args: ServeArgs) -> TlsFiles | None:
    """The TLS files `serve` was given; None for plaintext (args.validate() checked the pairing)."""
    if args.tls_cert_path is None or args.tls_key_path is None:
        return None
    return TlsFiles(args.tls_cert_path, args.tls_key_path, args.tls_client_ca_path)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if not data.strip():
        raise TlsError(f"{flag} {path}: the file is empty")
    return data


def _check_certificates(path: str, flag: str, data: bytes) -> None:
    """At least one PEM certificate, all of them parseable (load_verify_locations parses each one)."""
    if _PEM_BEGIN.encode() not in data:
        raise TlsError(f"{flag} {path}: no PEM certificate in it (expected '-----BEGIN CERTIFICATE-----')")
    try:
        ssl.create_default_context(cadata=data.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise TlsError(f"{flag} {path}: not a valid PEM certificate ({exc})") from None


def _no_password() -> bytes:
    raise TlsError("encrypted")  # OpenSSL would otherwise prompt on the terminal


def load_tls(files: TlsFiles) -> TlsMaterial:
    """Reads and checks the files; TlsError naming the file for a missing, empty, malformed,
    encrypted or mismatched one. This is what gRPC would fail on, checked up front."""
    cert = _read(files.cert_path, "--tls-cert-path")
    key = _read(files.key_path, "--tls-key-path")
    _check_certificates(files.cert_path, "--tls-cert-path", cert)
    if b"PRIVATE KEY-----" not in key:
        raise TlsError(f"--tls-key-path {files.key_path}: no PEM private key in it "
                       "(expected '-----BEGIN PRIVATE KEY-----' or '-----BEGIN EC/RSA PRIVATE KEY-----')")
    if b"ENCRYPTED" in key:
        raise TlsError(f"--tls-key-path {files.key_path}: the key is encrypted; gRPC needs an unencrypted key "
                       "(keep it readable by the server's user only)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(files.cert_path, files.key_path, password=_no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise TlsError(f"--tls-key-path {files.key_path} is not the key of the certificate in "
                           f"--tls-cert-path {files.cert_path}") from None
        raise TlsError(f"--tls-key-path {files.key_path}: the key does not load with --tls-cert-path "
                       f"{files.cert_path} ({exc})") from None
    except (TlsError, OSError) as exc:
        raise TlsError(f"--tls-key-path {files.key_path}: the key does not load ({exc})") from None
    client_ca = None
    if files.client_ca_path is not None:
        client_ca = _read(files.client_ca_path, "--tls-client-ca-path")
        _check_certificates(files.client_ca_path, "--tls-client-ca-path", client_ca)
    return TlsMaterial(cert, key, client_ca)


def _stamp(paths: tuple[str, ...]) -> tuple:
    """What changes when a file is rewritten or swapped (Kubernetes secrets swap a symlink)."""
    stamps: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


class CertificateStore:
    """The certificate gRPC serves, re-read when its files change or on request (SIGHUP)."""

    def __init__(self, files: TlsFiles):
        self.files = files
        self._lock = threading.Lock()
        self._stamp = _stamp(files.paths)
        self.material = load_tls(files)  # TlsError: startup stops here
        self._pending: TlsMaterial | None = None

    @property
    def mutual(self) -> bool:
        return self.files.client_ca_path is not None

    def refresh(self, force: bool = False) -> bool:
        """Re-reads the files if their stat changed (always with `force`); True when a new
        certificate will be served from the next handshake. Errors are logged, never raised."""
        with self._lock:
            stamp = _stamp(self.files.paths)
            if stamp == self._stamp and not force:
                return False
            # Remember this state even if it fails to load: a half-written pair is retried
            # when the files change again, not logged on every handshake meanwhile.
            self._stamp = stamp
            try:
                material = load_tls(self.files)
            except TlsError as exc:
                logger.error("TLS files changed but cannot be used; still serving certificate {}: {}",
                             self.material.fingerprint, exc)
                return False
            if material == self.material:
                if force:
                    logger.info("TLS files re-read: unchanged (certificate {})", material.fingerprint)
                return False
            self.material = self._pending = material
        logger.info("TLS files re-read: serving certificate {} to new connections", material.fingerprint)
        return True

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate-configuration fetcher: None keeps the current configuration.

        It runs on a gRPC core thread before each handshake; an exception there would
        only fail that handshake with no useful message, so any is logged and the
        current certificate stays.
        """
        try:
            self.refresh()
            with self._lock:
                pending, self._pending = self._pending, None
            return None if pending is None else pending.configuration()
        except Exception:  # noqa: BLE001 - see the docstring: never fail a handshake from here
            logger.exception("re-reading the TLS files failed; the current certificate stays")
            return None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.material.configuration(), self.fetch, require_client_authentication=self.mutual)
