"""The router inside `serve`: shard discovery, warmup, the client API, metrics."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loguru import logger

from text_generation_server.about import __version__
from text_generation_server.router.metrics import Metrics
from text_generation_server.models.registry import read_model_config
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.quantizers.factory import read_quantization_config
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc
from text_generation_server.router.adapters import AdapterSet, LoadPolicy
from text_generation_server.router.adapter_admin import client_info
from text_generation_server.router.auth import ApiKeyInterceptor, ApiKeys, api_keys
from text_generation_server.router.client import ShardClient
from text_generation_server.router.health import HEALTH_SERVICE_NAME, RouterHealth, ShardHealthMonitor
from text_generation_server.router.http.core import PLACEHOLDER_MODELS, HttpContext
from text_generation_server.router.http.server import HttpServer, build_app
from text_generation_server.router.reflection import enable_reflection
from text_generation_server.router.block_pool import BlockPool
from text_generation_server.router.scheduler import Scheduler, SchedulerLimits
from text_generation_server.router.service import MalformedRequestInterceptor, TextGenerationService
from text_generation_server.router.tls import CertificateStore, tls_files
from text_generation_server.router.validation import Limits
from text_generation_server.settings.serve_args import ServeArgs
from text_generation_server.utils.locate import open_checkpoint

SERVICE_NAME = cpb.DESCRIPTOR.services_by_name["TextGeneration"].full_name


class RouterError(RuntimeError):
    """Startup cannot go on; the message tells the user what to change."""


def resolve_limits(args: ServeArgs, max_context: int, context_name: str | None = None
                   ) -> tuple[int, int, int]:
    """max_input_tokens, max_total_tokens, max_batch_prefill_tokens with TGI's defaults."""
    max_total = args.max_total_tokens or min(max_context, 4096)
    if max_total > max_context:
        raise RouterError(
            f"--max-total-tokens {max_total} exceeds the model's "
            f"{context_name or f'max_position_embeddings ({max_context})'}"
        )
    max_input = args.max_input_tokens or max_total - 1
    if max_input >= max_total:
        raise RouterError(f"--max-input-tokens ({max_input}) must be < --max-total-tokens ({max_total})")
    # A prompt longer than max_batch_prefill_tokens is prefilled in chunks (checked against the
    # shards' Info once they answer: see check_chunking).
    prefill = args.max_batch_prefill_tokens or max_input + 50
    return max_input, max_total, prefill


def check_chunking(info: spb.InfoResponse, max_input: int, max_prefill: int) -> None:
    """Shards that cannot chunk need every prompt to fit one prefill."""
    if not info.support_chunking and max_prefill < max_input:
        raise RouterError(
            f"--max-batch-prefill-tokens ({max_prefill}) must be >= --max-input-tokens ({max_input}): "
            "the shards do not support chunked prefill"
        )


def warmup_batch(max_input: int, max_prefill: int, max_total: int) -> spb.Batch:
    """The batch TGI's router warms up with: "_test " prompts cut to fill max_prefill tokens."""
    requests = []
    tokens = 0
    while tokens < max_prefill:
        truncate = min(max_input, max_prefill - tokens)
        params = spb.NextTokenChooserParameters(
            temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, do_sample=False, seed=0,
            repetition_penalty=1.2, frequency_penalty=0.1, watermark=False,
        )
        requests.append(spb.Request(
            id=len(requests), inputs="_test " * max_input, truncate=truncate, parameters=params,
            stopping_parameters=spb.StoppingCriteriaParameters(
                max_new_tokens=max(1, max_total - truncate), ignore_eos_token=True),
            prefill_logprobs=True, top_n_tokens=20, add_special_tokens=True,
        ))
        tokens += truncate
    return spb.Batch(id=0, requests=requests, size=len(requests), max_tokens=0, max_blocks=0)


def load_security(args: ServeArgs) -> tuple[ApiKeys | None, CertificateStore | None]:
    """The API keys and the certificate store of the client port, read before the (slow) warmup
    so a bad file stops startup at once."""
    try:
        keys = api_keys(args)
        files = tls_files(args)
        return keys, (CertificateStore(files) if files is not None else None)
    except ValueError as exc:  # ApiKeyError, TlsError: the message names the file
        raise RouterError(str(exc)) from None


def describe_security(keys: ApiKeys | None, tls: CertificateStore | None, protect_health: bool) -> str:
    """One phrase for the startup log: what a caller needs."""
    transport = "plaintext" if tls is None else ("mutual TLS" if tls.mutual else "TLS")
    if keys is None:
        return f"{transport}, no API key"
    scope = "every service" if protect_health else "all but health and reflection"
    return f"{transport}, API key ({len(keys)} accepted) on {scope}"


