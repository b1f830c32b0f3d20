"""layers/rotary.py against transformers' own rope code, to 1e-6 in float32.

The reference is what transformers runs: `modeling_rope_utils.ROPE_INIT_FUNCTIONS` for the
frequencies and attention scaling, the models' rotary-embedding modules (with their
`dynamic_rope_update` recomputation) for cos/sin, and the models' `apply_rotary_pos_emb` for the
rotated queries. Configs are built the way a config.json carries them (`rope_scaling` or
`rope_parameters`), through `AutoConfig.for_model`, and read on our side both from the raw dict
(what the server loads) and from transformers' standardised `to_dict()`.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.cohere import modeling_cohere  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.gptj import modeling_gptj  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.phi import modeling_phi  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

from text_generation_server.layers.rotary import (  # noqa: E402
    RopeConfig,
    RotaryEmbedding,
    apply_rotary,
    rope_config_from_hf,
)
from text_generation_server.models.registry import BY_MODEL_TYPE  # noqa: E402

CPU = torch.device("cpu")

# model_type -> (its rotary-embedding module, its apply_rotary_pos_emb)
MODELS = {
    "llama": (modeling_llama.LlamaRotaryEmbedding, modeling_llama.apply_rotary_pos_emb),
    "qwen2": (modeling_qwen2.Qwen2RotaryEmbedding, modeling_qwen2.apply_rotary_pos_emb),
    "phi3": (modeling_phi3.Phi3RotaryEmbedding, modeling_phi3.apply_rotary_pos_emb),
    "phi": (modeling_phi.PhiRotaryEmbedding, modeling_phi.apply_rotary_pos_emb),
    "gpt_neox": (modeling_gpt_neox.GPTNeoXRotaryEmbedding, modeling_gpt_neox.apply_rotary_pos_emb),
    "cohere": (modeling_cohere.CohereRotaryEmbedding, modeling_cohere.apply_rotary_pos_emb),
}
INTERLEAVED = {"cohere"}


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    # transformers warns about odd-but-valid rope configs (implied factors, factor 1.0); the
    # tests build such configs on purpose.
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


def raw_config(model_type: str, head_dim: int, max_pos: int, heads: int = 4, **extra) -> dict:
    """A config.json as the server reads it (head_dim implied by hidden_size / heads)."""
    return {"model_type": model_type, "hidden_size": head_dim * heads, "num_attention_heads": heads,
            "num_key_value_heads": heads, "max_position_embeddings": max_pos, **extra}


def hf_config(raw: dict):
    """transformers' config from the same dict (deep-copied: transformers edits rope dicts in place)."""
    raw = copy.deepcopy(raw)
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, vocab_size=64, num_hidden_layers=2, intermediate_size=64, **raw)


def ours(raw: dict, head_dim: int, **kwargs) -> RopeConfig:
    """Our reading of the config, with what the model type's family passes: the layout and the
    rope defaults (Cohere's base is 500000; GPT-NeoX reads rotary_pct and rotary_emb_base)."""
    kwargs.setdefault("interleaved", raw["model_type"] in INTERLEAVED)
    kwargs.setdefault("defaults", BY_MODEL_TYPE[raw["model_type"]].rope_defaults)
    return rope_config_from_hf(copy.deepcopy(raw), head_dim, **kwargs)


def hf_rotary(raw: dict):
    """A fresh transformers rotary module (they are stateful: dynamic NTK grows its cache)."""
    return MODELS[raw["model_type"]][0](hf_config(raw))


