"""Cohere (Command-R): one bias-free LayerNorm feeding attention and the MLP in parallel,
interleaved rotary (pairs 2i, 2i + 1), optional per-head LayerNorm on q and k (a weight row
per head), and logits multiplied by logit_scale."""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_server.layers.mlp import GatedMLP, activation
from text_generation_server.layers.rotary import RopeDefaults, RotaryEmbedding
from text_generation_server.layers.self_attention import AttentionOptions, HeadNorm, SelfAttention
from text_generation_server.models.decoder import DecoderConfig, DecoderLayer, Head, check_heads
from text_generation_server.models.families.base import Family
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class CohereConfig(DecoderConfig):
    hidden_act: str = "silu"
    attention_bias: bool = False
    use_qk_norm: bool = False
    logit_scale: float = 1.0


class CohereFamily(Family):
    model_types = ("cohere",)
    layer_norm = True
    norm_bias = False
    rope_defaults = RopeDefaults(theta=500000.0)  # CohereConfig.default_theta

    def read_config(self, r: ConfigReader) -> CohereConfig:
        hidden = r.positive_int("hidden_size")
        heads = r.positive_int("num_attention_heads")
        head_dim = hidden // heads
        act = r.get("hidden_act", "silu")
        activation(act, "hidden_act", r.source)
        layers = r.positive_int("num_hidden_layers")
        config = CohereConfig(
            model_type=r.get("model_type"), vocab_size=r.positive_int("vocab_size"), hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size"), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=r.positive_int("num_key_value_heads", default=heads),
            head_dim=head_dim, max_position_embeddings=r.positive_int("max_position_embeddings", default=8192),
            rope=self.rope(r, head_dim, interleaved=True),
            tie_word_embeddings=bool(r.get("tie_word_embeddings", True)), layer_windows=(None,) * layers,
            norm_eps=r.number("layer_norm_eps", 1e-5), hidden_act=act,
            attention_bias=bool(r.get("attention_bias", False)), use_qk_norm=bool(r.get("use_qk_norm", False)),
            logit_scale=r.number("logit_scale", 0.0625),
        )
        check_heads(config, r.source)
        return config

    def head(self, config: CohereConfig, weights: Weights) -> Head:
        return Head.load(weights, config, self.head_prefix, tied_prefix=self.embed_prefix,
                         multiplier=config.logit_scale)

    def layer(self, config: CohereConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        opts = AttentionOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, scale=config.head_dim ** -0.5, qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            head_norm=HeadNorm("layer", config.norm_eps, per_head=True) if config.use_qk_norm else None,
        )
        attn = SelfAttention(opts, weights, f"{prefix}.self_attn", index, rotaries["default"])
        mlp = GatedMLP(weights, f"{prefix}.mlp", config.hidden_size, config.intermediate_size,
                       activation(config.hidden_act))
        return DecoderLayer(attn, mlp, input_norm=self.norm(config, weights, f"{prefix}.input_layernorm"), parallel=True)
