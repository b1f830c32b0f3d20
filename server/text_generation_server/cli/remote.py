"""The commands that call a running server's client API: `health`, and `generate --server`.

Both take the same client flags (API key, TLS), declared here once.
"""

from __future__ import annotations

from typing import Any, List, Optional

import typer

from text_generation_server.cli.common import fail
from text_generation_server.settings.serve_args import ServeArgs

CLIENT_API_KEY = typer.Option(
    None, "--api-key", envvar="API_KEY", metavar="KEY",
    help="Send 'authorization: Bearer KEY' (API_KEY, as serve reads it: the first of several).",
)
CLIENT_API_KEY_FILE = typer.Option(
    None, "--api-key-file", envvar="API_KEY_FILE", help="Send the first key of this file (as serve reads it)."
)
CLIENT_TLS = typer.Option(False, "--tls", help="Use TLS, trusting the system's CAs (implied by the --tls-* options).")
CLIENT_TLS_CA = typer.Option(None, "--tls-ca-path", help="PEM CA certificates to trust for the server's certificate.")
CLIENT_TLS_CERT = typer.Option(
    None, "--tls-client-cert-path", help="PEM client certificate chain, for a server that requires one (mutual TLS)."
)
CLIENT_TLS_KEY = typer.Option(None, "--tls-client-key-path", help="PEM private key of --tls-client-cert-path.")
CLIENT_TLS_NAME = typer.Option(
    None, "--tls-server-name", help="Name the server's certificate must carry (default: the host dialled)."
)


def client_options(api_key: Optional[str], api_key_file: Optional[str], tls: bool, ca_path: Optional[str],
                   cert_path: Optional[str], key_path: Optional[str], server_name: Optional[str]) -> Any:
    """ClientOptions from the client flags; a bad combination or unreadable file exits 2."""
    from text_generation_server.cli.client_channel import ClientOptions, client_api_key

    try:
        return ClientOptions(client_api_key(api_key, api_key_file), tls, ca_path, cert_path, key_path, server_name)
    except ValueError as exc:
        fail(str(exc))


def health(
    hostname: str = typer.Option("127.0.0.1", "--hostname", help="Address of the server's client gRPC API."),
    port: int = typer.Option(ServeArgs().port, "--port", min=1, max=65535, help="Port of the client gRPC API."),
    service: str = typer.Option("", "--service", help="Service to check ('' is the whole server)."),
    timeout_s: float = typer.Option(5.0, "--timeout-s", min=0.1, help="Give up (unhealthy) after this long."),
    api_key: Optional[str] = CLIENT_API_KEY,
    api_key_file: Optional[str] = CLIENT_API_KEY_FILE,
    tls: bool = CLIENT_TLS,
    tls_ca_path: Optional[str] = CLIENT_TLS_CA,
    tls_client_cert_path: Optional[str] = CLIENT_TLS_CERT,
    tls_client_key_path: Optional[str] = CLIENT_TLS_KEY,
    tls_server_name: Optional[str] = CLIENT_TLS_NAME,
) -> None:
    """Exit 0 when the server's grpc.health.v1 reports SERVING, else 1: a container HEALTHCHECK without grpcurl."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from text_generation_server.cli.client_channel import target as client_target

    client = client_options(api_key, api_key_file, tls, tls_ca_path, tls_client_cert_path, tls_client_key_path,
                            tls_server_name)
    target = client_target(hostname, port)
    try:
        with client.channel(target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=client.metadata
            )
    except ValueError as exc:  # an unreadable TLS file
        fail(str(exc))
    except grpc.RpcError as exc:
        fail(f"{target}: health check failed: {exc.code().name}: {exc.details()}", code=1)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        fail(f"{target}: {service or 'the server'} is {status}", code=1)
    typer.echo(f"{target}: SERVING")


def generate_remote(server: str, prompts: List[str], params: Any, client: Any,
                    timeout_s: float, chat: bool = False) -> tuple[str, List[tuple]]:
    """Every prompt sent at once (the server batches them); the model id from Info. chat: each
    prompt is a user message sent to Chat. Returns (model id, [(text, token_ids, finish_reason, seed)])."""
    import grpc

    from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

    try:
        with client.channel(server) as channel:
            stub = cpb_grpc.TextGenerationStub(channel)
            if chat:
                calls = [stub.Chat.future(cpb.ChatRequest(messages=[cpb.Message(role="user", content=p)],
                                                          parameters=params),
                                          timeout=timeout_s, metadata=client.metadata) for p in prompts]
            else:
                calls = [stub.Generate.future(cpb.GenerateRequest(inputs=p, parameters=params), timeout=timeout_s,
                                              metadata=client.metadata) for p in prompts]
            info = stub.Info(cpb.InfoRequest(), timeout=timeout_s, metadata=client.metadata)
            responses = [call.result() for call in calls]
    except ValueError as exc:  # an unreadable TLS file
        fail(str(exc))
    except grpc.RpcError as exc:
        fail(f"{server}: {exc.code().name}: {exc.details()}", code=1)
    rows = []
    for resp in responses:
        d = resp.details
        reason = cpb.FinishReason.Name(d.finish_reason).removeprefix("FINISH_REASON_").lower()
        rows.append((resp.generated_text, [t.id for t in d.tokens], reason, d.seed if d.HasField("seed") else None))
    return info.model_id, rows
