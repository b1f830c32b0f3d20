"""GPT-2 and GPT-BigCode (SantaCoder, StarCoder 1): learned positions, LayerNorms with biases,
a plain MLP, no rotary. GPT-2 stores its linears as Conv1D ([in, out], read transposed here);
BigCode uses Linear and, with multi_query, one KV head ([q | k | v] rows) instead of GPT-2's
[q | k | v] of full width or its per-head [heads, 3, head_dim] layout without multi_query."""

from __future__ import annotations

import re
from dataclasses import dataclass

from text_generation_server.layers.mlp import MLP, activation
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.layers.self_attention import GROUPED, SPLIT, AttentionOptions, SelfAttention
from text_generation_server.models.decoder import DecoderConfig, DecoderLayer, Embeddings, check_heads
from text_generation_server.models.families.base import Family
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.weights import Weights

_CONV1D = re.compile(r"^(transformer\.)?h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


@dataclass(frozen=True)
class GPT2Config(DecoderConfig):
    hidden_act: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_by_layer: bool = False  # GPT-2's scale_attn_by_inverse_layer_idx
    multi_query: bool = False


class GPT2Family(Family):
    model_types = ("gpt2", "gpt_bigcode")
    layer_norm = True
    embed_prefix = "transformer.wte"
    layer_prefix = "transformer.h"
    norm_prefix = "transformer.ln_f"

    def read_config(self, r: ConfigReader) -> GPT2Config:
        model_type = r.get("model_type")
        if r.get("add_cross_attention", False):
            raise r.refuse("add_cross_attention", "cross-attention (an encoder-decoder use of GPT-2) is not served")
        hidden = r.positive_int("n_embd", "hidden_size")
        heads = r.positive_int("n_head", "num_attention_heads")
        layers = r.positive_int("n_layer", "num_hidden_layers")
        act = r.get("activation_function", "gelu_new" if model_type == "gpt2" else "gelu_pytorch_tanh")
        activation(act, "activation_function", r.source)
        multi_query = model_type == "gpt_bigcode" and bool(r.get("multi_query", True))
        config = GPT2Config(
            model_type=model_type, vocab_size=r.positive_int("vocab_size"), hidden_size=hidden,
            intermediate_size=r.positive_int("n_inner", default=4 * hidden), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=1 if multi_query else heads, head_dim=hidden // heads,
            max_position_embeddings=r.positive_int("n_positions", "max_position_embeddings", default=1024),
            rope=None, tie_word_embeddings=bool(r.get("tie_word_embeddings", True)), layer_windows=(None,) * layers,
            norm_eps=r.number("layer_norm_epsilon", 1e-5), hidden_act=act,
            scale_attn_weights=bool(r.get("scale_attn_weights", True)),
            scale_by_layer=model_type == "gpt2" and bool(r.get("scale_attn_by_inverse_layer_idx", False)),
            multi_query=multi_query,
        )
        check_heads(config, r.source)
        return config

    def transposed(self, name: str) -> bool:
        return bool(_CONV1D.match(name))

    def prepare(self, config: GPT2Config, weights: Weights) -> None:
        # GPT2Model checkpoints (no LM head wrapper) name their tensors without "transformer.".
        for name in weights.tensor_names():
            if not name.startswith("transformer.") and name != "lm_head.weight":
                weights.aliases.setdefault(f"transformer.{name}", [name])
        if config.model_type == "gpt2":
            weights.transpose(self.transposed)

    def embeddings(self, config: GPT2Config, weights: Weights) -> Embeddings:
        return Embeddings(weights, self.embed_prefix, config.vocab_size, config.hidden_size,
                          positions="transformer.wpe", max_positions=config.max_position_embeddings)

    def layer(self, config: GPT2Config, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        scale = config.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_by_layer:
            scale /= float(index + 1)
        # BigCode without multi_query lays q/k/v out per head; GPT-2 and multi-query as blocks.
        layout = GROUPED if config.model_type == "gpt_bigcode" and not config.multi_query else SPLIT
        opts = AttentionOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, scale=scale, qkv=("c_attn",), layout=layout, qkv_bias=True, o_proj="c_proj",
            o_bias=True,
        )
        attn = SelfAttention(opts, weights, f"{prefix}.attn", index, None)
        mlp = MLP(weights, f"{prefix}.mlp", config.hidden_size, config.intermediate_size, activation(config.hidden_act),
                  fc_in="c_fc", fc_out="c_proj")
        return DecoderLayer(attn, mlp, input_norm=self.norm(config, weights, f"{prefix}.ln_1"),
                            mlp_norm=self.norm(config, weights, f"{prefix}.ln_2"))
