"""GPT-NeoX (Pythia): q/k/v fused per head ([heads, 3, head_dim] rows), partial rotary, a parallel
residual with two LayerNorms (or sequential when use_parallel_residual is false)."""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_server.layers.mlp import MLP, activation
from text_generation_server.layers.rotary import RopeDefaults, RotaryEmbedding
from text_generation_server.layers.self_attention import GROUPED, AttentionOptions, SelfAttention
from text_generation_server.models.decoder import DecoderConfig, DecoderLayer, check_heads
from text_generation_server.models.families.base import Family
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class GPTNeoXConfig(DecoderConfig):
    hidden_act: str = "gelu"
    attention_bias: bool = True
    parallel_residual: bool = True


class GPTNeoXFamily(Family):
    model_types = ("gpt_neox",)
    layer_norm = True
    embed_prefix = "gpt_neox.embed_in"
    layer_prefix = "gpt_neox.layers"
    norm_prefix = "gpt_neox.final_layer_norm"
    # Older configs: rotary_emb_base and rotary_pct (transformers 5 moves both into rope_parameters);
    # GPTNeoXConfig reads no top-level rope_theta or partial_rotary_factor.
    rope_defaults = RopeDefaults(theta_key="rotary_emb_base", partial_rotary_factor=0.25, partial_key="rotary_pct")

    def read_config(self, r: ConfigReader) -> GPTNeoXConfig:
        hidden = r.positive_int("hidden_size")
        heads = r.positive_int("num_attention_heads")
        head_dim = hidden // heads
        act = r.get("hidden_act", "gelu")
        activation(act, "hidden_act", r.source)
        layers = r.positive_int("num_hidden_layers")
        config = GPTNeoXConfig(
            model_type="gpt_neox", vocab_size=r.positive_int("vocab_size"), hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size"), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
            max_position_embeddings=r.positive_int("max_position_embeddings", default=2048),
            rope=self.rope(r, head_dim),
            tie_word_embeddings=bool(r.get("tie_word_embeddings", False)), layer_windows=(None,) * layers,
            norm_eps=r.number("layer_norm_eps", 1e-5), hidden_act=act,
            attention_bias=bool(r.get("attention_bias", True)),
            parallel_residual=bool(r.get("use_parallel_residual", True)),
        )
        check_heads(config, r.source)
        return config

    def prepare(self, config: GPTNeoXConfig, weights: Weights) -> None:
        # Checkpoints before transformers 5 name the head embed_out.
        weights.aliases.setdefault("lm_head.weight", ["embed_out.weight"])

    def layer(self, config: GPTNeoXConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        opts = AttentionOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, scale=config.head_dim ** -0.5, qkv=("query_key_value",), layout=GROUPED,
            qkv_bias=config.attention_bias, o_proj="dense", o_bias=config.attention_bias,
        )
        attn = SelfAttention(opts, weights, f"{prefix}.attention", index, rotaries["default"])
        mlp = MLP(weights, f"{prefix}.mlp", config.hidden_size, config.intermediate_size, activation(config.hidden_act),
                  fc_in="dense_h_to_4h", fc_out="dense_4h_to_h")
        return DecoderLayer(attn, mlp, input_norm=self.norm(config, weights, f"{prefix}.input_layernorm"),
                            mlp_norm=self.norm(config, weights, f"{prefix}.post_attention_layernorm"),
                            parallel=config.parallel_residual)
