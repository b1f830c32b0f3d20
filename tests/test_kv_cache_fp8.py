"""The fp8 KV cache (`--kv-cache-dtype`): its arithmetic, its kernels, its checkpoints, its size.

- write-then-read of the cache equals rounding x / scale to e4m3fn / e5m2 (saturated) times scale,
  per head, for per-head and latent caches;
- the Triton kernels (decode with and without splits, prefill over a cached prefix with a window
  and a soft cap, MLA decode) under TRITON_INTERPRET=1 equal the torch path on the same fp8 cache;
- every family of tests/family_cases.py serves with the flag, its logits (prefill and decode)
  within FAMILY_BOUND of its 16-bit (bfloat16) cache's;
- checkpoint declarations: compressed-tensors kv_cache_scheme with per-layer and per-head scales
  (cut per tensor-parallel rank), ModelOpt's kv_cache_quant_algo, other declarations refused by
  name, a flag contradicting the checkpoint refused naming both;
- warmup: at the same memory budget an fp8 cache holds 2x the tokens of a bfloat16 one (4x
  float32), and Info's max_batch_total_tokens says so;
- CUDA graphs (emulated capture) replay over an fp8 cache; chunked prefill and a cached prefix give
  the whole prefill's tokens; two gloo ranks keep their KV heads' scales and give one process's
  tokens; the kernels' fp8 paths compile for sm80 and sm90.
- at Qwen2.5-1.5B's attention shape (128-wide heads, 6 query heads per KV head, an outlier key channel)
  the torch prefill and decode and the Triton kernels equal float64 attention over K and V rounded to fp8: what the real
  model loses (BENCHMARKS.md) is the format's rounding, not a fault of the fp8 path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_cases import CASES, write_family_checkpoint
from helpers import ids_request, run_to_end
from safetensors.torch import load_file, save_file

from text_generation_server.engine.types import GenerationRequest
from text_generation_server.kernels.kv_fp8 import FP8_KV_DTYPES, KVScales
from text_generation_server.layers.attention import AttentionMetadata, KVLayout, TorchAttention
from text_generation_server.models.kv_cache import resolve_kv_cache_dtype
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.kv_cache import read_kv_cache_declaration
from text_generation_server.quantizers.sources import CheckpointError

torch.set_num_threads(1)
FP8 = list(FP8_KV_DTYPES.values())
CPU = torch.device("cpu")


def rounded(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference: x / scale to the nearest fp8 (saturated at the format's max), times scale, in float32."""
    limit = torch.finfo(dtype).max
    return (x.double() / scale.double()[:, None]).clamp(-limit, limit).float().to(dtype).float() * scale[:, None]


# -- write, then read -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_write_then_read_is_rounding_to_fp8(dtype, model_dtype):
    torch.manual_seed(0)
    layout = KVLayout(num_layers=2, kv_heads=3, head_dim=8)
    k_scale, v_scale = torch.tensor([0.01, 0.5, 4.0]), torch.tensor([2.0, 0.25, 1.0])
    scales = [KVScales.ones(dtype, 3, CPU), KVScales(dtype, k_scale, v_scale)]
    cache = layout.allocate(4, 4, dtype, CPU, scales)
    assert cache.keys[0].dtype == dtype and cache.keys[0].element_size() == 1
    k = (torch.randn(6, 3, 8) * 300).to(model_dtype)  # past e4m3's 448 at scale 0.01 and 0.5: saturates
    v = (torch.randn(6, 3, 8) * 3).to(model_dtype)
    slots = torch.tensor([0, 5, 6, 9, 14, 15])
    for layer in range(2):
        cache.store(layer, slots, k, v)
        s = cache.scales_of(layer)
        got_k = s.dequantize(cache.keys[layer].view(-1, 3, 8)[slots], "key", torch.float32)
        got_v = s.dequantize(cache.values[layer].view(-1, 3, 8)[slots], "value", torch.float32)
        assert torch.equal(got_k, rounded(k.float(), s.key, dtype))
        assert torch.equal(got_v, rounded(v.float(), s.value, dtype))
        assert torch.isfinite(got_k).all()  # saturated, never inf or NaN
        # What a prefill attends over for this forward's own tokens is the same read-back.
        assert torch.equal(s.roundtrip(k, "key").float(), got_k.to(model_dtype).float())
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (cache.keys[1].view(-1, 3, 8)[untouched].float() == 0).all()