def assert_same(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-6) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def assert_same_freqs(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Frequencies span 1 .. 1e-6 and smaller: compare relatively, not to an absolute 1e-6."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-6, atol=0)


def sign(rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """The rotation sign our sin carries, built independently of rotary.py."""
    half = rotary_dim // 2
    if interleaved:
        return torch.tensor([-1.0, 1.0] * half)
    return torch.cat([-torch.ones(half), torch.ones(half)])


def ramp(n: int, start: float, step: float) -> list[float]:
    return [start + step * i for i in range(n)]


# -- 1. inv_freq and attention scaling, every type ---------------------------------------------

# (id, raw config.json, head_dim, rope_config_from_hf kwargs)
INIT_CASES = [
    ("linear", raw_config("llama", 64, 4096, rope_scaling={"type": "linear", "factor": 4.0}), 64, {}),
    ("linear-rope_parameters", raw_config(
        "llama", 128, 8192, rope_parameters={"rope_type": "linear", "factor": 2.5, "rope_theta": 500000.0}), 128, {}),
    ("linear-partial", raw_config(
        "llama", 64, 4096, rope_theta=25000.0, partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "linear", "factor": 3.0}), 64, {}),
    ("llama3.1", raw_config("llama", 128, 131072, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), 128, {}),
    ("llama3.2", raw_config("llama", 64, 131072, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), 64, {}),
    ("llama3-odd-factors", raw_config("llama", 128, 65536, rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 4096}), 128, {}),
    ("llama3-partial", raw_config("llama", 128, 65536, rope_theta=500000.0, partial_rotary_factor=0.5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), 128, {}),
    ("yarn-qwen2.5", raw_config("qwen2", 128, 32768, rope_theta=1000000.0, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), 128, {}),
    ("yarn-implied-factor", raw_config("qwen2", 128, 131072, rope_theta=1000000.0, rope_scaling={
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32768}), 128, {}),
    ("yarn-explicit-factor-1", raw_config("llama", 64, 8192, rope_scaling={
        "rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 2048}), 64, {}),
    ("yarn-mscale", raw_config("llama", 64, 163840, rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32,
        "beta_slow": 1, "original_max_position_embeddings": 4096}), 64, {}),
    ("yarn-mscale-equal", raw_config("llama", 64, 163840, rope_scaling={
        "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}), 64, {}),
    ("yarn-mscale-only", raw_config("llama", 64, 16384, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "original_max_position_embeddings": 4096}), 64, {}),
    ("yarn-attention-factor", raw_config("llama", 64, 16384, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8, "mscale": 0.707, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}), 64, {}),
    ("yarn-no-truncate", raw_config("llama", 64, 131072, rope_theta=150000.0, rope_scaling={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}), 64, {}),
    ("yarn-betas", raw_config("llama", 128, 65536, rope_theta=500000.0, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
        "original_max_position_embeddings": 8192}), 128, {}),
    ("yarn-no-original", raw_config("llama", 64, 4096, rope_scaling={"rope_type": "yarn", "factor": 2.0}), 64, {}),
    # the ramp's ends clamped to [0, dim - 1], and a zero-width ramp (transformers adds 0.001)
    ("yarn-ramp-clamped-high", raw_config("llama", 32, 4096, rope_theta=10.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}), 32, {}),
    ("yarn-ramp-clamped-low", raw_config("llama", 64, 1024, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}), 64, {}),
    ("yarn-zero-width-ramp", raw_config("llama", 64, 16384, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 8.0, "truncate": False,
        "original_max_position_embeddings": 4096}), 64, {}),
    ("yarn-partial", raw_config("llama", 128, 32768, rope_theta=1000000.0, partial_rotary_factor=0.5, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}), 128, {}),
    ("dynamic", raw_config("llama", 64, 2048, rope_scaling={"type": "dynamic", "factor": 2.0}), 64, {}),
    ("dynamic-partial", raw_config(
        "phi", 80, 2048, partial_rotary_factor=0.4, rope_scaling={"type": "dynamic", "factor": 4.0}), 80, {}),
    ("longrope-phi3-implied", raw_config("phi3", 96, 131072, original_max_position_embeddings=4096, rope_scaling={
        "type": "longrope", "short_factor": ramp(48, 1.0, 0.01), "long_factor": ramp(48, 1.0, 0.8)}), 96, {}),
    ("longrope-phi3-attention-factor", raw_config(
        "phi3", 64, 131072, original_max_position_embeddings=4096, rope_scaling={
            "type": "longrope", "attention_factor": 1.25, "short_factor": ramp(32, 1.05, 0.0),
            "long_factor": ramp(32, 1.0, 1.5)}), 64, {}),
    ("longrope-phi3-no-scaling-needed", raw_config("phi3", 64, 4096, original_max_position_embeddings=4096,
                                                   rope_scaling={"type": "longrope", "short_factor": ramp(32, 1.0, 0.0),
                                                                 "long_factor": ramp(32, 2.0, 0.1)}), 64, {}),
    ("longrope-phi4-mini-partial", raw_config(
        "phi3", 128, 131072, heads=3, rope_theta=10000.0, partial_rotary_factor=0.75,
        original_max_position_embeddings=4096, rope_scaling={
            "type": "longrope", "short_factor": ramp(48, 1.0, 0.02), "long_factor": ramp(48, 1.0, 1.0)}), 128, {}),
    ("longrope-llama-factor", raw_config("llama", 64, 32768, rope_theta=500000.0, rope_scaling={
        "rope_type": "longrope", "factor": 16.0, "original_max_position_embeddings": 2048,
        "short_factor": ramp(32, 1.0, 0.0), "long_factor": ramp(32, 1.0, 2.0)}), 64, {}),
    ("longrope-llama-factor-1", raw_config("llama", 64, 32768, rope_scaling={
        "rope_type": "longrope", "factor": 1.0, "original_max_position_embeddings": 2048,
        "short_factor": ramp(32, 1.0, 0.0), "long_factor": ramp(32, 1.0, 2.0)}), 64, {}),
    ("phi3-yarn-is-longrope", raw_config("phi3", 64, 131072, original_max_position_embeddings=4096, rope_scaling={
        "type": "yarn", "short_factor": ramp(32, 1.0, 0.01), "long_factor": ramp(32, 1.0, 0.8)}), 64, {}),
    # original_max_position_embeddings at the top level of config.json overrides rope_scaling's
    # (transformers' standardize_rope_params, re-run by each ROPE_INIT_FUNCTIONS entry)...
    ("yarn-top-level-original-wins", raw_config("llama", 64, 16384, original_max_position_embeddings=1024,
                                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 4096}), 64, {}),
    ("yarn-top-level-original-only", raw_config("qwen2", 64, 16384, original_max_position_embeddings=2048,
                                                rope_scaling={"rope_type": "yarn", "factor": None}), 64, {}),
    ("llama3-top-level-original", raw_config("llama", 128, 131072, rope_theta=500000.0,
                                             original_max_position_embeddings=4096, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), 128, {}),
    ("longrope-llama-top-level-original", raw_config("llama", 64, 32768, original_max_position_embeddings=1024,
                                                     rope_scaling={"rope_type": "longrope",
                                                                   "short_factor": ramp(32, 1.0, 0.0),
                                                                   "long_factor": ramp(32, 1.0, 2.0)}), 64, {}),
    # ...and Phi3Config always has one: 4096 unless config.json says otherwise.
    ("longrope-phi3-default-original", raw_config("phi3", 64, 131072, rope_scaling={
        "type": "longrope", "short_factor": ramp(32, 1.0, 0.01), "long_factor": ramp(32, 1.0, 0.8)}), 64, {}),
    ("longrope-phi3-top-level-beats-nested", raw_config("phi3", 64, 131072, rope_scaling={
        "type": "longrope", "original_max_position_embeddings": 8192, "short_factor": ramp(32, 1.0, 0.01),
        "long_factor": ramp(32, 1.0, 0.8)}), 64, {}),
]


INIT = {c[0]: c[1] for c in INIT_CASES}


