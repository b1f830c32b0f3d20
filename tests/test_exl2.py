"""EXL2 checkpoints: layout, loader matrix, sharding, bad tensors, and a tiny Llama end to end.

Tensors are written by the test-side packer (exl2_packer.py), which follows exllamav2's
pack kernels unit by unit and never shares code with the loader. The ground truth is the
packer's own dequantization: codes minus 2^(b-1) times exllamav2's fp16 scales, rows put
back in original order through the permutation.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from exl2_packer import Exl2Layer, exl2_tensors, pack_columns, pack_rows_4, quantize_exl2
from helpers import (METHODS, assert_bfloat16_close, assert_ranks_match_one_process, fast_kernels, join_shards,
                     kernel_names, load_qkv, prompt_logprobs, qkv_of, run_ranks_per_mode, write_checkpoint,
                     write_model_folder)
from safetensors.torch import load_file
from test_quant_e2e import SHAPE

from text_generation_server.kernels.base import dequantize
from text_generation_server.kernels.select import DISABLE_ENV
from text_generation_server.kernels.cpu import CpuInt4PackKernel
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.factory import get_loader, read_quantization_config
from text_generation_server.quantizers.exl2 import Exl2Config, Exl2Weight
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError, DictTensorSource
from text_generation_server.quantizers.weights import UnquantizedWeight, Weights

torch.set_num_threads(1)

K = 384  # 96 rows per rank at world size 4
PARTS = {"q": 256, "k": 128, "v": 128}
N = sum(PARTS.values())
WORLDS = [1, 2, 4]
CONFIG = Exl2Config(source="test")

# Every width in one tensor, groups of 32 to 128 rows, widest first as the converter orders them.
ALL_WIDTHS = [(8, 32), (6, 32), (5, 32), (4, 64), (3, 32), (3, 64), (2, 64), (2, 64)]
UP_TO_4 = [(4, 64), (4, 64), (3, 128), (3, 128)]
PLANS = {  # case -> prefix -> plan; q, k and v differ so fusing must merge unlike groups
    "mixed": {"q": ALL_WIDTHS, "k": [(8, 128), (6, 128), (5, 128)], "v": [(6, 32), (4, 128), (2, 224)],
              "qkv": ALL_WIDTHS},
    "up-to-4": {"q": UP_TO_4, "k": [(4, 128), (2, 256)], "v": UP_TO_4, "qkv": UP_TO_4},
    "no-act-order": {"q": [(6, 128), (5, 256)], "k": [(6, 128), (5, 256)], "v": [(4, 384)], "qkv": [(8, 384)]},
}


def weights_for(tensors: dict, rank: int = 0, world: int = 1) -> Weights:
    return Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32, ProcessGroup(rank=rank, size=world),
                   loader=get_loader(CONFIG))


def dense_of(weight) -> torch.Tensor:
    return dequantize(weight.to_quantized(), torch.float32)


def build_case(name: str, seed: int) -> tuple[dict, dict]:
    """(tensors, dense per prefix). "mixed" gives k its own act-order; q, v and qkv share one."""
    g = torch.Generator().manual_seed(seed)
    shared = None if name == "no-act-order" else torch.randperm(K, generator=g)
    tensors, dense = {}, {}
    for part, plan in PLANS[name].items():
        n = N if part == "qkv" else PARTS[part]
        perm = torch.randperm(K, generator=g) if name == "mixed" and part == "k" else shared
        layer = quantize_exl2(torch.randn(n, K, generator=g) * 0.1, plan, perm)
        tensors |= exl2_tensors(f"m.{part}", layer, with_perm=name == "no-act-order")
        dense[f"m.{part}"] = layer.dense()
    return tensors, dense


@pytest.fixture(scope="module")
def cases() -> dict[str, tuple[dict, dict]]:
    return {name: build_case(name, seed) for seed, name in enumerate(PLANS)}


# -- the published layout ---------------------------------------------------------------------
def column(values: dict[int, int], rows: int) -> np.ndarray:
    codes = np.zeros((rows, 1), dtype=np.int64)
    for row, value in values.items():
        codes[row] = value
    return codes


def test_packer_writes_exllamav2_units():
    """Hand-computed words: values that straddle words at 3, 5 and 6 bits, and a padded scale column."""
    words = pack_columns(column({10: 0b101, 31: 0b110}, 32), 3).ravel().tolist()
    assert words == [0b01 << 30, 0b1, 0b110 << 29]  # value 10 at bit 30: low 2 bits, then its top bit
    words = pack_columns(column({6: 0b10110, 31: 0b11111}, 32), 5).ravel().tolist()
    assert words == [0b10 << 30, 0b101, 0, 0, 0b11111 << 27]  # value 6 at bit 30; value 31 at bit 155
    words = pack_columns(column({5: 0b111001, 15: 0b111111}, 16), 6).ravel().tolist()
    assert words == [0b01 << 30, 0b1110, 0b111111 << 26]
    words = pack_columns(column({0: 3, 15: 2}, 16), 2).ravel().tolist()
    assert words == [3 | 2 << 30]
    assert pack_columns(column({0: 0xAB, 3: 0x12}, 4), 8).ravel().tolist() == [0xAB | 0x12 << 24]
    assert pack_columns(column({}, 16), 3).shape == (2, 1)  # a short last group: ceil(16 * 3 / 32) words
    # Scale codes store qs - 1; a padded column (0) stores 0xFFFF, which spills over the nibbles above it.
    words = pack_rows_4(np.array([[16, 1, 2, 0, 0, 0, 0, 0]])).ravel().tolist()
    assert words == [0xF | 0x0 << 4 | 0x1 << 8 | 0xFFFFF000]


def test_round_trip_every_width_in_one_tensor():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, K, generator=g) * 0.05
    perm = torch.randperm(K, generator=g)
    layer = quantize_exl2(w, ALL_WIDTHS, perm)
    tensors = exl2_tensors("m.lin", layer)
    assert tensors["m.lin.q_groups"].tolist() == [8, 0, 6, 8, 5, 14, 4, 19, 3, 27, 3, 30, 2, 36, 2, 40]
    assert tensors["m.lin.q_weight"].shape == (44, 64) and tensors["m.lin.q_scale"].shape == (8, 8)
    loaded = weights_for(tensors).get_weights("m.lin")
    assert isinstance(loaded, Exl2Weight) and loaded.bits == 8 and loaded.shape == (64, K)
    # Codes and groups in original row order: stored row j is original row perm[j].
    groups = layer.stored_groups()
    mids = np.array([2 ** (b - 1) for b, _ in ALL_WIDTHS])[groups]
    assert torch.equal(loaded.codes[perm], torch.from_numpy(layer.codes - mids[:, None]).to(torch.int8))
    assert torch.equal(loaded.g_idx[perm].long(), torch.from_numpy(groups))
    assert torch.equal(loaded.scales, torch.from_numpy(layer.scales()))
    assert torch.equal(dense_of(loaded), layer.dense())
    # And the packer quantized sensibly: each group's relative error is about one step of its width.
    group_of_row = torch.empty(K, dtype=torch.long)
    group_of_row[perm] = torch.from_numpy(groups)
    for g, (bits, _) in enumerate(ALL_WIDTHS):
        rows = group_of_row == g
        assert (layer.dense() - w)[:, rows].norm() / w[:, rows].norm() < 2.0 ** (2 - bits)
    # Only q_perm stored (exllamav2 derives one from the other): the same weight.
    only_perm = exl2_tensors("m.lin", layer, with_perm=True)
    del only_perm["m.lin.q_invperm"]
    assert torch.equal(dense_of(weights_for(only_perm).get_weights("m.lin")), layer.dense())


def test_short_last_group():
    """K = 112: the last 3-bit group has 48 rows in ceil(48 * 3 / 32) = 5 words, not whole 32-row units."""
    g = torch.Generator().manual_seed(15)
    layer = quantize_exl2(torch.randn(32, 112, generator=g), [(4, 64), (3, 48)], torch.randperm(112, generator=g))
    tensors = exl2_tensors("m.lin", layer)
    assert tensors["m.lin.q_weight"].shape[0] == 8 + 5
    for world in (1, 2):
        rows = [dense_of(weights_for(tensors, r, world).get_weights_row("m.lin")) for r in range(world)]
        assert torch.equal(torch.cat(rows, dim=1), layer.dense())


def test_scales_follow_exllamav2_fp16_rounding():
    """q_scale_max / 256 is an fp16 subnormal for small layers: the rounding changes the weights."""
    g = torch.Generator().manual_seed(12)
    layer = quantize_exl2(torch.randn(32, 128, generator=g) * 1e-2, [(4, 64), (4, 64)])
    assert float(layer.qscale_max.max()) / 256 < 2 ** -14  # subnormal in fp16
    loaded = weights_for(exl2_tensors("m.lin", layer)).get_weights("m.lin")
    assert torch.equal(dense_of(loaded), layer.dense())
    exact = torch.from_numpy(((layer.qscale ** 2) * layer.qscale_max.astype(np.float64)[:, None] / 256))
    assert not torch.allclose(loaded.scales.double(), exact, rtol=1e-4, atol=0)


# -- loader matrix -------------------------------------------------------------------------------
def load(tensors: dict, method: str, rank: int, world: int) -> torch.Tensor:
    return dense_of(load_qkv(weights_for(tensors, rank, world), method, PARTS))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(PLANS))
def test_loader_matrix(cases, name, method, world):
    tensors, dense = cases[name]
    shards = [load(tensors, method, rank, world) for rank in range(world)]
    if method == "full":
        assert all(torch.equal(s, shards[0]) for s in shards)
    elif method == "row":
        assert all(s.shape == (N, K // world) for s in shards)
    assert torch.equal(join_shards(method, shards, PARTS), qkv_of(method, dense, PARTS))


def test_row_shards_keep_only_the_groups_their_rows_use(cases):
    tensors, _ = cases["no-act-order"]  # qkv: one 8-bit group; q: 128 rows at 6 bits, 256 at 5
    w = weights_for(tensors, rank=0, world=4).get_weights_row("m.q")  # rows 0..95: the 6-bit group only
    assert w.scales.shape[0] == 1 and w.widths.tolist() == [6] and w.bits == 8
    w = weights_for(tensors, rank=1, world=4).get_weights_row("m.q")  # rows 96..191 straddle both groups
    assert w.scales.shape[0] == 2 and w.g_idx[:32].eq(0).all() and w.g_idx[32:].eq(1).all()
    mixed = weights_for(cases["mixed"][0], rank=3, world=4).get_weights_row("m.qkv")
    assert mixed.scales.shape[0] == 8  # act-order: every group has rows on every rank
    assert mixed.to_quantized().act_order


def test_fused_parts_with_unlike_groups(cases):
    """q (8 groups), k (3 groups, its own act-order) and v (3 groups): one group per distinct triple."""
    tensors, _ = cases["mixed"]
    fused = weights_for(tensors).get_multi_weights_col(["m.q", "m.k", "m.v"], dim=0)
    parts = [weights_for(tensors).get_weights(f"m.{p}") for p in PARTS]
    triples = {tuple(int(p.g_idx[k]) for p in parts) for k in range(K)}
    assert fused.scales.shape == (len(triples), N) and fused.bits == 8
    assert fused.layer == "m.q+k+v"


@pytest.mark.parametrize("name, world", [("up-to-4", 1), ("mixed", 1), ("up-to-4", 2), ("no-act-order", 4)])
def test_get_linear_runs_the_weight(cases, name, world):
    """Whatever kernel is chosen computes x @ W^T + b; 2- to 4-bit layers fit the int4 op, act-order and all."""
    tensors, _ = cases[name]
    for rank in range(world):
        w = weights_for(tensors, rank, world)
        for weight in (w.get_weights_row("m.qkv"), w.get_multi_weights_col(["m.q", "m.k", "m.v"], dim=0)):
            bias = torch.randn(weight.shape[0])
            canonical = weight.to_quantized()
            assert canonical.bits == (4 if name == "up-to-4" else 8) and canonical.zeros is None
            modules = [weight.get_linear(bias)]
            if name == "up-to-4" and world == 1:
                assert CpuInt4PackKernel.can_implement(canonical.spec(torch.float32, "cpu")) == (True, "")
                modules.append(CpuInt4PackKernel.build(canonical, bias, torch.float32))
            x = torch.randn(5, weight.shape[1])
            want = x @ dense_of(weight).t() + bias
            for module in modules:
                assert (module(x).float() - want).norm() / want.norm() < 2e-2, getattr(module, "kernel_name", "")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_run_exl2_weights(cases):
    for name in PLANS:
        tensors, dense = cases[name]
        w = Weights(DictTensorSource({k: v.cuda() for k, v in tensors.items()}), torch.device("cuda"), torch.float16,
                    loader=get_loader(CONFIG))
        module = w.get_multi_weights_col([f"m.{p}" for p in PARTS], dim=0).get_linear(None)
        x = torch.randn(5, K, device="cuda", dtype=torch.float16)
        want = x.float() @ torch.cat([dense[f"m.{p}"] for p in PARTS]).cuda().t()
        assert (module(x).float() - want).norm() / want.norm() < 2e-2, module.kernel_name


def test_padded_output_columns():
    """N = 40 is stored as 64 columns; the padding dequantizes to zero and the shape says 64."""
    g = torch.Generator().manual_seed(13)
    layer = quantize_exl2(torch.randn(40, 128, generator=g), [(4, 64), (3, 64)], torch.randperm(128, generator=g))
    tensors = exl2_tensors("m.lin", layer)
    assert tensors["m.lin.q_weight"].shape[1] == 64 and tensors["m.lin.q_scale"].shape[1] == 8
    for world in (1, 2):
        shards = [dense_of(weights_for(tensors, r, world).get_weights_col("m.lin")) for r in range(world)]
        dense = torch.cat(shards)
        assert dense.shape == (64, 128)
        assert torch.equal(dense[:40], layer.dense()) and dense[40:].eq(0).all()
    with pytest.raises(CheckpointError, match=r"'m\.lin\.q_weight' has 64 output features.*padded 40 output "
                                              r"features to 64"):
        weights_for(tensors).get_weights_col_packed("m.lin", [24, 16])


# -- refusals ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small() -> tuple[dict, Exl2Layer]:
    g = torch.Generator().manual_seed(14)
    layer = quantize_exl2(torch.randn(64, 128, generator=g), [(6, 32), (4, 64), (3, 32)],
                          torch.randperm(128, generator=g))
    return exl2_tensors("m.lin", layer, with_perm=True), layer


def changed(tensors: dict, name: str, value: torch.Tensor | None) -> dict:
    out = dict(tensors)
    if value is None:
        out.pop(name)
    else:
        out[name] = value
    return out


def bad_inputs(t: dict) -> dict[str, tuple[dict, str]]:
    groups = t["m.lin.q_groups"]  # [6, 0, 4, 6, 3, 14]
    seven = groups.clone()
    seven[2] = 7
    overlapping = groups.clone()
    overlapping[3] = 15  # group 1 would start after group 2
    dup = t["m.lin.q_invperm"].clone()
    dup[5] = dup[6]
    longer = torch.cat([t["m.lin.q_invperm"], torch.arange(128, 160, dtype=torch.int32)])
    return {
        # 32 more input rows than the groups hold: q_groups does not cover K.
        "groups-short-of-k": (changed(changed(t, "m.lin.q_invperm", longer), "m.lin.q_perm", None),
                              r"'m\.lin\.q_groups': its groups hold 128 input rows .* 'm\.lin\.q_invperm' has 160"),
        "q-weight-truncated": (changed(t, "m.lin.q_weight", t["m.lin.q_weight"][:-1]),
                               r"'m\.lin\.q_groups': its groups hold 117 input rows in 'm\.lin\.q_weight' \(16 rows\)"),
        "groups-out-of-order": (changed(t, "m.lin.q_groups", overlapping),
                                r"'m\.lin\.q_groups': group 1 spans q_weight rows \[15, 14\)"),
        "width-7": (changed(t, "m.lin.q_groups", seven), r"'m\.lin\.q_groups': group 1 is 7-bit"),
        "missing-q-scale-max": (changed(t, "m.lin.q_scale_max", None), r"'m\.lin\.q_scale_max' not found"),
        "missing-permutation": (changed(changed(t, "m.lin.q_invperm", None), "m.lin.q_perm", None),
                                r"'m\.lin\.q_invperm' not found"),
        "invperm-not-a-permutation": (changed(t, "m.lin.q_invperm", dup),
                                      r"'m\.lin\.q_invperm' is not a permutation of 0\.\.127"),
        "perm-not-the-inverse": (changed(t, "m.lin.q_perm", t["m.lin.q_invperm"].flip(0).contiguous()),
                                 r"'m\.lin\.q_perm' is not the inverse of 'm\.lin\.q_invperm'"),
        "q-scale-columns": (changed(t, "m.lin.q_scale", t["m.lin.q_scale"][:, :-1].contiguous()),
                            r"'m\.lin\.q_scale' has torch\.int32 \[3, 7\], expected int32 \[3, 8\]"),
        "q-scale-max-groups": (changed(t, "m.lin.q_scale_max", t["m.lin.q_scale_max"][:2]),
                               r"'m\.lin\.q_scale' has .* expected int32 \[2, 8\] for 2 groups"),
        "q-weight-dtype": (changed(t, "m.lin.q_weight", t["m.lin.q_weight"].float()),
                           r"'m\.lin\.q_weight' must be 2-D int32"),
    }


BAD = ["groups-short-of-k", "q-weight-truncated", "groups-out-of-order", "width-7", "missing-q-scale-max",
       "missing-permutation", "invperm-not-a-permutation", "perm-not-the-inverse", "q-scale-columns",
       "q-scale-max-groups", "q-weight-dtype"]


@pytest.mark.parametrize("name", BAD)
def test_bad_tensors_are_named(small, name):
    tensors, message = bad_inputs(small[0])[name]
    for method in ("get_weights", "get_weights_col", "get_weights_row"):
        for world in (1, 2):
            with pytest.raises(CheckpointError, match=message):
                getattr(weights_for(tensors, 0, world), method)("m.lin")


def test_impossible_splits_name_the_tensor(small):
    with pytest.raises(CheckpointError, match=r"'m\.lin\.q_invperm': 128 input features do not divide into 3"):
        weights_for(small[0], 0, 3).get_weights_row("m.lin")
    with pytest.raises(CheckpointError, match=r"'m\.lin\.q_weight'.*does not divide into 5 shards"):
        weights_for(small[0], 0, 5).get_weights_col("m.lin")


def test_dense_layers_in_an_exl2_checkpoint(small):
    """exllamav2 loads a layer stored as `.weight` dense; fusing it with a quantized one is refused."""
    dense = torch.randn(64, 128)
    tensors = small[0] | {"m.dense.weight": dense}
    w = weights_for(tensors, 1, 2)
    got = w.get_weights_col("m.dense")
    assert isinstance(got, UnquantizedWeight) and torch.equal(got.weight, dense[32:])
    with pytest.raises(CheckpointError, match=r"m\.dense stored dense but m\.lin EXL2-quantized"):
        w.get_multi_weights_col(["m.dense", "m.lin"], dim=0)


# -- config ----------------------------------------------------------------------------------------
def exllamav2_config(**changes) -> dict:
    """What exllamav2's compile step adds to config.json."""
    return {"quant_method": "exl2", "version": "0.2.7", "bits": 4.65, "head_bits": 6,
            "calibration": {"rows": 115, "length": 2048, "dataset": "(default)"}} | changes


