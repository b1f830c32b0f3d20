"""cpu-kquant: GGUF Q4_K / Q6_K blocks read in place (kernels/cpu_kquant.py, cpu_native_kquant_src.py).

Blocks are random (tests/gguf_writer.py k_quant_bytes: random codes and packed scales, finite fp16
super-block scales). Checked here:
- the native dequantization gives the block decoder's values bit for bit (float32, and bfloat16 as
  torch rounds them), the decoder itself being checked against the gguf package in test_gguf.py;
- activations are quantized by ggml's Q8_K rule (written out here from the rule, in torch);
- the kernel equals the same arithmetic done here in float64 from the same integer sums (llama.cpp's
  Q8_K dot products) within float32 summation error, and equals dequantize-then-matmul within the
  bound the activation rounding allows: |x - d * q| <= |d| / 2 per element, so
  |y - W x| <= sum_k |W[n, k]| * |d_block(k)| / 2 (plus float32 slack);
- a row's result has the same bits whatever the rows beside it (1 to 40 rows: each code path), for odd N and K,
  strided rows (a rank's column slice) and parts; the AVX2 build (TGS_CPU_ISA=avx2) gives the same bits;
- the packed form (AVX-512 builds: 16 outputs' blocks interleaved, converted at load) gives the bits of
  the stored layout's kernel for every row count, tail tile, strided rows and parts, and its layer
  those of the AVX2 build; wrong sizes are refused by name;
- a fused layer of mixed types (Q4_K q and k, Q6_K v) joined into one call gives each part's columns the
  bits of its own layer (one call per type and a torch.cat) at every row count, packed and as stored, on
  one thread and two, and in the AVX2 build;
- loading a GGUF reads the file's blocks as views (nothing decoded; on AVX-512 builds each layer packs
  them into its own copy), runs them on cpu-kquant, and falls back to the canonical form where the
  kernel is switched off;
- a row-parallel split off the 256-wide super-block keeps the decoded form (quantizers/gguf.py's rule);
  on a super-block boundary the rank's blocks stay a view.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf_writer import T, k_quant_bytes, write_gguf
from helpers import fast_kernels, greedy, kernel_names, kernels_used, prompt_logprobs

from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.cpu_kquant import KQuantBlocks, kquant_dequant, kquant_mm, quantize_q8k
from text_generation_server.kernels.select import DISABLE_ENV
from text_generation_server.models.loader import get_model
from text_generation_server.quantizers.gguf_blocks import FORMATS, decode
from text_generation_server.quantizers.gguf_file import open_gguf

torch.set_num_threads(1)
TYPES = [T.Q4_K, T.Q6_K]
SHAPES = [(1, 256), (3, 512), (7, 768), (33, 1536), (64, 2304)]  # (N, K)


@pytest.fixture(scope="module")
def native():
    module = cpu_native.native()
    if module is None or not module.kquant_native_isa():
        pytest.skip(f"native kernels without their AVX2 code ({cpu_native.unavailable_reason() or 'not x86-64'})")
    return module


def blocks(qtype, n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(k_quant_bytes(np.random.default_rng(seed), qtype, n, k))


def q8k_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's quantize_row_q8_K_ref as a rule: per 256 values, the value of largest magnitude `max`,
    iscale = -127 / max, codes round(iscale * x) (to nearest even) capped at 127, d = 1 / iscale."""
    m, k = x.shape
    v = x.float().view(m, k // 256, 256)
    at = v.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes, as ggml's strict '>'
    big = v.gather(-1, at)
    zero = big == 0
    # tensor / tensor: one IEEE division (a Python number over a tensor multiplies by a reciprocal)
    iscale = torch.where(zero, torch.zeros_like(big), torch.full_like(big, -127.0) / torch.where(zero, 1.0, big))
    codes = torch.round(iscale * v).clamp(max=127).to(torch.int8)
    d = torch.where(zero, torch.zeros_like(big), torch.ones_like(big) / torch.where(zero, 1.0, iscale))
    sums = codes.view(m, k // 16, 16).to(torch.int32).sum(-1)
    return codes.view(m, k), d.view(m, -1), sums


def int_reference(qtype, raw: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q8_K dot product with exact integer sums per block (llama.cpp's), each block's terms scaled
    in float64; also the sum of every product's magnitude, which bounds every partial sum the kernel
    rounds (its lanes hold parts of a block's sum: they may cancel, and exceed 2^24)."""
    from text_generation_server.quantizers.gguf_blocks import _k_scale_min

    fmt = FORMATS[int(qtype)]
    codes, d, sums = q8k_reference(x)
    m, k = x.shape
    n, nb = raw.shape[0], k // 256
    blk = raw.view(n, nb, fmt.block_bytes)
    half = lambda at: blk[..., at:at + 2].contiguous().view(torch.float16)[..., 0].double()  # noqa: E731
    q = decode(fmt, raw).codes.long().view(1, n, nb, 256)
    c = codes.long().view(m, 1, nb, 256)
    if fmt.name == "Q6_K":
        sc = blk[..., 192:208].contiguous().view(torch.int8).long()  # [n, nb, 16]
        prod = ((q - 32) * c).view(m, n, nb, 16, 16)
        dd = half(208)[None] * d.double()[:, None, :]
        terms = (prod.sum(-1) * sc[None]).sum(-1).double() * dd  # exact integers, then one scaling
        size = (prod.abs().sum(-1) * sc.abs()[None]).sum(-1).double() * dd.abs()
        return terms.sum(-1), size.sum(-1)
    else:
        sc, mn = _k_scale_min(blk[..., 4:16])
        per = (q * c).view(m, n, nb, 8, 32).sum(-1)
        isum = (per * sc.long()[None]).sum(-1)
        msum = (sums.long().view(m, 1, nb, 8, 2).sum(-1) * mn.long()[None]).sum(-1)
        dy = d.double()[:, None, :]
        terms = isum.double() * half(0)[None] * dy - msum.double() * half(2)[None] * dy
        size = ((q * c).abs().view(m, n, nb, 8, 32).sum(-1) * sc.long()[None]).sum(-1).double() * \
            (half(0)[None] * dy).abs() + (c.abs().view(m, 1, nb, 8, 32).sum(-1) * mn.long()[None]).sum(-1).double() \
            * (half(2)[None] * dy).abs()
        return terms.sum(-1), size.sum(-1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_native_dequant_equals_the_block_decoder(native, qtype):
    fmt = FORMATS[int(qtype)]
    for n, k in SHAPES:
        raw = blocks(qtype, n, k, seed=n)
        want = decode(fmt, raw).dequantize(fmt)
        assert torch.equal(kquant_dequant(native, raw, int(qtype)), want), (n, k)
        assert torch.equal(kquant_dequant(native, raw, int(qtype), torch.bfloat16), want.to(torch.bfloat16)), (n, k)


def test_activations_are_quantized_by_ggmls_q8k_rule(native):
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 30.0, 1e4])\
        .repeat_interleave(256)
    x[1, 256:512] = 0  # an all-zero block: d = 0, codes 0
    x[2, 0] = -x[2, :256].abs().max() * 2  # a negative extreme: codes flip sign (iscale = -127 / max)
    x[3, 512:768] = torch.arange(256).float() / 2 - 64  # halves: ties round to even
    got, want = quantize_q8k(native, x), q8k_reference(x)
    for g, w, what in zip(got, want, ("codes", "d", "sums")):
        assert torch.equal(g, w), what


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_equals_the_q8k_arithmetic_and_the_dequantized_matmul(native, qtype):
    fmt = FORMATS[int(qtype)]
    gen = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        raw = blocks(qtype, n, k, seed=k)
        for m in (1, 2, 3, 5, 8, 11, 19):
            x = torch.randn(m, k, generator=gen)
            y = kquant_mm(native, x, raw, int(qtype)).double()
            ref, scale = int_reference(qtype, raw, x)
            # float32: a rounding per block's scaling and sum, 16 (AVX-512) or 8 (AVX2) lanes, then their sum
            assert ((y - ref).abs() <= 2 * (k // 256 + 16) * 2.0**-24 * scale + 1e-30).all(), (n, k, m)
            w = decode(fmt, raw).dequantize(fmt).double()
            exact = x.double() @ w.t()
            _, d, _ = q8k_reference(x)
            bound = (w.abs().view(n, k // 256, 256).sum(-1)[None] * d.double().abs()[:, None, :] / 2).sum(-1)
            assert ((y - exact).abs() <= bound + 1e-5 * scale).all(), (n, k, m)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_its_batch_strides_or_parts(native, qtype):
    n, k = 37, 1792  # 37: two full tiles of 16 outputs and a part
    raw = blocks(qtype, n, k, seed=3)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([kquant_mm(native, x[i:i + 1], raw, int(qtype)) for i in range(40)])
    # 1-11 rows (passes of up to 8 on the tiled code), then past GEMM_ROWS (16: Q4_K's decoded-tile path)
    for m in [*range(1, 12), 15, 16, 17, 25, 40]:
        assert torch.equal(kquant_mm(native, x[:m], raw, int(qtype)), alone[:m]), m
    assert torch.equal(kquant_mm(native, x[21:40], raw, int(qtype)), alone[21:40])
    # a rank's columns (whole super-blocks) as a strided view of the stored rows
    size = FORMATS[int(qtype)].block_bytes
    view = raw[:, 2 * size:5 * size]
    assert not view.is_contiguous()
    assert torch.equal(kquant_mm(native, x[:, 512:1280], view, int(qtype)),
                       kquant_mm(native, x[:, 512:1280], view.contiguous(), int(qtype)))
    # a fused layer's parts, kept apart, equal their concatenation
    weight = KQuantBlocks((raw[:20], raw[20:]), int(qtype))
    assert weight.shape == (n, k)
    layer = cpu_kquant_layer(weight)
    torch.testing.assert_close(layer(x), alone, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_one_call_layer_has_the_bits_of_its_steps(native, qtype, dtype):
    """KQuantLinear's one native call (quantize into scratch, the parts side by side, the bias) equals
    quantize_q8k, kquant_mm_into per part and torch's `y + bias` in the layer's dtype, bit for bit."""
    from text_generation_server.kernels.cpu_kquant import PREFETCH_BYTES, CpuKQuantKernel, KQuantLinear

    n, k = 53, 1280
    raw = blocks(qtype, n, k, seed=7)
    weight = KQuantBlocks((raw[:16], raw[16:21], raw[21:]), int(qtype))
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(n, generator=gen) * 8
    x = (torch.randn(19, k, generator=gen) * 3).to(dtype)
    x[2, 256:512] = 0
    for b in (None, bias):
        layer = CpuKQuantKernel.build(weight, b, dtype)
        for m in (1, 2, 8, 19):
            q, d, s = quantize_q8k(native, x[:m])
            want = torch.empty(m, n, dtype=dtype)
            col = 0
            for part in weight.parts:
                native.kquant_mm_into(q, d, s, part, int(qtype), PREFETCH_BYTES, want, col)
                col += part.shape[0]
            if b is not None:
                want = want + b.to(dtype)
            with torch.inference_mode():
                got = layer(x[:m])
            assert got.dtype == dtype and torch.equal(got, want), (m, b is None)
        with torch.inference_mode():
            assert torch.equal(layer(x[:3].reshape(3, 1, k)), layer(x[:3]).reshape(3, 1, n))
    with pytest.raises(RuntimeError, match="bias must be empty"):
        native.kquant_linear(list(weight.parts), [int(qtype)], torch.zeros(n + 1, dtype=dtype), [0], [], x[:1])
    if native.kquant_packed_isa():  # the layer read the packed form; the blocks as stored give the same bits
        stored = KQuantLinear(weight.parts, int(qtype), bias.to(dtype), dtype, packed=False)
        packed = CpuKQuantKernel.build(weight, bias, dtype)
        assert packed.packed and not stored.packed
        described = weight.describe_layer(weight.spec(dtype, "cpu"), CpuKQuantKernel)
        assert described == f"{qtype.name} blocks packed at load (16 outputs interleaved)", described
        with torch.inference_mode():
            assert torch.equal(stored(x), packed(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_a_layer_of_mixed_types_is_one_call_with_its_parts_bits(native, dtype):
    """A fused layer whose parts are stored in different types (a Q4_K_M file's Q4_K q and k beside its
    Q6_K v), joined into one KQuantLinear (quantizers/gguf.py join_parts): each part's columns have the
    bits of its own layer (a call per type and torch.cat: the path before), for each row count and code
    path (passes of 1-8 rows, the decoded-tile path from 16), packed and as stored, with and without a
    bias, in either order of the types; built at once from mixed parts it is the same layer."""
    from text_generation_server.kernels.cpu_kquant import CpuKQuantKernel, KQuantLinear
    from text_generation_server.quantizers.gguf import SplitLinear, join_parts

    k = 1536
    q4, q6 = blocks(T.Q4_K, 74, k, seed=21), blocks(T.Q6_K, 37, k, seed=22)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(19, k, generator=gen) * 3).to(dtype)
    x[4, :256] = 0
    bias = (torch.randn(111, generator=gen) * 4).to(dtype)
    forms = [None, False] if native.kquant_packed_isa() else [False]
    for first_q4 in (True, False):
        parts = [(q4[:53], q4[53:]), (q6,)] if first_q4 else [(q6,), (q4[:53], q4[53:])]
        types = [int(T.Q4_K), int(T.Q6_K)] if first_q4 else [int(T.Q6_K), int(T.Q4_K)]
        sizes = [sum(p.shape[0] for p in ps) for ps in parts]
        for packed in forms:
            for b in (None, bias):
                pieces = [None, None] if b is None else [b[:sizes[0]], b[sizes[0]:]]
                alone = [KQuantLinear(ps, t, piece, dtype, packed=packed) for ps, t, piece in zip(parts, types, pieces)]
                joined = join_parts(alone)
                assert isinstance(joined, KQuantLinear) and joined.count == 3 and joined.packed == alone[0].packed
                assert joined.types == [t for ps, t in zip(parts, types) for _ in ps]
                at_once = KQuantLinear(tuple(p for ps in parts for p in ps), joined.types, b, dtype, packed=packed)
                split = SplitLinear(alone)
                with torch.inference_mode():
                    for m, threads in ((1, 1), (1, 2), (2, 2), (5, 1), (8, 2), (9, 1), (16, 2), (19, 1)):
                        want = split(x[:m])
                        torch.set_num_threads(threads)  # 2: the tiles shared out by the native pool
                        try:
                            got = joined(x[:m])
                        finally:
                            torch.set_num_threads(1)
                        assert got.dtype == dtype and got.shape == (m, 111)
                        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                           want.view(torch.int16 if dtype != torch.float32 else torch.int32)), \
                            (first_q4, packed, b is None, m)
                        assert torch.equal(at_once(x[:m]), got), (first_q4, packed, m)
                        apart = SplitLinear(joined.split([[0, 1], [2]] if first_q4 else [[0], [1, 2]]))
                        assert torch.equal(apart(x[:m]), got), (first_q4, packed, m)  # split: the layers before join
                    assert torch.equal(joined(x[:3].reshape(3, 1, k)), joined(x[:3]).reshape(3, 1, 111))
        if dtype == torch.float32:  # each part's columns: its stored blocks' product (kquant_mm) plus the bias
            layer = join_parts([CpuKQuantKernel.build(KQuantBlocks(ps, t), piece, dtype)
                                for ps, t, piece in zip(parts, types, (bias[:sizes[0]], bias[sizes[0]:]))])
            want = torch.cat([kquant_mm(native, x, torch.cat(ps), t) for ps, t in zip(parts, types)], dim=1) + bias
            with torch.inference_mode():
                assert torch.equal(layer(x), want)
    if native.kquant_packed_isa():
        with pytest.raises(ValueError, match="only KQuantLinear layers of one form"):
            KQuantLinear.join([KQuantLinear((q4,), int(T.Q4_K), None, dtype),
                               KQuantLinear((q6,), int(T.Q6_K), None, dtype, packed=False)])
    with pytest.raises(ValueError, match="must split parts 0..2 in order"):
        joined.split([[0], [2, 1]])
    with pytest.raises(ValueError, match="need one K-quant type each"):
        KQuantLinear((q4, q6), [int(T.Q4_K)], None, dtype)
    with pytest.raises(RuntimeError, match="types must hold one K-quant type for all parts or one per part"):
        native.kquant_linear([q4, q4, q6], [12, 14], torch.empty(0), [0], [], x[:1].float())
    with pytest.raises(RuntimeError, match="K-quant type must be"):
        native.kquant_linear([q4, q6], [12, 13], torch.empty(0), [0], [], x[:1].float())


def packed(native, raw: torch.Tensor, qtype) -> torch.Tensor:
    if not native.kquant_packed_isa():
        pytest.skip("the packed form's kernel needs an AVX-512BW build")
    return native.kquant_pack(raw, int(qtype))


def packed_mm(native, x: torch.Tensor, pack: torch.Tensor, n: int, qtype) -> torch.Tensor:
    q, d, s = quantize_q8k(native, x)
    out = torch.empty(x.shape[0], n)
    native.kquant_mm_packed_into(q, d, s, pack, n, int(qtype), 0, out, 0)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_packed_form_gives_the_stored_layouts_bits(native, qtype):
    """The packed kernel (lane per output, every row count in passes of up to 8) against the stored
    layout's (tiles with lane sums below 16 rows, the decoded-tile path from 16): equal bits for each
    row count, a last tile of 1-15 outputs, K of 1-35 super-blocks, prefetch distances, bfloat16 out."""
    gen = torch.Generator().manual_seed(11)
    for n, k in [(1, 256), (5, 512), (16, 768), (37, 1792), (53, 1536), (48, 8960)]:
        raw = blocks(qtype, n, k, seed=n + k)
        pack = packed(native, raw, qtype)
        size = FORMATS[int(qtype)].block_bytes
        assert pack.numel() == 64 + (n + 15) // 16 * 16 * k // 256 * (148 if qtype == T.Q4_K else 212)
        x = torch.randn(40, k, generator=gen) * 4
        x[3, :256] = 0
        for m in [*range(1, 12), 15, 16, 17, 25, 40]:
            assert torch.equal(packed_mm(native, x[:m], pack, n, qtype), kquant_mm(native, x[:m], raw, int(qtype))), \
                (n, k, m)
        q, d, s = quantize_q8k(native, x[:9])
        want = torch.empty(9, n + 3, dtype=torch.bfloat16)
        native.kquant_mm_into(q, d, s, raw, int(qtype), 0, want, 3)
        got = torch.empty(9, n + 3, dtype=torch.bfloat16)
        native.kquant_mm_packed_into(q, d, s, pack, n, int(qtype), 1024, got, 3)
        assert torch.equal(got[:, 3:].view(torch.int16), want[:, 3:].view(torch.int16)), (n, k)
        if k >= 768:  # a rank's columns (whole super-blocks): the strided view packs as its copy does
            view = raw[:, size:3 * size]
            assert torch.equal(native.kquant_pack(view, int(qtype)), native.kquant_pack(view.contiguous(), int(qtype)))
    raw = blocks(qtype, 20, 512, seed=1)
    pack = packed(native, raw, qtype)
    q, d, s = quantize_q8k(native, torch.randn(2, 512))
    with pytest.raises(RuntimeError, match="packed blocks must be contiguous uint8 of"):
        native.kquant_mm_packed_into(q, d, s, pack, 40, int(qtype), 0, torch.empty(2, 40), 0)
    with pytest.raises(RuntimeError, match="N = 20, 2 super-blocks a row .magic ok., not type .*, N = 21"):
        native.kquant_mm_packed_into(q, d, s, pack, 21, int(qtype), 0, torch.empty(2, 32), 0)
    with pytest.raises(RuntimeError, match="magic wrong"):
        native.kquant_mm_packed_into(q, d, s, torch.zeros_like(pack), 20, int(qtype), 0, torch.empty(2, 32), 0)
    with pytest.raises(RuntimeError, match="64-byte boundary"):
        native.kquant_mm_packed_into(q, d, s, torch.cat([pack[:1], pack])[1:], 20, int(qtype), 0, torch.empty(2, 20), 0)
    with pytest.raises(RuntimeError, match="packed_n must be empty"):
        native.kquant_linear([pack], [int(qtype)], torch.empty(0), [0], [20, 4], torch.randn(1, 512))
    with pytest.raises(RuntimeError, match="K-quant type must be"):
        native.kquant_pack(raw, int(T.Q5_K))


def cpu_kquant_layer(weight: KQuantBlocks) -> torch.nn.Module:
    from text_generation_server.kernels.cpu_kquant import CpuKQuantKernel

    spec = weight.spec(torch.float32, "cpu")
    assert CpuKQuantKernel.can_implement(spec) == (True, "")
    return CpuKQuantKernel.build(weight, None, torch.float32)


def test_other_formats_and_devices_are_refused_by_reason(native):
    from text_generation_server.kernels.cpu_kquant import CpuKQuantKernel

    spec = KQuantBlocks((blocks(T.Q4_K, 4, 256),), int(T.Q4_K)).spec(torch.bfloat16, "cuda")
    assert CpuKQuantKernel.can_implement(spec) == (False, "device cuda")
    with pytest.raises(ValueError, match="not a K-quant"):
        KQuantBlocks((blocks(T.Q4_K, 4, 256),), int(T.Q5_K))
    with pytest.raises(ValueError, match="one width"):
        KQuantBlocks((blocks(T.Q6_K, 4, 256), blocks(T.Q6_K, 4, 512)), int(T.Q6_K))


AVX2_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from gguf_writer import T
from test_gguf_kquant import blocks, mixed_layer
from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.cpu_kquant import kquant_mm
module = cpu_native.native()
x = torch.randn(20, 768, generator=torch.Generator().manual_seed(4))
out = {t.name: kquant_mm(module, x, blocks(t, 37, 768, seed=5), int(t)).tolist() for t in (T.Q4_K, T.Q6_K)}
out["cflags"] = list(cpu_native.cflags())
torch.set_num_threads(2)  # the stored blocks' kernel on the pool's threads
out["mixed"] = mixed_layer()(x).tolist()
print(json.dumps(out))
"""


def mixed_layer() -> torch.nn.Module:
    """A float32 layer of Q4_K parts and a Q6_K part (a Q4_K_M qkv), built as the loader builds it."""
    from text_generation_server.kernels.cpu_kquant import CpuKQuantKernel
    from text_generation_server.quantizers.gguf import join_parts

    bias = torch.randn(37 + 21 + 16, generator=torch.Generator().manual_seed(8))
    return join_parts([CpuKQuantKernel.build(KQuantBlocks((blocks(T.Q4_K, 37, 768, seed=6), blocks(T.Q4_K, 21, 768, seed=7)),
                                                          int(T.Q4_K)), bias[:58], torch.float32),
                       CpuKQuantKernel.build(KQuantBlocks((blocks(T.Q6_K, 16, 768, seed=9),), int(T.Q6_K)), bias[58:],
                                             torch.float32)])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the AVX2 build is x86-64's")
def test_the_avx2_build_gives_the_same_bits(native):
    """Built without AVX-512 (TGS_CPU_ISA=avx2) the kernel runs its AVX2 code (an output at a time,
    each block's integer sums reduced across lanes); this build runs the AVX-512 code (tiles of 16
    outputs, and from 16 rows the decoded-tile path). Both form the same exact integer sums and take
    the same float steps in the same order, so they give the same bits, within the Q8_K bound."""
    env = {**os.environ, cpu_native.ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", AVX2_CHILD], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "-mno-avx512f" in got["cflags"]
    x = torch.randn(20, 768, generator=torch.Generator().manual_seed(4))
    for t in (T.Q4_K, T.Q6_K):
        raw = blocks(t, 37, 768, seed=5)
        ref, scale = int_reference(t, raw, x)
        ours = kquant_mm(native, x, raw, int(t))
        assert torch.equal(torch.tensor(got[t.name], dtype=torch.float32), ours), t.name
        if native.kquant_packed_isa():  # and the packed form's kernel, which the layers run here
            assert torch.equal(torch.tensor(got[t.name], dtype=torch.float32),
                               packed_mm(native, x, native.kquant_pack(raw, int(t)), 37, t)), t.name
        assert ((ours.double() - ref).abs() <= 2 * (768 // 256 + 16) * 2.0**-24 * scale).all(), t.name
    with torch.inference_mode():  # a mixed-type layer: here packed, one call; there the blocks as stored, a call per part
        assert torch.equal(torch.tensor(got["mixed"], dtype=torch.float32), mixed_layer()(x))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_half_precision_activations_are_read_as_they_are(native, qtype):
    """bfloat16 / float16 rows are quantized from their exact float32 values (no conversion pass),
    and a bfloat16 layer's output is the float32 product rounded as torch rounds it."""
    raw = blocks(qtype, 40, 512, seed=6)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    for dtype in (torch.bfloat16, torch.float16):
        got, want = quantize_q8k(native, x.to(dtype)), quantize_q8k(native, x.to(dtype).float())
        assert all(torch.equal(g, w) for g, w in zip(got, want)), dtype
    from text_generation_server.kernels.cpu_kquant import CpuKQuantKernel

    layer = CpuKQuantKernel.build(KQuantBlocks((raw[:24], raw[24:]), int(qtype)), None, torch.bfloat16)
    xb = x.bfloat16()
    assert torch.equal(layer(xb).view(torch.int16), kquant_mm(native, xb.float(), raw, int(qtype)).bfloat16().view(torch.int16))


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    """Q4_K_M's mix on the tiny qwen2: Q4_K linears, attn_v in Q6_K."""
    return write_gguf(tmp_path_factory.mktemp("kquant") / "model.gguf", "qwen2", T.Q4_K, seed=7, v_type=T.Q6_K)


def test_a_gguf_runs_its_k_quant_blocks_in_place(native, q4km, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "")
    lm = get_model(str(q4km), dtype="bfloat16")
    names = kernel_names(lm)
    quantized = {k: v for k, v in names.items() if v != "dense"}
    assert quantized and set(quantized.values()) == {"cpu-kquant"}, names
    # views of the file's map (the reader the loader shares per process), not copies; or, where the
    # build has the packed form's kernel, each layer's packed copy of them and no stored blocks
    mapped = open_gguf([q4km]).readers[0].data
    lo, hi = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    kind = "packed" if native.kquant_packed_isa() else "blocks"
    buffers = [(n, b) for m in lm.model.modules() for n, b in m.named_buffers(recurse=False)
               if n.startswith(("blocks", "packed"))]
    # per layer: q and k (one Q4_K layer, two parts), v (Q6_K), o, gate and up (two parts), down
    assert len(buffers) == 2 * 7 and all(n.startswith(kind) for n, _ in buffers), [n for n, _ in buffers]
    # q, k (Q4_K) and v (Q6_K), loaded as two layers by type, run as one (one call, one output)
    from text_generation_server.kernels.cpu_kquant import KQuantLinear

    for layer in lm.model.layers:
        qkv = layer.self_attn.qkv.linear
        assert isinstance(qkv, KQuantLinear) and qkv.types == [int(T.Q4_K), int(T.Q4_K), int(T.Q6_K)], qkv
        assert qkv.kernel_name == "cpu-kquant" and "Q6_K" in qkv.computes and "Q4_K" in qkv.computes, qkv.computes
    for _, b in buffers:
        inside = lo <= b.data_ptr() and b.data_ptr() + b.numel() <= hi
        assert inside == (kind == "blocks"), \
            "a copy, not a view of the file" if inside else "the file's bytes, not packed"
    greedy_fast = greedy(lm, 8)
    # switched off: the canonical form's kernels, and the reference tokens are the reference's
    monkeypatch.setenv(DISABLE_ENV, fast_kernels())
    ref = get_model(str(q4km), dtype="float32")
    assert kernels_used(ref) <= {"reference", "dense"}
    monkeypatch.setenv(DISABLE_ENV, "cpu-kquant")
    canonical = get_model(str(q4km), dtype="bfloat16")
    assert "cpu-kquant" not in kernels_used(canonical) and "reference" not in kernels_used(canonical)
    lp_ref, lp_fast = prompt_logprobs(ref), prompt_logprobs(lm)
    assert torch.isfinite(lp_fast).all()
    assert (lp_fast - lp_ref).abs().mean() < 0.03 * lp_ref.abs().mean(), (lp_fast, lp_ref)
    assert greedy_fast and all(len(tokens) == 8 for tokens in greedy_fast), greedy_fast


def test_row_split_off_a_super_block_keeps_the_decoded_form(native, q4km, monkeypatch):
    """ffn_down's K = 768: two ranks get 384 (inside a super-block: decoded, cut on a 32-column
    sub-block), three get 256 (whole super-blocks: the rank's blocks stay a strided view)."""
    from text_generation_server.quantizers.dist import ProcessGroup
    from text_generation_server.quantizers.factory import get_loader, read_quantization_config, tensor_source
    from text_generation_server.quantizers.gguf import GGUFBlocksWeight, GGUFWeight
    from text_generation_server.quantizers.weights import Weights

    monkeypatch.setenv(DISABLE_ENV, "")
    loader = get_loader(read_quantization_config(q4km, None))
    source = tensor_source(q4km)
    whole = Weights(source, torch.device("cpu"), torch.float32, ProcessGroup(rank=0, size=1), loader=loader)
    full = whole.get_weights_row("model.layers.0.mlp.down_proj")
    assert isinstance(full, GGUFBlocksWeight)
    dense = full.plain
    values = (dense.qweight.float() - dense.zero_points().float()[dense.g_idx.long()]) * \
        dense.scales.float()[dense.g_idx.long()]  # [K, N]
    for world, kind in ((2, GGUFWeight), (3, GGUFBlocksWeight)):
        for rank in range(world):
            w = Weights(source, torch.device("cpu"), torch.float32, ProcessGroup(rank=rank, size=world), loader=loader)
            part = w.get_weights_row("model.layers.0.mlp.down_proj")
            assert isinstance(part, kind), (world, type(part))
            share = 768 // world
            plain = part.plain if isinstance(part, GGUFBlocksWeight) else part
            got = (plain.qweight.float() - plain.zero_points().float()[plain.g_idx.long()]) * \
                plain.scales.float()[plain.g_idx.long()]
            assert torch.equal(got, values[rank * share:(rank + 1) * share]), (world, rank)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_an_embedding_decodes_the_rows_it_looks_up_as_the_full_decode_does(native, qtype):
    from text_generation_server.kernels.cpu_kquant import KQuantEmbedding

    raw = blocks(qtype, 50, 768, seed=8)
    full = kquant_dequant(native, raw, int(qtype))  # float32, the dense read's values before its cast
    ids = torch.tensor([[3, 49, 0], [3, 17, 8]])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = KQuantEmbedding(raw, int(qtype), dtype)(ids)
        assert got.dtype == dtype and got.shape == (2, 3, 768)
        assert torch.equal(got, torch.nn.functional.embedding(ids, full.to(dtype))), dtype
    # strided rows (a view that skips each row's first block)
    table = KQuantEmbedding(raw[:, FORMATS[int(qtype)].block_bytes:], int(qtype), torch.float32)
    assert table.embedding_dim == 512
    assert torch.equal(table(ids[0]), full[ids[0]][:, 256:])
    with pytest.raises(IndexError, match="50 rows"):
        table(torch.tensor([50]))
    with pytest.raises(ValueError, match="not a K-quant"):
        KQuantEmbedding(raw, int(T.Q5_K), torch.float32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_k_quant_token_embedding_stays_as_stored_in_a_served_model(native, qtype, tmp_path, monkeypatch):
    """serve/get_model of a GGUF whose token_embd is Q4_K or Q6_K: the embedding module keeps the file's
    blocks (no dense table) and the model gives the tokens and logprobs of the table dequantized whole."""
    from text_generation_server.kernels.cpu_kquant import KQuantEmbedding
    from text_generation_server.layers.tensor_parallel import TensorParallelEmbedding
    from text_generation_server.quantizers.gguf import GGUFConfig

    monkeypatch.setenv(DISABLE_ENV, "")
    path = write_gguf(tmp_path / "model.gguf", "qwen2", T.Q4_K, seed=3, tied=False, embedding_type=qtype)
    lm = get_model(str(path), dtype="bfloat16")
    embeddings = [m for m in lm.model.modules() if isinstance(m, TensorParallelEmbedding)]
    assert len(embeddings) == 1 and isinstance(embeddings[0].stored, KQuantEmbedding) and embeddings[0].weight is None
    mapped = open_gguf([path]).readers[0].data
    ptr = embeddings[0].stored.blocks.data_ptr()
    assert mapped.ctypes.data <= ptr < mapped.ctypes.data + mapped.nbytes, "a copy, not a view of the file"
    monkeypatch.setattr(GGUFConfig, "quantized_embedding", lambda self, weights, prefix: None)
    dense = get_model(str(path), dtype="bfloat16")
    assert [m for m in dense.model.modules() if isinstance(m, TensorParallelEmbedding)][0].stored is None
    assert greedy(lm, 8) == greedy(dense, 8)
    assert torch.equal(prompt_logprobs(lm), prompt_logprobs(dense))


def _mapping_rss_kib(address: int) -> int:
    """Rss of the mapping holding `address`, from /proc/self/smaps."""
    current = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= address < hi
            elif current and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_packing_lets_go_of_the_file_pages_only(tmp_path):
    """release_file_pages drops a read-only file mapping's pages (they read back from the file, the
    same bytes) and never touches anonymous memory, where DONTNEED would zero it."""
    import warnings

    import numpy as np

    from text_generation_server.kernels.cpu_kquant import release_file_pages

    data = np.random.default_rng(0).integers(0, 255, 4 * 2**20, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    data.tofile(path)
    with warnings.catch_warnings():  # read-only memory, as a GGUF file is mapped: never written here
        warnings.simplefilter("ignore", UserWarning)
        mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r"))
    assert int(mapped.sum()) == int(data.sum())  # every page touched
    before = _mapping_rss_kib(mapped.data_ptr())
    assert before >= 4 * 1024 - 8
    owned = torch.from_numpy(data.copy())
    assert release_file_pages([owned]) == 0
    assert torch.equal(owned, torch.from_numpy(data))
    dropped = release_file_pages([mapped])
    assert dropped >= 4 * 2**20 - 2 * 4096
    assert _mapping_rss_kib(mapped.data_ptr()) <= 8
    assert torch.equal(mapped, torch.from_numpy(data))  # faulted back in from the file


def test_the_pack_arena_cuts_aligned_buffers_from_huge_page_chunks():
    """PackArena: 64-byte aligned views, one after another in a chunk that starts on a 2 MiB boundary
    (what a huge page needs), a new chunk when one is full, a buffer larger than a chunk in its own;
    no two buffers overlap."""
    from text_generation_server.kernels.cpu_kquant import HUGE_PAGE, PackArena

    arena = PackArena(chunk=4 << 20)
    sizes = [100, 64, 1 << 20, 3 << 20, 5 << 20, 1]
    got = [arena.take(n) for n in sizes]
    for n, buf in zip(sizes, got):
        assert buf.dtype == torch.uint8 and buf.is_contiguous() and buf.numel() == n
        assert buf.data_ptr() % 64 == 0
    assert got[0].data_ptr() % HUGE_PAGE == 0  # a chunk's first buffer
    assert got[1].data_ptr() == got[0].data_ptr() + 128 and got[2].data_ptr() == got[1].data_ptr() + 64
    assert got[3].data_ptr() % HUGE_PAGE == 0  # did not fit the first chunk's rest
    assert got[4].data_ptr() % HUGE_PAGE == 0 and got[4].untyped_storage().nbytes() >= 5 << 20
    for i, buf in enumerate(got):
        buf.fill_(i + 1)
    assert all(bool((buf == i + 1).all()) for i, buf in enumerate(got))
    with pytest.raises(ValueError, match="-1 bytes"):
        arena.take(-1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_layers_packed_into_the_arena_give_the_same_bits(native, qtype, monkeypatch):
    """A layer's packed parts go into the arena (TGS_CPU_KQUANT_HUGEPAGES=off: torch's allocator): the
    bytes kquant_pack writes, and the layer's outputs the same bits either way; kquant_pack_into
    refuses a buffer of the wrong size or alignment by name."""
    from text_generation_server.kernels.cpu_kquant import HUGEPAGES_ENV, KQuantLinear, PackArena, pack

    raw = blocks(qtype, 53, 1536, seed=5)
    pack_ref = packed(native, raw, qtype)
    arena = PackArena(chunk=1 << 20)
    into = pack(native, raw, qtype, arena)
    assert torch.equal(into, pack_ref) and into.untyped_storage().nbytes() > into.numel()
    assert torch.equal(pack(native, raw, qtype, None), pack_ref)
    x = torch.randn(9, 1536).bfloat16()
    bias = torch.randn(53).bfloat16()
    monkeypatch.setenv(HUGEPAGES_ENV, "1")
    on = KQuantLinear((raw[:21], raw[21:]), int(qtype), bias, torch.bfloat16)
    monkeypatch.setenv(HUGEPAGES_ENV, "off")
    off = KQuantLinear((raw[:21], raw[21:]), int(qtype), bias, torch.bfloat16)
    assert on.packed0.untyped_storage().nbytes() > on.packed0.numel()  # a view of an arena chunk
    assert off.packed0.untyped_storage().nbytes() == off.packed0.numel()
    for m in (1, 3, 9):
        assert torch.equal(on(x[:m]).view(torch.int16), off(x[:m]).view(torch.int16)), m
    size = native.kquant_packed_bytes(int(qtype), 53, 1536)
    assert size == pack_ref.numel()
    with pytest.raises(RuntimeError, match="contiguous uint8 of"):
        native.kquant_pack_into(raw, int(qtype), torch.empty(size - 64, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="64-byte boundary"):
        native.kquant_pack_into(raw, int(qtype), torch.empty(size + 64, dtype=torch.uint8)[1:size + 1])
    with pytest.raises(RuntimeError, match="K a positive multiple of 256"):
        native.kquant_packed_bytes(int(qtype), 53, 1000)