@pytest.mark.parametrize("raw,head_dim,kwargs", [c[1:] for c in INIT_CASES], ids=[c[0] for c in INIT_CASES])
@pytest.mark.parametrize("source", ["raw", "to_dict"])
def test_init_functions_match(raw, head_dim, kwargs, source):
    config = hf_config(raw)
    rope_type = config.rope_parameters["rope_type"]
    expected, expected_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, CPU)

    cfg = ours(raw if source == "raw" else {**config.to_dict(), "model_type": raw["model_type"]}, head_dim, **kwargs)
    assert cfg.rope_type == rope_type
    if rope_type in ("llama3", "yarn", "longrope"):
        # (read after the init function: it re-standardises config.rope_parameters in place)
        assert cfg.original_max_position_embeddings == config.rope_parameters["original_max_position_embeddings"]
    assert_same_freqs(cfg.inv_freq(), expected)
    assert cfg.attention_scaling == pytest.approx(expected_scaling, rel=1e-12)
    if rope_type == "longrope":
        original = config.rope_parameters["original_max_position_embeddings"]
        expected_long, long_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, CPU, seq_len=original + 1)
        assert_same_freqs(cfg.long_inv_freq(), expected_long)
        assert long_scaling == pytest.approx(cfg.attention_scaling, rel=1e-12)
        assert not torch.equal(cfg.long_inv_freq(), cfg.inv_freq())


DEFAULT_CASES = [
    ("llama", raw_config("llama", 64, 2048), 64, {}),
    ("llama-theta", raw_config("llama", 128, 131072, rope_theta=500000.0), 128, {}),
    ("llama-rope_parameters", raw_config("llama", 128, 8192, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1000000.0}), 128, {}),
    ("llama-rope_scaling-null", raw_config("llama", 64, 2048, rope_theta=20000.0, rope_scaling=None), 64, {}),
    ("qwen2", raw_config("qwen2", 128, 32768, rope_theta=1000000.0), 128, {}),
    ("phi3", raw_config("phi3", 96, 4096, rope_theta=10000.0), 96, {}),
    ("phi-partial", raw_config("phi", 80, 2048, partial_rotary_factor=0.4), 80, {}),
    ("gpt_neox-rotary_pct", raw_config("gpt_neox", 64, 2048, rotary_pct=0.25, rotary_emb_base=10000),
     64, {}),
    ("cohere", raw_config("cohere", 128, 8192, rope_theta=8000000.0), 128, {}),
]


@pytest.mark.parametrize("raw,head_dim,kwargs", [c[1:] for c in DEFAULT_CASES], ids=[c[0] for c in DEFAULT_CASES])
def test_default_frequencies_match_model_modules(raw, head_dim, kwargs):
    """`default` has no ROPE_INIT_FUNCTIONS entry: each model's module computes it."""
    module = hf_rotary(raw)
    cfg = ours(raw, head_dim, **kwargs)
    assert cfg.rope_type == "default"
    assert_same_freqs(cfg.inv_freq(), module.inv_freq)
    assert cfg.attention_scaling == module.attention_scaling == 1.0
    assert not cfg.length_dependent


@pytest.mark.parametrize("raw,head_dim,kwargs", [c[1:] for c in INIT_CASES], ids=[c[0] for c in INIT_CASES])
def test_module_frequencies_match(raw, head_dim, kwargs):
    """The model module's own buffers and scaling (what its forward starts from) agree too."""
    module = hf_rotary(raw)
    cfg = ours(raw, head_dim, **kwargs)
    assert_same_freqs(cfg.inv_freq(), module.inv_freq)
    assert cfg.attention_scaling == pytest.approx(module.attention_scaling, rel=1e-12)


def test_dynamic_init_function_at_lengths():
    """Dynamic NTK's frequencies for sequences of several lengths in one call, each against
    ROPE_INIT_FUNCTIONS(seq_len=...) (the angle at position 1 is the frequency itself)."""
    raw = raw_config("llama", 64, 2048, rope_scaling={"type": "dynamic", "factor": 4.0})
    config = hf_config(raw)
    lengths = [1, 2, 1000, 2047, 2048, 2049, 2500, 3000, 4095, 4096, 4097, 6000, 8000, 8191, 8192]
    emb = RotaryEmbedding(ours(raw, 64), 8192, CPU)
    cos, sin = emb.cos_sin(torch.ones(len(lengths), dtype=torch.int64), torch.float32,
                           seq_lens=torch.tensor(lengths))
    for i, length in enumerate(lengths):
        expected, scaling = ROPE_INIT_FUNCTIONS["dynamic"](config, CPU, seq_len=torch.tensor(length))
        assert scaling == 1.0
        assert_same(cos[i, 0, :32], expected.cos())
        assert_same(sin[i, 0, 32:], expected.sin())
        assert_same(sin[i, 0, :32], -expected.sin())


# -- 2. cos / signed sin and apply_rotary against apply_rotary_pos_emb -------------------------

APPLY_CASES = [
    ("llama-default", raw_config("llama", 64, 4096, rope_theta=500000.0), 64, {}),
    ("llama-linear", raw_config("llama", 64, 8192, rope_scaling={"type": "linear", "factor": 2.0}), 64, {}),
    ("llama3.1", INIT["llama3.1"], 128, {}),
    ("qwen2-yarn", INIT["yarn-qwen2.5"], 128, {}),
    ("yarn-mscale", INIT["yarn-mscale"], 64, {}),
    ("yarn-no-truncate", INIT["yarn-no-truncate"], 64, {}),
    ("phi-partial", raw_config("phi", 80, 2048, partial_rotary_factor=0.4), 80, {}),
    ("phi-partial-linear", raw_config("phi", 80, 8192, partial_rotary_factor=0.5,
                                      rope_scaling={"type": "linear", "factor": 4.0}), 80, {}),
    ("gpt_neox-partial", raw_config("gpt_neox", 64, 2048, rotary_pct=0.25), 64, {}),
    ("phi3-longrope-short", INIT["longrope-phi3-implied"], 96, {}),
    ("phi4-mini-partial", INIT["longrope-phi4-mini-partial"], 128, {}),
    ("cohere-interleaved", raw_config("cohere", 128, 8192, rope_theta=8000000.0), 128, {}),
    ("cohere-interleaved-linear", raw_config("cohere", 64, 8192, rope_scaling={"type": "linear", "factor": 2.0}),
     64, {}),
]
POSITIONS = [0, 1, 2, 3, 17, 100, 511, 1000, 2047]


