"""Tiny random checkpoints of every native model family, written by transformers' own classes.

Each case is a model_type and the config values that exercise its variants (windows, soft caps,
partial rotary, fused layouts, multipliers, rope scalings). Weights are widened so greedy
choices are clear (no near-ties for float rounding to flip), and norm weights sit around 1 so
every layer contributes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import build_tokenizer

VOCAB = 300  # helpers.build_tokenizer()
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=88, num_hidden_layers=2, max_position_embeddings=256,
            eos_token_id=0, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
GPT2_BASE = dict(vocab_size=VOCAB, n_embd=48, n_head=4, n_layer=2, n_positions=256, eos_token_id=0, bos_token_id=0,
                 pad_token_id=0, tie_word_embeddings=False)

LONGROPE_HALF = 6  # head_dim 12, full rotary
SHORT = [1.0 + 0.1 * i for i in range(LONGROPE_HALF)]
LONG = [1.5 + 0.7 * i for i in range(LONGROPE_HALF)]

# DeepSeek's shape: 4 heads (num_key_value_heads must equal them in transformers' MLA), 8 experts.
DEEPSEEK = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=12,
                qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=16)
# yarn with mscale != mscale_all_dim: the rotary's attention factor and the softmax's mscale both count.
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.9,
                 "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}

# name -> (model_type, overrides)
CASES: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen3_window_yarn": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=7, max_window_layers=1,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 16})),
    "gemma": ("gemma", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "gemma2": ("gemma2", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=7,
                              attn_logit_softcapping=4.0, final_logit_softcapping=6.0, query_pre_attn_scalar=24)),
    "gemma3_text": ("gemma3_text", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=7,
                                        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                                          "sliding_attention"],
                                        final_logit_softcapping=8.0,
                                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1000000.0}})),
    "phi": ("phi", dict(num_attention_heads=4, partial_rotary_factor=0.5)),
    "phi_qk_layernorm": ("phi", dict(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.75,
                                     qk_layernorm=True)),
    "phi3_longrope": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                   max_position_embeddings=128, original_max_position_embeddings=16,
                                   rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})),
    "starcoder2": ("starcoder2", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=7)),
    "gpt_neox": ("gpt_neox", dict(hidden_size=64, num_attention_heads=4, rotary_pct=0.25)),
    "gpt_neox_sequential": ("gpt_neox", dict(num_attention_heads=4, rotary_pct=0.5, use_parallel_residual=False,
                                             attention_bias=False)),
    "falcon": ("falcon", dict(num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True)),
    "falcon_mqa": ("falcon", dict(num_attention_heads=4, new_decoder_architecture=False, multi_query=True,
                                  parallel_attn=True, bias=True)),
    "falcon_sequential": ("falcon", dict(num_attention_heads=4, new_decoder_architecture=False, multi_query=False,
                                         parallel_attn=False)),
    "gpt2": ("gpt2", dict()),
    "gpt2_layer_scaled": ("gpt2", dict(scale_attn_by_inverse_layer_idx=True, activation_function="gelu")),
    "gpt_bigcode_mqa": ("gpt_bigcode", dict(multi_query=True)),
    "gpt_bigcode_mha": ("gpt_bigcode", dict(multi_query=False)),
    "cohere": ("cohere", dict(num_attention_heads=4, num_key_value_heads=2, logit_scale=0.5)),
    "cohere_qk_norm": ("cohere", dict(num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True,
                                      logit_scale=0.8)),
    "olmo2": ("olmo2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "granite": ("granite", dict(num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=3.0,
                                residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=0.5)),
    "llama_dynamic": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                    rope_scaling={"rope_type": "dynamic", "factor": 4.0})),
    "qwen2_yarn": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                 rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                               "original_max_position_embeddings": 32})),
    # Mixtures of experts: 8 experts, 2 per token, so the prompts reach every expert.
    "mixtral": ("mixtral", dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=40, mlp_only_layers=[1])),
    "qwen3_moe": ("qwen3_moe", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "gpt_oss": ("gpt_oss", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=8,
                                num_experts_per_tok=2, intermediate_size=32, sliding_window=7,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 64})),
    # Multi-head latent attention (kv_lora_rank 16 + rope 8 cached per token) and DeepSeek routing.
    "deepseek_v2_lite": ("deepseek_v2", dict(DEEPSEEK, q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=1,
                                             topk_method="greedy", n_shared_experts=2)),
    "deepseek_v2": ("deepseek_v2", dict(DEEPSEEK, q_lora_rank=24, first_k_dense_replace=1,
                                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                        num_experts_per_tok=3,  # more than topk_group: the limit bites
                                        routed_scaling_factor=1.5, n_shared_experts=1, rope_parameters=DEEPSEEK_YARN,
                                        attention_bias=True, mlp_bias=True)),
    "deepseek_v3": ("deepseek_v3", dict(DEEPSEEK, q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2,
                                        norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
                                        rope_parameters=DEEPSEEK_YARN)),
    "deepseek_v3_no_q_lora": ("deepseek_v3", dict(DEEPSEEK, q_lora_rank=None, num_hidden_layers=3,
                                                  first_k_dense_replace=1, n_group=2, topk_group=1,
                                                  norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=2,
                                                  rope_interleave=False)),
}


def hf_config(name: str):
    import transformers

    model_type, overrides = CASES[name]
    base = dict(GPT2_BASE if model_type in ("gpt2", "gpt_bigcode") else BASE)
    base.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **base)


def widen(model: torch.nn.Module, seed: int) -> None:
    """Random weights large enough that greedy choices are not near-ties; norm weights around 1
    (Gemma's stored w of 1 + w around 0)."""
    g = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type in ("gemma", "gemma2", "gemma3_text")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            is_norm = name.endswith(".weight") and any(k in name for k in ("norm", "ln_", "ln_f", "layernorm"))
            p.copy_(noise + (1.0 if is_norm and not gemma else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, zeros at init: give it a say
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)


def write_family_checkpoint(folder: Path, name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Writes case `name` with transformers' own class and a tokenizer; returns the model (eval)."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen(model, seed)
    model = model.to(dtype).eval()
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return model
