"""A decode step's linears called through their resolved one-row calls (issue #32, session 13): each kernel
module's `decode_call` gives forward's bits at decode row counts, its `decode_stamp` moves when what the call
was resolved from does, and the decode plan (layers/cpu_decode_step.py) uses the calls only where the module
path would make nothing but that call (hooks, an instance-level forward, LoRA, the switch)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_weight

from text_generation_server.kernels import cpu, cpu_act_int8, cpu_native
from text_generation_server.kernels.dense import DenseLinear
from text_generation_server.kernels.phase import forward_phase
from text_generation_server.layers import cpu_decode_step

pytestmark = pytest.mark.skipif(cpu_native.native() is None,
                                reason=f"native CPU kernels not built here: {cpu_native.unavailable_reason()}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16
                                                                     else a, b.view(torch.int16)
                                                                     if b.dtype == torch.bfloat16 else b)


def layers(monkeypatch) -> list[tuple[str, torch.nn.Module, torch.dtype]]:
    """One of each kernel module the plan binds: int4 with int8 activations (tiled and torch's layout, with
    and without a bias), int8 (plain and table layouts, zero points and a bias), dense bfloat16 and float32."""
    out = []
    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    w4 = make_weight(256, 192, 4, 64, False, False, seed=11)
    for tiled in ("on", "off"):
        monkeypatch.setenv(cpu_act_int8.TILED_ENV, tiled)
        for bias in (None, torch.randn(192)):
            out.append((f"int4-q8 tiled={tiled} bias={bias is not None}",
                        cpu.CpuInt4PackQ8Kernel.build(w4, bias, torch.bfloat16), torch.bfloat16))
    monkeypatch.delenv(cpu_act_int8.TILED_ENV)
    monkeypatch.setenv(cpu_act_int8.ENV, "off")
    w8 = make_weight(256, 192, 8, 256, False, False, seed=12)
    out.append(("int8 plain", cpu.CpuInt8Kernel.build(w8, torch.randn(192), torch.bfloat16), torch.bfloat16))
    table = cpu.CpuInt8Kernel.build(make_weight(256, 192, 8, 256, True, False, seed=13), None, torch.bfloat16)
    assert table.keep_rows_invariant()
    out.append(("int8 row-invariant", table, torch.bfloat16))
    for dtype in (torch.bfloat16, torch.float32):
        for bias in (None, torch.randn(192)):
            dense = DenseLinear(torch.randn(192, 256).to(dtype), None if bias is None else bias.to(dtype))
            out.append((f"dense {dtype} bias={bias is not None}", dense, dtype))
    return out


def test_a_resolved_call_has_forwards_bits(monkeypatch):
    x = torch.randn(8, 256)
    built = layers(monkeypatch)
    with torch.inference_mode():
        for name, layer, dtype in built:
            xd = x.to(dtype)
            resolved = 0
            for phase in (None, False):
                for rows in (1, 2, 3, 5, 8):
                    call = layer.decode_call(rows, dtype)
                    if call is None:
                        continue
                    resolved += 1
                    if phase is None:
                        want = layer(xd[:rows])
                    else:
                        with forward_phase(prefill=False):
                            want = layer(xd[:rows])
                    assert same_bits(call(xd[:rows].contiguous()), want), (name, rows, phase)
            assert resolved, name  # every one of these resolves its one-row call
            other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
            if not name.startswith("dense"):
                assert layer.decode_call(1, other) is None, name  # the int layers take bfloat16 rows only


def test_the_stamp_moves_with_what_the_call_binds(monkeypatch):
    for name, layer, dtype in layers(monkeypatch):
        stamp = layer.decode_stamp(1)
        assert layer.decode_stamp(1) == stamp
        layer.measured[1] = "a stale name"
        assert layer.decode_stamp(1) != stamp, name
        assert layer.decode_stamp(16) == layer.decode_stamp(9)  # one bucket
        del layer.measured[1]
        assert layer.decode_stamp(1) == stamp
        if name.startswith("dense"):
            layer.to(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)  # the parameter's data swapped
            assert layer.decode_stamp(1) != stamp, name


def test_a_dense_layer_waiting_for_its_extension_resolves_nothing():
    layer = DenseLinear(torch.randn(64, 32), None)
    layer._pending = True  # a float32 model that has not decoded yet (dense.native_for)
    assert layer.decode_call(1, torch.float32) is None


def captured_plans(monkeypatch) -> list:
    """The decode plans (layers/cpu_decode_step.py) that run steps from now on, in order."""
    plans: list[cpu_decode_step.CpuDecodeStep] = []
    real_run = cpu_decode_step.CpuDecodeStep.run

    def keeping(self, hidden, ctx):
        plans.append(self)
        return real_run(self, hidden, ctx)

    monkeypatch.setattr(cpu_decode_step.CpuDecodeStep, "run", keeping)
    return plans


def embedded():
    from pathlib import Path

    from text_generation_server import about
    from text_generation_server.models.loader import get_model

    return get_model(str(Path(about.__file__).parent / "assets" / about.EMBEDDED_MODEL_ID), dtype="bfloat16")


def test_the_plan_binds_its_linears_and_steps_aside_for_hooks(monkeypatch):
    """Every linear of the embedded model is bound in a decode step (its module's forward is not called), the
    tokens and cache equal the module calls' (TGS_CPU_DECODE_BIND=0), and a hook on one linear's wrapper or
    kernel module, or a forward replaced on the instance, sends that linear (only) through its modules."""
    from helpers import decode_three_requests

    lm = embedded()
    lm.allocate_kv_cache(48)
    wrappers = [m for layer in lm.model.layers for m in (layer.self_attn.qkv, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up, layer.mlp.down)]
    seen: list[int] = []
    handles = [w.linear.register_forward_pre_hook(lambda module, args, i=i: seen.append(i))
               for i, w in enumerate(wrappers)]
    plans = captured_plans(monkeypatch)
    try:
        want, want_cache = [], []
        monkeypatch.setenv(cpu_decode_step.BIND_ENV, "0")
        want, want_cache = decode_three_requests(lm)
        assert plans and seen  # the switch off: the modules, with their hooks
        monkeypatch.delenv(cpu_decode_step.BIND_ENV)
        # hooked kernel modules: every linear through its modules, the same tokens
        seen.clear()
        got, got_cache = decode_three_requests(lm)
        assert set(seen) == set(range(len(wrappers)))
        assert got == want and all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))
    finally:
        for handle in handles:
            handle.remove()
    # no hooks: the bound calls, the same tokens; no linear's forward runs in a decode step
    calls = []
    for kind in {type(w.linear) for w in wrappers}:
        real = kind.forward
        monkeypatch.setattr(kind, "forward", lambda self, x, real=real: calls.append(1) or real(self, x))
    got, got_cache = decode_three_requests(lm)
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))
    steps = 11
    assert len(calls) == len(wrappers)  # the three prompts' one prefill, none of the 11 decode steps
    plan = plans[-1]
    rows_seen = {key[0] for key in plan._bound}
    assert rows_seen and all(entry is not None and entry[3] is not entry[0] for key in plan._bound
                             for entry in plan._bound[key])
    # one wrapper hooked, one with its forward replaced on the instance: those two through their modules
    hooked, replaced = wrappers[1], wrappers[6]
    seen.clear()
    handle = hooked.register_forward_hook(lambda module, args, out: seen.append(1))
    replaced.forward = lambda x, module=replaced: (seen.append(2), type(module).forward(module, x))[1]
    try:
        calls.clear()
        got, got_cache = decode_three_requests(lm)
    finally:
        handle.remove()
        del replaced.forward
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))
    assert seen.count(1) >= steps and seen.count(2) >= steps
    assert len(calls) == len(wrappers) + 2 * steps  # the hooked and the replaced linears' decode calls
    # LoRA set on a linear (models/adapters.py sets `module.lora`): that linear through its wrapper, which adds it
    added: list[int] = []

    class Adapter:
        def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            added.append(x.shape[0])
            return out

    wrappers[4].lora = Adapter()
    try:
        got, _ = decode_three_requests(lm)
    finally:
        del wrappers[4].lora
    assert got == want and len(added) == 1 + steps  # the prefill and every decode step


def test_a_replaced_linear_is_forgotten_at_every_row_count(monkeypatch):
    """A linear replaced in the model (its wrapper given a new kernel module) is resolved afresh at the next
    decode step, whatever its row count, and no other row count's entry keeps the old module (and its
    weights) alive: a batch size that stops recurring must not pin a replaced layer's tensors."""
    import gc
    import weakref

    from helpers import ids_request, random_ids

    lm = embedded()
    lm.allocate_kv_cache(48)
    plans = captured_plans(monkeypatch)

    def decode(requests: int) -> list:
        batch = lm.make_batch(0, [ids_request(i, random_ids(20 + 9 * i, i, 1000), 4) for i in range(requests)])
        tokens = []
        while batch is not None:
            generations, batch, _ = lm.generate_token(batch)
            tokens.append([g.tokens.ids for g in generations])
        return tokens

    decode(3)
    want = decode(1)
    plan = plans[-1]
    assert {key[0] for key in plan._bound} >= {1, 3}
    wrapper = lm.model.layers[0].self_attn.qkv
    old = wrapper._modules["linear"]
    assert any(entry is not None and entry[1] is old for entries in plan._bound.values() for entry in entries)
    replacement = DenseLinear(old.weight.detach().clone(), None if old.bias is None else old.bias.detach().clone())
    wrapper._modules["linear"] = replacement
    gone = weakref.ref(old)
    del old
    got = decode(1)  # only one row: the three-row entries are not looked at
    assert got == want
    assert all(entry is None or entry[1] is not gone() for entries in plan._bound.values() for entry in entries)
    gc.collect()
    assert gone() is None, "the replaced module is still referenced"


def test_a_decode_batch_on_the_native_gemm_resolves_with_its_bits(monkeypatch):
    """Past the matrix-vector product's rows a dense bfloat16 layer's decode batch runs the native GEMM where
    it is wanted (a build without AVX512-BF16, or TGS_CPU_BF16_GEMM=on on any build): its resolved call is
    that GEMM's, with forward's bits (before, such a layer went through its module every step)."""
    from text_generation_server.kernels.dense import decode_variant

    monkeypatch.setenv(cpu_native.BF16_GEMM_ENV, "on")
    layer = DenseLinear(torch.randn(192, 256).to(torch.bfloat16), torch.randn(192).to(torch.bfloat16))
    x = torch.randn(16, 256).to(torch.bfloat16)
    rows = [r for r in (3, 5, 8, 16) if decode_variant(layer, r) == "native-gemm"]
    assert rows, "no decode row count ran the native GEMM"
    with torch.inference_mode(), forward_phase(prefill=False):
        for r in rows:
            call = layer.decode_call(r, torch.bfloat16)
            assert call is not None
            assert same_bits(call(x[:r].contiguous()), layer(x[:r])), r
