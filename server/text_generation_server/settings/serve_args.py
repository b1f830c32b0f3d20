"""The settings of `serve`, shared by the launcher, the router and the shard processes.

Each setting is declared once, as a field of ServeArgs whose `setting(...)` holds its flag: help,
environment variables, TGI's name, the command line's type and default where they differ, how a
command-line value becomes the setting (`parse`) and the setting's rule (`check`). The `serve`
command's options are built from these fields (cli/serve.py), in this order, which is --help's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.settings.serve_flags import (
    CPU_ISA_ENV,
    CPU_ISAS,
    CUSTOM_KERNELS,
    api_keys_given,
    parse_bool,
    parse_cuda_graphs,
    parse_log_level,
)

# Attention implementations a rank can be asked for; None picks one for the device.
ATTENTION_BACKENDS = ("triton-paged", "torch-sdpa")
# The attention backend that needs none of our custom kernels (--disable-custom-kernels).
PORTABLE_ATTENTION_BACKEND = "torch-sdpa"
# Which code computes the model (models.model_impl): auto = native when a family covers the
# model_type, else transformers' modeling code over our cache.
MODEL_IMPLS = ("auto", "native", "transformers")
# --quantize-lm-head: how a dense lm_head may be run instead (models.quantize_head).
LM_HEAD_QUANTIZATIONS = ("int8",)
# ... and the flag's values: one of those, or "none" (the head as the checkpoint stores it). Not given:
# int8 on the CPU for a checkpoint quantized to 8 bits or fewer, as the checkpoint stores it otherwise
# (models.loader.head_quantization).
LM_HEAD_NONE = "none"
LM_HEAD_CHOICES = (*LM_HEAD_QUANTIZATIONS, LM_HEAD_NONE)
LM_HEAD_AUTO = "auto"  # what `serve` asks the loader for when the flag is not given
# Batch sizes captured as CUDA graphs when --cuda-graphs is not given (TGI's default).
# TGI's default stops at 32; decode batches of 33-128 rows then ran eagerly, a few hundred launches a step
# (vLLM captures up to 512, SGLang up to 160). Warmup keeps only the buckets the batch limit can reach.
DEFAULT_CUDA_GRAPHS = (1, 2, 4, 8, 16, 32, 64, 128)
# --speculate: the most n-gram tokens a request proposes per step (generation/speculation.py).
# Beyond a handful a guess from an n-gram is rarely right all the way, while every proposed
# position costs a token of compute.
MAX_SPECULATE = 8

# --tool-call-parser: the call syntaxes generation/tool_calls.py reads.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")

# --kv-cache-dtype (TGI's flag): auto keeps the checkpoint's declared KV dtype, else the model's;
# the fp8 formats halve a 16-bit cache's bytes per token. vLLM's spellings are accepted as aliases.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3fn", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3fn", "fp8_e4m3": "fp8_e4m3fn"}


def parse_kv_cache_dtype(text: str, where: str) -> str:
    """A --kv-cache-dtype value in its canonical spelling (aliases and case folded)."""
    value = text.strip().lower()
    value = KV_CACHE_DTYPE_ALIASES.get(value, value)
    if value not in KV_CACHE_DTYPES:
        spelled = ", ".join(KV_CACHE_DTYPES + tuple(KV_CACHE_DTYPE_ALIASES))
        raise ValueError(f"{where} must be one of {spelled}, got {text!r}")
    return value


# --kv-cache-fp8-skip-layers: which layers of an fp8 KV cache stay in the model's dtype
# (models/kv_cache.py): auto measures each layer's fp8 rounding at load, none keeps none, or a list.
KV_SKIP_LAYERS_WORDS = ("auto", "none")


def parse_kv_skip_layers(text: str, where: str) -> str:
    """A --kv-cache-fp8-skip-layers value in canonical form: auto, none, or layer ids and ranges
    (0,1 or 0-3,9), sorted, each id >= 0 and each range first <= last."""
    value = str(text).strip().lower().replace(" ", "")
    if value in KV_SKIP_LAYERS_WORDS:
        return value
    ids: set[int] = set()
    for part in value.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{where} must be auto, none or layer ids and ranges such as 0,1 or 0-3,9; got "
                             f"{text!r} ({part!r} is not a layer id or a range of them)")
        lo, hi = int(first), int(last) if dash else int(first)
        if lo > hi:
            raise ValueError(f"{where}: the range {part!r} in {text!r} runs backwards")
        ids.update(range(lo, hi + 1))
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


FLAG = "flag"  # the metadata key of a field's Flag
AS_SETTING = object()  # Flag.option_default: the command line's default is the setting's


@dataclass(frozen=True)
class Flag:
    """How one setting is given to `serve`: an option (or the MODEL_DIR argument), also read from
    the environment, as TGI's launcher reads every flag (by default from the option's name in
    upper snake case: --max-total-tokens, MAX_TOTAL_TOKENS)."""

    help: str
    tgi: str | None = None  # TGI's name for the setting: another option, read from its own variable
    tgi_older: bool = False  # TGI's name is an older one, hidden from --help
    env: tuple[str, ...] = ()  # the variables read, first wins; () = the option's name
    metavar: str | None = None
    choices: tuple[str, ...] = ()  # the values allowed (None too, where that is the default); the metavar
    option_type: Any = None  # the command line's type where the setting's differs (then `parse` converts)
    option_default: Any = AS_SETTING
    parse: Callable[[Any, str], Any] | None = None  # (command-line value, where it came from) -> the setting
    check: Callable[[str, Any], None] | None = None  # (option, the setting) -> None, or ValueError naming it
    argument: str | None = None  # positional, under this name, instead of an option
    param: str | None = None  # the command's parameter where it is not the field's name
    companions: tuple["Flag", ...] = ()  # options read together with this one into the setting (--sharded)


# --cpu-int8-activations: the values and variable kernels/cpu_act_int8.py reads (MODES, ENV; a test
# holds them equal; the kernels module imports torch, which the launcher's argument check must not).
CPU_INT8_ACTIVATIONS_ENV = "TGS_CPU_INT8_ACTIVATIONS"
CPU_INT8_ACTIVATIONS_MODES = ("auto", "on", "off")
CPU_AFFINITY_MODES = ("auto", "off")  # launcher/cpu_affinity.py
CPU_AFFINITY_ENV = "TGS_CPU_AFFINITY"


def setting(default: Any, help: str, *, repr: bool = True, **flag: Any) -> Any:
    """A ServeArgs field with its flag (Flag's fields as keywords)."""
    metadata = {FLAG: Flag(help, **flag)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), repr=repr, metadata=metadata)
    return field(default=default, repr=repr, metadata=metadata)


