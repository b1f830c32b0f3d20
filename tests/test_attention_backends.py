"""The attention-backend registry (server/layers/attention_backends.py) and triton-paged inside
the whole model.

Choice: the ordered list per device with the reasons for what was passed over (a GPU mocked
where one is needed), a backend asked for by name that cannot run, unknown names,
TGS_ATTENTION_BACKEND and the serve setting.
Soft-capping: triton-paged's prefill and decode with a cap give torch-sdpa's outputs.
Model: the tiny random Llama and Mistral (sliding window) of tests/helpers.py, and Gemma 2 (soft
cap and window) of tests/family_cases.py, with triton-paged under TRITON_INTERPRET=1 give
torch-sdpa's greedy tokens (and seeded ones), logprobs within 1e-4, for a plain prefill with
prompt logprobs, a prefix from the cache (cache_len), a prompt prefilled in chunks while other
rows decode, and decode steps. The interpreter is slow: few tokens, two layers.
"""

from __future__ import annotations


import pytest
import torch
from helpers import collect_generations, ids_request, random_ids, run_to_end, write_checkpoint

from text_generation_server.layers.attention import AttentionMetadata, AttentionSpec, TorchAttention
from text_generation_server.layers.attention_backends import (
    ATTENTION_ENV,
    NoAttentionBackendError,
    TritonPagedAttention,
    backend_names,
    choose_attention_backend,
)
from text_generation_server.models.loader import get_model
from text_generation_server.engine.batch import Batch
from text_generation_server.settings.serve_args import ATTENTION_BACKENDS, ServeArgs

torch.set_num_threads(1)

BLOCK_SIZE = 4


def spec(device_type: str = "cpu", **kw) -> AttentionSpec:
    base = dict(device_type=device_type, dtype=torch.float16, heads=8, kv_heads=2, head_dim=64, block_size=16,
                windowed=False)
    base.update(kw)
    return AttentionSpec(**base)


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return monkeypatch


@pytest.fixture
def gpu(clean_env):
    """A CUDA device of compute capability 9.0 as far as the availability checks can tell."""
    pytest.importorskip("triton")
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    clean_env.setattr(torch.version, "hip", None)
    return clean_env


# ---------------------------------------------------------------------------------------------
# Choice

def test_cpu_takes_torch_first(clean_env):
    backend, rejected = choose_attention_backend(spec("cpu"))
    assert (backend.name, rejected) == ("torch-sdpa", [])
    assert isinstance(backend, TorchAttention) and not backend.graph_safe


def test_cuda_without_a_gpu_says_why_triton_was_passed_over(clean_env):
    pytest.importorskip("triton")
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    backend, rejected = choose_attention_backend(spec("cuda"))
    assert backend.name == "torch-sdpa"
    assert rejected == [("triton-paged", "no CUDA device")]


def test_cuda_prefers_triton_paged(gpu):
    backend, rejected = choose_attention_backend(spec("cuda"))
    assert (backend.name, rejected) == ("triton-paged", [])
    assert isinstance(backend, TritonPagedAttention) and backend.graph_safe


@pytest.mark.parametrize("change,reason", [
    (dict(block_size=12), "block size 12 is not a power of two <= 256"),
    (dict(block_size=512), "block size 512 is not a power of two <= 256"),
    (dict(head_dim=320), "head_dim 320 > 256"),
    (dict(heads=6, kv_heads=4), "6 query heads are not a multiple of 4 KV heads"),
])
def test_cuda_reasons_for_models_triton_cannot_run(gpu, change, reason):
    backend, rejected = choose_attention_backend(spec("cuda", **change))
    assert backend.name == "torch-sdpa"
    assert rejected == [("triton-paged", reason)]


def test_cuda_takes_triton_paged_for_soft_capped_models(gpu):
    """Gemma 2's shapes: logit soft-capping, a window, head_dim 256."""
    gemma2 = spec("cuda", dtype=torch.bfloat16, heads=8, kv_heads=4, head_dim=256, windowed=True, softcap=True)
    assert TritonPagedAttention.can_implement(gemma2) == (True, "")
    backend, rejected = choose_attention_backend(gemma2)
    assert (backend.name, rejected) == ("triton-paged", [])
    assert choose_attention_backend(gemma2, "triton-paged")[0].name == "triton-paged"


