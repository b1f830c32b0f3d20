"""The HTTP server of `serve --http-port`: Starlette's app on uvicorn, inside the router's event
loop, over the same core (router/service.py) as the gRPC API.

Behind the same door as gRPC: API keys as `Authorization: Bearer KEY` (the same key set, the
same tgs_request_unauthenticated metric; /health stays open for probes unless
--api-key-protects-health), TLS from --tls-cert-path/--tls-key-path (mutual with
--tls-client-ca-path), a rotated certificate served to new connections within seconds. CORS as
TGI's --cors-allow-origin sets it. Errors are shaped per API: OpenAI's under /v1/, TGI's
elsewhere. uvicorn runs embedded: the launcher owns the process's signals, so uvicorn installs
no handlers of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from typing import Iterator

import uvicorn
from loguru import logger
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from text_generation_server.router.auth import ApiKeys, _RefusalLog
from text_generation_server.router.http.core import HttpContext
from text_generation_server.router.http.errors import HttpError, openai_body, tgi_status_and_body
from text_generation_server.router.http.openai_api import OpenAIApi
from text_generation_server.router.http.tgi_api import TgiApi
from text_generation_server.router.metrics import Metrics
from text_generation_server.router.tls import CertificateStore, TlsMaterial

OPEN_PATHS = ("/health",)  # probes need no key unless --api-key-protects-health
TLS_CHECK_INTERVAL_S = 5.0


def error_response(request_path: str, error: HttpError) -> JSONResponse:
    """OpenAI's shape under /v1/, TGI's elsewhere."""
    if request_path.startswith("/v1/") or request_path == "/v1":
        return JSONResponse(openai_body(error), status_code=error.status)
    status, body = tgi_status_and_body(error)
    return JSONResponse(body, status_code=status)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HttpError)
    return error_response(request.url.path, exc)


async def _starlette_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own answers (no such path 404, wrong method 405) in the API's shape."""
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    message = {404: f"no such path: {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(request.url.path, HttpError(exc.status_code, message, kind))


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client closed the connection while its body was read: nothing was queued, no one listens."""
    return Response(status_code=499)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug of ours: logged with its traceback; the client gets a 500 that says so."""
    logger.opt(exception=exc).error("HTTP {} {} failed", request.method, request.url.path)
    return error_response(request.url.path, HttpError(500, f"internal error: {type(exc).__name__}", "server_error"))


class ApiKeyMiddleware:
    """Refuses a request without a valid `Authorization: Bearer KEY` (401, in the API's shape)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics: Metrics, protect_health: bool):
        self.app = app
        self.keys = keys
        self.metrics = metrics
        self.open_paths = () if protect_health else OPEN_PATHS
        self._log = _RefusalLog()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin1"), v.decode("latin1")) for k, v in scope["headers"]]
        reason = self.keys.verify(headers)
        if reason is None:
            await self.app(scope, receive, send)
            return
        self.metrics.request_unauthenticated.labels(reason=reason).inc()
        client = scope.get("client") or ("?", 0)
        self._log(f"HTTP {scope['path']}", f"{client[0]}:{client[1]}", reason)
        response = error_response(scope["path"], HttpError(
            401, f"{reason} API key: send 'Authorization: Bearer KEY'", "authentication_error",
            code="invalid_api_key"))
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def build_app(ctx: HttpContext, keys: ApiKeys | None, metrics: Metrics, *, protect_health: bool = False,
              cors_allow_origin: list[str] | None = None) -> Starlette:
    middleware = []
    if cors_allow_origin:  # outermost: a browser's preflight carries no key
        middleware.append(Middleware(CORSMiddleware, allow_origins=cors_allow_origin,
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]))
    if keys is not None:
        middleware.append(Middleware(ApiKeyMiddleware, keys=keys, metrics=metrics, protect_health=protect_health))
    return Starlette(
        routes=OpenAIApi(ctx).routes() + TgiApi(ctx).routes(),
        middleware=middleware,
        exception_handlers={HttpError: _http_error, HTTPException: _starlette_error, ClientDisconnect: _client_gone,
                            Exception: _server_error},
    )


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the launcher's SIGTERM drains the whole router."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn's name for the same
        pass


class TlsContext:
    """The SSL context of the HTTP port, reloaded from the files when the certificate store (the
    same one gRPC serves from) has a new certificate; new connections get it."""

    def __init__(self, store: CertificateStore):
        self.store = store
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.set_alpn_protocols(["http/1.1"])
        self._material: TlsMaterial | None = None
        self.reload()
        files = store.files
        if files.client_ca_path:
            self.context.load_verify_locations(cafile=files.client_ca_path)
            self.context.verify_mode = ssl.CERT_REQUIRED

    def reload(self) -> None:
        material = self.store.material
        if material is self._material:
            return
        self.context.load_cert_chain(self.store.files.cert_path, self.store.files.key_path)
        self._material = material

    async def follow(self) -> None:
        while True:
            await asyncio.sleep(TLS_CHECK_INTERVAL_S)
            try:
                await asyncio.to_thread(self.store.refresh)
                self.reload()
            except (OSError, ssl.SSLError) as exc:  # a half-written pair: the current one stays
                logger.warning("HTTP TLS reload failed; the current certificate stays: {}", exc)


class HttpServer:
    """Listens at once (a port in use fails startup, naming it); serves until stop()."""

    def __init__(self, app: Starlette, host: str, port: int, tls: CertificateStore | None):
        self.tls = TlsContext(tls) if tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host.strip("[]"), port))
        except OSError as exc:
            self.socket.close()
            raise OSError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}") from None
        self.socket.listen(2048)
        self.socket.setblocking(False)
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", server_header=False,
                                timeout_graceful_shutdown=2, ws="none")
        config.load()
        config.ssl = self.tls.context if self.tls is not None else None
        self.server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None
        self._tls_task: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    async def start(self) -> None:
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]), name="http-server")
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        if self.tls is not None:
            self._tls_task = asyncio.create_task(self.tls.follow(), name="http-tls-reload")

    async def stop(self) -> None:
        if self._tls_task is not None:
            self._tls_task.cancel()
        if self._task is None:
            self.socket.close()
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        except BaseException as exc:  # noqa: BLE001 - uvicorn exits with SystemExit on failures
            logger.warning("the HTTP server ended with {!r}", exc)
        self.socket.close()
