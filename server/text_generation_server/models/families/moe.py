"""Mixture-of-experts families on the Llama attention: Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss.

Each differs from its dense sibling only in the feed-forward block (layers/moe.py) and, for
gpt-oss, in attention (biases, sinks, alternating windows, yarn) and in how its checkpoints
store experts: one [E, H, 2I] tensor per layer with gate and up interleaved along the last
dimension, read here as per-expert Linear weights through derived tensors, so every loader,
the sharding rules and `quantize` see the same per-expert names as for the other families.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from text_generation_server.layers.mlp import GatedMLP, activation
from text_generation_server.layers.moe import (
    SWIGLU_OAI,
    ExpertOptions,
    Experts,
    Router,
    RouterOptions,
    SparseMoE,
    moe_layer_indices,
)
from text_generation_server.layers.norm import RMSNorm
from text_generation_server.layers.rotary import RopeDefaults, RotaryEmbedding
from text_generation_server.layers.self_attention import (
    AttentionOptions,
    HeadNorm,
    SelfAttention,
)
from text_generation_server.models.decoder import (
    DecoderConfig,
    DecoderLayer,
)
from text_generation_server.models.families.llama import LlamaConfig, LlamaFamily
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sources import CheckpointError, DerivedTensor
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    num_experts: int = 0
    experts_per_token: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: frozenset[int] = frozenset()
    shared_expert_intermediate_size: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class MoeFamily(LlamaFamily):
    """What the MoE families share: config fields, the decoder layer choosing a sparse or a dense
    MLP per layer. Subclasses name their tensors and their routing."""

    model_types: tuple[str, ...] = ()
    config_class = MoeConfig
    windowed_everywhere = ("mixtral",)
    # Where a layer's MoE block lives (under model.layers.N) and its router's name in it.
    moe_prefix = "mlp"
    router_name = "gate"

    def moe_fields(self, r: ConfigReader, layers: int) -> dict:
        raise NotImplementedError

    def extra_fields(self, r: ConfigReader) -> dict:
        fields = self.moe_fields(r, r.positive_int("num_hidden_layers"))
        experts, top_k = fields["num_experts"], fields["experts_per_token"]
        if fields["sparse_layers"] and not 0 < top_k <= experts:
            raise CheckpointError(f"{r.source}: num_experts_per_tok ({top_k}) must be between 1 and the "
                                  f"{experts} experts")
        return fields

    def router_options(self, config: MoeConfig) -> RouterOptions:
        return RouterOptions(config.num_experts, config.experts_per_token, renormalize=config.norm_topk_prob)

    def layer_kind(self, config: MoeConfig, index: int) -> object:
        return "sparse" if index in config.sparse_layers else "dense"

    def expert_names(self, prefix: str, e: int) -> tuple[str, str, str]:
        return (f"{prefix}.experts.{e}.gate_proj", f"{prefix}.experts.{e}.up_proj", f"{prefix}.experts.{e}.down_proj")

    def expert_options(self, config: MoeConfig, prefix: str) -> ExpertOptions:
        return ExpertOptions(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                             lambda e: self.expert_names(prefix, e), act=config.hidden_act,
                             top_k=config.experts_per_token)

    def sparse_block(self, config: MoeConfig, weights: Weights, prefix: str) -> SparseMoE:
        router = Router.load(weights, f"{prefix}.{self.router_name}", self.router_options(config), config.hidden_size)
        experts = Experts(self.expert_options(config, prefix), weights)
        return SparseMoE(router, experts, weights.process_group)

    def attention(self, config: MoeConfig, weights: Weights, prefix: str, index: int,
                  rotaries: dict[str, RotaryEmbedding]) -> torch.nn.Module:
        return SelfAttention(self.attention_options(config, index), weights, prefix, index, rotaries.get("default"))

    def layer(self, config: MoeConfig, weights: Weights, index: int,
              rotaries: dict[str, RotaryEmbedding]) -> DecoderLayer:
        prefix = f"{self.layer_prefix}.{index}"
        attn = self.attention(config, weights, f"{prefix}.self_attn", index, rotaries)
        if index in config.sparse_layers:
            mlp: torch.nn.Module = self.sparse_block(config, weights, f"{prefix}.{self.moe_prefix}")
        else:
            mlp = self.mlp(config, weights, f"{prefix}.mlp")
        return DecoderLayer(
            attn, mlp,
            input_norm=self.norm(config, weights, f"{prefix}.input_layernorm"),
            mlp_norm=self.norm(config, weights, f"{prefix}.post_attention_layernorm"),
        )


class MixtralFamily(MoeFamily):
    """Mixtral: every layer sparse, softmax routing renormalised over the top k, float32 weights."""

    model_types = ("mixtral",)
    moe_prefix = "block_sparse_moe"
    rope_defaults = RopeDefaults(theta=1_000_000.0)  # MixtralConfig.default_theta

    def moe_fields(self, r: ConfigReader, layers: int) -> dict:
        return dict(num_experts=r.positive_int("num_local_experts"),
                    experts_per_token=r.positive_int("num_experts_per_tok"),
                    moe_intermediate_size=r.positive_int("intermediate_size"),
                    sparse_layers=frozenset(range(layers)))

    def router_options(self, config: MoeConfig) -> RouterOptions:
        return RouterOptions(config.num_experts, config.experts_per_token, renormalize=True, float32_weights=True)

    def expert_names(self, prefix: str, e: int) -> tuple[str, str, str]:
        return (f"{prefix}.experts.{e}.w1", f"{prefix}.experts.{e}.w3", f"{prefix}.experts.{e}.w2")


class Qwen2MoeFamily(MoeFamily):
    """Qwen2-MoE: Qwen2 attention (qkv bias), sparse layers by decoder_sparse_step and
    mlp_only_layers, a shared expert gated by sigmoid(shared_expert_gate(x))."""

    model_types = ("qwen2_moe",)

    def moe_fields(self, r: ConfigReader, layers: int) -> dict:
        experts = int(r.first("num_experts", "num_local_experts", default=0))
        mlp_only = r.get("mlp_only_layers") or []
        return dict(num_experts=experts,
                    experts_per_token=r.positive_int("num_experts_per_tok", default=1),
                    moe_intermediate_size=r.positive_int("moe_intermediate_size"),
                    norm_topk_prob=bool(r.get("norm_topk_prob", False)),
                    sparse_layers=frozenset(moe_layer_indices(layers, r.positive_int("decoder_sparse_step", default=1),
                                                              list(mlp_only), experts)),
                    shared_expert_intermediate_size=int(r.get("shared_expert_intermediate_size", 0)))

    def read_config(self, r: ConfigReader) -> DecoderConfig:
        config = super().read_config(r)
        # Qwen2-MoE names its q/k/v bias flag qkv_bias (default on); o_proj never has one.
        return replace(config, attention_bias=bool(r.get("qkv_bias", True)), o_bias=False)

    def sparse_block(self, config: MoeConfig, weights: Weights, prefix: str) -> SparseMoE:
        block = super().sparse_block(config, weights, prefix)
        if config.shared_expert_intermediate_size > 0:
            block.shared = GatedMLP(weights, f"{prefix}.shared_expert", config.hidden_size,
                                    config.shared_expert_intermediate_size, activation(config.hidden_act))
            gate = weights.get_tensor(f"{prefix}.shared_expert_gate.weight")
            if list(gate.shape) != [1, config.hidden_size]:
                raise CheckpointError(f"'{prefix}.shared_expert_gate.weight' has shape {list(gate.shape)}, expected "
                                      f"[1, {config.hidden_size}] (in {weights.files_of(prefix)})")
            block.shared_gate = torch.nn.Parameter(gate, requires_grad=False)
        return block


class Qwen3MoeFamily(Qwen2MoeFamily):
    """Qwen3-MoE: Qwen3 attention (q/k head norms, no bias), no shared expert."""

    model_types = ("qwen3_moe",)

    def read_config(self, r: ConfigReader) -> DecoderConfig:
        config = MoeFamily.read_config(self, r)
        config = replace(config, attention_bias=bool(r.get("attention_bias", False)), o_bias=False,
                         shared_expert_intermediate_size=0)
        if r.get("layer_types") is None and r.get("use_sliding_window") and r.get("sliding_window"):
            # Qwen3-MoE windows every layer when use_sliding_window is set (no max_window_layers).
            config = replace(config, layer_windows=(int(r.get("sliding_window")),) * config.num_hidden_layers)
        return config

    def attention_options(self, config: MoeConfig, index: int) -> AttentionOptions:
        return replace(super().attention_options(config, index), head_norm=HeadNorm("rms", config.norm_eps))


class GptOssFamily(MoeFamily):
    """gpt-oss: biased attention with sinks, alternating sliding/full layers (layer_types), yarn,
    a biased router (top-k logits, softmax over the k), experts with biases and a clamped SwiGLU,
    RMSNorm scaled in float32."""

    model_types = ("gpt_oss",)
    router_name = "router"
    # GptOssConfig: its default_theta, and its rope when config.json has none.
    rope_defaults = RopeDefaults(theta=150_000.0, parameters={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096})

    def moe_fields(self, r: ConfigReader, layers: int) -> dict:
        return dict(num_experts=r.positive_int("num_local_experts"),
                    experts_per_token=r.positive_int("num_experts_per_tok"),
                    moe_intermediate_size=r.positive_int("intermediate_size"),
                    sparse_layers=frozenset(range(layers)),
                    swiglu_alpha=r.number("swiglu_alpha", 1.702),
                    swiglu_limit=r.number("swiglu_limit", 7.0))

    def read_config(self, r: ConfigReader) -> DecoderConfig:
        config = super().read_config(r)
        bias = bool(r.get("attention_bias", True))
        return replace(config, attention_bias=bias, o_bias=bias, norm_eps=r.number("rms_norm_eps", 1e-5))

    def attention_options(self, config: MoeConfig, index: int) -> AttentionOptions:
        return replace(super().attention_options(config, index), sinks=True)

    def norm(self, config: DecoderConfig, weights: Weights, prefix: str) -> torch.nn.Module:
        # GptOssRMSNorm multiplies by the weight in float32 and casts the product.
        return RMSNorm.load(weights, prefix, config.hidden_size, config.norm_eps, float_scale=True)

    def router_options(self, config: MoeConfig) -> RouterOptions:
        return RouterOptions(config.num_experts, config.experts_per_token, scoring="topk_softmax", bias=True)

    def expert_options(self, config: MoeConfig, prefix: str) -> ExpertOptions:
        return ExpertOptions(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                             lambda e: self.expert_names(prefix, e), act=SWIGLU_OAI, bias=True,
                             top_k=config.experts_per_token,
                             swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)

    def prepare(self, config: MoeConfig, weights: Weights) -> None:
        """Per-expert names for the stacked tensors (when the checkpoint stores them stacked)."""
        names = weights.tensor_names()
        mxfp4 = sorted(n for n in names if n.endswith("_blocks"))[:1]
        if mxfp4:
            raise CheckpointError(f"tensor '{mxfp4[0]}': gpt-oss MXFP4 expert blocks are not supported; use the "
                                  "bf16 checkpoint (or quantize it with `text-generation-server quantize`)")
        views: dict[str, DerivedTensor] = {}
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        for index in config.sparse_layers:
            prefix = f"{self.layer_prefix}.{index}.{self.moe_prefix}.experts"
            if f"{prefix}.gate_up_proj" not in names:
                continue  # per-expert tensors already (a checkpoint `quantize` wrote)
            self._check_stacked(weights, prefix, experts, hidden, inter)
            for e in range(experts):
                views[f"{prefix}.{e}.gate_proj.weight"] = DerivedTensor(
                    f"{prefix}.gate_up_proj", e, lambda t: t[:, 0::2].t(), (inter, hidden))
                views[f"{prefix}.{e}.up_proj.weight"] = DerivedTensor(
                    f"{prefix}.gate_up_proj", e, lambda t: t[:, 1::2].t(), (inter, hidden))
                views[f"{prefix}.{e}.gate_proj.bias"] = DerivedTensor(
                    f"{prefix}.gate_up_proj_bias", e, lambda t: t[0::2], (inter,))
                views[f"{prefix}.{e}.up_proj.bias"] = DerivedTensor(
                    f"{prefix}.gate_up_proj_bias", e, lambda t: t[1::2], (inter,))
                views[f"{prefix}.{e}.down_proj.weight"] = DerivedTensor(
                    f"{prefix}.down_proj", e, lambda t: t.t(), (hidden, inter))
                views[f"{prefix}.{e}.down_proj.bias"] = DerivedTensor(
                    f"{prefix}.down_proj_bias", e, lambda t: t, (hidden,))
        if views:
            weights.derive(views)

    @staticmethod
    def _check_stacked(weights: Weights, prefix: str, experts: int, hidden: int, inter: int) -> None:
        expected = {"gate_up_proj": [experts, hidden, 2 * inter], "gate_up_proj_bias": [experts, 2 * inter],
                    "down_proj": [experts, inter, hidden], "down_proj_bias": [experts, hidden]}
        for name, shape in expected.items():
            found = weights.get_shape(f"{prefix}.{name}")
            if list(found) != shape:
                raise CheckpointError(f"'{prefix}.{name}' has shape {list(found)}, expected {shape} "
                                      f"(experts, ...) (in {weights.files_of(f'{prefix}.{name}')})")
