"""The settings of `serve`, shared by the launcher, the router and the shard processes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


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
        if self.max_batch_prefill_tokens is not None and self.max_input_tokens is not None:
            if self.max_batch_prefill_tokens < self.max_input_tokens:
                raise ValueError(
                    f"--max-batch-prefill-tokens ({self.max_batch_prefill_tokens}) must be >= "
                    f"--max-input-tokens ({self.max_input_tokens})"
                )
        if self.max_batch_total_tokens is not None and self.max_total_tokens is not None:
            if self.max_batch_total_tokens < self.max_total_tokens:
                raise ValueError(
                    f"--max-batch-total-tokens ({self.max_batch_total_tokens}) must be >= "
                    f"--max-total-tokens ({self.max_total_tokens})"
                )
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ServeArgs":
        return cls(**json.loads(text))
