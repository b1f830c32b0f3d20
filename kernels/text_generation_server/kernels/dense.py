"""The `dense` kernel: unquantized weights, chosen through the kernel table like the others.

A dense layer computes x @ W^T (+ bias) one of three ways (kernels/phase.py picks per forward):
- "gemv": on the CPU, a decode-sized input against bfloat16 or float32 weights runs the native
  matrix-vector product, which streams the weights faster than torch's GEMM there
  (kernels/cpu_native.py; by default up to BF16_GEMV_MAX_ROWS rows with AVX512-BF16, else
  BF16_GEMV_MAX_ROWS_FLOAT, or F32_GEMV_MAX_ROWS; for bfloat16 weights a machine's measurement may
  choose it or torch's GEMM per decode bucket up to 8 rows, kernels/cpu_tuning.py). For float32 it
  matters most on small models: torch's GEMM costs tens of microseconds a call in fixed work on a
  0.5 MiB matrix at one row, most of a step of the embedded model (BENCHMARKS.md, session 7);
- "gemm": torch's F.linear;
- "padded-gemm": the prompt path, F.linear with the smallest inputs padded so each row has the
  bits it has inside a larger call (every prefill forward, whatever its row count);
- "native-gemm": bfloat16 weights on a CPU build without AVX512-BF16 (cpu_native.bf16_gemm_fits):
  the native GEMM through float32 FMAs, for prompts (every row count: a row's bits do not depend
  on the others) and decode batches past the matrix-vector product's rows; torch's bfloat16 GEMM
  has no fast path there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.base import LinearSpec, QuantKernel
from text_generation_server.kernels.phase import (PREFILL, current_phase, decode_variant, prompt_linear, row_bucket,
                                                  run_rows)


def _deferred(weight: torch.Tensor) -> bool:
    """Whether a float32 CPU weight waits for its first decode call to look the extension up."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and not cpu_native.loaded()[0])


def native_for(weight: torch.Tensor) -> cpu_native.Extension | None:
    """The native CPU extension for a bfloat16 CPU weight (built at load); for a float32 one, the
    extension if this process has it already, else None and the layer looks it up on its first decode
    call (`DenseProduct.native`): a float32 model that never decodes (`quantize`'s calibration)
    builds and logs nothing it does not use."""
    if _deferred(weight):
        return None
    return cpu_native.for_dense_weight(weight)


