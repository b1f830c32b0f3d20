"""Per-layer KV cache dtypes: an fp8 cache that keeps the layers fp8 cannot hold in the model's dtype.

- a mixed cache's write-then-read is fp8 rounding in its fp8 layers and exact in the others;
- every attention path reads each layer in its own dtype: a model whose fp8 cache keeps every
  layer unquantized gives its 16-bit cache's logits bit for bit (torch and triton-paged under
  TRITON_INTERPRET=1, per-head and MLA latent caches), a mixed cache's Triton logits equal its
  torch logits, and emulated CUDA graphs replay over a mixed cache;
- the layer rule (`--kv-cache-fp8-skip-layers auto`) picks the layer of a tiny Qwen2 given a
  near-constant outlier key channel (Qwen2.5's layers 0-1 in small), and no layer of the same
  model without it;
- warmup sizes the cache in bytes, each layer at its own width: blocks stay one count, a block
  costs the sum of its layers' bytes, and Info's token count says so exactly;
- the flag's spellings, its environment variable, `perplexity`'s flag and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_kv_cache_fp8 import BS, PROMPT, logits_trace, rounded
from test_serve_flags import ok, serve  # noqa: F401 (the serve fixture)

from text_generation_server.kernels.kv_fp8 import FP8_KV_DTYPES, KVScales
from text_generation_server.layers.attention import KVLayout
from text_generation_server.models import kv_cache
from text_generation_server.models.loader import get_model
from text_generation_server.settings.serve_args import parse_kv_skip_layers

torch.set_num_threads(1)
CPU = torch.device("cpu")
FP8 = list(FP8_KV_DTYPES.values())


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# -- a mixed cache: each layer in its own dtype -------------------------------------------------------------
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("latent", [False, True])
def test_a_mixed_cache_is_rounding_in_its_fp8_layers_and_exact_in_the_others(dtype, latent):
    heads = 1 if latent else 2
    scales = KVScales(dtype, torch.tensor([0.5, 2.0])[:heads].contiguous(), torch.tensor([0.25, 1.0])[:heads].contiguous())
    per_layer = [scales, None, scales, None]
    layout = KVLayout(4, heads, 16, latent=latent)
    cache = layout.allocate(3, 4, dtype, CPU, per_layer, wide=torch.bfloat16)
    assert cache.dtypes == [dtype, torch.bfloat16, dtype, torch.bfloat16]
    assert [t.dtype for t in cache.keys] == cache.dtypes
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([5, 0, 11])
    for layer, s in enumerate(per_layer):
        k = (torch.randn(3, heads, 16, generator=gen) * 40).to(torch.bfloat16)
        v = (torch.randn(3, heads, 16, generator=gen) / 3).to(torch.bfloat16)
        if latent:
            cache.store_latent(layer, slots, k[:, 0])
        else:
            cache.store(layer, slots, k, v)
        assert cache.scales_of(layer) is s
        pools = [(cache.keys[layer], k, "key")] + ([] if latent else [(cache.values[layer], v, "value")])
        for pool, x, which in pools:
            got = pool.view(-1, heads, 16).index_select(0, slots)
            if s is None:
                assert torch.equal(got, x)
            else:
                want = rounded(x.float(), s.key if which == "key" else s.value, dtype)
                assert torch.equal(s.dequantize(got, which, torch.float32), want)


def test_a_mixed_cache_costs_the_sum_of_its_layers_bytes():
    layout = KVLayout(5, 2, 16)
    ones = KVScales.ones(torch.float8_e4m3fn, 2, CPU)
    mixed = [None, ones, ones, None, ones]
    assert layout.bytes_per_token(torch.float8_e4m3fn, mixed, torch.bfloat16) == 2 * 2 * 16 * (3 * 1 + 2 * 2)
    assert layout.bytes_per_token(torch.float8_e4m3fn, mixed, torch.float32) == 2 * 2 * 16 * (3 * 1 + 2 * 4)
    assert layout.bytes_per_block(16, torch.float8_e4m3fn, mixed, torch.bfloat16) == 16 * 2 * 2 * 16 * 7
    assert layout.bytes_per_token(torch.float8_e4m3fn) == 2 * 2 * 16 * 5
    cache = layout.allocate(3, 16, torch.float8_e4m3fn, CPU, mixed, wide=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
    assert held == 3 * layout.bytes_per_block(16, torch.float8_e4m3fn, mixed, torch.bfloat16)
    assert "layers 0,3 in bfloat16" in layout.describe_dtypes(torch.float8_e4m3fn, mixed, torch.bfloat16)
    with pytest.raises(ValueError, match="wide"):
        layout.allocate(3, 16, torch.float8_e4m3fn, CPU, mixed)
    with pytest.raises(ValueError, match="cannot be fp8"):
        layout.allocate(3, 16, torch.float8_e4m3fn, CPU, mixed, wide=torch.float8_e5m2)


# -- every attention path reads each layer's own dtype ---------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from helpers import write_checkpoint

    path = tmp_path_factory.mktemp("fp8_layers") / "llama"
    write_checkpoint(path, "llama", seed=7, num_hidden_layers=3)
    return str(path)


def load(folder, backend=None, dtype="bfloat16", **kw):
    return get_model(folder, dtype=dtype, block_size=BS, attention_backend=backend, **kw)


@pytest.mark.parametrize("backend", [None, "triton-paged"])
def test_an_fp8_cache_keeping_every_layer_is_the_16_bit_cache(llama, interpret, backend):
    base = load(llama, backend)
    assert base.attention.name == (backend or "torch-sdpa")
    ids = base.tokenizer.encode(PROMPT).ids
    want = logits_trace(base, ids)
    every = load(llama, backend, kv_cache_dtype="fp8_e4m3fn", kv_cache_fp8_skip_layers="0-2")
    assert every.kv_scales == [None, None, None] and every.kv_bytes_per_token == base.kv_bytes_per_token
    assert torch.equal(logits_trace(every, ids), want)
    mixed = load(llama, backend, kv_cache_dtype="fp8_e4m3fn", kv_cache_fp8_skip_layers="1")
    fp8 = load(llama, backend, kv_cache_dtype="fp8_e4m3fn", kv_cache_fp8_skip_layers="none")
    got_mixed, got_fp8 = logits_trace(mixed, ids), logits_trace(fp8, ids)
    assert not torch.equal(got_mixed, want) and not torch.equal(got_mixed, got_fp8)
    assert float((got_mixed - want).norm() / want.norm()) < 0.1


def test_a_mixed_cache_reads_the_same_through_triton_as_through_torch(llama, interpret):
    ids = load(llama).tokenizer.encode(PROMPT).ids
    for flag in FP8_KV_DTYPES:
        got = {backend: logits_trace(load(llama, backend, dtype="float32", kv_cache_dtype=flag,
                                          kv_cache_fp8_skip_layers="0,2"), ids)
               for backend in (None, "triton-paged")}
        assert torch.allclose(got["triton-paged"], got[None], atol=2e-4, rtol=1e-4), flag


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from family_cases import write_family_checkpoint

    folder = tmp_path_factory.mktemp("fp8_layers_mla") / "deepseek"
    write_family_checkpoint(folder, "deepseek_v2_lite", seed=3)
    return str(folder)


@pytest.mark.parametrize("backend", [None, "triton-paged"])
def test_mla_reads_each_layers_latent_in_its_own_dtype(deepseek, interpret, backend):
    """The latent cache: torch's absorbed decode, and triton-paged's MLA decode kernel (interpreted)."""
    base = load(deepseek, backend)
    assert base.attention.name == (backend or "torch-sdpa")
    ids = base.tokenizer.encode(PROMPT).ids
    want = logits_trace(base, ids)
    layers = base.kv_layout.num_layers
    every = load(deepseek, backend, kv_cache_dtype="fp8_e4m3fn", kv_cache_fp8_skip_layers=f"0-{layers - 1}")
    assert torch.equal(logits_trace(every, ids), want)
    mixed = load(deepseek, backend, kv_cache_dtype="fp8_e4m3fn", kv_cache_fp8_skip_layers="0")
    assert mixed.new_kv_cache(2).dtypes[:2] == [torch.bfloat16, torch.float8_e4m3fn]
    assert 0 < float((logits_trace(mixed, ids) - want).norm() / want.norm()) < 0.1


# -- the layer rule --------------------------------------------------------------------------------------------
OUTLIER_LAYER = 3


@pytest.fixture(scope="module")
def qwen_with_an_outlier(tmp_path_factory):
    """A 4-layer Qwen2 (q/k/v biases, rope_theta 1e6 as Qwen2.5) and its twin whose last layer has a key
    channel held near -354 by its bias: a slowly rotating dimension, so it stays nearly constant over the
    probe, as Qwen2.5's layers 0-1 do. Norm weights are 1 (as trained models' are, roughly), so the
    projections' token-dependent part is not drowned by the random biases."""
    from helpers import write_checkpoint

    root = tmp_path_factory.mktemp("fp8_rule")
    plain = root / "plain"
    write_checkpoint(plain, "qwen2_bias", seed=11, num_hidden_layers=4, rope_theta=1e6)
    tensors = load_file(plain / "model.safetensors")
    tensors = {k: torch.ones_like(t) if k.endswith("norm.weight") else t for k, t in tensors.items()}
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    outlier = root / "outlier"
    outlier.mkdir()
    for f in plain.iterdir():
        if f.name != "model.safetensors":
            (outlier / f.name).write_bytes(f.read_bytes())
    name = f"model.layers.{OUTLIER_LAYER}.self_attn.k_proj.bias"
    bias = tensors[name].clone()
    bias[3] = -354.0  # head 0, dimension 3 of 8: rotary's slowest frequency
    tensors[name] = bias
    save_file(tensors, outlier / "model.safetensors", metadata={"format": "pt"})
    return str(plain), str(outlier)