def test_old_gpus_fall_back_with_the_capability_in_the_reason(gpu):
    gpu.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    backend, rejected = choose_attention_backend(spec("cuda"))
    assert backend.name == "torch-sdpa"
    assert rejected == [("triton-paged", "needs compute capability 8.0+, got 7.5")]


def test_a_named_backend_that_cannot_run_is_an_error_not_a_fallback(clean_env):
    pytest.importorskip("triton")
    with pytest.raises(NoAttentionBackendError,
                       match="attention backend 'triton-paged' cannot run this model: CPU tensors run only under "
                             "TRITON_INTERPRET=1"):
        choose_attention_backend(spec("cpu"), "triton-paged")


def test_unknown_names_list_the_known_ones(clean_env):
    with pytest.raises(NoAttentionBackendError,
                       match="attention backend 'flash' does not exist \\(choose from triton-paged, torch-sdpa\\)"):
        choose_attention_backend(spec("cpu"), "flash")
    clean_env.setenv(ATTENTION_ENV, "paged")
    with pytest.raises(NoAttentionBackendError, match="attention backend 'paged' does not exist"):
        choose_attention_backend(spec("cpu"))


def test_the_environment_variable_and_the_argument(clean_env):
    pytest.importorskip("triton")
    clean_env.setenv("TRITON_INTERPRET", "1")
    clean_env.setenv(ATTENTION_ENV, "triton-paged")
    assert choose_attention_backend(spec("cpu"))[0].name == "triton-paged"
    assert choose_attention_backend(spec("cpu"), "torch-sdpa")[0].name == "torch-sdpa"  # the argument wins
    clean_env.setenv(ATTENTION_ENV, "")
    assert choose_attention_backend(spec("cpu"))[0].name == "torch-sdpa"  # empty means unset


def test_the_setting_names_the_registry():
    assert set(ATTENTION_BACKENDS) == set(backend_names())
    assert ServeArgs(disable_custom_kernels=True).effective_attention_backend == "torch-sdpa"
    assert ServeArgs(attention_backend="triton-paged").effective_attention_backend == "triton-paged"


def test_triton_prefill_needs_block_tables(clean_env):
    pytest.importorskip("triton")
    clean_env.setenv("TRITON_INTERPRET", "1")
    backend = TritonPagedAttention(spec("cpu", dtype=torch.float32, heads=2, kv_heads=1, head_dim=16, block_size=4))
    q = torch.randn(3, 2, 16)
    cache = torch.zeros(4, 4, 1, 16)
    meta = AttentionMetadata(is_prefill=True, slots=torch.arange(3), prefill_lens=[3])
    with pytest.raises(ValueError, match="triton-paged prefill reads K/V through the block tables"):
        backend.prefill(q, q[:, :1], q[:, :1], cache, cache, meta, 0.25, None)


def test_decode_workspace_is_reserved_once_and_shared(clean_env):
    pytest.importorskip("triton")
    clean_env.setenv("TRITON_INTERPRET", "1")
    backend = TritonPagedAttention(spec("cpu", dtype=torch.float32, heads=4, kv_heads=2, head_dim=16, block_size=4))
    cpu = torch.device("cpu")
    assert backend.reserve_decode(8, 128, cpu) == 0  # 128 positions never split (MIN_SPLIT_TOKENS 256)
    grown = backend.reserve_decode(8, 4096, cpu)
    assert grown > 0
    assert backend.reserve_decode(4, 4096, cpu) == 0  # fits already
    memo = backend.capture_memo(2, 4096, cpu)
    assert memo["num_splits"] == backend.splits_for(2, 4096) > 1
    assert memo["decode_workspace"] is backend._workspace


# ---------------------------------------------------------------------------------------------
# Soft-capping: triton-paged's two calls (interpreted) against torch-sdpa's