@pytest.mark.parametrize("dtype", FP8)
def test_latent_write_then_read(dtype):
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=12, latent=True)
    scale = torch.tensor([0.125])
    cache = layout.allocate(2, 4, dtype, CPU, [KVScales(dtype, scale, scale)])
    latent = torch.randn(3, 12) * 50
    slots = torch.tensor([1, 2, 7])
    cache.store_latent(0, slots, latent)
    got = cache.scales_of(0).dequantize(cache.keys[0].view(-1, 1, 12)[slots], "key", torch.float32)
    assert torch.equal(got, rounded(latent.unsqueeze(1), scale, dtype))


def test_an_fp8_cache_takes_only_fp8_scales_of_its_shape():
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="one torch.float8_e4m3fn KVScales of \\[2\\] per layer"):
        layout.allocate(1, 4, torch.float8_e4m3fn, CPU, [KVScales.ones(torch.float8_e4m3fn, 3, CPU)] * 2)
    with pytest.raises(ValueError, match="KV scales are for fp8 caches"):
        layout.allocate(1, 4, torch.bfloat16, CPU, [KVScales.ones(torch.float8_e4m3fn, 2, CPU)] * 2)
    assert layout.bytes_per_token(torch.float8_e5m2) * 2 == layout.bytes_per_token(torch.bfloat16)
    assert layout.bytes_per_token(torch.float8_e4m3fn) * 4 == layout.bytes_per_token(torch.float32)