@pytest.mark.parametrize("flag", list(FP8_KV_DTYPES))
def test_the_rule_keeps_the_layer_with_an_outlier_channel(qwen_with_an_outlier, flag):
    plain, outlier = qwen_with_an_outlier
    lm = get_model(outlier, dtype="float32", kv_cache_dtype=flag)
    assert [i for i, s in enumerate(lm.kv_scales) if s is None] == [OUTLIER_LAYER]
    assert lm.new_kv_cache(2).dtypes[OUTLIER_LAYER] == torch.float32
    fp8 = FP8_KV_DTYPES[flag]
    assert lm.kv_bytes_per_token == 2 * 3 * 8 * (3 * fp8.itemsize + 4)
    lm = get_model(plain, dtype="float32", kv_cache_dtype=flag)
    assert all(s is not None for s in lm.kv_scales)


def test_the_rules_measure(qwen_with_an_outlier):
    """The ratios themselves (in units of e4m3's unit roundoff): the outlier layer far over the
    threshold, the others within a float's rounding."""
    from text_generation_server.quantizers.dist import single_process_group

    _, outlier = qwen_with_an_outlier
    lm = get_model(outlier, dtype="float32", kv_cache_dtype="fp8_e4m3fn", kv_cache_fp8_skip_layers="none")
    ids = lm.tokenizer.encode(kv_cache.PROBE_TEXT).ids[:kv_cache.PROBE_TOKENS]
    ratios = kv_cache.probe_ratios(lm.model, ids, lm.kv_layout, lm.kv_scales, torch.float32, CPU,
                                   single_process_group())
    assert ratios[OUTLIER_LAYER] > 3 * kv_cache.ROUNDING_THRESHOLD
    assert all(0 < r < 1 for i, r in enumerate(ratios) if i != OUTLIER_LAYER)  # within a unit roundoff