def _paged_sequences(cache_lens: list[int], new_lens: list[int], kv_heads: int, head_dim: int, block_size: int,
                     seed: int):
    """A random cache (every slot finite: torch-sdpa reads whole blocks), shuffled block tables
    (int64, as batches hold them), and the slots and K/V of each sequence's new tokens, which the
    cache already holds (as it does when attention runs)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-(c + n) // block_size) for c, n in zip(cache_lens, new_lens)) + 1
    num_blocks = 1 + len(cache_lens) * width
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(len(cache_lens), width)
    tables = torch.zeros(len(cache_lens), width, dtype=torch.long)
    slots = []
    for b, (c, n) in enumerate(zip(cache_lens, new_lens)):
        used = -(-(c + n) // block_size)
        tables[b, :used] = free[b, :used]
        pos = torch.arange(c, c + n)
        slots.append(tables[b, pos // block_size] * block_size + pos % block_size)
    slots = torch.cat(slots)
    k = key_cache.view(-1, kv_heads, head_dim)[slots]
    v = value_cache.view(-1, kv_heads, head_dim)[slots]
    return key_cache, value_cache, tables, slots, k, v


@pytest.mark.parametrize("head_dim,window,splits", [(32, None, 1), (256, 5, 3)])
def test_triton_paged_softcap_equals_torch_sdpa(clean_env, head_dim, window, splits):
    """prefill (prompts from scratch, after a cached prefix, and single-token rows, which
    torch-sdpa runs as a decode step) and decode (with `splits` sequence splits, as a captured
    graph fixes them) with a soft cap: triton-paged's outputs are torch-sdpa's."""
    pytest.importorskip("triton")
    clean_env.setenv("TRITON_INTERPRET", "1")
    heads, kv_heads, bs, cap = 4, 2, 4, 2.0
    s = spec("cpu", dtype=torch.float32, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=bs,
             windowed=window is not None, softcap=True)
    assert TritonPagedAttention.can_implement(s) == (True, "")
    triton_paged, torch_sdpa = TritonPagedAttention(s), TorchAttention(s)
    scale = head_dim ** -0.5
    gen = torch.Generator().manual_seed(head_dim + 1)

    cache_lens, prefill_lens = [0, 5, 9, 3], [7, 6, 1, 1]
    key_cache, value_cache, tables, slots, k, v = _paged_sequences(cache_lens, prefill_lens, kv_heads, head_dim,
                                                                   bs, seed=head_dim)
    q = torch.randn(sum(prefill_lens), heads, head_dim, generator=gen) * 2.0

    def prefill_meta():
        return AttentionMetadata(is_prefill=True, slots=slots, prefill_lens=prefill_lens, cache_lens=cache_lens,
                                 block_tables=tables, max_seq_len=max(c + n for c, n in zip(cache_lens, prefill_lens)))

    want = torch_sdpa.prefill(q, k, v, key_cache, value_cache, prefill_meta(), scale, window, cap)
    got = triton_paged.prefill(q, k, v, key_cache, value_cache, prefill_meta(), scale, window, cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    uncapped = torch_sdpa.prefill(q, k, v, key_cache, value_cache, prefill_meta(), scale, window)
    assert (uncapped - want).abs().max() > 0.05  # the cap matters at these scores

    seq_lens = [13, 11, 10, 4]
    key_cache, value_cache, tables, slots, _, _ = _paged_sequences([n - 1 for n in seq_lens], [1] * 4, kv_heads,
                                                                   head_dim, bs, seed=head_dim + 2)
    q = torch.randn(4, heads, head_dim, generator=gen) * 2.0

    def decode_meta():
        meta = AttentionMetadata(is_prefill=False, slots=slots, block_tables=tables,
                                 seq_lens=torch.tensor(seq_lens), max_seq_len=max(seq_lens))
        meta.memo("num_splits", lambda: splits)  # what a captured graph fixes
        return meta

    want = torch_sdpa.decode(q, key_cache, value_cache, decode_meta(), scale, window, cap)
    got = triton_paged.decode(q, key_cache, value_cache, decode_meta(), scale, window, cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    uncapped = torch_sdpa.decode(q, key_cache, value_cache, decode_meta(), scale, window)
    assert (uncapped - want).abs().max() > 0.05


# ---------------------------------------------------------------------------------------------
# The whole model: triton-paged (interpreted) against torch-sdpa

@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("backends")
    out = {}
    for seed, name in enumerate(("llama", "mistral_window")):
        write_checkpoint(root / name, name, seed=seed + 51)
        out[name] = str(root / name)
    return out


def scenarios(lm) -> dict[str, dict]:
    """Every shape of step the engine runs, on one model."""
    lm.allocate_kv_cache(64)
    results = {}
    # A plain prefill of two prompts with prompt logprobs, then decode steps.
    results["prefill+decode"] = run_to_end(lm, lm.make_batch(0, [
        ids_request(0, random_ids(13, 1), 3, prefill_logprobs=True),
        ids_request(1, random_ids(6, 2), 3, seed=5, prefill_logprobs=True),
    ]))
    # A prefix from the cache: the router's blocks hold the first 8 tokens of `first`.
    shared = random_ids(8, 3)
    first, second = shared + random_ids(5, 4), shared + random_ids(7, 5)
    blocks = lm.allocator.allocate(lm.blocks_for(len(first) + 2))
    run_to_end(lm, lm.make_batch(1, [ids_request(2, first, 2, blocks=blocks)]))
    tail = lm.allocator.allocate(lm.blocks_for(len(second) + 3) - 2)
    results["cached prefix"] = run_to_end(lm, lm.make_batch(2, [
        ids_request(3, second, 3, seed=6, blocks=blocks[:2] + tail, cache_len=2 * BLOCK_SIZE,
                    prefill_logprobs=True),
    ]))
    lm.allocator.free(tail)
    lm.allocator.free(blocks)
    # A prompt prefilled in chunks of at most 5 tokens a step, beside two decoding rows.
    lm.max_prefill_tokens = 5
    out: dict = {}
    running = lm.make_batch(3, [ids_request(4, random_ids(5, 6), 6), ids_request(5, random_ids(3, 7), 6, seed=7)])
    generations, running, _ = lm.generate_token(running)
    collect_generations(out, generations)
    batch = Batch.concatenate([running, lm.make_batch(4, [ids_request(6, random_ids(14, 8), 2, chunk_len=3)])])
    mixed = 0
    while batch is not None:
        mixed += batch.prefilling and any(not s.prefilling for s in batch.states)
        generations, batch, _ = lm.generate_token(batch)
        done = collect_generations(out, generations)
        if batch is not None and done:
            batch = lm.filter(batch, [r for r in batch.request_ids if r not in done])
    results["chunks+decode"] = out
    assert mixed >= 4, "the long prompt was not prefilled in chunks beside decoding rows"
    lm.max_prefill_tokens = None
    return results


@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_triton_paged_gives_the_tokens_of_torch_sdpa(folders, arch, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    want = scenarios(get_model(folders[arch], dtype="float32", block_size=BLOCK_SIZE, attention_backend="torch-sdpa"))
    lm = get_model(folders[arch], dtype="float32", block_size=BLOCK_SIZE, attention_backend="triton-paged")
    assert lm.attention.name == "triton-paged"
    got = scenarios(lm)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for rid in want[name]:
            g, w = got[name][rid], want[name][rid]
            assert g["ids"] == w["ids"], (name, rid)
            torch.testing.assert_close(torch.tensor(g["lps"]), torch.tensor(w["lps"]), atol=1e-4, rtol=0)
            if w["prompt"] is not None:
                torch.testing.assert_close(torch.tensor(g["prompt"]), torch.tensor(w["prompt"]), atol=1e-4, rtol=0,
                                           equal_nan=True)


def test_triton_paged_gives_the_tokens_of_torch_sdpa_on_gemma2(tmp_path, monkeypatch):
    """Gemma 2 (attention logit soft-capping at 4, a 7-token window on alternate layers): every
    scenario above, through triton-paged's soft-capped kernels."""
    pytest.importorskip("triton")
    from family_cases import write_family_checkpoint

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    write_family_checkpoint(tmp_path, "gemma2", seed=53)
    want = scenarios(get_model(str(tmp_path), dtype="float32", block_size=BLOCK_SIZE, attention_backend="torch-sdpa"))
    lm = get_model(str(tmp_path), dtype="float32", block_size=BLOCK_SIZE, attention_backend="triton-paged")
    assert lm.attention.name == "triton-paged"
    got = scenarios(lm)
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for rid in want[name]:
            g, w = got[name][rid], want[name][rid]
            assert g["ids"] == w["ids"], (name, rid)
            torch.testing.assert_close(torch.tensor(g["lps"]), torch.tensor(w["lps"]), atol=1e-4, rtol=0)
            if w["prompt"] is not None:
                torch.testing.assert_close(torch.tensor(g["prompt"]), torch.tensor(w["prompt"]), atol=1e-4, rtol=0,
                                           equal_nan=True)
