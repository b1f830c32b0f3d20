"""Phi-2 (model_type `phi`): attention and MLP in parallel off one LayerNorm, partial rotary,
biases everywhere (the head too), an optional LayerNorm on q and k shared by the heads."""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_server.layers.mlp import MLP, activation
from text_generation_server.layers.rotary import RopeDefaults, RotaryEmbedding
from text_generation_server.layers.self_attention import AttentionOptions, HeadNorm, SelfAttention
from text_generation_server.models.decoder import DecoderConfig, DecoderLayer, Head, check_heads
from text_generation_server.models.families.base import Family
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class PhiConfig(DecoderConfig):
    hidden_act: str = "gelu_new"
    qk_layernorm: bool = False


class PhiFamily(Family):
    model_types = ("phi",)
    norm_prefix = "model.final_layernorm"
    layer_norm = True
    rope_defaults = RopeDefaults(partial_rotary_factor=0.5)  # PhiConfig's, for configs that give none

    def read_config(self, r: ConfigReader) -> PhiConfig:
        hidden = r.positive_int("hidden_size")
        heads = r.positive_int("num_attention_heads")
        head_dim = r.positive_int("head_dim", default=hidden // heads)
        act = r.get("hidden_act", "gelu_new")
        activation(act, "hidden_act", r.source)
        layers = r.positive_int("num_hidden_layers")
        config = PhiConfig(
            model_type="phi", vocab_size=r.positive_int("vocab_size"), hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size"), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=r.positive_int("num_key_value_heads", default=heads),
            head_dim=head_dim, max_position_embeddings=r.positive_int("max_position_embeddings", default=2048),
            rope=self.rope(r, head_dim),
            tie_word_embeddings=bool(r.get("tie_word_embeddings", False)), layer_windows=(None,) * layers,
            norm_eps=r.number("layer_norm_eps", 1e-5), hidden_act=act, qk_layernorm=bool(r.get("qk_layernorm", False)),
        )
        check_heads(config, r.source)
        return config

    def head(self, config: PhiConfig, weights: Weights) -> Head:
        return Head.load(weights, config, self.head_prefix, tied_prefix=self.embed_prefix, bias=True)

    def layer(self, config: PhiConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        opts = AttentionOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, scale=config.head_dim ** -0.5, qkv_bias=True, o_proj="dense", o_bias=True,
            head_norm=HeadNorm("layer", config.norm_eps, q_name="q_layernorm", k_name="k_layernorm", bias=True)
            if config.qk_layernorm else None,
        )
        attn = SelfAttention(opts, weights, f"{prefix}.self_attn", index, rotaries["default"])
        mlp = MLP(weights, f"{prefix}.mlp", config.hidden_size, config.intermediate_size, activation(config.hidden_act),
                  fc_in="fc1", fc_out="fc2")
        return DecoderLayer(attn, mlp, input_norm=self.norm(config, weights, f"{prefix}.input_layernorm"), parallel=True)
