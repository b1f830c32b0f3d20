"""The `text-generation-server` command line: the app and its commands, each defined in the module
of its role (cli/serve.py, cli/generate.py, cli/remote.py, cli/jobs.py)."""

from __future__ import annotations

import typer

from text_generation_server.cli import generate, jobs, remote, serve
from text_generation_server.cli.common import version_option

# Plain click help (rich_markup_mode=None): rich's tables cut long flag names ("--max-batch-pre…")
# at 80 columns, where plain help wraps the text and keeps every name whole.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Serve, run, convert and quantize large language models.",
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def main_options(version: bool = version_option()) -> None:
    """Serve, run, convert and quantize large language models."""


<<<<<<< HEAD
_LEVEL_HELP = "trace, debug, info, warning or error."
_SHARD_SIZE_HELP = "Largest safetensors file written, in MB."


def setup_logging(level: str = "INFO") -> None:
    """Loguru to stderr, so stdout stays clean for results (--json)."""
    try:
        name = parse_log_level(level)
    except ValueError as exc:
        fail(str(exc))
    logger.remove()
    logger.add(sys.stderr, level=name, backtrace=False, diagnose=False)


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


# -- options of the commands that call a running server (health, generate --server) ---------
_CLIENT_API_KEY = typer.Option(
    None, "--api-key", envvar="API_KEY", metavar="KEY",
    help="Send 'authorization: Bearer KEY' (API_KEY, as serve reads it: the first of several).",
)
_CLIENT_API_KEY_FILE = typer.Option(
    None, "--api-key-file", envvar="API_KEY_FILE", help="Send the first key of this file (as serve reads it)."
)
_CLIENT_TLS = typer.Option(False, "--tls", help="Use TLS, trusting the system's CAs (implied by the --tls-* options).")
_CLIENT_TLS_CA = typer.Option(None, "--tls-ca-path", help="PEM CA certificates to trust for the server's certificate.")
_CLIENT_TLS_CERT = typer.Option(
    None, "--tls-client-cert-path", help="PEM client certificate chain, for a server that requires one (mutual TLS)."
)
_CLIENT_TLS_KEY = typer.Option(None, "--tls-client-key-path", help="PEM private key of --tls-client-cert-path.")
_CLIENT_TLS_NAME = typer.Option(
    None, "--tls-server-name", help="Name the server's certificate must carry (default: the host dialled)."
)


def _client_options(api_key: Optional[str], api_key_file: Optional[str], tls: bool, ca_path: Optional[str],
                    cert_path: Optional[str], key_path: Optional[str], server_name: Optional[str]) -> Any:
    """ClientOptions from the client flags; a bad combination or unreadable file exits 2."""
    from text_generation_server.cli.client_channel import ClientOptions, client_api_key

    try:
        return ClientOptions(client_api_key(api_key, api_key_file), tls, ca_path, cert_path, key_path, server_name)
    except ValueError as exc:
        fail(str(exc))


