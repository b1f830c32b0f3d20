"""LoRA adapters against transformers + peft, on tiny random checkpoints of three families.

Adapters are made with the `peft` package itself (random A and B, so every adapted projection
matters) and saved in its layout; the server loads them from the folder. What must hold:
- greedy tokens and prompt log-probs equal transformers + peft with the adapter unmerged, and the
  tokens equal the merged model's (merge_and_unload);
- a batch mixing several adapters and the base gives every row what it gets alone; so do chunked
  prefill and a cached prefix (a prompt continued over blocks another request filled);
- two gloo ranks give one rank's tokens (column layers split B, row layers split A and share the
  base layer's all-reduce);
- a GPTQ, AWQ, compressed-tensors or FP8 base with an adapter gives what the dense checkpoint of its dequantized weights gives.
Llama covers the separate q/k/v and gate/up projections fused into one linear here, Qwen2 adds
q/k/v biases, Phi-3 stores qkv_proj and gate_up_proj fused in the checkpoint (peft adapts them
whole).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import ids_request, random_ids, run_ranks, run_to_end, write_checkpoint, write_model_folder

from quant_packers import awq_tensors, ct_tensors, gptq_tensors, quantize_rtn

from text_generation_server.models.adapters import enable_lora
from text_generation_server.models.loader import get_model

peft = pytest.importorskip("peft")  # the `test` extra installs it
torch.set_num_threads(1)

FAMILIES = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2_bias": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3_fused": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
# name -> (which targets, LoraConfig fields): ranks, alphas, rsLoRA and subsets differ per adapter.
ADAPTERS = {
    "all": (slice(None), dict(r=4, lora_alpha=8)),
    "attn_rslora": (slice(0, 2), dict(r=6, lora_alpha=5, use_rslora=True)),
    "mlp_r2": (slice(-2, None), dict(r=2, lora_alpha=16)),
}
NEW = 8


def make_adapter(base, folder: Path, targets: list[str], seed: int, **fields):
    """A peft adapter with random A and B (peft's own init leaves B zero: no effect to check)."""
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(target_modules=targets, **fields))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(folder)
    return model.eval()


