"""The attention-backend registry: an ordered list per device, each backend saying whether it can
run a model (`can_implement(spec) -> (ok, reason)`), like the quantized-kernel registry.

CUDA: `triton-paged` (Triton kernels reading K/V straight from the block tables: decode split
along the sequence, varlen prefill over the flattened batch; graph-safe) before `torch-sdpa`.
CPU: `torch-sdpa`; `triton-paged` runs there only under TRITON_INTERPRET=1 (tests).
Both read and write an fp8 KV cache (`KVCache.scales_of`, passed to every call as kv_scales).
`--attention-backend NAME` (TGS_ATTENTION_BACKEND) asks for one by name; when it cannot run,
startup fails with its reason rather than silently taking another.

A graph-safe backend (`graph_safe`) also answers `capture_memo(batch, max_seq_len, device)`:
what a CUDA graph of that many decode rows must fix at capture (models/cuda_graphs.py), and
may answer `reserve_decode(max_batch, max_seq_len, device)`, which warmup calls so decode
steps allocate nothing of their own.
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
    """kernels/paged_attention.py: no gather, GQA heads share K/V loads, flash-decoding splits,
    logit soft-capping (Gemma 2) in both kernels.

    Decode's split partials live in one workspace the backend owns, sized at warmup
    (`reserve_decode`) for the largest batch and context the limits allow, so a decode step
    allocates nothing: the eager path takes views of it, and each CUDA graph bucket fixes its
    split count and keeps a reference to it (`capture_memo`).
    """

    name = "triton-paged"
    graph_safe = True

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        from text_generation_server.kernels import paged_attention

        self._kernels = paged_attention
        self._sms: int | None = None
        self._workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._workspace_rows = 0  # batch x heads x splits the workspace holds

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
        if spec.sinks:
            return False, "attention sinks (gpt-oss) are not in the Triton paged kernels"
        if spec.latent_dim:
            from text_generation_server.kernels.mla_decode import MAX_LATENT_DIM

            if spec.latent_dim > MAX_LATENT_DIM:
                return False, f"latent width {spec.latent_dim} > {MAX_LATENT_DIM} (the MLA decode kernel's)"
        return True, ""

    # -- decode splits and their workspace ------------------------------------------------------
    def splits_for(self, batch: int, max_seq_len: int) -> int:
        """Sequence splits for a decode step of `batch` rows whose longest context is max_seq_len."""
        if self._sms is None and self.spec.device_type == "cuda" and torch.cuda.is_available():
            self._sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        return self._kernels.decode_splits(max_seq_len, self.spec.block_size, batch, self.spec.kv_heads, self._sms)

    def num_splits(self, meta: AttentionMetadata, batch: int) -> int:
        """Sequence splits for a decode step; a captured graph passes its own fixed value."""
        fixed = meta.memo("num_splits", lambda: None)
        if fixed is not None:
            return fixed
        return self.splits_for(batch, meta.max_seq_len)

    def reserve_decode(self, max_batch: int, max_seq_len: int, device: torch.device) -> int:
        """Sizes the split workspace for every decode step up to `max_batch` rows and
        `max_seq_len` positions; returns the bytes newly allocated (0 when it already fits).

        A larger workspace replaces the old one without touching it: graphs captured against
        the old one keep their own reference (see `capture_memo`).
        """
        if self.spec.latent_dim:
            return 0  # latent attention decodes through mla_decode, which needs no split workspace
        # Steps with one split write no partials: only batches small enough to split count.
        rows = max((b * s for b in range(1, max_batch + 1) if (s := self.splits_for(b, max_seq_len)) > 1), default=0)
        rows *= self.spec.heads
        if rows == 0:
            return 0
        if self._workspace is not None and rows <= self._workspace_rows and self._workspace[0].device == device:
            return 0
        self._workspace = self._kernels.decode_workspace(rows, 1, self.spec.head_dim, 1, device)
        self._workspace_rows = rows
        return sum(t.numel() * t.element_size() for t in self._workspace)

    def _shared_workspace(self, batch: int, splits: int, device: torch.device):
        """The reserved workspace when it holds this step's partials, else None (paged_decode
        then allocates its own: a step past the limits warmup reserved for)."""
        if splits == 1 or self._workspace is None or self._workspace[0].device != device:
            return None
        if batch * self.spec.heads * splits > self._workspace_rows:
            return None
        return self._workspace

    def capture_memo(self, batch: int, max_seq_len: int, device: torch.device) -> dict:
        """What a decode graph of `batch` rows fixes at capture: the split count for the longest
        context it serves, and the workspace views (reserved first, so capture allocates nothing)."""
        splits = self.splits_for(batch, max_seq_len)
        self.reserve_decode(batch, max_seq_len, device)
        return {"num_splits": splits, "decode_workspace": self._shared_workspace(batch, splits, device)}

    # -- the two calls -----------------------------------------------------------------------------
    def _int32(self, meta: AttentionMetadata, key: str, tensor: torch.Tensor) -> torch.Tensor:
        return meta.memo(key, lambda: tensor if tensor.dtype == torch.int32 else tensor.to(torch.int32))

    def prefill(self, q, k, v, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None,
                kv_scales=None):
        if sinks is not None:
            raise ValueError("triton-paged has no attention sinks: choose torch-sdpa for this model")
        if meta.block_tables is None:
            raise ValueError("triton-paged prefill reads K/V through the block tables: AttentionMetadata.block_tables "
                             "must be set (one row per sequence)")
        seq_lens = meta.memo("prefill_seq_lens", lambda: torch.tensor(
            [c + n for c, n in zip(meta.cache_lens or [0] * len(meta.prefill_lens), meta.prefill_lens)],
            dtype=torch.int32, device=q.device))
        tables = self._int32(meta, "tables32", meta.block_tables)
        return self._kernels.paged_prefill(
            q, key_cache, value_cache, meta.cu_seqlens_q(q.device), seq_lens, tables, scale, window,
            max_q_len=max(meta.prefill_lens), softcap=softcap, kv_scales=kv_scales,
        )

    def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None, kv_scales=None):
        if sinks is not None:
            raise ValueError("triton-paged has no attention sinks: choose torch-sdpa for this model")
        tables = self._int32(meta, "tables32", meta.block_tables)
        seq_lens = self._int32(meta, "seq_lens32", meta.seq_lens)
        splits = self.num_splits(meta, q.shape[0])
        workspace = meta.memo("decode_workspace", lambda: self._shared_workspace(q.shape[0], splits, q.device))
        return self._kernels.paged_decode(
            q, key_cache, value_cache, tables, seq_lens, scale, window, num_splits=splits, workspace=workspace,
            softcap=softcap, kv_scales=kv_scales,
        )

    def latent_decode(self, q, latent_cache, meta, scale, value_dim, kv_scales=None):
        """kernels/mla_decode.py: the paged latents read in place, a head group per program."""
        from text_generation_server.kernels.mla_decode import mla_decode

        tables = self._int32(meta, "tables32", meta.block_tables)
        seq_lens = self._int32(meta, "seq_lens32", meta.seq_lens)
        return mla_decode(q, latent_cache, tables, seq_lens, scale, value_dim, kv_scales=kv_scales)


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