@app.command()
def generate(
    prompts: List[str] = typer.Argument(..., metavar="PROMPT...", help="One or more prompts; all run as one batch."),
    model: Optional[str] = typer.Option(
        None, "--model", help=f"Checkpoint folder, or '{EMBEDDED_MODEL_ID}' (the embedded default)."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Most tokens generated per prompt."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, float16 or bfloat16."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", help="Quantization method; must agree with the checkpoint (default: from the checkpoint)."
    ),
    model_impl: str = typer.Option(
        "auto", "--model-impl", metavar="auto|native|transformers",
        help="Which code computes the model (as for serve).",
    ),
    do_sample: bool = typer.Option(False, "--do-sample", help="Sample instead of greedy decoding."),
    temperature: float = typer.Option(1.0, "--temperature", help="Divide the logits by this (with --do-sample)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k likeliest tokens; 0 keeps all."),
    top_p: float = typer.Option(
        1.0, "--top-p", help="Sample from the likeliest tokens holding this mass; 1 keeps all."
    ),
    typical_p: float = typer.Option(1.0, "--typical-p", help="Locally typical sampling mass; 1 keeps all."),
    repetition_penalty: float = typer.Option(
        1.0, "--repetition-penalty", help="Penalise tokens already seen (CTRL-style); 1 is off."
    ),
    frequency_penalty: float = typer.Option(
        0.0, "--frequency-penalty", help="Subtract this per earlier occurrence of a token; 0 is off."
    ),
    seed: Optional[int] = typer.Option(None, "--seed", min=0, help="Seed for sampling (default: a random one)."),
    stop: List[str] = typer.Option([], "--stop", help="Stop sequence (repeatable)."),
    json_lines: bool = typer.Option(False, "--json", help="One JSON object per prompt, one per line."),
    chat: bool = typer.Option(
        False, "--chat", help="Each PROMPT is a user message of its own conversation, rendered with the model's "
        "chat template (the Chat RPC with --server).",
    ),
    logger_level: str = typer.Option("WARNING", "--logger-level", help=_LEVEL_HELP),
    server: Optional[str] = typer.Option(
        None, "--server", metavar="HOST:PORT",
        help="Send the prompts to a running serve (its client API) instead of loading a model here.",
    ),
    timeout_s: float = typer.Option(300.0, "--timeout-s", min=0.1, help="With --server: deadline of each request."),
    api_key: Optional[str] = _CLIENT_API_KEY,
    api_key_file: Optional[str] = _CLIENT_API_KEY_FILE,
    tls: bool = _CLIENT_TLS,
    tls_ca_path: Optional[str] = _CLIENT_TLS_CA,
    tls_client_cert_path: Optional[str] = _CLIENT_TLS_CERT,
    tls_client_key_path: Optional[str] = _CLIENT_TLS_KEY,
    tls_server_name: Optional[str] = _CLIENT_TLS_NAME,
) -> None:
    """Generate completions for PROMPTS with a local model, or with a running server (--server)."""
    setup_logging(logger_level)
    if server is not None:
        if model is not None or dtype is not None or quantize is not None or model_impl != "auto":
            fail("--server uses the server's model: --model, --dtype, --quantize and --model-impl do not apply")
        client = _client_options(api_key, api_key_file, tls, tls_ca_path, tls_client_cert_path,
                                 tls_client_key_path, tls_server_name)
        from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

        params = cpb.GenerateParameters(max_new_tokens=max_new_tokens, do_sample=do_sample, stop=stop, details=True)
        # Only what differs from the server's defaults (1 / 0 / off), so its own validation applies as written.
        for name, value, default in (("temperature", temperature, 1.0), ("top_k", top_k, 0), ("top_p", top_p, 1.0),
                                     ("typical_p", typical_p, 1.0), ("repetition_penalty", repetition_penalty, 1.0),
                                     ("frequency_penalty", frequency_penalty, 0.0), ("seed", seed, None)):
            if value != default:
                setattr(params, name, value)
        model_id, rows = _generate_remote(server, prompts, params, client, timeout_s, chat)
        _echo_completions(model_id, prompts, rows, json_lines)
        return
    from text_generation_server.generation.sampling import SamplingParams
    from text_generation_server.models.loader import get_model
    from text_generation_server.engine.types import GenerationRequest

    sampling = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, typical_p=typical_p, do_sample=do_sample,
        seed=seed, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
    )
    try:
        sampling.validate()
        inputs = _chat_prompts(model, prompts) if chat else prompts
        lm = get_model(model, dtype=dtype, quantize=quantize, model_impl=model_impl)
        requests = [
            GenerationRequest(id=i, inputs=p, sampling=sampling, max_new_tokens=max_new_tokens, stop_sequences=stop,
                              add_special_tokens=not chat)  # a chat template writes its special tokens itself
            for i, p in enumerate(inputs)
        ]
        completions = lm.generate(requests)
    except ValueError as exc:  # CheckpointError is a ValueError
        fail(str(exc))
    rows = [(done.text, done.token_ids, done.finish_reason.name.lower(), done.seed) for done in completions]
    _echo_completions(lm.model_id, prompts, rows, json_lines)