@pytest.mark.parametrize("raw,head_dim,kwargs", [c[1:] for c in APPLY_CASES], ids=[c[0] for c in APPLY_CASES])
def test_cos_sin_and_apply_match_transformers(raw, head_dim, kwargs):
    model_type = raw["model_type"]
    _, hf_apply = MODELS[model_type]
    module = hf_rotary(raw)
    cfg = ours(raw, head_dim, **kwargs)
    interleaved = model_type in INTERLEAVED
    assert cfg.interleaved == interleaved
    heads = 3
    positions = torch.tensor(POSITIONS + [raw["max_position_embeddings"] - 1])
    tokens = len(positions)

    # transformers: positions as a [1, tokens] batch (within the short range for longrope:
    # max(position) + 1 <= original_max_position_embeddings).
    x = torch.zeros(1, tokens, head_dim)
    emb = RotaryEmbedding(cfg, cfg.max_context(raw["max_position_embeddings"]), CPU)
    if cfg.rope_type == "longrope":
        positions = positions[positions < cfg.original_max_position_embeddings]
        tokens = len(positions)
        x = x[:, :tokens]
    hf_cos, hf_sin = module(x, positions[None])
    cos, sin = emb.cos_sin(positions, torch.float32, max_position=int(positions.max()))
    rot = cfg.rotary_dim
    assert cos.shape == sin.shape == (tokens, 1, rot)
    assert_same(cos[:, 0], hf_cos[0])
    assert_same(sin[:, 0] * sign(rot, interleaved), hf_sin[0])

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, tokens, head_dim, generator=generator)
    if model_type == "phi":  # PhiAttention slices the rotary part itself; its apply rotates all it gets
        q_rot, _ = hf_apply(q[..., :rot], q[..., :rot], hf_cos, hf_sin)
        expected = torch.cat([q_rot, q[..., rot:]], dim=-1)
    else:
        expected, _ = hf_apply(q, q, hf_cos, hf_sin)
    actual = apply_rotary(q[0].transpose(0, 1).contiguous(), cos, sin, interleaved)
    assert_same(actual, expected[0].transpose(0, 1))
    assert_same(emb.apply(q[0].transpose(0, 1).contiguous(), cos, sin), actual, tol=0)
    if rot < head_dim:  # the pass-through dimensions are untouched
        assert torch.equal(actual[..., rot:], q[0].transpose(0, 1)[..., rot:])


def test_cos_sin_low_precision_dtype_matches_transformers():
    raw = INIT["llama3.1"]  # llama 3.1
    module = hf_rotary(raw)
    emb = RotaryEmbedding(ours(raw, 128), 131072, CPU)
    positions = torch.tensor([0, 5, 4000, 70000, 131071])
    for dtype in (torch.bfloat16, torch.float16):
        hf_cos, hf_sin = module(torch.zeros(1, 1, 128, dtype=dtype), positions[None])
        cos, sin = emb.cos_sin(positions, dtype)
        assert cos.dtype == sin.dtype == dtype
        assert torch.equal(cos[:, 0], hf_cos[0])
        assert torch.equal(sin[:, 0] * sign(128, False).to(dtype), hf_sin[0])


