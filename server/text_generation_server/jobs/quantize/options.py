"""`quantize`'s options and errors: what a run is asked to do, validated before any model is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from text_generation_server.quantizers.rtn import SUPPORTED_BITS

METHODS = ("gptq", "rtn")
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class QuantizeError(ValueError):
    """The quantize command cannot run with these arguments on this model."""


@dataclass(frozen=True)
class QuantizeOptions:
    bits: int = 4
    group_size: int = 128  # -1: per output channel
    sym: bool = True
    act_order: bool = False
    static_groups: bool = False
    percdamp: float = 0.01
    true_sequential: bool = True
    method: str = "gptq"
    checkpoint_format: str = "gptq"
    modules_to_not_convert: tuple[str, ...] = ()
    dataset: Path | None = None  # None: the train split of the stdlib corpus
    nsamples: int = 128
    seqlen: int | None = None  # None: min(2048, max_position_embeddings)
    seed: int = 0
    overwrite: bool = False
    max_shard_bytes: int = 2 * 1024**3
    device: str = "cpu"

    def validate(self) -> None:
        """Checks that need no model, so a typo fails before anything is read."""
        if self.bits not in SUPPORTED_BITS:
            raise QuantizeError(f"--bits {self.bits} is not supported (choose {', '.join(map(str, SUPPORTED_BITS))})")
        if self.group_size != -1 and self.group_size <= 0:
            raise QuantizeError(f"--groupsize must be -1 (per-channel) or positive, got {self.group_size}")
        if self.method not in METHODS:
            raise QuantizeError(f"--method '{self.method}' is not supported (choose {', '.join(METHODS)})")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise QuantizeError(f"--checkpoint-format '{self.checkpoint_format}' is not supported "
                                f"(choose {', '.join(CHECKPOINT_FORMATS)})")
        if not 0.0 <= self.percdamp < 1.0:
            raise QuantizeError(f"--percdamp must be in [0, 1), got {self.percdamp}")
        if self.nsamples < 1:
            raise QuantizeError(f"--nsamples must be at least 1, got {self.nsamples}")
        if self.seqlen is not None and self.seqlen < 1:
            raise QuantizeError(f"--seqlen must be at least 1, got {self.seqlen}")
        if self.method == "rtn" and self.act_order:
            raise QuantizeError("--act-order orders columns by calibration statistics: it needs --method gptq")
        if self.max_shard_bytes < 1:
            raise QuantizeError("the shard size must be positive")
        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise QuantizeError(f"--device '{self.device}' is not supported (choose cpu or cuda)")
        if kind == "cuda" and not torch.cuda.is_available():
            raise QuantizeError(f"--device {self.device}: CUDA is not available on this machine")

    @property
    def min_zero(self) -> int:
        # GPTQ v1 stores z - 1, so an asymmetric zero point of 0 cannot be written.
        return 1 if self.checkpoint_format == "gptq" and not self.sym else 0

    def quantization_config(self, seqlen: int | None = None) -> dict:
        """config.json's quantization_config: every key GPTQ loaders read, written truthfully."""
        config = {
            "quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.act_order,
            "sym": self.sym, "static_groups": self.static_groups, "damp_percent": self.percdamp,
            "true_sequential": self.true_sequential, "checkpoint_format": self.checkpoint_format, "lm_head": False,
            "meta": {"quantizer": "text-generation-server", "method": self.method, "nsamples": self.nsamples,
                     "seqlen": seqlen if seqlen is not None else self.seqlen, "seed": self.seed,
                     "dataset": str(self.dataset) if self.dataset is not None else "stdlib-corpus:train"},
        }
        if self.modules_to_not_convert:
            config["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return config
