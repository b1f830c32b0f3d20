"""The attention-backend registry: an ordered list per device, each backend saying whether it can
run a model (`can_implement(spec) -> (ok, reason)`), like the quantized-kernel registry.

CUDA: `triton-paged` (Triton kernels reading K/V straight from the block tables: decode split
along the sequence, varlen prefill over the flattened batch; graph-safe) before `torch-sdpa`.
CPU: `torch-sdpa`; `triton-paged` runs there only under TRITON_INTERPRET=1 (tests).
`--attention-backend NAME` (TGS_ATTENTION_BACKEND) asks for one by name; when it cannot run,
startup fails with its reason rather than silently taking another.
"""

from __future__ import annotations

import os

import torch
from loguru import logger

from text_generation_server.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    TorchAttention,
)

ATTENTION_ENV = "TGS_ATTENTION_BACKEND"


class TritonPagedAttention(AttentionBackend):
    """kernels/paged_attention.py: no gather, GQA heads share K/V loads, flash-decoding splits."""

    name = "triton-paged"
    graph_safe = True

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        from text_generation_server.kernels import paged_attention

        self._kernels = paged_attention
        self._sms: int | None = None

    @classmethod
    def can_implement(cls, spec: AttentionSpec) -> tuple[bool, str]:
        try:
            from text_generation_server.kernels import paged_attention
        except ImportError as exc:
            return False, f"the Triton kernels cannot be imported ({exc})"
        ok, reason = paged_attention.paged_attention_available(torch.device(spec.device_type))
        if not ok:
            return False, reason
        if spec.heads % spec.kv_heads:
            return False, f"{spec.heads} query heads are not a multiple of {spec.kv_heads} KV heads"
        if spec.block_size & (spec.block_size - 1) or spec.block_size > 256:
            return False, f"block size {spec.block_size} is not a power of two <= 256"
        if spec.head_dim > 256:
            return False, f"head_dim {spec.head_dim} > 256"
        return True, ""

    def num_splits(self, meta: AttentionMetadata, batch: int) -> int:
        """Sequence splits for a decode step; a captured graph passes its own fixed value."""
        fixed = meta.memo("num_splits", lambda: None)
        if fixed is not None:
            return fixed
        if self._sms is None and torch.cuda.is_available() and self.spec.device_type == "cuda":
            self._sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        return self._kernels.decode_splits(meta.max_seq_len, self.spec.block_size, batch, self.spec.kv_heads,
                                           self._sms)

    def _int32(self, meta: AttentionMetadata, key: str, tensor: torch.Tensor) -> torch.Tensor:
        return meta.memo(key, lambda: tensor if tensor.dtype == torch.int32 else tensor.to(torch.int32))

    def prefill(self, q, k, v, key_cache, value_cache, meta, scale, window):
        seq_lens = meta.memo("prefill_seq_lens", lambda: torch.tensor(
            [c + n for c, n in zip(meta.cache_lens or [0] * len(meta.prefill_lens), meta.prefill_lens)],
            dtype=torch.int32, device=q.device))
        tables = self._int32(meta, "tables32", meta.block_tables)
        return self._kernels.paged_prefill(
            q, key_cache, value_cache, meta.cu_seqlens_q(q.device), seq_lens, tables, scale, window,
            max_q_len=max(meta.prefill_lens),
        )

    def decode(self, q, key_cache, value_cache, meta, scale, window):
        tables = self._int32(meta, "tables32", meta.block_tables)
        seq_lens = self._int32(meta, "seq_lens32", meta.seq_lens)
        workspace = meta.memo("decode_workspace", lambda: None)
        return self._kernels.paged_decode(
            q, key_cache, value_cache, tables, seq_lens, scale, window,
            num_splits=self.num_splits(meta, q.shape[0]), workspace=workspace,
        )


# Ordered, preferred first, per device type.
ATTENTION_BACKENDS: dict[str, list[type[AttentionBackend]]] = {
    "cuda": [TritonPagedAttention, TorchAttention],
    "cpu": [TorchAttention, TritonPagedAttention],
}


def backend_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(b.name for backends in ATTENTION_BACKENDS.values() for b in backends))


class NoAttentionBackendError(ValueError):
    pass


def choose_attention_backend(
    spec: AttentionSpec, requested: str | None = None
) -> tuple[AttentionBackend, list[tuple[str, str]]]:
    """The first backend of the device's list that can run `spec` (or the one asked for), with
    the reasons the ones before it were passed over."""
    requested = requested or os.environ.get(ATTENTION_ENV) or None
    candidates = ATTENTION_BACKENDS.get(spec.device_type, [TorchAttention])
    if requested is not None:
        known = backend_names()
        if requested not in known:
            raise NoAttentionBackendError(
                f"attention backend '{requested}' does not exist (choose from {', '.join(known)})")
        chosen = [b for b in candidates if b.name == requested]
        if not chosen:
            raise NoAttentionBackendError(f"attention backend '{requested}' does not run on {spec.device_type}")
        ok, reason = chosen[0].can_implement(spec)
        if not ok:
            raise NoAttentionBackendError(f"attention backend '{requested}' cannot run this model: {reason}")
        return chosen[0](spec), []
    rejected: list[tuple[str, str]] = []
    for backend in candidates:
        ok, reason = backend.can_implement(spec)
        if ok:
            return backend(spec), rejected
        rejected.append((backend.name, reason))
    reasons = "; ".join(f"{n}: {r}" for n, r in rejected)
    raise NoAttentionBackendError(f"no attention backend can run this model on {spec.device_type} ({reasons})")


def log_choice(backend: AttentionBackend, rejected: list[tuple[str, str]]) -> None:
    for name, reason in rejected:
        logger.info("attention backend {} passed over: {}", name, reason)
    logger.info("attention backend: {}", backend.name)