@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_interleaved_partial_matches_gptj(rotary_dim):
    """GPT-J style: interleaved pairs over the first rotary_dim dimensions, the rest passed through."""
    head_dim, heads, tokens = 64, 2, 7
    cfg = RopeConfig(head_dim=head_dim, partial_rotary_factor=rotary_dim / head_dim, interleaved=True)
    emb = RotaryEmbedding(cfg, 2048, CPU)
    positions = torch.tensor([0, 1, 9, 100, 777, 1500, 2047])
    cos, sin = emb.cos_sin(positions, torch.float32)

    table = modeling_gptj.create_sinusoidal_positions(2048, rotary_dim)
    sin_hf, cos_hf = torch.split(table[positions][None], rotary_dim // 2, dim=-1)
    q = torch.randn(1, tokens, heads, head_dim, generator=torch.Generator().manual_seed(1))
    q_rot = modeling_gptj.apply_rotary_pos_emb(q[..., :rotary_dim], sin_hf, cos_hf)
    expected = torch.cat([q_rot, q[..., rotary_dim:]], dim=-1)[0]
    assert_same(apply_rotary(q[0].contiguous(), cos, sin, interleaved=True), expected)


# -- 3. length-dependent types against the modules' dynamic_rope_update -----------------------

DYNAMIC_MAX = 256
DYNAMIC_FACTOR = 4.0
DYNAMIC_LENGTHS = [1, 100, DYNAMIC_MAX - 1, DYNAMIC_MAX, DYNAMIC_MAX + 1, 300, 513, 777,
                   int(DYNAMIC_MAX * DYNAMIC_FACTOR)]
DYNAMIC_CASES = [
    ("llama", raw_config("llama", 64, DYNAMIC_MAX, rope_scaling={"type": "dynamic", "factor": DYNAMIC_FACTOR}), 64),
    ("llama-theta", raw_config("llama", 128, DYNAMIC_MAX, rope_theta=500000.0,
                               rope_parameters={"rope_type": "dynamic", "factor": DYNAMIC_FACTOR}), 128),
    ("phi-partial", raw_config("phi", 80, DYNAMIC_MAX, partial_rotary_factor=0.4,
                               rope_scaling={"type": "dynamic", "factor": DYNAMIC_FACTOR}), 80),
    ("cohere-interleaved", raw_config("cohere", 64, DYNAMIC_MAX,
                                      rope_scaling={"type": "dynamic", "factor": DYNAMIC_FACTOR}), 64),
]

LONGROPE_ORIGINAL = 256
LONGROPE_MAX = 1024
LONGROPE_LENGTHS = [1, 100, LONGROPE_ORIGINAL - 1, LONGROPE_ORIGINAL, LONGROPE_ORIGINAL + 1, 600, LONGROPE_MAX]
LONGROPE_CASES = [
    ("phi3", raw_config("phi3", 32, LONGROPE_MAX, original_max_position_embeddings=LONGROPE_ORIGINAL, rope_scaling={
        "type": "longrope", "short_factor": ramp(16, 1.0, 0.03), "long_factor": ramp(16, 1.0, 0.9)}), 32),
    ("phi3-partial", raw_config("phi3", 64, LONGROPE_MAX, partial_rotary_factor=0.75,
                                original_max_position_embeddings=LONGROPE_ORIGINAL, rope_scaling={
        "type": "longrope", "short_factor": ramp(24, 1.0, 0.03), "long_factor": ramp(24, 1.0, 0.9)}), 64),
    ("llama-longrope-factor", raw_config("llama", 32, LONGROPE_MAX, rope_theta=500000.0, rope_scaling={
        "rope_type": "longrope", "factor": 8.0, "original_max_position_embeddings": LONGROPE_ORIGINAL,
        "short_factor": ramp(16, 1.0, 0.0), "long_factor": ramp(16, 1.0, 2.5)}), 32),
]
LENGTH_CASES = ([(f"dynamic-{c[0]}", c[1], c[2], DYNAMIC_LENGTHS) for c in DYNAMIC_CASES]
                + [(f"longrope-{c[0]}", c[1], c[2], LONGROPE_LENGTHS) for c in LONGROPE_CASES])


def hf_cos_sin_alone(raw: dict, position_ids: torch.Tensor, head_dim: int):
    """transformers' cos/sin for one forward, on a fresh module, and the angles' float32 slack.

    Dynamic NTK recomputes the base per sequence length in float32. transformers raises a scalar
    to a power; we raise a [tokens] vector (every sequence of a batch its own length), and on CPU
    torch computes vector powers with SIMD code that can round the last bit differently from the
    scalar path. Both are float32-rounded answers to the same formula (the frequencies agree to
    1e-6 relative, test_dynamic_init_function_at_lengths), but one ulp of a frequency moves the
    angle at position p by p ulps, past 1e-6 once p x frequency is in the tens. So whole-sequence
    dynamic comparisons allow, per element, 1e-6 plus a few float32 ulps of the angle itself —
    the precision float32 can carry that angle at — and every other type is held to plain 1e-6.
    """
    module = hf_rotary(raw)
    cos, sin = module(torch.zeros(1, 1, head_dim), position_ids[None])
    if module.rope_type != "dynamic":
        return cos, sin, 0.0
    freqs = position_ids[:, None].float() * module.inv_freq[None, :]
    angles = (torch.repeat_interleave(freqs, 2, dim=-1) if raw["model_type"] in INTERLEAVED
              else torch.cat([freqs, freqs], dim=-1))
    return cos, sin, 4 * torch.finfo(torch.float32).eps * angles.abs()


def assert_same_within(actual: torch.Tensor, expected: torch.Tensor, slack) -> None:
    """assert_same, plus a per-element slack (see hf_cos_sin_alone)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    excess = (actual - expected).abs() - (1e-6 + 1e-6 * expected.abs()) - slack
    where = divmod(int(excess.argmax()), actual.shape[-1])
    assert excess.max() <= 0, f"past the tolerance by {excess.max().item():.3g} at {where}"


@pytest.mark.parametrize("raw,head_dim,lengths", [c[1:] for c in LENGTH_CASES], ids=[c[0] for c in LENGTH_CASES])
def test_length_dependent_single_sequence(raw, head_dim, lengths):
    cfg = ours(raw, head_dim)
    assert cfg.length_dependent
    interleaved = raw["model_type"] in INTERLEAVED
    emb = RotaryEmbedding(cfg, cfg.max_context(raw["max_position_embeddings"]), CPU)
    unsign = sign(cfg.rotary_dim, interleaved)
    for length in lengths:
        hf_cos, hf_sin, slack = hf_cos_sin_alone(raw, torch.arange(length), head_dim)
        positions = torch.arange(length)
        cos, sin = emb.cos_sin(positions, torch.float32, max_position=length - 1,
                               seq_lens=torch.full((length,), length))
        assert_same_within(cos[:, 0], hf_cos[0], slack)
        assert_same_within(sin[:, 0] * unsign, hf_sin[0], slack)


@pytest.mark.parametrize("raw,head_dim,lengths", [c[1:] for c in LENGTH_CASES], ids=[c[0] for c in LENGTH_CASES])
def test_length_dependent_batch_gives_each_sequence_its_own(raw, head_dim, lengths):
    """Sequences of different lengths in one forward each get the frequencies transformers
    gives them alone; a decode token (one position, its sequence's length) its row of those."""
    cfg = ours(raw, head_dim)
    emb = RotaryEmbedding(cfg, cfg.max_context(raw["max_position_embeddings"]), CPU)
    unsign = sign(cfg.rotary_dim, raw["model_type"] in INTERLEAVED)
    short, long = lengths[1], lengths[-2]  # one at/below the base length, one past it
    positions = torch.cat([torch.arange(short), torch.arange(long), torch.tensor([long - 1, short - 1])])
    seq_lens = torch.cat([torch.full((short,), short), torch.full((long,), long), torch.tensor([long, short])])
    cos, sin = emb.cos_sin(positions, torch.float32, seq_lens=seq_lens)
    short_cos, short_sin, short_slack = hf_cos_sin_alone(raw, torch.arange(short), head_dim)
    long_cos, long_sin, long_slack = hf_cos_sin_alone(raw, torch.arange(long), head_dim)
    expected_cos = torch.cat([short_cos[0], long_cos[0], long_cos[0, -1:], short_cos[0, -1:]])
    expected_sin = torch.cat([short_sin[0], long_sin[0], long_sin[0, -1:], short_sin[0, -1:]])
    if isinstance(short_slack, torch.Tensor):
        slack = torch.cat([short_slack, long_slack, long_slack[-1:], short_slack[-1:]])
    else:
        slack = 0.0
    assert_same_within(cos[:, 0], expected_cos, slack)
    assert_same_within(sin[:, 0] * unsign, expected_sin, slack)
    # The two sequences really do differ (the test would be vacuous otherwise).
    assert not torch.allclose(long_cos[0, :short], short_cos[0])


@pytest.mark.parametrize("raw,head_dim,lengths", [c[1:] for c in LENGTH_CASES], ids=[c[0] for c in LENGTH_CASES])
def test_length_dependent_without_seq_lens_uses_position_plus_one(raw, head_dim, lengths):
    """seq_lens=None: each token's length is its position + 1, i.e. transformers on that position alone."""
    cfg = ours(raw, head_dim)
    emb = RotaryEmbedding(cfg, cfg.max_context(raw["max_position_embeddings"]), CPU)
    unsign = sign(cfg.rotary_dim, raw["model_type"] in INTERLEAVED)
    positions = torch.tensor([length - 1 for length in lengths])
    cos, sin = emb.cos_sin(positions, torch.float32)
    for i, p in enumerate(positions.tolist()):
        hf_cos, hf_sin, slack = hf_cos_sin_alone(raw, torch.tensor([p]), head_dim)
        assert_same_within(cos[i], hf_cos[0], slack)
        assert_same_within(sin[i] * unsign, hf_sin[0], slack)


@pytest.mark.parametrize("case,length", [(DYNAMIC_CASES[0], 700), (DYNAMIC_CASES[0], 200),
                                         (DYNAMIC_CASES[3], 500), (LONGROPE_CASES[1], 600), (LONGROPE_CASES[2], 900)],
                         ids=["dynamic-past-base", "dynamic-below-base", "dynamic-interleaved",
                              "longrope-phi3-partial", "longrope-llama"])
def test_length_dependent_apply_matches_transformers(case, length):
    """End to end on q, for sequences whose frequencies are rescaled (or not) by their length."""
    raw, head_dim = case[1:]
    model_type = raw["model_type"]
    hf_cos, hf_sin, slack = hf_cos_sin_alone(raw, torch.arange(length), head_dim)
    q = torch.randn(1, 2, length, head_dim, generator=torch.Generator().manual_seed(2))
    expected, _ = MODELS[model_type][1](q, q, hf_cos, hf_sin)
    cfg = ours(raw, head_dim)
    emb = RotaryEmbedding(cfg, cfg.max_context(raw["max_position_embeddings"]), CPU)
    cos, sin = emb.cos_sin(torch.arange(length), torch.float32, seq_lens=torch.full((length,), length))
    actual = emb.apply(q[0].transpose(0, 1).contiguous(), cos, sin)
    if isinstance(slack, torch.Tensor):  # |x cos + partner sin| moves by at most the angle error x (|x| + |partner|)
        pad = torch.zeros(length, head_dim - cfg.rotary_dim)
        slack = torch.cat([slack, pad], dim=-1)[:, None, :] * 2 * q[0].transpose(0, 1).abs().amax(-1, keepdim=True)
    assert_same_within(actual, expected[0].transpose(0, 1), slack)


def test_non_length_dependent_types_ignore_seq_lens():
    raw = INIT["llama3.1"]  # llama 3.1
    emb = RotaryEmbedding(ours(raw, 128), 131072, CPU)
    positions = torch.tensor([0, 10, 9000])
    plain = emb.cos_sin(positions, torch.float32)
    with_lens = emb.cos_sin(positions, torch.float32, seq_lens=torch.tensor([100000, 11, 120000]))
    assert torch.equal(plain[0], with_lens[0]) and torch.equal(plain[1], with_lens[1])


# -- 4. max_context and the max_position check -------------------------------------------------

MAX_CONTEXT_CASES = [
    ("default", raw_config("llama", 64, 4096), 4096),
    ("linear", raw_config("llama", 64, 4096, rope_scaling={"type": "linear", "factor": 4.0}), 4096),
    ("llama3", INIT["llama3.1"], 131072),
    ("dynamic", raw_config("llama", 64, 2048, rope_scaling={"type": "dynamic", "factor": 4.0}), 8192),
    ("dynamic-fractional", raw_config("llama", 64, 4096, rope_scaling={"type": "dynamic", "factor": 1.5}), 6144),
    ("yarn-at-original", INIT["yarn-qwen2.5"], 131072),  # Qwen2.5: 32768 x 4
    ("yarn-implied", INIT["yarn-implied-factor"], 131072),
    ("yarn-max-pos-larger", raw_config("llama", 64, 200000, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}), 200000),
    ("yarn-factor-1", INIT["yarn-explicit-factor-1"], 8192),
    ("longrope", INIT["longrope-phi3-implied"], 131072),
]


@pytest.mark.parametrize("raw,expected", [c[1:] for c in MAX_CONTEXT_CASES], ids=[c[0] for c in MAX_CONTEXT_CASES])
def test_max_context(raw, expected):
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    cfg = ours(raw, head_dim)
    assert cfg.max_context(raw["max_position_embeddings"]) == expected


def test_cos_sin_refuses_positions_past_the_limit():
    cfg = ours(raw_config("llama", 64, 2048, rope_scaling={"type": "dynamic", "factor": 2.0}), 64)
    limit = cfg.max_context(2048)
    emb = RotaryEmbedding(cfg, limit, CPU)
    cos, _ = emb.cos_sin(torch.tensor([limit - 1]), torch.float32, max_position=limit - 1)
    assert cos.shape == (1, 1, 64)
    for bad in (limit, limit + 1, 10 * limit):
        with pytest.raises(ValueError, match=rf"position {bad} .*{limit} positions"):
            emb.cos_sin(torch.tensor([0]), torch.float32, max_position=bad)
    with pytest.raises(ValueError, match="at least one position"):
        RotaryEmbedding(cfg, 0, CPU)


# -- 5. refusals and per-layer rope_parameters ------------------------------------------------

@pytest.mark.parametrize("key", ["rope_type", "type"])
@pytest.mark.parametrize("rope_type", ["proportional", "foo", "su", "mrope"])
def test_unknown_rope_type_refused(key, rope_type):
    raw = raw_config("llama", 64, 2048, rope_scaling={key: rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match=rf"rope type '{rope_type}' is not supported"):
        ours(raw, 64)
    with pytest.raises(ValueError, match=rope_type):
        RopeConfig(head_dim=64, rope_type=rope_type)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3"])
@pytest.mark.parametrize("container", ["rope_scaling", "rope_parameters"])
def test_factor_required(rope_type, container):
    params = {"rope_type": rope_type, "original_max_position_embeddings": 1024}
    with pytest.raises(ValueError, match=rf"'{rope_type}' needs rope_scaling.factor"):
        ours(raw_config("llama", 64, 2048, **{container: params}), 64)
    with pytest.raises(ValueError, match=rf"'{rope_type}' needs rope_scaling.factor"):
        ours(raw_config("llama", 64, 2048, **{container: {**params, "factor": None}}), 64)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3"])
def test_rope_config_factor_required(rope_type):
    with pytest.raises(ValueError, match=rf"'{rope_type}' needs a factor"):
        RopeConfig(head_dim=64, rope_type=rope_type, original_max_position_embeddings=1024)


def test_rope_config_implied_factor_only_when_absent():
    """yarn/longrope imply max_position_embeddings / original only without a factor; 1.0 is a factor."""
    implied = RopeConfig(head_dim=64, rope_type="yarn", max_position_embeddings=8192,
                         original_max_position_embeddings=2048)
    explicit = RopeConfig(head_dim=64, rope_type="yarn", factor=1.0, max_position_embeddings=8192,
                          original_max_position_embeddings=2048)
    assert implied.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    assert explicit.attention_scaling == 1.0
    assert torch.equal(explicit.inv_freq(), RopeConfig(head_dim=64).inv_freq())
    assert implied.max_context(8192) == 8192 and explicit.max_context(4096) == 4096


@pytest.mark.parametrize("bad", ["short_factor", "long_factor"])
@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_longrope_factor_lengths_refused(bad, length):
    params = {"type": "longrope", "short_factor": ramp(32, 1.0, 0.1), "long_factor": ramp(32, 1.0, 0.5)}
    params[bad] = ramp(length, 1.0, 0.1)
    raw = raw_config("phi3", 64, 131072, original_max_position_embeddings=4096, rope_scaling=params)
    with pytest.raises(ValueError, match=rf"{bad} has {length} entries, expected 32"):
        ours(raw, 64)


def test_longrope_factor_length_follows_partial_rotary_factor():
    """Phi-4-mini: head_dim 128 x 0.75 rotates 96 dimensions, so 48 factors, not 64."""
    params = {"type": "longrope", "short_factor": ramp(64, 1.0, 0.0), "long_factor": ramp(64, 1.0, 0.0)}
    raw = raw_config("phi3", 128, 131072, partial_rotary_factor=0.75, original_max_position_embeddings=4096,
                     rope_scaling=params)
    with pytest.raises(ValueError, match="short_factor has 64 entries, expected 48"):
        ours(raw, 128)


GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_nested_rope_parameters_by_layer_type(layer_type):
    raw = raw_config("gemma3_text", 64, 131072, rope_parameters=copy.deepcopy(GEMMA3_ROPE),
                     layer_types=["sliding_attention", "full_attention"])
    raw["head_dim"] = 64  # Gemma 3's default is 256
    config = hf_config(raw)
    params = config.rope_parameters[layer_type]
    if params["rope_type"] == "default":
        theta = params["rope_theta"]
        expected = 1.0 / (theta ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, CPU, layer_type=layer_type)
    for source in (raw, {**config.to_dict(), "model_type": "gemma3_text"}):
        cfg = ours(source, 64, layer_type=layer_type)
        assert cfg.rope_type == params["rope_type"]
        assert cfg.theta == params["rope_theta"]
        assert_same_freqs(cfg.inv_freq(), expected)


@pytest.mark.parametrize("nested_original", [8192, None])
def test_nested_rope_parameters_yarn_layer(nested_original):
    """A nested dict keeps its own original_max_position_embeddings, or takes
    max_position_embeddings; a top-level one does not reach it (unlike a flat dict)."""
    full = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1000000.0, "beta_fast": 32, "beta_slow": 1}
    if nested_original is not None:
        full["original_max_position_embeddings"] = nested_original
    nested = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": full}
    raw = raw_config("gemma3_text", 64, 65536, rope_parameters=nested, original_max_position_embeddings=2048,
                     layer_types=["sliding_attention", "full_attention"])
    raw["head_dim"] = 64
    config = hf_config(raw)
    expected, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, CPU, layer_type="full_attention")
    cfg = ours(raw, 64, layer_type="full_attention")
    assert cfg.original_max_position_embeddings == (nested_original or 65536)
    assert cfg.original_max_position_embeddings == config.rope_parameters["full_attention"][
        "original_max_position_embeddings"]
    assert_same_freqs(cfg.inv_freq(), expected)
    assert cfg.attention_scaling == pytest.approx(scaling, rel=1e-12)


