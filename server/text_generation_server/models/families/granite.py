"""Granite: the Llama layout with four multipliers (embeddings, residual branches, attention
scale, and a divisor of the logits)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.layers.self_attention import AttentionOptions
from text_generation_server.models.decoder import DecoderLayer, Embeddings, Head
from text_generation_server.models.families.llama import LlamaConfig, LlamaFamily
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class GraniteConfig(LlamaConfig):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteFamily(LlamaFamily):
    model_types = ("granite",)
    config_class = GraniteConfig

    def extra_fields(self, r: ConfigReader) -> dict:
        fields = {key: r.number(key, 1.0) for key in ("embedding_multiplier", "residual_multiplier",
                                                       "attention_multiplier", "logits_scaling")}
        if fields["logits_scaling"] == 0:
            raise r.refuse("logits_scaling", "the logits are divided by it")
        return fields

    def embeddings(self, config: GraniteConfig, weights: Weights) -> Embeddings:
        return Embeddings(weights, self.embed_prefix, config.vocab_size, config.hidden_size,
                          scale=config.embedding_multiplier)

    def attention_options(self, config: GraniteConfig, index: int) -> AttentionOptions:
        return replace(super().attention_options(config, index), scale=config.attention_multiplier)

    def layer(self, config: GraniteConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        layer = super().layer(config, weights, index, rotaries)
        layer.residual_scale = config.residual_multiplier
        return layer

    def head(self, config: GraniteConfig, weights: Weights) -> Head:
        return Head.load(weights, config, self.head_prefix, tied_prefix=self.embed_prefix,
                         divisor=config.logits_scaling)
