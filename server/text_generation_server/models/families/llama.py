"""The Llama family: Llama 2/3/3.1, Mistral, Qwen2 and Phi-3.

The variants differ only in data: fused (Phi-3) or separate projections, qkv bias (Qwen2),
sliding windows, rope scaling and tied embeddings. Other families start from this one
(Qwen3, Granite, OLMo 2 subclass it and change only what differs).
"""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_server.layers.mlp import GatedMLP, activation
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.layers.self_attention import AttentionOptions, SelfAttention
from text_generation_server.models.decoder import DecoderConfig, DecoderLayer, check_heads
from text_generation_server.models.families.base import Family
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    hidden_act: str = "silu"
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj in one tensor each


def layer_windows(r: ConfigReader, layers: int, every_layer: bool) -> tuple[int | None, ...]:
    """Per-layer sliding windows (None = full attention), as transformers applies them.

    `layer_types` (transformers 5 writes it) decides where it exists; otherwise Qwen-style
    configs (use_sliding_window, max_window_layers) window the layers from max_window_layers on,
    and families that window every layer (`every_layer`: Mistral, Phi-3, StarCoder2) do so
    whenever sliding_window is set.
    """
    window = r.get("sliding_window")
    if window == 0 and not isinstance(window, bool):
        window = None  # Qwen2-MoE's config writes 0 when use_sliding_window is off
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise CheckpointError(f"{r.source}: sliding_window must be a positive integer or null, got {window!r}")
    layer_types = r.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != layers:
            raise CheckpointError(f"{r.source}: layer_types has {len(layer_types)} entries for {layers} layers")
        unknown = sorted({t for t in layer_types if t not in ("sliding_attention", "full_attention")})
        if unknown:
            raise CheckpointError(f"{r.source}: layer_types {unknown} not supported "
                                  "(sliding_attention and full_attention only)")
        if window is None and "sliding_attention" in layer_types:
            raise CheckpointError(f"{r.source}: layer_types has sliding_attention layers but sliding_window is null")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if window is None:
        return (None,) * layers
    if r.has("use_sliding_window") or r.has("max_window_layers"):
        if not r.get("use_sliding_window", False):
            return (None,) * layers
        first = int(r.get("max_window_layers", layers))
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers if every_layer else (None,) * layers


class LlamaFamily(Family):
    model_types = ("llama", "mistral", "qwen2", "phi3")
    config_class = LlamaConfig
    # Families whose windows apply to every layer when sliding_window is set.
    windowed_everywhere = ("mistral", "phi3")

    def base_fields(self, r: ConfigReader) -> dict:
        """The DecoderConfig fields, read the Llama way (families reuse and amend them)."""
        model_type = r.get("model_type")
        hidden = r.positive_int("hidden_size")
        heads = r.positive_int("num_attention_heads")
        kv_heads = r.positive_int("num_key_value_heads", default=heads)
        head_dim = r.positive_int("head_dim", default=hidden // heads)
        layers = r.positive_int("num_hidden_layers")
        return dict(
            model_type=model_type,
            vocab_size=r.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=r.positive_int("max_position_embeddings", default=2048),
            rope=self.rope(r, head_dim),
            tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
            layer_windows=layer_windows(r, layers, model_type in self.windowed_everywhere),
            norm_eps=r.number("rms_norm_eps", 1e-6),
        )

    def read_config(self, r: ConfigReader) -> DecoderConfig:
        fields = self.base_fields(r)
        model_type = fields["model_type"]
        act = r.get("hidden_act", "silu")
        activation(act, "hidden_act", r.source)  # refused here, at load, when unknown
        attention_bias = bool(r.get("attention_bias", model_type == "qwen2"))
        config = self.config_class(
            **fields,
            hidden_act=act,
            attention_bias=attention_bias,
            # Llama's o_proj has a bias only with attention_bias; Qwen2's never does.
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(r.get("mlp_bias", False)),
            fused=model_type == "phi3",
            **self.extra_fields(r),
        )
        check_heads(config, r.source)
        return config

    def extra_fields(self, r: ConfigReader) -> dict:
        """Fields a subclass's config adds (read here so the config is built once)."""
        return {}

    def attention_options(self, config: LlamaConfig, index: int) -> AttentionOptions:
        return AttentionOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, scale=config.head_dim ** -0.5,
            qkv=("qkv_proj",) if config.fused else ("q_proj", "k_proj", "v_proj"),
            qkv_bias=config.attention_bias, o_bias=config.o_bias, window=config.layer_windows[index],
        )

    def mlp(self, config: LlamaConfig, weights: Weights, prefix: str) -> GatedMLP:
        return GatedMLP(weights, prefix, config.hidden_size, config.intermediate_size, activation(config.hidden_act),
                        gate_up=("gate_up_proj",) if config.fused else ("gate_proj", "up_proj"), bias=config.mlp_bias)

    def layer(self, config: LlamaConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        attn = SelfAttention(self.attention_options(config, index), weights, f"{prefix}.self_attn", index,
                             rotaries.get("default"))
        return DecoderLayer(
            attn, self.mlp(config, weights, f"{prefix}.mlp"),
            input_norm=self.norm(config, weights, f"{prefix}.input_layernorm"),
            mlp_norm=self.norm(config, weights, f"{prefix}.post_attention_layernorm"),
        )