def test_nested_rope_parameters_refused_without_layer_type():
    raw = raw_config("gemma3_text", 64, 131072, rope_parameters=copy.deepcopy(GEMMA3_ROPE))
    with pytest.raises(ValueError, match=r"nested by layer type \(sliding_attention, full_attention\).*None"):
        ours(raw, 64)
    with pytest.raises(ValueError, match=r"nested by layer type.*'chunked_attention'"):
        ours(raw, 64, layer_type="chunked_attention")


def test_flat_rope_parameters_ignore_layer_type():
    """A flat config serves every layer, whatever its type."""
    raw = raw_config("llama", 64, 4096, rope_scaling={"type": "linear", "factor": 4.0})
    assert ours(raw, 64, layer_type="full_attention") == ours(raw, 64)


@pytest.mark.parametrize("params,match", [
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": "fast"}, "'beta_fast' must be a number"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": [1], "original_max_position_embeddings": 8192},
     "'low_freq_factor' must be a number"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, "high_freq_factor must be greater than low_freq_factor"),
    ({"rope_type": "linear", "factor": 0.0}, "factor must be > 0"),
    ({"rope_type": "linear", "factor": -2.0}, "factor must be > 0"),
])
def test_bad_parameters_refused(params, match):
    with pytest.raises(ValueError, match=match):
        ours(raw_config("llama", 64, 16384, rope_scaling=params), 64)


