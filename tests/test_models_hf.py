"""The engine against transformers, for every architecture the helpers can build.

transformers is the ground truth: all-position log-probs must agree in float32,
greedy continuations must be token-identical, and half precision must stay close
to float32. Prompts are longer than the Mistral sliding window (7) and decoding
crosses KV block boundaries, so windowed attention and the paged cache are both
on the path being compared.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from helpers import ARCH_CONFIGS, write_checkpoint

from text_generation_server.models.loader import get_model
from text_generation_server.engine.types import GenerationRequest

torch.set_num_threads(1)

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",  # 26 tokens
    "import os\nimport sys\n\nclass Stack:\n",  # 21 tokens
    "Ünïcödé: 日本語",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    """One random float32 checkpoint per architecture, with its transformers model."""
    root = tmp_path_factory.mktemp("hf_archs")
    built = {}
    for seed, name in enumerate(ARCH_CONFIGS):
        folder = root / name
        built[name] = (str(folder), write_checkpoint(folder, name, seed=seed + 11))
    return built


def hf_prompt_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(token_i | prefix) for i >= 1, from transformers' logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def engine_prompt_logprobs(lm, prompts: list[str]) -> list[torch.Tensor]:
    requests = [
        GenerationRequest(id=i, inputs=p, max_new_tokens=1, prefill_logprobs=True, ignore_eos_token=True)
        for i, p in enumerate(prompts)
    ]
    out = []
    for done in lm.generate(requests):
        lps = done.steps[0].prefill_tokens.logprobs
        assert math.isnan(lps[0])  # nothing predicts the first token
        out.append(torch.tensor(lps[1:]))
    return out


def hf_greedy(model: torch.nn.Module, ids: list[int]) -> list[int]:
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    new = out[0, len(ids):].tolist()
    assert len(new) == NEW_TOKENS, "transformers stopped early: the reference would be wrong"
    return new


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_prompt_logprobs_match_transformers(checkpoints, arch):
    folder, hf = checkpoints[arch]
    lm = get_model(folder, dtype="float32")
    # All prompts in one batch: flattened prefill must not leak between requests.
    ours = engine_prompt_logprobs(lm, PROMPTS)
    for prompt, got in zip(PROMPTS, ours):
        ids = lm.tokenizer.encode(prompt).ids
        want = hf_prompt_logprobs(hf, ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_generation_matches_transformers(checkpoints, arch):
    folder, hf = checkpoints[arch]
    lm = get_model(folder, dtype="float32", block_size=8)
    requests = [
        GenerationRequest(id=i, inputs=p, max_new_tokens=NEW_TOKENS, ignore_eos_token=True)
        for i, p in enumerate(PROMPTS)
    ]
    completions = lm.generate(requests)
    for prompt, done in zip(PROMPTS, completions):
        ids = lm.tokenizer.encode(prompt).ids
        assert done.token_ids == hf_greedy(hf, ids), f"{arch}: prompt {prompt!r}"
        assert done.finish_reason.name == "LENGTH"


# What each feature is turned off with, to show the comparison above would notice it missing.
FEATURE_OFF = {
    "mistral_window": {"sliding_window": None},
    "llama3_rope": {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "llama_linear_rope_tied": {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}


@pytest.mark.parametrize("arch", list(FEATURE_OFF))
def test_features_matter_for_these_prompts(checkpoints, arch):
    """The same weights without the sliding window / rope scaling give clearly different log-probs,
    so agreement with transformers really checks those features."""
    folder, hf = checkpoints[arch]
    config = hf.config.to_dict()
    config.update(FEATURE_OFF[arch])
    plain_config = type(hf.config).from_dict(config)
    plain = transformers.AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32).eval()
    plain.load_state_dict(hf.state_dict())
    lm = get_model(folder, dtype="float32")
    ours = engine_prompt_logprobs(lm, PROMPTS[:1])[0]
    ids = lm.tokenizer.encode(PROMPTS[0]).ids
    assert (ours - hf_prompt_logprobs(plain, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_half_precision_stays_close_to_float32(checkpoints, arch, dtype):
    folder, _ = checkpoints[arch]
    reference = engine_prompt_logprobs(get_model(folder, dtype="float32"), PROMPTS)
    lm = get_model(folder, dtype=dtype)
    got = engine_prompt_logprobs(lm, PROMPTS)
    for want, have in zip(reference, got):
        assert torch.isfinite(have).all()
        torch.testing.assert_close(have, want, atol=0.05, rtol=0)
    assert lm.kv_cache.keys[0].dtype == getattr(torch, dtype)
    # Generation runs to the end in half precision too.
    done = lm.generate([GenerationRequest(id=9, inputs=PROMPTS[0], max_new_tokens=8, ignore_eos_token=True)])[0]
    assert len(done.token_ids) == 8


def test_half_precision_checkpoint_loads_as_float32(tmp_path):
    """A float16 checkpoint computed in float32 matches transformers' upcast model exactly."""
    hf = write_checkpoint(tmp_path, "qwen2_bias", seed=5, dtype=torch.float16).float()
    lm = get_model(str(tmp_path), dtype="float32")
    assert lm.model.embeddings.tokens.weight.dtype == torch.float32
    got = engine_prompt_logprobs(lm, PROMPTS[:1])[0]
    want = hf_prompt_logprobs(hf, lm.tokenizer.encode(PROMPTS[0]).ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
