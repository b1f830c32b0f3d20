"""Opt-in: a real GGUF file (the registry's Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1.1 GB), not run in CI.

    TGS_GGUF_FILE=/path/qwen2.5-coder-1.5b-instruct.gguf pytest -m gguf_file tests/test_gguf_real.py

(benchmarks/llamacpp_build.py assembles that file into $TGS_BENCH_CACHE/models/qwen2.5-coder-1.5b/.)
Greedy tokens on the reference kernel in float32 equal transformers loading the same file; on the
chosen kernels no layer runs on the reference; two ranks (ffn_down's K = 8960 split at 4480, inside
a Q4_K/Q6_K super-block) give the reference tokens of one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers
from helpers import fast_kernels, ids_request, kernels_used, run_ranks, run_to_end

from text_generation_server.kernels.select import DISABLE_ENV
from text_generation_server.models.loader import get_model

pytestmark = pytest.mark.gguf_file
FILE = os.environ.get("TGS_GGUF_FILE")
PROMPTS = ["def quicksort(arr):", "The capital of France is"]
TOKENS = 12


@pytest.fixture(scope="module")
def path() -> Path:
    if not FILE:
        pytest.skip("opt-in: set TGS_GGUF_FILE to a Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF")
    return Path(FILE)


def ours(lm) -> list[list[int]]:
    lm.allocate_kv_cache(64)
    ids = [lm.tokenizer.encode(p).ids for p in PROMPTS]
    out = run_to_end(lm, lm.make_batch(0, [ids_request(i, p, TOKENS) for i, p in enumerate(ids)]))
    return [out[i]["ids"] for i in range(len(ids))]


def test_reference_kernel_equals_transformers(path, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, fast_kernels())
    lm = get_model(str(path), dtype="float32")
    got = ours(lm)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=TOKENS, eos_token_id=None, pad_token_id=0)
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([lm.tokenizer.encode(prompt).ids])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        assert tokens == want[0, ids.shape[1]:].tolist(), prompt


def test_no_layer_runs_on_the_reference(path):
    used = kernels_used(get_model(str(path), dtype="bfloat16"))
    assert "reference" not in used and "cpu-kquant" in used, used  # Q4_K and Q6_K blocks read in place


def _rank(pg, file: str) -> list[list[int]]:
    os.environ[DISABLE_ENV] = fast_kernels()
    return ours(get_model(file, dtype="float32", process_group=pg))


def test_two_ranks_equal_one(path, tmp_path, monkeypatch):
    ranks = run_ranks(_rank, (str(path),), 2, tmp_path, timeout_s=1800)
    monkeypatch.setenv(DISABLE_ENV, fast_kernels())
    want = ours(get_model(str(path), dtype="float32"))
    assert ranks == [want, want]