def test_rope_scaling_must_be_an_object():
    with pytest.raises(ValueError, match="rope_scaling must be an object"):
        ours(raw_config("llama", 64, 2048, rope_scaling=[2.0]), 64)


@pytest.mark.parametrize("head_dim,partial,match", [
    (64, 0.0, "partial_rotary_factor must be in"),
    (64, 1.5, "partial_rotary_factor must be in"),
    (64, 0.01, "must be even and at least 2"),
    (10, 0.5, "must be even and at least 2"),
])
def test_bad_rotary_dimension_refused(head_dim, partial, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig(head_dim=head_dim, partial_rotary_factor=partial)
    with pytest.raises(ValueError, match=match):
        ours(raw_config("llama", head_dim, 2048, partial_rotary_factor=partial), head_dim)


@pytest.mark.parametrize("extra", [
    {},  # PhiConfig: 0.5; GPTNeoXConfig: rotary_pct 0.25
    {"partial_rotary_factor": 0.375},  # GPT-NeoX reads rotary_pct, not this
    {"rotary_pct": 0.5, "rotary_emb_base": 20000},
    {"rope_theta": 30000.0},  # GPT-NeoX reads rotary_emb_base, not this
    {"partial_rotary_factor": 0.375, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75,
                                                       "rope_theta": 5000.0}},  # the dict's own win
], ids=["none", "top-level-partial", "neox-keys", "top-level-theta", "dict-wins"])
@pytest.mark.parametrize("model_type", ["phi", "gpt_neox"])
def test_rotated_share_and_base_where_transformers_reads_them(model_type, extra):
    """Each model type's config class reads the rotated share and the base under its own keys,
    with its own defaults; the rope dict's own values win over top-level keys."""
    raw = raw_config(model_type, 64, 2048, **copy.deepcopy(extra))
    config = hf_config(raw)
    cfg = ours(raw, 64)
    assert cfg.rotary_dim == int(64 * config.rope_parameters.get("partial_rotary_factor", 1.0))
    assert cfg.theta == config.rope_parameters["rope_theta"]
    assert_same_freqs(cfg.inv_freq(), hf_rotary(raw).inv_freq)


ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq", "rotary_emb_base")


