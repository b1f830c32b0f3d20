"""`serve`'s flags as TGI's launcher users write them: from the environment, under TGI's names.

TGI's launcher reads every flag from an environment variable of the same name in upper
snake case (MODEL_ID, NUM_SHARD, MAX_TOTAL_TOKENS, ...), which is how Kubernetes manifests
configure it. `serve` does the same for its own flags and for TGI's names where ours differ
(each ServeArgs field declares its flag and TGI's name for it: settings/serve_args.py). A flag
on the command line wins over the environment; two names for one setting that disagree at the
same level (two flags, or two variables) are an error (cli/serve.py).

TGI flags with no meaning here (TGI_ONLY_FLAGS) are accepted by name only to be refused with
the reason, or, where they are harmless no-ops (--max-best-of, --usage-stats, ...), ignored
with a warning. Three variables are not read even though TGI reads them, because other
programs set them: HUGGINGFACE_HUB_CACHE (Hugging Face tools), MASTER_ADDR and MASTER_PORT
(torch.distributed; our launcher sets them for its ranks).

HOSTNAME is read as TGI reads it, with one exception for safety: container runtimes set it
to the container or pod name, which would silently expose the API on the pod's address. So
only an IP address or "localhost" in HOSTNAME is used; a name is ignored with a warning and
`serve` stays on 127.0.0.1 unless --hostname says otherwise.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Callable

# Kernels of our own (Triton) that --disable-custom-kernels switches off; the names are the
# kernels' `name` in the registry (text_generation_server.kernels). Library kernels (torch's
# tinygemm and _scaled_mm, bitsandbytes) stay on, as TGI keeps torch's.
CUSTOM_KERNELS = ("triton-gemm",)
DISABLE_KERNELS_ENV = "TGS_DISABLE_KERNELS"
ALLOW_DENSE_FALLBACK_ENV = "TGS_ALLOW_DENSE_FALLBACK"
# --cpu-isa: the instruction set the CPU kernels may use. "avx2" forces the AVX2 variants of ours
# (kernels/cpu_native.py reads CPU_ISA_ENV) and of torch's and oneDNN's, whose variables must be in
# a process's environment before it imports torch: the launcher starts the ranks with them.
CPU_ISAS = ("native", "avx2")
CPU_ISA_ENV = "TGS_CPU_ISA"


def cpu_isa_environment(isa: str) -> dict[str, str]:
    """The variables a rank process starts with for `--cpu-isa isa` ({} for native)."""
    if isa != "avx2":
        return {}
    return {CPU_ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def openmp_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """OpenMP's settings a rank process starts with, unless the user set their own: idle OpenMP
    threads sleep at once (OMP_WAIT_POLICY=passive) instead of spinning for milliseconds after each
    of torch's parallel ops, where they took the core the native kernels' pool and the router need
    (kernels/cpu_native_src.py's tgs::parallel_for; BENCHMARKS.md, issue #32 session 8: an int4 decode
    step 1.18-1.21x faster). libgomp reads it when torch loads, so it is set at the process's start."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"OMP_WAIT_POLICY": "passive"}

# TGI's level names (tracing's, lower case) and loguru's, to loguru's. tracing's "off" has no
# loguru twin: CRITICAL, the quietest level, is the nearest.
_LEVELS = {
    "trace": "TRACE", "debug": "DEBUG", "info": "INFO", "success": "SUCCESS", "warn": "WARNING",
    "warning": "WARNING", "error": "ERROR", "critical": "CRITICAL", "off": "CRITICAL",
}
_LEVEL_ORDER = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "y", "on", "t")
_FALSE = ("0", "false", "no", "n", "off", "f")


@dataclass(frozen=True)
class TgiFlag:
    """A TGI launcher flag that sets nothing here."""

    name: str  # TGI's argument, snake case
    reason: str
    refuse: bool  # False: a no-op, accepted with a warning
    is_flag: bool = False  # takes no value
    read_env: bool = True  # False where other programs set the variable
    quiet: tuple[str, ...] = ()  # values (lower case) that describe what this server does anyway: no warning

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def envvar(self) -> str:
        return self.name.upper()