def describe_adapters(adapters: AdapterSet, policy: LoadPolicy, slots: int) -> None:
    """The startup log's word on LoRA adapters: those loaded, and whether more may be (`slots`:
    the adapter slots each rank reserved, --max-loras)."""
    if adapters.names():
        logger.info("LoRA adapters loaded: {}", ", ".join(adapters.names()))
    if policy.directory is None:
        return
    if slots <= len(adapters.names()):
        logger.warning("--lora-load-dir is set but every adapter slot is taken ({} of --max-loras {}): run-time "
                       "loads will be refused until one is unloaded; raise --max-loras to load more", slots, slots)
    if policy.open:
        logger.info("LoRA adapters may be loaded at run time from {}{}", policy.directory,
                    "" if policy.api_key_required else " by any caller (no API key: --lora-load-without-api-key)")
    else:
        logger.warning("--lora-load-dir {} is set but the client port has no API key: LoadAdapter is refused "
                       "unless --lora-load-without-api-key", policy.directory)


async def reload_on_request(reload: asyncio.Event, keys: ApiKeys | None, tls: CertificateStore | None) -> None:
    """Re-reads the key file and the TLS files each time `reload` is set (the launcher's SIGHUP).
    Changes are picked up without it too (by their stat); this forces a read."""
    while True:
        await reload.wait()
        reload.clear()
        if keys is not None:
            keys.refresh(force=True)
        if tls is not None:
            await asyncio.to_thread(tls.refresh, True)


async def start_http(args: ServeArgs, service: TextGenerationService, health: RouterHealth, keys: ApiKeys | None,
                     tls: CertificateStore | None, metrics: Metrics, model_id: str,
                     model_names: frozenset[str]) -> HttpServer:
    """The HTTP APIs (--http-port) on the gRPC API's core, keys and certificate. model_names:
    what an OpenAI `model` may say for the base model (the model id, the folder)."""
    ctx = HttpContext(
        service=service, model_id=model_id, model_names=model_names,
        max_body_bytes=args.max_message_bytes, max_client_batch_size=getattr(args, "max_client_batch_size", 4),
        healthy=lambda: health.status("") == health_pb2.HealthCheckResponse.SERVING,
    )
    app = build_app(ctx, keys, metrics, protect_health=args.api_key_protects_health,
                    cors_allow_origin=getattr(args, "cors_allow_origin", []))
    try:
        http = HttpServer(app, args.hostname, args.http_port, tls)
    except OSError as exc:
        raise RouterError(str(exc)) from None
    await http.start()
    logger.info("serving HTTP (OpenAI /v1/..., TGI /generate ...) on {}://{}:{}", http.scheme, args.hostname, http.port)
    return http


