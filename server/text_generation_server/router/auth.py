"""API keys on the client gRPC port: `authorization: Bearer <key>` metadata, as TGI's HTTP API takes it.

Keys come from --api-key / API_KEY (TGI's name; several comma-separated, for rotation)
and from --api-key-file (one key per line, so a key need not sit in a process listing or
an environment). Only SHA-256 digests of the keys are kept, and a presented key is
compared with every one of them in constant time (hmac.compare_digest over equal-length
digests), so neither the time taken nor the log says which key came close.

Health and reflection stay open unless --api-key-protects-health: orchestrator probes
and `grpcurl list` carry no key. Refused calls get UNAUTHENTICATED with the same
message whatever was wrong, are counted in tgs_request_unauthenticated{reason}, and are
logged with the method and peer, never the key (at most one line per second).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from typing import Iterable, Sequence

import grpc
from loguru import logger

from text_generation_server.router.metrics import Metrics
from text_generation_server.router.health import HEALTH_SERVICE_NAME
from text_generation_server.router.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME
from text_generation_server.settings.serve_args import ServeArgs
from text_generation_server.settings.serve_flags import check_api_key

# Services that answer without a key unless told otherwise: what probes and stock tools call.
OPEN_SERVICES = (HEALTH_SERVICE_NAME, V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME)
METADATA_KEY = "authorization"
REFUSAL = "this server requires an API key: send metadata 'authorization: Bearer <key>'"
LOG_INTERVAL_S = 1.0


class ApiKeyError(ValueError):
    """A key or key file that cannot be used; the message names where it came from, never the key."""


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped. ApiKeyError for a
    missing, unreadable or keyless file: a server that meant to check keys must not start open."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ApiKeyError(f"--api-key-file {path}: cannot read it ({reason})") from None
    keys = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if text and not text.startswith("#"):
            try:
                keys.append(check_api_key(text, f"--api-key-file {path} line {number}"))
            except ValueError as exc:
                raise ApiKeyError(str(exc)) from None
    if not keys:
        raise ApiKeyError(f"--api-key-file {path}: holds no key (one per line; '#' starts a comment)")
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _stamp(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class ApiKeys:
    """The keys a call may present: the fixed ones plus the key file's, re-read when it changes."""

    def __init__(self, keys: Sequence[str] = (), key_file: str | None = None):
        self._fixed = [_digest(k) for k in keys]
        self.key_file = key_file
        self._file: list[bytes] = []
        self._stamp = None
        if key_file is not None:
            self._stamp = _stamp(key_file)
            self._file = [_digest(k) for k in read_key_file(key_file)]
        if not self._fixed and not self._file:
            raise ApiKeyError("no API key given")

    def __len__(self) -> int:
        return len(self._fixed) + len(self._file)

    def refresh(self, force: bool = False) -> bool:
        """Re-reads the key file when it changed (always with `force`); True when its keys changed.
        A file that has become unreadable or empty keeps the keys read before, with an error
        logged: a rotation half done must not lock every client out, nor open the port."""
        if self.key_file is None:
            return False
        stamp = _stamp(self.key_file)
        if stamp == self._stamp and not force:
            return False
        self._stamp = stamp
        try:
            digests = [_digest(k) for k in read_key_file(self.key_file)]
        except ApiKeyError as exc:
            logger.error("API key file changed but cannot be used; keeping its previous {} key(s): {}",
                         len(self._file), exc)
            return False
        if digests == self._file:
            return False
        self._file = digests
        logger.info("API key file re-read: {} key(s) from {}", len(digests), self.key_file)
        return True

    def matches(self, presented: str) -> bool:
        """Constant time in the key and over every key (no early exit on a match)."""
        digest = _digest(presented)
        found = False
        for key in self._fixed + self._file:
            found |= hmac.compare_digest(digest, key)
        return found

    def verify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when the call's metadata carries a valid key; else the reason ("missing", "invalid")."""
        self.refresh()
        values = [v for k, v in metadata or () if k.lower() == METADATA_KEY]
        if not values:
            return "missing"
        value = values[0].decode(errors="replace") if isinstance(values[0], bytes) else values[0]
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "invalid"
        return None if self.matches(token.strip()) else "invalid"


def api_keys(args: ServeArgs) -> ApiKeys | None:
    """The keys `serve` was given (the key file read now); None when calls need none."""
    if not args.requires_api_key:
        return None
    return ApiKeys(args.api_keys, args.api_key_file)


class _RefusalLog:
    """One warning per LOG_INTERVAL_S at most, with the number of refusals it stands for, so a
    client retrying with a wrong key (or a scanner) cannot flood the log."""

    def __init__(self) -> None:
        self._last = 0.0
        self._quiet = 0

    def __call__(self, method: str, peer: str, reason: str) -> None:
        now = time.monotonic()
        if now - self._last < LOG_INTERVAL_S:
            self._quiet += 1
            return
        more = f" ({self._quiet} more refused since the last report)" if self._quiet else ""
        logger.warning("refused {} from {}: {} API key{}", method, peer, reason, more)
        self._last, self._quiet = now, 0


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid key, except OPEN_SERVICES unless `protect_health`."""

    def __init__(self, keys: ApiKeys, metrics: Metrics, protect_health: bool = False):
        self.keys = keys
        self.metrics = metrics
        self.open_prefixes = () if protect_health else tuple(f"/{name}/" for name in OPEN_SERVICES)
        self._log = _RefusalLog()

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self.open_prefixes):
            return await continuation(handler_call_details)
        reason = self.keys.verify(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if reason is None:
            return handler
        self.metrics.request_unauthenticated.labels(reason=reason).inc()
        return _refusal(handler, method, reason, self._log)


def _refusal(handler, method: str, reason: str, log: _RefusalLog):
    """A handler of the same kind as `handler` that aborts UNAUTHENTICATED without reading the
    request. An unknown method is refused the same way: a caller without a key learns nothing
    about which methods exist."""

    async def abort(context) -> None:
        log(method, context.peer(), reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def unary(request, context):
        await abort(context)

    async def stream(request, context):
        await abort(context)
        yield  # pragma: no cover - abort raises; this makes the function an async generator

    request_streaming = handler is None or handler.request_streaming
    response_streaming = handler is None or handler.response_streaming
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)
