"""Gemma 1, 2 and 3 (text).

Gemma: GeGLU (tanh GELU), RMSNorm scaled by 1 + w in float32, embeddings times sqrt(hidden)
rounded to the compute dtype, head_dim from the config, tied embeddings.
Gemma 2 adds soft-capping of attention scores and of the final logits, alternating sliding and
global layers, norms after attention and after the MLP, and query_pre_attn_scalar ** -0.5 as
the softmax scale.
Gemma 3 adds q/k RMSNorm per head, a layer_types pattern (sliding_window_pattern), its own rope
on sliding layers (rope_local_base_freq) and rope scaling on global ones; transformers 5.24
passes no attention soft-cap for it, so neither do we.
"""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_server.layers.mlp import GatedMLP, activation
from text_generation_server.layers.norm import RMSNorm
from text_generation_server.layers.rotary import RopeConfig, RotaryEmbedding, layered_rope_parameters
from text_generation_server.layers.self_attention import AttentionOptions, HeadNorm, SelfAttention
from text_generation_server.models.decoder import (
    DecoderConfig,
    DecoderLayer,
    Embeddings,
    Head,
    check_heads,
)
from text_generation_server.models.families.base import Family
from text_generation_server.models.families.llama import layer_windows
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights


# Gemma 3's rope base per layer type: the top-level key of older configs, and Gemma3TextConfig's default.
GEMMA3_ROPE_BASES = {"full_attention": ("rope_theta", 1_000_000.0),
                     "sliding_attention": ("rope_local_base_freq", 10_000.0)}


@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    hidden_act: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    query_pre_attn_scalar: float | None = None  # Gemma 2/3: the softmax scale is its -0.5 power
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope: RopeConfig | None = None  # Gemma 3: the rope of sliding layers


class GemmaFamily(Family):
    model_types = ("gemma", "gemma2", "gemma3_text")

    def read_config(self, r: ConfigReader) -> GemmaConfig:
        model_type = r.get("model_type")
        if r.get("use_bidirectional_attention"):
            raise r.refuse("use_bidirectional_attention", "only causal (decoder) attention is served")
        hidden = r.positive_int("hidden_size")
        heads = r.positive_int("num_attention_heads")
        head_dim = r.positive_int("head_dim", default=hidden // heads)
        layers = r.positive_int("num_hidden_layers")
        act = r.first("hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
        activation(act, "hidden_activation", r.source)
        windows = (None,) * layers
        if model_type == "gemma2":
            if not r.has("layer_types"):  # transformers' default: even layers slide
                r = r.with_values(layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention"
                                               for i in range(layers)])
            windows = layer_windows(r, layers, every_layer=False)
        if model_type != "gemma3_text":
            rope, local_rope = self.rope(r, head_dim), None
        else:
            if not r.has("layer_types"):
                pattern = r.positive_int("sliding_window_pattern", default=6)
                r = r.with_values(layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention"
                                               for i in range(layers)])
            windows = layer_windows(r, layers, every_layer=False)
            rope, local_rope = self._gemma3_ropes(r, head_dim)
        scalar = r.number("query_pre_attn_scalar", 256.0) if model_type != "gemma" else None
        attn_softcap = r.number("attn_logit_softcapping") if model_type == "gemma2" else None
        final_softcap = r.number("final_logit_softcapping") if model_type != "gemma" else None
        for key, value in (("attn_logit_softcapping", attn_softcap), ("final_logit_softcapping", final_softcap)):
            if value is not None and value <= 0:
                raise r.refuse(key, "a soft cap must be positive")
        config = GemmaConfig(
            model_type=model_type, vocab_size=r.positive_int("vocab_size"), hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size"), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=r.positive_int("num_key_value_heads", default=heads),
            head_dim=head_dim, max_position_embeddings=r.positive_int("max_position_embeddings", default=8192),
            rope=rope, tie_word_embeddings=bool(r.get("tie_word_embeddings", True)), layer_windows=windows,
            norm_eps=r.number("rms_norm_eps", 1e-6), hidden_act=act,
            attention_bias=bool(r.get("attention_bias", False)), query_pre_attn_scalar=scalar,
            attn_softcap=attn_softcap, final_softcap=final_softcap, local_rope=local_rope,
        )
        check_heads(config, r.source)
        return config

    def _gemma3_ropes(self, r: ConfigReader, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
        """(global, local) rope: transformers 5 nests rope_parameters by layer type; older configs
        give rope_theta + rope_scaling for global layers and rope_local_base_freq for local ones.
        A rope_scaling (old configs, or one a user adds) changes only the global layers'."""
        try:
            params = layered_rope_parameters(r.data, GEMMA3_ROPE_BASES)
        except ValueError as exc:
            raise CheckpointError(f"{r.source}: {exc}") from exc
        return (self.rope(r, head_dim, layer_type="full_attention", params=params),
                self.rope(r, head_dim, layer_type="sliding_attention", params=params))

    def rotaries(self, config: GemmaConfig, max_positions: int, device) -> dict[str, RotaryEmbedding]:
        out = super().rotaries(config, max_positions, device)
        if config.local_rope is not None:
            out["local"] = RotaryEmbedding(config.local_rope, max_positions, device)
        return out

    def embeddings(self, config: GemmaConfig, weights: Weights) -> Embeddings:
        return Embeddings(weights, self.embed_prefix, config.vocab_size, config.hidden_size,
                          scale=config.hidden_size ** 0.5, scale_in_dtype=True)

    def norm(self, config: GemmaConfig, weights: Weights, prefix: str) -> RMSNorm:
        return RMSNorm.load(weights, prefix, config.hidden_size, config.norm_eps, offset=1.0)

    def head(self, config: GemmaConfig, weights: Weights) -> Head:
        return Head.load(weights, config, self.head_prefix, tied_prefix=self.embed_prefix,
                         softcap=config.final_softcap)

    def layer(self, config: GemmaConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        window = config.layer_windows[index]
        gemma3 = config.model_type == "gemma3_text"
        scale = (config.query_pre_attn_scalar if config.query_pre_attn_scalar is not None else config.head_dim) ** -0.5
        opts = AttentionOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, scale=scale, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            window=window, softcap=config.attn_softcap,
            head_norm=HeadNorm("rms", config.norm_eps, offset=1.0) if gemma3 else None,
        )
        rotary = rotaries["local"] if gemma3 and window is not None else rotaries["default"]
        attn = SelfAttention(opts, weights, f"{prefix}.self_attn", index, rotary)
        mlp = GatedMLP(weights, f"{prefix}.mlp", config.hidden_size, config.intermediate_size,
                       activation(config.hidden_act))
        if config.model_type == "gemma":
            return DecoderLayer(attn, mlp, input_norm=self.norm(config, weights, f"{prefix}.input_layernorm"),
                                mlp_norm=self.norm(config, weights, f"{prefix}.post_attention_layernorm"))
        return DecoderLayer(
            attn, mlp,
            input_norm=self.norm(config, weights, f"{prefix}.input_layernorm"),
            post_attn_norm=self.norm(config, weights, f"{prefix}.post_attention_layernorm"),
            mlp_norm=self.norm(config, weights, f"{prefix}.pre_feedforward_layernorm"),
            post_mlp_norm=self.norm(config, weights, f"{prefix}.post_feedforward_layernorm"),
        )