TGI_ONLY_FLAGS: tuple[TgiFlag, ...] = (
    TgiFlag("revision", "models are local folders; there is no hub revision to pick", True),
    TgiFlag("rope_scaling", "RoPE scaling comes from the checkpoint's config.json (rope_scaling)", True),
    TgiFlag("rope_factor", "RoPE scaling comes from the checkpoint's config.json (rope_scaling)", True),
    TgiFlag("otlp_endpoint", "OpenTelemetry export is not supported; use /metrics and --json-output logs", True),
    TgiFlag("watermark_gamma", "watermarking is not supported by this server", True),
    TgiFlag("watermark_delta", "watermarking is not supported by this server", True),
    TgiFlag("tokenizer_config_path", "the chat template is read from the model folder (chat_template.jinja or "
            "tokenizer_config.json)", True),
    TgiFlag("weights_cache_override", "weights are read from MODEL_DIR; there is no weights cache", True),
    TgiFlag("ngrok", "ngrok tunnels are not supported; publish the gRPC port yourself", True, is_flag=True),
    TgiFlag("ngrok_authtoken", "ngrok tunnels are not supported; publish the gRPC port yourself", True),
    TgiFlag("ngrok_edge", "ngrok tunnels are not supported; publish the gRPC port yourself", True),
    TgiFlag("huggingface_hub_cache", "models are local folders; nothing is downloaded, so there is no hub cache",
            True, read_env=False),
    TgiFlag("master_addr", "the launcher rendezvouses its ranks on a free local port; ranks run by another "
            "launcher (--shard-only) read MASTER_ADDR from the environment", True, read_env=False),
    TgiFlag("master_port", "the launcher rendezvouses its ranks on a free local port; ranks run by another "
            "launcher (--shard-only) read MASTER_PORT from the environment", True, read_env=False),
    TgiFlag("env", "not supported; `python -m torch.utils.collect_env` prints the runtime environment", True,
            is_flag=True, read_env=False),
    TgiFlag("trust_remote_code", "ignored: no code from a checkpoint ever runs here, only built-in architectures",
            False, is_flag=True),
    TgiFlag("max_best_of", "ignored: best_of is not part of the API (one sequence per request)", False,
            quiet=("1",)),
    TgiFlag("validation_workers", "ignored: requests are validated on the router's thread pool", False),
    TgiFlag("otlp_service_name", "ignored: no OpenTelemetry export", False),
    TgiFlag("usage_stats", "ignored: this server collects no usage statistics", False, quiet=("off",)),
    TgiFlag("enable_prefill_logprobs", "ignored: prompt logprobs (decoder_input_details) are always available",
            False, is_flag=True, quiet=("true",)),
)