# -- Qwen2.5's shape: what an fp8 cache costs is the format's rounding, nothing more -------------------------
def qwen_like_kv(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, 12, 128], k and v [T, 2, 128] shaped like Qwen2.5-1.5B's layer 0: 6 query heads per KV head,
    keys with a few bias-driven channels near +-358 (the model's largest), small values."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, 12, 128, generator=gen)
    k = torch.randn(tokens, 2, 128, generator=gen)
    k[:, :, [3, 67]] += torch.tensor([358.0, -250.0])  # outlier channels, slowly varying over tokens
    q[:, :, [3, 67]] *= 8
    v = torch.randn(tokens, 2, 128, generator=gen) / 10
    return q, k, v


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention in float64 over the given keys and values: [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("per_head", [False, True])
def test_attention_over_an_fp8_cache_is_attention_over_rounded_keys_and_values(dtype, per_head):
    """At Qwen2.5-1.5B's attention shape (128-wide heads, 12 query heads over 2 KV heads, an outlier key
    channel of 358): the prefill (its own keys read as the cache holds them) and the decode of the last
    token equal float64 attention over K and V rounded to fp8 (x / scale, saturated, times scale). So
    the agreement and perplexity lost on the real model (BENCHMARKS.md) are the format's rounding, not
    a fault of the indexing, the scales' direction or the read-back."""
    n, bs = 21, 16
    q, k, v = qwen_like_kv(n)
    if per_head:
        scales = KVScales(dtype, torch.tensor([0.8, 1.5]), torch.tensor([0.01, 0.002]))
    else:
        scales = KVScales.ones(dtype, 2, CPU)
    cache = KVLayout(1, 2, 128).allocate(3, bs, dtype, CPU, [scales])
    slots = torch.arange(n) + bs  # blocks 1 and 2
    cache.store(0, slots, k, v)
    scale = 128 ** -0.5
    want = attention_reference(q, rounded(k, scales.key, dtype), rounded(v, scales.value, dtype), scale)
    # The unrounded keys give visibly different attention: the check below could tell them apart.
    assert (attention_reference(q, k, v, scale) - want).abs().max() > 1e-2
    table = torch.tensor([[1, 2]])
    prefill = AttentionMetadata(is_prefill=True, slots=slots, prefill_lens=[n], block_tables=table)
    got = TorchAttention().prefill(q, k, v, cache.keys[0], cache.values[0], prefill, scale, None, kv_scales=scales)
    assert (got.double() - want).abs().max() < 1e-4
    decode = AttentionMetadata(is_prefill=False, slots=slots[-1:], block_tables=table,
                               seq_lens=torch.tensor([n]), max_seq_len=n)
    got = TorchAttention().decode(q[-1:], cache.keys[0], cache.values[0], decode, scale, None, kv_scales=scales)
    assert (got.double() - want[-1:]).abs().max() < 1e-4


# -- the Triton kernels against the torch path, on the same fp8 cache ---------------------------------------
triton = pytest.importorskip("triton")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def filled_cache(dtype, model_dtype, lens, kv_heads=2, dim=32, bs=4, seed=0):
    """An fp8 cache with per-head scales, sequences of `lens` scattered over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [(n + bs - 1) // bs for n in lens]
    order = torch.randperm(sum(per_seq) + 2, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    at = 0
    for b, count in enumerate(per_seq):
        tables[b, :count] = torch.tensor(order[at:at + count])
        at += count
    scales = KVScales(dtype, torch.tensor([0.02, 0.3])[:kv_heads].contiguous(),
                      torch.tensor([0.05, 0.01])[:kv_heads].contiguous())
    cache = KVLayout(1, kv_heads, dim).allocate(sum(per_seq) + 2, bs, dtype, CPU, [scales])
    for b, n in enumerate(lens):
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(n)])
        cache.store(0, slots, (torch.randn(n, kv_heads, dim, generator=gen) * 4).to(model_dtype),
                    (torch.randn(n, kv_heads, dim, generator=gen) / 20).to(model_dtype))
    return cache, tables


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap,splits", [(None, None, 1), (None, None, 3), (6, None, 2), (None, 5.0, 1)])
def test_triton_decode_equals_torch_on_fp8(interpret, dtype, model_dtype, window, softcap, splits):
    from text_generation_server.kernels import paged_attention as pa

    lens = [13, 27, 1]
    cache, tables = filled_cache(dtype, model_dtype, lens)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(5)).to(model_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=False, slots=torch.zeros(3, dtype=torch.long), block_tables=tables.long(),
                             seq_lens=seq_lens.long(), max_seq_len=max(lens))
    scales = cache.scales_of(0)
    want = TorchAttention().decode(q, cache.keys[0], cache.values[0], meta, 0.25, window, softcap,
                                   kv_scales=scales)
    got = pa.paged_decode(q, cache.keys[0], cache.values[0], tables, seq_lens, 0.25, window, num_splits=splits,
                          softcap=softcap, kv_scales=scales)
    assert (got.float() - want.float()).abs().max() <= TOL[model_dtype] * want.float().abs().max()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 5.0)])
def test_triton_prefill_equals_torch_on_fp8(interpret, dtype, model_dtype, window, softcap):
    """Over a cached prefix and without one: the torch path reads its new tokens as the cache holds
    them, so both see the same numbers."""
    from text_generation_server.kernels import paged_attention as pa

    cache_lens, q_lens = [0, 9, 16], [11, 6, 1]
    lens = [c + n for c, n in zip(cache_lens, q_lens)]
    cache, tables = filled_cache(dtype, model_dtype, lens, seed=3)
    gen = torch.Generator().manual_seed(9)
    tokens = sum(q_lens)
    q = torch.randn(tokens, 4, 32, generator=gen).to(model_dtype)
    # The new tokens' K/V as the layer passes them (their stored copy is in the cache already).
    k = torch.empty(tokens, 2, 32, dtype=model_dtype)
    v = torch.empty_like(k)
    at = 0
    for b, (c, n) in enumerate(zip(cache_lens, q_lens)):
        slots = torch.tensor([int(tables[b, p // 4]) * 4 + p % 4 for p in range(c, c + n)])
        s = cache.scales_of(0)
        k[at:at + n] = s.dequantize(cache.keys[0].view(-1, 2, 32)[slots], "key", model_dtype)
        v[at:at + n] = s.dequantize(cache.values[0].view(-1, 2, 32)[slots], "value", model_dtype)
        at += n
    meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(tokens, dtype=torch.long), prefill_lens=q_lens,
                             cache_lens=cache_lens, block_tables=tables.long())
    want = TorchAttention().prefill(q, k, v, cache.keys[0], cache.values[0], meta, 0.25, window, softcap,
                                    kv_scales=cache.scales_of(0))
    cu = torch.tensor([0, 11, 17, 18], dtype=torch.int32)
    got = pa.paged_prefill(q, cache.keys[0], cache.values[0], cu, torch.tensor(lens, dtype=torch.int32), tables,
                           0.25, window, max_q_len=max(q_lens), softcap=softcap, kv_scales=cache.scales_of(0))
    assert (got.float() - want.float()).abs().max() <= TOL[model_dtype] * want.float().abs().max()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_equals_torch_on_fp8(interpret, dtype, model_dtype):
    from text_generation_server.kernels.mla_decode import mla_decode
    from text_generation_server.layers.attention import padded_latent_decode

    gen = torch.Generator().manual_seed(1)
    width, rank, bs = 40, 32, 4
    scale = torch.tensor([0.05])
    cache = KVLayout(1, 1, width, latent=True).allocate(12, bs, dtype, CPU, [KVScales(dtype, scale, scale)])
    lens = [9, 22]
    tables = torch.tensor([[5, 2, 11, 0, 0, 0], [1, 3, 4, 6, 7, 8]], dtype=torch.int32)
    for b, n in enumerate(lens):
        slots = torch.tensor([int(tables[b, p // bs]) * bs + p % bs for p in range(n)])
        cache.store_latent(0, slots, (torch.randn(n, width, generator=gen) * 3).to(model_dtype))
    q = torch.randn(2, 5, width, generator=gen).to(model_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=False, slots=torch.zeros(2, dtype=torch.long), block_tables=tables.long(),
                             seq_lens=seq_lens.long(), max_seq_len=max(lens))
    want = padded_latent_decode(q, cache.keys[0], meta, 0.2, rank, cache.scales_of(0))
    got = mla_decode(q, cache.keys[0], tables, seq_lens, 0.2, rank, kv_scales=cache.scales_of(0))
    assert (got.float() - want.float()).abs().max() <= TOL[model_dtype] * want.float().abs().max()


def test_kernels_refuse_an_fp8_cache_without_its_scales(interpret):
    from text_generation_server.kernels import paged_attention as pa

    cache, tables = filled_cache(torch.float8_e4m3fn, torch.float32, [5])
    q = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="needs kv_scales"):
        pa.paged_decode(q, cache.keys[0], cache.values[0], tables, torch.tensor([5], dtype=torch.int32), 0.25)
    wrong = KVScales(torch.float8_e4m3fn, torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="kv_scales.key must be contiguous float32 \\[2\\]"):
        pa.paged_decode(q, cache.keys[0], cache.values[0], tables, torch.tensor([5], dtype=torch.int32), 0.25,
                        kv_scales=wrong)


@pytest.mark.parametrize("dtype", FP8)
def test_triton_kernels_at_qwens_shape_are_attention_over_rounded_keys_and_values(interpret, dtype):
    """The same check as the torch path's above, for the paged decode and prefill kernels: 128-wide
    heads, 6 query heads per KV head, per-head scales, an outlier key channel, 21 tokens over 2 blocks."""
    from text_generation_server.kernels import paged_attention as pa

    n, bs, scale = 21, 16, 128 ** -0.5
    q, k, v = qwen_like_kv(n, seed=1)
    scales = KVScales(dtype, torch.tensor([0.8, 1.5]), torch.tensor([0.01, 0.002]))
    cache = KVLayout(1, 2, 128).allocate(3, bs, dtype, CPU, [scales])
    cache.store(0, torch.arange(n) + bs, k, v)
    want = attention_reference(q, rounded(k, scales.key, dtype), rounded(v, scales.value, dtype), scale)
    table, seq_lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    got = pa.paged_decode(q[-1:], cache.keys[0], cache.values[0], table, seq_lens, scale, kv_scales=scales)
    assert (got.double() - want[-1:]).abs().max() < 1e-4
    got = pa.paged_prefill(q, cache.keys[0], cache.values[0], torch.tensor([0, n], dtype=torch.int32), seq_lens,
                           table, scale, max_q_len=n, kv_scales=scales)
    assert (got.double() - want).abs().max() < 1e-4


# -- every family serves with the flag ---------------------------------------------------------------------
# Logits of an fp8 cache against the bfloat16 cache's, same bfloat16 model, over every prefill and
# decode position: the relative L2 error ||fp8 - bf16|| / ||bf16|| is at most FAMILY_BOUND. On these
# random tiny models (weights widened past a real model's) measured worst cases were 0.085 (e4m3)
# and 0.19 (e5m2) for dense families; mixture-of-experts families reach 0.23 / 0.31, since a small
# change flips a token's experts (there even a bfloat16 model against a float32 one differs by up to
# 0.23). A real model's agreement is the opt-in check (test_kv_cache_fp8_real.py).
FAMILY_BOUND = {"fp8_e4m3fn": 0.1, "fp8_e5m2": 0.2}
MOE_BOUND = {"fp8_e4m3fn": 0.3, "fp8_e5m2": 0.4}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3",
       "deepseek_v3_no_q_lora"}
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"
DECODE_STEPS = 4
BS = 4


@torch.inference_mode()
def logits_trace(lm, ids: list[int]) -> torch.Tensor:
    """[positions, vocab]: a prefill of all but the last DECODE_STEPS ids, then one decode step each."""
    cache = lm.new_kv_cache(len(ids) // BS + 2, BS)
    table = torch.arange(cache.num_blocks, dtype=torch.long).unsqueeze(0)
    first = len(ids) - DECODE_STEPS
    meta = AttentionMetadata(is_prefill=True, slots=torch.arange(first), prefill_lens=[first], block_tables=table)
    rows = [lm.model(torch.tensor(ids[:first]), torch.arange(first), cache, meta)]
    for pos in range(first, len(ids)):
        meta = AttentionMetadata(is_prefill=False, slots=torch.tensor([pos]), block_tables=table,
                                 seq_lens=torch.tensor([pos + 1]), max_seq_len=pos + 1)
        rows.append(lm.model(torch.tensor([ids[pos]]), torch.tensor([pos]), cache, meta))
    return torch.cat(rows).float()


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8_families")
    out = {}
    for seed, name in enumerate(CASES):
        write_family_checkpoint(root / name, name, seed=100 + seed)
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_family_serves_with_an_fp8_cache(family_folders, name):
    folder = family_folders[name]
    base = get_model(folder, dtype="bfloat16", block_size=BS)
    ids = base.tokenizer.encode(PROMPT).ids
    want = logits_trace(base, ids)
    for flag, bound in (MOE_BOUND if name in MOE else FAMILY_BOUND).items():
        lm = get_model(folder, dtype="bfloat16", block_size=BS, kv_cache_dtype=flag)
        assert lm.kv_dtype == FP8_KV_DTYPES[flag] and lm.kv_bytes_per_token * 2 == base.kv_bytes_per_token
        got = logits_trace(lm, ids)
        error = float((got - want).norm() / want.norm())
        assert 0 < error <= bound, f"{name} {flag}: relative L2 error of the logits {error:.3f} > {bound}"
    # Served end to end: prefill and decode steps through the engine on the fp8 cache.
    lm.allocate_kv_cache(64)
    out = run_to_end(lm, lm.make_batch(0, [ids_request(0, ids, 6)]))
    assert len(out[0]["ids"]) == 6


# -- checkpoints: what they declare, the scales they ship ----------------------------------------------------
CT_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
K_SCALES, V_SCALES = [0.5, 0.125], [0.25, 2.0]  # layer 0, layer 1


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from helpers import write_checkpoint

    path = tmp_path_factory.mktemp("fp8_llama") / "llama"
    write_checkpoint(path, "llama", seed=7)  # 2 layers, 4 heads, 2 KV heads
    return path


def calibrated(llama: Path, folder: Path, scheme: dict | None = None, names=("k_scale", "v_scale"),
               per_head: bool = False, quantization: dict | None = None, hf_quant: dict | None = None) -> str:
    """`llama` with k/v scales under `names` and a declaration: compressed-tensors' kv_cache_scheme
    (`scheme`), or `quantization` as config.json's quantization_config, or `hf_quant` as
    hf_quant_config.json (ModelOpt)."""
    import shutil

    shutil.copytree(llama, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    for layer in range(2):
        k = torch.tensor([K_SCALES[layer], K_SCALES[layer] * 3]) if per_head else torch.tensor(K_SCALES[layer])
        v = torch.tensor([V_SCALES[layer], V_SCALES[layer] * 3]) if per_head else torch.tensor(V_SCALES[layer])
        tensors[f"model.layers.{layer}.self_attn.{names[0]}"] = k
        tensors[f"model.layers.{layer}.self_attn.{names[1]}"] = v
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if scheme is not None:
        quantization = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
                        "quantization_status": "compressed", "kv_cache_scheme": scheme}
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return str(folder)


def test_compressed_tensors_scales_are_read_per_layer(llama, tmp_path):
    folder = calibrated(llama, tmp_path / "ct", CT_SCHEME)
    lm = get_model(folder, dtype="float32", block_size=BS)  # auto: the checkpoint's declaration
    assert lm.kv_dtype == torch.float8_e4m3fn and lm.kv_bytes_per_token * 4 == \
        get_model(str(llama), dtype="float32").kv_bytes_per_token
    for layer in range(2):
        assert lm.kv_scales[layer].key.tolist() == [K_SCALES[layer]] * 2  # one per layer, for both KV heads
        assert lm.kv_scales[layer].value.tolist() == [V_SCALES[layer]] * 2
        assert not lm.kv_scales[layer].unit
    assert get_model(folder, dtype="float32", kv_cache_dtype="fp8_e4m3fn").kv_dtype == torch.float8_e4m3fn
    # Calibrated scales are used: the cache holds x / scale.
    base = get_model(str(llama), dtype="float32", block_size=BS)
    ids = base.tokenizer.encode(PROMPT).ids
    want, got = logits_trace(base, ids), logits_trace(lm, ids)
    assert float((got - want).norm() / want.norm()) <= FAMILY_BOUND["fp8_e4m3fn"]


def test_per_head_scales_are_cut_to_the_ranks_heads(llama, tmp_path):
    from text_generation_server.quantizers.dist import single_process_group
    from text_generation_server.quantizers.kv_cache import load_kv_scales
    from text_generation_server.quantizers.sources import safetensors_files
    from text_generation_server.quantizers.weights import Weights

    folder = calibrated(llama, tmp_path / "heads", dict(CT_SCHEME, strategy="attn_head"), per_head=True)
    lm = get_model(folder, dtype="float32")
    assert lm.kv_scales[1].key.tolist() == [K_SCALES[1], K_SCALES[1] * 3]
    declaration = read_kv_cache_declaration(folder)
    assert declaration.per_head
    weights = Weights(safetensors_files(Path(folder)), CPU, torch.float32, single_process_group())
    # Rank 1 of 2 holds KV head 1; with 4 ranks over 2 KV heads, ranks 2 and 3 replicate head 1.
    key, value = load_kv_scales(weights, declaration, "model.layers.0.self_attn", 2, [1])
    assert key.tolist() == [K_SCALES[0] * 3] and value.tolist() == [V_SCALES[0] * 3]
    attn = lm.model.layers[0].self_attn
    assert (attn.kv_prefix, attn.kv_heads_total, attn.kv_head_ids) == ("model.layers.0.self_attn", 2, (0, 1))
    # A per-layer declaration with per-head tensors is a contradiction, named.
    folder = calibrated(llama, tmp_path / "mismatch", CT_SCHEME, per_head=True)
    with pytest.raises(CheckpointError, match=r"self_attn.k_scale' has 2 values, expected 1 \(one per layer\)"):
        get_model(folder, dtype="float32")


def test_older_and_modelopt_scale_names(llama, tmp_path):
    folder = calibrated(llama, tmp_path / "older", CT_SCHEME, names=("k_proj.output_scale", "v_proj.output_scale"))
    assert get_model(folder, dtype="float32").kv_scales[0].key.tolist() == [K_SCALES[0]] * 2
    folder = calibrated(llama, tmp_path / "modelopt", names=("k_proj.k_scale", "v_proj.v_scale"),
                        hf_quant={"producer": {"name": "modelopt"},
                                  "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}})
    lm = get_model(folder, dtype="float32")
    assert lm.kv_dtype == torch.float8_e4m3fn and lm.kv_scales[1].value.tolist() == [V_SCALES[1]] * 2


def test_missing_scales_are_named(llama, tmp_path):
    folder = calibrated(llama, tmp_path / "missing", CT_SCHEME, names=("k_cache_scale", "v_cache_scale"))
    with pytest.raises(CheckpointError, match="no scales for 'model.layers.0.self_attn' \\(looked for "
                                              "model.layers.0.self_attn.k_scale and"):
        get_model(folder, dtype="float32")


def test_a_flag_contradicting_the_checkpoint_is_refused_naming_both(llama, tmp_path):
    folder = calibrated(llama, tmp_path / "ct", CT_SCHEME)
    with pytest.raises(CheckpointError) as info:
        get_model(folder, dtype="float32", kv_cache_dtype="fp8_e5m2")
    message = str(info.value)
    assert "--kv-cache-dtype fp8_e5m2 contradicts the checkpoint" in message
    assert "declares a fp8_e4m3fn KV cache" in message and "kv_cache_scheme" in message


@pytest.mark.parametrize("declaration, named", [
    (dict(scheme=dict(CT_SCHEME, type="int")), "type 'int' with num_bits 8 is not an fp8 KV cache"),
    (dict(scheme=dict(CT_SCHEME, dynamic=True)), "dynamic KV scales are not supported"),
    (dict(scheme=dict(CT_SCHEME, strategy="channel")), "strategy 'channel' is not supported"),
    (dict(scheme=dict(CT_SCHEME, symmetric=False)), "asymmetric"),
    (dict(hf_quant={"quantization": {"kv_cache_quant_algo": "NVFP4"}}), "kv_cache_quant_algo 'NVFP4' is not"),
    (dict(quantization={"quant_method": "quark", "kv_cache_group": ["*k_proj", "*v_proj"]}),
     "quantization_config.kv_cache_group: kv_cache_group = \\['\\*k_proj', '\\*v_proj'\\] declares a KV cache"),
])
def test_other_kv_declarations_are_refused_by_name(llama, tmp_path, declaration, named):
    folder = calibrated(llama, tmp_path / "other", **declaration)
    with pytest.raises(CheckpointError, match=named):
        get_model(folder, dtype="float32")


def test_no_declaration_means_the_models_dtype_or_fp8_at_scale_one(llama):
    declaration = read_kv_cache_declaration(llama)
    assert declaration is None
    assert resolve_kv_cache_dtype("auto", None, torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype(None, None, torch.float32) == torch.float32
    lm = get_model(str(llama), dtype="float32", kv_cache_dtype="fp8_e5m2")
    assert lm.kv_dtype == torch.float8_e5m2 and all(s.unit for s in lm.kv_scales)
    assert lm.kv_scales[0].key.tolist() == [1.0, 1.0]


# -- warmup: the same memory holds 2x (4x) the tokens ---------------------------------------------------------
@pytest.mark.parametrize("model_dtype, factor", [("bfloat16", 2), ("float32", 4)])
def test_the_same_memory_holds_more_tokens(llama, monkeypatch, interpret, model_dtype, factor):
    """Warmup's answer is Info.max_batch_total_tokens (the router takes the ranks' minimum). On the
    Triton backend (CUDA's default; here interpreted) decode needs no gathered copy, so the KV
    budget is the same and an fp8 cache gets exactly `factor` times the blocks."""
    from test_warmup_memory import Events, warmup_requests

    from text_generation_server.engine.memory import MemoryReading

    blocks, supported = {}, {}
    lm16 = get_model(str(llama), dtype=model_dtype, block_size=BS, attention_backend="triton-paged", max_batch_size=2)
    reading = MemoryReading("cuda", 256 * 2**20 + 300 * lm16.kv_bytes_per_block, 8 * 2**30)
    for flag in ("auto", "fp8_e4m3fn"):
        lm = lm16 if flag == "auto" else get_model(str(llama), dtype=model_dtype, block_size=BS,
                                                   attention_backend="triton-paged", max_batch_size=2,
                                                   kv_cache_dtype=flag)
        Events(lm, monkeypatch, reading)
        supported[flag] = lm.warmup(warmup_requests(12, 12), 12, 12, 32, 1.0)
        blocks[flag] = lm.kv_cache.num_blocks
    assert blocks == {"auto": 300, "fp8_e4m3fn": 300 * factor}
    assert supported == {"auto": 299 * BS, "fp8_e4m3fn": (300 * factor - 1) * BS}


# -- CUDA graphs still capture ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["fp8_e4m3fn", "fp8_e5m2"])
def test_decode_graphs_replay_on_an_fp8_cache(llama, monkeypatch, interpret, flag):
    """Through the capture emulator (which fails a replay that syncs or issues other operators):
    triton-paged decode graphs over an fp8 cache give the eager path's tokens and logprobs."""
    from test_cuda_graphs import EagerReplayCapturer, Recorder, assert_same, load, request

    monkeypatch.setenv("TGS_ATTENTION_BACKEND", "triton-paged")

    def scenario(lm):
        rec = Recorder(lm)
        rec.steps(lm.make_batch(0, [request(0, 6, 3), request(1, 3, 3, seed=2), request(2, 17, 3)]), 3)
        return rec.out

    eager = scenario(load(str(llama), backend=None, kv_cache_dtype=flag))
    lm = load(str(llama), buckets=[4], capturer=EagerReplayCapturer(), backend=None, kv_cache_dtype=flag)
    assert lm.attention.name == "triton-paged" and lm.kv_cache.dtype == FP8_KV_DTYPES[flag]
    assert_same(scenario(lm), eager)
    assert lm.graphs.stats.replays == {4: 2}


def test_the_transformers_fallback_serves_an_fp8_cache_but_not_calibrated_scales(llama, tmp_path):
    """transformers' modeling code over our cache quantizes and reads it like the native layers;
    a checkpoint's calibrated scales are not mapped onto its modules, so they are refused by name."""
    base = get_model(str(llama), dtype="bfloat16", block_size=BS, model_impl="transformers")
    lm = get_model(str(llama), dtype="bfloat16", block_size=BS, model_impl="transformers", kv_cache_dtype="fp8")
    assert lm.model_impl == "transformers" and lm.kv_dtype == torch.float8_e4m3fn
    ids = base.tokenizer.encode(PROMPT).ids
    want, got = logits_trace(base, ids), logits_trace(lm, ids)
    assert 0 < float((got - want).norm() / want.norm()) <= FAMILY_BOUND["fp8_e4m3fn"]
    folder = calibrated(llama, tmp_path / "ct", CT_SCHEME)
    with pytest.raises(CheckpointError, match="does not read them"):
        get_model(folder, dtype="float32", model_impl="transformers")


def test_get_model_takes_the_flags_spellings():
    assert resolve_kv_cache_dtype("fp8", None, torch.bfloat16) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("FP8_E4M3", None, torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8_e4m3fn, fp8_e5m2"):
        resolve_kv_cache_dtype("int8", None, torch.bfloat16)


# -- prefix caching and chunked prefill are unchanged ----------------------------------------------------------
@pytest.mark.parametrize("flag", ["fp8_e4m3fn", "fp8_e5m2"])
def test_chunks_and_a_cached_prefix_give_the_whole_prefills_tokens(llama, tmp_path, flag):
    """A prompt's own keys are read as the cache holds them, so the tokens do not depend on how the
    prompt was split: whole, in chunks of 3, or after 2 or 5 blocks another request computed."""
    folder = calibrated(llama, tmp_path / "ct", dict(CT_SCHEME, strategy="attn_head"), per_head=True) \
        if flag == "fp8_e4m3fn" else str(llama)
    lm = get_model(folder, dtype="float32", block_size=BS, kv_cache_dtype=flag)
    lm.allocate_kv_cache(256)
    ids = lm.tokenizer.encode(PROMPT).ids  # 26 tokens
    want = run_to_end(lm, lm.make_batch(0, [ids_request(0, ids, 12)]))[0]["ids"]
    lm.max_prefill_tokens = 5
    chunked = run_to_end(lm, lm.make_batch(1, [ids_request(1, ids, 12, chunk_len=3)]))[1]["ids"]
    assert chunked == want
    lm.max_prefill_tokens = None
    blocks = lm.allocator.allocate(lm.blocks_for(len(ids) + 12))
    run_to_end(lm, lm.make_batch(2, [ids_request(2, ids[:20] + [7, 8, 9], 2, blocks=blocks)]))
    for cached_blocks in (2, 5):
        tail = lm.allocator.allocate(lm.blocks_for(len(ids) + 12) - cached_blocks)
        req = ids_request(3, ids, 12, blocks=blocks[:cached_blocks] + tail, cache_len=cached_blocks * BS)
        assert run_to_end(lm, lm.make_batch(3, [req]))[3]["ids"] == want
        lm.allocator.free(tail)


# -- tensor parallel: each rank its heads' scales --------------------------------------------------------------
def _fp8_rank(pg, folder: str) -> dict:
    lm = get_model(folder, dtype="float32", process_group=pg, block_size=BS)
    done = lm.generate([GenerationRequest(id=0, inputs=PROMPT, max_new_tokens=8, ignore_eos_token=True)])
    return {"tokens": list(done[0].token_ids), "key": [s.key.tolist() for s in lm.kv_scales],
            "value": [s.value.tolist() for s in lm.kv_scales]}


def test_two_ranks_keep_their_heads_scales_and_give_one_process_tokens(llama, tmp_path):
    from helpers import run_ranks

    folder = calibrated(llama, tmp_path / "heads", dict(CT_SCHEME, strategy="attn_head"), per_head=True)
    (tmp_path / "ranks").mkdir()
    ranks = run_ranks(_fp8_rank, (folder,), 2, tmp_path / "ranks", 300)
    one = get_model(folder, dtype="float32", block_size=BS)
    want = one.generate([GenerationRequest(id=0, inputs=PROMPT, max_new_tokens=8, ignore_eos_token=True)])
    for rank, got in enumerate(ranks):
        assert got["key"] == [[K_SCALES[layer] * (3 if rank else 1)] for layer in range(2)]
        assert got["value"] == [[V_SCALES[layer] * (3 if rank else 1)] for layer in range(2)]
        assert got["tokens"] == list(want[0].token_ids)


@pytest.mark.parametrize("cap,dtype,fp8", [(80, torch.bfloat16, 1), (90, torch.float16, 2), (90, torch.bfloat16, 0)])
def test_mla_decode_compiles_for_sm80_and_sm90_on_fp8(monkeypatch, cap, dtype, fp8):
    """The fp8 bytes are widened with integer operations: no fp8 instruction, so sm80 compiles it."""
    from test_paged_attention import _compile

    from text_generation_server.kernels import mla_decode as mla

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = mla._kernels()
    d = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    strides = ["stride_qb", "stride_qh", "stride_cb", "stride_ct", "stride_bt", "stride_ob", "stride_oh"]
    ptrs = {"q_ptr": d, "c_ptr": "*u8" if fp8 else d, "bt_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": d,
            "s_ptr": "*fp32"}
    sig = {**ptrs, "qk_scale": "fp32", **{a: "i32" for a in ["heads_total", "max_blocks"] + strides}}
    block_n, warps, stages = mla._config(512, dtype)
    const = dict(HB=16, R=512, RP=512, P=64, PP=64, BS=64, BLOCK_N=block_n, DOT_F32=False, FP8=fp8)
    compiled = _compile(kernels.decode, cap, sig, const, list(ptrs) + strides, num_warps=warps, num_stages=stages)
    assert compiled.asm["cubin"] and compiled.metadata.shared <= 99 * 1024
