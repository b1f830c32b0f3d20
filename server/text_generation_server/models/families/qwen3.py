"""Qwen3: the Llama layout with an RMSNorm on each query and key head before rotary."""

from __future__ import annotations

from dataclasses import replace

from text_generation_server.layers.self_attention import AttentionOptions, HeadNorm
from text_generation_server.models.families.llama import LlamaConfig, LlamaFamily


class Qwen3Family(LlamaFamily):
    model_types = ("qwen3",)

    def attention_options(self, config: LlamaConfig, index: int) -> AttentionOptions:
        return replace(super().attention_options(config, index), head_norm=HeadNorm("rms", config.norm_eps))
