"""Mixture-of-experts blocks: routing as transformers computes it, the grouped expert path against
a per-token reference, the layers that get experts, gpt-oss's stacked tensors read per expert,
and the refusals. (Greedy tokens against transformers at 1 and 2 ranks, with caching and
chunks, are in test_families.py's MoE cases.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from family_cases import CASES, write_family_checkpoint
from helpers import ids_request, run_to_end
from text_generation_server.layers.moe import (
    SWIGLU_OAI,
    ExpertOptions,
    Experts,
    Router,
    RouterOptions,
    moe_layer_indices,
    swiglu_oai,
)
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.sources import CheckpointError, DictTensorSource
from text_generation_server.quantizers.weights import Weights

MOE_CASES = [n for n, (t, _) in CASES.items() if t in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")]


def _router(opts: RouterOptions, hidden: int = 16, seed: int = 0) -> Router:
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(opts.num_experts, generator=g) if opts.bias else None
    return Router(opts, torch.randn(opts.num_experts, hidden, generator=g), bias)


def test_softmax_routing_renormalised_in_float32():
    router = _router(RouterOptions(6, 2, renormalize=True, float32_weights=True))
    x = torch.randn(5, 16, dtype=torch.float64).float()
    weights, ids = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    top, want_ids = probs.topk(2, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))


def test_softmax_routing_without_renormalising_keeps_the_activation_dtype():
    router = _router(RouterOptions(6, 2, renormalize=False))
    x = torch.randn(5, 16)
    weights, _ = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    torch.testing.assert_close(weights, probs.topk(2, dim=-1).values)  # not renormalised
    router.weight.data = router.weight.data.bfloat16()
    assert router(x.bfloat16())[0].dtype == torch.bfloat16


def test_topk_then_softmax_routing_with_bias():
    router = _router(RouterOptions(6, 3, scoring="topk_softmax", bias=True))
    x = torch.randn(4, 16)
    weights, ids = router(x)
    logits = x @ router.weight.T + router.bias
    top, want_ids = logits.topk(3, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1))


def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        _router(RouterOptions(4, 5))


def _experts(act: str, bias: bool, experts: int = 5, hidden: int = 12, inter: int = 8, seed: int = 0,
             dtype=torch.float32) -> tuple[Experts, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(experts):
        for name, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            tensors[f"x.{e}.{name}.weight"] = torch.randn(shape, generator=g)
            if bias:
                tensors[f"x.{e}.{name}.bias"] = torch.randn(shape[0], generator=g)
    weights = Weights(DictTensorSource(tensors), torch.device("cpu"), dtype)
    opts = ExpertOptions(experts, hidden, inter, lambda e: (f"x.{e}.gate", f"x.{e}.up", f"x.{e}.down"), act=act,
                         bias=bias)
    return Experts(opts, weights), tensors


def _expert_tensors(act: str, bias: bool, experts: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for e in range(experts):
        for name, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            tensors[f"x.{e}.{name}.weight"] = torch.randn(shape, generator=g) * 0.3
            if bias:
                tensors[f"x.{e}.{name}.bias"] = torch.randn(shape[0], generator=g) * 0.3
    opts = ExpertOptions(experts, hidden, inter, lambda e: (f"x.{e}.gate", f"x.{e}.up", f"x.{e}.down"), act=act,
                         bias=bias, top_k=2)
    return tensors, opts


FUSED = {"silu": ("silu", False), "swiglu_oai+bias": (SWIGLU_OAI, True), "gelu_tanh": ("gelu_pytorch_tanh", False)}


@pytest.mark.parametrize("case", list(FUSED))
def test_fused_kernel_experts_equal_the_grouped_path(monkeypatch, case):
    """The Triton fused path (in the interpreter, on CPU tensors) computes what the grouped
    per-expert GEMMs compute, from the same checkpoint tensors, and holds no per-expert linears."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    act, bias = FUSED[case]
    tensors, opts = _expert_tensors(act, bias, experts=6, hidden=64, inter=32)
    grouped = Experts(opts, Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32), fused=False)
    fused = Experts(opts, Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32), fused=True)
    assert fused.fused is not None and len(fused.gate_up) == 0 and fused.kernel_name == "moe-fused-triton"
    assert fused.graph_blocker is None and grouped.graph_blocker is not None
    x = torch.randn(7, 64)
    ids = torch.stack([torch.randperm(5)[:2] for _ in range(7)])  # expert 5 idle
    weights = torch.softmax(torch.randn(7, 2), dim=-1)
    torch.testing.assert_close(fused(x, weights, ids), grouped(x, weights, ids), rtol=1e-4, atol=1e-4)


