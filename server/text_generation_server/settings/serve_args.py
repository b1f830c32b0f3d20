"""The settings of `serve`, shared by the launcher, the router and the shard processes."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

# Attention implementations a rank can be asked for; None picks one for the device.
ATTENTION_BACKENDS = ("triton-paged", "torch-sdpa")
# The attention backend that needs none of our custom kernels (--disable-custom-kernels).
PORTABLE_ATTENTION_BACKEND = "torch-sdpa"
# Which code computes the model (models.model_impl): auto = native when a family covers the
# model_type, else transformers' modeling code over our cache.
MODEL_IMPLS = ("auto", "native", "transformers")
# --quantize-lm-head: how a dense lm_head may be run instead (models.quantize_head).
LM_HEAD_QUANTIZATIONS = ("int8",)
# Batch sizes captured as CUDA graphs when --cuda-graphs is not given (TGI's default).
DEFAULT_CUDA_GRAPHS = (1, 2, 4, 8, 16, 32)
# --speculate: the most n-gram tokens a request proposes per step (generation/speculation.py).
# Beyond a handful a guess from an n-gram is rarely right all the way, while every proposed
# position costs a token of compute.
MAX_SPECULATE = 8


@dataclass
class ServeArgs:
    model: str | None = None
    hostname: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9000
    num_shard: int = 1
    quantize: str | None = None
    dtype: str | None = None
    uds_path: str = "/tmp/text-generation-server"
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_batch_size: int | None = None
    max_concurrent_requests: int = 128
    max_stop_sequences: int = 4
    max_stop_sequence_length: int = 256
    max_top_n_tokens: int = 5
    max_input_chars: int = 1_000_000
    max_message_bytes: int = 4 * 2**20
    block_size: int = 16
    memory_fraction: float | None = None  # of free memory for the KV cache; None = 0.1 on CPU, 0.9 on CUDA
    device: str | None = None  # "cpu" or "cuda"; None = cuda when available
    logger_level: str = "INFO"
    json_output: bool = False
    shard_only: bool = False
    drain_timeout_s: float = 60.0
    # Scheduler: a waiting request joins the running batch (pausing it for a prefill) once it
    # has waited max_waiting_tokens decode steps, or as soon as waiting/running requests
    # exceed waiting_served_ratio (TGI's knobs and defaults).
    max_waiting_tokens: int = 20
    waiting_served_ratio: float = 1.2
    prefix_caching: bool = True
    cuda_graphs: list[int] | None = None  # batch sizes to capture; None = DEFAULT_CUDA_GRAPHS, [] = none
    attention_backend: str | None = None  # one of ATTENTION_BACKENDS; None = chosen for the device
    disable_custom_kernels: bool = False  # no Triton/custom CUDA kernels (TGS_DISABLE_KERNELS in the ranks)
    allow_dense_fallback: bool = False  # quantized layers may run dequantized on CUDA (TGS_ALLOW_DENSE_FALLBACK)
    cuda_memory_fraction: float = 1.0  # cap on each rank's CUDA allocations, as a share of total GPU memory
    rank_stall_timeout_s: float = 300.0  # a rank whose model call runs longer is reported unhealthy
    model_impl: str = "auto"  # auto | native | transformers (models.MODEL_IMPLS)
    speculate: int = 0  # n-gram tokens proposed per request and decode step (TGI's --speculate); 0: none
    quantize_lm_head: str | None = None  # "int8": a dense lm_head runs as per-row int8
    disable_grammar_support: bool = False  # requests with parameters.grammar are refused (TGI's flag)
    # Who may call the client API (router/auth.py, router/tls.py). The keys never leave the
    # launcher: repr hides them and to_json (the ranks' copy) drops them.
    api_keys: list[str] = field(default_factory=list, repr=False)
    api_key_file: str | None = None  # one key per line, re-read when it changes
    api_key_protects_health: bool = False  # health and reflection need a key too
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_client_ca_path: str | None = None  # mutual TLS: client certificates must chain to this CA
    metrics_hostname: str | None = None  # None = where the client API listens (hostname)
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Checks ranges and the relations between limits; raises ValueError naming the flag."""
        def positive(name: str, value: int | None) -> None:
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

        for name in ("num_shard", "max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens",
                     "max_batch_total_tokens", "max_batch_size", "max_concurrent_requests", "block_size",
                     "max_stop_sequence_length", "max_input_chars", "max_message_bytes"):
            positive(name, getattr(self, name))
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be a TCP port (0-65535), got {value}")
        if self.max_stop_sequences < 0 or self.max_top_n_tokens < 0:
            raise ValueError("--max-stop-sequences and --max-top-n-tokens must be >= 0")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")
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
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device}")
        if not _real(self.drain_timeout_s) or self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout-s must be a number >= 0, got {self.drain_timeout_s}")
        if not _integer(self.max_waiting_tokens) or self.max_waiting_tokens < 0:
            raise ValueError(f"--max-waiting-tokens must be an integer >= 0, got {self.max_waiting_tokens}")
        if not _real(self.waiting_served_ratio) or self.waiting_served_ratio < 0:
            raise ValueError(f"--waiting-served-ratio must be a number >= 0, got {self.waiting_served_ratio}")
        if not _real(self.rank_stall_timeout_s) or self.rank_stall_timeout_s <= 0:
            raise ValueError(f"--rank-stall-timeout-s must be a number > 0, got {self.rank_stall_timeout_s}")
        if not _real(self.cuda_memory_fraction) or not 0 < self.cuda_memory_fraction <= 1:
            raise ValueError(f"--cuda-memory-fraction must be in (0, 1], got {self.cuda_memory_fraction}")
        if self.cuda_graphs is not None:
            graphs = self.cuda_graphs
            if not isinstance(graphs, list) or not all(_integer(b) and b > 0 for b in graphs) or any(
                a >= b for a, b in zip(graphs, graphs[1:])
            ):
                raise ValueError(
                    f"--cuda-graphs must be increasing batch sizes >= 1 (or 0 alone to disable), got {graphs}"
                )
        if self.quantize_lm_head is not None and self.quantize_lm_head not in LM_HEAD_QUANTIZATIONS:
            raise ValueError(f"--quantize-lm-head must be one of {', '.join(LM_HEAD_QUANTIZATIONS)}, got "
                             f"{self.quantize_lm_head!r}")
        if not _integer(self.speculate) or not 0 <= self.speculate <= MAX_SPECULATE:
            raise ValueError(f"--speculate must be an integer from 0 to {MAX_SPECULATE}, got {self.speculate!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.disable_custom_kernels and self.attention_backend not in (None, PORTABLE_ATTENTION_BACKEND):
            raise ValueError(
                f"--disable-custom-kernels rules out --attention-backend {self.attention_backend} "
                f"(use {PORTABLE_ATTENTION_BACKEND})"
            )
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            missing = "--tls-cert-path" if self.tls_cert_path is None else "--tls-key-path"
            raise ValueError(f"--tls-cert-path and --tls-key-path go together: {missing} is missing")
        if self.tls_client_ca_path is not None and self.tls_cert_path is None:
            raise ValueError("--tls-client-ca-path needs --tls-cert-path and --tls-key-path (mutual TLS is TLS)")

    @property
    def requires_api_key(self) -> bool:
        return bool(self.api_keys) or self.api_key_file is not None

    @property
    def effective_metrics_hostname(self) -> str:
        """Where /metrics listens: its own flag, else beside the client API."""
        return self.metrics_hostname or self.hostname

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


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
