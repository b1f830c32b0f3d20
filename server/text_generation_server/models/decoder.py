"""The decoder-only causal LM every native family is built from.

A family (models/families/) reads its config.json into a `DecoderConfig` and assembles
these parts: `Embeddings` (token table, optional scale and learned positions), a stack of
`DecoderLayer`s (attention and MLP with the norms and residual wiring the family uses), a
final norm and a `Head` (logit scale, soft-capping). The engine (CausalLM, warmup, CUDA
graphs, quantize) sees only this model and its config, never a family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from text_generation_server.layers.attention import AttentionMetadata, KVCache, KVLayout
from text_generation_server.layers.context import ForwardContext
from text_generation_server.layers.cpu_decode_step import CpuDecodeStep
from text_generation_server.layers.norm import RMSNorm
from text_generation_server.layers.rotary import RopeConfig
from text_generation_server.layers.tensor_parallel import (
    QuantizedTensorParallelHead,
    TensorParallelEmbedding,
    TensorParallelHead,
)
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class DecoderConfig:
    """What the engine needs of any native model; families subclass it for their own fields."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope: RopeConfig | None
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...]
    norm_eps: float = 1e-6

    @property
    def sliding_window(self) -> int | None:
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    @property
    def max_context(self) -> int:
        """Positions a sequence may reach: max_position_embeddings, stretched by dynamic/yarn rope."""
        return self.rope.max_context(self.max_position_embeddings) if self.rope is not None \
            else self.max_position_embeddings

    @property
    def context_name(self) -> str:
        """How error messages name the limit: max_position_embeddings, or what stretched it."""
        if self.max_context == self.max_position_embeddings:
            return f"max_position_embeddings ({self.max_position_embeddings})"
        return (f"context ({self.max_context}: max_position_embeddings {self.max_position_embeddings} stretched by "
                f"{self.rope.rope_type} rope scaling)")

    @property
    def rope_length_dependent(self) -> bool:
        """Whether rotary frequencies depend on a sequence's length (dynamic NTK, longrope)."""
        return self.rope is not None and self.rope.length_dependent


