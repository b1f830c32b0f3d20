"""Multi-head latent attention (DeepSeek-V2/V3): the latent cache, absorbed decode, the Triton
decode kernel, and DeepSeek-V3's own FP8 checkpoints.

test_families.py holds the model-level proof for the tiny DeepSeek cases of family_cases.CASES
(greedy tokens equal transformers' at 1 and 2 ranks, with small prefill chunks and a prefix read
from the cache). Here:
- the cache holds one latent of kv_lora_rank + qk_rope_head_dim per token per layer, no values:
  bytes per token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype size, as the startup log,
  Info's trailing metadata and warmup report it; for the same memory warmup admits
  heads x (qk_head_dim + v_head_dim) / (kv_lora_rank + qk_rope_head_dim) times the tokens a
  per-head cache would (5x for the tiny model, 71x for DeepSeek-V3's published shape);
- at layer level, the absorbed decode (the query moved into latent space, W_UV after attention)
  equals attention over the per-head K/V expanded from the same latents;
- the Triton MLA decode kernel (TRITON_INTERPRET=1 on CPU) equals the torch reference on paged,
  shuffled blocks, heads not a multiple of its 16-head groups, widths not powers of two, padding
  rows; a whole model on the triton-paged backend decodes transformers' tokens;
- a DeepSeek-V3 FP8 checkpoint (block-scaled e4m3, weight_scale_inv) loads through the FP8
  loader: every linear and the absorbed kv_b_proj hold exactly the dequantized weights, and with
  the declared input rounding taken out it computes the dense model of those weights (tokens
  equal transformers' on the dequantized checkpoint).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from family_cases import write_family_checkpoint
from helpers import PROMPTS, ids_request, run_to_end, write_model_folder
from safetensors.torch import load_file

from text_generation_server.layers.attention import (
    AttentionMetadata,
    KVLayout,
    padded_latent_decode,
    sequence_attention,
)
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.models.families.deepseek import DeepseekFamily
from text_generation_server.engine.memory import MemoryReading

torch.set_num_threads(1)

MIB = 2**20
NEW_TOKENS = 12
BLOCK_SIZE = 4
# The tiny deepseek_v3 case: 2 layers, 4 heads, kv_lora_rank 16, rope 8, nope 12, v 10.
LAYERS, HEADS, RANK, ROPE, NOPE, V = 2, 4, 16, 8, 12, 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mla") / "deepseek_v3"
    write_family_checkpoint(path, "deepseek_v3", seed=11)
    return path


def hf_greedy(folder: Path | str, ids: list[int], new: int = NEW_TOKENS) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    return out[0, len(ids):].tolist()


def engine_greedy(lm, prompts: list[list[int]], new: int = NEW_TOKENS) -> list[list[int]]:
    lm.allocate_kv_cache(128)
    out = run_to_end(lm, lm.make_batch(0, [ids_request(i, ids, new) for i, ids in enumerate(prompts)]))
    return [out[i]["ids"] for i in range(len(prompts))]


# -- the latent cache: its size, reported and planned ------------------------------------------------
@pytest.mark.parametrize("dtype,size", [("float32", 4), ("bfloat16", 2)])
def test_kv_bytes_per_token_is_one_latent_per_layer(folder, dtype, size):
    lm = get_model(str(folder), dtype=dtype, block_size=BLOCK_SIZE)
    assert lm.kv_layout == KVLayout(LAYERS, 1, RANK + ROPE, latent=True)
    assert lm.kv_bytes_per_token == LAYERS * (RANK + ROPE) * size
    assert lm.kv_bytes_per_block == BLOCK_SIZE * lm.kv_bytes_per_token
    lm.allocate_kv_cache(8)
    assert all(k.shape == (8, BLOCK_SIZE, 1, RANK + ROPE) for k in lm.kv_cache.keys)
    assert lm.kv_cache.values == [None] * LAYERS  # no value pool
    assert sum(k.numel() * k.element_size() for k in lm.kv_cache.keys) == 8 * lm.kv_bytes_per_block


def test_startup_log_and_info_report_the_bytes_per_token(folder):
    from loguru import logger
    from text_generation_server.pb.generate.v3 import generate_pb2 as pb
    from text_generation_server.shard.service import KV_BYTES_METADATA, TextGenerationService

    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    try:
        lm = get_model(str(folder), dtype="float32", block_size=BLOCK_SIZE)
    finally:
        logger.remove(sink)
    want = LAYERS * (RANK + ROPE) * 4
    assert any(f"KV cache: {want} bytes per token ({LAYERS} layers x one latent of {RANK + ROPE}" in line
               for line in lines), lines

    class Context:
        metadata: tuple = ()

        def set_trailing_metadata(self, metadata):
            self.metadata = metadata

    context = Context()
    asyncio.run(TextGenerationService(lm, "/tmp/unused", 1, 0.1).Info(pb.InfoRequest(), context))
    assert dict(context.metadata)[KV_BYTES_METADATA] == str(want)


def test_the_same_memory_admits_that_many_times_the_tokens(folder, monkeypatch):
    """Warmup sizes the cache from the latent's bytes: with the memory a per-head cache (K of
    qk_head_dim and V of v_head_dim for every head) would turn into N tokens, it admits N x 5."""
    from text_generation_server.engine.causal_lm import CausalLM
    from text_generation_server.engine.types import GenerationRequest
    from text_generation_server.engine import memory

    lm = get_model(str(folder), dtype="float32", block_size=BLOCK_SIZE)
    per_head = LAYERS * HEADS * ((NOPE + ROPE) + V) * 4  # 960 bytes per token
    assert per_head / lm.kv_bytes_per_token == 5.0
    monkeypatch.setattr(memory, "read_memory", lambda device: MemoryReading("cpu", 64 * MIB, 1024 * MIB))
    requests = [GenerationRequest(id=0, inputs="", input_ids=list(range(1, 17)), max_new_tokens=1)]

    def admitted() -> int:
        return lm.warmup(requests, 16, 16, 64, 0.5)

    latent_tokens = admitted()
    assert latent_tokens == lm.kv_cache.num_blocks * BLOCK_SIZE - BLOCK_SIZE  # block 0 is the padding block
    # The same warmup, planning with per-head bytes (the layers still store latents).
    monkeypatch.setattr(CausalLM, "kv_bytes_per_block", property(lambda self: BLOCK_SIZE * per_head))
    per_head_tokens = admitted()
    assert latent_tokens / per_head_tokens == pytest.approx(5.0, rel=1e-3), (latent_tokens, per_head_tokens)


def test_deepseek_v3_published_shape_caches_71x_less():
    """DeepSeek-V3's config.json (the values that size attention): 576 numbers per token per layer
    against 128 heads x (192 + 128) = 40,960 per head; bfloat16 bytes per token over 61 layers."""
    raw = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
           "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
           "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
           "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
           "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
           "max_position_embeddings": 163840, "rope_theta": 10000,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}}
    config = DeepseekFamily().read_config(ConfigReader(raw, "config.json"))
    options = DeepseekFamily().mla_options(config)
    assert options.latent_dim == 576
    assert config.sparse_layers == frozenset(range(3, 61))
    assert config.max_context == 163840
    # qk_head_dim^-0.5 times mscale(40, mscale_all_dim=1)^2 (transformers' yarn_apply_mscale).
    assert config.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    layout = KVLayout(config.num_hidden_layers, 1, options.latent_dim, latent=True)
    per_head = config.num_hidden_layers * 128 * (192 + 128) * 2
    assert layout.bytes_per_token(torch.bfloat16) == 61 * 576 * 2 == 70272
    assert per_head / layout.bytes_per_token(torch.bfloat16) == pytest.approx(40960 / 576)  # 71.1x


# -- absorbed decode == expanded attention, at layer level --------------------------------------------
def _paged(seq_lens: list[int], width: int, dtype: torch.dtype, seed: int):
    """Random latents for sequences of seq_lens positions in shuffled blocks (unused blocks NaN),
    with the block tables and decode metadata."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    blocks = 1 + sum(need) + 2
    cache = torch.full((blocks, BLOCK_SIZE, 1, width), float("nan"), dtype=dtype)
    order = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.long)
    for row, (n, k) in enumerate(zip(seq_lens, need)):
        ids = [order.pop() for _ in range(k)]
        table[row, :k] = torch.tensor(ids)
        flat = torch.randn(k * BLOCK_SIZE, width, generator=g).to(dtype)
        flat[n:] = float("nan")  # past the sequence: never read
        cache[ids] = flat.view(k, BLOCK_SIZE, 1, width)
    meta = AttentionMetadata(is_prefill=False, slots=torch.zeros(len(seq_lens), dtype=torch.long),
                             block_tables=table, seq_lens=torch.tensor(seq_lens), max_seq_len=max(seq_lens))
    return cache, table, meta


