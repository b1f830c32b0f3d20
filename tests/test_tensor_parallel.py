"""Tensor parallelism with real gloo processes: world size 2 must reproduce world size 1.

All world-size-2 work runs in one spawn of two ranks (process start and
torch.distributed set-up dominate the cost); the ranks load every checkpoint in
turn and save what they generated, and the tests compare that with the same
requests run in this process at world size 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import run_ranks, write_checkpoint
from safetensors.torch import load_file, save_file

from text_generation_server.generation.sampling import SamplingParams
from text_generation_server.models.loader import get_model
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.quantizers.sources import CheckpointError

torch.set_num_threads(1)

WORLD = 2
TOKENIZER_VOCAB = 300  # helpers.build_tokenizer()
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
    "import os",
    "The quick brown fox",
]
# name -> (architecture, config overrides); "odd_vocab" is padded to 301 rows after writing.
MODELS = {
    "llama_gqa": ("llama", {}),
    "llama3_six_heads": ("llama3_rope", {}),  # 3 query heads per rank
    "phi3_fused": ("phi3_fused", {}),
    "tied": ("llama_linear_rope_tied", {"num_attention_heads": 4, "num_key_value_heads": 4}),
    "odd_vocab": ("llama", {}),
    "three_heads": ("llama_linear_rope_tied", {}),  # 3 heads: cannot split over 2 ranks
}
SPAWN_TIMEOUT_S = 240


def pad_vocab(folder: Path, vocab_size: int, seed: int) -> None:
    """Grows embed_tokens and lm_head to `vocab_size` rows, as checkpoints that pad their
    vocabulary past the tokenizer do (Qwen2, Phi-3)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(seed)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = tensors[name]
        extra = torch.randn(vocab_size - t.shape[0], t.shape[1], generator=g, dtype=t.dtype) * 0.2
        tensors[name] = torch.cat([t, extra])
    save_file(tensors, str(path))
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (folder / "config.json").write_text(json.dumps(config))


def requests() -> list[GenerationRequest]:
    sampling = SamplingParams(do_sample=True, seed=4, temperature=0.9, top_k=50)
    return [
        GenerationRequest(id=0, inputs=PROMPTS[0], max_new_tokens=12, ignore_eos_token=True, prefill_logprobs=True),
        GenerationRequest(id=1, inputs=PROMPTS[1], max_new_tokens=9, ignore_eos_token=True, prefill_logprobs=True),
        GenerationRequest(id=2, inputs=PROMPTS[2], max_new_tokens=12, ignore_eos_token=True, sampling=sampling),
    ]


def run(lm) -> dict:
    completions = lm.generate(requests())
    return {
        "tokens": [c.token_ids for c in completions],
        "prefill": [c.steps[0].prefill_tokens.logprobs for c in completions if c.steps[0].prefill_tokens],
    }


def _rank_main(pg, folders: dict[str, str]) -> dict[str, object]:
    results: dict[str, object] = {}
    for name, folder in folders.items():
        try:
            lm = get_model(folder, dtype="float32", process_group=pg)
        except CheckpointError as exc:  # raised on every rank before any collective
            results[name] = f"CheckpointError: {exc}"
            continue
        results[name] = run(lm)
        results[name]["shapes"] = {
            "embed": list(lm.model.embeddings.tokens.weight.shape),
            "head": list(lm.model.head.projection.weight.shape),
            "kv_heads": lm.model.local_kv_heads,
        }
    return results


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for seed, (name, (arch, overrides)) in enumerate(MODELS.items()):
        write_checkpoint(root / name, arch, seed=41 + seed, **overrides)
        out[name] = str(root / name)
    pad_vocab(root / "odd_vocab", TOKENIZER_VOCAB + 1, seed=1)
    return out


@pytest.fixture(scope="module")
def world2(folders, tmp_path_factory) -> list[dict]:
    """What each of the two ranks generated, per model."""
    return run_ranks(_rank_main, (folders,), WORLD, tmp_path_factory.mktemp("tp_out"), SPAWN_TIMEOUT_S)


def world1(folder: str) -> dict:
    return run(get_model(folder, dtype="float32"))


@pytest.mark.parametrize("name", ["llama_gqa", "llama3_six_heads", "phi3_fused", "tied", "odd_vocab"])
def test_world_size_2_matches_world_size_1(folders, world2, name):
    reference = world1(folders[name])
    rank0, rank1 = world2[0][name], world2[1][name]
    assert not isinstance(rank0, str), rank0
    assert rank0["tokens"] == reference["tokens"]
    assert rank1["tokens"] == rank0["tokens"]  # every rank chooses the same tokens
    for got, want in zip(rank0["prefill"], reference["prefill"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0, equal_nan=True)
    # Each rank really holds half of the heads.
    kv = get_model(folders[name]).model.local_kv_heads
    assert rank0["shapes"]["kv_heads"] * WORLD == kv


def test_odd_vocab_is_split_and_padded(world2):
    # 301 rows: rank 0 embeds ids 0..150, rank 1 ids 151..300; the head pads rank 1 to 151 rows.
    assert world2[0]["odd_vocab"]["shapes"]["embed"] == [151, 48]
    assert world2[1]["odd_vocab"]["shapes"]["embed"] == [150, 48]
    assert world2[0]["odd_vocab"]["shapes"]["head"] == world2[1]["odd_vocab"]["shapes"]["head"] == [151, 48]


def test_head_count_not_divisible_by_world_size(world2):
    for rank in range(WORLD):
        message = world2[rank]["three_heads"]
        assert isinstance(message, str) and message.startswith("CheckpointError")
        assert "num_attention_heads (3) must be divisible by the 2 shards" in message


def test_padded_vocabulary_never_emits_ids_the_tokenizer_lacks(tmp_path):
    """Ids past the tokenizer have no text: the engine must never choose them, even when sampling
    from a flat distribution where a quarter of the mass sits on them."""
    write_checkpoint(tmp_path, "llama", seed=5)
    pad_vocab(tmp_path, 400, seed=2)
    lm = get_model(str(tmp_path), dtype="float32")
    assert lm.config.vocab_size == 400
    reqs = [GenerationRequest(id=i, inputs=p, max_new_tokens=20, ignore_eos_token=True, top_n_tokens=5,
                              sampling=SamplingParams(do_sample=True, seed=i, temperature=50.0))
            for i, p in enumerate(PROMPTS)]
    for done in lm.generate(reqs):
        assert len(done.token_ids) == 20
        assert max(done.token_ids) < TOKENIZER_VOCAB
        for step in done.steps:
            assert max(step.top_tokens[0].ids) < TOKENIZER_VOCAB
            assert math.isfinite(step.tokens.logprobs[0])
