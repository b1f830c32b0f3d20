"""The Llama family: Llama 2/3/3.1, Mistral, Qwen2 and Phi-3 in one model.

The variants differ only in data: fused or separate projections, qkv bias,
sliding windows, rope scaling and tied embeddings. Checkpoint names are mapped
here (`FUSED_PROJECTIONS`), so one loader and one forward serve all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from text_generation_server.layers.attention import DEFAULT_BACKEND, AttentionMetadata, KVCache
from text_generation_server.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary, rope_config_from_hf
from text_generation_server.layers.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelHead,
    TensorParallelRowLinear,
    QuantizedTensorParallelHead,
)
from text_generation_server.weights import CheckpointError, Weights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3")
# Model types whose checkpoints store qkv_proj and gate_up_proj fused.
FUSED_PROJECTIONS = {"phi3"}


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    layer_windows: tuple[int | None, ...]
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, config: dict, source: str = "config.json") -> "LlamaConfig":
        def need(key: str):
            if key not in config or config[key] is None:
                raise CheckpointError(f"{source}: missing required key '{key}'")
            return config[key]

        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: model_type '{model_type}' is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        layers = int(need("num_hidden_layers"))
        for key, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_hidden_layers", layers)):
            if value <= 0:
                raise CheckpointError(f"{source}: '{key}' must be positive, got {value}")
        if heads % kv_heads != 0:
            raise CheckpointError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"{source}: hidden_act '{act}' is not supported (silu only)")
        try:
            rope = rope_config_from_hf(config, head_dim)
        except ValueError as exc:
            raise CheckpointError(f"{source}: {exc}") from exc
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope=rope,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(config.get("mlp_bias", False)),
            layer_windows=_layer_windows(config, model_type, layers, source),
            hidden_act=act,
        )

    @property
    def sliding_window(self) -> int | None:
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None


def _layer_windows(config: dict, model_type: str, layers: int, source: str) -> tuple[int | None, ...]:
    """Per-layer sliding window sizes (None = full attention), as transformers applies them."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != layers:
            raise CheckpointError(f"{source}: layer_types has {len(layer_types)} entries for {layers} layers")
        return tuple(int(window) if t == "sliding_attention" and window else None for t in layer_types)
    if model_type == "qwen2":
        if not config.get("use_sliding_window", False) or not window:
            return (None,) * layers
        first = int(config.get("max_window_layers", layers))
        return tuple(int(window) if i >= first else None for i in range(layers))
    if model_type in ("mistral", "phi3") and window:
        return (int(window),) * layers
    return (None,) * layers


class RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    @classmethod
    def load(cls, weights: Weights, prefix: str, hidden: int, eps: float) -> "RMSNorm":
        w = weights.get_tensor(f"{prefix}.weight")
        if list(w.shape) != [hidden]:
            raise CheckpointError(
                f"tensor '{prefix}.weight' has shape {list(w.shape)}, expected [{hidden}] "
                f"(in {weights.files_of(prefix + '.weight')})"
            )
        return cls(w, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF semantics: normalise in float32, cast back, then scale by the weight.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: LlamaConfig, weights: Weights, prefix: str, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        world = weights.process_group.size
        for name, value in (("num_attention_heads", config.num_attention_heads),
                            ("num_key_value_heads", config.num_key_value_heads)):
            if value % world != 0:
                raise CheckpointError(f"config.json: {name} ({value}) must be divisible by the {world} shards")
        self.heads = config.num_attention_heads // world
        self.kv_heads = config.num_key_value_heads // world
        self.head_dim = config.head_dim
        self.layer_id = layer_id
        self.window = config.layer_windows[layer_id]
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.rotary = rotary
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        if config.model_type in FUSED_PROJECTIONS:
            self.qkv = TensorParallelColumnLinear.load_packed(
                weights, f"{prefix}.qkv_proj", config.attention_bias, [q_size, kv_size, kv_size], config.hidden_size
            )
        else:
            self.qkv = TensorParallelColumnLinear.load_multi(
                weights,
                [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
                config.attention_bias,
                [q_size, kv_size, kv_size],
                config.hidden_size,
            )
        # Llama's o_proj has a bias only with attention_bias; Qwen2's never does.
        o_bias = config.attention_bias and config.model_type != "qwen2"
        self.o_proj = TensorParallelRowLinear.load(weights, f"{prefix}.o_proj", o_bias, config.hidden_size, q_size)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # hidden: [tokens, hidden] -> [tokens, hidden]
        tokens = hidden.shape[0]
        qkv = self.qkv(hidden)
        qk_size = (self.heads + self.kv_heads) * self.head_dim
        # q and k heads share positions: one rotary call over both.
        qk = apply_rotary(qkv[:, :qk_size].view(tokens, self.heads + self.kv_heads, self.head_dim), cos, sin)
        q, k = qk[:, : self.heads], qk[:, self.heads:]
        v = qkv[:, qk_size:].view(tokens, self.kv_heads, self.head_dim)
        cache.store(self.layer_id, meta.slots, k, v)
        backend = meta.backend or DEFAULT_BACKEND
        key_cache, value_cache = cache.keys[self.layer_id], cache.values[self.layer_id]
        if meta.is_prefill:
            out = backend.prefill(q, k, v, key_cache, value_cache, meta, self.scale, self.window)
        else:
            out = backend.decode(q, key_cache, value_cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(tokens, self.heads * self.head_dim))


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: LlamaConfig, weights: Weights, prefix: str):
        super().__init__()
        inter = config.intermediate_size
        world = weights.process_group.size
        if inter % world != 0:
            raise CheckpointError(f"config.json: intermediate_size ({inter}) must be divisible by the {world} shards")
        self.local_inter = inter // world
        if config.model_type in FUSED_PROJECTIONS:
            self.gate_up = TensorParallelColumnLinear.load_packed(
                weights, f"{prefix}.gate_up_proj", config.mlp_bias, [inter, inter], config.hidden_size
            )
        else:
            self.gate_up = TensorParallelColumnLinear.load_multi(
                weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], config.mlp_bias, [inter, inter],
                config.hidden_size,
            )
        self.down = TensorParallelRowLinear.load(weights, f"{prefix}.down_proj", config.mlp_bias,
                                                 config.hidden_size, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.local_inter, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaLayer(torch.nn.Module):
    def __init__(self, config: LlamaConfig, weights: Weights, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        prefix = f"model.layers.{layer_id}"
        self.input_layernorm = RMSNorm.load(weights, f"{prefix}.input_layernorm", config.hidden_size,
                                            config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, weights, f"{prefix}.self_attn", layer_id, rotary)
        self.post_attention_layernorm = RMSNorm.load(
            weights, f"{prefix}.post_attention_layernorm", config.hidden_size, config.rms_norm_eps
        )
        self.mlp = LlamaMLP(config, weights, f"{prefix}.mlp")

    def forward(self, hidden, cos, sin, cache, meta):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def quantized_head(weights: Weights) -> bool:
    """Whether the checkpoint stores the head quantized: no lm_head.weight, but the loader's
    format claims the module and tensors under lm_head. are there."""
    config = getattr(weights.loader, "config", None)
    if config is None or not config.quantizes("lm_head"):
        return False
    return any(name.startswith("lm_head.") for name in weights.tensor_names())


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, config: LlamaConfig, weights: Weights):
        super().__init__()
        self.config = config
        self.process_group = weights.process_group
        self.embed_tokens = TensorParallelEmbedding(weights, "model.embed_tokens", config.vocab_size,
                                                    config.hidden_size)
        # The whole table at load: a step never grows it (no allocation inside a CUDA graph).
        self.rotary = RotaryEmbedding(config.rope, config.max_position_embeddings, weights.device)
        self.layers = torch.nn.ModuleList(
            LlamaLayer(config, weights, i, self.rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm.load(weights, "model.norm", config.hidden_size, config.rms_norm_eps)
        head_prefix = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
        if config.tie_word_embeddings or weights.has_tensor("lm_head.weight"):
            self.lm_head = TensorParallelHead.load(weights, head_prefix, config.vocab_size, config.hidden_size)
        elif quantized_head(weights):
            self.lm_head = QuantizedTensorParallelHead.load(weights, "lm_head", config.vocab_size, config.hidden_size)
        else:
            raise CheckpointError(
                "tensor 'lm_head.weight' not found and tie_word_embeddings is false in config.json"
            )

    @property
    def local_kv_heads(self) -> int:
        return self.config.num_key_value_heads // self.process_group.size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        # input_ids, positions: [tokens] -> logits [len(logits_indices) or tokens, vocab] float32
        # (head=False: the final normed hidden states of those rows, for `logits` in pieces)
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, meta.max_position)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, cache, meta)
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        hidden = self.norm(hidden)
        return self.logits(hidden) if head else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [rows, hidden] (normed) -> [rows, vocab] float32
        return self.lm_head(hidden).float()
