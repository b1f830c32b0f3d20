"""--quantize eetq: per-channel symmetric int8 on load, torch's int8 weight-only kernel.

The ground truth is computed here: q = round(W * 127 / absmax_row), W' = q * absmax_row / 127
with the absmax of the full checkpoint row. Every shard at world sizes 1, 2 and 4 must
reassemble into exactly that (row-parallel shards included: their scales come from the full
rows), and a tiny Llama quantized on load must compute what a dense checkpoint of W' computes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import (METHODS, MODE_ATOL, assert_bfloat16_close, fast_kernels, join_shards, kernel_modes, kernels_used,
                     load_qkv, prompt_logprobs, run_ranks, write_checkpoint)
from safetensors.torch import load_file, save_file

from text_generation_server.kernels.base import dequantize
from text_generation_server.kernels.select import DISABLE_ENV
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.factory import get_loader, read_quantization_config
from text_generation_server.quantizers.eetq import ChannelInt8Weight, EetqConfig
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError, DictTensorSource
from text_generation_server.quantizers.weights import Weights

torch.set_num_threads(1)

K = 384
PARTS = {"q": 256, "k": 128, "v": 128}
N = sum(PARTS.values())
WORLDS = [1, 2, 4]
CONFIG = EetqConfig(source="test")


def int8_reference(w: torch.Tensor) -> torch.Tensor:
    """Per-channel symmetric int8 over the full row, dequantized (float32)."""
    absmax = w.float().abs().amax(dim=1, keepdim=True)
    return torch.round(w.float() * (127 / absmax)).clamp(-127, 127) * (absmax / 127)


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for prefix, n in ({f"m.{p}": n for p, n in PARTS.items()} | {"m.qkv": N}).items():
        w = torch.randn(n, K, generator=g) * 0.1
        w[:, 5] = 5.0  # an outlier column: at world size 4 rank 0's row shard holds every row's absmax
        out[f"{prefix}.weight"] = w.half()
    return out


def weights_for(tensors: dict, rank: int = 0, world: int = 1) -> Weights:
    return Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32, ProcessGroup(rank=rank, size=world),
                   loader=get_loader(CONFIG))


def dense_of(w: ChannelInt8Weight) -> torch.Tensor:
    assert isinstance(w, ChannelInt8Weight)
    return dequantize(w.to_quantized())  # the canonical form the int8 kernel and the reference start from


def load(tensors, method: str, rank: int, world: int) -> ChannelInt8Weight:
    return load_qkv(weights_for(tensors, rank, world), method, PARTS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", METHODS)
def test_loader_matrix(tensors, method, world):
    shards = [load(tensors, method, rank, world) for rank in range(world)]
    if method == "row":
        assert all(s.shape == (N, K // world) for s in shards)
    got = join_shards(method, [dense_of(s) for s in shards], PARTS)
    if method == "multi_col":
        want = torch.cat([int8_reference(tensors[f"m.{p}.weight"]) for p in PARTS])
    else:
        want = int8_reference(tensors["m.qkv.weight"])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_row_shards_use_full_row_scales(tensors):
    full = weights_for(tensors).get_weights("m.qkv")
    for rank in range(4):
        shard = weights_for(tensors, rank, 4).get_weights_row("m.qkv")
        torch.testing.assert_close(shard.scales, full.scales, rtol=0, atol=0)
        local = tensors["m.qkv.weight"][:, rank * K // 4:(rank + 1) * K // 4].float().abs().amax(dim=1) / 127
        if rank:  # the outlier column lives on rank 0: a rank-local absmax would be far smaller
            assert (local < shard.scales / 5).all()


def test_codes_and_edge_rows():
    w = torch.randn(32, 64)
    w[3] = 0  # an all-zero row: scale 0, codes 0, no NaN
    weight = weights_for({"m.lin.weight": w}).get_weights("m.lin")
    assert weight.qweight.dtype == torch.int8 and int(weight.qweight.abs().max()) == 127
    assert weight.scales[3] == 0 and not weight.qweight[3].any()
    torch.testing.assert_close(dense_of(weight), torch.nan_to_num(int8_reference(w)), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("k,kernel", [(64, "cpu-int8"), (100, "reference")])  # cpu-int8 needs K % 16 == 0
def test_linear_runs_on_the_int8_kernel(k, kernel, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    w = torch.randn(48, k)
    weight = weights_for({"m.lin.weight": w}).get_weights("m.lin")
    bias = torch.randn(48)
    module = weight.get_linear(bias)
    assert module.kernel_name == kernel
    x = torch.randn(2, 3, k)
    want = x @ dense_of(weight).t() + bias
    assert ((module(x) - want).norm() / want.norm()).item() < (1e-2 if kernel == "cpu-int8" else 1e-6)


def test_bad_tensors_name_the_tensor():
    with pytest.raises(CheckpointError, match=r"tensor 'm\.lin\.weight' is torch\.int8 \[8, 16\] \(in <memory>\): "
                                              r"quantizing on load needs a dense"):
        weights_for({"m.lin.weight": torch.zeros(8, 16, dtype=torch.int8)}).get_weights("m.lin")
    with pytest.raises(CheckpointError, match=r"tensor 'm\.lin\.weight' has shape \[8\]"):
        weights_for({"m.lin.weight": torch.zeros(8)}, rank=1, world=2).get_weights_row("m.lin")
    with pytest.raises(CheckpointError, match=r"tensor 'm\.other\.weight' not found"):
        weights_for({"m.lin.weight": torch.zeros(8, 16)}).get_weights_col("m.other")
    with pytest.raises(CheckpointError,
                       match=r"tensor 'm\.lin\.weight': 30 input features do not divide into 4 shards"):
        weights_for({"m.lin.weight": torch.zeros(8, 30)}, rank=1, world=4).get_weights_row("m.lin")


def test_config(tmp_path):
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(2)}, str(dense / "model.safetensors"))
    config = read_quantization_config(dense, "eetq")
    assert isinstance(config, EetqConfig) and config.on_load and "quantized on load" in config.describe()
    assert isinstance(read_quantization_config(dense, "EETQ"), EetqConfig)
    pre = tmp_path / "pre"
    pre.mkdir()
    config = {"model_type": "llama", "quantization_config": {"quant_method": "eetq"}}
    (pre / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.zeros(2)}, str(pre / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"config\.json: 'quantization_config\.quant_method' = 'eetq': "
                                              r"pre-quantized EETQ checkpoints are not yet supported"):
        read_quantization_config(pre, None)


# -- end to end -------------------------------------------------------------------------------------
SHAPE = dict(hidden_size=192, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
WORLD = 2
SPAWN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The dense checkpoint, and the same with every linear replaced by its int8 dequantization."""
    root = tmp_path_factory.mktemp("eetq_e2e")
    original = root / "llama"
    write_checkpoint(original, "llama", seed=3, **SHAPE)
    state = load_file(str(original / "model.safetensors"))
    ref = root / "ref"
    ref.mkdir()
    for name in ("tokenizer.json", "generation_config.json", "config.json"):
        (ref / name).write_bytes((original / name).read_bytes())
    linear = lambda key: key.startswith("model.layers.") and key.removesuffix(".weight").split(".", 3)[-1] in LINEARS
    save_file({k: int8_reference(v) if linear(k) else v for k, v in state.items()}, str(ref / "model.safetensors"))
    return {"original": original, "ref": ref}