def test_fused_kernel_reads_gptq_experts(monkeypatch):
    """GPTQ experts (act-order, 4-bit asymmetric) through the loader factory: the fused W4A16 path
    computes the experts of the dequantized weights."""
    pytest.importorskip("triton")
    from quant_packers import gptq_tensors, quantize_rtn

    from text_generation_server.kernels.fused_moe import moe_reference
    from text_generation_server.quantizers.factory import get_loader
    from text_generation_server.quantizers.config import GPTQConfig

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dense, opts = _expert_tensors("silu", False, experts=4, hidden=64, inter=32, seed=3)
    tensors, dequantized = {}, {}
    for key, weight in dense.items():
        prefix = key.removesuffix(".weight")
        # gate and up see one input, so GPTQ's act-order gives them one permutation
        seed = int(prefix.split(".")[1]) * 2 + prefix.endswith("down")
        q = quantize_rtn(weight, 4, 16, sym=False,
                         perm=torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(seed)))
        tensors |= gptq_tensors(prefix, q, "gptq")
        dequantized[prefix] = q.dense().float()
    config = GPTQConfig(source="test", bits=4, group_size=16, sym=False, desc_act=True, checkpoint_format="gptq")
    weights = Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32, loader=get_loader(config))
    fused = Experts(opts, weights, fused=True)
    assert fused.fused is not None
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2]])
    routing = torch.softmax(torch.randn(5, 2), dim=-1)
    w13 = torch.stack([torch.cat([dequantized[f"x.{e}.gate"], dequantized[f"x.{e}.up"]]) for e in range(4)])
    w2 = torch.stack([dequantized[f"x.{e}.down"] for e in range(4)])
    torch.testing.assert_close(fused(x, routing, ids), moe_reference(x, w13, w2, routing, ids), rtol=1e-4,
                               atol=1e-4)


def test_quantize_keeps_per_expert_linears_even_where_fused_would_run():
    from text_generation_server.layers.moe import grouped_experts_only

    tensors, opts = _expert_tensors("silu", False, experts=2, hidden=8, inter=4)
    with grouped_experts_only():
        experts = Experts(opts, Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32), fused=None)
    assert experts.fused is None and len(experts.gate_up) == 2


def _per_token_reference(tensors, x, weights, ids, act: str, bias: bool) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])

            def lin(name, v, e=e):
                return F.linear(v, tensors[f"x.{e}.{name}.weight"], tensors.get(f"x.{e}.{name}.bias") if bias else None)

            g, u = lin("gate", x[t]), lin("up", x[t])
            h = swiglu_oai(g, u, 1.702, 7.0) if act == SWIGLU_OAI else F.silu(g) * u
            out[t] += weights[t, j] * lin("down", h)
    return out