def check_heads(config: DecoderConfig, source: str) -> None:
    for key, value in (("hidden_size", config.hidden_size), ("num_attention_heads", config.num_attention_heads),
                       ("num_hidden_layers", config.num_hidden_layers), ("head_dim", config.head_dim)):
        if value <= 0:
            raise CheckpointError(f"{source}: '{key}' must be positive, got {value}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise CheckpointError(f"{source}: num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({config.num_key_value_heads})")


class Embeddings(torch.nn.Module):
    """Token embedding, optionally scaled (Gemma: by sqrt(hidden) rounded to the compute dtype;
    Granite: by embedding_multiplier) and plus learned positions (GPT-2, BigCode)."""

    # ids, positions: [tokens] -> [tokens, hidden]
    def __init__(self, weights: Weights, prefix: str, vocab_size: int, hidden_size: int,
                 scale: float | None = None, scale_in_dtype: bool = False, positions: str | None = None,
                 max_positions: int = 0):
        super().__init__()
        self.tokens = TensorParallelEmbedding(weights, prefix, vocab_size, hidden_size)
        self.scale = scale
        self.scale_in_dtype = scale_in_dtype
        self.positions = None
        if positions is not None:
            name = f"{positions}.weight"
            shape = weights.get_shape(name)
            if shape != [max_positions, hidden_size]:
                raise CheckpointError(f"tensor '{name}' has shape {shape}, expected {[max_positions, hidden_size]} "
                                      f"(in {weights.files_of(name)})")
            self.positions = torch.nn.Parameter(weights.get_tensor(name), requires_grad=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(ids)
        if self.scale is not None:
            hidden = hidden * (torch.tensor(self.scale, dtype=hidden.dtype) if self.scale_in_dtype else self.scale)
        if self.positions is not None:
            hidden = hidden + torch.nn.functional.embedding(positions, self.positions)
        return hidden


class Head(torch.nn.Module):
    """The vocabulary projection and what some families do to the logits after it."""

    # hidden: [rows, hidden] (normed) -> [rows, vocab] float32
    def __init__(self, projection: torch.nn.Module, multiplier: float | None = None, divisor: float | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.projection = projection
        self.multiplier = multiplier  # Cohere's logit_scale
        self.divisor = divisor  # Granite's logits_scaling
        self.softcap = softcap  # Gemma 2's final_logit_softcapping

    @classmethod
    def load(cls, weights: Weights, config: DecoderConfig, prefix: str = "lm_head",
             tied_prefix: str = "model.embed_tokens", bias: bool = False, **transforms) -> "Head":
        vocab, hidden = config.vocab_size, config.hidden_size
        stored = tied_prefix if config.tie_word_embeddings else prefix
        if not bias and head_stays_quantized(weights, stored):  # a GGUF's K-quant head, read in place
            projection: torch.nn.Module = QuantizedTensorParallelHead.load(weights, stored, vocab, hidden)
        elif config.tie_word_embeddings:
            projection = TensorParallelHead.load(weights, tied_prefix, vocab, hidden, bias=bias)
        elif weights.has_tensor(f"{prefix}.weight"):
            projection = TensorParallelHead.load(weights, prefix, vocab, hidden, bias=bias)
        elif quantized_head(weights, prefix):
            projection = QuantizedTensorParallelHead.load(weights, prefix, vocab, hidden)
        else:
            raise CheckpointError(f"tensor '{prefix}.weight' not found and tie_word_embeddings is false in config.json")
        return cls(projection, **transforms)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.projection(hidden)
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


def head_stays_quantized(weights: Weights, prefix: str) -> bool:
    """Whether the format keeps a head stored quantized as it is, rather than loading it dense: the
    config's `keeps_head_quantized` says (GGUF: Q4_K/Q6_K heads, read in place on the CPU)."""
    keeps = getattr(getattr(weights.loader, "config", None), "keeps_head_quantized", None)
    return bool(keeps is not None and keeps(weights, prefix))


def quantized_head(weights: Weights, prefix: str = "lm_head") -> bool:
    """Whether the checkpoint stores the head quantized: no weight, but the loader's format
    claims the module and tensors under it are there."""
    config = getattr(weights.loader, "config", None)
    if config is None or not config.quantizes(prefix):
        return False
    return any(name.startswith(prefix + ".") for name in weights.tensor_names())


def _hooked(layers: torch.nn.ModuleList) -> bool:
    """Whether a forward hook would see the layers' calls (one of theirs, or a global one): the
    chained path calls `forward_chained`, which no hook sees, so it steps aside then."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_pre_hooks or nn_module._global_forward_hooks
                or any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers))


def _llama_rms(norm: torch.nn.Module | None) -> bool:
    """An RMSNorm in Llama's arithmetic (no offset, no float32 scale), whose `add_forward` is the add
    then the norm."""
    return type(norm) is RMSNorm and norm._scale32 is None


class DecoderLayer(torch.nn.Module):
    """Attention and MLP with the residual wiring of the family.

    Sequential (Llama): h += attn(n1(h)); h += mlp(n2(h)). Parallel (GPT-NeoX, Phi-2, Falcon,
    Cohere): h += attn(n1(h)) + mlp(n2(h) or n1(h)). Post norms (Gemma 2/3, OLMo 2) normalise a
    sublayer's output before the residual add; OLMo 2 has no pre-norms. Granite scales both
    sublayers' outputs by residual_multiplier.
    """

    # hidden: [tokens, hidden] -> [tokens, hidden]
    def __init__(self, self_attn: torch.nn.Module, mlp: torch.nn.Module, input_norm: torch.nn.Module | None = None,
                 mlp_norm: torch.nn.Module | None = None, post_attn_norm: torch.nn.Module | None = None,
                 post_mlp_norm: torch.nn.Module | None = None, parallel: bool = False,
                 residual_scale: float | None = None):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_norm = input_norm
        self.mlp_norm = mlp_norm
        self.post_attn_norm = post_attn_norm
        self.post_mlp_norm = post_mlp_norm
        self.parallel = parallel
        self.residual_scale = residual_scale

    @staticmethod
    def _apply(norm: torch.nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        return x if norm is None else norm(x)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.parallel:
            attn_in = self._apply(self.input_norm, hidden)
            mlp_in = attn_in if self.mlp_norm is None else self.mlp_norm(hidden)
            attn = self._apply(self.post_attn_norm, self.self_attn(attn_in, ctx))
            mlp = self._apply(self.post_mlp_norm, self.mlp(mlp_in))
            return hidden + (attn + mlp)
        attn = self._apply(self.post_attn_norm, self.self_attn(self._apply(self.input_norm, hidden), ctx))
        if self.residual_scale is None and type(self.mlp_norm) is RMSNorm:
            mlp_in, hidden = self.mlp_norm.add_forward(hidden, attn)  # one launch on CUDA
        else:
            hidden = hidden + (attn if self.residual_scale is None else attn * self.residual_scale)
            mlp_in = self._apply(self.mlp_norm, hidden)
        mlp = self._apply(self.post_mlp_norm, self.mlp(mlp_in))
        return hidden + (mlp if self.residual_scale is None else mlp * self.residual_scale)

    def chains_residual(self) -> bool:
        """Whether this layer can take its input as (hidden, the previous layer's last output not yet
        added) and hand on its own the same way (`forward_chained`): Llama's wiring, RMSNorms in the
        Llama arithmetic, no scale on the sublayers and no post norms."""
        return (not self.parallel and self.residual_scale is None and self.post_attn_norm is None
                and self.post_mlp_norm is None and _llama_rms(self.input_norm) and _llama_rms(self.mlp_norm))

    def forward_chained(self, hidden: torch.Tensor, pending: torch.Tensor | None,
                        ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the residual add at its end left to the next norm: takes the previous
        layer's pending output and returns (hidden, this layer's pending output). The add then runs
        inside the next layer's input norm (`RMSNorm.add_forward`: one native call on the CPU, one
        launch on CUDA, in the add's own rounding), so a sequence of layers computes the same bits
        with one call fewer per layer. Only where `chains_residual`."""
        if pending is None:
            normed = self.input_norm(hidden)
        else:
            normed, hidden = self.input_norm.add_forward(hidden, pending)
        attn = self.self_attn(normed, ctx)
        mlp_in, hidden = self.mlp_norm.add_forward(hidden, attn)
        return hidden, self.mlp(mlp_in)

    def linear_stages(self) -> list[list[str]]:
        """This layer's linears (module paths) in the order `quantize` calibrates them."""
        stages = [[f"self_attn.{p}" for p in stage] for stage in self.self_attn.linear_stages()]
        return stages + [[f"mlp.{p}" for p in stage] for stage in self.mlp.linear_stages()]


class DecoderModel(torch.nn.Module):
    def __init__(self, config: DecoderConfig, embeddings: Embeddings, layers: list[DecoderLayer],
                 norm: torch.nn.Module, head: Head, process_group):
        super().__init__()
        self.config = config
        self.embeddings = embeddings
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.head = head
        self.process_group = process_group
        self._chained: bool | None = None  # every layer hands its residual add on (forward_chained)
        # The CPU decode step's plan (layers/cpu_decode_step.py) and the layer list it was made for:
        # warmup's probe (engine/warmup_probe.py) runs with a shorter list in `layers` for a while.
        self._cpu_step: CpuDecodeStep | None = None
        self._cpu_step_layers: torch.nn.ModuleList | None = None

    def chains_residuals(self) -> bool:
        """Whether the layers hand their last residual add on to the next layer's norm on the CPU
        (`DecoderLayer.forward_chained`): then every layer but the first holds one more hidden-sized
        tensor at its start, which warmup's probe (engine/warmup_probe.py) must see."""
        if self._chained is None:
            self._chained = all(type(layer) is DecoderLayer and layer.chains_residual() for layer in self.layers)
        return self._chained

    @property
    def local_kv_heads(self) -> int:
        return self.layers[0].self_attn.kv_heads

    @property
    def kv_layout(self) -> KVLayout:
        """What this rank's paged cache holds per token and layer: one latent when the layers'
        attention caches one (multi-head latent attention, `latent_dim`), else K and V per head."""
        attn = self.layers[0].self_attn
        latent = getattr(attn, "latent_dim", None)
        if latent is not None:
            return KVLayout(len(self.layers), 1, latent, latent=True)
        return KVLayout(len(self.layers), attn.kv_heads, self.config.head_dim)

    @property
    def attention_softcap(self) -> bool:
        """Whether some layer soft-caps its attention scores (the backend must support it)."""
        return any(getattr(layer.self_attn, "softcap", None) is not None for layer in self.layers)

    @property
    def attention_sinks(self) -> bool:
        """Whether some layer has attention sinks (gpt-oss; the backend must support them)."""
        return any(getattr(layer.self_attn, "sinks", None) is not None for layer in self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        head: bool = True,
        seq_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # input_ids, positions: [tokens] -> logits [len(logits_indices) or tokens, vocab] float32
        # (head=False: the final normed hidden states of those rows, for `logits` in pieces)
        hidden = self.embeddings(input_ids, positions)
        normed = None  # the final norm's output, where the chained path's last add ran inside it
        ctx = ForwardContext(positions, cache, meta, hidden.dtype, seq_lens)
        with ctx.kernel_phase():
            self.chains_residuals()
            # On the CPU only: there each call is host time a step waits for; on CUDA the graphs
            # replay the launches and the fused add's bits are not measured against torch's there.
            if self._chained and hidden.device.type == "cpu" and not _hooked(self.layers):
                stepped = None
                if not meta.is_prefill:  # a decode step: its layers in the fewest calls (layers/cpu_decode_step.py)
                    if self._cpu_step_layers is not self.layers:
                        self._cpu_step, self._cpu_step_layers = CpuDecodeStep.plan(self.layers), self.layers
                    if self._cpu_step is not None:
                        stepped = self._cpu_step.run(hidden, ctx)
                if stepped is not None:
                    hidden, pending = stepped
                else:
                    pending = None
                    for layer in self.layers:
                        hidden, pending = layer.forward_chained(hidden, pending, ctx)
                if logits_indices is None and _llama_rms(self.norm):  # the last add inside the final norm
                    normed = self.norm.add_forward(hidden, pending)[0]
                else:
                    hidden = hidden + pending
            else:
                for layer in self.layers:
                    hidden = layer(hidden, ctx)
        if normed is not None:
            hidden = normed
        else:
            if logits_indices is not None:
                hidden = hidden.index_select(0, logits_indices)
            hidden = self.norm(hidden)
        return self.logits(hidden) if head else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [rows, hidden] (normed) -> [rows, vocab] float32
        return self.head(hidden)
