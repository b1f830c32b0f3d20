"""DeepSeek-V2 and DeepSeek-V3 (also R1, V2-Lite, Moonlight, Kimi-K2): multi-head latent
attention (layers/mla.py) and DeepSeek's mixture of experts.

Read from transformers' modeling code (deepseek_v2, deepseek_v3):
- Attention: q through q_a_proj -> q_a_layernorm -> q_b_proj, or one q_proj without q_lora_rank;
  the rotary part (qk_rope_head_dim) in interleaved pairs (V2 always; V3 with rope_interleave,
  default on); softmax scale qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the
  rope is scaled and mscale_all_dim is set (yarn's own attention factor scales cos/sin besides).
  num_key_value_heads plays no part (every head's K/V come from the latent).
- Feed-forward: dense GatedMLPs in the first first_k_dense_replace layers, sparse ones after;
  each sparse block is the routed experts plus n_shared_experts shared ones as one ungated MLP of
  moe_intermediate_size x n_shared_experts, summed. Routing: layers/moe.py's "softmax_group"
  (V2: topk_method greedy or group_limited_greedy, never renormalised) and "sigmoid_group" (V3:
  e_score_correction_bias, group top-k, norm_topk_prob), both times routed_scaling_factor.
- moe_layer_freq (DeepSeek's own code: sparse where index % freq == 0) is honoured, so a
  checkpoint's dense layers load as dense; transformers ignores it (every released checkpoint
  has 1, where the two agree).
Checkpoint names are transformers' (and DeepSeek's): experts as model.layers.N.mlp.experts.E.*,
the gate's weight and e_score_correction_bias kept float32. V3's multi-token-prediction layers
(model.layers.{num_hidden_layers}.*) are not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from text_generation_server.layers.mla import MLAOptions, MultiHeadLatentAttention
from text_generation_server.layers.mlp import GatedMLP, activation
from text_generation_server.layers.moe import RouterOptions, SparseMoE
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.models.families.moe import MoeConfig, MoeFamily
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.weights import Weights


@dataclass(frozen=True)
class DeepseekConfig(MoeConfig):
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_scale: float = 1.0
    n_shared_experts: int = 0
    scoring: str = "softmax_group"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class DeepseekFamily(MoeFamily):
    model_types = ("deepseek_v2", "deepseek_v3")
    config_class = DeepseekConfig
    windowed_everywhere: tuple[str, ...] = ()

    def base_fields(self, r: ConfigReader) -> dict:
        fields = super().base_fields(r)
        v3 = fields["model_type"] == "deepseek_v3"
        nope, rope_dim = r.positive_int("qk_nope_head_dim", default=128), r.positive_int("qk_rope_head_dim", default=64)
        if r.get("sliding_window") is not None or r.get("layer_types") is not None:
            raise r.refuse("sliding_window" if r.get("sliding_window") is not None else "layer_types",
                           "DeepSeek attends to the whole context")
        interleaved = bool(r.get("rope_interleave", True)) if v3 else True
        heads = fields["num_attention_heads"]
        return fields | dict(
            # The per-head width q and k attend with in prefill; the cache's is the latent's.
            head_dim=nope + rope_dim,
            num_key_value_heads=heads,
            max_position_embeddings=r.positive_int("max_position_embeddings", default=4096 if v3 else 2048),
            rope=self.rope(r, rope_dim, interleaved=interleaved),
        )

    def moe_fields(self, r: ConfigReader, layers: int) -> dict:
        v3 = r.get("model_type") == "deepseek_v3"
        experts = int(r.first("n_routed_experts", "num_local_experts", default=0))
        first_dense = int(r.get("first_k_dense_replace", 3 if v3 else 0))
        freq = r.positive_int("moe_layer_freq", default=1)
        sparse = frozenset(i for i in range(layers) if experts and i >= first_dense and i % freq == 0)
        fields = dict(num_experts=experts, sparse_layers=sparse,
                      experts_per_token=r.positive_int("num_experts_per_tok", default=8 if v3 else 1),
                      moe_intermediate_size=r.positive_int("moe_intermediate_size", default=2048 if v3 else 1407),
                      n_shared_experts=int(r.get("n_shared_experts", 1 if v3 else 2)),
                      routed_scaling_factor=r.number("routed_scaling_factor", 2.5 if v3 else 1.0))
        if v3:
            return fields | dict(scoring="sigmoid_group", norm_topk_prob=bool(r.get("norm_topk_prob", True)),
                                 n_group=r.positive_int("n_group", default=8),
                                 topk_group=r.positive_int("topk_group", default=4))
        method = r.get("topk_method", "greedy")
        if method == "greedy":
            return fields
        if method != "group_limited_greedy":
            raise r.refuse("topk_method", "DeepSeek-V2 routes greedy or group_limited_greedy")
        return fields | dict(n_group=r.positive_int("n_group"), topk_group=r.positive_int("topk_group"))

    def extra_fields(self, r: ConfigReader) -> dict:
        q_lora = r.get("q_lora_rank")
        if q_lora is not None:
            q_lora = r.positive_int("q_lora_rank")
        nope, rope_dim = r.positive_int("qk_nope_head_dim", default=128), r.positive_int("qk_rope_head_dim", default=64)
        return super().extra_fields(r) | dict(
            q_lora_rank=q_lora,
            kv_lora_rank=r.positive_int("kv_lora_rank", default=512),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=r.positive_int("v_head_dim", default=128),
            softmax_scale=self._softmax_scale(r, nope, rope_dim),
        )

    def _softmax_scale(self, r: ConfigReader, nope_dim: int, rope_dim: int) -> float:
        """(nope + rope head dims)^-0.5, times yarn's mscale(factor, mscale_all_dim) squared when the
        rope is scaled (transformers' yarn_apply_mscale), read from the rope the layers use."""
        scale = (nope_dim + rope_dim) ** -0.5
        rope = self.rope(r, rope_dim)
        if rope.rope_type != "default" and rope.mscale_all_dim:
            if rope.factor is None:
                raise r.refuse("rope_scaling" if r.get("rope_scaling") else "rope_parameters",
                               "mscale_all_dim needs rope factor")
            scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        return scale

    def read_config(self, r: ConfigReader) -> DeepseekConfig:
        config = super().read_config(r)
        assert isinstance(config, DeepseekConfig)
        # transformers' DeepseekV3MLP has no bias whatever the config says; V2's MLPs follow mlp_bias.
        return replace(config, mlp_bias=config.mlp_bias if config.model_type == "deepseek_v2" else False)

    def mla_options(self, config: DeepseekConfig) -> MLAOptions:
        return MLAOptions(
            hidden=config.hidden_size, heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, scale=config.softmax_scale,
            bias=config.attention_bias,
        )

    def router_options(self, config: DeepseekConfig) -> RouterOptions:
        return RouterOptions(
            config.num_experts, config.experts_per_token, scoring=config.scoring,
            renormalize=config.norm_topk_prob if config.scoring == "sigmoid_group" else False,
            float32_weights=True, n_group=config.n_group, topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor, correction_bias=config.scoring == "sigmoid_group",
        )

    def sparse_block(self, config: DeepseekConfig, weights: Weights, prefix: str) -> SparseMoE:
        block = super().sparse_block(config, weights, prefix)
        if config.n_shared_experts > 0:
            block.shared = GatedMLP(weights, f"{prefix}.shared_experts", config.hidden_size,
                                    config.moe_intermediate_size * config.n_shared_experts,
                                    activation(config.hidden_act), bias=config.mlp_bias)
        return block

    def attention(self, config: DeepseekConfig, weights: Weights, prefix: str, index: int,
                  rotaries: dict[str, RotaryEmbedding]) -> torch.nn.Module:
        return MultiHeadLatentAttention(self.mla_options(config), weights, prefix, index, rotaries["default"])