def write_config(folder: Path, quantization_config: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": quantization_config}))
    return str(folder)


def test_config(tmp_path):
    folder = write_config(tmp_path / "ok", exllamav2_config())
    for flag in (None, "exl2"):
        cfg = read_quantization_config(folder, flag)
        assert cfg == Exl2Config(source=str(tmp_path / "ok" / "config.json"), bits=4.65, head_bits=6, version="0.2.7")
    assert cfg.describe() == "exl2 4.65 bpw head 6-bit (exllamav2 0.2.7)"
    with pytest.raises(ValueError, match=r"--quantize gptq disagrees with the checkpoint: .*'exl2'"):
        read_quantization_config(folder, "gptq")
    qc = r"config\.json: 'quantization_config\."
    for changes, message in (({"head_bits": 7}, qc + r"head_bits' = 7 is not yet supported for exl2"),
                             ({"head_bits": "6"}, qc + r"head_bits' must be an integer"),
                             ({"bits": "4.65"}, qc + r"bits' must be a positive number")):
        with pytest.raises(CheckpointError, match=message):
            read_quantization_config(write_config(tmp_path / "bad", exllamav2_config(**changes)), None)


# -- end to end: a tiny Llama ------------------------------------------------------------------------
# q/k/v and gate/up share their input's act-order (exllamav2 reuses the Hessian) but not their widths.
E2E_PLANS = {
    "exl2-mixed": {
        192: {"q_proj": [(8, 32), (6, 32), (5, 32), (4, 32), (3, 32), (2, 32)], "k_proj": [(8, 64), (6, 128)],
              "v_proj": [(6, 64), (5, 128)], "o_proj": [(5, 64), (4, 128)], "gate_proj": [(8, 32), (4, 160)],
              "up_proj": [(6, 64), (4, 64), (3, 64)]},
        384: {"down_proj": [(8, 32), (6, 32), (5, 64), (4, 128), (3, 128)]},
    },
    "exl2-up-to-4": {
        192: {"q_proj": [(4, 64), (3, 128)], "k_proj": [(4, 64), (4, 128)], "v_proj": [(4, 64), (3, 128)],
              "o_proj": [(4, 64), (3, 128)], "gate_proj": [(4, 64), (3, 128)], "up_proj": [(4, 128), (3, 64)]},
        384: {"down_proj": [(4, 128), (3, 128), (3, 128)]},
    },
}
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
WORLD = 2
SPAWN_TIMEOUT_S = 180


def write_exl2(original: Path, folder: Path, reference: Path, plans: dict, seed: int) -> None:
    """`folder`: the EXL2 checkpoint; `reference`: the same model with the dequantized dense weights.

    lm_head stays dense here, unlike exllamav2's output (head_bits): the model loads the head
    from `lm_head.weight` only.
    """
    g = torch.Generator().manual_seed(seed)
    quantized, dense, perms = {}, {}, {}
    for name, tensor in load_file(str(original / "model.safetensors")).items():
        prefix = name.removesuffix(".weight")
        kind = prefix.rsplit(".", 1)[-1]
        quantizable = prefix.startswith("model.layers.") or prefix == "lm_head"
        plan = plans.get(tensor.shape[-1], {}).get(kind) if quantizable else None
        if plan is None:
            quantized[name] = dense[name] = tensor.half()
            continue
        owner = prefix.rsplit(".", 1)[0] + "." + SHARED_INPUT.get(kind, kind)
        perm = perms.setdefault(owner, torch.randperm(tensor.shape[1], generator=g))
        layer = quantize_exl2(tensor.float(), plan, perm)
        quantized |= exl2_tensors(prefix, layer)
        dense[name] = layer.dense()
    config = json.loads((original / "config.json").read_text()) | {"torch_dtype": "float16"}
    write_model_folder(folder, original, quantized, config | {"quantization_config": exllamav2_config()})
    write_model_folder(reference, original, dense, config)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exl2_e2e")
    write_checkpoint(root / "llama", "llama", seed=7, **SHAPE)
    out = {"original": root / "llama"}
    for seed, (name, plans) in enumerate(E2E_PLANS.items()):
        write_exl2(root / "llama", root / name, root / f"{name}.dense", plans, seed)
        out[name], out[f"{name}.dense"] = root / name, root / f"{name}.dense"
    return out


@pytest.fixture(scope="module")
def original_logprobs(folders) -> torch.Tensor:
    return prompt_logprobs(get_model(str(folders["original"]), dtype="float32"))


# Mean |log-prob difference| to the unquantized model (measured 0.11 and 0.20): mostly 3-bit is worse.
QUANT_ERROR = {"exl2-mixed": 0.16, "exl2-up-to-4": 0.3}


def test_quantized_head(folders, tmp_path, monkeypatch):
    """exllamav2 quantizes the head too (head_bits): no lm_head.weight, lm_head.q_weight instead.
    Its 300-word vocabulary is padded to 320 columns, which the head cuts off again."""
    plans = dict(E2E_PLANS["exl2-up-to-4"])
    plans[192] = dict(plans[192], lm_head=[(6, 64), (4, 128)])
    write_exl2(folders["original"], tmp_path / "q", tmp_path / "ref", plans, seed=5)
    assert "lm_head.q_weight" in load_file(str(tmp_path / "q" / "model.safetensors"))
    monkeypatch.setenv(DISABLE_ENV, fast_kernels())
    lm = get_model(str(tmp_path / "q"), dtype="float32")
    from text_generation_server.layers.tensor_parallel import QuantizedTensorParallelHead
    assert isinstance(lm.model.head.projection, QuantizedTensorParallelHead)
    assert lm.model.head.projection.linear.kernel_name == "reference"
    want = prompt_logprobs(get_model(str(tmp_path / "ref"), dtype="float32"))
    torch.testing.assert_close(prompt_logprobs(lm), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", list(E2E_PLANS))
def test_reference_path_equals_dequantized_checkpoint(folders, original_logprobs, monkeypatch, name):
    monkeypatch.setenv(DISABLE_ENV, fast_kernels())
    lm = get_model(str(folders[name]), dtype="float32")
    assert lm.quantize == "exl2"
    kernels = kernel_names(lm)
    assert kernels and set(kernels.values()) <= {"reference", "dense"}
    got = prompt_logprobs(lm)
    want = prompt_logprobs(get_model(str(folders[f"{name}.dense"]), dtype="float32"))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    error = (got - original_logprobs).abs().mean().item()
    assert 0 < error < QUANT_ERROR[name], error


@pytest.mark.parametrize("name", list(E2E_PLANS))
def test_chosen_kernels_stay_close_to_the_reference(folders, name):
    lm = get_model(str(folders[name]), dtype="float32")
    kernels = kernel_names(lm)
    if name == "exl2-up-to-4":  # the int4 op takes every layer (act-order, fused unlike parts): none stays dense
        assert "reference" not in kernels.values(), kernels
    got = prompt_logprobs(lm)
    want = prompt_logprobs(get_model(str(folders[f"{name}.dense"]), dtype="float32"))
    assert (got - want).abs().max() < 0.05, kernels


@pytest.mark.parametrize("name", list(E2E_PLANS))
def test_bfloat16_activations(folders, name):
    assert_bfloat16_close(get_model(str(folders[name]), dtype="bfloat16"), folders[f"{name}.dense"])


@pytest.fixture(scope="module")
def world2(folders, tmp_path_factory) -> list[dict]:
    return run_ranks_per_mode(folders, E2E_PLANS, WORLD, tmp_path_factory.mktemp("exl2_tp"), SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("name", list(E2E_PLANS))
def test_world_size_2_matches_world_size_1(folders, world2, name, monkeypatch):
    """Sharded EXL2 (TGI refuses it) reproduces one process: exactly up to float32 summation order
    on the reference kernel, up to bf16 activation rounding on the chosen kernels."""
    assert_ranks_match_one_process(world2, name, str(folders[name]), monkeypatch)