def test_the_ratio_is_the_rounding_against_the_token_dependent_part():
    scales = KVScales.ones(torch.float8_e4m3fn, 1, CPU)
    gen = torch.Generator().manual_seed(0)
    varying = torch.randn(64, 1, 32, generator=gen)
    assert 0.01 < kv_cache.rounding_ratio(varying, scales, "key") < 0.06
    # The same variation on top of a constant of 354: e4m3's step there (32) dwarfs it.
    assert kv_cache.rounding_ratio(varying + 354.0, scales, "key") > 1
    # A constant channel that fp8 holds exactly costs nothing, one it rounds costs everything.
    assert kv_cache.rounding_ratio(torch.full((8, 1, 4), 352.0), scales, "key") == 0
    assert kv_cache.rounding_ratio(torch.full((8, 1, 4), 354.0), scales, "key") == float("inf")


def test_a_list_or_none_overrides_the_rule(qwen_with_an_outlier):
    _, outlier = qwen_with_an_outlier
    lm = get_model(outlier, dtype="float32", kv_cache_dtype="fp8", kv_cache_fp8_skip_layers="none")
    assert all(s is not None for s in lm.kv_scales)
    lm = get_model(outlier, dtype="float32", kv_cache_dtype="fp8", kv_cache_fp8_skip_layers="0,3")
    assert [s is None for s in lm.kv_scales] == [True, False, False, True]