ROTARY_TYPES = sorted(t for t in BY_MODEL_TYPE if t not in ("gpt2", "gpt_bigcode"))  # (learned positions)
LINEAR = {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("model_type,rope_parameters",
                         [(t, None) for t in ROTARY_TYPES]
                         + [(t, LINEAR) for t in ROTARY_TYPES if t != "phi3"],  # (Phi3Config: longrope only)
                         ids=[f"{t}-plain" for t in ROTARY_TYPES]
                         + [f"{t}-linear" for t in ROTARY_TYPES if t != "phi3"])
def test_base_default_is_the_model_types(model_type, rope_parameters):
    """A config.json with no base gets the one transformers' config class of its type defaults
    to (Cohere 500000, Mixtral 1e6, gpt-oss 150000, Gemma 3 1e6 global / 1e4 local)."""
    from text_generation_server.models.registry import read_model_config

    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=6,
                 intermediate_size=64, vocab_size=64, max_position_embeddings=2048)
    raw = {k: v for k, v in AutoConfig.for_model(model_type, **small).to_dict().items() if k not in ROPE_KEYS}
    if rope_parameters is not None:
        raw["rope_parameters"] = dict(rope_parameters)
    config = AutoConfig.for_model(**copy.deepcopy(raw))
    _, ours_config = read_model_config(copy.deepcopy(raw))
    if model_type == "gemma3_text":
        assert ours_config.rope.theta == config.rope_parameters["full_attention"]["rope_theta"] == 1e6
        assert ours_config.local_rope.theta == config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
        return
    assert ours_config.rope.theta == config.rope_parameters["rope_theta"]
    assert ours_config.rope.rope_type == config.rope_parameters["rope_type"]