@pytest.mark.parametrize("act,bias", [("silu", False), (SWIGLU_OAI, True)])
def test_grouped_experts_equal_a_per_token_loop(act, bias):
    experts, tensors = _experts(act, bias)
    x = torch.randn(9, 12)
    ids = torch.stack([torch.randperm(5)[:2] for _ in range(9)])
    ids[3] = torch.tensor([4, 0])  # and an expert that only one token picks
    weights = torch.rand(9, 2)
    want = _per_token_reference(tensors, x, weights, ids, act, bias)
    torch.testing.assert_close(experts(x, weights, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act,bias", [("silu", False), (SWIGLU_OAI, True)])
def test_grouped_gemm_over_stacked_experts_equals_each_experts_own_linears(act, bias):
    """The CPU path over stacked weights (torch's grouped GEMM) computes what each expert's own
    linears compute (the path quantized experts and calibration take)."""
    experts, _ = _experts(act, bias)
    x = torch.randn(11, 12)
    ids = torch.stack([torch.randperm(5)[:3] for _ in range(11)])
    weights = torch.rand(11, 3)
    fast = experts(x, weights, ids)
    experts.per_expert_calls = True
    torch.testing.assert_close(fast, experts(x, weights, ids), rtol=1e-6, atol=1e-6)


def test_unquantized_experts_are_stacked_and_shared_with_the_per_expert_linears():
    experts, tensors = _experts("silu", True)
    assert experts.w13.shape == (5, 16, 12) and experts.w2.shape == (5, 12, 8)
    assert experts.gate_up[2].linear.weight.data_ptr() == experts.w13[2].data_ptr()
    torch.testing.assert_close(experts.w13[1, :8], tensors["x.1.gate.weight"])
    torch.testing.assert_close(experts.w13[1, 8:], tensors["x.1.up.weight"])
    torch.testing.assert_close(experts.b2[4], tensors["x.4.down.bias"])


def test_swiglu_oai_clamps_as_gpt_oss():
    gate = torch.tensor([10.0, -3.0, 0.5])
    up = torch.tensor([-9.0, 2.0, 8.0])
    want = (torch.tensor([-7.0, 2.0, 7.0]) + 1) * torch.tensor([7.0, -3.0, 0.5]) * \
        torch.sigmoid(1.702 * torch.tensor([7.0, -3.0, 0.5]))
    torch.testing.assert_close(swiglu_oai(gate, up, 1.702, 7.0), want)


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    assert moe_layer_indices(4, 1, [], 8) == {0, 1, 2, 3}
    assert moe_layer_indices(4, 2, [], 8) == {1, 3}
    assert moe_layer_indices(4, 1, [0, 2], 8) == {1, 3}
    assert moe_layer_indices(4, 1, [], 0) == set()


def test_intermediate_not_divisible_by_ranks_is_refused():
    from text_generation_server.quantizers.dist import ProcessGroup

    tensors = {f"x.0.{n}.weight": torch.zeros(s) for n, s in (("gate", (7, 4)), ("up", (7, 4)), ("down", (4, 7)))}
    weights = Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32, process_group=ProcessGroup(rank=0, size=2))
    with pytest.raises(CheckpointError, match="intermediate size .7. must be divisible by the 2 shards"):
        Experts(ExpertOptions(1, 4, 7, lambda e: ("x.0.gate", "x.0.up", "x.0.down")), weights)


# -- whole models --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for seed, name in enumerate(MOE_CASES):
        write_family_checkpoint(root / name, name, seed=300 + seed)
        out[name] = str(root / name)
    return out


PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n", "The quick brown fox jumps over the lazy dog",
           "import torch\nx = torch.zeros(3)"]


