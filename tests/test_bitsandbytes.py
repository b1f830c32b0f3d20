"""bitsandbytes: configs, the loader matrix over bitsandbytes' own serialization, kernels, bad
checkpoints, on-load quantization end to end, and two gloo ranks against one.

Pre-quantized tensors are written the way bitsandbytes saves a Linear4bit / Linear8bitLt
(quantize_4bit + QuantState.as_dict(packed=True); int8_vectorwise_quant + SCB), and their
dense ground truth is computed here from the QuantState (bitsandbytes' own nested-absmax
dequantization, the code table it stores). Every shard the server loads, at world sizes 1, 2
and 4, must reassemble into exactly that; on-load quantization must give sharded == unsharded.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import bitsandbytes.functional as bnb_f
import pytest
import torch
from helpers import (METHODS, MODE_ATOL, assert_bfloat16_close, fast_kernels, join_shards, kernel_modes, kernels_used,
                     load_qkv, prompt_logprobs, run_ranks, write_checkpoint, write_model_folder)
from safetensors.torch import load_file, save_file

from text_generation_server.kernels.base import DenseFallbackError, NoKernelError, dequantize
from text_generation_server.kernels.bitsandbytes import (
    BnbCpu4bitKernel,
    BnbMatmul4bitKernel,
    MissingDependencyError,
    _cpu_fused_4bit,
)
from text_generation_server.kernels.select import ALLOW_DENSE_ENV, DISABLE_ENV, choose_kernel
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.factory import get_loader, read_quantization_config
from text_generation_server.quantizers.bitsandbytes import Bnb4bitWeight, BnbConfig
from text_generation_server.quantizers.eetq import ChannelInt8Weight
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError, DictTensorSource
from text_generation_server.quantizers.weights import UnquantizedWeight, Weights

torch.set_num_threads(1)

# -- test-side writer and ground truth --------------------------------------------------------------
DOCUMENTED_4BIT_KEYS = {"weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax",
                        "weight.nested_quant_map", "weight.quant_state.bitsandbytes__{}"}


def bnb4_tensors(prefix: str, w: torch.Tensor, quant_type: str, double_quant: bool,
                 blocksize: int = 64) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What Linear4bit saves for `w`, and the dense weight it stands for."""
    packed, state = bnb_f.quantize_4bit(w.float(), blocksize=blocksize, quant_type=quant_type,
                                        compress_statistics=double_quant)
    tensors = {f"{prefix}.weight": packed}
    tensors |= {f"{prefix}.weight.{k}": v.clone() for k, v in state.as_dict(packed=True).items()}
    return tensors, reference_4bit(packed, state)


def reference_4bit(packed: torch.Tensor, state) -> torch.Tensor:
    """table[code] * absmax over flat blocks, from bitsandbytes' QuantState (nested absmax via bitsandbytes)."""
    absmax = state.absmax
    if state.nested:
        absmax = bnb_f.dequantize_blockwise(state.absmax, state.state2) + state.offset
    n, k = state.shape
    b = packed.reshape(-1)
    codes = torch.stack([b >> 4, b & 0xF], dim=1).reshape(-1)[:n * k].long()
    scale = absmax.float().repeat_interleave(state.blocksize)[:n * k]
    return (state.code.float()[codes] * scale).view(n, k)