def test_absorbed_decode_equals_expanded_attention(folder):
    lm = get_model(str(folder), dtype="float32")
    attn = lm.model.layers[1].self_attn
    seq_lens = [1, 5, 13, 8]
    cache, table, meta = _paged(seq_lens, RANK + ROPE, torch.float32, seed=3)
    cache = torch.nan_to_num(cache)  # the expanded reference gathers whole blocks
    g = torch.Generator().manual_seed(4)
    q_nope = torch.randn(len(seq_lens), HEADS, NOPE, generator=g)
    q_pe = torch.randn(len(seq_lens), HEADS, ROPE, generator=g)
    absorbed = attn._decode(q_nope, q_pe, cache, meta, lm.attention)
    q = torch.cat([q_nope, q_pe], dim=-1)
    for row, n in enumerate(seq_lens):
        latent = cache[table[row]].view(-1, RANK + ROPE)[:n]
        k, v = attn.expand(latent)  # [n, H, NOPE + ROPE], [n, H, V]
        want = sequence_attention(q[row:row + 1], k, v, n - 1, attn.scale, None)
        torch.testing.assert_close(absorbed[row:row + 1], want, atol=2e-6, rtol=1e-5)


# -- the Triton MLA decode kernel (interpreter) ---------------------------------------------------------
@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