def test_refusals_name_what_is_wrong(qwen_with_an_outlier):
    _, outlier = qwen_with_an_outlier
    with pytest.raises(ValueError, match=r"layers \[4, 5\] do not exist \(this model has 4, 0-3\)"):
        get_model(outlier, dtype="float32", kv_cache_dtype="fp8", kv_cache_fp8_skip_layers="0,4-5")
    with pytest.raises(ValueError, match="names layers of an fp8 KV cache, but this cache is float32"):
        get_model(outlier, dtype="float32", kv_cache_fp8_skip_layers="1")
    lm = get_model(outlier, dtype="float32", kv_cache_fp8_skip_layers="none")  # auto/none: fine without fp8
    assert lm.kv_scales is None


# -- warmup: bytes, each layer at its own width ---------------------------------------------------------------
def test_warmup_sizes_a_mixed_cache_by_its_bytes(llama, monkeypatch, interpret):
    """At the same budget as a bfloat16 cache's 300 blocks, an e4m3 cache keeping 1 of 3 layers in
    bfloat16 costs (1 + 1 + 2) / (2 + 2 + 2) of a block: 450 blocks, and Info's tokens say so."""
    from test_warmup_memory import Events, warmup_requests

    from text_generation_server.engine.memory import MemoryReading

    lm16 = load(llama, "triton-paged", max_batch_size=2)
    reading = MemoryReading("cuda", 256 * 2**20 + 300 * lm16.kv_bytes_per_block, 8 * 2**30)
    found = {}
    for flag, skip in (("auto", "auto"), ("fp8_e4m3fn", "1"), ("fp8_e4m3fn", "none")):
        lm = lm16 if flag == "auto" else load(llama, "triton-paged", max_batch_size=2, kv_cache_dtype=flag,
                                              kv_cache_fp8_skip_layers=skip)
        Events(lm, monkeypatch, reading)
        supported = lm.warmup(warmup_requests(12, 12), 12, 12, 32, 1.0)
        found[skip] = (lm.kv_cache.num_blocks, supported)
        held = sum(t.numel() * t.element_size() for t in (*lm.kv_cache.keys, *lm.kv_cache.values))
        assert held == lm.kv_cache.num_blocks * lm.kv_bytes_per_block
    assert found == {"auto": (300, 299 * BS), "1": (450, 449 * BS), "none": (600, 599 * BS)}


