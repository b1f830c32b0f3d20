"""Falcon: q/k/v fused in one tensor, laid out per KV group ([q x heads/kv, k, v] rows) in the
new decoder architecture (Falcon-40B/180B) and the multi-head one, or as [q | k | v] with a
single KV head (multi_query, Falcon-7B); parallel attention and MLP with one or two LayerNorms,
or sequential. ALiBi checkpoints (Falcon-RW) are refused."""

from __future__ import annotations

from dataclasses import dataclass

from text_generation_server.layers.mlp import MLP, activation
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.layers.self_attention import GROUPED, SPLIT, AttentionOptions, SelfAttention
from text_generation_server.models.decoder import DecoderConfig, DecoderLayer, check_heads
from text_generation_server.models.families.base import Family
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class FalconConfig(DecoderConfig):
    hidden_act: str = "gelu"
    bias: bool = False
    new_decoder_architecture: bool = False
    multi_query: bool = True
    parallel_attn: bool = True
    two_norms: bool = False  # new architecture with ln_attn and ln_mlp


class FalconFamily(Family):
    model_types = ("falcon",)
    layer_norm = True
    embed_prefix = "transformer.word_embeddings"
    layer_prefix = "transformer.h"
    norm_prefix = "transformer.ln_f"

    def read_config(self, r: ConfigReader) -> FalconConfig:
        if r.get("alibi", False):
            raise r.refuse("alibi", "ALiBi position biases (Falcon-RW) are not implemented; rotary Falcon models are")
        hidden = r.positive_int("hidden_size", "n_embd")
        heads = r.positive_int("num_attention_heads", "n_head")
        head_dim = hidden // heads
        layers = r.positive_int("num_hidden_layers", "n_layer")
        new_arch = bool(r.get("new_decoder_architecture", False))
        multi_query = bool(r.get("multi_query", True))
        if new_arch or not multi_query:
            kv_heads = r.positive_int("num_kv_heads", default=heads)
        else:
            kv_heads = 1
        act = r.get("activation", "gelu")
        activation(act, "activation", r.source)
        config = FalconConfig(
            model_type="falcon", vocab_size=r.positive_int("vocab_size"), hidden_size=hidden,
            intermediate_size=r.positive_int("ffn_hidden_size", default=4 * hidden), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=r.positive_int("max_position_embeddings", default=2048),
            rope=self.rope(r, head_dim), tie_word_embeddings=bool(r.get("tie_word_embeddings", True)),
            layer_windows=(None,) * layers, norm_eps=r.number("layer_norm_epsilon", 1e-5), hidden_act=act,
            bias=bool(r.get("bias", False)), new_decoder_architecture=new_arch, multi_query=multi_query,
            parallel_attn=bool(r.get("parallel_attn", True)),
            two_norms=new_arch and int(r.get("num_ln_in_parallel_attn", 2)) == 2,
        )
        check_heads(config, r.source)
        return config

    def layer(self, config: FalconConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        grouped = config.new_decoder_architecture or not config.multi_query
        opts = AttentionOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, scale=config.head_dim ** -0.5, qkv=("query_key_value",),
            layout=GROUPED if grouped else SPLIT, qkv_bias=config.bias, o_proj="dense", o_bias=config.bias,
        )
        attn = SelfAttention(opts, weights, f"{prefix}.self_attention", index, rotaries["default"])
        mlp = MLP(weights, f"{prefix}.mlp", config.hidden_size, config.intermediate_size, activation(config.hidden_act),
                  fc_in="dense_h_to_4h", fc_out="dense_4h_to_h", bias=config.bias)
        if config.two_norms:
            return DecoderLayer(attn, mlp, input_norm=self.norm(config, weights, f"{prefix}.ln_attn"),
                                mlp_norm=self.norm(config, weights, f"{prefix}.ln_mlp"), parallel=True)
        norm = self.norm(config, weights, f"{prefix}.input_layernorm")
        if config.new_decoder_architecture or config.parallel_attn:
            return DecoderLayer(attn, mlp, input_norm=norm, parallel=True)
        return DecoderLayer(attn, mlp, input_norm=norm,
                            mlp_norm=self.norm(config, weights, f"{prefix}.post_attention_layernorm"))