KERNEL_CASES = {
    # name: (heads, value_dim R, rope P, seq_lens, dtype)
    "tiny f32": (4, 16, 8, [1, 7, 16, 30], torch.float32),
    "20 heads, R 20 (not pow2), padding row": (20, 20, 6, [9, 0, 33], torch.float32),
    "deepseek width bf16": (3, 512, 64, [5, 40], torch.bfloat16),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_triton_mla_decode_matches_the_torch_reference(name, interpret):
    from text_generation_server.kernels.mla_decode import mla_decode

    heads, r, p, seq_lens, dtype = KERNEL_CASES[name]
    cache, table, meta = _paged(seq_lens, r + p, dtype, seed=5)
    q = torch.randn(len(seq_lens), heads, r + p, generator=torch.Generator().manual_seed(6)).to(dtype)
    scale = (r + p) ** -0.5
    out = mla_decode(q, cache, table.to(torch.int32), meta.seq_lens.to(torch.int32), scale, r)
    live = [i for i, n in enumerate(seq_lens) if n > 0]
    sub = AttentionMetadata(is_prefill=False, slots=meta.slots[live], block_tables=table[live],
                            seq_lens=meta.seq_lens[live], max_seq_len=meta.max_seq_len)
    want = padded_latent_decode(q[live].double(), torch.nan_to_num(cache).double(), sub, scale, r)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[live].double(), want, atol=bound, rtol=bound)
    for i, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), "a padding row writes zeros"


def test_triton_mla_decode_refuses_bad_arguments(interpret):
    from text_generation_server.kernels.mla_decode import mla_decode

    cache, table, meta = _paged([3], 24, torch.float32, seed=1)
    q = torch.randn(1, 4, 24)
    with pytest.raises(ValueError, match="width"):
        mla_decode(q[..., :20], cache, table.int(), meta.seq_lens.int(), 0.1, 16)
    with pytest.raises(ValueError, match="int32"):
        mla_decode(q, cache, table, meta.seq_lens.int(), 0.1, 16)
    with pytest.raises(ValueError, match="value_dim"):
        mla_decode(q, cache, table.int(), meta.seq_lens.int(), 0.1, 24)


