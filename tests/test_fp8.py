"""FP8 (e4m3) checkpoints and `--quantize fp8`: configs, loaders, kernels, end to end.

The test-side writer below lays tensors out as the published tools do (AutoFP8 / vLLM
per-tensor scales, fbgemm per-channel [N, 1], DeepSeek-V3 / transformers block
`weight_scale_inv` with weight_block_size [128, 128], compressed-tensors float-quantized)
and computes the dequantized weights with torch's own e4m3 cast, independently of the
server. Loaded weights must equal those exactly, at every world size: a rank boundary
inside a 128-block, a block spanning two fused parts, per-tensor parts fused into one
matmul. Layers and models compute the input quantization each checkpoint declares
(test_fp8_activations.py has its reference, and checks it against transformers). Only the
CUDA _scaled_mm check needs a GPU; its scaling logic also runs on the CPU here through
torch's CPU _scaled_mm.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (METHODS, PROMPTS, greedy, join_shards, kernel_names, load_qkv, prompt_logprobs,
                     qkv_of, run_ranks, write_checkpoint, write_model_folder)
from safetensors.torch import load_file, save_file
from test_fp8_activations import formula, hf_model, hf_prompt_logprobs, hook_declared_inputs

from text_generation_server.kernels.base import NoKernelError
from text_generation_server.kernels.fp8 import (
    Fp8DequantLinear,
    Fp8ScaledMMLinear,
    Fp8Weight,
    dequantize_fp8,
    fp8_to_float32,
)
from text_generation_server.kernels.select import DISABLE_ENV, build_linear, choose_kernel
from text_generation_server.kernels.table import TABLES
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.factory import get_loader, read_quantization_config
from text_generation_server.quantizers.config import CompressedTensorsConfig
from text_generation_server.quantizers.fp8 import Fp8Config, fp8_scheme
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError, DictTensorSource
from text_generation_server.quantizers.weights import Weights

torch.set_num_threads(1)

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0


# -- test-side writer ------------------------------------------------------------------------
def _nonzero(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def scales_of(w: torch.Tensor, kind: str, block=(128, 128)) -> torch.Tensor:
    """How the tools pick scales: max |w| / 448 per tensor, per output row, or per block."""
    if kind == "tensor":
        return _nonzero(w.abs().max())
    if kind == "channel":
        return _nonzero(w.abs().amax(dim=1, keepdim=True))
    (n, k), (bn, bk) = w.shape, block
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w.abs()
    return _nonzero(padded.view(-1, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3)))


def expand(scale: torch.Tensor, n: int, k: int, kind: str, block=(128, 128)) -> torch.Tensor:
    """Every weight's own scale, [N, K]."""
    if kind == "block":
        return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return scale.reshape(-1, 1).expand(n, k) if kind == "channel" else scale.reshape(1, 1).expand(n, k)


# layout -> (scale kind, scale tensor name, stored scale shape, static input scale shape or None)
LAYOUTS = {
    "fp8-tensor": ("tensor", "weight_scale", (), None),  # AutoFP8 dynamic
    "fp8-tensor-static": ("tensor", "weight_scale", (), ()),  # AutoFP8 static
    "fp8-channel": ("channel", "weight_scale", "N1", None),
    "fp8-block": ("block", "weight_scale_inv", None, None),  # DeepSeek-V3 / transformers FineGrainedFP8
    "fbgemm": ("channel", "weight_scale", "N1", None),  # Meta Llama 3.1 FP8
    "ct-tensor-static": ("tensor", "weight_scale", (1,), (1,)),  # compressed-tensors FP8
    "ct-channel": ("channel", "weight_scale", "N1", None),  # FP8_DYNAMIC
    "ct-block": ("block", "weight_scale", None, None),  # FP8_BLOCK
}


def ct_config(strategy: str, acts: dict | None, ignore=("lm_head",)) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
               "group_size": None, "observer": "minmax"}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}}}


STATIC_ACTS = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
TOKEN_ACTS = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
GROUP_ACTS = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "symmetric": True,
              "dynamic": True}

# The quantization_config each published tool writes for a layout.
QCONFIGS = {
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]},
    "fp8-tensor-static": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    "fp8-channel": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]},
    "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
    "ct-tensor-static": ct_config("tensor", STATIC_ACTS),
    "ct-channel": ct_config("channel", TOKEN_ACTS),
    "ct-block": ct_config("block", GROUP_ACTS),
}


