"""The transformers fallback: model types with no native family run through transformers' own
modeling code over our paged cache, and give transformers' tokens.

Nine long-tail types (tiny random checkpoints written by transformers 5): greedy tokens equal
transformers' in float32; the same with small prefill chunks and over a prefix read from the
cache; at 2 ranks where transformers gives the model a tensor-parallel plan (refused with the
reason where it gives none). Also: a Llama forced through the fallback equals the native
family, quantized checkpoints load through the loader factory, architectures whose state is not
a KV cache are refused by name, and a missing transformers says what to install.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import build_tokenizer, ids_request, random_ids, run_ranks, run_to_end, write_checkpoint
from quant_packers import awq_tensors, ct_tensors, gptq_tensors, quantize_rtn

from text_generation_server.models.loader import get_model
from text_generation_server.models.registry import model_impl
from text_generation_server.quantizers.sources import CheckpointError

torch.set_num_threads(1)

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=88, num_hidden_layers=2, max_position_embeddings=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=0, bos_token_id=0,
            pad_token_id=0, tie_word_embeddings=False)
CASES = {
    "stablelm": {},  # partial rotary, LayerNorm; no tensor-parallel plan
    "glm4": {},  # fused gate_up, sandwich norms, partial interleaved rotary
    "smollm3": {},
    "helium": {},
    "exaone4": {"sliding_window": 7, "layer_types": ["sliding_attention", "full_attention"]},  # q/k norm, windows
    "ernie4_5": {},
    "olmo": {},
    "arcee": {},  # ReLU^2 MLP
    "nemotron": {},  # LayerNorm1p, partial rotary
}
PROMPTS = [random_ids(21, 1), random_ids(9, 2), random_ids(3, 3)]
NEW_TOKENS = 12
BLOCK_SIZE = 4
WORLD = 2


def write_case(folder: Path, model_type: str, seed: int) -> None:
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **CASES.get(model_type, {})})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = name.endswith(".weight") and "norm" in name
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if is_norm and model_type != "nemotron" else 0.0))
    model.eval().save_pretrained(folder)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fallback")
    out = {}
    for seed, name in enumerate(CASES):
        write_case(root / name, name, seed + 7)
        out[name] = str(root / name)
    return out


def hf_greedy(folder: str, ids: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def references(folders) -> dict[str, list[list[int]]]:
    return {name: [hf_greedy(folder, ids) for ids in PROMPTS] for name, folder in folders.items()}


def load(folder: str, **kw):
    lm = get_model(folder, dtype="float32", block_size=BLOCK_SIZE, **kw)
    lm.allocate_kv_cache(128)
    return lm


def greedy(lm, **request_kw) -> list[list[int]]:
    out = run_to_end(lm, lm.make_batch(0, [ids_request(i, ids, NEW_TOKENS, **request_kw)
                                           for i, ids in enumerate(PROMPTS)]))
    return [out[i]["ids"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_transformers(folders, references, name):
    lm = load(folders[name])
    assert lm.model_impl == "transformers"
    assert greedy(lm) == references[name]


@pytest.mark.parametrize("name", list(CASES))
def test_chunks_and_a_cached_prefix_give_the_same_tokens(folders, references, name):
    lm = load(folders[name])
    lm.max_prefill_tokens = 5
    assert greedy(lm, chunk_len=2) == references[name]
    ids, want = PROMPTS[0], references[name][0]
    blocks = lm.allocator.allocate(lm.blocks_for(len(ids) + NEW_TOKENS))
    run_to_end(lm, lm.make_batch(1, [ids_request(1, ids[:16] + [5, 6], 2, blocks=blocks)]))
    tail = lm.allocator.allocate(lm.blocks_for(len(ids) + NEW_TOKENS) - 3)
    hit = ids_request(2, ids, NEW_TOKENS, blocks=blocks[:3] + tail, cache_len=3 * BLOCK_SIZE)
    assert run_to_end(lm, lm.make_batch(2, [hit]))[2]["ids"] == want


def _rank_main(pg, folders: dict[str, str]) -> dict:
    out = {}
    for name, folder in folders.items():
        try:
            lm = get_model(folder, dtype="float32", process_group=pg, block_size=BLOCK_SIZE)
            lm.allocate_kv_cache(128)
            out[name] = {"tokens": greedy(lm), "kv_heads": lm.model.local_kv_heads}
        except Exception as exc:  # reported to the test, which names the case
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def world2(folders, tmp_path_factory) -> list[dict]:
    return run_ranks(_rank_main, (folders,), WORLD, tmp_path_factory.mktemp("fallback_tp"), 300)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_follow_the_tensor_parallel_plan(folders, references, world2, name):
    rank0, rank1 = world2[0][name], world2[1][name]
    if name == "stablelm":  # transformers gives it no plan
        assert isinstance(rank0, str) and "no tensor-parallel plan" in rank0 and "--num-shard 1" in rank0
        return
    assert not isinstance(rank0, str), rank0
    assert rank0["tokens"] == rank1["tokens"] == references[name]
    assert rank0["kv_heads"] == BASE["num_key_value_heads"] // WORLD


def test_llama_forced_through_transformers_equals_the_native_family(tmp_path):
    write_checkpoint(tmp_path, "llama", seed=3)
    native = load(str(tmp_path))
    forced = load(str(tmp_path), model_impl="transformers")
    assert (native.model_impl, forced.model_impl) == ("native", "transformers")
    assert greedy(forced) == greedy(native)


def test_model_impl_choices_and_refusals(folders):
    config = json.loads((Path(folders["glm4"]) / "config.json").read_text())
    assert model_impl(config, "auto") == "transformers"
    assert model_impl({"model_type": "llama"}, "auto") == "native"
    assert model_impl({"model_type": "llama"}, "transformers") == "transformers"
    with pytest.raises(CheckpointError, match="model_type 'glm4' is not supported"):
        model_impl(config, "native")
    with pytest.raises(ValueError, match="--model-impl must be one of auto, native, transformers"):
        model_impl(config, "vllm")


@pytest.mark.parametrize("model_type,why", [("jamba", "Mamba"), ("falcon_h1", "Mamba-2"), ("lfm2", "convolution"),
                                            ("qwen3_next", "linear attention"), ("mamba", "state-space")])
def test_architectures_without_a_kv_cache_are_refused_by_name(tmp_path, model_type, why):
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, "num_hidden_layers": 2}).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        model_impl(config, "auto", str(tmp_path / "config.json"))
    assert f"model_type '{model_type}'" in str(info.value) and why in str(info.value)
    assert "not a KV cache" in str(info.value)


def test_layer_types_that_keep_other_state_are_refused():
    with pytest.raises(CheckpointError, match=r"layer_types \['linear_attention'\]"):
        model_impl({"model_type": "somenewmodel", "layer_types": ["full_attention", "linear_attention"]})


def test_without_transformers_the_refusal_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(CheckpointError, match=r'pip install "text-generation-server\[transformers\]"'):
        model_impl({"model_type": "glm4"})
    assert model_impl({"model_type": "qwen3"}) == "native"  # native families never need it


CT_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8,
                 "dynamic": False, "actorder": None}}}}
def fp8_tensors(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoFP8's per-channel layout (e4m3 codes, one float32 scale per output row) and what they mean."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    codes = (w / scale).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": codes, f"{prefix}.weight_scale": scale.float()}, codes.float() * scale


QUANTIZED = {  # format -> (its tensors for one linear, its quantization_config)
    "gptq": (lambda prefix, q: gptq_tensors(prefix, q, "gptq"),
             {"quant_method": "gptq", "bits": 4, "group_size": 8, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}),
    "awq": (awq_tensors,
            {"quant_method": "awq", "bits": 4, "group_size": 8, "zero_point": True, "version": "gemm"}),
    "compressed-tensors": (lambda prefix, q: ct_tensors(prefix, q, with_g_idx=False),
                           CT_CONFIG),
    # Weight-only (compressed-tensors float-quantized, no input_activations): a checkpoint that
    # declares fp8 activations computes their rounding too, which the dequantized model does not.
    "fp8": (None, {"quant_method": "compressed-tensors", "format": "float-quantized",
                   "quantization_status": "compressed", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                       "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                       "dynamic": False}}}}),
}


@pytest.mark.parametrize("fmt", list(QUANTIZED))
def test_a_quantized_checkpoint_runs_on_our_kernels(folders, tmp_path, monkeypatch, fmt):
    """GPTQ/AWQ/compressed-tensors/FP8 tensors under transformers' own linear names load through the
    loader factory: on the reference kernel the model equals a dense checkpoint of the dequantized
    weights."""
    from safetensors.torch import load_file, save_file

    from text_generation_server.kernels.select import DISABLE_ENV
    from text_generation_server.layers.tensor_parallel import LinearSource

    folder = Path(folders["glm4"])
    dense = load_file(str(folder / "model.safetensors"))
    lm = get_model(str(folder), dtype="float32")
    # Our parallel linears say which checkpoint tensors they hold (q/k/v and gate/up fused).
    linears = [t for m in lm.model.hf.modules() if isinstance(m, LinearSource) for t in m.tensors]
    assert len(linears) == 2 * 6 and "model.layers.0.self_attn.k_proj" in linears, linears
    pack, qconfig_of_format = QUANTIZED[fmt]
    quantized, dequantized = dict(dense), dict(dense)
    for name in linears:
        w = dense[f"{name}.weight"]
        del quantized[f"{name}.weight"]
        if fmt == "fp8":
            tensors, meaning = fp8_tensors(name, w)
            quantized.update(tensors)
            dequantized[f"{name}.weight"] = meaning.to(w.dtype)
            continue
        q = quantize_rtn(w, bits=4, group_size=8, sym=fmt != "awq")
        quantized.update(pack(name, q))
        dequantized[f"{name}.weight"] = q.dense().to(w.dtype)
    for target, tensors, qconfig in ((tmp_path / "quantized", quantized, qconfig_of_format),
                                     (tmp_path / "deq", dequantized, None)):
        target.mkdir()
        for f in folder.iterdir():
            if f.name != "model.safetensors":
                (target / f.name).write_bytes(f.read_bytes())
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        if qconfig is not None:
            config = json.loads((target / "config.json").read_text())
            config["quantization_config"] = qconfig
            (target / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv(DISABLE_ENV, "cpu-int4pack,cpu-int8,marlin-layout")
    q_lm, deq_lm = load(str(tmp_path / "quantized")), load(str(tmp_path / "deq"))
    kinds = {m.linear.kernel_name for m in q_lm.model.hf.modules() if isinstance(m, LinearSource)}
    assert kinds == ({"fp8-dense"} if fmt == "fp8" else {"reference"}), kinds
    req = [ids_request(0, PROMPTS[0], 1, prefill_logprobs=True)]
    got = run_to_end(q_lm, q_lm.make_batch(0, req))[0]["prompt"]
    want = run_to_end(deq_lm, deq_lm.make_batch(0, req))[0]["prompt"]
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(want[1:]), atol=1e-4, rtol=0)


def test_fused_siblings_recompute_for_an_input_they_did_not_see():
    """q/k/v-style siblings share one matmul only when transformers' code feeds them one tensor;
    a sibling called with another input gets its own projection of that input."""
    from text_generation_server.kernels.dense import DenseLinear
    from text_generation_server.models.transformers_impl import _Fused, _FusedMember

    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 5, generator=g)
    group = _Fused(DenseLinear(w, None), [3, 4])
    first, second = _FusedMember(group, 0, 5, 3), _FusedMember(group, 1, 5, 4)
    x, y = torch.randn(1, 2, 5, generator=g), torch.randn(1, 2, 5, generator=g)
    torch.testing.assert_close(first(x), x @ w[:3].T)
    torch.testing.assert_close(second(y), y @ w[3:].T)  # not x's cached output
    torch.testing.assert_close(second(x), x @ w[3:].T)
    assert group._input is x and group._out is not None
    torch.testing.assert_close(first(x), x @ w[:3].T)
    assert group._input is None and group._out is None  # both served: nothing held