def test_model_on_the_triton_backend_decodes_transformers_tokens(folder, interpret, monkeypatch):
    from text_generation_server.kernels import mla_decode as kernel

    calls = []
    launch = kernel.mla_decode
    monkeypatch.setattr(kernel, "mla_decode", lambda *a, **kw: calls.append(a[0].shape) or launch(*a, **kw))
    lm = get_model(str(folder), dtype="float32", block_size=BLOCK_SIZE, attention_backend="triton-paged")
    assert lm.attention.name == "triton-paged"
    prompts = [lm.tokenizer.encode(p).ids for p in PROMPTS]
    assert engine_greedy(lm, prompts, 6) == [hf_greedy(folder, ids, 6) for ids in prompts]
    assert len(calls) == LAYERS * 5  # every decode step of every layer (the first token comes from prefill)


@pytest.mark.parametrize("change,needles", [
    ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, ["topk_method", "'noaux_tc'"]),
    ({"n_group": 3}, ["n_group (3)", "8 routed experts"]),
    ({"topk_group": 5, "n_group": 4}, ["topk_group (5)"]),
    ({"num_attention_heads": 3}, ["q_b_proj"]),
])
def test_configs_that_cannot_load_are_refused_by_name(folder, tmp_path, change, needles):
    from text_generation_server.quantizers.sources import CheckpointError

    target = tmp_path / "model"
    target.mkdir()
    for f in folder.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    config = json.loads((target / "config.json").read_text()) | change
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        get_model(str(target))
    for needle in needles:
        assert needle in str(info.value), str(info.value)


# -- DeepSeek's routing against transformers' routers -------------------------------------------------
ROUTINGS = {
    # name: (model_type, config overrides, our RouterOptions fields)
    "v2 greedy": ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=1.5),
                  dict(scoring="softmax_group", routed_scaling_factor=1.5)),
    "v2 group limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             routed_scaling_factor=1.5),
                         dict(scoring="softmax_group", n_group=4, topk_group=2, routed_scaling_factor=1.5)),
    "v3 grouped, renormalised": ("deepseek_v3", dict(n_group=4, topk_group=2, norm_topk_prob=True,
                                                     routed_scaling_factor=2.5),
                                 dict(scoring="sigmoid_group", n_group=4, topk_group=2, renormalize=True,
                                      routed_scaling_factor=2.5, correction_bias=True)),
    "v3 one group, raw": ("deepseek_v3", dict(n_group=1, topk_group=1, norm_topk_prob=False,
                                              routed_scaling_factor=1.0),
                          dict(scoring="sigmoid_group", routed_scaling_factor=1.0, correction_bias=True)),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_equals_transformers_router(name, dtype):
    """Same experts and weights per token as transformers' DeepseekV2/V3TopkRouter (float32 gate,
    V3's correction bias in the choice only), from activations of either dtype."""
    import transformers

    from text_generation_server.layers.moe import Router, RouterOptions

    model_type, overrides, ours = ROUTINGS[name]
    config = transformers.AutoConfig.for_model(model_type, hidden_size=32, n_routed_experts=16,
                                               num_experts_per_tok=4, **overrides)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    theirs = getattr(module, "DeepseekV3TopkRouter" if model_type == "deepseek_v3" else "DeepseekV2TopkRouter")(config)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 32, generator=g))
        correction = None
        if model_type == "deepseek_v3":
            correction = torch.randn(16, generator=g) * 0.3
            theirs.e_score_correction_bias.copy_(correction)
    router = Router(RouterOptions(16, 4, float32_weights=True, **ours), theirs.weight.detach().clone(), None,
                    correction)
    x = torch.randn(64, 32, generator=g).to(dtype)
    with torch.no_grad():
        _, want_w, want_ids = theirs(x)
    got_w, got_ids = router(x)
    assert got_w.dtype == torch.float32
    order_got, order_want = got_ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(got_ids.gather(1, order_got), want_ids.gather(1, order_want))
    torch.testing.assert_close(got_w.gather(1, order_got), want_w.gather(1, order_want), atol=1e-6, rtol=1e-6)


