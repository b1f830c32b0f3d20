"""A CPU decode step's glue in fewer calls (helper G, session 10): the layers' plan
(layers/cpu_decode_step.py) against the eager layers, the greedy argmax (kernels/cpu_pointwise.py
`argmax`) against torch's, the rotary's blocks of positions against one-row calls, and the vectorised
bfloat16 rounding of `silu_mul_bf16` against its one-value tail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from text_generation_server.kernels import cpu_native, cpu_pointwise
from text_generation_server.layers import cpu_decode_step
from text_generation_server.layers.rotary import RopeConfig, RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_native.native() is None,
                                reason=f"native CPU kernels not built here: {cpu_native.unavailable_reason()}")


def embedded(dtype: str):
    from text_generation_server import about
    from text_generation_server.models.loader import get_model

    return get_model(str(Path(about.__file__).parent / "assets" / about.EMBEDDED_MODEL_ID), dtype=dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_plan_decodes_every_layer_with_the_eager_bits(monkeypatch, dtype):
    """After warmup (whose probe runs a shorter layer list for a while), every decode step of the
    embedded model runs through the plan over all its layers, and tokens, logprobs and the KV cache
    equal the eager layers' (TGS_CPU_DECODE_STEP=0), with three requests of different lengths."""
    from helpers import decode_three_requests, ids_request, random_ids

    lm = embedded(dtype)
    lm.warmup([ids_request(0, random_ids(20, 1, 1000), 2)], 64, 64, 64, 0.5, max_batch_total_tokens=256,
              max_batch_size=4)
    ran: list[bool] = []
    real_run = cpu_decode_step.CpuDecodeStep.run

    def counting(self, hidden, ctx):
        out = real_run(self, hidden, ctx)
        ran.append(out is not None and len(self.layers) == len(lm.model.layers))
        return out

    monkeypatch.setattr(cpu_decode_step.CpuDecodeStep, "run", counting)

    got, got_cache = decode_three_requests(lm)
    assert len(ran) == 11 and all(ran)  # 11 decode steps, each over the 4 layers
    monkeypatch.setenv(cpu_decode_step.ENV, "0")
    ran.clear()
    want, want_cache = decode_three_requests(lm)
    assert ran and not any(ran)  # switched off: every step ran the layers one by one
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))


def test_the_plan_steps_aside(monkeypatch):
    """The native pointwise switch, a prefill, or a forward hook on a layer: the eager layers run."""
    from helpers import ids_request, random_ids

    lm = embedded("bfloat16")
    lm.allocate_kv_cache(16)
    results: list[bool] = []
    real_run = cpu_decode_step.CpuDecodeStep.run
    monkeypatch.setattr(cpu_decode_step.CpuDecodeStep, "run",
                        lambda self, hidden, ctx: results.append(real_run(self, hidden, ctx) is not None))

    def decode_once():
        batch = lm.make_batch(0, [ids_request(0, random_ids(12, 3, 1000), 3)])
        _, batch, _ = lm.generate_token(batch)  # the prefill: the plan is not asked
        assert not results
        _, batch, _ = lm.generate_token(batch)
        lm.release(batch)

    monkeypatch.setenv(cpu_pointwise.ENV, "0")
    decode_once()
    assert results == [False]
    monkeypatch.delenv(cpu_pointwise.ENV)
    results.clear()
    handle = lm.model.layers[1].register_forward_hook(lambda *args: None)
    try:
        decode_once()
    finally:
        handle.remove()
    assert results == []  # a hooked layer: the model does not ask the plan
    seen = []
    handle = lm.model.layers[2].mlp.register_forward_pre_hook(lambda module, args: seen.append(1))
    try:
        decode_once()
    finally:
        handle.remove()
    assert results == [False] and seen  # a hooked MLP: the eager layers, and the hook saw its call
    results.clear()
    decode_once()
    assert results == [True]