# -- values ----------------------------------------------------------------------------------------------
def parse_bool(text: str, where: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{where}: expected true or false (or 1/0, yes/no), got {text!r}")


def parse_log_level(text: str, where: str = "--logger-level") -> str:
    """A loguru level name from ours or TGI's LOG_LEVEL, including its env-filter syntax.

    TGI's "text_generation_launcher=debug,tokio=info" sets levels per crate: the directives for
    text_generation* targets and the bare ones count, others are ignored, and the most verbose
    of those is the level (one process here logs everything at one level).
    """
    levels = []
    for directive in (d.strip() for d in text.split(",")):
        if not directive:
            continue
        target, has_target, level = directive.rpartition("=")
        if has_target and not target.strip().startswith("text_generation"):
            continue
        name = _LEVELS.get(level.strip().lower())
        if name is None:
            raise ValueError(
                f"{where}: unknown level {level.strip()!r} in {text!r} (choose trace, debug, info, warn, error, "
                "or TGI's text_generation_launcher=<level>)"
            )
        levels.append(name)
    if not levels:
        raise ValueError(f"{where}: {text!r} sets no level for this server (text_generation targets)")
    return min(levels, key=_LEVEL_ORDER.index)


def parse_cuda_graphs(text: str, where: str = "--cuda-graphs") -> list[int]:
    """TGI's "1,2,4,8" as sorted unique batch sizes; "0" alone disables CUDA graphs ([])."""
    items = [item.strip() for item in text.split(",")]
    try:
        sizes = [int(item) for item in items]
    except ValueError:
        raise ValueError(
            f"{where}: expected comma-separated batch sizes such as 1,2,4,8 (or 0), got {text!r}"
        ) from None
    if sizes == [0]:
        return []
    if any(size < 1 for size in sizes):
        raise ValueError(f"{where}: batch sizes must be >= 1 (0 alone disables CUDA graphs), got {text!r}")
    return sorted(set(sizes))


def resolve_num_shard(sharded: bool | None, num_shard: int | None, device: str | None,
                      cuda_device_count: Callable[[], int]) -> int:
    """TGI's --sharded with --num-shard. true: one rank per visible GPU (at least two) unless
    --num-shard says how many; false: one rank. Unset: --num-shard, else 1 (TGI would take
    every visible GPU; a single rank is the safer default on a shared machine)."""
    if sharded is None:
        return num_shard or 1
    if not sharded:
        if num_shard not in (None, 1):
            raise ValueError(f"--sharded false contradicts --num-shard {num_shard}")
        return 1
    if num_shard is not None:
        if num_shard < 2:
            raise ValueError(f"--sharded true needs --num-shard >= 2, got {num_shard}")
        return num_shard
    count = 0 if device == "cpu" else cuda_device_count()
    if count == 0:
        raise ValueError("--sharded true: no CUDA device to count ranks from; give --num-shard N for N CPU ranks")
    if count < 2:
        raise ValueError(f"--sharded true needs at least 2 CUDA devices, found {count}")
    return count


def check_api_key(key: str, where: str) -> str:
    """A key as gRPC metadata can carry it: printable ASCII, no spaces, no commas (the separator).
    The error never quotes the key."""
    if not key:
        raise ValueError(f"{where}: an empty API key")
    bad = sum(1 for c in key if not 0x21 <= ord(c) <= 0x7E or c == ",")
    if bad:
        raise ValueError(f"{where}: an API key may hold only printable ASCII without spaces or commas "
                         f"({bad} other character(s) in one)")
    return key


def parse_api_keys(values: list[str], where: str) -> list[str]:
    """--api-key values (repeatable) and API_KEY (TGI's; here several may be comma-separated, so
    a new key can be added before the old one is retired) as one list of keys."""
    keys = [check_api_key(part.strip(), where) for value in values for part in value.split(",") if part.strip()]
    if values and not keys:
        raise ValueError(f"{where}: no API key in it")
    return keys


def api_keys_given(values: list[str], where: str) -> list[str]:
    """--api-key values, or API_KEY split on commas only: click splits a repeatable option's
    variable on whitespace, which would turn a key with a space into two keys instead of an error."""
    if where.startswith("environment variable "):
        values = [os.environ[where.removeprefix("environment variable ")]]
    return parse_api_keys(values, where)


def is_loopback(hostname: str) -> bool:
    """True for an address only this machine can reach."""
    if hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def hostname_from_env(value: str) -> str | None:
    """HOSTNAME's value when it is an address to bind; None for a host name (see the module doc)."""
    text = value.strip()
    if text == "localhost":
        return text
    try:
        ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    return text


def disabled_kernels_value(current: str | None) -> str:
    """TGS_DISABLE_KERNELS with CUSTOM_KERNELS added to whatever the user already disabled."""
    names = [n.strip() for n in (current or "").split(",") if n.strip()]
    return ",".join(names + [k for k in CUSTOM_KERNELS if k not in names])
