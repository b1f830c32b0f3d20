"""What a model family provides: its config reading and its decoder block.

A family subclasses `Family`, names its model types and reads config.json into a
`DecoderConfig` (`read_config`); `layer` assembles one decoder layer from the shared parts
(SelfAttention, GatedMLP/MLP, norms). The defaults cover the Llama layout of names
(model.embed_tokens, model.layers.N, model.norm, lm_head); families with other names
override the prefixes or the part. A family built on another subclasses it and overrides
only what differs (Qwen3 = Llama + q/k norms).
"""

from __future__ import annotations

import torch

from text_generation_server.layers.norm import LayerNorm, RMSNorm
from text_generation_server.layers.rotary import RopeConfig, RopeDefaults, RotaryEmbedding, rope_config_from_hf
from text_generation_server.models.decoder import (
    DecoderConfig,
    DecoderLayer,
    DecoderModel,
    Embeddings,
    Head,
)
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights


class Family:
    model_types: tuple[str, ...] = ()
    embed_prefix = "model.embed_tokens"
    layer_prefix = "model.layers"
    norm_prefix = "model.norm"
    head_prefix = "lm_head"
    # The norm of the family: RMSNorm, or LayerNorm (with or without a bias).
    layer_norm = False
    norm_bias = True
    # Where config.json keeps the rope's base and rotated share, and their defaults (transformers'
    # config class of the model type: its default_theta and the like).
    rope_defaults = RopeDefaults()

    def read_config(self, r: ConfigReader) -> DecoderConfig:
        raise NotImplementedError

    def rope(self, r: ConfigReader, head_dim: int, **kwargs) -> RopeConfig:
        """config.json's rope as transformers reads it (layers/rotary.py), refused naming the file."""
        try:
            return rope_config_from_hf(r.data, head_dim, defaults=self.rope_defaults, **kwargs)
        except ValueError as exc:
            raise CheckpointError(f"{r.source}: {exc}") from exc

    def prepare(self, config: DecoderConfig, weights: Weights) -> None:
        """Sets up the weight view this family reads (before any part loads): aliases of tensor
        names, Conv1D weights read transposed."""

    def layer_kind(self, config: DecoderConfig, index: int) -> object:
        """Layers of one kind have the same linears (`quantize` reads them off one layer per kind);
        a family whose layers differ (dense and sparse MLPs) says which is which."""
        return None

    def rotaries(self, config: DecoderConfig, max_positions: int, device: torch.device) -> dict[str, RotaryEmbedding]:
        """The rotary embeddings layers share, by name ({} for learned positions)."""
        if config.rope is None:
            return {}
        return {"default": RotaryEmbedding(config.rope, max_positions, device)}

    def embeddings(self, config: DecoderConfig, weights: Weights) -> Embeddings:
        return Embeddings(weights, self.embed_prefix, config.vocab_size, config.hidden_size)

    def layer(self, config: DecoderConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        raise NotImplementedError

    def norm(self, config: DecoderConfig, weights: Weights, prefix: str) -> torch.nn.Module:
        """The family's norm of the hidden state at `prefix`."""
        if self.layer_norm:
            return LayerNorm.load(weights, prefix, config.hidden_size, config.norm_eps, bias=self.norm_bias)
        return RMSNorm.load(weights, prefix, config.hidden_size, config.norm_eps)

    def final_norm(self, config: DecoderConfig, weights: Weights) -> torch.nn.Module:
        return self.norm(config, weights, self.norm_prefix)

    def head(self, config: DecoderConfig, weights: Weights) -> Head:
        return Head.load(weights, config, self.head_prefix, tied_prefix=self.embed_prefix)

    def build(self, config: DecoderConfig, weights: Weights) -> DecoderModel:
        """The whole model on this rank (rotary sized for the model's full context)."""
        rotaries = self.rotaries(config, config.max_context, weights.device)
        embeddings = self.embeddings(config, weights)
        layers = [self.layer(config, weights, i, rotaries) for i in range(config.num_hidden_layers)]
        return DecoderModel(config, embeddings, layers, self.final_norm(config, weights), self.head(config, weights),
                            weights.process_group)
