"""Tensor-parallel layers.

Column layers split the output dimension and need no communication; row layers
split the input dimension and all-reduce; the embedding splits the vocabulary and
all-reduces; the head splits the vocabulary and all-gathers. None of them knows a
checkpoint format: they ask `Weights` for a typed weight and call its get_linear().
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from text_generation_server.kernels.dense import DenseProduct, native_for
from text_generation_server.kernels.select import build_linear
from text_generation_server.layers.lora import LoraLayout, LoraLinear
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.eetq import ChannelInt8Weight, quantize_rows
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights


def _check_out_features(weights: Weights, weight, expected: int, prefix: str, label: str | None = None) -> None:
    shape = getattr(weight, "shape", None)
    if shape is not None and shape[0] != expected:
        raise CheckpointError(
            f"'{label or prefix}': expected {expected} output features on this rank, the checkpoint gives "
            f"{shape[0]} (in {weights.files_of(prefix)})"
        )


def _check_in_features(weights: Weights, weight, expected: int, prefix: str) -> None:
    shape = getattr(weight, "shape", None)
    if shape is not None and shape[1] != expected:
        raise CheckpointError(
            f"'{prefix}': expected {expected} input features on this rank, the checkpoint gives {shape[1]} "
            f"(in {weights.files_of(prefix)})"
        )


class LinearSource:
    """Which checkpoint tensors a parallel linear was built from: `quantize` reads it to write
    each part back under its own name (rows: each tensor's full output features, in fused order)."""

    tensors: tuple[str, ...] = ()
    rows: tuple[int, ...] = ()
    in_features: int = 0
    # LoRA (layers/lora.py): what an adapter must match on this rank, and the adapter slots once
    # LoRA is enabled; None: no adapter can change this linear.
    lora_layout: LoraLayout | None = None
    lora: LoraLinear | None = None

    def _record(self, tensors: list[str], rows: list[int], in_features: int):
        self.tensors, self.rows, self.in_features = tuple(tensors), tuple(rows), in_features
        return self

    def _lora_columns(self, weights: Weights, parts: list[tuple[str, int, int]], in_features: int):
        """Column layers: parts are (tensor, first row, rows) of the output blocks this layer
        splits evenly over the ranks (a fused tensor's blocks, or one tensor each)."""
        pg = weights.process_group
        outputs, full = [], {}
        for tensor, first, rows in parts:
            local = rows // pg.size
            outputs.append((tensor, first + pg.rank * local, first + (pg.rank + 1) * local))
            full[tensor] = full.get(tensor, 0) + rows
        self.lora_layout = LoraLayout(tensors_path(parts), False, tuple(outputs), full, in_features,
                                      (0, in_features))
        return self


def tensors_path(parts: list[tuple[str, int, int]]) -> str:
    return "+".join(dict.fromkeys(t for t, _, _ in parts))


class TensorParallelColumnLinear(LinearSource, torch.nn.Module):
    # x: [tokens, K] -> [tokens, N / world]
    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.linear = linear

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool, out_features: int, in_features: int):
        world = weights.process_group.size
        w = weights.get_weights_col(prefix)
        _check_out_features(weights, w, out_features // world, prefix)
        _check_in_features(weights, w, in_features, prefix)
        b = weights.get_sharded(f"{prefix}.bias", dim=0) if bias else None
        return cls(w.get_linear(b))._record([prefix], [out_features], in_features)._lora_columns(
            weights, [(prefix, 0, out_features)], in_features)

    @classmethod
    def load_packed(
        cls, weights: Weights, prefix: str, bias: bool, block_sizes: list[int], in_features: int
    ):
        """A fused checkpoint tensor (Phi-3 qkv_proj, gate_up_proj) sharded part by part."""
        world = weights.process_group.size
        w = weights.get_weights_col_packed(prefix, block_sizes)
        _check_out_features(weights, w, sum(block_sizes) // world, prefix)
        _check_in_features(weights, w, in_features, prefix)
        b = weights.get_packed_sharded(f"{prefix}.bias", dim=0, block_sizes=block_sizes) if bias else None
        blocks = [(prefix, sum(block_sizes[:i]), n) for i, n in enumerate(block_sizes)]
        return cls(w.get_linear(b))._record([prefix], [sum(block_sizes)], in_features)._lora_columns(
            weights, blocks, in_features)

    @classmethod
    def load_multi(
        cls, weights: Weights, prefixes: list[str], bias: bool, out_features: list[int], in_features: int
    ):
        """Separate checkpoint tensors (q, k, v) fused into one matmul."""
        world = weights.process_group.size
        w = weights.get_multi_weights_col(prefixes, dim=0)
        parts = "+".join(prefixes) + f" (parts of {out_features} rows)"
        _check_out_features(weights, w, sum(out_features) // world, prefixes[0], label=parts)
        _check_in_features(weights, w, in_features, prefixes[0])
        b = None
        if bias:
            b = torch.cat([weights.get_sharded(f"{p}.bias", dim=0) for p in prefixes], dim=0)
        return cls(w.get_linear(b))._record(prefixes, out_features, in_features)._lora_columns(
            weights, [(p, 0, n) for p, n in zip(prefixes, out_features)], in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out if self.lora is None else self.lora.add(x, out)


class TensorParallelRowLinear(LinearSource, torch.nn.Module):
    # x: [tokens, K / world] -> [tokens, N] (summed over ranks)
    def __init__(self, linear: torch.nn.Module, process_group: ProcessGroup):
        super().__init__()
        self.linear = linear
        self.process_group = process_group

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool, out_features: int, in_features: int):
        pg = weights.process_group
        w = weights.get_weights_row(prefix)
        _check_out_features(weights, w, out_features, prefix)
        _check_in_features(weights, w, in_features // pg.size, prefix)
        # The bias is added once: by rank 0, before the all-reduce sums the partial products.
        b = weights.get_tensor(f"{prefix}.bias") if bias and pg.rank == 0 else None
        layer = cls(w.get_linear(b), pg)._record([prefix], [out_features], in_features)
        local = in_features // pg.size
        layer.lora_layout = LoraLayout(prefix, True, ((prefix, 0, out_features),), {prefix: out_features},
                                       in_features, (pg.rank * local, (pg.rank + 1) * local))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if self.lora is not None:
            out = self.lora.add(x, out)  # this rank's partial, summed by the same all-reduce
        return self.process_group.all_reduce(out)


class TensorParallelEmbedding(torch.nn.Module):
    # ids: [tokens] -> [tokens, hidden]
    def __init__(self, weights: Weights, prefix: str, vocab_size: int, hidden_size: int, keep_stored: bool = True):
        """keep_stored: a format may keep the table as stored (GGUF K-quants on the CPU), so `weight` is
        None; False where other code reads the weight (transformers' modeling code may tie it)."""
        super().__init__()
        pg = weights.process_group
        name = f"{prefix}.weight"
        shape = weights.get_shape(name)
        if shape != [vocab_size, hidden_size]:
            raise CheckpointError(
                f"tensor '{name}' has shape {shape}, expected {[vocab_size, hidden_size]} (in {weights.files_of(name)})"
            )
        self.process_group = pg
        # A format may keep the table as stored and decode the rows looked up (GGUF K-quants on the CPU).
        keeps = getattr(getattr(weights.loader, "config", None), "quantized_embedding", None)
        self.stored = keeps(weights, prefix) if keeps is not None and keep_stored else None
        if self.stored is not None:
            self.min_id, self.max_id, self.weight = 0, vocab_size, None
            return
        weight = weights.get_partial_sharded(name, dim=0)
        block = (vocab_size + pg.size - 1) // pg.size
        self.min_id = pg.rank * block
        self.max_id = self.min_id + weight.shape[0]
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.stored is not None:
            return self.stored(ids)
        if self.process_group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.min_id
        outside = (ids < self.min_id) | (ids >= self.max_id)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.process_group.all_reduce(out)


class TensorParallelHead(DenseProduct, torch.nn.Module):
    # hidden: [tokens, hidden] -> logits [tokens, vocab]
    # The product is the dense kernel's (kernels/dense.py): the native bf16 matrix-vector product for
    # decode rows on the CPU, torch's GEMM otherwise.
    def __init__(self, weight: torch.Tensor, vocab_size: int, process_group: ProcessGroup,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.vocab_size = vocab_size
        self.process_group = process_group
        self.native = native_for(weight)
        self.measured = {}

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.native = native_for(self.weight)
        return self

    @classmethod
    def load(cls, weights: Weights, prefix: str, vocab_size: int, hidden_size: int, bias: bool = False):
        name = f"{prefix}.weight"
        shape = weights.get_shape(name)
        if shape != [vocab_size, hidden_size]:
            raise CheckpointError(
                f"tensor '{name}' has shape {shape}, expected {[vocab_size, hidden_size]} (in {weights.files_of(name)})"
            )
        pg = weights.process_group
        weight = weights.get_partial_sharded(name, dim=0)
        b = None
        if bias:
            bias_shape = weights.get_shape(f"{prefix}.bias")
            if bias_shape != [vocab_size]:
                raise CheckpointError(f"tensor '{prefix}.bias' has shape {bias_shape}, expected {[vocab_size]} "
                                      f"(in {weights.files_of(prefix + '.bias')})")
            b = weights.get_partial_sharded(f"{prefix}.bias", dim=0)
        block = (vocab_size + pg.size - 1) // pg.size
        if weight.shape[0] < block:
            # Pad the short last shard so every rank gathers equal shapes.
            pad = torch.zeros(block - weight.shape[0], hidden_size, dtype=weight.dtype, device=weight.device)
            weight = torch.cat([weight, pad], dim=0)
            if b is not None:
                b = torch.cat([b, b.new_zeros(block - b.shape[0])])
        return cls(weight, vocab_size, pg, b)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.dense_product(hidden)
        if self.process_group.size > 1:
            logits = self.process_group.all_gather_last_dim(logits)[..., : self.vocab_size]
        return logits


def int8_head(head: TensorParallelHead, act_dtype: torch.dtype) -> "QuantizedTensorParallelHead":
    """The dense head's rows (this rank's vocabulary block) as symmetric per-row int8, EETQ's grid,
    on the machine's int8 kernel (`--quantize-lm-head int8`).

    Why: a small model's head is its largest matrix (Qwen2.5-0.5B: 151936 x 896, over a quarter of the
    weights) and decode reads all of it every step; int8 halves those bytes against bf16 (a
    quarter against float32), as llama.cpp keeps its output tensor at 6 bits (Q6_K) under Q4_0 weights.
    Measured (BENCHMARKS.md, third round): int4 weights with this head decode Qwen2.5-1.5B at 12.6
    tok/s single-stream on 2 cores, against 9.4 with the bf16 head (on the native kernels of
    kernels/cpu_native.py both ways).
    """
    w = head.weight.data
    codes, scales = quantize_rows(w, w.float().abs().amax(dim=1))
    bias = None if head.bias is None else head.bias.data
    weight = ChannelInt8Weight(codes, scales, prefix="lm_head", layer="lm_head", act_dtype=act_dtype,
                               device_type=w.device.type)
    linear = build_linear(weight.to_quantized(), bias, act_dtype, w.device.type, "lm_head")
    if hasattr(linear, "keep_rows_invariant"):  # a row's logits whatever shares its batch (kernels/cpu.py)
        linear.keep_rows_invariant()
    return QuantizedTensorParallelHead(linear, head.vocab_size, head.process_group, rows=w.shape[0])


class QuantizedTensorParallelHead(torch.nn.Module):
    """A head the checkpoint quantized (EXL2 always does; `head_bits`): split by vocabulary
    like the dense head, each rank's part built by the format's loader and kernel."""

    # hidden: [tokens, hidden] -> logits [tokens, vocab]
    def __init__(self, linear: torch.nn.Module, vocab_size: int, process_group: ProcessGroup,
                 rows: int | None = None):
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.process_group = process_group
        # Rows of each rank's block (the dense head pads the last block to ceil(vocab / world)).
        self.rows = rows if rows is not None else vocab_size // process_group.size

    @classmethod
    def load(cls, weights: Weights, prefix: str, vocab_size: int, hidden_size: int):
        pg = weights.process_group
        if vocab_size % pg.size:
            raise CheckpointError(f"quantized head '{prefix}': a vocabulary of {vocab_size} does not split into "
                                  f"{pg.size} shards (use a world size that divides it)")
        weight = weights.get_weights_col(prefix)
        rows, cols = weight.shape
        local = vocab_size // pg.size
        # Formats that pad output columns (EXL2 to 32) leave extra rows past the vocabulary; on one
        # rank they are cut from the logits, across ranks they would shift every later shard.
        if cols != hidden_size or rows < local or (rows != local and pg.size > 1):
            raise CheckpointError(f"quantized head '{prefix}' holds {(rows, cols)} (out, in) on rank {pg.rank}, "
                                  f"expected {(local, hidden_size)} for vocabulary {vocab_size} and hidden size "
                                  f"{hidden_size} at world size {pg.size}")
        return cls(weight.get_linear(None), vocab_size, pg)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden)[..., : self.rows]
        if self.process_group.size > 1:
            logits = self.process_group.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
