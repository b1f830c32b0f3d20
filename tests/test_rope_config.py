"""A `rope_scaling` added to a config.json that has `rope_parameters`, read as transformers reads it.

Model cards tell users to extend a model's context by adding `rope_scaling` to its config.json;
configs transformers 5 wrote already hold `rope_parameters`. transformers' config classes
(RotaryEmbeddingConfigMixin.convert_rope_params_to_dict) let the `rope_scaling` replace
`rope_parameters` whole (its type under `rope_type` or the legacy `type`), and take the base from
config.json's top-level `rope_theta` or the model type's default, never from the dict replaced;
Gemma 3 (Gemma3TextConfig) updates only its full-attention entry and leaves the sliding one.

Each case is read by the family (`read_model_config`, what the server loads) and compared with
what transformers computes from the same dict: the frequencies and attention scaling of
`ROPE_INIT_FUNCTIONS` on transformers' own config, and, end to end, the log-probs of
transformers' model on the same random weights.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import build_tokenizer  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from text_generation_server.engine.types import GenerationRequest  # noqa: E402
from text_generation_server.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402
from text_generation_server.models.loader import get_model  # noqa: E402
from text_generation_server.models.registry import read_model_config  # noqa: E402

CPU = torch.device("cpu")
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers():
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # (it warns about rope_scaling being deprecated)
    yield
    transformers.logging.set_verbosity(level)


def small(model_type: str, **extra) -> dict:
    """A config.json of a small model: head_dim 64, 2048 positions."""
    return {"model_type": model_type, "vocab_size": 64, "hidden_size": 256, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
            "max_position_embeddings": 2048, **extra}


def theirs(raw: dict):
    """transformers' config from config.json's dict (a copy: it edits rope dicts in place)."""
    return AutoConfig.for_model(**copy.deepcopy(raw))


def ours(raw: dict):
    _, config = read_model_config(copy.deepcopy(raw))
    return config


def expected_freqs(config, params: dict, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """transformers' inv_freq and attention scaling for one rope dict of `config`."""
    if params["rope_type"] == "default":  # no ROPE_INIT_FUNCTIONS entry: the models compute it
        dim = config.head_dim
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, CPU, layer_type=layer_type)


def assert_rope_equal(rope: RopeConfig, config, params: dict, layer_type: str | None = None) -> None:
    expected, scaling = expected_freqs(config, params, layer_type)
    assert rope.rope_type == params["rope_type"]
    assert rope.theta == params["rope_theta"]
    torch.testing.assert_close(rope.inv_freq(), expected.float(), rtol=1e-6, atol=0)
    assert rope.attention_scaling == pytest.approx(scaling, rel=1e-12)


# -- llama-style: one rope for every layer ------------------------------------------------------------

