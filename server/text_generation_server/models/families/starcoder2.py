"""StarCoder2: the Llama attention with biases and a sliding window, a plain MLP (c_fc, c_proj)
and LayerNorms with biases."""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_server.layers.mlp import MLP, activation
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.layers.self_attention import AttentionOptions, SelfAttention
from text_generation_server.models.decoder import DecoderConfig, DecoderLayer, check_heads
from text_generation_server.models.families.base import Family
from text_generation_server.models.families.llama import layer_windows
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class Starcoder2Config(DecoderConfig):
    hidden_act: str = "gelu_pytorch_tanh"
    use_bias: bool = True


class Starcoder2Family(Family):
    model_types = ("starcoder2",)
    layer_norm = True

    def read_config(self, r: ConfigReader) -> Starcoder2Config:
        hidden = r.positive_int("hidden_size")
        heads = r.positive_int("num_attention_heads")
        head_dim = hidden // heads
        act = r.get("hidden_act", "gelu_pytorch_tanh")
        activation(act, "hidden_act", r.source)
        layers = r.positive_int("num_hidden_layers")
        config = Starcoder2Config(
            model_type="starcoder2", vocab_size=r.positive_int("vocab_size"), hidden_size=hidden,
            intermediate_size=r.positive_int("intermediate_size"), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=r.positive_int("num_key_value_heads", default=heads),
            head_dim=head_dim, max_position_embeddings=r.positive_int("max_position_embeddings", default=4096),
            rope=self.rope(r, head_dim), tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
            layer_windows=layer_windows(r, layers, every_layer=True), norm_eps=r.number("norm_epsilon", 1e-5),
            hidden_act=act, use_bias=bool(r.get("use_bias", True)),
        )
        check_heads(config, r.source)
        return config

    def layer(self, config: Starcoder2Config, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        opts = AttentionOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, scale=config.head_dim ** -0.5, qkv_bias=config.use_bias,
            o_bias=config.use_bias, window=config.layer_windows[index],
        )
        attn = SelfAttention(opts, weights, f"{prefix}.self_attn", index, rotaries["default"])
        mlp = MLP(weights, f"{prefix}.mlp", config.hidden_size, config.intermediate_size, activation(config.hidden_act),
                  fc_in="c_fc", fc_out="c_proj", bias=config.use_bias)
        return DecoderLayer(attn, mlp, input_norm=self.norm(config, weights, f"{prefix}.input_layernorm"),
                            mlp_norm=self.norm(config, weights, f"{prefix}.post_attention_layernorm"))