class DenseProduct:
    """x @ weight^T (+ bias) for a module holding `weight` [N, K], `bias` and `native` (the extension
    or None): DenseLinear and the tensor-parallel head share it (phase.RowVariantLayer).

    A decode step of a small model calls this tens of times, each product a few microseconds of
    arithmetic, so the decode path keeps its Python short: the rows the native product takes are
    worked out when `native` is set (the layer's construction and every `.to()`), not per call."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    measured: dict[int, str]
    _native: cpu_native.Extension | None = None
    _gemv_rows = 0  # rows up to which the native product runs this weight by default (0: never)
    _gemv_any = 0  # rows up to which it can run it (a measured choice, kernels/cpu_tuning.py)
    _native_gemm = False  # the native bfloat16 GEMM runs prompts and larger decode batches (cpu_native.bf16_gemm_fits)
    _pending = False  # float32: the extension is looked up on the first decode call (native_for)

    @property
    def native(self) -> cpu_native.Extension | None:
        return self._native

    @native.setter
    def native(self, module: cpu_native.Extension | None) -> None:
        self._native = module
        self._pending = module is None and _deferred(self.weight)
        self._gemv_rows = 0 if module is None else cpu_native.dense_gemv_max_rows(module, self.weight)
        self._gemv_any = 0 if module is None else cpu_native.dense_gemv_max_rows(module, self.weight, any_build=True)
        self._native_gemm = cpu_native.bf16_gemm_fits(module, self.weight)

    def variants(self, rows: int) -> tuple[str, ...]:
        found = ("gemv", "gemm", "padded-gemm") if 0 < rows <= self._gemv_any else ("gemm", "padded-gemm")
        return (*found, "native-gemm") if self._native_gemm else found

    def prompt_variant(self) -> str:
        return "native-gemm" if self._native_gemm else "padded-gemm"

    def static_variant(self, rows: int) -> str:
        if 0 < rows <= self._gemv_rows:
            return "gemv"
        return "native-gemm" if self._native_gemm and rows > 0 else "gemm"

    def run(self, x: torch.Tensor, variant: str) -> torch.Tensor:
        # x: [M, K] -> [M, N]
        if variant == "gemv":
            return cpu_native.dense_gemv(self._native, x, self.weight, self.bias)
        if variant == "native-gemm":
            return cpu_native.bf16_gemm(self._native, x, self.weight, self.bias)
        if variant == "padded-gemm":
            return prompt_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        weight = self.weight
        k = x.shape[-1]
        if x.device.type != "cpu" or k != weight.shape[1]:
            return F.linear(x, weight, self.bias)  # nothing to choose off the CPU (or a shape error to raise)
        flat = x if x.dim() == 2 else x.reshape(-1, k)
        if current_phase() == PREFILL:
            y = run_rows(self, flat)
        else:  # decode rows, or no phase: run_rows without its prompt split
            if self._pending:
                self.native = cpu_native.for_dense_weight(weight)  # loads (or builds) it once per process
            y = self.run(flat, decode_variant(self, flat.shape[0]))
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])


class DenseLinear(DenseProduct, torch.nn.Module):
    # x: [tokens, in_features] -> [tokens, out_features]
    kernel_name = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.native = native_for(weight)
        self.measured = {}

    def decode_stamp(self, rows: int) -> tuple:
        """What `decode_call(rows)` was resolved from (kernels/cpu.py, Int4PackLinear.decode_stamp): the
        parameters by id and the weight's dtype (`.to()` may swap a parameter's data in place; the call reads
        the parameters' data when it runs)."""
        params = self._parameters
        bias = params["bias"] if "bias" in params else self.__dict__.get("bias")  # None: a plain attribute
        weight = params["weight"]
        return (id(weight), weight.dtype, id(bias), id(self._native), self._pending,
                self.measured.get(row_bucket(rows)))

    def decode_call(self, rows: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`forward` for a decode forward of `rows` contiguous CPU `dtype` rows, resolved once (as
        Int4PackLinear.decode_call): the native matrix-vector product's call with the weight, the bias and
        the prefetch bound, the native GEMM's, torch's F.linear or the padded prompt GEMM, as `run` runs
        them (the same ops, the same bits); None for anything else."""
        weight, bias = self.weight, self.bias
        if (self._pending or weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype != dtype or rows < 1
                or (bias is not None and bias.dtype != dtype)):
            return None
        variant = decode_variant(self, rows)
        if variant == "gemm":
            return lambda x: F.linear(x, weight, bias)
        if variant == "padded-gemm":
            return lambda x: prompt_linear(x, weight, bias)
        module = self._native
        if variant == "native-gemm" and module is not None:
            # decode batches past the matrix-vector product's rows on a build without AVX512-BF16
            return lambda x: cpu_native.bf16_gemm(module, x, weight, bias)
        if variant != "gemv" or module is None:
            return None
        if dtype == torch.float32:
            fn, min_bytes = self._native.f32_gemv, cpu_native.F32_PARALLEL_MIN_BYTES
            return lambda x: fn(x, weight, bias, cpu_native.PREFETCH_BYTES, min_bytes)
        if dtype != torch.bfloat16:
            return None
        fn, prefetch = self._native.bf16_gemv, cpu_native.bf16_gemv_prefetch(self._native)
        if bias is None:
            return lambda x: fn(x, weight, prefetch).to(dtype)
        return lambda x: (fn(x, weight, prefetch) + bias.float()).to(dtype)

    def _apply(self, fn, recurse: bool = True):
        # .to() may change the weight's device or dtype: the native path follows it.
        super()._apply(fn, recurse)
        self.native = native_for(self.weight)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_product(x)


class DenseWeight(Protocol):
    """What the dense kernel reads of a weight (quantizers.weights.UnquantizedWeight)."""

    weight: torch.Tensor  # [out_features, in_features]


def dense_spec(weight: torch.Tensor, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
    """The LinearSpec of a dense weight [N, K]: format "dense", bits of its dtype, one group over K."""
    n, k = weight.shape
    return LinearSpec(in_features=k, out_features=n, bits=weight.element_size() * 8, group_size=max(k, 1),
                      has_zeros=False, act_order=False, act_dtype=act_dtype, device_type=device_type,
                      weight_format="dense")


class DenseKernel(QuantKernel):
    """Unquantized weights as they are: torch's GEMM, the native bf16/f32 matrix-vector product for decode rows."""

    name = "dense"
    family = "dense"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.weight_format != "dense":
            return False, f"runs unquantized weights, not {spec.weight_format} weights"
        return True, ""

    @classmethod
    def build(cls, weight: DenseWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return DenseLinear(weight.weight, bias)