@pytest.mark.parametrize("mode", ["reference", "chosen"])
def test_eetq_equals_int8_dequant_reference(folders, mode, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, fast_kernels() if mode == "reference" else "")
    lm = get_model(str(folders["original"]), dtype="float32", quantize="eetq")
    assert lm.quantize == "eetq"
    assert kernels_used(lm) == ({"reference"} if mode == "reference" else {"cpu-int8"})
    got = prompt_logprobs(lm)
    want = prompt_logprobs(get_model(str(folders["ref"]), dtype="float32"))
    if mode == "reference":
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    else:  # torch's int8 kernel runs bf16 activations
        assert (got - want).abs().max() < 0.05
    original = prompt_logprobs(get_model(str(folders["original"]), dtype="float32"))
    assert 0 < (got - original).abs().mean() < 0.02


def test_bfloat16_model(folders):
    assert_bfloat16_close(get_model(str(folders["original"]), dtype="bfloat16", quantize="eetq"), folders["ref"])


def _rank_main(pg, folder: str) -> dict:
    return {mode: prompt_logprobs(get_model(folder, dtype="float32", quantize="eetq", process_group=pg))
            for mode in kernel_modes()}


def test_world_size_2_matches_world_size_1(folders, tmp_path, monkeypatch):
    """o_proj and down_proj shard their input columns: full-row scales keep every rank on the unsharded grid."""
    ranks = run_ranks(_rank_main, (str(folders["original"]),), WORLD, tmp_path, SPAWN_TIMEOUT_S)
    for mode in kernel_modes(monkeypatch.setenv):
        want = prompt_logprobs(get_model(str(folders["original"]), dtype="float32", quantize="eetq"))
        for rank in range(WORLD):
            assert math.isfinite(ranks[rank][mode].sum().item())
            torch.testing.assert_close(ranks[rank][mode], want, atol=MODE_ATOL[mode], rtol=0)