# -- the flag -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given, expected", [
    ("auto", "auto"), ("NONE", "none"), ("1", "1"), ("1,0", "0-1"), (" 0, 1 ,2,5-7,9 ", "0-2,5-7,9"),
    ("3-3,3", "3"),
])
def test_the_flags_spellings(given, expected):
    assert parse_kv_skip_layers(given, "--kv-cache-fp8-skip-layers") == expected
    assert parse_kv_skip_layers(expected, "x") == expected  # the canonical form is a fixed point


def test_a_list_names_its_layers():
    assert kv_cache.layer_ids("0-2,5-7,9") == {0, 1, 2, 5, 6, 7, 9}


@pytest.mark.parametrize("given, named", [
    ("", "''"), ("all", "'all'"), ("1,,2", "''"), ("-1", "'-1'"), ("a-3", "'a-3'"), ("5-2", "runs backwards"),
    ("1.5", "'1.5'"),
])
def test_bad_values_are_refused_naming_them(given, named):
    with pytest.raises(ValueError, match="--kv-cache-fp8-skip-layers") as caught:
        parse_kv_skip_layers(given, "--kv-cache-fp8-skip-layers")
    assert named in str(caught.value)


def test_serve_takes_the_flag_and_its_variable(serve):  # noqa: F811
    assert ok(serve()).kv_cache_fp8_skip_layers == "auto"
    assert ok(serve("--kv-cache-fp8-skip-layers", "1,0")).kv_cache_fp8_skip_layers == "0-1"
    assert ok(serve(KV_CACHE_FP8_SKIP_LAYERS="none")).kv_cache_fp8_skip_layers == "none"
    run = serve("--kv-cache-fp8-skip-layers", "first")
    assert run.code == 2 and run.args is None and "'first'" in run.output


# -- CUDA graphs capture over a mixed cache ---------------------------------------------------------------------
def test_decode_graphs_replay_on_a_mixed_cache(llama, monkeypatch, interpret):
    """Through the capture emulator (a replay that syncs or issues other operators fails): triton-paged
    decode graphs over an e4m3 cache keeping layer 1 in float32 give the eager path's tokens."""
    from test_cuda_graphs import EagerReplayCapturer, Recorder, assert_same
    from test_cuda_graphs import load as load_graphs
    from test_cuda_graphs import request

    monkeypatch.setenv("TGS_ATTENTION_BACKEND", "triton-paged")
    kw = dict(backend=None, kv_cache_dtype="fp8_e4m3fn", kv_cache_fp8_skip_layers="1")

    def scenario(lm):
        rec = Recorder(lm)
        rec.steps(lm.make_batch(0, [request(0, 6, 3), request(1, 3, 3, seed=2), request(2, 17, 3)]), 3)
        return rec.out

    eager = scenario(load_graphs(llama, **kw))
    lm = load_graphs(llama, buckets=[4], capturer=EagerReplayCapturer(), **kw)
    assert lm.attention.name == "triton-paged" and lm.kv_cache.dtypes == [torch.float8_e4m3fn, torch.float32,
                                                                          torch.float8_e4m3fn]
    assert_same(scenario(lm), eager)
    assert lm.graphs.stats.replays == {4: 2}


def test_perplexity_takes_the_flag(qwen_with_an_outlier):
    from typer.testing import CliRunner

    from text_generation_server.cli import main as cli

    _, outlier = qwen_with_an_outlier
    run = CliRunner().invoke(cli.app, ["perplexity", outlier, "--kv-cache-dtype", "fp8", "--max-tokens", "40",
                                       "--kv-cache-fp8-skip-layers", "none", "--json"])
    assert run.exit_code == 0 and '"perplexity"' in run.output
    run = CliRunner().invoke(cli.app, ["perplexity", outlier, "--kv-cache-dtype", "fp8", "--max-tokens", "40",
                                       "--kv-cache-fp8-skip-layers", "7"])
    assert run.exit_code != 0 and "layers [7] do not exist" in run.output