def _echo_completions(model_id: str, prompts: List[str], rows: List[tuple], json_lines: bool) -> None:
    """(text, token_ids, finish_reason, seed) per prompt, as JSON lines or as prompt + text."""
    for prompt, (text, token_ids, finish_reason, seed) in zip(prompts, rows):
        if json_lines:
            typer.echo(json.dumps({
                "model": model_id,
                "prompt": prompt,
                "text": text,
                "token_ids": token_ids,
                "generated_tokens": len(token_ids),
                "finish_reason": finish_reason,
                "seed": seed,
            }))
        else:
            typer.echo(prompt + text)
            if len(prompts) > 1:
                typer.echo("")


def _chat_prompts(model: Optional[str], prompts: List[str]) -> List[str]:
    """Each prompt as a one-message conversation rendered by the model's chat template; a model
    without one (or a template that refuses the message) fails with the template's reason."""
    from text_generation_server.generation.chat_template import ChatTemplate, ChatTemplateMissing
    from text_generation_server.utils.locate import resolve_model

    try:
        template = ChatTemplate.load(resolve_model(model)[1])
        return [template.render([{"role": "user", "content": p}]) for p in prompts]
    except ChatTemplateMissing as exc:
        fail(str(exc))
        raise  # fail() exits; this keeps type checkers informed


def _generate_remote(server: str, prompts: List[str], params: Any, client: Any,
                     timeout_s: float, chat: bool = False) -> tuple[str, List[tuple]]:
    """Every prompt sent at once (the server batches them); the model id from Info. chat: each
    prompt is a user message sent to Chat."""
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


@app.command()
def convert(
    model_dir: Path = typer.Argument(..., help="Folder with pytorch_model*.bin / *.pt files."),
    output: Optional[Path] = typer.Option(None, "--output", help="Where to write (default: in place)."),
    max_shard_size_mb: int = typer.Option(2000, "--max-shard-size-mb", min=1, help=_SHARD_SIZE_HELP),
    logger_level: str = typer.Option("INFO", "--logger-level", help=_LEVEL_HELP),
) -> None:
    """Convert pickle weights to safetensors: the only command that unpickles, with weights_only=True."""
    setup_logging(logger_level)
    from text_generation_server.jobs.convert import convert_folder

    try:
        written = convert_folder(model_dir, output or model_dir, max_shard_size_mb * 1024 * 1024)
    except ValueError as exc:
        fail(str(exc))
    for path in written:
        typer.echo(str(path))


_SERVE_DEFAULTS = ServeArgs()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        fail(f"environment variable {name} must be an integer, got {value!r}")


def _env_option(default: Any, *decls: str, help: str, envvar: Optional[List[str]] = None, **kwargs: Any) -> Any:
    """An option also read from the environment, as TGI's launcher reads every flag: by default
    from its long name in upper snake case (--max-total-tokens: MAX_TOTAL_TOKENS)."""
    long_name = decls[0].split("/")[0]
    names = envvar or [long_name.lstrip("-").replace("-", "_").upper()]
    # A single name as a string: click then names just that variable in its parse errors.
    return typer.Option(default, *decls, envvar=names[0] if len(names) == 1 else names, show_envvar=True,
                        help=help, **kwargs)


def _tgi_name(ours: str) -> str:
    return f"TGI's name for {ours}."


_SERVE_EPILOG = (
    "Every option can also be set by the environment variable shown; a flag given on the command "
    "line wins. TGI launcher flags that mean nothing here (--revision, --kv-cache-dtype, "
    "--lora-adapters, ...) are refused with the reason; harmless ones (--max-best-of, --usage-stats, "
    "--trust-remote-code, ...) are ignored with a warning."
)


