"""Marlin and Marlin 2:4: layout, repacks, configs, the loader matrix, kernels, end to end.

The checkpoints are written by the test-side packers (marlin_packers.py, transcribed from
the published packing steps), never by the server's own pack functions, so every loader
and layout test compares two independent implementations of the format.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (METHODS, assert_ranks_match_one_process, fast_kernels, join_shards, kernels_used, load_qkv,
                     prompt_logprobs, qkv_of, run_ranks_per_mode, write_checkpoint, write_model_folder)
from marlin_packers import (
    compress_24,
    marlin24_tensors,
    marlin_tensors,
    marlin_zero_points,
    permute_scales,
    prune_24,
    tile_and_pack,
)
from quant_packers import awq_tensors, gptq_tensors, quantize_rtn
from safetensors.torch import load_file

from text_generation_server.kernels import marlin as km
from text_generation_server.quantizers import marlin as qm
from text_generation_server.kernels.base import LinearSpec, NoKernelError, dequantize
from text_generation_server.kernels.select import DISABLE_ENV, choose_kernel
from text_generation_server.kernels.table import CPU, CUDA
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.config import GPTQConfig
from text_generation_server.quantizers.factory import get_loader, read_quantization_config
from text_generation_server.quantizers.marlin import MarlinConfig, MarlinWeight
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError, DictTensorSource
from text_generation_server.quantizers.weights import Weights

torch.set_num_threads(1)


# -- layout: bit-exact against the transcribed packers ----------------------------------------------
def random_codes(k: int, n: int, bits: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2**bits, (k, n), generator=torch.Generator().manual_seed(seed)).to(torch.uint8)


def random_24_codes(k: int, n: int, bits: int, seed: int) -> torch.Tensor:
    """2:4 along K, with some quads holding fewer than two non-zero codes (the padded encodings)."""
    g = torch.Generator().manual_seed(seed)
    codes = random_codes(k, n, bits, seed)
    keep = torch.rand(k // 4, 4, n, generator=g).argsort(dim=1)[:, :2]
    mask = torch.zeros(k // 4, 4, n, dtype=torch.bool).scatter_(1, keep, True).view(k, n)
    mask &= torch.rand(k, n, generator=g) > 0.25
    return torch.where(mask, codes, torch.tensor(1 << (bits - 1), dtype=torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
def test_marlin_weight_is_bit_exact_and_round_trips(bits):
    codes = random_codes(64, 192, bits, seed=bits)
    packed = km.pack_marlin_weight(codes, bits)
    assert packed.shape == (4, 192 * bits // 2) and packed.dtype == torch.int32
    assert torch.equal(packed, tile_and_pack(codes.numpy(), bits))
    assert torch.equal(km.unpack_marlin_weight(packed, bits), codes)
    # Any window of whole 16-row x 64-column blocks unpacks on its own (what a rank reads).
    words = bits // 2
    window = packed[1:3, 64 * words:192 * words]
    assert torch.equal(km.unpack_marlin_weight(window, bits), codes[16:48, 64:192])


def test_marlin_known_positions():
    """Hand-derived from the fragment permutation: thread 4 loads column 1 first, so code (0, 1) is value
    128 of the strip (word 16, bits 0-3); row 8 is thread 0's third value, which the interleave
    [0, 2, 4, 6, 1, 3, 5, 7] moves to slot 1, so code (8, 0) is in word 0, bits 4-7."""
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    codes[0, 1], codes[8, 0] = 5, 3
    b = km.pack_marlin_weight(codes).view(-1)
    assert int(b[16]) == 5 and int(b[0]) == 3 << 4
    assert int(b.count_nonzero()) == 2


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("sparse_24", [False, True])
def test_scale_permutation_is_bit_exact(grouped, sparse_24):
    s = torch.randn(3 if grouped else 1, 128).half()
    marlin = km.permute_scales(s, grouped, sparse_24)
    assert torch.equal(marlin, permute_scales(s, grouped, sparse_24))
    assert torch.equal(km.unpermute_scales(marlin, grouped, sparse_24), s)


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_points_are_bit_exact(bits):
    zeros = random_codes(3, 128, bits, seed=5)
    zp = km.pack_marlin_zeros(zeros, bits)
    assert torch.equal(zp, marlin_zero_points(zeros, bits))
    assert torch.equal(km.unpack_marlin_zeros(zp, bits), zeros)


@pytest.mark.parametrize("bits", [4, 8])
def test_marlin24_is_bit_exact_and_round_trips(bits):
    codes = random_24_codes(128, 128, bits, seed=bits)
    b24, meta = km.pack_marlin24_weight(codes, bits)
    assert b24.shape == (4, 128 * bits // 2) and meta.shape == (4, 256) and meta.dtype == torch.int16
    kept, want_meta = compress_24(codes.numpy(), bits)
    assert torch.equal(meta, torch.from_numpy(want_meta.copy()))
    assert torch.equal(b24, tile_and_pack(kept.copy(), bits, sparse_24=True))
    assert torch.equal(km.unpack_marlin24_weight(b24, meta, bits), codes)
    window = km.unpack_marlin24_weight(b24[1:3, 64 * bits // 2:], meta[1:3, 128:], bits)
    assert torch.equal(window, codes[32:96, 64:])


def test_marlin24_encoding_matches_torch_cutlass_conversion():
    """The kept values and their 2-bit positions equal torch's CUTLASS conversion (before the metadata
    reordering, which Marlin 2:4 changes: 64-row groups instead of CUTLASS's 32)."""
    from torch.sparse._semi_structured_conversions import (
        _calculate_meta_reordering_scatter_offsets,
        sparse_semi_structured_from_dense_cutlass,
    )

    k, n, bits = 64, 64, 4
    codes = random_24_codes(k, n, bits, seed=9)
    signed = (codes.long() - 8).t().contiguous().half()  # [N, K], small integers: exact in fp16
    sparse, meta = sparse_semi_structured_from_dense_cutlass(signed)
    offsets = _calculate_meta_reordering_scatter_offsets(n, k // 16, torch.int16, "cpu")
    plain_torch = meta.reshape(-1)[offsets].view(n, k // 16)
    b24, b_meta = km.pack_marlin24_weight(codes, bits)
    plain_ours = (b_meta.long() & 0xFFFF).reshape(-1)[km._meta_index(n, k // 32)]
    assert torch.equal(plain_ours, plain_torch.long() & 0xFFFF)
    kept = (sparse.float() + 8).round().to(torch.uint8).t().contiguous()  # [K/2, N]
    assert torch.equal(km._unpack_strips(b24, bits, sparse_24=True), kept)


def test_marlin24_rejects_dense_codes_and_bad_metadata():
    codes = random_codes(32, 64, 4, seed=1)
    codes[:4, 0] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    with pytest.raises(ValueError, match="not 2:4 sparse"):
        km.pack_marlin24_weight(codes, 4)
    b24, meta = km.pack_marlin24_weight(random_24_codes(32, 64, 4, seed=2), 4)
    with pytest.raises(ValueError, match="invalid 2:4 metadata"):
        km.unpack_marlin24_weight(b24, torch.zeros_like(meta), 4)  # every quad would keep position 0 twice


# -- repacks through the canonical form ---------------------------------------------------------
def gptq_case(bits, group, sym, fmt, act_order=False, k=256, n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(k, generator=g) if act_order else None
    q = quantize_rtn(torch.randn(n, k, generator=g), bits, group, sym, perm=perm)
    return q, gptq_tensors("m", q, fmt)


@pytest.mark.parametrize("bits,group,sym,fmt,act_order", [
    (4, 128, True, "gptq", False), (4, -1, True, "gptq_v2", False), (8, 64, True, "gptq", False),
    (4, 64, False, "gptq_v2", False), (4, 128, True, "gptq", True), (8, 64, False, "gptq", True)])
def test_gptq_marlin_round_trip(bits, group, sym, fmt, act_order):
    q, t = gptq_case(bits, group, sym, fmt, act_order, seed=bits + group)
    offset = 1 if fmt == "gptq" else 0
    packed = qm.gptq_to_marlin(t["m.qweight"], t["m.qzeros"], t["m.scales"], t["m.g_idx"], bits, offset)
    assert (packed.zp is None) == sym and (packed.g_idx is not None) == act_order
    torch.testing.assert_close(dequantize(km.marlin_to_quantized(packed)), q.dense(), rtol=0, atol=1e-6)
    back = qm.marlin_to_gptq(packed, offset)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(back[name], t[f"m.{name}"]), name
    if sym and bits == 4 and not act_order:  # the very tensors a Marlin checkpoint of the same weights stores
        want = marlin_tensors("m", q)
        assert torch.equal(packed.B, want["m.B"]) and torch.equal(packed.s, want["m.s"])


def test_awq_marlin_round_trip():
    g = torch.Generator().manual_seed(3)
    q = quantize_rtn(torch.randn(128, 256, generator=g), 4, 64, sym=False)
    t = awq_tensors("m", q)
    packed = qm.awq_to_marlin(t["m.qweight"], t["m.qzeros"], t["m.scales"], 64)
    assert torch.equal(packed.zp, marlin_zero_points(q.zeros, 4))
    torch.testing.assert_close(dequantize(km.marlin_to_quantized(packed)), q.dense(), rtol=0, atol=1e-6)
    back = qm.marlin_to_awq(packed)
    for name in ("qweight", "qzeros", "scales"):
        assert torch.equal(back[name], t[f"m.{name}"]), name


def test_repack_refuses_what_marlin_cannot_hold():
    q, t = gptq_case(3, 64, True, "gptq_v2", k=256)
    with pytest.raises(ValueError, match="4- or 8-bit"):
        qm.gptq_to_marlin(t["m.qweight"], t["m.qzeros"], t["m.scales"], t["m.g_idx"], 3, 0)
    q, _ = gptq_case(4, 64, False, "gptq_v2", seed=4)
    q.zeros[0, 0] = 0  # fine in v2, not storable in v1
    t = gptq_tensors("m", q, "gptq_v2")
    packed = qm.gptq_to_marlin(t["m.qweight"], t["m.qzeros"], t["m.scales"], t["m.g_idx"], 4, 0)
    with pytest.raises(ValueError, match="zero point of 0 cannot be stored in GPTQ v1"):
        qm.marlin_to_gptq(packed, zero_offset=1)


# -- configs ---------------------------------------------------------------------------------------
GPTQ_MARLIN = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "static_groups": False,
               "true_sequential": True, "damp_percent": 0.01, "quant_method": "gptq", "checkpoint_format": "marlin"}


def write_config(folder: Path, file: str, content: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"model_type": "llama", "quantization_config": content} if file == "config.json" else content
    (folder / file).write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("file,content,want", [
    ("quantize_config.json", GPTQ_MARLIN, (4, 128, "marlin")),
    ("config.json", GPTQ_MARLIN | {"checkpoint_format": "marlin_24", "bits": 8, "group_size": -1},
     (8, -1, "marlin_24")),
    ("quantize_config.json", {"bits": 4, "group_size": -1, "is_marlin_format": True, "sym": True}, (4, -1, "marlin")),
    ("quantize_config.json", GPTQ_MARLIN | {"checkpoint_format": None, "is_marlin_format": True}, (4, 128, "marlin")),
    # TGI's Marlin checkpoints: quant_method marlin, bits left out.
    ("config.json", {"quant_method": "marlin", "group_size": 128}, (4, 128, "marlin")),
    ("quantize_config.json", {"quant_method": "marlin", "group_size": -1, "sym": True}, (4, -1, "marlin")),
])
def test_marlin_configs(tmp_path, file, content, want):
    config = read_quantization_config(write_config(tmp_path, file, content), None)
    assert isinstance(config, MarlinConfig)
    assert (config.bits, config.group_size, config.checkpoint_format) == want
    assert config.source.endswith(file)
    assert read_quantization_config(tmp_path, "marlin") == config


@pytest.mark.parametrize("change,match", [
    ({"sym": False}, r"'quantization_config\.sym' = False is not yet supported for marlin \(supported: true"),
    ({"bits": 3}, r"'quantization_config\.bits' = 3 is not yet supported for marlin \(supported: 4\)"),
    ({"bits": 2, "checkpoint_format": "marlin_24"}, r"'quantization_config\.bits' = 2 .* marlin_24 \(supported: 4, 8"),
    ({"group_size": 64}, r"'quantization_config\.group_size' = 64 .* \(supported: -1, 128\)"),
    ({"desc_act": True}, r"'quantization_config\.desc_act' = True .* no g_idx"),
    ({"lm_head": True}, r"'quantization_config\.lm_head' = True"),
    ({"bits": "4"}, r"'quantization_config\.bits' must be an integer"),
])
def test_bad_marlin_configs_name_the_key(tmp_path, change, match):
    with pytest.raises(CheckpointError, match=match):
        read_quantization_config(write_config(tmp_path, "config.json", GPTQ_MARLIN | change), None)


def test_marlin_method_with_another_format_and_the_gptq_flag(tmp_path):
    folder = write_config(tmp_path / "a", "quantize_config.json",
                          {"quant_method": "marlin", "checkpoint_format": "gptq"})
    with pytest.raises(CheckpointError, match=r"quantize_config\.json: 'checkpoint_format' = 'gptq' .* marlin_24"):
        read_quantization_config(folder, None)
    # The checkpoint says gptq, so --quantize gptq fits it; the Marlin layout decides the loader.
    folder = write_config(tmp_path / "b", "quantize_config.json", GPTQ_MARLIN)
    config = read_quantization_config(folder, "gptq")
    assert isinstance(config, MarlinConfig) and config.quant_method == "gptq" and config.flag == "marlin"
    # TGI's own Marlin checkpoints say marlin: a gptq flag contradicts them.
    folder = write_config(tmp_path / "c", "config.json", {"quant_method": "marlin", "group_size": 128})
    with pytest.raises(CheckpointError, match=r"--quantize gptq disagrees .*\.quant_method' = 'marlin' "
                                              r"\(marlin \(marlin\) 4-bit group 128 sym\)"):
        read_quantization_config(folder, "gptq")


# -- the loader matrix -------------------------------------------------------------------------------
K = 384  # 3 groups of 128; 96 rows per rank at world size 4 (groups straddle ranks)
PARTS = {"q": 256, "k": 128, "v": 128}  # k and v: 32 columns per rank at world size 4, half a layout block
N = sum(PARTS.values())
WORLDS = [1, 2, 4]
CASES = {f"{fmt}-{bits}bit-{'g128' if g == 128 else 'channel'}": (fmt, bits, g)
         for fmt, bits in (("marlin", 4), ("marlin_24", 4), ("marlin_24", 8)) for g in (128, -1)}


def quantize_case(fmt: str, bits: int, group: int, seed: int, shapes: dict[str, int], k: int = K):
    g = torch.Generator().manual_seed(seed)
    tensors, dense = {}, {}
    for prefix, n in shapes.items():
        w = torch.randn(n, k, generator=g) * 0.1
        if fmt == "marlin_24":
            w = prune_24(w)
        q = quantize_rtn(w, bits, group, sym=True)
        tensors |= (marlin24_tensors if fmt == "marlin_24" else marlin_tensors)(prefix, q)
        dense[prefix] = q.dense()
    return tensors, dense


@pytest.fixture(scope="module")
def cases() -> dict:
    out = {}
    for seed, (name, (fmt, bits, group)) in enumerate(CASES.items()):
        shapes = {f"m.{p}": n for p, n in PARTS.items()} | {"m.qkv": N}
        tensors, dense = quantize_case(fmt, bits, group, seed, shapes)
        out[name] = (tensors, dense, MarlinConfig(source="test", bits=bits, group_size=group, checkpoint_format=fmt))
    return out


def weights_for(tensors: dict, config, rank: int = 0, world: int = 1) -> Weights:
    return Weights(DictTensorSource(tensors), torch.device("cpu"), torch.float32,
                   ProcessGroup(rank=rank, size=world), loader=get_loader(config))


def load(tensors, config, method: str, rank: int, world: int) -> torch.Tensor:
    loaded = load_qkv(weights_for(tensors, config, rank, world), method, PARTS)
    assert isinstance(loaded, MarlinWeight)
    return dequantize(loaded.to_quantized())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(CASES))
def test_loader_matrix(cases, name, method, world):
    tensors, dense, config = cases[name]
    shards = [load(tensors, config, method, rank, world) for rank in range(world)]
    if method == "full":
        assert all(torch.equal(s, shards[0]) for s in shards)
    elif method in ("col", "row"):
        assert shards[0].shape == ((N, K // world) if method == "row" else (N // world, K))
    torch.testing.assert_close(join_shards(method, shards, PARTS), qkv_of(method, dense, PARTS), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["marlin-4bit-g128", "marlin_24-8bit-g128"])
def test_row_shards_off_block_boundaries(cases, name):
    """World size 8: 48 rows per rank, half a 2:4 block (32 rows), groups shared by neighbours."""
    tensors, dense, config = cases[name]
    shards = [dequantize(weights_for(tensors, config, r, 8).get_weights_row("m.qkv").to_quantized())
              for r in range(8)]
    torch.testing.assert_close(torch.cat(shards, dim=1), dense["m.qkv"], rtol=0, atol=1e-6)


def test_rank_reads_only_its_blocks(cases):
    """A column rank reads its blocks of B, not the whole tensor."""
    tensors, _, config = cases["marlin-4bit-g128"]
    seen: list = []

    class Spy(DictTensorSource):
        def get_slice(self, name):
            inner = super().get_slice(name)

            class Slice:
                def get_shape(self):
                    return inner.get_shape()

                def __getitem__(self, index):
                    out = inner[index]
                    seen.append((name, tuple(out.shape)))
                    return out
            return Slice()

    w = Weights(Spy(tensors), torch.device("cpu"), torch.float32, ProcessGroup(rank=1, size=4),
                loader=get_loader(config))
    w.get_weights_col("m.qkv")
    assert ("m.qkv.B", (K // 16, N // 4 * 2)) in seen and ("m.qkv.s", (3, N // 4)) in seen


# -- bad tensors ------------------------------------------------------------------------------------
def test_bad_tensors_are_named(cases):
    tensors, _, config = cases["marlin_24-4bit-g128"]
    missing = {k: v for k, v in tensors.items() if k != "m.qkv.B_meta"}
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.B_meta' not found .*every marlin_24 linear stores it"):
        weights_for(missing, config).get_weights("m.qkv")
    bad = tensors | {"m.qkv.B_meta": tensors["m.qkv.B_meta"][:, :-2]}
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.B_meta' has shape \[12, 1022\], expected \[12, 1024\]"):
        weights_for(bad, config).get_weights_row("m.qkv")
    bad = tensors | {"m.qkv.B_meta": torch.zeros_like(tensors["m.qkv.B_meta"])}
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.B_24': B_meta holds invalid 2:4 metadata"):
        weights_for(bad, config).get_weights("m.qkv")
    as_8bit = MarlinConfig(source="quantize_config.json", bits=8, group_size=128, checkpoint_format="marlin_24")
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.B_24' has shape \[12, 1024\], expected \[K/32, 2048\] "
                                              r".*bits = 8 \(quantize_config\.json\)"):
        weights_for(tensors, as_8bit).get_weights("m.qkv")

    tensors, _, config = cases["marlin-4bit-g128"]
    bad = tensors | {"m.qkv.s": tensors["m.qkv.s"][:, :-32]}
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.s' has shape \[3, 480\].*multiple of 64"):
        weights_for(bad, config).get_weights_col("m.qkv")
    bad = tensors | {"m.qkv.s": tensors["m.qkv.s"][:2]}
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.s' has 2 groups, but K = 384 .*group_size = 128"):
        weights_for(bad, config).get_weights("m.qkv")
    per_channel = MarlinConfig(source="cfg", bits=4, group_size=-1)
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.s' has 3 groups.*group_size = -1 \(cfg\) makes 1"):
        weights_for(tensors, per_channel).get_weights("m.qkv")
    bad = tensors | {"m.qkv.B": tensors["m.qkv.B"].long()}
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.B' must be torch\.int32, got torch\.int64"):
        weights_for(bad, config).get_weights("m.qkv")
    with pytest.raises(CheckpointError, match=r"'m\.q\.s': a part of 256 output features does not divide into 3"):
        weights_for(tensors, config, 0, 3).get_multi_weights_col(["m.q", "m.k", "m.v"], dim=0)
    with pytest.raises(CheckpointError, match=r"'m\.qkv\.B': 384 input features do not divide into 5 shards"):
        weights_for(tensors, config, 0, 5).get_weights_row("m.qkv")


# -- kernels --------------------------------------------------------------------------------------
def canonical(k, n, bits, group, sym=True, act_order=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(k, generator=g) if act_order else None
    q = quantize_rtn(torch.randn(n, k, generator=g), bits, group, sym, perm=perm)
    t = gptq_tensors("m", q, "gptq_v2")
    config = GPTQConfig(source="t", bits=bits, group_size=group, sym=sym, desc_act=act_order,
                        checkpoint_format="gptq_v2")
    return weights_for(t, config).get_weights("m")


@pytest.mark.parametrize("bits,group,act_order", [(4, 128, False), (8, -1, False), (4, 48, True), (8, 32, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_marlin_layout_kernel_matches_reference(bits, group, act_order, dtype):
    w = canonical(384, 128, bits, group, act_order=act_order, seed=bits).to_quantized()
    ok, reason = km.MarlinLayoutKernel.can_implement(w.spec(dtype, "cpu"))
    assert ok, reason
    bias = torch.randn(128)
    module = km.MarlinLayoutKernel.build(w, bias, dtype)
    assert module.B.dtype == torch.int32 and module.B.numel() * 32 == 384 * 128 * bits  # compact
    x = torch.randn(3, 5, 384).to(dtype)
    want = x.double() @ dequantize(w, torch.float64).t() + bias.to(dtype).double()
    got = module(x)
    assert got.dtype == dtype and got.shape == (3, 5, 128)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got.double() - want).norm() / want.norm()).item() < bound


def spec(**changes) -> LinearSpec:
    base = dict(in_features=256, out_features=128, bits=4, group_size=128, has_zeros=False, act_order=False,
                act_dtype=torch.float32, device_type="cpu")
    return LinearSpec(**(base | changes))


@pytest.mark.parametrize("changes,reason", [
    (dict(has_zeros=True), "asymmetric weights"),
    (dict(bits=3), "needs 4- or 8-bit codes, got 3-bit"),
    (dict(group_size=40, group_rows_gcd=8), "groups must be whole 16-row strips"),
    (dict(out_features=96), "does not tile into 16x64 blocks"),
    (dict(device_type="cuda"), "device cuda"),
    (dict(weight_format="fp8"), "not fp8 weights"),
])
def test_marlin_layout_kernel_refuses_with_reasons(changes, reason):
    ok, why = km.MarlinLayoutKernel.can_implement(spec(**changes))
    assert not ok and reason in why


def test_marlin_layout_sits_after_int4pack_and_serves_when_it_is_disabled(monkeypatch):
    names = [k.name for k in CPU if k.family == "quantized"]
    assert names.index("marlin-layout") > names.index("reference") > names.index("cpu-int4pack")
    monkeypatch.setenv(DISABLE_ENV, "cpu-int4pack,reference")
    sym = canonical(256, 128, 4, 128, sym=True)
    assert sym.get_linear(None).kernel_name == "marlin-layout"
    asym = canonical(256, 128, 4, 128, sym=False)
    with pytest.raises(NoKernelError, match="marlin-layout: asymmetric weights"):
        choose_kernel(asym.to_quantized().spec(torch.float32, "cpu"))  # the packed path refuses zero points
    monkeypatch.setenv(DISABLE_ENV, "cpu-int4pack")
    kernel, rejected = choose_kernel(asym.to_quantized().spec(torch.float32, "cpu"))
    assert kernel.name == "reference"  # ... and the next kernel in the list serves them
    assert asym.get_linear(None).kernel_name == "reference"


def test_marlin24_runs_dense_on_cpu_and_refuses_the_sparse_kernel_here(cases):
    tensors, dense, config = cases["marlin_24-4bit-g128"]
    weight = weights_for(tensors, config).get_weights("m.qkv")
    assert km.is_24_sparse(weight.to_quantized())
    bias = torch.randn(N)
    module = weight.get_linear(bias)
    assert module.kernel_name != "sparse-2:4"
    x = torch.randn(4, K)
    want = x.double() @ dense["m.qkv"].double().t() + bias.double()
    assert ((module(x).double() - want).norm() / want.norm()).item() < 2e-2
    sparse_spec = spec(weight_format=km.SPARSE_24_FORMAT, device_type="cuda", act_dtype=torch.float16)
    ok, why = km.Sparse24Kernel.can_implement(sparse_spec)
    assert ok == (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8)
    ok, why = km.Sparse24Kernel.can_implement(spec(device_type="cuda"))
    assert not ok and "2:4" in why
    assert "sparse-2:4" in [k.name for k in CUDA]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
                    reason="the semi-structured sparse kernel needs a CUDA device of compute capability 8.0+")
def test_marlin24_uses_the_sparse_kernel_on_cuda(cases):
    tensors, dense, config = cases["marlin_24-4bit-g128"]
    w = Weights(DictTensorSource(tensors), torch.device("cuda"), torch.float16, loader=get_loader(config))
    module = w.get_weights("m.qkv").get_linear(None)
    assert module.kernel_name == "sparse-2:4"
    x = torch.randn(16, K, device="cuda", dtype=torch.float16)
    want = x.double() @ dense["m.qkv"].cuda().double().t()
    assert ((module(x).double() - want).norm() / want.norm()).item() < 5e-3


# -- end to end -------------------------------------------------------------------------------------
# head_dim 64: k/v 128 outputs (64 per rank at world size 2); intermediate 384: down_proj's 3 groups of
# 128 rows split 192 per rank, so one group straddles the ranks.
SHAPE = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
VARIANTS = {
    # AutoGPTQ's Marlin export: quant_method gptq, checkpoint_format marlin (and the old is_marlin_format).
    "marlin-4bit-g128": dict(fmt="marlin", bits=4, group=128, files={
        "quantize_config.json": GPTQ_MARLIN | {"is_marlin_format": True}, "config.json": GPTQ_MARLIN}),
    "marlin_24-8bit-channel": dict(fmt="marlin_24", bits=8, group=-1, files={
        "config.json": GPTQ_MARLIN | {"checkpoint_format": "marlin_24", "bits": 8, "group_size": -1}}),
}
QUANT_ERROR = {4: 0.25, 8: 0.02}  # mean |logprob difference| against the unquantized (pruned) model
WORLD = 2
SPAWN_TIMEOUT_S = 180
TOKENS = 6  # greedy tokens compared at world size 2


def write_variant(original: Path, root: Path, name: str, spec: dict) -> None:
    """root/name: the checkpoint; name.dense: dequantized weights; name.float: the (pruned) unquantized model."""
    state = load_file(str(original / "model.safetensors"))
    out = {"": {}, ".dense": {}, ".float": {}}
    for key, tensor in state.items():
        prefix = key.removesuffix(".weight")
        if not prefix.startswith("model.layers.") or prefix.split(".", 3)[-1] not in LINEARS:
            for part in out.values():
                part[key] = tensor.half() if part is not out[".float"] else tensor
            continue
        w = prune_24(tensor.float()) if spec["fmt"] == "marlin_24" else tensor.float()
        q = quantize_rtn(w, spec["bits"], spec["group"], sym=True)
        out[""] |= (marlin24_tensors if spec["fmt"] == "marlin_24" else marlin_tensors)(prefix, q)
        out[".dense"][key] = q.dense()
        out[".float"][key] = w
    config = json.loads((original / "config.json").read_text())
    for suffix, tensors in out.items():
        files = spec["files"] if suffix == "" else {}
        content = config | ({"quantization_config": files["config.json"]} if "config.json" in files else {})
        folder = write_model_folder(root / f"{name}{suffix}", original, tensors, content)
        for file, quant in files.items():
            if file != "config.json":
                (folder / file).write_text(json.dumps(quant))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("marlin_e2e")
    write_checkpoint(root / "llama", "llama", seed=11, **SHAPE)
    for name, spec in VARIANTS.items():
        write_variant(root / "llama", root, name, spec)
    return {p.name: p for p in root.iterdir()}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_e2e_reference_path_equals_dequantized_checkpoint(folders, monkeypatch, name):
    monkeypatch.setenv(DISABLE_ENV, fast_kernels())
    lm = get_model(str(folders[name]), dtype="float32")
    assert lm.quantize == "marlin" and kernels_used(lm) <= {"reference", "dense"}
    got = prompt_logprobs(lm)
    torch.testing.assert_close(got, prompt_logprobs(get_model(str(folders[f"{name}.dense"]), dtype="float32")),
                               atol=2e-5, rtol=0)
    error = (got - prompt_logprobs(get_model(str(folders[f"{name}.float"]), dtype="float32"))).abs().mean().item()
    assert 0 < error < QUANT_ERROR[VARIANTS[name]["bits"]], error


@pytest.mark.parametrize("name,disabled,kernel", [("marlin-4bit-g128", "", "cpu-int4pack"),
                                                  ("marlin-4bit-g128", "cpu-int4pack,reference", "marlin-layout"),
                                                  ("marlin_24-8bit-channel", "", "cpu-int8")])
def test_e2e_chosen_kernels_stay_close_to_the_reference(folders, monkeypatch, name, disabled, kernel):
    monkeypatch.setenv(DISABLE_ENV, disabled)
    lm = get_model(str(folders[name]), dtype="float32")
    assert kernel in kernels_used(lm)
    want = prompt_logprobs(get_model(str(folders[f"{name}.dense"]), dtype="float32"))
    assert (prompt_logprobs(lm) - want).abs().max() < 0.05


@pytest.fixture(scope="module")
def world2(folders, tmp_path_factory) -> list[dict]:
    return run_ranks_per_mode(folders, VARIANTS, WORLD, tmp_path_factory.mktemp("marlin_tp"), SPAWN_TIMEOUT_S, TOKENS)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_e2e_world_size_2_matches_world_size_1(folders, world2, monkeypatch, name):
    assert_ranks_match_one_process(world2, name, str(folders[name]), monkeypatch, TOKENS)