async def run_router(args: ServeArgs, shard_urls: list[str], shutdown: asyncio.Event,
                     reload: asyncio.Event | None = None, client=None) -> None:
    """Serves the client API over the shards at `shard_urls` until `shutdown` is set, then drains.

    `reload` (set by the launcher on SIGHUP) re-reads the API key file and the TLS files.
    `client`: a client of the shards to use instead (--shard-in-process: the rank in this process,
    launcher/in_process.py), with ShardClient's calls.
    """
    keys, tls = load_security(args)
    try:
        policy = LoadPolicy.from_settings(getattr(args, "lora_load_dir", None), keys is not None,
                                          getattr(args, "lora_load_without_api_key", False))
    except ValueError as exc:
        raise RouterError(str(exc)) from None
    checkpoint = await asyncio.to_thread(open_checkpoint, args.model)
    qconfig = await asyncio.to_thread(read_quantization_config, checkpoint.folder, args.quantize)
    _, model_config = await asyncio.to_thread(read_model_config, checkpoint.config,
                                              str(checkpoint.folder / "config.json"), args.model_impl)
    max_input, max_total, max_prefill = resolve_limits(args, model_config.max_context, model_config.context_name)

    if client is None:
        client = ShardClient(shard_urls) if len(shard_urls) > 1 else await ShardClient.connect(shard_urls[0])
    metrics_server = None
    server = None
    http_server = None
    scheduler = None
    monitor = None
    reloader = None
    try:
        await client.clear_cache()
        info = await client.info()
        if await client.open_steps():
            logger.info("shard calls: {}", client.step_transport)
        check_chunking(info, max_input, max_prefill)
        started = time.monotonic()
        try:
            warm = await client.warmup(spb.WarmupRequest(
                batch=warmup_batch(max_input, max_prefill, max_total),
                max_input_tokens=max_input, max_prefill_tokens=max_prefill, max_total_tokens=max_total,
            ))
        except grpc.aio.AioRpcError as exc:
            raise RouterError(f"warmup failed: {exc.details()}") from exc
        supported = warm.max_supported_total_tokens
        batch_total = min(supported, args.max_batch_total_tokens or supported)
        prefix_caching = info.use_prefix_caching and getattr(args, "prefix_caching", True)
        pool = BlockPool(batch_total // info.block_size + 1, info.block_size, prefix_caching=prefix_caching)
        logger.info(
            "warmup done in {:.1f} s: max_input_tokens {}, max_total_tokens {}, max_batch_prefill_tokens {}, "
            "max_batch_total_tokens {} ({} KV blocks of {})", time.monotonic() - started, max_input, max_total,
            max_prefill, batch_total, pool.num_blocks - 1, info.block_size,
        )
        metrics = Metrics(model_name=checkpoint.model_id)
        metrics.batch_max_total_tokens.set(batch_total)
        limits = Limits(
            max_input_tokens=max_input, max_total_tokens=max_total, max_stop_sequences=args.max_stop_sequences,
            max_stop_sequence_length=args.max_stop_sequence_length, max_top_n_tokens=args.max_top_n_tokens,
            max_input_chars=args.max_input_chars,
        )
        model_names = frozenset({checkpoint.model_id, str(args.model or checkpoint.folder),
                                 Path(checkpoint.model_id).name})
        # The base model's names and the OpenAI placeholders mean the base: no adapter may take them.
        adapters = AdapterSet((client_info(a) for a in info.adapters), reserved=model_names | PLACEHOLDER_MODELS)
        for name in adapters.names():
            metrics.adapter_series(name)
        describe_adapters(adapters, policy, getattr(args, "lora_slots", 0))
        scheduler = Scheduler(client, pool, SchedulerLimits(
            max_prefill, args.max_batch_size, args.max_concurrent_requests,
            waiting_served_ratio=getattr(args, "waiting_served_ratio", 1.2),
            max_waiting_tokens=getattr(args, "max_waiting_tokens", 20),
        ), metrics, support_chunking=info.support_chunking, speculate=info.speculate, adapters=adapters)
        scheduler.start()
        info_msg = cpb.InfoResponse(
            model_id=checkpoint.model_id, model_dtype=info.dtype, model_device_type=info.device_type,
            max_input_tokens=max_input, max_total_tokens=max_total,
            max_concurrent_requests=args.max_concurrent_requests, max_stop_sequences=args.max_stop_sequences,
            max_batch_total_tokens=batch_total, max_batch_prefill_tokens=max_prefill, num_shard=len(client.urls),
            quantize=qconfig.describe() if qconfig is not None else "", version=__version__, block_size=info.block_size,
            kernels=await client.kernels(), attention_backend=await client.attention_backend(),
            model_impl=await client.model_impl(), prefix_caching=prefix_caching,
            chunked_prefill=info.support_chunking,
        )
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
        if keys is not None:  # first: a call without a key goes no further
            interceptors.insert(0, ApiKeyInterceptor(keys, metrics, protect_health=args.api_key_protects_health))
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", args.max_message_bytes),
            ("grpc.max_send_message_length", max(args.max_message_bytes, 64 * 2**20)),
        ])
        service = TextGenerationService(scheduler, checkpoint.tokenizer, limits, info_msg, metrics,
                                        model_folder=checkpoint.folder, eos_token_ids=checkpoint.eos_token_ids,
                                        grammar_support=not getattr(args, "disable_grammar_support", False),
                                        tool_call_parser=getattr(args, "tool_call_parser", None),
                                        load_policy=policy, drain_timeout_s=args.drain_timeout_s)
        cpb_grpc.add_TextGenerationServicer_to_server(service, server)
        health = RouterHealth(["", SERVICE_NAME])
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        enable_reflection(server, [SERVICE_NAME, HEALTH_SERVICE_NAME])
        address = f"{args.hostname}:{args.port}"
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.server_credentials())
        if port == 0:
            raise RouterError(f"cannot listen on {address} (port in use?)")
        await server.start()
        if getattr(args, "http_port", None) is not None:
            http_server = await start_http(args, service, health, keys, tls, metrics, checkpoint.model_id,
                                           model_names)
        metrics_host = args.effective_metrics_hostname
        try:
            metrics_server = metrics.serve(args.metrics_port, addr=metrics_host)
        except OSError as exc:
            raise RouterError(f"cannot serve metrics on {metrics_host}:{args.metrics_port}: {exc}") from exc
        if reload is not None and (keys is not None or tls is not None):
            reloader = asyncio.create_task(reload_on_request(reload, keys, tls), name="reload-on-sighup")
        await health.update(started=True)
        monitor = ShardHealthMonitor(client, health, metrics,
                                     interval_s=getattr(args, "shard_health_interval_s", 5.0),
                                     timeout_s=getattr(args, "shard_health_timeout_s", 5.0))
        monitor.start()
        logger.info("serving gRPC on {}:{} ({}), metrics on http://{}:{}/metrics", args.hostname, port,
                    describe_security(keys, tls, args.api_key_protects_health), metrics_host,
                    metrics_server.server_port)

        await shutdown.wait()
        logger.info("shutting down: no new requests; draining {} in flight", scheduler.inflight)
        scheduler.admitting = False
        await health.update(draining=True)
        deadline = time.monotonic() + args.drain_timeout_s
        while scheduler.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if scheduler.inflight:
            logger.warning("drain timeout: {} requests still in flight are cancelled", scheduler.inflight)
    finally:
        if reloader is not None:
            reloader.cancel()
        if monitor is not None:
            await monitor.stop()
        if scheduler is not None:
            await scheduler.stop()
        if http_server is not None:
            await http_server.stop()
        if server is not None:
            await server.stop(grace=1.0)
        if metrics_server is not None:
            metrics_server.shutdown()
        await client.close()
