"""Calibration for `quantize`: which linears a decoder layer has, and running a layer over the
calibration samples while hooks collect each linear's inputs.

A layer's linears are read from the built layer itself: its `linear_stages()` says their
order (q/k/v, o_proj, the MLP's input and output projections) and each parallel linear
records which checkpoint tensors it was built from, so every native family quantizes without
a table of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from text_generation_server.layers.attention import AttentionMetadata, KVCache
from text_generation_server.layers.context import ForwardContext
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.models.decoder import DecoderConfig, DecoderLayer
from text_generation_server.jobs.quantize.options import QuantizeError, QuantizeOptions
from text_generation_server.quantizers.config import GPTQConfig
from text_generation_server.quantizers.gptq_solver import HessianAccumulator, packing_multiple

# Activation scratch of one layer forward (float32): bounds how many samples run at once. Larger
# forwards amortise per-call overhead; 256 MiB is 17 samples of 1024 tokens on tiny-pycoder and
# one 2048-token sample on a 7B layer, whose forward is then a few seconds of matmuls anyway.
FORWARD_BYTES = 256 * 2**20


@dataclass(frozen=True)
class LinearGroup:
    """Checkpoint tensors that run as one matmul (and so share their input Hessian)."""

    module: str  # path of the parallel linear inside the decoder layer
    tensors: tuple[str, ...]  # checkpoint names relative to the layer prefix
    rows: tuple[int, ...]  # output rows of each tensor, in fused order
    in_features: int

    @property
    def names(self) -> str:
        return "+".join(t.split(".")[-1] for t in self.tensors)


def linear_groups(layer: DecoderLayer, prefix: str) -> list[list[LinearGroup]]:
    """The layer's linears in the order true-sequential quantizes them: stage by stage."""
    stages = []
    for stage in layer.linear_stages():
        groups = []
        for path in stage:
            linear = layer.get_submodule(path)
            groups.append(LinearGroup(path, tuple(t.removeprefix(prefix + ".") for t in linear.tensors),
                                      linear.rows, linear.in_features))
        stages.append(groups)
    return stages


def check_shapes(stages: list[list[LinearGroup]], options: QuantizeOptions) -> None:
    """Group size and packing constraints, checked on every linear before any work starts."""
    multiple = packing_multiple(options.bits)
    for stage in stages:
        for group in stage:
            k = group.in_features
            if options.group_size != -1 and k % options.group_size != 0:
                raise QuantizeError(
                    f"--groupsize {options.group_size} does not divide the {k} input features of {group.names}; "
                    f"use a divisor of every input size or -1"
                )
            for size, what in [(k, "input features")] + [(n, "output features") for n in group.rows]:
                if size % multiple != 0:
                    raise QuantizeError(f"{group.names} has {size} {what}, which {options.bits}-bit GPTQ packing "
                                        f"cannot store (it needs a multiple of {multiple})")


def dense_groups(layer_stages: list[list[list[LinearGroup]]], layer_prefix: str,
                 options: QuantizeOptions) -> set[tuple[int, str]]:
    """(layer, group module) pairs that --modules-to-not-convert leaves dense; fused parts must
    agree. layer_stages: each layer's groups, stage by stage."""
    if not options.modules_to_not_convert:
        return set()
    rule = GPTQConfig(source="--modules-to-not-convert", bits=options.bits,
                      modules_to_not_convert=options.modules_to_not_convert)
    dense = set()
    for layer, stages in enumerate(layer_stages):
        for stage in stages:
            for group in stage:
                prefixes = [f"{layer_prefix}.{layer}.{t}" for t in group.tensors]
                kept = [not rule.quantizes(p) for p in prefixes]
                if any(kept) and not all(kept):
                    raise QuantizeError(
                        f"--modules-to-not-convert leaves only part of {', '.join(prefixes)} dense: they run as "
                        "one matmul, so list all of them or none"
                    )
                if all(kept):
                    dense.add((layer, group.module))
    return dense


class InputsCollected(Exception):
    """Raised by the hook of a stage's last linear: the rest of the layer's forward is not needed."""


def forward_scratch_bytes(config: DecoderConfig) -> int:
    """Float32 activation bytes one token needs in a layer forward (its widest moments: the MLP's
    gate/up output with its product, and attention's q/k/v with the residual stream)."""
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    return 4 * (3 * config.intermediate_size + qkv + 4 * config.hidden_size)


class AttentionReplay(torch.nn.Module):
    """Stands in for a layer's self_attn once q/k/v are final: o_proj over recorded inputs.

    The layer's own forward still runs the residual and the MLP, so a replayed pass
    computes exactly what the full forward would, without attention or q/k/v.
    """

    def __init__(self, o_proj: torch.nn.Module, recorded: torch.Tensor):
        super().__init__()
        self.o_proj = o_proj
        self.recorded = recorded  # [nsamples, seqlen, heads * head_dim]
        self.current: torch.Tensor | None = None  # this chunk's rows, set by the runner

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # SelfAttention's signature
        return self.o_proj(self.current)


