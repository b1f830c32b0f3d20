"""The group-scale int8 CPU kernel (kernels/cpu_group_int8.py) against the reference dequantization.

5- to 8-bit codes with 16- or 32-wide groups, symmetric or with zero points, in float32 and
bfloat16; a prompt's rows come out bit for bit the same whole or in chunks (kernels/phase.py);
the table picks it for ggml's groups only.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_weight

from text_generation_server.kernels.base import dequantize
from text_generation_server.kernels.cpu_group_int8 import BLOCK_BYTES, CpuGroupInt8Kernel
from text_generation_server.kernels.phase import forward_phase
from text_generation_server.kernels.select import build_linear, choose_kernel

torch.set_num_threads(1)

CASES = [(8, 32, True), (6, 16, True), (5, 32, True), (5, 32, False), (8, 16, False)]


@pytest.mark.parametrize("bits,group,sym", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_the_reference(bits, group, sym, dtype):
    w = make_weight(512, 96, bits, group, sym, False, seed=bits + group)
    bias = torch.randn(96)
    layer = CpuGroupInt8Kernel.build(w, bias, dtype)
    x = torch.randn(5, 512)
    want = x @ dequantize(w).t() + bias
    got = layer(x.to(dtype)).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_many_row_blocks_cover_every_output(monkeypatch):
    """N larger than one dequantized block: every block's rows land in their own columns."""
    w = make_weight(256, 4096, 8, 32, False, False, seed=3)
    layer = CpuGroupInt8Kernel.build(w, None, torch.float32)
    assert layer.block < 4096 and BLOCK_BYTES // (256 * 4) == layer.block
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ dequantize(w).t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_prompt_gives_the_same_bits_whole_or_in_chunks(dtype):
    layer = CpuGroupInt8Kernel.build(make_weight(512, 320, 6, 16, True, False, seed=1), None, dtype)
    x = torch.randn(45, 512).to(dtype)
    with forward_phase(prefill=True):
        whole = layer(x)
        for cuts in ((40,), (1, 40), (8, 16, 30)):
            bounds = [0, *cuts, 45]
            assert torch.equal(torch.cat([layer(x[a:b]) for a, b in zip(bounds, bounds[1:])]), whole), cuts


def test_the_table_takes_it_for_ggml_groups_only():
    for bits, group in ((8, 32), (6, 16), (5, 32)):
        assert build_linear(make_weight(256, 64, bits, group, True, False), None, torch.float32,
                            "cpu").kernel_name == "cpu-int8-group"
    spec = make_weight(256, 64, 8, 128, True, False).spec(torch.float32, "cpu")
    kernel, why = choose_kernel(spec)
    assert kernel.name == "reference"
    assert ("cpu-int8-group", "group size 128 not in (16, 32) (ggml's block groups)") in why
    ok, reason = CpuGroupInt8Kernel.can_implement(make_weight(256, 64, 8, 32, True, True).spec(torch.float32, "cpu"))
    assert not ok and "act-order" in reason