# -- DeepSeek-V3's FP8 checkpoints -----------------------------------------------------------------------
E4M3, FP8_MAX = torch.float8_e4m3fn, 448.0
FP8_BLOCK = (16, 16)  # DeepSeek's are 128 x 128; 16 cuts the tiny weights into several blocks
LINEAR = re.compile(r".*(_proj|_proj_with_mqa)\.weight$")


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, weight_scale_inv [ceil(N/bn), ceil(K/bk)] as DeepSeek stores it, dequantized)."""
    (n, k), (bn, bk) = w.shape, FP8_BLOCK
    grid = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / FP8_MAX
    full = grid.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    w8 = (w / full).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return w8, grid, w8.float() * full


@pytest.fixture(scope="module")
def fp8_folders(folder, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla_fp8")
    state = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    quantized, dense = {}, {}
    for name, tensor in state.items():
        if not LINEAR.match(name):
            quantized[name] = dense[name] = tensor
            continue
        w8, grid, dequantized = fp8_block(tensor.float())
        quantized[name], quantized[name.removesuffix(".weight") + ".weight_scale_inv"] = w8, grid
        dense[name] = dequantized
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK)}
    return {"fp8": write_model_folder(root / "fp8", folder, quantized, config | {"quantization_config": qc}),
            "dense": write_model_folder(root / "dense", folder, dense, config), "tensors": dense}


def test_fp8_checkpoint_loads_the_dequantized_weights(fp8_folders):
    lm = get_model(str(fp8_folders["fp8"]), dtype="float32")
    dense = fp8_folders["tensors"]
    linears = {name: m for name, m in lm.model.named_modules() if getattr(m, "kernel_name", None) == "fp8-dense"}
    assert linears, "the FP8 loader built no fp8 linear"
    for i, layer in enumerate(lm.model.layers):
        prefix = f"model.layers.{i}.self_attn"
        attn = layer.self_attn
        # kv_b_proj, absorbed at load through its fp8 kernel: exactly the dequantized weight.
        assert torch.equal(attn.w_kv, dense[f"{prefix}.kv_b_proj.weight"])
        down = torch.cat([dense[f"{prefix}.q_a_proj.weight"], dense[f"{prefix}.kv_a_proj_with_mqa.weight"]])
        assert torch.equal(attn.down.linear.weight, down)
        assert torch.equal(attn.q_up.linear.weight, dense[f"{prefix}.q_b_proj.weight"])
        assert torch.equal(attn.o_proj.linear.weight, dense[f"{prefix}.o_proj.weight"])
    experts = lm.model.layers[1].mlp.experts
    gate_up = torch.cat([dense["model.layers.1.mlp.experts.3.gate_proj.weight"],
                         dense["model.layers.1.mlp.experts.3.up_proj.weight"]])
    assert torch.equal(experts.gate_up[3].linear.weight, gate_up)
    assert all("groups of 16 columns" in m.computes for m in linears.values() if hasattr(m, "computes"))


def test_fp8_checkpoint_computes_the_dense_model_of_its_weights(fp8_folders, monkeypatch):
    """With the declared input rounding taken out, the FP8 model is the dense model of the
    dequantized weights: transformers' greedy tokens on that checkpoint, and our dense model's
    prompt log-probs. With it (as served) the log-probs stay close."""
    from helpers import prompt_logprobs
    from text_generation_server.kernels.fp8 import Fp8InputQuantizer

    dense_lm = get_model(str(fp8_folders["dense"]), dtype="float32")
    want_lp = prompt_logprobs(dense_lm)
    served = prompt_logprobs(get_model(str(fp8_folders["fp8"]), dtype="float32"))
    # Rounding every linear's input to e4m3 moves log-probs by a few percent, more where it flips
    # a router's top-k (which transformers' stacked experts offer no hook to emulate): a mean bound.
    gap = (served - want_lp).abs()
    assert 1e-3 < gap.mean() < 0.3, gap
    monkeypatch.setattr(Fp8InputQuantizer, "fake_quantize", lambda self, x: x.float())
    lm = get_model(str(fp8_folders["fp8"]), dtype="float32", block_size=BLOCK_SIZE)
    torch.testing.assert_close(prompt_logprobs(lm), want_lp, atol=1e-4, rtol=0)
    prompts = [lm.tokenizer.encode(p).ids for p in PROMPTS]
    assert engine_greedy(lm, prompts) == [hf_greedy(fp8_folders["dense"], ids) for ids in prompts]