def module_linear(layer: torch.nn.Module, path: str) -> torch.nn.Module:
    """The DenseLinear inside the parallel linear at `path` (the input is checked to be dense)."""
    return layer.get_submodule(path).linear


def collect(acc: HessianAccumulator, x: torch.Tensor, stop: bool) -> None:
    acc.add(x)
    if stop:
        raise InputsCollected


class LayerRunner:
    """Runs one decoder layer over all calibration samples, a few samples per forward."""

    def __init__(self, config: DecoderConfig, rotaries: dict[str, RotaryEmbedding], seqlen: int, nsamples: int,
                 device: torch.device, forward_bytes: int | None = None):
        self.seqlen = seqlen
        self.nsamples = nsamples
        per_sample = forward_scratch_bytes(config) * seqlen
        budget = FORWARD_BYTES if forward_bytes is None else forward_bytes
        self.chunk = max(1, min(nsamples, budget // per_sample))
        tokens = self.chunk * seqlen
        self.rotaries = rotaries
        self.positions = torch.arange(seqlen, device=device).repeat(self.chunk)
        # A prompt of seqlen tokens: length-dependent rope sees that length for every token.
        self.seq_lens = torch.full_like(self.positions, seqlen)
        # Prefill attention reads K/V straight from the projections; the cache is only written.
        # One block pool aliased under every layer id keeps that scratch at one layer's size.
        self.cache = KVCache(1, 1, tokens, config.num_key_value_heads, config.head_dim, torch.float32, device)
        self.cache.keys = self.cache.keys * config.num_hidden_layers
        self.cache.values = self.cache.values * config.num_hidden_layers
        self.cache.scales = self.cache.scales * config.num_hidden_layers  # (no scales: a float32 cache)
        self.device = device
        self.start = 0  # first sample of the chunk being run
        self.needs_outputs = False  # whether this chunk's layer outputs are kept (hooks must not stop it)

    @property
    def batches(self) -> int:
        """Forwards per pass over the calibration samples."""
        return -(-self.nsamples // self.chunk)

    @torch.inference_mode()
    def run(self, layer: torch.nn.Module, inputs: torch.Tensor, outputs: torch.Tensor | None,
            record: torch.Tensor | None = None, replay: torch.Tensor | None = None,
            on_batch: Callable[[], None] | None = None) -> None:
        """One pass. inputs: [nsamples, seqlen, hidden]; outputs: [<= nsamples, seqlen, hidden], the
        first rows of the result (may be inputs: each chunk is read before it is written).
        record: [nsamples, seqlen, q] filled with o_proj's inputs; replay: such a recording, used
        instead of attention."""
        attn = layer.self_attn
        stand_in = AttentionReplay(attn.o_proj, replay) if replay is not None else None
        hook = None
        if record is not None:
            # Before any Hessian hook on o_proj, which may stop the forward.
            hook = module_linear(layer, "self_attn.o_proj").register_forward_pre_hook(
                lambda _m, args: self._record(record, args[0]), prepend=True)
        if stand_in is not None:
            layer.self_attn = stand_in
        try:
            for start in range(0, inputs.shape[0], self.chunk):
                self.start = start
                x = inputs[start:start + self.chunk]
                b, tokens = x.shape[0], x.shape[0] * self.seqlen
                self.needs_outputs = outputs is not None and start < outputs.shape[0]
                if stand_in is not None:
                    stand_in.current = replay[start:start + b].reshape(tokens, -1)
                meta = AttentionMetadata(is_prefill=True, slots=torch.arange(tokens, device=self.device),
                                         prefill_lens=[self.seqlen] * b)
                ctx = ForwardContext(self.positions[:tokens], self.cache, meta, torch.float32, self.seq_lens[:tokens])
                try:
                    y = layer(x.reshape(tokens, -1), ctx)
                except InputsCollected:
                    y = None
                keep = 0 if outputs is None or y is None else min(b, outputs.shape[0] - start)
                if keep > 0:
                    outputs[start:start + keep] = y.reshape(b, self.seqlen, -1)[:keep]
                if on_batch is not None:
                    on_batch()
        finally:
            if stand_in is not None:
                layer.self_attn = attn
            if hook is not None:
                hook.remove()

    def _record(self, record: torch.Tensor, x: torch.Tensor) -> None:
        # x: [tokens, q] for the chunk that starts at sample self.start
        b = x.shape[0] // self.seqlen
        record[self.start:self.start + b] = x.reshape(b, self.seqlen, -1)