@app.command(epilog=_SERVE_EPILOG)
@add_tgi_only_flags
def serve(
    ctx: typer.Context,
    model_dir: Optional[str] = typer.Argument(
        None, metavar="MODEL_DIR", show_default=False,
        help=f"Checkpoint folder, or '{EMBEDDED_MODEL_ID}' (the embedded default); or --model-id / MODEL_ID.",
    ),
    model_id: Optional[str] = _env_option(None, "--model-id", help=_tgi_name("MODEL_DIR")),
    # -- network
    hostname: str = _env_option(
        _SERVE_DEFAULTS.hostname, "--hostname",
        help="Address of the client gRPC API. HOSTNAME is used only when it holds an address "
        "(container runtimes set it to a host name).",
    ),
    port: int = _env_option(_SERVE_DEFAULTS.port, "--port", help="Port of the client gRPC API."),
    metrics_port: int = _env_option(_SERVE_DEFAULTS.metrics_port, "--metrics-port", help="Prometheus /metrics port."),
    prometheus_port: Optional[int] = _env_option(None, "--prometheus-port", help=_tgi_name("--metrics-port")),
    uds_path: str = _env_option(
        _SERVE_DEFAULTS.uds_path, "--uds-path", help="Shard sockets are {uds_path}-{rank}."
    ),
    shard_uds_path: Optional[str] = _env_option(None, "--shard-uds-path", help=_tgi_name("--uds-path")),
    metrics_hostname: Optional[str] = _env_option(
        None, "--metrics-hostname", help="Address of /metrics (default: --hostname's). It is plain HTTP."
    ),
    # -- who may call
    api_key: List[str] = _env_option(
        [], "--api-key", metavar="KEY",
        help="Calls must send metadata 'authorization: Bearer KEY' (repeatable; API_KEY may hold several, "
        "comma-separated, to rotate keys).",
    ),
    api_key_file: Optional[str] = _env_option(
        None, "--api-key-file", help="API keys, one per line; re-read when it changes or on SIGHUP."
    ),
    api_key_protects_health: bool = _env_option(
        False, "--api-key-protects-health",
        help="Health and reflection need the key too (default: open, for probes).",
    ),
    tls_cert_path: Optional[str] = _env_option(
        None, "--tls-cert-path",
        help="PEM certificate chain: the client API speaks TLS. Re-read when it changes or on SIGHUP.",
    ),
    tls_key_path: Optional[str] = _env_option(
        None, "--tls-key-path", help="PEM private key of --tls-cert-path (unencrypted)."
    ),
    tls_client_ca_path: Optional[str] = _env_option(
        None, "--tls-client-ca-path",
        help="PEM CA certificates: clients must present a certificate they signed (mutual TLS).",
    ),
    # -- model and ranks
    num_shard: Optional[int] = _env_option(None, "--num-shard", help="Tensor-parallel ranks (default 1)."),
    sharded: Optional[str] = _env_option(
        None, "--sharded", metavar="true|false",
        help="TGI's switch: true runs one rank per visible GPU (or --num-shard ranks), false one rank.",
    ),
    quantize: Optional[str] = _env_option(
        None, "--quantize", help="Quantization method (default: from the checkpoint)."
    ),
    dtype: Optional[str] = _env_option(None, "--dtype", help="float32, float16 or bfloat16."),
    device: Optional[str] = _env_option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    model_impl: str = _env_option(
        "auto", "--model-impl", metavar="auto|native|transformers",
        help="auto: this server's implementation of the family, else transformers' modeling code over its "
        "paged cache; native refuses other types; transformers always takes the latter.",
    ),
    quantize_lm_head: Optional[str] = _env_option(
        None, "--quantize-lm-head", metavar="int8",
        help="Run a dense lm_head as per-row int8 (the head is a small model's largest matrix and decode "
        "reads it every step). Default: as the checkpoint stores it.",
    ),
    # -- request limits
    max_input_tokens: Optional[int] = _env_option(
        None, "--max-input-tokens",
        help="Longest prompt in tokens (default: --max-total-tokens - 1).",
    ),
    max_input_length: Optional[int] = _env_option(None, "--max-input-length", help=_tgi_name("--max-input-tokens")),
    max_total_tokens: Optional[int] = _env_option(
        None, "--max-total-tokens",
        help="Longest prompt + generation in tokens (default: min(max positions, 4096)).",
    ),
    max_stop_sequences: int = _env_option(
        _SERVE_DEFAULTS.max_stop_sequences, "--max-stop-sequences", help="Most stop sequences per request."
    ),
    max_stop_sequence_length: int = _env_option(
        _SERVE_DEFAULTS.max_stop_sequence_length, "--max-stop-sequence-length",
        help="Longest stop sequence, in characters.",
    ),
    max_top_n_tokens: int = _env_option(
        _SERVE_DEFAULTS.max_top_n_tokens, "--max-top-n-tokens",
        help="Most alternative tokens a request may ask for per step.",
    ),
    max_input_chars: int = _env_option(
        _SERVE_DEFAULTS.max_input_chars, "--max-input-chars",
        help="Longest prompt in characters, checked before tokenizing.",
    ),
    max_message_bytes: int = _env_option(
        _SERVE_DEFAULTS.max_message_bytes, "--max-message-bytes", help="Largest gRPC request accepted, in bytes."
    ),
    payload_limit: Optional[int] = _env_option(None, "--payload-limit", help=_tgi_name("--max-message-bytes")),
    # -- batching and scheduling
    max_concurrent_requests: int = _env_option(
        _SERVE_DEFAULTS.max_concurrent_requests, "--max-concurrent-requests",
        help="Requests in flight before new ones are refused (RESOURCE_EXHAUSTED).",
    ),
    max_batch_prefill_tokens: Optional[int] = _env_option(
        None, "--max-batch-prefill-tokens",
        help="Most prompt tokens in one prefill (default: --max-input-tokens + 50).",
    ),
    max_batch_total_tokens: Optional[int] = _env_option(
        None, "--max-batch-total-tokens",
        help="Most tokens (prompts + generations) in a running batch (default: what the KV cache holds).",
    ),
    max_batch_size: Optional[int] = _env_option(
        None, "--max-batch-size", help="Most requests in a running batch (default: no limit)."
    ),
    max_waiting_tokens: int = _env_option(
        _SERVE_DEFAULTS.max_waiting_tokens, "--max-waiting-tokens",
        help="Decode steps a waiting request may wait before the running batch pauses to admit it.",
    ),
    waiting_served_ratio: float = _env_option(
        _SERVE_DEFAULTS.waiting_served_ratio, "--waiting-served-ratio",
        help="Admit waiting requests early once waiting / running exceeds this ratio.",
    ),
    speculate: int = _env_option(
        _SERVE_DEFAULTS.speculate, "--speculate", metavar="N",
        help=f"Speculative decoding: each decode step checks up to N tokens proposed from the request's own "
        f"earlier tokens (n-gram lookup) in one forward; the output is unchanged (0 to {MAX_SPECULATE}, 0 = off).",
    ),
    # -- memory and kernels
    block_size: int = _env_option(_SERVE_DEFAULTS.block_size, "--block-size", help="KV cache block size in tokens."),
    memory_fraction: Optional[float] = _env_option(
        None, "--memory-fraction",
        help="Share of the memory free after warmup given to the KV cache (default 0.1 on CPU, 0.9 on CUDA).",
    ),
    cuda_memory_fraction: float = _env_option(
        _SERVE_DEFAULTS.cuda_memory_fraction, "--cuda-memory-fraction",
        help="TGI's cap on each rank's CUDA memory, as a share of the GPU's total; the KV cache takes "
        "--memory-fraction of what is free inside it.",
    ),
    prefix_caching: bool = _env_option(
        _SERVE_DEFAULTS.prefix_caching, "--prefix-caching/--no-prefix-caching",
        help="Reuse the KV cache of prompt prefixes seen before (USE_PREFIX_CACHING is read too).",
    ),
    use_prefix_caching: Optional[bool] = _env_option(
        None, "--use-prefix-caching/--no-use-prefix-caching", hidden=True,
        help="TGI's older name for --prefix-caching.",
    ),
    cuda_graphs: Optional[str] = _env_option(
        None, "--cuda-graphs", metavar="SIZES",
        help="Batch sizes captured as CUDA graphs, e.g. 1,2,4,8 (default 1,2,4,8,16,32; 0 disables).",
    ),
    attention_backend: Optional[str] = _env_option(
        None, "--attention-backend", metavar="|".join(ATTENTION_BACKENDS),
        help="Attention implementation (default: the best for the device).",
    ),
    disable_custom_kernels: bool = _env_option(
        False, "--disable-custom-kernels",
        help=f"No custom CUDA kernels: turns off {', '.join(CUSTOM_KERNELS)} and uses "
        f"{PORTABLE_ATTENTION_BACKEND} attention.",
    ),
    allow_dense_fallback: bool = _env_option(
        False, "--allow-dense-fallback",
        help="Let quantized layers with no CUDA kernel run dequantized (more memory) instead of failing.",
    ),
    disable_grammar_support: bool = _env_option(
        False, "--disable-grammar-support",
        help="Refuse requests with parameters.grammar (JSON schema / regex constrained output).",
    ),
    # -- lifecycle and logs
    drain_timeout_s: float = _env_option(
        _SERVE_DEFAULTS.drain_timeout_s, "--drain-timeout-s",
        help="On SIGTERM/SIGINT, how long in-flight requests may run before they are cancelled.",
    ),
    graceful_termination_timeout: Optional[float] = _env_option(
        None, "--graceful-termination-timeout", help=_tgi_name("--drain-timeout-s"),
    ),
    rank_stall_timeout_s: float = _env_option(
        _SERVE_DEFAULTS.rank_stall_timeout_s, "--rank-stall-timeout-s",
        help="A rank whose model call runs longer than this is reported unhealthy.",
    ),
    logger_level: str = _env_option(
        _SERVE_DEFAULTS.logger_level, "--logger-level", envvar=["LOGGER_LEVEL", "LOG_LEVEL"],
        help="trace, debug, info, warning or error; TGI's LOG_LEVEL values are accepted too.",
    ),
    json_output: bool = _env_option(
        False, "--json-output",
        help="Log one JSON object per line (timestamp, level, message, target, component, request_id).",
    ),
    shard_only: bool = _env_option(
        False, "--shard-only",
        help="Run one rank only (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment).",
    ),
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
    **tgi_only_flags: Any,
) -> None:
    """Serve MODEL_DIR over gRPC: the router plus one process per tensor-parallel rank."""
    from text_generation_server.launcher.supervisor import launch
    from text_generation_server.launcher.process_exit import exit_process
    from text_generation_server.launcher.rank import SERVE_ARGS_ENV, run_shard, shard_args_from_env

    if shard_only and SERVE_ARGS_ENV in os.environ:
        # A rank of our launcher: its settings come whole from the launcher, which checked them.
        try:
            args = shard_args_from_env(_SERVE_DEFAULTS)
        except ValueError as exc:
            fail(str(exc))
        exit_process(run_shard(args, _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)))
    try:
        args, warnings = serve_args_from_flags(ctx)
    except ValueError as exc:
        _serve_fail(str(exc), ctx)
    if shard_only:
        exit_process(run_shard(args, _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), warnings))
    raise typer.Exit(launch(args, warnings=warnings))
=======
# In the order `--help` lists them.
app.command()(generate.generate)
app.command()(jobs.convert)
app.command(epilog=serve.SERVE_EPILOG)(serve.serve)
app.command()(remote.health)
app.command()(jobs.quantize)
app.command()(jobs.perplexity)
>>>>>>> h3


def serve_environment_variables() -> list[str]:
    """Every variable `serve` reads a setting from (HOSTNAME included), for wrappers and tests
    that must start it from a clean environment."""
    command = typer.main.get_command(app).commands["serve"]
    names = set()
    for param in command.params:
        names.update([param.envvar] if isinstance(param.envvar, str) else param.envvar or ())
    return sorted(names)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