# What the config.json already holds (transformers 5 writes rope_parameters with the base inside).
PARAMETERS = {
    "llama3.2": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "qwen2": {"rope_type": "default", "rope_theta": 1000000.0},
}
# What a user adds, each type as model cards write it.
SCALINGS = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 512},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("top_theta", [None, 250000.0], ids=["no-rope_theta", "rope_theta"])
@pytest.mark.parametrize("type_key", ["rope_type", "type"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("model_type,parameters", [("llama", "llama3.2"), ("qwen2", "qwen2"), ("mistral", "qwen2")])
def test_rope_scaling_replaces_rope_parameters(model_type, parameters, scaling, type_key, top_theta):
    raw = small(model_type, rope_parameters=copy.deepcopy(PARAMETERS[parameters]),
                rope_scaling={type_key: scaling, **SCALINGS[scaling]})
    if top_theta is not None:
        raw["rope_theta"] = top_theta
    config = theirs(raw)
    params = config.rope_parameters
    # transformers' reading, spelled out: the added dict wins whole, the base is not the replaced dict's.
    assert params["rope_type"] == scaling
    assert params["rope_theta"] == (top_theta or 10000.0)

    decoder = ours(raw)
    assert_rope_equal(decoder.rope, config, params)
    assert decoder.rope.factor == SCALINGS[scaling]["factor"]
    # The context it serves follows the added scaling (dynamic NTK stretches max_position_embeddings).
    assert decoder.max_context == (4096 if scaling == "dynamic" else 2048)
    # transformers' standardised config (what it saves) reads the same.
    assert ours({**config.to_dict(), "model_type": model_type}).rope == decoder.rope


@pytest.mark.parametrize("length", [2048, 3000, 4096])
def test_added_dynamic_scaling_at_long_lengths(length):
    """Dynamic NTK added over a llama3 rope_parameters: the frequencies at a sequence length past
    the base, against ROPE_INIT_FUNCTIONS(seq_len=...)."""
    raw = small("llama", rope_parameters=copy.deepcopy(PARAMETERS["llama3.2"]),
                rope_scaling={"type": "dynamic", "factor": 2.0})
    config = theirs(raw)
    rope = ours(raw).rope
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, CPU, seq_len=torch.tensor(length))
    cos, _ = RotaryEmbedding(rope, 4096, CPU).cos_sin(torch.tensor([1]), torch.float32,
                                                      seq_lens=torch.tensor([length]))
    torch.testing.assert_close(cos[0, 0, :32], expected.cos(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rope_scaling", [None, {}], ids=["null", "empty"])
def test_no_rope_scaling_keeps_rope_parameters(rope_scaling):
    """A null or empty rope_scaling replaces nothing (transformers: `rope_scaling or rope_parameters`)."""
    raw = small("llama", rope_parameters=copy.deepcopy(PARAMETERS["llama3.2"]), rope_scaling=rope_scaling,
                rope_theta=250000.0)
    config = theirs(raw)
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500000.0
    assert_rope_equal(ours(raw).rope, config, config.rope_parameters)


def test_rope_theta_inside_rope_scaling_wins():
    raw = small("llama", rope_parameters=copy.deepcopy(PARAMETERS["qwen2"]), rope_theta=250000.0,
                rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 40000.0})
    config = theirs(raw)
    assert config.rope_parameters["rope_theta"] == 40000.0
    assert_rope_equal(ours(raw).rope, config, config.rope_parameters)


@pytest.mark.parametrize("model_type,theta", [("cohere", 500000.0), ("mixtral", 1000000.0)])
def test_added_rope_scaling_takes_the_model_types_base(model_type, theta):
    """No top-level rope_theta: the base is the model type's default, not the replaced dict's."""
    raw = small(model_type, rope_parameters={"rope_type": "default", "rope_theta": 1234.0},
                rope_scaling={"type": "linear", "factor": 2.0})
    if model_type == "mixtral":
        raw.update(num_local_experts=2, num_experts_per_tok=1)
    config = theirs(raw)
    assert config.rope_parameters["rope_theta"] == theta
    assert_rope_equal(ours(raw).rope, config, config.rope_parameters)


def test_deepseek_softmax_scale_follows_the_added_scaling():
    """DeepSeek's softmax scale depends on the rope (yarn's mscale_all_dim): it reads the same dict."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    raw = small("deepseek_v3", hidden_size=128, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.7,
                              "original_max_position_embeddings": 512})
    del raw["head_dim"]
    config = theirs(raw)
    decoder = ours(raw)
    assert decoder.softmax_scale == pytest.approx(yarn_apply_mscale(config.rope_parameters, 20 ** -0.5), rel=1e-12)
    assert decoder.softmax_scale != pytest.approx(20 ** -0.5)
    assert_rope_equal(decoder.rope, config, config.rope_parameters)


# -- Gemma 3: a rope per layer type ---------------------------------------------------------------

NESTED = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
GEMMA3_CASES = {
    # transformers 5 configs (nested), a rope_scaling added
    "nested-yarn": dict(rope_parameters=NESTED, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}),
    # the update is key by key: a legacy `type` does not replace the rope_type already there
    "nested-legacy-type": dict(rope_parameters=NESTED, rope_scaling={"type": "yarn", "factor": 4.0}),
    "nested-theta-inside": dict(rope_parameters=NESTED, rope_scaling={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}),
    "nested-top-level-theta-ignored": dict(rope_parameters=NESTED, rope_theta=77777.0, rope_local_base_freq=5.0,
                                           rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # older configs: rope_theta (global) and rope_local_base_freq (sliding), rope_scaling for global layers
    "legacy": dict(rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear",
                                                                                     "factor": 8.0}),
    "legacy-no-theta": dict(rope_scaling={"type": "linear", "factor": 8.0}),
    "legacy-yarn": dict(rope_theta=500000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
}


@pytest.mark.parametrize("case", list(GEMMA3_CASES))
def test_gemma3_rope_scaling_updates_only_full_attention(case):
    raw = small("gemma3_text", sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                **copy.deepcopy(GEMMA3_CASES[case]))
    config = theirs(raw)
    decoder = ours(raw)
    full, sliding = config.rope_parameters["full_attention"], config.rope_parameters["sliding_attention"]
    assert_rope_equal(decoder.rope, config, full, "full_attention")
    assert_rope_equal(decoder.local_rope, config, sliding, "sliding_attention")
    if "rope_parameters" in raw:  # the sliding entry is config.json's, untouched
        assert decoder.local_rope == ours({**raw, "rope_scaling": None}).local_rope
        assert sliding["rope_theta"] == 10000.0 and sliding["rope_type"] == "default"
    assert ours({**config.to_dict(), "model_type": "gemma3_text"}).rope == decoder.rope


# -- end to end: log-probs of transformers' model on the same weights ---------------------------------

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
           "import os\nimport sys\n\nclass Stack:\n"]
MODELS = {
    # Llama 3.2-style rope_parameters, no top-level rope_theta; the user adds yarn.
    "llama-yarn": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=PARAMETERS["llama3.2"]),
                   {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2-linear-legacy-type": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2,
                                               rope_parameters=PARAMETERS["qwen2"]), {"type": "linear", "factor": 4.0}),
    "gemma3-yarn": ("gemma3_text", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=7,
                                        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters=NESTED),
                    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
}


def prompt_logprobs_hf(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def prompt_logprobs_ours(lm) -> list[torch.Tensor]:
    requests = [GenerationRequest(id=i, inputs=p, max_new_tokens=1, prefill_logprobs=True, ignore_eos_token=True)
                for i, p in enumerate(PROMPTS)]
    out = []
    for done in lm.generate(requests):
        lps = done.steps[0].prefill_tokens.logprobs
        assert math.isnan(lps[0])
        out.append(torch.tensor(lps[1:]))
    return out


def write_with_rope_scaling(folder: Path, model_type: str, overrides: dict, rope_scaling: dict, seed: int):
    """A random checkpoint whose config.json holds rope_parameters (as transformers saved it) plus a
    hand-added rope_scaling; returns transformers' model without the scaling."""
    tokenizer = build_tokenizer()
    base = dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=48, intermediate_size=88, num_hidden_layers=2,
                max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=0,
                bos_token_id=0, pad_token_id=0)
    config = AutoConfig.for_model(model_type, **{**base, **copy.deepcopy(overrides)})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2)
            if "norm" in name and model_type != "gemma3_text":
                p.add_(1.0)
    model.eval().save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    saved = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved and "rope_scaling" not in saved
    (folder / "config.json").write_text(json.dumps({**saved, "rope_scaling": rope_scaling}))
    return model


@pytest.mark.parametrize("name", list(MODELS))
def test_logprobs_equal_transformers_with_added_rope_scaling(tmp_path, name):
    model_type, overrides, rope_scaling = MODELS[name]
    plain = write_with_rope_scaling(tmp_path, model_type, overrides, rope_scaling, seed=7)
    scaled = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    lm = get_model(str(tmp_path), dtype="float32")
    for prompt, got in zip(PROMPTS, prompt_logprobs_ours(lm)):
        ids = lm.tokenizer.encode(prompt).ids
        torch.testing.assert_close(got, prompt_logprobs_hf(scaled, ids), atol=1e-4, rtol=0)
        # The added scaling matters on these prompts: ignoring it would be noticed.
        assert (got - prompt_logprobs_hf(plain, ids)).abs().max() > 1e-3