def flag_of(item: dataclasses.Field) -> Flag | None:
    """The field's flag; None for a setting no flag sets."""
    return item.metadata.get(FLAG)


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the rules of single settings: (option, value) -> None, or a ValueError naming the option ----------
def _at_least_1(option: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{option} must be >= 1, got {value}")


def _tcp_port(option: str, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"{option} must be a TCP port (0-65535), got {value}")


def _optional_tcp_port(option: str, value: int | None) -> None:
    if value is not None:
        _tcp_port(option, value)


def parse_origins(values: list[str], where: str) -> list[str]:
    """--cors-allow-origin values (repeatable) and CORS_ALLOW_ORIGIN, comma-separated."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _request_limit(option: str, value: int) -> None:
    if value < 0:
        raise ValueError("--max-stop-sequences and --max-top-n-tokens must be >= 0")


def _share(option: str, value: float | None) -> None:
    if value is not None and (not _real(value) or not 0 < value <= 1):
        raise ValueError(f"{option} must be in (0, 1], got {value}")


def _device(option: str, value: str | None) -> None:
    if value not in (None, "cpu", "cuda"):
        raise ValueError(f"{option} must be cpu or cuda, got {value}")


def _number_at_least_0(option: str, value: float) -> None:
    if not _real(value) or value < 0:
        raise ValueError(f"{option} must be a number >= 0, got {value}")


def _number_above_0(option: str, value: float) -> None:
    if not _real(value) or value <= 0:
        raise ValueError(f"{option} must be a number > 0, got {value}")


def _integer_at_least_0(option: str, value: int) -> None:
    if not _integer(value) or value < 0:
        raise ValueError(f"{option} must be an integer >= 0, got {value}")


def _speculate(option: str, value: int) -> None:
    if not _integer(value) or not 0 <= value <= MAX_SPECULATE:
        raise ValueError(f"{option} must be an integer from 0 to {MAX_SPECULATE}, got {value!r}")


def _cuda_graphs(option: str, graphs: list[int] | None) -> None:
    if graphs is None:
        return
    if not isinstance(graphs, list) or not all(_integer(b) and b > 0 for b in graphs) or any(
        a >= b for a, b in zip(graphs, graphs[1:])
    ):
        raise ValueError(f"{option} must be increasing batch sizes >= 1 (or 0 alone to disable), got {graphs}")


# -- LoRA adapters (models/adapters.py) ------------------------------------------------------------
DEFAULT_MAX_LORA_RANK = 64


def parse_lora_adapters(values: list[str], where: str) -> list[str]:
    """--lora-adapters (TGI's flag; LORA_ADAPTERS): `name=path` or a bare `path` (named by its folder),
    repeatable or comma-separated; each as `name=path`, names unique."""
    out: dict[str, str] = {}
    for value in values:
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            name, sep, path = part.partition("=")
            if not sep:
                path = part
                name = path.rstrip("/").rsplit("/", 1)[-1]
            name, path = name.strip(), path.strip()
            if not name or not path:
                raise ValueError(f"{where}: '{part}' must be name=path or a path")
            if name in out:
                raise ValueError(f"{where}: adapter name '{name}' is given twice")
            out[name] = os.path.abspath(os.path.expanduser(path))  # the ranks' working folder may differ
    return [f"{name}={path}" for name, path in out.items()]


def _directory(option: str, value: str | None) -> None:
    if value is not None and not os.path.isdir(os.path.expanduser(value)):
        raise ValueError(f"{option} must be an existing directory, got {value!r}")


def check_choice(option: str, value: str | None, choices: tuple[str, ...]) -> None:
    """Flag.choices' rule (None is allowed: the flag's default where it has one)."""
    if value is not None and value not in choices:
        raise ValueError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(kw_only=True)
class ServeArgs:
    model: str | None = setting(
        None, f"Checkpoint folder, or '{EMBEDDED_MODEL_ID}' (the embedded default); or --model-id / MODEL_ID.",
        argument="MODEL_DIR", param="model_dir", tgi="model_id",
    )
    # -- network
    hostname: str = setting(
        "127.0.0.1", "Address of the client APIs (gRPC, and HTTP with --http-port). HOSTNAME is used only when it "
        "holds an address (container runtimes set it to a host name).",
    )
    port: int = setting(50051, "Port of the client gRPC API.", check=_tcp_port)
    metrics_port: int = setting(9000, "Prometheus /metrics port.", tgi="prometheus_port", check=_tcp_port)
    uds_path: str = setting("/tmp/text-generation-server", "Shard sockets are {uds_path}-{rank}.",
                            tgi="shard_uds_path")
    metrics_hostname: str | None = setting(  # None = where the client API listens (hostname)
        None, "Address of /metrics (default: --hostname's). It is plain HTTP.",
    )
    # -- who may call the client API (router/auth.py, router/tls.py). The keys never leave the
    # launcher: repr hides them and to_json (the ranks' copy) drops them.
    api_keys: list[str] = setting(
        [], "Calls must send metadata 'authorization: Bearer KEY' (repeatable; API_KEY may hold several, "
        "comma-separated, to rotate keys).", repr=False, param="api_key", metavar="KEY", parse=api_keys_given,
    )
    api_key_file: str | None = setting(  # one key per line, re-read when it changes
        None, "API keys, one per line; re-read when it changes or on SIGHUP.",
    )
    api_key_protects_health: bool = setting(  # health and reflection need a key too
        False, "Health and reflection need the key too (default: open, for probes).",
    )
    tls_cert_path: str | None = setting(
        None, "PEM certificate chain: the client API speaks TLS. Re-read when it changes or on SIGHUP.",
    )
    tls_key_path: str | None = setting(None, "PEM private key of --tls-cert-path (unencrypted).")
    tls_client_ca_path: str | None = setting(  # mutual TLS: client certificates must chain to this CA
        None, "PEM CA certificates: clients must present a certificate they signed (mutual TLS).",
    )
    # -- model and ranks
    num_shard: int = setting(
        1, "Tensor-parallel ranks (default 1).", option_default=None, check=_at_least_1,
        companions=(Flag(
            "TGI's switch: true runs one rank per visible GPU (or --num-shard ranks), false one rank.",
            param="sharded", metavar="true|false", option_type=Optional[str], option_default=None, parse=parse_bool,
        ),),
    )
    quantize: str | None = setting(None, "Quantization method (default: from the checkpoint).")
    dtype: str | None = setting(None, "float32, float16 or bfloat16.")
    device: str | None = setting(  # None = cuda when available
        None, "cpu or cuda (default: cuda when available).", check=_device,
    )
    model_impl: str = setting(
        "auto", "auto: this server's implementation of the family, else transformers' modeling code over its "
        "paged cache; native refuses other types; transformers always takes the latter.", choices=MODEL_IMPLS,
    )
    quantize_lm_head: str | None = setting(  # "int8": a dense lm_head runs as per-row int8
        None, "Run a dense lm_head as per-row int8 (the head is a small model's largest matrix and decode "
        "reads it every step); none keeps it as the checkpoint stores it. Default: int8 on the CPU for a "
        "checkpoint quantized to 8 bits or fewer (as llama.cpp keeps its head at 6-8 bits), none otherwise.",
        choices=LM_HEAD_CHOICES,
    )
    # -- request limits
    max_input_tokens: int | None = setting(
        None, "Longest prompt in tokens (default: --max-total-tokens - 1).", tgi="max_input_length",
        check=_at_least_1,
    )
    max_total_tokens: int | None = setting(
        None, "Longest prompt + generation in tokens (default: min(max positions, 4096)).", check=_at_least_1,
    )
    max_stop_sequences: int = setting(4, "Most stop sequences per request.", check=_request_limit)
    max_stop_sequence_length: int = setting(256, "Longest stop sequence, in characters.", check=_at_least_1)
    max_top_n_tokens: int = setting(5, "Most alternative tokens a request may ask for per step.",
                                    check=_request_limit)
    max_input_chars: int = setting(1_000_000, "Longest prompt in characters, checked before tokenizing.",
                                   check=_at_least_1)
    max_message_bytes: int = setting(4 * 2**20, "Largest request accepted (a gRPC message, an HTTP body), in bytes.",
                                     tgi="payload_limit", check=_at_least_1)
    # -- batching and scheduling. A waiting request joins the running batch (pausing it for a
    # prefill) once it has waited max_waiting_tokens decode steps, or as soon as waiting/running
    # requests exceed waiting_served_ratio (TGI's knobs and defaults).
    max_concurrent_requests: int = setting(
        128, "Requests in flight before new ones are refused (RESOURCE_EXHAUSTED).", check=_at_least_1,
    )
    max_batch_prefill_tokens: int | None = setting(
        None, "Most prompt tokens in one prefill (default: --max-input-tokens + 50).", check=_at_least_1,
    )
    max_batch_total_tokens: int | None = setting(
        None, "Most tokens (prompts + generations) in a running batch (default: what the KV cache holds).",
        check=_at_least_1,
    )
    max_batch_size: int | None = setting(None, "Most requests in a running batch (default: no limit).",
                                         check=_at_least_1)
    max_waiting_tokens: int = setting(
        20, "Decode steps a waiting request may wait before the running batch pauses to admit it.",
        check=_integer_at_least_0,
    )
    waiting_served_ratio: float = setting(
        1.2, "Admit waiting requests early once waiting / running exceeds this ratio.", check=_number_at_least_0,
    )
    speculate: int = setting(  # n-gram tokens proposed per request and decode step (TGI's --speculate)
        0, "Speculative decoding: each decode step checks up to N tokens proposed from the request's own "
        f"earlier tokens (n-gram lookup) in one forward; the output is unchanged (0 to {MAX_SPECULATE}, 0 = off).",
        metavar="N", check=_speculate,
    )
    # -- memory and kernels
    block_size: int = setting(16, "KV cache block size in tokens.", check=_at_least_1)
    memory_fraction: float | None = setting(  # of free memory for the KV cache; None = 0.1 on CPU, 0.9 on CUDA
        None, "Share of the memory free after warmup given to the KV cache (default 0.1 on CPU, 0.9 on CUDA).",
        check=_share,
    )
    cuda_memory_fraction: float = setting(  # cap on each rank's CUDA allocations, as a share of total GPU memory
        1.0, "TGI's cap on each rank's CUDA memory, as a share of the GPU's total; the KV cache takes "
        "--memory-fraction of what is free inside it.", check=_share,
    )
    kv_cache_dtype: str = setting(
        "auto", "KV cache dtype: auto (the checkpoint's declared KV dtype, else the model's), fp8_e4m3fn or "
        "fp8_e5m2 (aliases fp8, fp8_e4m3): twice a 16-bit cache's tokens in the same memory. Scales come from "
        "the checkpoint (compressed-tensors kv_cache_scheme, ModelOpt kv_cache_quant_algo), else 1.0.",
        choices=KV_CACHE_DTYPES, parse=parse_kv_cache_dtype,
    )
    kv_cache_fp8_skip_layers: str = setting(
        "auto", "Layers an fp8 KV cache keeps in the model's dtype: auto (measured at load: where fp8 rounding "
        "erases what a layer's keys or values vary by from token to token, e.g. Qwen2.5's layers 0-1), none "
        "(every layer fp8), or layer ids such as 0,1 or 0-3,9.", metavar="auto|none|IDS",
        parse=parse_kv_skip_layers,
    )
    prefix_caching: bool = setting(
        True, "Reuse the KV cache of prompt prefixes seen before (USE_PREFIX_CACHING is read too).",
        tgi="use_prefix_caching", tgi_older=True,
    )
    cuda_graphs: list[int] | None = setting(  # batch sizes to capture; None = DEFAULT_CUDA_GRAPHS, [] = none
        None, "Batch sizes captured as CUDA graphs, e.g. 1,2,4,8 (default 1,2,4,8,16,32,64,128, those up to the batch limit; 0 disables).",
        metavar="SIZES", option_type=Optional[str], parse=parse_cuda_graphs, check=_cuda_graphs,
    )
    attention_backend: str | None = setting(  # None = chosen for the device
        None, "Attention implementation (default: the best for the device).", choices=ATTENTION_BACKENDS,
    )
    disable_custom_kernels: bool = setting(  # no Triton/custom CUDA kernels (TGS_DISABLE_KERNELS in the ranks)
        False, f"No custom CUDA kernels: turns off {', '.join(CUSTOM_KERNELS)} and uses "
        f"{PORTABLE_ATTENTION_BACKEND} attention.",
    )
    allow_dense_fallback: bool = setting(  # quantized layers may run dequantized on CUDA (TGS_ALLOW_DENSE_FALLBACK)
        False, "Let quantized layers with no CUDA kernel run dequantized (more memory) instead of failing.",
    )
    cpu_isa: str = setting(  # the ranks start with serve_flags.cpu_isa_environment(cpu_isa)
        "native", "Instruction set of the CPU kernels: native (the best this CPU has) or avx2 (ours, torch's "
        "and oneDNN's AVX2 variants, as on an AVX2-only machine).", choices=CPU_ISAS, env=(CPU_ISA_ENV,),
    )
    cpu_int8_activations: str = setting(  # the ranks get CPU_INT8_ACTIVATIONS_ENV (kernels/cpu_act_int8.py reads it)
        "auto", "int4 layers on CPUs: round activations to int8 per 32-wide block and multiply in integers, as "
        "llama.cpp does (faster decode, ~0.2-0.5% relative error per product): auto (where the CPU has AVX2 or "
        "AVX512-VNNI integer dot products; int8 layers too where it lacks AVX512-BF16), on, or off (exact "
        "bfloat16 activations).",
        choices=CPU_INT8_ACTIVATIONS_MODES, env=(CPU_INT8_ACTIVATIONS_ENV,),
    )
    cpu_affinity: str = setting(  # launcher/cpu_affinity.py: each CPU rank pins itself, the router takes what is left
        "auto", "CPU ranks: auto binds each rank's threads to cores of their own and the router to a core the ranks "
        "leave over (when they leave one); off leaves placement to the OS scheduler.",
        choices=CPU_AFFINITY_MODES, env=(CPU_AFFINITY_ENV,),
    )
    disable_grammar_support: bool = setting(  # requests with parameters.grammar are refused (TGI's flag)
        False, "Refuse requests with parameters.grammar (JSON schema / regex constrained output).",
    )
    # -- LoRA adapters: slots preallocated on every rank, counted by warmup before the KV cache
    lora_adapters: list[str] = setting(  # "name=path" each (parse_lora_adapters)
        [], "LoRA adapters (PEFT folders) loaded at startup: name=path or a path (named by its folder), "
        "repeatable or comma-separated; requests name them in adapter_id.", metavar="NAME=PATH",
        parse=parse_lora_adapters,
    )
    max_loras: int | None = setting(  # None = len(lora_adapters); 0 slots = LoRA off
        None, "Adapter slots reserved on every rank (default: as many as --lora-adapters names; set it to load "
        "more at run time).", check=_at_least_1,
    )
    max_lora_rank: int = setting(
        DEFAULT_MAX_LORA_RANK, "Largest adapter rank accepted; each slot reserves this rank for every adaptable "
        "linear.", check=_at_least_1,
    )
    # -- lifecycle and logs
    drain_timeout_s: float = setting(
        60.0, "On SIGTERM/SIGINT, how long in-flight requests may run before they are cancelled.",
        tgi="graceful_termination_timeout", check=_number_at_least_0,
    )
    rank_stall_timeout_s: float = setting(  # a rank whose model call runs longer is reported unhealthy
        300.0, "A rank whose model call runs longer than this is reported unhealthy.", check=_number_above_0,
    )
    logger_level: str = setting(
        "INFO", "trace, debug, info, warning or error; TGI's LOG_LEVEL values are accepted too.",
        env=("LOGGER_LEVEL", "LOG_LEVEL"), parse=parse_log_level,
    )
    json_output: bool = setting(
        False, "Log one JSON object per line (timestamp, level, message, target, component, request_id).",
    )
    shard_only: bool = setting(
        False, "Run one rank only (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment).",
    )
    shard_in_process: bool = setting(  # launcher/in_process.py: no gRPC hop between router and rank
        False, "Run the one rank's model inside the router's process (one rank only): a decode step skips the "
        "gRPC hop between them (half a batch-1 step's host time on a CPU; nothing at large batches).",
    )
    # -- the HTTP APIs (router/http/): OpenAI's and TGI's, beside the gRPC API on the same scheduler,
    # behind the same API keys and TLS files
    http_port: int | None = setting(  # None = no HTTP API
        None, "Also serve OpenAI's (/v1/chat/completions, /v1/completions, /v1/models) and TGI's (/generate, "
        "/generate_stream, /tokenize, /info, /health) HTTP APIs on this port, at --hostname (default: off).",
        check=_optional_tcp_port,
    )
    cors_allow_origin: list[str] = setting(  # TGI's flag: origins allowed by CORS on the HTTP port
        [], "Origins browsers may call the HTTP API from (repeatable or comma-separated; '*' for any).",
        metavar="ORIGIN", parse=parse_origins,
    )
    max_client_batch_size: int = setting(  # TGI's flag: prompts x n of one HTTP request
        4, "Most sequences one HTTP request may ask for: prompts of /v1/completions times n.",
        check=_at_least_1,
    )
    tool_call_parser: str | None = setting(  # None = read from the chat template
        None, "How the model writes tool calls, for tool_choice auto (default: read from the chat template; "
        "else hermes).", choices=TOOL_CALL_PARSERS,
    )
    # -- LoRA adapters loaded and unloaded at run time (the client API's LoadAdapter / UnloadAdapter,
    # router/adapter_admin.py): off unless a directory is named; on a port without API keys, only
    # with the second switch too
    lora_load_dir: str | None = setting(  # None = LoadAdapter / UnloadAdapter refused
        None, "Allow LoadAdapter / UnloadAdapter on the client API, for adapter folders inside DIR only "
        "(symlinks and '..' resolved); without API keys, only with --lora-load-without-api-key too.",
        metavar="DIR", check=_directory,
    )
    lora_load_without_api_key: bool = setting(  # the client port has no keys: anyone may load
        False, "Allow run-time adapter loading (--lora-load-dir) on a server without API keys: any caller "
        "who reaches the port may then load adapters from that directory.",
    )
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Checks each setting's rule, then the relations between limits; raises ValueError naming the flag."""
        for item in dataclasses.fields(self):
            flag = flag_of(item)
            if flag is None:
                continue
            option, value = option_name(flag.param or item.name), getattr(self, item.name)
            if flag.choices:
                check_choice(option, value, flag.choices)
            if flag.check is not None:
                flag.check(option, value)
        if self.max_input_tokens is not None and self.max_total_tokens is not None:
            if self.max_input_tokens >= self.max_total_tokens:
                raise ValueError(
                    f"--max-input-tokens ({self.max_input_tokens}) must be < --max-total-tokens "
                    f"({self.max_total_tokens})"
                )
        # max_batch_prefill_tokens below max_input_tokens is fine: longer prompts are prefilled in
        # chunks (the router refuses it only if the shards cannot chunk).
        if self.max_batch_total_tokens is not None and self.max_total_tokens is not None:
            if self.max_batch_total_tokens < self.max_total_tokens:
                raise ValueError(
                    f"--max-batch-total-tokens ({self.max_batch_total_tokens}) must be >= "
                    f"--max-total-tokens ({self.max_total_tokens})"
                )
        if self.disable_custom_kernels and self.attention_backend not in (None, PORTABLE_ATTENTION_BACKEND):
            raise ValueError(
                f"--disable-custom-kernels rules out --attention-backend {self.attention_backend} "
                f"(use {PORTABLE_ATTENTION_BACKEND})"
            )
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            missing = "--tls-cert-path" if self.tls_cert_path is None else "--tls-key-path"
            raise ValueError(f"--tls-cert-path and --tls-key-path go together: {missing} is missing")
        if self.max_loras is not None and len(self.lora_adapters) > self.max_loras:
            raise ValueError(f"--lora-adapters names {len(self.lora_adapters)} adapters, over --max-loras "
                             f"{self.max_loras}")
        if self.tls_client_ca_path is not None and self.tls_cert_path is None:
            raise ValueError("--tls-client-ca-path needs --tls-cert-path and --tls-key-path (mutual TLS is TLS)")
        if self.shard_in_process and self.num_shard is not None and self.num_shard > 1:
            raise ValueError(f"--shard-in-process runs one rank; --num-shard is {self.num_shard} (tensor-parallel "
                             "ranks each need their own process)")
        if self.shard_in_process and self.shard_only:
            raise ValueError("--shard-in-process and --shard-only contradict each other: one runs the rank inside "
                             "the router, the other a rank without a router")
        if self.lora_load_without_api_key and self.lora_load_dir is None:
            raise ValueError("--lora-load-without-api-key opens run-time loading, which needs --lora-load-dir DIR")

    @property
    def requires_api_key(self) -> bool:
        return bool(self.api_keys) or self.api_key_file is not None

    @property
    def effective_metrics_hostname(self) -> str:
        """Where /metrics listens: its own flag, else beside the client API."""
        return self.metrics_hostname or self.hostname

    @property
    def lora_slots(self) -> int:
        """Adapter slots each rank reserves: --max-loras, else one per --lora-adapters (0: LoRA off)."""
        return self.max_loras if self.max_loras is not None else len(self.lora_adapters)

    @property
    def effective_cuda_graphs(self) -> list[int]:
        """The batch sizes to capture: the flag's, else TGI's default buckets."""
        return list(DEFAULT_CUDA_GRAPHS) if self.cuda_graphs is None else list(self.cuda_graphs)

    @property
    def effective_attention_backend(self) -> str | None:
        """The flag's backend; the portable one when custom kernels are off; None = the device's choice."""
        if self.attention_backend is None and self.disable_custom_kernels:
            return PORTABLE_ATTENTION_BACKEND
        return self.attention_backend

    def to_json(self) -> str:
        """The settings as the ranks get them (in their environment), without the API keys:
        ranks never check keys, and a process environment is readable by its user's tools."""
        return json.dumps(dataclasses.asdict(dataclasses.replace(self, api_keys=[])))

    @classmethod
    def from_json(cls, text: str) -> "ServeArgs":
        return cls(**json.loads(text))