@pytest.mark.parametrize("name", MOE_CASES)
def test_every_expert_is_used_by_the_test_prompts(moe_folders, name):
    """The exactness cases mean something only if every expert computes for some token."""
    lm = get_model(moe_folders[name], dtype="float32")
    lm.allocate_kv_cache(256)
    used: dict[int, set[int]] = {}
    hooks = []
    for index, layer in enumerate(lm.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        hooks.append(layer.mlp.router.register_forward_hook(
            lambda m, args, out, i=index: used.setdefault(i, set()).update(out[1].flatten().tolist())))
    assert hooks, "no sparse layer"
    requests = [ids_request(i, lm.tokenizer.encode(p).ids, 16) for i, p in enumerate(PROMPTS)]
    run_to_end(lm, lm.make_batch(0, requests))
    n = CASES[name][1].get("num_local_experts", CASES[name][1].get("num_experts"))
    for index, seen in used.items():
        assert seen == set(range(n)), f"layer {index}: experts {sorted(set(range(n)) - seen)} never chosen"


def test_qwen2_moe_dense_layers_and_shared_expert(moe_folders):
    lm = get_model(moe_folders["qwen2_moe"], dtype="float32")
    kinds = [type(layer.mlp).__name__ for layer in lm.model.layers]
    assert kinds == ["SparseMoE", "GatedMLP", "SparseMoE"]  # mlp_only_layers=[1]
    assert lm.model.layers[0].mlp.shared is not None


def test_gpt_oss_stacked_experts_are_read_per_expert(moe_folders):
    """gpt-oss stores [E, H, 2I] with gate and up interleaved; expert e's gate is columns 0::2."""
    from safetensors.torch import load_file

    folder = moe_folders["gpt_oss"]
    stored = load_file(f"{folder}/model.safetensors")
    lm = get_model(folder, dtype="float32")
    experts = lm.model.layers[1].mlp.experts
    gate_up = stored["model.layers.1.mlp.experts.gate_up_proj"]
    inter = gate_up.shape[-1] // 2
    torch.testing.assert_close(experts.w13[3, :inter], gate_up[3][:, 0::2].T)
    torch.testing.assert_close(experts.w13[3, inter:], gate_up[3][:, 1::2].T)
    torch.testing.assert_close(experts.w2[5], stored["model.layers.1.mlp.experts.down_proj"][5].T)
    torch.testing.assert_close(experts.b13[3, :inter], stored["model.layers.1.mlp.experts.gate_up_proj_bias"][3, 0::2])
    assert lm.model.attention_sinks


def test_gpt_oss_mxfp4_checkpoints_are_refused_by_name(moe_folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mxfp4"
    shutil.copytree(moe_folders["gpt_oss"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(8, 64, 2, 16, dtype=torch.uint8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="gate_up_proj_blocks.*MXFP4"):
        get_model(str(folder), dtype="float32")


def test_gpt_oss_stacked_tensor_of_the_wrong_shape_is_named(moe_folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(moe_folders["gpt_oss"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj"] = tensors["model.layers.0.mlp.experts.down_proj"][:7].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts.down_proj' has shape"):
        get_model(str(folder), dtype="float32")


def test_missing_expert_tensor_is_named(moe_folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "missing"
    shutil.copytree(moe_folders["mixtral"], folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.6.w3.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="experts.6.w3.weight"):
        get_model(str(folder), dtype="float32")


def test_router_top_k_beyond_the_experts_is_refused_at_load(moe_folders, tmp_path):
    import shutil

    folder = tmp_path / "topk"
    shutil.copytree(moe_folders["qwen3_moe"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_experts_per_tok"] = 99
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        get_model(str(folder), dtype="float32")


def test_cuda_graphs_name_the_grouped_experts_as_the_blocker(moe_folders):
    lm = get_model(moe_folders["mixtral"], dtype="float32")
    lm.graph_buckets = [1]
    lm.device = torch.device("cuda")  # the reason is read before any capture, device or not
    reason = lm.graphs_off_reason()
    assert reason is not None
    if lm.attention.graph_safe:
        assert "mixture-of-experts" in reason


@pytest.mark.parametrize("scheme", ["FP8-weight-only", "FP8_DYNAMIC"])
def test_fp8_experts_load_through_the_loader_factory(moe_folders, tmp_path, scheme):
    """An llmcompressor-style FP8 checkpoint of Qwen3-MoE (every expert quantized, per-channel
    e4m3): weight-only gives the prompt log-probs of the dequantized dense checkpoint; FP8_DYNAMIC
    also rounds every expert's inputs per token, as it declares."""
    from helpers import prompt_logprobs, write_model_folder
    from safetensors.torch import load_file
    from test_fp8_activations import CHECKPOINTS, ct_quantization_config, quantize_weight

    from pathlib import Path

    folder = Path(moe_folders["qwen3_moe"])
    state = load_file(f"{folder}/model.safetensors")
    config = json.loads(open(f"{folder}/config.json").read())
    strategy, acts, _, _ = CHECKPOINTS[scheme]
    quantized, dense = {}, {}
    for name, tensor in state.items():
        if not name.endswith("_proj.weight"):
            quantized[name] = dense[name] = tensor
            continue
        w8, scale, dequantized = quantize_weight(tensor, strategy)
        quantized |= {name: w8, f"{name.removesuffix('.weight')}.weight_scale": scale}
        dense[name] = dequantized
    assert sum(".experts." in n and n.endswith("weight_scale") for n in quantized) == 2 * 8 * 3
    qc = {"quantization_config": ct_quantization_config({"strategy": strategy}, acts)}
    fp8 = get_model(str(write_model_folder(tmp_path / "fp8", folder, quantized, config | qc)), dtype="float32")
    reference = get_model(str(write_model_folder(tmp_path / "dense", folder, dense, config)), dtype="float32")
    experts = fp8.model.layers[0].mlp.experts
    computes = experts.gate_up[0].linear.computes
    gap = (prompt_logprobs(fp8) - prompt_logprobs(reference)).abs().max().item()
    if scheme == "FP8-weight-only":
        assert "not quantized" in computes and gap < 1e-4, (computes, gap)
    else:
        assert "emulated on CPU" in computes and gap > 1e-3, (computes, gap)
