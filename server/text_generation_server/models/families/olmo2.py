"""OLMo 2: the Llama layout with norms after the sublayers instead of before, and an RMSNorm on
the whole q and k projections (across tensor-parallel ranks)."""

from __future__ import annotations

from dataclasses import replace

from text_generation_server.layers.norm import RMSNorm
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.layers.self_attention import AttentionOptions, HeadNorm, SelfAttention
from text_generation_server.models.decoder import DecoderLayer
from text_generation_server.models.families.llama import LlamaConfig, LlamaFamily
from text_generation_server.quantizers.weights import Weights


class Olmo2Family(LlamaFamily):
    model_types = ("olmo2",)

    def attention_options(self, config: LlamaConfig, index: int) -> AttentionOptions:
        return replace(super().attention_options(config, index),
                       head_norm=HeadNorm("rms_projection", config.norm_eps))

    def norm(self, config: LlamaConfig, weights: Weights, prefix: str) -> RMSNorm:
        # OLMo 2's RMSNorm multiplies by the weight in float32 and casts the product.
        return RMSNorm.load(weights, prefix, config.hidden_size, config.norm_eps, float_scale=True)

    def layer(self, config: LlamaConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        attn = SelfAttention(self.attention_options(config, index), weights, f"{prefix}.self_attn", index,
                             rotaries.get("default"))
        return DecoderLayer(
            attn, self.mlp(config, weights, f"{prefix}.mlp"),
            post_attn_norm=self.norm(config, weights, f"{prefix}.post_attention_layernorm"),
            post_mlp_norm=self.norm(config, weights, f"{prefix}.post_feedforward_layernorm"),
        )