def hf_greedy(model, prompt: list[int], new: int = NEW) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the prompt's log-probs (row p scores token p + 1)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
    scored = logprobs[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
    return out[0, len(prompt):].tolist(), scored


class Family:
    def __init__(self, root: Path, name: str):
        self.name = name
        self.base_dir = root / name / "base"
        self.hf = write_checkpoint(self.base_dir, name)
        self.adapters: dict[str, Path] = {}
        self.peft: dict[str, torch.nn.Module] = {}
        targets = FAMILIES[name]
        for i, (adapter, (pick, fields)) in enumerate(ADAPTERS.items()):
            folder = root / name / adapter
            self.peft[adapter] = make_adapter(self.hf, folder, targets[pick], seed=10 + i, **fields)
            self.adapters[adapter] = folder
        self.prompts = {adapter: random_ids(11 + i, seed=i) for i, adapter in enumerate([None, *ADAPTERS])}

    def server(self, max_loras: int = 4, max_rank: int = 8, **kw):
        lm = get_model(str(self.base_dir), dtype="float32", **kw)
        enable_lora(lm, max_loras, max_rank)
        for adapter, folder in self.adapters.items():
            lm.adapters.load(adapter, str(folder))
        lm.allocate_kv_cache(64)
        return lm


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    cache: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in cache:
            cache[name] = Family(root, name)
        return cache[name]

    return get


def serve(lm, rows: list[tuple[str | None, list[int]]], **kw) -> list[dict]:
    """Every row in one batch: its tokens and prompt log-probs."""
    requests = [ids_request(i + 1, prompt, NEW, adapter_id=adapter, prefill_logprobs=True, **kw)
                for i, (adapter, prompt) in enumerate(rows)]
    out = run_to_end(lm, lm.make_batch(1, requests))
    return [out[i + 1] for i in range(len(rows))]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_mixed_batch_equals_transformers_and_peft(families, name):
    """One batch: the base and three adapters; each row equals peft unmerged (tokens and prompt
    log-probs) and merged (tokens)."""
    fam = families(name)
    lm = fam.server()
    rows = [(adapter, fam.prompts[adapter]) for adapter in [None, *ADAPTERS]]
    got = serve(lm, rows)
    for (adapter, prompt), row in zip(rows, got):
        model = fam.hf if adapter is None else fam.peft[adapter]
        want, scored = hf_greedy(model, prompt)
        assert row["ids"] == want, (adapter, row["ids"], want)
        torch.testing.assert_close(torch.tensor(row["prompt"][1:]), scored, atol=2e-4, rtol=0)
        if adapter is not None:
            merged = copy.deepcopy(fam.peft[adapter]).merge_and_unload()
            assert hf_greedy(merged, prompt)[0] == want, adapter
    base_tokens = hf_greedy(fam.hf, fam.prompts["all"])[0]
    assert got[1]["ids"] != base_tokens, "the adapter changed nothing: the test would not see a dropped adapter"


@pytest.mark.parametrize("name", ["llama", "phi3_fused"])
def test_each_row_of_many_adapters_gets_what_it_gets_alone(families, name):
    """8 adapter slots, every one used (the three adapters loaded again under other names), and the
    base, in one batch in interleaved order: each row's tokens are those it gets alone."""
    fam = families(name)
    lm = fam.server(max_loras=8)
    for i in range(5):
        adapter = list(ADAPTERS)[i % 3]
        lm.adapters.load(f"{adapter}-{i}", str(fam.adapters[adapter]))
    names = sorted(lm.adapters.by_name)
    assert len(names) == 8
    rows = [(n, random_ids(7 + i, seed=40 + i)) for i, n in enumerate(names)] + [(None, random_ids(9, seed=60))]
    rows = rows[::2] + rows[1::2]
    together = serve(lm, rows)
    for row, got in zip(rows, together):
        alone = serve(lm, [row])[0]
        assert got["ids"] == alone["ids"], row[0]
        torch.testing.assert_close(torch.tensor(got["prompt"][1:]), torch.tensor(alone["prompt"][1:]), atol=1e-5,
                                   rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2_bias"])
def test_chunked_prefill_and_cached_prefix_keep_the_adapter(families, name):
    """A prompt computed in chunks of 4, and one continued over a prefix another request of the same
    adapter left in the cache, give the tokens of the whole prompt under peft."""
    fam = families(name)
    lm = fam.server()
    prompt = random_ids(19, seed=5)
    want = hf_greedy(fam.peft["all"], prompt)[0]
    lm.max_prefill_tokens = 4
    batch = lm.make_batch(1, [ids_request(1, prompt, NEW, adapter_id="all", chunk_len=4)])
    assert run_to_end(lm, batch)[1]["ids"] == want
    lm.max_prefill_tokens = None
    # A router's blocks: the first request fills them; the second arrives with 16 tokens cached.
    blocks = [3, 4]
    first = ids_request(2, prompt, NEW, adapter_id="all", blocks=blocks)
    run_to_end(lm, lm.make_batch(2, [first]))
    cached = ids_request(3, prompt, NEW, adapter_id="all", blocks=blocks, cache_len=16)
    assert run_to_end(lm, lm.make_batch(3, [cached]))[3]["ids"] == want


def _rank_tokens(pg, base: str, adapters: dict[str, str], rows: list) -> list[list[int]]:
    lm = get_model(base, dtype="float32", process_group=pg)
    enable_lora(lm, 4, 8)
    for adapter, folder in adapters.items():
        lm.adapters.load(adapter, folder)
    lm.allocate_kv_cache(64)
    return [r["ids"] for r in serve(lm, rows)]


@pytest.mark.parametrize("name", ["llama", "phi3_fused"])
def test_two_ranks_give_one_ranks_tokens(families, tmp_path, name):
    fam = families(name)
    rows = [(adapter, fam.prompts[adapter]) for adapter in [None, *ADAPTERS]]
    want = [r["ids"] for r in serve(fam.server(), rows)]
    ranks = run_ranks(_rank_tokens, (str(fam.base_dir), {a: str(p) for a, p in fam.adapters.items()}, rows), 2,
                      tmp_path, timeout_s=240)
    assert ranks == [want, want]


def _int4(sym: bool, pack):
    """4-bit group-8 codes packed by `pack`, and the dense weight they decode to."""
    def quantize(prefix: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q = quantize_rtn(tensor.float(), 4, 8, sym=sym)
        return pack(prefix, q), q.dense()
    return quantize


def _fp8_channel(prefix: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors FP8 (float-quantized, one scale per output row), and its dense decoding."""
    w = tensor.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-8)
    codes = (w / scale).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": codes, f"{prefix}.weight_scale": scale}, codes.float() * scale


def _ct_config(weights: dict, fmt: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}}}


QUANTIZED = {  # format -> (quantize: (prefix, dense weight) -> (stored tensors, dequantized), quantization_config)
    "gptq": (_int4(True, lambda prefix, q: gptq_tensors(prefix, q, "gptq")),
             {"quant_method": "gptq", "bits": 4, "group_size": 8, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}),
    "awq": (_int4(False, lambda prefix, q: awq_tensors(prefix, q)),
            {"quant_method": "awq", "bits": 4, "group_size": 8, "zero_point": True, "version": "gemm"}),
    "compressed-tensors": (
        _int4(True, lambda prefix, q: ct_tensors(prefix, q, with_g_idx=False)),
        _ct_config({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8,
                    "dynamic": False, "actorder": None, "observer": "minmax"}, "pack-quantized")),
    "fp8": (_fp8_channel,
            _ct_config({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                        "group_size": None, "observer": "minmax"}, "float-quantized")),
}


@pytest.mark.parametrize("fmt", list(QUANTIZED))
def test_a_quantized_base_with_an_adapter_equals_its_dequantized_base(families, tmp_path, monkeypatch, fmt):
    """Every linear of the Llama checkpoint as 4-bit GPTQ, AWQ or compressed-tensors (group 8), or as
    compressed-tensors FP8, and the dense checkpoint of the dequantized weights: with the same adapter,
    the same tokens and prompt log-probs (the base keeps its kernel, the adapter adds its term)."""
    from safetensors.torch import load_file

    from text_generation_server.kernels.select import DISABLE_ENV
    from helpers import fast_kernels

    quantize, quant_config = QUANTIZED[fmt]
    fam = families("llama")
    state = load_file(str(fam.base_dir / "model.safetensors"))
    config = fam.hf.config.to_dict()
    quantized, dense = dict(state), dict(state)
    for key, tensor in state.items():
        if key.endswith("_proj.weight"):
            prefix = key.removesuffix(".weight")
            stored, dequantized = quantize(prefix, tensor)
            del quantized[key]
            quantized |= stored
            dense[key] = dequantized
    qdir = write_model_folder(tmp_path / fmt, fam.base_dir, quantized, config | {"quantization_config": quant_config})
    ddir = write_model_folder(tmp_path / "dense", fam.base_dir, dense, config)
    if fmt != "fp8":  # integer codes on the reference kernel; fp8 weights keep their dequantizing kernel
        monkeypatch.setenv(DISABLE_ENV, fast_kernels())
    results = []
    for folder in (qdir, ddir):
        lm = get_model(str(folder), dtype="float32")
        enable_lora(lm, 2, 8)
        lm.adapters.load("all", str(fam.adapters["all"]))
        lm.allocate_kv_cache(64)
        results.append(serve(lm, [("all", fam.prompts["all"]), (None, fam.prompts[None])]))
        if folder == qdir:
            assert lm.quantize == quant_config["quant_method"]
    (q_adapter, q_base), (d_adapter, d_base) = results
    assert q_adapter["ids"] == d_adapter["ids"] and q_base["ids"] == d_base["ids"]
    assert q_adapter["ids"] != q_base["ids"] or fam.prompts["all"] != fam.prompts[None]
    torch.testing.assert_close(torch.tensor(q_adapter["prompt"][1:]), torch.tensor(d_adapter["prompt"][1:]),
                               atol=1e-4, rtol=0)


# Other families' own projection names: GPT-2's fused Conv1D c_attn, Falcon's and GPT-NeoX's fused
# query_key_value, Phi's dense/fc1/fc2, Gemma's GeGLU MLP.
OTHER_TARGETS = {
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "falcon": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "phi": ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"],
}


@pytest.mark.parametrize("name", list(OTHER_TARGETS))
def test_other_families_projection_names(tmp_path, name):
    from family_cases import write_family_checkpoint

    hf = write_family_checkpoint(tmp_path / "base", name)
    pm = make_adapter(hf, tmp_path / "adapter", OTHER_TARGETS[name], seed=3, r=4, lora_alpha=8)
    prompt = random_ids(12, seed=3)
    lm = get_model(str(tmp_path / "base"), dtype="float32")
    enable_lora(lm, 1, 4)
    lm.adapters.load("a", str(tmp_path / "adapter"))
    lm.allocate_kv_cache(64)
    got = serve(lm, [("a", prompt), (None, prompt)])
    assert got[0]["ids"] == hf_greedy(pm, prompt)[0]
    assert got[1]["ids"] == hf_greedy(hf, prompt)[0] != got[0]["ids"]