def bnb8_tensors(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What Linear8bitLt saves (int8 weight, SCB row absmax, row-major weight_format 0)."""
    codes, scb, _ = bnb_f.int8_vectorwise_quant(w.half())
    tensors = {f"{prefix}.weight": codes, f"{prefix}.SCB": scb,
               f"{prefix}.weight_format": torch.tensor(0, dtype=torch.uint8)}
    return tensors, codes.float() * (scb / 127)[:, None]


def int8_reference(w: torch.Tensor) -> torch.Tensor:
    """Per-channel symmetric int8 on the full-row absmax, dequantized."""
    absmax = w.float().abs().amax(dim=1, keepdim=True)
    return torch.round(w.float() * (127 / absmax)).clamp(-127, 127) * (absmax / 127)


def test_writer_matches_bitsandbytes_modules_and_the_spec():
    import bitsandbytes as bnb

    w = torch.randn(64, 128)
    tensors, _ = bnb4_tensors("m", w, "nf4", double_quant=True)
    assert {k.removeprefix("m.") for k in tensors} == {k.format("nf4") for k in DOCUMENTED_4BIT_KEYS}
    lin = bnb.nn.Linear4bit(128, 64, bias=False, compress_statistics=True, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, compress_statistics=True, quant_type="nf4")
    saved = lin.to("cpu").state_dict()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in saved.items()} == \
        {k.removeprefix("m."): (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    assert torch.equal(saved["weight"], tensors["m.weight"])
    lin8 = bnb.nn.Linear8bitLt(128, 64, bias=False, has_fp16_weights=False)
    lin8.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    saved8 = lin8.to("cpu").state_dict()
    tensors8, _ = bnb8_tensors("m", w)
    assert set(saved8) == {k.removeprefix("m.") for k in tensors8}
    assert torch.equal(saved8["weight"], tensors8["m.weight"])


def test_reference_matches_bitsandbytes_dequantize():
    for quant_type in ("nf4", "fp4"):
        for nested in (False, True):
            packed, state = bnb_f.quantize_4bit(torch.randn(96, 256), quant_type=quant_type, compress_statistics=nested)
            want = bnb_f.dequantize_4bit(packed, state)
            torch.testing.assert_close(reference_4bit(packed, state), want, rtol=0, atol=0)


# -- configs -------------------------------------------------------------------------------------
def hf_config(**kwargs) -> dict:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(**kwargs).to_dict()


def test_config_from_transformers_dicts():
    c = BnbConfig.from_config(hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.bfloat16), "c.json")
    assert (c.kind, c.double_quant, c.compute_dtype, c.prequantized) == ("nf4", True, "bfloat16", True)
    assert BnbConfig.from_config(hf_config(load_in_4bit=True), "c.json").kind == "fp4"  # transformers' default
    c = BnbConfig.from_config(hf_config(load_in_8bit=True, llm_int8_skip_modules=["mlp.down_proj"]), "c.json")
    assert c.kind == "int8" and not c.quantizes("model.layers.3.mlp.down_proj")
    assert c.quantizes("model.layers.3.mlp.up_proj")
    assert c.describe() == "bitsandbytes LLM.int8 (run weight-only)"


@pytest.mark.parametrize("data,error", [
    ({"quant_method": "bitsandbytes"}, r"c\.json: 'load_in_4bit' and 'load_in_8bit': exactly one must be true"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, r"'bnb_4bit_quant_type' = 'int4' is not yet supported"),
    ({"load_in_8bit": True, "llm_int8_has_fp16_weight": True},
     r"'llm_int8_has_fp16_weight' = True is not yet supported"),
    ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "int8"},
     r"'bnb_4bit_compute_dtype' = 'int8' is not yet supported"),
    ({"load_in_4bit": "yes"}, r"'load_in_4bit' must be true or false"),
])
def test_bad_configs(data, error):
    with pytest.raises(CheckpointError, match=error):
        BnbConfig.from_config(data, "c.json")


def write_folder(folder: Path, quantization_config: dict | None, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    config = {"model_type": "llama"} | ({"quantization_config": quantization_config} if quantization_config else {})
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_flags_against_checkpoints(tmp_path):
    int8 = write_folder(tmp_path / "int8", hf_config(load_in_8bit=True), {"w": torch.zeros(2)})
    nf4 = write_folder(tmp_path / "nf4", hf_config(load_in_4bit=True, bnb_4bit_quant_type="nf4"), {"w": torch.zeros(2)})
    dense = write_folder(tmp_path / "dense", None, {"w": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"--quantize bitsandbytes-nf4 disagrees with the checkpoint: "
                                              r".*int8.config\.json says bitsandbytes int8 \(use --quantize "
                                              r"bitsandbytes, or leave"):
        read_quantization_config(int8, "bitsandbytes-nf4")
    with pytest.raises(CheckpointError, match=r"--quantize bitsandbytes-fp4 disagrees .* says bitsandbytes nf4"):
        read_quantization_config(nf4, "bitsandbytes-fp4")
    with pytest.raises(CheckpointError, match=r"--quantize bitsandbytes disagrees .* says bitsandbytes nf4"):
        read_quantization_config(nf4, "bitsandbytes")
    assert read_quantization_config(nf4, "bitsandbytes-nf4").kind == "nf4"
    assert read_quantization_config(int8, None).kind == "int8"
    # What a loaded model reports (`flag`) tells the kinds apart; `method` is the same for all three.
    assert [read_quantization_config(f, None).flag for f in (int8, nf4)] == ["bitsandbytes", "bitsandbytes-nf4"]
    for flag, kind in (("bitsandbytes", "int8"), ("bitsandbytes-nf4", "nf4"), ("Bitsandbytes-FP4", "fp4")):
        config = read_quantization_config(dense, flag)
        assert (config.kind, config.prequantized, config.flag) == (kind, False, flag.lower())
        assert config.method == "bitsandbytes"
    with pytest.raises(CheckpointError, match=r"--quantize eetq disagrees with the checkpoint"):
        read_quantization_config(nf4, "eetq")


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    for kind in ("nf4", "fp4"):
        with pytest.raises(MissingDependencyError, match=r'pip install "text-generation-server\[bnb\]"'):
            get_loader(BnbConfig(source="t", kind=kind))
    # int8 runs on torch's int8 kernel: no bitsandbytes needed.
    tensors, dense = bnb8_tensors("m.lin", torch.randn(32, 64))
    w = Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32,
                loader=get_loader(BnbConfig(source="t", kind="int8"))).get_weights("m.lin")
    torch.testing.assert_close(dense_of(w), dense)


# -- loader matrix --------------------------------------------------------------------------------
WORLDS = [1, 2, 4]


def build_case(name: str, k: int, parts: dict[str, int], seed: int) -> tuple[dict, dict, BnbConfig]:
    """(tensors, dense ground truth per prefix or None for on-load, config) for a fused qkv and its parts."""
    g = torch.Generator().manual_seed(seed)
    shapes = {f"m.{p}": n for p, n in parts.items()} | {"m.qkv": sum(parts.values())}
    tensors, dense = {}, {}
    onload = name.startswith("onload-")
    kind = name.removeprefix("onload-").split("-")[0]
    for prefix, n in shapes.items():
        w = torch.randn(n, k, generator=g) * 0.1
        if onload:
            tensors[f"{prefix}.weight"] = w.half()
        elif kind == "int8":
            t, dense[prefix] = bnb8_tensors(prefix, w)
            tensors |= t
        else:
            t, dense[prefix] = bnb4_tensors(prefix, w, kind, double_quant="-dq" in name)
            tensors |= t
    return tensors, dense, BnbConfig(source="test", kind=kind, prequantized=not onload)


# name -> (K, parts). K = 384: 96 columns per rank at world size 4, so row shards pad to whole blocks;
# K = 100: blocks straddle rows, so some shards run dequantized (still exact).
BIG = (384, {"q": 256, "k": 128, "v": 128})
CASES = {"nf4": BIG, "nf4-dq": BIG, "fp4": BIG, "fp4-dq": BIG, "int8": BIG,
         "nf4-dq-k100": (100, {"q": 64, "k": 32, "v": 32}), "onload-nf4": BIG, "onload-fp4": BIG, "onload-int8": BIG}


@pytest.fixture(scope="module")
def cases() -> dict:
    return {}


def get_case(cases: dict, name: str):
    if name not in cases:
        k, parts = CASES[name]
        cases[name] = build_case(name, k, parts, seed=len(cases))
    return cases[name]


def dense_of(w) -> torch.Tensor:
    if isinstance(w, Bnb4bitWeight):
        return w.dequantize()
    if isinstance(w, ChannelInt8Weight):
        return dequantize(w.to_quantized())  # the canonical form every int kernel starts from
    assert isinstance(w, UnquantizedWeight), type(w)
    return w.weight.float()


def weights_for(tensors: dict, config: BnbConfig, rank: int = 0, world: int = 1) -> Weights:
    return Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32, ProcessGroup(rank=rank, size=world),
                   loader=get_loader(config))


def load(tensors, config, parts, method: str, rank: int, world: int):
    return load_qkv(weights_for(tensors, config, rank, world), method, parts)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(CASES))
def test_loader_matrix(cases, name, method, world):
    tensors, dense, config = get_case(cases, name)
    k, parts = CASES[name]
    n = sum(parts.values())
    weights = [load(tensors, config, parts, method, rank, world) for rank in range(world)]
    for w in weights:
        want_shape = {"full": (n, k), "row": (n, k // world)}.get(method, (n // world, k))
        assert tuple(w.shape) == want_shape
        if k % 64 == 0:  # compact everywhere: no shard falls back to a dense weight
            assert isinstance(w, ChannelInt8Weight if "int8" in name else Bnb4bitWeight), type(w)
    got = join_shards(method, [dense_of(w) for w in weights], parts)
    if config.prequantized:
        want = torch.cat([dense[f"m.{p}"] for p in parts]) if method == "multi_col" else dense["m.qkv"]
    else:  # on load: sharded equals unsharded, which is within quantization error of the checkpoint
        whole = weights_for(tensors, config)
        if method == "multi_col":
            want = torch.cat([dense_of(whole.get_weights(f"m.{p}")) for p in parts])
        else:
            want = dense_of(whole.get_weights("m.qkv"))
        prefixes = [f"m.{p}" for p in parts] if method == "multi_col" else ["m.qkv"]
        original = torch.cat([tensors[f"{p}.weight"] for p in prefixes])
        error = ((want - original.float()).norm() / original.float().norm()).item()
        assert 0 < error < {"int8": 0.01, "nf4": 0.11, "fp4": 0.14}[config.kind], error
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_row_shards_keep_whole_blocks(cases):
    tensors, dense, config = get_case(cases, "nf4-dq")
    # K = 384 at world size 4: rank 1 owns columns 96..191, i.e. blocks 1 and 2 (columns 64..191).
    w = weights_for(tensors, config, rank=1, world=4).get_weights_row("m.qkv")
    assert (w.cols, w.pad, w.shape) == (128, (32, 0), (512, 96))
    w = weights_for(tensors, config, rank=1, world=2).get_weights_row("m.qkv")
    assert (w.cols, w.pad) == (192, (0, 0))


def test_unaligned_shards_warn_and_stay_exact(cases):
    from loguru import logger

    tensors, dense, config = get_case(cases, "nf4-dq-k100")
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        from text_generation_server.quantizers import bitsandbytes as module

        module._WARNED.clear()
        w = weights_for(tensors, config, rank=1, world=4).get_weights_row("m.qkv")
    finally:
        logger.remove(sink)
    assert isinstance(w, UnquantizedWeight)
    torch.testing.assert_close(w.weight, dense["m.qkv"][:, 25:50], rtol=0, atol=0)
    assert any("m.qkv" in line and "dequantized" in line for line in lines), lines


def test_quant_storage_other_than_uint8():
    """bnb_4bit_quant_storage (e.g. bfloat16 for FSDP) only reinterprets the same bytes."""
    w = torch.randn(64, 256)
    packed, state = bnb_f.quantize_4bit(w, quant_type="nf4", quant_storage=torch.bfloat16)
    assert packed.dtype == torch.bfloat16
    tensors = {"m.lin.weight": packed} | {f"m.lin.weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    want = reference_4bit(packed.view(torch.uint8), state)
    config = BnbConfig(source="test", kind="nf4")
    shards = [weights_for(tensors, config, rank, 4).get_weights_row("m.lin") for rank in range(4)]
    torch.testing.assert_close(torch.cat([dense_of(s) for s in shards], dim=1), want, rtol=0, atol=0)
    torch.testing.assert_close(dense_of(weights_for(tensors, config, 1, 2).get_weights_col("m.lin")), want[32:])


# -- kernels ---------------------------------------------------------------------------------------
KERNEL_NAMES = ("bnb-cpu-4bit", "bnb-matmul-4bit", "reference")


def only(kernel: str) -> str:
    return ",".join(n for n in KERNEL_NAMES if n != kernel)


@pytest.fixture
def fresh_cpu_check():
    """Forgets the cached CPU feature answer after a test that mocked it."""
    yield
    _cpu_fused_4bit.cache_clear()


@pytest.fixture(params=[True, False], ids=["avx512-bf16", "no-avx512-bf16"])
def mocked_cpu_bf16(request, monkeypatch, fresh_cpu_check) -> bool:
    """bitsandbytes' CPU feature check answered both ways, whatever this machine has."""
    monkeypatch.setattr(bnb_f, "has_avx512bf16", lambda: request.param)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    _cpu_fused_4bit.cache_clear()  # the answer is cached per process
    return request.param


def test_fused_cpu_kernel_follows_the_cpu_feature(cases, mocked_cpu_bf16, monkeypatch):
    """bitsandbytes registers its fused CPU 4-bit kernel only on AVX512-BF16 CPUs. With the feature
    it is the first choice; without it, it refuses with that reason and the dense reference takes
    the layer (faster there than bnb-matmul-4bit's dequantize per call); with the others disabled
    too, nothing can run the layer and the error says why."""
    tensors, _, config = get_case(cases, "nf4-dq")
    w = weights_for(tensors, config).get_weights("m.qkv")
    spec = w.spec(torch.float32, "cpu")
    if mocked_cpu_bf16:
        assert BnbCpu4bitKernel.can_implement(spec) == (True, "")
        assert choose_kernel(spec) == (BnbCpu4bitKernel, [])
        return
    assert BnbCpu4bitKernel.can_implement(spec) == (False, "the CPU lacks AVX512-BF16")
    kernel, rejected = choose_kernel(spec)
    assert kernel.name == "reference" and rejected == [("bnb-cpu-4bit", "the CPU lacks AVX512-BF16")]
    module = w.get_linear(None)
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(module(x), x @ w.dequantize().t(), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(DISABLE_ENV, only("bnb-cpu-4bit"))
    with pytest.raises(NoKernelError, match=r"bnb-cpu-4bit: the CPU lacks AVX512-BF16; reference: disabled by "
                                            r"TGS_DISABLE_KERNELS; bnb-matmul-4bit: disabled by TGS_DISABLE_KERNELS"):
        w.get_linear(None)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("shard", ["full", "row-padded", "multi-col"])
def test_kernels_run_the_loaded_weight(cases, kernel, shard, monkeypatch):
    tensors, _, config = get_case(cases, "fp4-dq" if shard == "multi-col" else "nf4-dq")
    world, rank = {"full": (1, 0), "row-padded": (4, 1), "multi-col": (2, 1)}[shard]
    weights = weights_for(tensors, config, rank, world)
    w = {"full": lambda: weights.get_weights("m.qkv"), "row-padded": lambda: weights.get_weights_row("m.qkv"),
         "multi-col": lambda: weights.get_multi_weights_col(["m.q", "m.k", "m.v"], dim=0)}[shard]()
    monkeypatch.setenv(DISABLE_ENV, only(kernel))
    bias = torch.randn(w.shape[0])
    if kernel == "bnb-cpu-4bit" and _cpu_fused_4bit():
        # Only the fused CPU kernel depends on the machine: where it cannot run (no AVX512-BF16)
        # and every other kernel is disabled, loading the layer must fail with its reason.
        with pytest.raises(NoKernelError, match=f"bnb-cpu-4bit: {_cpu_fused_4bit()}"):
            w.get_linear(bias)
        return
    module = w.get_linear(bias)
    assert module.kernel_name == kernel
    x = torch.randn(3, 5, w.shape[1])
    want = x @ w.dequantize().t() + bias
    got = module(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    bound = 1e-2 if kernel == "bnb-cpu-4bit" else 1e-6  # the fused CPU kernel computes in bfloat16
    assert ((got - want).norm() / want.norm()).item() < bound


def test_cuda_4bit_never_falls_back_to_dense_silently(cases, monkeypatch):
    """On CUDA the 4-bit reference (a dense copy) is refused unless --allow-dense-fallback."""
    import dataclasses

    monkeypatch.delenv(ALLOW_DENSE_ENV, raising=False)
    monkeypatch.setenv(DISABLE_ENV, "bnb-matmul-4bit")
    tensors, _, config = get_case(cases, "nf4-dq")
    w = dataclasses.replace(weights_for(tensors, config).get_weights("m.qkv"), device_type="cuda")
    with pytest.raises(DenseFallbackError, match=r"m\.qkv: no compact kernel can run this 4-bit bnb-nf4 layer .* on "
                                                 r"CUDA.*bnb-matmul-4bit: disabled by TGS_DISABLE_KERNELS.*"
                                                 r"--allow-dense-fallback \(TGS_ALLOW_DENSE_FALLBACK=1\)"):
        w.get_linear(None)
    monkeypatch.setenv(ALLOW_DENSE_ENV, "1")
    assert w.get_linear(None).kernel_name == "reference"


def test_kernel_choice_is_logged_once_per_layer_kind(cases, monkeypatch):
    from loguru import logger

    from text_generation_server.kernels import select

    monkeypatch.setenv(DISABLE_ENV, "bnb-cpu-4bit,reference")
    monkeypatch.setattr(select, "_LOGGED", set())
    tensors, _, config = get_case(cases, "fp4")
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")
    try:
        for _ in range(2):
            weights_for(tensors, config).get_weights("m.qkv").get_linear(None)
    finally:
        logger.remove(sink)
    off = f"disabled by {DISABLE_ENV}"
    assert lines == [f"m.qkv: bitsandbytes fp4 blocksize 64: kernel bnb-matmul-4bit (bnb-cpu-4bit: {off}; "
                     f"reference: {off})\n"]


def test_kernel_reasons_for_blocks_straddling_rows(cases, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    tensors, _, config = get_case(cases, "nf4-dq-k100")
    w = weights_for(tensors, config).get_weights("m.qkv")
    spec = w.spec(torch.float32, "cpu")
    kernel, rejected = choose_kernel(spec)
    assert kernel.name == "reference"
    assert rejected == [("bnb-cpu-4bit", "in_features 100 not a multiple of the blocksize 64")]
    ok, reason = BnbMatmul4bitKernel.can_implement(spec)
    assert not ok and reason.startswith("in_features 100 not a multiple of the blocksize 64 "
                                        "(bitsandbytes' CPU dequantize is wrong")
    # CUDA's fused kernels use flat blocks: straddling rows is fine there.
    assert choose_kernel(w.spec(torch.float16, "cuda"))[0].name == "bnb-matmul-4bit"


# -- bad checkpoints ------------------------------------------------------------------------------
def lin_tensors(quant_type="nf4", double_quant=True) -> dict:
    return bnb4_tensors("m.lin", torch.randn(64, 128), quant_type, double_quant)[0]


def qs_json(tensors: dict, quant_type: str = "nf4") -> dict:
    return json.loads(bytes(tensors[f"m.lin.weight.quant_state.bitsandbytes__{quant_type}"].tolist()))


def with_json(tensors: dict, data: dict | bytes, quant_type: str = "nf4") -> dict:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    key = f"m.lin.weight.quant_state.bitsandbytes__{quant_type}"
    return tensors | {key: torch.tensor(list(raw), dtype=torch.uint8)}


def drop(tensors: dict, *names: str) -> dict:
    return {k: v for k, v in tensors.items() if k not in {f"m.lin.{n}" for n in names}}


QS = r"tensor 'm\.lin\.weight\.quant_state\.bitsandbytes__nf4' \(in <memory>\)"
BAD = {
    "missing-absmax": (lambda t: drop(t, "weight.absmax"), r"tensor 'm\.lin\.weight\.absmax' not found"),
    "broken-json": (lambda t: with_json(t, b'{"quant_type": "nf4", "blocksize'),
                    QS + r" is not a bitsandbytes quant_state"),
    "json-not-object": (lambda t: with_json(t, b"[1, 2]"),
                        QS + r" is not a bitsandbytes quant_state: not a JSON object"),
    "blocksize-mismatch": (lambda t: with_json(t, qs_json(t) | {"blocksize": 128}),
                           r"tensor 'm\.lin\.weight\.absmax' has 128 blocks, but \[64, 128\] in blocks of " + QS +
                           r": 'blocksize' = 128 makes 64"),
    "blocksize-odd": (lambda t: with_json(t, qs_json(t) | {"blocksize": 48}),
                      QS + r": 'blocksize' = 48 is not yet supported"),
    "shape-mismatch": (lambda t: with_json(t, qs_json(t) | {"shape": [64, 256]}),
                       r"tensor 'm\.lin\.weight' \(torch\.uint8 \[4096, 1\], in <memory>\) holds 4096 bytes, but "
                       + QS + r": 'shape' \[64, 256\] needs 8192"),
    "shape-missing": (lambda t: with_json(t, {k: v for k, v in qs_json(t).items() if k != "shape"}),
                      QS + r": 'shape' must be \[out_features, in_features\]"),
    "type-in-json": (lambda t: with_json(t, qs_json(t) | {"quant_type": "fp4"}),
                     QS + r": 'quant_type' = 'fp4' disagrees"),
    "missing-quant-state": (lambda t: drop(t, "weight.quant_state.bitsandbytes__nf4"),
                            r"tensor 'm\.lin\.weight\.quant_state\.bitsandbytes__nf4' not found"),
    "missing-nested": (lambda t: drop(t, "weight.nested_absmax"),
                       r"tensor 'm\.lin\.weight\.absmax' is torch\.uint8 without 'm\.lin\.weight\.nested_absmax'"),
    "missing-nested-offset": (lambda t: with_json(t, {k: v for k, v in qs_json(t).items() if k != "nested_offset"}),
                              QS + r": 'nested_offset' must be a number"),
    "custom-code-table": (lambda t: t | {"m.lin.weight.quant_map": torch.linspace(-1, 1, 16)},
                          r"tensor 'm\.lin\.weight\.quant_map' \(in <memory>\) is not the standard nf4 code table"),
    "missing-weight": (lambda t: drop(t, "weight"), r"tensor 'm\.lin\.weight' not found"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_4bit_checkpoints_name_the_tensor(name):
    corrupt, error = BAD[name]
    weights = weights_for(corrupt(lin_tensors()), BnbConfig(source="test", kind="nf4"))
    with pytest.raises(CheckpointError, match=error):
        weights.get_weights_row("m.lin")


def test_quant_type_of_tensors_must_match_the_config():
    weights = weights_for(lin_tensors("fp4"), BnbConfig(source="config.json", kind="nf4"))
    with pytest.raises(CheckpointError, match=r"tensor 'm\.lin\.weight\.quant_state\.bitsandbytes__fp4' "
                                              r"\(in <memory>\) says this weight is fp4, but config\.json says "
                                              r"bnb_4bit_quant_type 'nf4'"):
        weights.get_weights("m.lin")


def test_bad_int8_checkpoints_name_the_tensor():
    tensors, _ = bnb8_tensors("m.lin", torch.randn(32, 64))
    config = BnbConfig(source="test", kind="int8")
    with pytest.raises(CheckpointError, match=r"tensor 'm\.lin\.SCB' not found"):
        weights_for(drop(tensors, "SCB"), config).get_weights("m.lin")
    with pytest.raises(CheckpointError, match=r"tensor 'm\.lin\.weight_format' = \[2\] .* not yet supported"):
        weights_for(tensors | {"m.lin.weight_format": torch.tensor(2, dtype=torch.uint8)}, config).get_weights("m.lin")
    with pytest.raises(CheckpointError, match=r"tensor 'm\.lin\.weight' is torch\.float16 \[32, 64\]"):
        fp16 = tensors | {"m.lin.weight": torch.zeros(32, 64, dtype=torch.float16)}
        weights_for(fp16, config).get_weights_col("m.lin")
    with pytest.raises(CheckpointError, match=r"'m\.lin': SCB is torch\.float32 \[16\]"):
        weights_for(tensors | {"m.lin.SCB": torch.ones(16)}, config).get_weights_row("m.lin")
    with pytest.raises(CheckpointError,
                       match=r"tensor 'm\.lin\.weight' is torch\.int8 \[32, 64\] .*quantizing on load"):
        weights_for(tensors, BnbConfig(source="test", kind="int8", prequantized=False)).get_weights("m.lin")


# -- end to end: a tiny Llama ------------------------------------------------------------------------
SHAPE = dict(hidden_size=192, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# name -> (flag for get_model, how the checkpoint was quantized, modules left dense)
VARIANTS = {
    "onload-nf4": ("bitsandbytes-nf4", None, ()),
    "onload-fp4": ("bitsandbytes-fp4", None, ()),
    "onload-int8": ("bitsandbytes", None, ()),
    "nf4-dq": (None, dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                          bnb_4bit_compute_dtype=torch.float16), ()),
    "fp4-skip-mlp1": ("bitsandbytes-fp4", dict(load_in_4bit=True, bnb_4bit_quant_type="fp4",
                                               llm_int8_skip_modules=["lm_head", "model.layers.1.mlp"]),
                      ("model.layers.1.mlp",)),
    "int8": ("bitsandbytes", dict(load_in_8bit=True), ()),
}
QUANT_ERROR = {"nf4": 0.25, "fp4": 0.25, "int8": 0.02}  # mean |logprob - unquantized logprob|
WORLD = 2
SPAWN_TIMEOUT_S = 240


def kind_of(name: str) -> str:
    return name.removeprefix("onload-").split("-")[0]


def write_variant(original: Path, root: Path, name: str) -> dict[str, Path]:
    """The quantized checkpoint (or the original, for on-load) and a dense checkpoint of what it must compute."""
    flag, qconfig, dense_modules = VARIANTS[name]
    state = load_file(str(original / "model.safetensors"))
    kind = kind_of(name)
    quantized, reference = {}, {}
    for key, tensor in state.items():
        prefix = key.removesuffix(".weight")
        linear = prefix.startswith("model.layers.") and prefix.split(".", 3)[-1] in LINEARS
        if not linear or any(prefix.startswith(d) for d in dense_modules):
            # What the tools store for what they leave dense; on load, the original tensor itself.
            quantized[key] = reference[key] = tensor.half() if qconfig else tensor
            continue
        if kind == "int8":
            t, dense = bnb8_tensors(prefix, tensor) if qconfig else (None, int8_reference(tensor))
        else:
            t, dense = bnb4_tensors(prefix, tensor, kind, double_quant="-dq" in name)
        quantized |= t or {}
        reference[key] = dense
    out = {}
    config = json.loads((original / "config.json").read_text()) | {"torch_dtype": "float16"}
    folders = [("ref", reference, config)]
    if qconfig:
        folders.append(("ckpt", quantized, config | {"quantization_config": hf_config(**qconfig)}))
    for label, tensors, cfg in folders:
        out[label] = write_model_folder(root / f"{name}.{label}", original, tensors, cfg, metadata=None)
    out.setdefault("ckpt", original)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bnb_e2e")
    write_checkpoint(root / "llama", "llama", seed=7, **SHAPE)
    return {"original": root / "llama"} | {name: write_variant(root / "llama", root, name) for name in VARIANTS}


def load_variant(folders, name: str, **kwargs):
    return get_model(str(folders[name]["ckpt"]), dtype="float32", quantize=VARIANTS[name][0], **kwargs)


BNB_FAST = ("bnb-cpu-4bit", "bnb-matmul-4bit")  # the 4-bit kernels (family bnb-4bit), outside fast_kernels()


@pytest.fixture(scope="module")
def original_logprobs(folders) -> torch.Tensor:
    return prompt_logprobs(get_model(str(folders["original"]), dtype="float32"))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_path_equals_dequantized_checkpoint(folders, original_logprobs, name, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, fast_kernels(*BNB_FAST))
    lm = load_variant(folders, name)
    # The reported flag names the kind: nf4, fp4 and int8 are all quant_method bitsandbytes.
    assert lm.quantize == {"int8": "bitsandbytes", "nf4": "bitsandbytes-nf4", "fp4": "bitsandbytes-fp4"}[kind_of(name)]
    assert kernels_used(lm) <= {"reference", "dense"}
    got = prompt_logprobs(lm)
    want = prompt_logprobs(get_model(str(folders[name]["ref"]), dtype="float32"))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    error = (got - original_logprobs).abs().mean().item()
    assert 0 < error < QUANT_ERROR[kind_of(name)], error


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chosen_kernels_stay_close(folders, name, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    lm = load_variant(folders, name)
    kernels = kernels_used(lm)
    if kind_of(name) == "int8":
        assert kernels == {"cpu-int8"}
    else:  # without AVX512-BF16 the dense reference outruns bnb-matmul-4bit's dequantize per call
        expected = "reference" if _cpu_fused_4bit() else "bnb-cpu-4bit"
        assert expected in kernels, kernels
    if name == "fp4-skip-mlp1":
        assert "dense" in kernels
    got = prompt_logprobs(lm)
    want = prompt_logprobs(get_model(str(folders[name]["ref"]), dtype="float32"))
    assert (got - want).abs().max() < 0.05, kernels


def test_model_on_a_cpu_without_avx512_bf16(folders, monkeypatch, fresh_cpu_check):
    """What an AVX512-BF16-less CPU loads, on any machine: the 4-bit layers on the dense reference."""
    monkeypatch.setattr(bnb_f, "has_avx512bf16", lambda: False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    _cpu_fused_4bit.cache_clear()
    lm = load_variant(folders, "nf4-dq")
    assert "reference" in kernels_used(lm) and "bnb-cpu-4bit" not in kernels_used(lm)
    want = prompt_logprobs(get_model(str(folders["nf4-dq"]["ref"]), dtype="float32"))
    torch.testing.assert_close(prompt_logprobs(lm), want, atol=2e-5, rtol=0)


def test_bfloat16_model(folders):
    assert_bfloat16_close(get_model(str(folders["nf4-dq"]["ckpt"]), dtype="bfloat16"), folders["nf4-dq"]["ref"])


# -- world size 2 ------------------------------------------------------------------------------
def _rank_main(pg, folders: dict) -> dict:
    return {(mode, name): prompt_logprobs(load_variant(folders, name, process_group=pg))
            for mode in kernel_modes(extra=BNB_FAST) for name in VARIANTS}


@pytest.fixture(scope="module")
def world2(folders, tmp_path_factory) -> list[dict]:
    return run_ranks(_rank_main, (folders,), WORLD, tmp_path_factory.mktemp("bnb_tp"), SPAWN_TIMEOUT_S,
                     group_timeout_s=120)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_world_size_2_matches_world_size_1(folders, world2, name, monkeypatch):
    """Shards hold the unsharded blocks (o_proj's 96 columns per rank are padded to whole blocks), so on the
    reference kernel two ranks reproduce one up to float32 summation order; the chosen kernels up to bf16."""
    for mode in kernel_modes(monkeypatch.setenv, BNB_FAST):
        want = prompt_logprobs(load_variant(folders, name))
        for rank in range(WORLD):
            got = world2[rank][mode, name]
            assert math.isfinite(got.sum().item())
            torch.testing.assert_close(got, want, atol=MODE_ATOL[mode], rtol=0)
