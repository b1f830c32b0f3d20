"""A CPU decode step's decoder layers in the fewest Python calls (issues #31, #32, #34).

Why: at one decode row a layer's non-linear work is a few thousand numbers, so what it costs is the
Python around it: each layer went through `forward_chained`, two module calls (attention, MLP), the
attention's checks before its fused call (`SelfAttention._cpu_decode`), and before each norm and the
MLP's activation a test of the environment switch, the tensors' shapes and the CUDA kernels' use. On
Qwen2.5-1.5B that glue was ~5 ms of a ~31 ms step on the 2-core EPYC, with the caches cold after
each linear streamed its weights (BENCHMARKS.md, helper G, session 10). Here those tests run once
per model (the layers' structure) and once per step (the inputs, the cache, the switches), and each
layer is then eight calls: the residual add and input norm, q/k/v, the attention block, o_proj, the
residual add and MLP norm, gate_up, silu * up, down.

The arithmetic is the eager chained path's, call for call (`DecoderLayer.forward_chained` with
`RMSNorm.add_forward`, `SelfAttention._cpu_decode` and `GatedMLP.forward`'s native activation): the
same native functions on the same inputs, so the same bits (tests/test_cpu_decode_step.py compares
logits and caches with that path). Where anything differs from what the plan was built for, `run`
returns None and the model takes the eager path; TGS_CPU_DECODE_STEP=0 makes it always do so (read
per step, so a benchmark can switch it between steps).

The four linears of a layer are called through their one-row native call resolved once (`_linear_calls`:
the kernel module's `decode_call`, kept while its `decode_stamp` holds), not through the tensor-parallel
wrapper, the kernel module and its variant choice each call: at one row that Python was ~10-20 us of a
~60-90 us q/k/v or o_proj call on Qwen2.5-1.5B (BENCHMARKS.md, #32 session 13). The same native call
with the same arguments, so the same bits. A linear goes through its modules as before wherever the
modules would do more than that call: a forward hook (its own, its kernel's, or a global one), a
`forward` replaced on the instance, LoRA, a row linear over several ranks, a replaced kernel module, a
prefill phase, or a kernel module without a resolved call for these rows; TGS_CPU_DECODE_BIND=0 calls
every linear as a module (read per step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from text_generation_server.kernels import cpu_native, cpu_pointwise, fused_pointwise
from text_generation_server.kernels.phase import PREFILL, current_phase
from text_generation_server.layers.attention import DEFAULT_BACKEND, NATIVE_DECODE_ENV, KVCache, TorchAttention
from text_generation_server.layers.context import ForwardContext
from text_generation_server.layers.mlp import GatedMLP
from text_generation_server.layers.norm import RMSNorm
from text_generation_server.layers.self_attention import SelfAttention
from text_generation_server.layers.tensor_parallel import TensorParallelColumnLinear, TensorParallelRowLinear

ENV = "TGS_CPU_DECODE_STEP"
BIND_ENV = "TGS_CPU_DECODE_BIND"
_OFF = ("0", "false", "no", "off")
_LINEARS = (("attn_modules", "qkv"), ("attn_modules", "o_proj"), ("mlp_modules", "gate_up"), ("mlp_modules", "down"))


@dataclass(frozen=True)
class _Layer:
    """What one layer's decode step reads, gathered once. The modules' own dictionaries of parameters
    and submodules, not their attributes: `module.weight` goes through nn.Module.__getattr__ (~0.4 us,
    a few per layer), a dictionary read does not, and it still sees a parameter or linear replaced."""

    input_params: dict  # input_norm._parameters ("weight")
    input_eps: float
    mlp_params: dict  # mlp_norm._parameters
    mlp_eps: float
    attn: SelfAttention
    attn_modules: dict  # attn._modules ("qkv", "o_proj")
    mlp_modules: dict  # mlp._modules ("gate_up", "down")
    rotary: int  # id() of the layer's RotaryEmbedding
    layer_modules: dict  # the DecoderLayer's _modules: its parts must still be these ones
    parts: tuple  # (attention, MLP, input norm, MLP norm): the modules whose hooks the plan would skip
    layer_id: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int  # 0: none (the bfloat16 call's form)
    local: int  # the MLP's intermediate features on this rank


def _llama_rms(norm: torch.nn.Module | None) -> bool:
    return type(norm) is RMSNorm and norm._scale32 is None and norm.weight.dim() == 1 and norm.weight.is_contiguous()


class CpuDecodeStep:
    """The layers of a model whose every layer is Llama-wired (`DecoderLayer.chains_residual`),
    with a `SelfAttention` in the fused decode layout and a SwiGLU `GatedMLP`; `plan` says whether
    a model is one."""

    def __init__(self, layers: list[_Layer]):
        self.layers = layers
        self.rotaries = list({layer.rotary: layer.attn.rotary for layer in layers}.values())
        self._cache_key: tuple[int, int, torch.dtype] | None = None  # the cache last found fit, and its dtype
        # Where each linear's module is found, in step order (each layer's qkv, o_proj, gate_up, down), and per
        # (rows, dtype) each one's (wrapper, kernel module, its decode_stamp, the call) or None.
        self._slots = [(getattr(layer, group), name) for layer in layers for group, name in _LINEARS]
        self._bound: dict[tuple[int, torch.dtype], list[tuple | None]] = {}

    @classmethod
    def plan(cls, layers: torch.nn.ModuleList) -> CpuDecodeStep | None:
        """The plan for these layers (each a `DecoderLayer` that chains its residual), or None where
        some layer is not of the shape it takes."""
        out = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (type(attn) is SelfAttention and attn._fused_decode_layout() and type(mlp) is GatedMLP
                    and mlp.act is F.silu and _llama_rms(layer.input_norm) and _llama_rms(layer.mlp_norm)
                    and layer.input_norm.weight.dtype == layer.mlp_norm.weight.dtype):
                return None
            out.append(_Layer(layer.input_norm._parameters, layer.input_norm.eps, layer.mlp_norm._parameters,
                              layer.mlp_norm.eps, attn, attn._modules, mlp._modules, id(attn.rotary), layer._modules,
                              (attn, mlp, layer.input_norm, layer.mlp_norm), attn.layer_id,
                              attn.heads, attn.kv_heads, attn.head_dim, attn.scale, attn.window or 0, mlp.local))
        if not out or len({layer.input_params["weight"].dtype for layer in out}) != 1:
            return None
        return cls(out)

    def _cache_fits(self, cache: KVCache, dtype: torch.dtype) -> bool:
        """Every layer's K and V caches contiguous in the model's dtype, without fp8 scales (checked
        once per cache: the engine allocates it once, every layer alike)."""
        keys = cache.keys
        key = (id(cache), keys[0].data_ptr() if keys and keys[0] is not None else 0, dtype)
        if key == self._cache_key:
            return True
        for layer in self.layers:
            k, v = cache.keys[layer.layer_id], cache.values[layer.layer_id]
            if (cache.scales_of(layer.layer_id) is not None or k is None or v is None or k.dtype != dtype
                    or v.dtype != dtype or not k.is_contiguous() or not v.is_contiguous()):
                return False
        self._cache_key = key
        return True

    def _unchanged(self) -> bool:
        """Whether each layer still holds the parts the plan was made from, none of them hooked (a hook on
        an attention, MLP or norm module would see the eager calls, not the plan's; the linears are
        called as modules, so theirs run)."""
        for layer in self.layers:
            attn, mlp, input_norm, mlp_norm = layer.parts
            mods = layer.layer_modules
            if (mods["self_attn"] is not attn or mods["mlp"] is not mlp or mods["input_norm"] is not input_norm
                    or mods["mlp_norm"] is not mlp_norm):
                return False
            for part in layer.parts:
                if part._forward_hooks or part._forward_pre_hooks:
                    return False
        return True

    def _linear_calls(self, rows: int, dtype: torch.dtype) -> list:
        """Each layer's four linears (qkv, o_proj, gate_up, down, layer by layer) as this step calls them:
        the resolved one-row call where the module path would make only that call, else the module. A
        resolved call is kept while its wrapper and kernel module are the same objects, neither hooked nor
        given a forward on the instance, no LoRA set, and the kernel module's stamp unchanged (~1 us a
        linear a step; what the first resolution checks beyond that cannot change without a new object)."""
        slots = self._slots
        if (os.environ.get(BIND_ENV, "1").strip().lower() in _OFF or current_phase() == PREFILL
                or _global_hooks()):
            return [mods[name] for mods, name in slots]
        cached = self._bound.get((rows, dtype))
        if cached is None:
            cached = self._bound[(rows, dtype)] = [None] * len(slots)
        calls = []
        append = calls.append
        for i, (mods, name) in enumerate(slots):
            wrapper = mods[name]
            entry = cached[i]
            if entry is not None and entry[0] is wrapper:
                inner = entry[1]
                if (wrapper._modules.get("linear") is inner and not (
                        wrapper._forward_hooks or wrapper._forward_pre_hooks or inner._forward_hooks
                        or inner._forward_pre_hooks or wrapper.lora is not None or "lora" in wrapper._modules
                        or "forward" in wrapper.__dict__ or "forward" in inner.__dict__)
                        and inner.decode_stamp(rows) == entry[2]):
                    append(entry[3])
                    continue
            if entry is not None:
                # What slot i was resolved from changed: forget it at every row count, so a count that
                # stops recurring does not keep a replaced layer's tensors alive through its call.
                for other in self._bound.values():
                    other[i] = None
            inner = _plain_inner(wrapper)
            if inner is None:
                cached[i] = None
                append(wrapper)
                continue
            entry = cached[i] = (wrapper, inner, inner.decode_stamp(rows), inner.decode_call(rows, dtype) or wrapper)
            append(entry[3])
        return calls

    def run(self, hidden: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, the last layer's pending output) as the chained layers give them, or None where
        this step is not one the plan takes (the caller then runs the layers eagerly)."""
        dtype = hidden.dtype
        meta = ctx.meta
        if (meta.is_prefill or hidden.device.type != "cpu" or hidden.dim() != 2 or hidden.stride(-1) != 1
                or dtype not in (torch.bfloat16, torch.float32) or dtype != self.layers[0].input_params["weight"].dtype):
            return None
        backend = meta.backend or DEFAULT_BACKEND
        if type(backend) is not TorchAttention or fused_pointwise.usable(hidden):
            return None
        env = os.environ
        if env.get(ENV, "1").strip().lower() in _OFF or env.get(cpu_pointwise.ENV, "1").strip().lower() in _OFF:
            return None
        if dtype == torch.bfloat16 and env.get(NATIVE_DECODE_ENV, "1").strip().lower() in _OFF:
            return None
        ext = cpu_native.native()
        if ext is None or not self._cache_fits(ctx.cache, dtype) or not self._unchanged():
            return None
        # cos and sin of each rotary (one for most models), checked as _cpu_decode checks them.
        shapes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for rotary in self.rotaries:
            if id(rotary) not in shapes:
                cos, sin = ctx.cos_sin(rotary)
                if not (cos.dtype == sin.dtype == dtype and cos.dim() == 3 and cos.shape == sin.shape
                        and cos.shape[0] == hidden.shape[0] and cos.shape[1] == 1
                        and cos.stride(-1) == 1 and sin.stride(-1) == 1):
                    return None
                shapes[id(rotary)] = (cos, sin)
        for layer in self.layers:
            if shapes[layer.rotary][0].shape[-1] != layer.head_dim:  # every dimension rotated
                return None
        meta, cache = ctx.meta, ctx.cache
        keys, values, slots = cache.keys, cache.values, meta.slots
        if dtype == torch.bfloat16:
            norm, silu_mul, attention = ext.rms_norm_bf16, ext.silu_mul_bf16, ext.decode_attention_bf16
            tables, lens = meta.block_tables, meta.seq_lens

            def attend(layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
                i = layer.layer_id
                return attention(qkv, cos, sin, keys[i], values[i], slots, tables, lens, layer.heads, layer.kv_heads,
                                 layer.scale, layer.window)
        else:  # float32: the attention stays torch's SDPA (SelfAttention._cpu_decode says why)
            norm, silu_mul, rotary_store = ext.rms_norm_f32, ext.silu_mul_f32, ext.rotary_store_f32
            rows = hidden.shape[0]

            def attend(layer: _Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
                i = layer.layer_id
                q = rotary_store(qkv, cos, sin, keys[i], values[i], slots, layer.heads, layer.kv_heads)
                return backend.decode(q, keys[i], values[i], meta, layer.scale, layer.attn.window).reshape(
                    rows, layer.heads * layer.head_dim)

        # The layers, eight calls each; hidden: [rows, hidden] in the step's dtype.
        calls = iter(self._linear_calls(hidden.shape[0], dtype))
        pending = None
        for layer in self.layers:
            cos, sin = shapes[layer.rotary]
            if pending is None:
                normed = norm(hidden, layer.input_params["weight"], layer.input_eps, None)[0]
            else:
                normed, hidden = norm(hidden, layer.input_params["weight"], layer.input_eps, pending)
            qkv_call, o_call, gate_up_call, down_call = next(calls), next(calls), next(calls), next(calls)
            qkv = qkv_call(normed)
            if qkv.stride(-1) != 1:
                qkv = qkv.contiguous()
            out = attend(layer, qkv, cos, sin)
            mlp_in, hidden = norm(hidden, layer.mlp_params["weight"], layer.mlp_eps, o_call(out))
            gate_up = gate_up_call(mlp_in)
            if gate_up.stride(-1) != 1:
                gate_up = gate_up.contiguous()
            pending = down_call(silu_mul(gate_up, layer.local))
        return hidden, pending


def _global_hooks() -> bool:
    """Whether a global module hook is registered (every module call would run it)."""
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _plain_inner(wrapper: torch.nn.Module) -> torch.nn.Module | None:
    """The kernel module of a tensor-parallel linear whose call is only its kernel module's (no LoRA,
    one rank, no hook or instance-level `forward` on either), if that module resolves one-row calls."""
    kind = type(wrapper)
    if kind is not TensorParallelColumnLinear and (kind is not TensorParallelRowLinear
                                                   or wrapper.process_group.size != 1):
        return None
    inner = wrapper._modules.get("linear")
    if (inner is None or wrapper.lora is not None or "lora" in wrapper._modules or wrapper._forward_hooks
            or wrapper._forward_pre_hooks or inner._forward_hooks or inner._forward_pre_hooks
            or "forward" in wrapper.__dict__ or "forward" in inner.__dict__
            or getattr(type(inner), "decode_call", None) is None):
        return None
    return inner