def fp8_pack(prefix: str, w: torch.Tensor, layout: str, input_scale: float = 0.02
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors, dequantized float32 [N, K]) of one linear."""
    kind, scale_name, shape, input_shape = LAYOUTS[layout]
    n, k = w.shape
    scale = scales_of(w.float(), kind).float()
    full = expand(scale, n, k, kind)
    w8 = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    stored = scale.reshape(shape if shape != "N1" else (n, 1)) if kind != "block" else scale
    tensors = {f"{prefix}.weight": w8, f"{prefix}.{scale_name}": stored.contiguous()}
    if input_shape is not None:
        tensors[f"{prefix}.input_scale"] = torch.full(input_shape, input_scale)
    if layout.startswith("ct-") and kind == "tensor":
        tensors[f"{prefix}.weight_zero_point"] = torch.zeros(1, dtype=E4M3)  # older compressed-tensors store it
    return tensors, w8.float() * full


def config_of(qconfig: dict):
    cls = CompressedTensorsConfig if qconfig["quant_method"] == "compressed-tensors" else Fp8Config
    return cls.from_config(qconfig, "test/config.json", "quantization_config.")


# Fp8Weight.activation -> the kind of input rounding test_fp8_activations.declared_inputs computes
KIND = {"none": "none", "static": "static", "dynamic-token": "token", "dynamic-tensor": "tensor",
        "dynamic-group": "group"}


def declared_matmul(w: Fp8Weight, x: torch.Tensor) -> torch.Tensor:
    """float32 x @ W^T with x rounded as the loaded weight says its checkpoint declares."""
    return formula(w, x, KIND[w.activation], None if w.input_scale is None else float(w.input_scale),
                   w.activation_group_size, w.activation_group_offset)


# -- loader matrix ---------------------------------------------------------------------------
K = 320  # 80 columns per rank at world size 4: row shards cut the 128-column blocks
PARTS = {"q": 192, "k": 96, "v": 96}  # fused qkv: block rows 128..255 span q and k
N = sum(PARTS.values())
WORLDS = [1, 2, 4]


@pytest.fixture(autouse=True)
def fp8_resident(monkeypatch):
    """On CPU fp8-dense (dequantized once at load) ranks first; these tests run the fp8-resident
    kernel the way a user who disables it does (test_cpu_default_dequantizes_once_at_load
    covers the default)."""
    monkeypatch.setenv(DISABLE_ENV, "fp8-dense")


@pytest.fixture(scope="module")
def cases() -> dict:
    out = {}
    for seed, layout in enumerate(LAYOUTS):
        g = torch.Generator().manual_seed(seed)
        tensors, dense = {}, {}
        for i, (prefix, n) in enumerate({**{f"m.{p}": n for p, n in PARTS.items()}, "m.qkv": N}.items()):
            # Rows of very different magnitude, so per-channel and block scales really differ.
            w = torch.randn(n, K, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1)[torch.randperm(n, generator=g)]
            t, d = fp8_pack(prefix, w, layout, input_scale=0.01 * (i + 1))
            tensors |= t
            dense[prefix] = d
        out[layout] = (tensors, dense, config_of(QCONFIGS[layout]))
    return out


def weights_for(tensors: dict, config, rank: int = 0, world: int = 1, dtype=torch.float32) -> Weights:
    return Weights(DictTensorSource(tensors), torch.device("cpu"), dtype, ProcessGroup(rank=rank, size=world),
                   loader=get_loader(config))


def load(case, method: str, rank: int, world: int):
    return load_qkv(weights_for(case[0], case[2], rank, world), method, PARTS)


def reassemble(method: str, shards: list, want: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ranks' dequantized weights put back together, the dense weight they must equal)."""
    world, dense = len(shards), [s.dequantize() for s in shards]
    if method == "row":
        assert all(d.shape == (N, K // world) for d in dense)
    return join_shards(method, dense, PARTS), qkv_of(method, want, PARTS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loader_matrix(cases, layout, method, world):
    case = cases[layout]
    shards = [load(case, method, rank, world) for rank in range(world)]
    assert all(s.fp8.weight.dtype == E4M3 for s in shards)  # resident as fp8
    got, want = reassemble(method, shards, case[1])
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_on_load_loader_matrix(dtype):
    """`--quantize fp8`: per-channel scales of the full rows, so every shard holds the world-1 weights."""
    g = torch.Generator().manual_seed(11)
    dense = {f"m.{p}": (torch.randn(n, K, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1)).to(dtype)
             for p, n in {**PARTS, "qkv": N}.items()}
    want = {}
    for prefix, w in dense.items():
        scale = scales_of(w.float(), "channel")
        want[prefix] = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() * scale
    tensors = {f"{p}.weight": w for p, w in dense.items()}
    config = Fp8Config.for_dense_checkpoint("fp8", Path("dense"))
    for world in WORLDS:
        for method in METHODS:
            shards = [load((tensors, None, config), method, rank, world) for rank in range(world)]
            assert all(s.fp8.weight.dtype == E4M3 and s.fp8.activation == "dynamic-token" for s in shards)
            got, expect = reassemble(method, shards, want)
            assert torch.equal(got, expect), (method, world)
    with pytest.raises(CheckpointError, match=r"tensor 'm\.q\.weight' is float8_e4m3fn .*quantizes float16"):
        weights_for({"m.q.weight": want["m.q"].to(E4M3)}, config).get_weights_col("m.q")


def test_sharded_scales_follow_the_rank(cases):
    # Block: rank 1 of 4 owns input columns 80..159, which straddle column blocks 0 and 1.
    w = load(cases["fp8-block"], "row", rank=1, world=4).fp8
    assert w.scale.shape == (3, 2) and w.col_block[:48].eq(0).all() and w.col_block[48:].eq(1).all()
    # Per-tensor q, k, v fused: one scale per part, i.e. per-channel scales of the fused weight.
    w = load(cases["fp8-tensor"], "multi_col", rank=0, world=2).fp8
    assert w.scale.shape == (3, 1) and w.scale_kind() == "per-channel"
    assert w.row_block.tolist() == [0] * 96 + [1] * 48 + [2] * 48


@pytest.mark.parametrize("layout", ["fp8-tensor-static", "ct-tensor-static"])
def test_static_input_scales(cases, layout):
    """Fused parts take the largest input scale (nothing clips); row shards keep the layer's own."""
    case = cases[layout]
    fused = load(case, "multi_col", 0, 2).fp8
    assert fused.activation == "static" and float(fused.input_scale) == pytest.approx(0.03)  # q 0.01, k 0.02, v 0.03
    assert float(load(case, "row", 1, 2).fp8.input_scale) == pytest.approx(0.04)
    assert load(cases["ct-channel"], "col", 0, 1).fp8.activation == "dynamic-token"
    assert load(cases["fbgemm"], "col", 0, 1).fp8.activation_scale_ub == 1200.0


@pytest.mark.parametrize("layout", ["fp8-tensor", "fp8-block", "ct-channel"])
def test_get_linear_runs_the_declared_model(cases, layout):
    """The loaded weight's kernel: the dequantized weight, fed inputs rounded as declared (per token;
    fp8-block: per token and 128 columns, this rank's columns 160.. lined up with the checkpoint's)."""
    case = cases[layout]
    for dtype in (torch.float32, torch.bfloat16):
        weight = weights_for(case[0], case[2], 1, 2, dtype).get_weights_row("m.qkv")
        bias = torch.randn(N)
        module = weight.get_linear(bias)
        assert module.kernel_name == "fp8-dequant"
        assert module.weight.dtype == E4M3 and module.weight.nbytes == N * K // 2
        # One byte per weight, plus float32 scales and int32 row/column indices.
        assert weight.fp8.nbytes() == N * K // 2 + 4 * weight.fp8.scale.numel() + 4 * (N + K // 2)
        x = torch.randn(3, 5, K // 2)
        want = declared_matmul(weight.fp8, x.to(dtype).reshape(15, -1)).reshape(3, 5, N) + bias.to(dtype).float()
        got = module(x.to(dtype))
        assert got.dtype == dtype
        # bfloat16: the float32 result rounded, and rounded again with the bias added
        torch.testing.assert_close(got.float(), want, rtol=1e-5 if dtype == torch.float32 else 2 ** -7,
                                   atol=1e-4 if dtype == torch.float32 else 1e-2)


def test_dequant_in_row_chunks_is_exact(cases, monkeypatch):
    import text_generation_server.kernels.fp8 as kfp8

    weight = load(cases["fp8-block"], "col_packed", 0, 1)
    monkeypatch.setattr(kfp8, "DEQUANT_CHUNK_BYTES", 37 * K * 4)  # 37 rows: chunks cut the blocks
    module = Fp8DequantLinear(weight.fp8, None, torch.float32)
    assert module.chunk_rows == 37
    rows = torch.cat([module.dequantize_rows(s, min(s + 37, N)) for s in range(0, N, 37)])
    assert torch.equal(rows, weight.dequantize())
    x = torch.randn(4, K)
    torch.testing.assert_close(module(x), declared_matmul(weight.fp8, x), rtol=1e-5, atol=1e-4)
    module.col_block = weight.fp8.col_block  # what CUDA uses for block scales: one gather across K
    assert torch.equal(module.dequantize_rows(0, N), weight.dequantize())


def test_e4m3_table_is_torchs_cast():
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).reshape(16, 16)
    assert torch.equal(fp8_to_float32(codes).isnan(), codes.float().isnan())
    ok = ~codes.float().isnan()
    assert torch.equal(fp8_to_float32(codes)[ok], codes.float()[ok])


# -- kernels ---------------------------------------------------------------------------------
def fp8_weight(n=96, k=100, kind="channel", activation="dynamic-token", input_scale=None, ub=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-1.5, 0, n).unsqueeze(1)
    scale = scales_of(w, kind).float()
    w8 = (w / expand(scale, n, k, kind)).to(E4M3)
    grid = scale.reshape(1, 1) if kind == "tensor" else scale.reshape(n, 1) if kind == "channel" else scale
    rows = torch.arange(n) // 128 if kind == "block" else torch.arange(n) if kind == "channel" else torch.zeros(n)
    cols = torch.arange(k) // 128 if kind == "block" else torch.zeros(k)
    return Fp8Weight(w8, grid, rows.int(), cols.int(), activation,
                     None if input_scale is None else torch.tensor(input_scale), ub)


def test_cpu_default_dequantizes_once_at_load(cases, monkeypatch):
    """CPUs have no fp8 arithmetic: by default the weight is dequantized once (dense speed),
    giving exactly what the fp8-resident kernel computes."""
    monkeypatch.delenv(DISABLE_ENV)
    case = cases["fp8-block"]
    weight = weights_for(case[0], case[2], 0, 1, torch.float32).get_weights_row("m.qkv")
    bias = torch.randn(N)
    dense = weight.get_linear(bias)
    assert dense.kernel_name == "fp8-dense" and dense.weight.dtype == torch.float32
    monkeypatch.setenv(DISABLE_ENV, "fp8-dense")
    resident = weight.get_linear(bias)
    assert resident.kernel_name == "fp8-dequant"
    x = torch.randn(5, dense.weight.shape[1])
    torch.testing.assert_close(dense(x), resident(x), atol=1e-5, rtol=1e-5)


def test_kernel_choice():
    cpu = fp8_weight().spec(torch.float32, "cpu")
    kernel, rejected = choose_kernel(cpu)
    assert kernel.name == "fp8-dequant"
    for device, kernels in TABLES.items():  # every other kernel refuses fp8 weights rather than misreading them
        spec = fp8_weight().spec(torch.bfloat16, device)
        for other in kernels:
            if not other.name.startswith("fp8-"):
                assert not other.can_implement(spec)[0], other.name
    cuda = fp8_weight(kind="block", k=384).spec(torch.bfloat16, "cuda")
    kernel, rejected = choose_kernel(cuda)
    reasons = dict(rejected)
    assert kernel.name == "fp8-dequant"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        assert "block weight scales" in reasons["fp8-scaled-mm"]
    else:
        assert "CUDA" in reasons["fp8-scaled-mm"] or "capability" in reasons["fp8-scaled-mm"]
    os.environ[DISABLE_ENV] = "fp8-dense,fp8-dequant"
    with pytest.raises(NoKernelError, match="fp8-dequant: disabled"):
        choose_kernel(cpu)


def emulate_scaled_mm(w: Fp8Weight, x: torch.Tensor) -> torch.Tensor:
    """What fp8-scaled-mm must compute: inputs rounded to e4m3 with the documented scales."""
    if w.activation == "static":
        sa = w.input_scale.reshape(1, 1)
    elif w.activation == "dynamic-tensor":
        sa = x.abs().max().reshape(1, 1) / FP8_MAX
    else:
        amax = x.abs().amax(dim=1, keepdim=True)
        sa = (amax if w.activation_scale_ub is None else amax.clamp(max=w.activation_scale_ub)) / FP8_MAX
    xq = (x / sa).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() * sa
    return xq @ dequantize_fp8(w).t()


SCALED_MM_CASES = {
    "tensor-static": dict(kind="tensor", activation="static", input_scale=0.01),  # tensorwise path
    "tensor-dynamic-tensor": dict(kind="tensor", activation="dynamic-tensor"),
    "channel-static": dict(kind="channel", activation="static", input_scale=0.01),  # rowwise path
    "channel-token": dict(kind="channel"),
    "channel-token-ub": dict(kind="channel", ub=1.0),
    "aligned": dict(n=64, k=128, kind="channel"),
}


@pytest.mark.parametrize("name", list(SCALED_MM_CASES))
def test_scaled_mm_module_on_cpu(name):
    """fp8-scaled-mm's quantization, padding and scale plumbing, run on torch's CPU _scaled_mm."""
    w = fp8_weight(**SCALED_MM_CASES[name])
    n, k = w.shape
    x = torch.randn(7, k) * 2
    x[3] *= 20  # one loud token: the ub case caps its scale (and saturates it)
    bias = torch.randn(n)
    for dtype in (torch.float32, torch.bfloat16):
        module = Fp8ScaledMMLinear(w, bias, dtype)
        assert module.weight.shape == (-(-n // 16) * 16, -(-k // 16) * 16) and module.weight.dtype == E4M3
        got = module(x.to(dtype)).float()
        want = emulate_scaled_mm(w, x.to(dtype).float()) + bias.to(dtype).float()
        assert got.shape == (7, n)
        assert ((got - want).norm() / want.norm()) < 1e-2, name


def test_activation_scale_ub_caps_loud_tokens():
    w = fp8_weight(kind="channel", ub=1.0)
    x = torch.randn(2, w.shape[1]) * 0.1
    x[1] *= 1000
    q, scales = Fp8ScaledMMLinear(w, None, torch.float32).quantize_input(x)
    assert scales[1].item() == pytest.approx(1.0 / FP8_MAX, rel=1e-6)  # capped: the loud token saturates
    assert scales[0].item() == pytest.approx(x[0].abs().max().item() / FP8_MAX, rel=1e-6)
    assert q[1].float().abs().max() == FP8_MAX and q.shape == (2, 112)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="torch._scaled_mm needs a CUDA GPU with compute capability >= 8.9")
@pytest.mark.parametrize("name", list(SCALED_MM_CASES))
def test_scaled_mm_kernel_on_cuda(name):
    w = fp8_weight(**SCALED_MM_CASES[name])
    cuda = Fp8Weight(w.weight.cuda(), w.scale.cuda(), w.row_block.cuda(), w.col_block.cuda(), w.activation,
                     None if w.input_scale is None else w.input_scale.cuda(), w.activation_scale_ub)
    x = torch.randn(33, w.shape[1], device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        module = build_linear(cuda, None, dtype, "cuda")
        assert module.kernel_name == "fp8-scaled-mm"
        got = module(x.to(dtype)).float().cpu()
        dequant = Fp8DequantLinear(cuda, None, dtype)(x.to(dtype)).float().cpu()
        want = emulate_scaled_mm(w, x.to(dtype).float().cpu())
        assert (got - want).norm() / want.norm() < 1e-2
        assert (got - dequant).norm() / dequant.norm() < 0.1  # fp8 activations against exact ones


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dequant_kernel_on_cuda_block_scales():
    w = fp8_weight(n=300, k=400, kind="block")
    cuda = Fp8Weight(w.weight.cuda(), w.scale.cuda(), w.row_block.cuda(), w.col_block.cuda())
    module = build_linear(cuda, None, torch.float32, "cuda")
    assert module.kernel_name == "fp8-dequant" and module.col_block is not None
    x = torch.randn(5, 400)
    torch.testing.assert_close(module(x.cuda()).cpu(), x @ dequantize_fp8(w).t(), rtol=1e-4, atol=1e-4)


# -- configs and bad checkpoints -------------------------------------------------------------
def test_published_configs():
    assert config_of(QCONFIGS["fp8-block"]).weight_block_size == (128, 128)
    cfg = config_of(QCONFIGS["fp8-tensor-static"])
    assert cfg.activation_scheme == "static" and not cfg.quantizes("lm_head") and cfg.quantizes("model.layers.0.mlp")
    cfg = config_of(QCONFIGS["fbgemm"])
    assert (cfg.method, cfg.checkpoint_method, cfg.activation_scale_ub) == ("fp8", "fbgemm_fp8", 1200.0)
    scheme = config_of(QCONFIGS["ct-block"]).schemes[0]
    assert (scheme.type, scheme.strategy, scheme.block, scheme.activations, scheme.activation_group_size) == (
        "float", "block", (128, 128), "dynamic-group", 128)
    # transformers' and DeepSeek-V3's fp8 kernels quantize inputs of 128x128-block weights per token and 128 columns.
    block = fp8_scheme(config_of(QCONFIGS["fp8-block"]))
    assert (block.activation, block.activation_group_size) == ("dynamic-group", 128)
    assert fp8_scheme(config_of(QCONFIGS["fp8-tensor-static"])).activation == "static"
    assert config_of(QCONFIGS["ct-tensor-static"]).schemes[0].activations == "static"
    assert config_of(ct_config("channel", None)).schemes[0].activations is None  # W8A16 fp8
    assert "float-quantized fp8 block 128x128" in config_of(QCONFIGS["ct-block"]).describe()


QC = r"config\.json: 'quantization_config\."
CTW = QC + r"config_groups\.group_0\.weights\."
BAD_CONFIGS = {
    "block-one-int": (QCONFIGS["fp8-block"] | {"weight_block_size": [128]}, QC + r"weight_block_size' must be two"),
    "block-zero": (QCONFIGS["fp8-block"] | {"weight_block_size": [0, 128]}, QC + r"weight_block_size' must be two"),
    "block-string": (QCONFIGS["fp8-block"] | {"weight_block_size": "128"}, QC + r"weight_block_size' must be two"),
    "scheme": (QCONFIGS["fp8-tensor"] | {"activation_scheme": "sometimes"},
               QC + r"activation_scheme' = 'sometimes' is not yet supported for fp8 \(supported: static, dynamic\)"),
    "e5m2": (QCONFIGS["fp8-tensor"] | {"fmt": "e5m2"}, QC + r"fmt' = 'e5m2' is not yet supported"),
    "ub-negative": (QCONFIGS["fbgemm"] | {"activation_scale_ub": -1}, QC + r"activation_scale_ub' must be a positive"),
    "ub-string": (QCONFIGS["fbgemm"] | {"activation_scale_ub": "big"}, QC + r"activation_scale_ub' must be a positive"),
    "ct-group": (ct_config("group", None), CTW + r"strategy' = 'group' is not yet supported for compressed-tensors "
                                                 r"float-quantized \(supported: tensor, channel, block\)"),
    "ct-block-structure": (ct_config("block", None) | {"config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
        CTW + r"block_structure' must be two positive integers"),
    "ct-group-acts-no-size": (ct_config("block", {k: v for k, v in GROUP_ACTS.items() if k != "group_size"}),
                              QC + r"config_groups\.group_0\.input_activations\.group_size' is required"),
    "ct-static-token": (ct_config("channel", STATIC_ACTS | {"strategy": "token"}),
                        QC + r"config_groups\.group_0\.input_activations\.strategy' = 'token' is not yet supported"),
    "ct-asym": (ct_config("tensor", None) | {"config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": False}}}},
        CTW + r"symmetric' = False is not yet supported"),
    "ct-int-in-float-format": (ct_config("channel", None) | {"config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
        CTW + r"type' = 'int' is not yet supported for compressed-tensors float-quantized \(supported: float\)"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_configs_name_the_key(tmp_path, name):
    config, message = BAD_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    with pytest.raises(CheckpointError, match=message):
        read_quantization_config(tmp_path, None)


def _bad(tensors: dict, **changes) -> dict:
    out = dict(tensors)
    for key, value in changes.items():
        key = "m.q." + key
        if value is None:
            del out[key]
        else:
            out[key] = value
    return out


BAD_TENSORS = {
    "weight-not-fp8": ("fp8-tensor", dict(weight=torch.zeros(192, K, dtype=torch.bfloat16)),
                       r"tensor 'm\.q\.weight' is bfloat16 .* expected float8_e4m3fn"),
    "e5m2-weight": ("fp8-channel", dict(weight=torch.zeros(192, K, dtype=torch.float8_e5m2)),
                    r"tensor 'm\.q\.weight' is float8_e5m2"),
    "missing-scale": ("fp8-tensor", dict(weight_scale=None), r"tensor 'm\.q\.weight_scale' not found"),
    "missing-block-scale": ("fp8-block", dict(weight_scale_inv=None), r"tensor 'm\.q\.weight_scale_inv' not found"),
    "block-scale-shape": ("fp8-block", dict(weight_scale_inv=torch.ones(2, 2)),
                          r"tensor 'm\.q\.weight_scale_inv' has shape \[2, 2\] .*expected \[2, 3\] for blocks of "
                          r"128x128 to match 'm\.q\.weight' \[192, 320\]"),
    "channel-scale-shape": ("ct-channel", dict(weight_scale=torch.ones(191, 1)),
                            r"tensor 'm\.q\.weight_scale' has shape \[191, 1\].* expected \[192, 1\]"),
    "scale-neither": ("fp8-channel", dict(weight_scale=torch.ones(3)),
                      r"tensor 'm\.q\.weight_scale' has shape \[3\].*per channel\) or a single value"),
    "missing-input-scale": ("fp8-tensor-static", dict(input_scale=None),
                            r"tensor 'm\.q\.input_scale' not found .*static activation"),
    "input-scale-vector": ("ct-tensor-static", dict(input_scale=torch.ones(4)),
                           r"tensor 'm\.q\.input_scale' must hold one positive float"),
    "zero-point": ("ct-tensor-static", dict(weight_zero_point=torch.ones(1)),
                   r"tensor 'm\.q\.weight_zero_point' holds non-zero zero points"),
}


@pytest.mark.parametrize("name", list(BAD_TENSORS))
def test_bad_tensors_name_the_tensor(cases, name):
    layout, changes, message = BAD_TENSORS[name]
    tensors, _, config = cases[layout]
    weights = weights_for(_bad(tensors, **changes), config)
    with pytest.raises(CheckpointError, match=message):
        weights.get_weights_col("m.q")
    with pytest.raises(CheckpointError, match=r"320 input features do not divide into 3 shards"):
        weights_for(tensors, config, 0, 3).get_weights_row("m.q")


# -- end to end ------------------------------------------------------------------------------
SHAPE = dict(hidden_size=192, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.qkv_proj", "mlp.gate_up_proj")
DENSE_MLP1 = ["model.layers.1.mlp"]
# name -> (architecture, layout, quantization_config, modules left dense)
VARIANTS = {
    "autofp8-static-tensor": ("llama", "fp8-tensor-static", QCONFIGS["fp8-tensor-static"], ()),
    "deepseek-block": ("llama", "fp8-block",
                       QCONFIGS["fp8-block"] | {"modules_to_not_convert": DENSE_MLP1}, DENSE_MLP1),
    "fbgemm-channel": ("llama", "fbgemm", QCONFIGS["fbgemm"], ()),
    "ct-fp8-dynamic": ("llama", "ct-channel", QCONFIGS["ct-channel"], ()),
    "ct-fp8-block-phi3": ("phi3_fused", "ct-block", ct_config("block", GROUP_ACTS, ["lm_head", *DENSE_MLP1]),
                          DENSE_MLP1),
}


def write_variant(original: Path, folder: Path, reference: Path, layout: str, qconfig: dict | None,
                  dense_prefixes=(), seed: int = 0) -> None:
    """`folder`: the fp8 checkpoint (None layout: `reference` only); `reference`: dequantized weights."""
    state = load_file(str(original / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    quantized, dense = {}, {}
    input_scales: dict[tuple[str, str], float] = {}  # linears that read one input share its calibrated scale
    for name, tensor in state.items():
        prefix = name.removesuffix(".weight")
        kind = prefix.split(".", 3)[-1] if prefix.startswith("model.layers.") else None
        if kind not in LINEARS or any(prefix.startswith(d) for d in dense_prefixes):
            # What the tools store for what they leave dense; on load, the checkpoint's own tensors.
            quantized[name] = dense[name] = tensor if layout == "on-load" else tensor.half()
            continue
        if layout == "on-load":
            # What `--quantize fp8` must produce: per-channel e4m3 of the stored weights.
            scale = scales_of(tensor.float(), "channel")
            dense[name] = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float() * scale
            continue
        reads = {"q": "attn", "k": "attn", "v": "attn", "qkv": "attn", "gate": "mlp", "up": "mlp", "gate_up": "mlp"}
        key = (prefix.rsplit(".", 2)[0], reads.get(kind.split(".")[-1].removesuffix("_proj"), kind))
        scale = input_scales.setdefault(key, float(torch.rand((), generator=g)) * 0.05 + 0.01)
        t, d = fp8_pack(prefix, tensor.float(), layout, input_scale=scale)
        quantized |= t
        dense[name] = d
    outputs = [(reference, dense)] + ([] if layout == "on-load" else [(folder, quantized)])
    config = json.loads((original / "config.json").read_text())
    for out, tensors in outputs:
        qc = {"quantization_config": qconfig} if out == folder else {}
        write_model_folder(out, original, tensors, config | {"torch_dtype": "float16"} | qc)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_e2e")
    out = {}
    for arch in ("llama", "phi3_fused"):
        write_checkpoint(root / arch, arch, seed=7, **SHAPE)
        out[arch] = root / arch
    write_checkpoint(root / "llama-bf16", "llama", seed=7, dtype=torch.bfloat16, **SHAPE)
    out["llama-bf16"] = root / "llama-bf16"
    for seed, (name, (arch, layout, qconfig, dense)) in enumerate(VARIANTS.items()):
        write_variant(out[arch], root / name, root / f"{name}.dense", layout, qconfig, dense, seed)
        out[name], out[f"{name}.dense"] = root / name, root / f"{name}.dense"
    for arch in ("llama", "llama-bf16"):
        write_variant(out[arch], out[arch], root / f"{arch}.on-load.dense", "on-load", None)
        out[f"{arch}.on-load.dense"] = root / f"{arch}.on-load.dense"
    return out


@pytest.fixture(scope="module")
def original_logprobs(folders) -> dict[str, torch.Tensor]:
    return {arch: prompt_logprobs(get_model(str(folders[arch]), dtype="float32"))
            for arch in ("llama", "phi3_fused", "llama-bf16")}


FP8_ERROR = 0.05  # mean |logprob difference| against the unquantized model
# layout -> the input rounding its checkpoint declares (test_fp8_activations.declared_inputs' kind, group)
DECLARED = {"fp8-tensor-static": ("static", None), "fp8-block": ("group", 128), "fbgemm": ("token", None),
            "ct-channel": ("token", None), "ct-block": ("group", 128), "on-load": ("token", None)}


def declared_logprobs(lm, dense_folder: Path, layout: str, fp8_folder: Path | None = None,
                      dense_prefixes=(), world: int = 1) -> torch.Tensor:
    """prompt_logprobs(lm) as transformers computes them for the dequantized weights with the
    declared input rounding (static scales read from the fp8 checkpoint's input_scale tensors);
    world > 1: dynamic scales of the row-parallel layers from each rank's columns."""
    kind, group = DECLARED[layout]
    scales = None
    if kind == "static":
        scales = {name.removesuffix(".input_scale"): float(t) for name, t in
                  load_file(str(fp8_folder / "model.safetensors")).items() if name.endswith(".input_scale")}
    model = hf_model(dense_folder)
    assert hook_declared_inputs(model, kind, scales, group, tuple(dense_prefixes), world) > 0
    return torch.cat([hf_prompt_logprobs(model, lm.tokenizer.encode(p).ids) for p in PROMPTS])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_checkpoint_computes_its_declared_model(folders, original_logprobs, name, torch_pointwise):
    """The dequantized weights, fed inputs rounded to e4m3 as the checkpoint declares."""
    arch, layout, _, dense = VARIANTS[name]
    lm = get_model(str(folders[name]), dtype="float32")
    assert lm.quantize in ("fp8", "compressed-tensors")
    kernels = kernel_names(lm)
    assert set(kernels.values()) <= {"fp8-dequant", "dense"} and "fp8-dequant" in kernels.values()
    if dense:
        assert kernels["layers.1.mlp.down.linear"] == "dense" and kernels["layers.0.mlp.down.linear"] == "fp8-dequant"
    got = prompt_logprobs(lm)
    want = declared_logprobs(lm, folders[f"{name}.dense"], layout, folders[name], dense)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    error = (got - original_logprobs[arch]).abs().mean().item()
    assert 0 < error < FP8_ERROR, error


@pytest.mark.parametrize("arch", ["llama", "llama-bf16"])
def test_quantize_fp8_on_load(folders, original_logprobs, arch, torch_pointwise):
    cfg = read_quantization_config(folders[arch], "fp8")
    assert isinstance(cfg, Fp8Config) and cfg.quantize_on_load and "quantized on load" in cfg.describe()
    lm = get_model(str(folders[arch]), dtype="float32", quantize="fp8")
    assert lm.quantize == "fp8"
    linear = lm.model.layers[0].mlp.down.linear
    assert linear.kernel_name == "fp8-dequant" and linear.weight.dtype == E4M3
    assert "fp8 per-token dynamic activations (emulated on CPU)" in linear.computes
    got = prompt_logprobs(lm)
    # `--quantize fp8` declares per-token dynamic inputs, as fp8-scaled-mm computes them on a GPU.
    want = declared_logprobs(lm, folders[f"{arch}.on-load.dense"], "on-load")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    error = (got - original_logprobs[arch]).abs().mean().item()
    assert 0 < error < FP8_ERROR, error


def test_quantize_flag(folders, tmp_path):
    assert get_model(str(folders["fbgemm-channel"]), quantize="fp8").quantize == "fp8"
    # A compressed-tensors float-quantized checkpoint is fp8 too; it loads as the config it is.
    assert get_model(str(folders["ct-fp8-dynamic"]), quantize="fp8").quantize == "compressed-tensors"
    assert read_quantization_config(folders["deepseek-block"], "fbgemm_fp8").weight_block_size == (128, 128)
    gptq = tmp_path / "gptq"
    shutil.copytree(folders["llama"], gptq)
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"--quantize fp8 disagrees with the checkpoint: .*config\.json says "
                                              r"'quantization_config\.quant_method' = 'gptq'"):
        get_model(str(gptq), quantize="fp8")
    # A GPTQ checkpoint without a config (parameters in gptq_bits tensors) is not dense either.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    save_file({"gptq_bits": torch.tensor([4]), "m.qweight": torch.zeros(4, 8, dtype=torch.int32)},
              str(legacy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"--quantize fp8: .*legacy holds quantized tensors \('gptq_bits'\)"):
        read_quantization_config(legacy, "fp8")


def test_bfloat16_activations(folders, torch_pointwise):
    """bfloat16 activations stay within bfloat16's reach of the float32 declared model."""
    lm = get_model(str(folders["ct-fp8-block-phi3"]), dtype="bfloat16")
    got = prompt_logprobs(lm)
    want = declared_logprobs(lm, folders["ct-fp8-block-phi3.dense"], "ct-block", dense_prefixes=DENSE_MLP1)
    assert torch.isfinite(got).all() and (got - want).abs().max() < 0.1, (got - want).abs().max()


# -- world size 2 ------------------------------------------------------------------------------
WORLD = 2
SPAWN_TIMEOUT_S = 180
TOKENS = 6  # greedy tokens compared


def _rank_main(pg, runs: dict[str, tuple[str, str | None]]) -> dict:
    results = {}
    for name, (folder, quantize) in runs.items():
        lm = get_model(folder, dtype="float32", process_group=pg, quantize=quantize)
        results[name] = {"logprobs": prompt_logprobs(lm), "tokens": greedy(lm, TOKENS)}
    return results


def world2_runs(folders) -> dict[str, tuple[str, str | None]]:
    return {name: (str(folders[name]), None) for name in VARIANTS} | {"on-load": (str(folders["llama"]), "fp8")}


@pytest.fixture(scope="module")
def world2(folders, tmp_path_factory) -> list[dict]:
    from text_generation_server.kernels import cpu_pointwise

    with pytest.MonkeyPatch.context() as patch:  # the ranks' norms as torch_pointwise's (conftest.py)
        patch.setenv(cpu_pointwise.ENV, "0")
        return run_ranks(_rank_main, (world2_runs(folders),), WORLD, tmp_path_factory.mktemp("fp8_tp"),
                         SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("name", [*VARIANTS, "on-load"])
def test_world_size_2_matches_world_size_1(folders, world2, name, torch_pointwise):
    """Block scales cut by the rank boundary (q rows 96.., o_proj/down_proj columns 96..) included.

    Dynamic input scales of a row-parallel layer (o_proj, down_proj) come from each rank's own
    columns, as on GPUs (and in vLLM): per-token and per-group (where the boundary cuts a 128-column
    group) scales then differ from world size 1's. Those models equal transformers' with that
    rounding, and stay close to world size 1."""
    folder, quantize = world2_runs(folders)[name]
    _, layout, _, dense = VARIANTS.get(name, ("llama", "on-load", None, ()))
    lm = get_model(folder, dtype="float32", quantize=quantize)
    want_logprobs, want_tokens = prompt_logprobs(lm), greedy(lm, TOKENS)
    dynamic = DECLARED[layout][0] in ("token", "group")
    if dynamic:
        dense_folder = folders[f"{name}.dense" if name in VARIANTS else "llama.on-load.dense"]
        sharded = declared_logprobs(lm, dense_folder, layout, folders.get(name), dense, world=WORLD)
    for rank in range(WORLD):
        got = world2[rank][name]
        assert math.isfinite(got["logprobs"].sum().item())
        if dynamic:
            torch.testing.assert_close(got["logprobs"], sharded, atol=1e-4, rtol=0)
            assert (got["logprobs"] - want_logprobs).abs().mean() < FP8_ERROR
            continue
        assert got["tokens"] == want_tokens
        torch.testing.assert_close(got["logprobs"], want_logprobs, atol=1e-4, rtol=0)