def test_argmax_is_torchs_index():
    """First maximal index, -0 equal to +0, the first NaN where there is one; rows with a stride."""
    gen = torch.Generator().manual_seed(5)
    for case in range(8):
        for n in (1, 15, 16, 17, 4096, 151936):
            x = torch.randn(3, n, generator=gen) * 3
            if case == 1:
                x = x.round()  # ties
            elif case == 2:
                x[:, torch.randint(0, n, (2,), generator=gen)] = float("nan")
            elif case == 3:
                x.fill_(-float("inf"))
            elif case == 4:
                x[:, torch.randint(0, n, (2,), generator=gen)] = float("inf")
            elif case == 5:
                x = torch.zeros(3, n)
                x[:, torch.randint(0, n, (n // 2 + 1,), generator=gen)] = -0.0
            elif case == 6:
                x[1:, -1] = 1e30  # the maximum in the last (tail) element
            wide = torch.randn(3, n + 7, generator=gen)
            wide[:, 3:3 + n] = x
            for scores in (x, wide[:, 3:3 + n]):
                got = cpu_pointwise.argmax(scores)
                assert got is not None and torch.equal(got, scores.argmax(dim=-1)), (case, n)
    assert cpu_pointwise.argmax(torch.zeros(2, 5, dtype=torch.bfloat16)) is None
    assert cpu_pointwise.argmax(torch.zeros(2, 5)[:, ::2]) is None
    with pytest.raises(RuntimeError, match="x must be float32"):
        cpu_native.native().argmax_f32(torch.zeros(2, 5, dtype=torch.float64))


def test_greedy_choice_is_unchanged(monkeypatch):
    from text_generation_server.generation.sampling import greedy_choice

    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    logits[2, 7] = logits[2, 9] = 50.0  # a tie: the first index
    got = greedy_choice(logits)
    monkeypatch.setenv(cpu_pointwise.ENV, "0")
    want = greedy_choice(logits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and int(got[0][2]) == 7


@pytest.mark.parametrize("dim", [32, 64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_blocks_are_one_row_bits(dim, dtype):
    rot = RotaryEmbedding(RopeConfig(head_dim=dim, theta=1e6), 300, torch.device("cpu"))
    for p in [0, 1, 63, 64, 65, 200, 255, 256, 299]:
        cos, sin = rot.decode_cos_sin(p, dtype)
        want_cos, want_sin = rot.cos_sin(torch.tensor([p]), dtype, p)
        assert cos.shape == want_cos.shape == (1, 1, dim)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rot.decode_cos_sin(300, dtype) is None  # past the positions: cos_sin's own error applies


def test_rotary_blocks_turn_off_when_they_differ(monkeypatch):
    rot = RotaryEmbedding(RopeConfig(head_dim=32, theta=1e4), 300, torch.device("cpu"))
    real = RotaryEmbedding.cos_sin

    def drifting(self, positions, dtype, max_position=None, seq_lens=None):
        cos, sin = real(self, positions, dtype, max_position, seq_lens)
        return (cos * 1.5, sin) if positions.shape[0] > 1 else (cos, sin)

    monkeypatch.setattr(RotaryEmbedding, "cos_sin", drifting)
    assert rot.decode_cos_sin(5, torch.float32) is None
    assert rot._decode_blocks is None
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", real)
    assert rot.decode_cos_sin(5, torch.float32) is None  # off for good


def test_rotary_blocks_skip_length_dependent_rope():
    cfg = RopeConfig(head_dim=32, theta=1e4, rope_type="dynamic", factor=2.0, max_position_embeddings=64)
    rot = RotaryEmbedding(cfg, 256, torch.device("cpu"))
    assert rot.length_dependent and rot.decode_cos_sin(10, torch.float32) is None


def test_silu_mul_vector_rounding_is_the_tails():
    """Lanes 16 at a time (the vectorised rounding) give each value's bits as the one-value tail does,
    NaN, infinities, zeros and tiny values included."""
    native = cpu_native.native()
    gen = torch.Generator().manual_seed(9)
    n = 160
    gate_up = (torch.randn(3, 2 * n, generator=gen) * 6).to(torch.bfloat16)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-39, -1e-38, 88.5, -90.0, 3e38])
    gate_up[0, : len(specials)] = specials.to(torch.bfloat16)
    gate_up[1, n: n + len(specials)] = specials.to(torch.bfloat16)
    got = native.silu_mul_bf16(gate_up, n)
    for r in range(3):
        for i in range(n):
            one = native.silu_mul_bf16(gate_up[r:r + 1, [i, n + i]].contiguous(), 1)  # the scalar tail
            assert torch.equal(got[r:r + 1, i:i + 1].view(torch.int16), one.view(torch.int16)), (r, i)
