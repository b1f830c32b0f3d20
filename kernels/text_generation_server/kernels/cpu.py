"""CPU kernels: torch's weight-only int4 and int8 matmuls.

Both repack the canonical weight once at build time; forward is one op call plus, where
needed, one input gather (act-order) or one row sum (int8 zero points).

Exactness arguments, so the kernels can take more than the obvious cases:
- int4 computes w = (q - 8) * s + zero per group. With zero = (8 - z) * s that is
  s * (q - z) for any zero point z, so 2- and 3-bit codes (a subset of 0..15) run
  exactly too. A checkpoint group may be split into several kernel groups with the same
  scale, so per-channel and group sizes that are multiples of 32 map onto the op's
  {32, 64, 128, 256}. Act-order: sorting rows by group makes every group contiguous;
  permuting the input columns the same way leaves x @ W unchanged. Groups whose row counts
  no op group size divides (an act-order row shard under tensor parallelism holds a different
  number of rows of each group) are padded up to whole op groups with rows that meet a zero
  input column, so they add nothing: exact, at the cost of the padded rows (bounded by
  MAX_PADDING).
- int8 computes y = (x @ q8^T) * s per output channel. With q8 = q - m, m = 2^(bits-1)
  (fits int8 for any width up to 8), s * (q - z) = s * q8 + s * (m - z), so a zero point becomes a
  per-channel constant times the row sum of x: exact for every bit width and zero point,
  but only with one scale per output channel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from loguru import logger

from text_generation_server.kernels import cpu_act_int8, cpu_native
from text_generation_server.kernels.base import LinearSpec, QuantizedWeight, QuantKernel
from text_generation_server.kernels.phase import choose_variant, decode_variant, row_bucket, run_rows

INT4_GROUP_SIZES = (256, 128, 64, 32)  # the op's qGroupSize values, largest (fewest scales) first
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The int4 and int8 ops accept float32 and float16 activations but run them 25-60x slower
# than bf16 (only bf16 has a fast micro-kernel; measured on the reference Xeon: int4 4096x4096
# batch 1 at 59 ms in fp32 and 57 ms in fp16 against 0.9 ms in bf16, slower than a dense fp32
# matmul). So other activation dtypes are cast to bf16 around the call, scales are stored in
# bf16 and the output is cast back. The added error (bf16 rounding, ~2^-9 relative) is an order
# of magnitude below 4-bit quantization error. Set to False to call the ops in the model dtype.
VIA_BF16 = True


def _unsupported_common(spec: LinearSpec) -> str:
    if spec.weight_format != "int":
        return f"runs integer codes, not {spec.weight_format} weights"
    if spec.device_type != "cpu":
        return f"device {spec.device_type}"
    if spec.act_dtype not in _ACT_DTYPES:
        return f"activation dtype {spec.act_dtype} not in bfloat16/float16/float32"
    return ""


def _compute_dtype(act_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if VIA_BF16 else act_dtype


# Padding rows the int4 op accepts, as a fraction of K: rows it stores and multiplies for nothing.
# At most doubling K keeps the packed weight at a quarter of a float32 copy and half of a bf16 one
# (the dense reference's), and an act-order row shard of 128-row groups needs ~25% at 2 ranks,
# ~50% at 4.
MAX_PADDING = 1.0


def int4_group_size(spec: LinearSpec) -> int | None:
    """The op group size to run `spec` with: the largest supported one tiling every group and K."""
    rows = spec.rows_per_group_gcd()
    for g in INT4_GROUP_SIZES:
        if rows % g == 0 and spec.in_features % g == 0:
            return g
    return None


def int4_layout(spec: LinearSpec) -> tuple[int, int] | None:
    """(op group size, K after padding every group to whole op groups), the fewest padded rows
    first and then the largest group size; None when the group row counts are not known."""
    exact = int4_group_size(spec)
    if exact is not None:
        return exact, spec.in_features
    if spec.group_rows is None:
        return None
    best = None
    for g in INT4_GROUP_SIZES:
        padded = sum(-(-count // g) * g for count in spec.group_rows)
        if best is None or padded < best[1]:
            best = (g, padded)
    return best


class Int4PackLinear(torch.nn.Module):
    # x: [..., K] -> [..., N]
    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 perm: torch.Tensor | None, bias: torch.Tensor | None, act_dtype: torch.dtype,
                 in_features: int | None = None):
        super().__init__()
        self.register_buffer("packed", packed)  # uint8 [N, Kp/2], the op's blocked layout (Kp: K padded)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [Kp/g, N, 2] compute dtype
        # int64 [Kp] or None: input column of each packed row; K (one past the last column) for the
        # padding rows, which read a zero column appended to the input.
        self.register_buffer("perm", perm)
        self.register_buffer("bias", bias)
        self.group_size = group_size
        self.act_dtype = act_dtype
        self.compute_dtype = scales_and_zeros.dtype
        self.in_features = packed.shape[1] * 2 if in_features is None else in_features
        self.padded = packed.shape[1] * 2 != self.in_features
        self.out_features = packed.shape[0]
        self.native = cpu_native.native()
        self.measured: dict[int, str] = {}  # row bucket -> variant, from measurements (kernels/cpu_tuning.py)
        self.int8_activations = False  # use_int8_activations()
        self.direct_q8 = False  # use_int8_activations(): forward's one-call path
        self.block = cpu_native.int4_block() or 64
        # For the native kernel reading the packed bytes in place (cpu_native.int4pack_mm): the
        # scales and offsets (W = q * s + c, c = z - 8 s) in float32 [Kp/g, N], 8 bytes per group and
        # output (an eighth more than the packed codes at g=128).
        self.register_buffer("scales_f32", None)
        self.register_buffer("offsets_f32", None)
        self.register_buffer("tiled", None)  # use_int8_activations(): cpu_act_int8.tile's layout
        if self._dequantizes():
            sz = scales_and_zeros.float()
            self.scales_f32 = sz[..., 0].contiguous()
            self.offsets_f32 = (sz[..., 1] - 8.0 * sz[..., 0]).contiguous()

    def use_int8_activations(self) -> None:
        """Every row count, prompts and decode alike, takes int8 activations (kernels/cpu_act_int8.py):
        one arithmetic for a row whatever its batch or its prompt's chunking."""
        if self.scales_f32 is None:
            sz = self.scales_and_zeros.float()
            self.scales_f32 = sz[..., 0].contiguous()
            self.offsets_f32 = (sz[..., 1] - 8.0 * sz[..., 0]).contiguous()
        self.int8_activations = True
        # its measured names (cpu_act_int8.VARIANTS) kept apart from the exact layer's of the same shape
        self.preference_scope = cpu_act_int8.SCOPE
        self.block = cpu_native.int4_block() or 64
        self.direct_q8 = (self.native is not None and not self.padded and self.perm is None
                          and self.compute_dtype == self.act_dtype == torch.bfloat16
                          and (self.bias is None or self.bias.dtype == torch.bfloat16))
        if self.tiled is None and cpu_act_int8.tiled_enabled(self.native):
            # The codes and scales rearranged for the int8-activation kernel (cpu_act_int8.tile: the same
            # bits); torch's layout and the float32 scales are let go (the tiled bytes hold them).
            self.tiled = cpu_act_int8.tile_for_layer(self.packed, self.scales_f32, self.offsets_f32,
                                                     self.group_size, self.block)
            self.packed = self.scales_f32 = self.offsets_f32 = None

    # The ways to compute (kernels/phase.py): "native" the packed bytes read in place for any row
    # count (NATIVE_VARIANTS: the same bits under every name), "op" torch's int4 op, "dequant" row
    # blocks dequantized to bf16 for torch's GEMM.
    def _dequantizes(self) -> bool:
        return (self.native is not None and self.compute_dtype == torch.bfloat16
                and cpu_native.int4_dequant_fits(self.out_features))

    def _reads_in_place(self) -> bool:
        return self._dequantizes() and cpu_native.int4_native_ok(self.native)

    def variants(self, rows: int) -> tuple[str, ...]:
        if self.int8_activations:
            return tuple(cpu_act_int8.VARIANTS)
        if not self._dequantizes():
            return ("op",)
        native = tuple(cpu_native.INT4_NATIVE_VARIANTS) if self._reads_in_place() else ()
        return (*native, "op", "dequant")

    def prompt_variant(self) -> str:
        # Every prompt row count takes the native kernel: its rows have the same bits whatever the
        # rows beside them, so short prompts (a chat turn after a cached prefix) read the weights
        # once instead of dequantizing all of them. Which of its names (rows per pass, prefetch) is
        # what this machine measured for prompt-sized inputs; the bits are the same under each.
        if self.int8_activations:
            chosen = self.measured.get(cpu_native.INT4_PROMPT_BUCKET, "")
            return chosen if chosen in cpu_act_int8.VARIANTS else cpu_act_int8.Q8
        if not self._dequantizes():
            return "op"
        if not self._reads_in_place():
            return "dequant"  # a build whose int4 kernel is slow: the dequantized GEMM, as before it
        chosen = self.measured.get(cpu_native.INT4_PROMPT_BUCKET, "")
        return chosen if chosen in cpu_native.INT4_NATIVE_VARIANTS else cpu_native.INT4_NATIVE

    def static_variant(self, rows: int) -> str:
        if self.int8_activations:
            return cpu_act_int8.Q8
        return cpu_native.int4_variant(rows, self._reads_in_place()) if self._dequantizes() else "op"

    def run(self, x: torch.Tensor, variant: str) -> torch.Tensor:
        # x: [M, Kp] compute dtype, permuted and padded -> [M, N] compute dtype
        if variant in cpu_act_int8.VARIANTS:
            if self.tiled is not None:
                if x.dtype == torch.bfloat16 == self.compute_dtype:
                    return cpu_act_int8.int4_q8_tiled_linear(self.native, x, self.tiled, None, self.group_size,
                                                             self.block, variant)
                return cpu_act_int8.int4_q8_tiled_mm(self.native, x, self.tiled, self.group_size, self.block,
                                                     variant).to(self.compute_dtype)
            if self.native is not None and x.dtype == torch.bfloat16 == self.compute_dtype:
                return cpu_act_int8.int4_q8_linear(self.native, x, self.packed, self.scales_f32, self.offsets_f32,
                                                   None, self.group_size, self.block, variant)
            return cpu_act_int8.int4_q8_mm(self.native, x, self.packed, self.scales_f32, self.offsets_f32,
                                           self.group_size, cpu_native.int4_block() or 64, variant
                                           ).to(self.compute_dtype)
        params = cpu_native.INT4_NATIVE_VARIANTS.get(variant)
        if params is not None:
            return cpu_native.int4pack_mm(self.native, x, self.packed, self.scales_f32, self.offsets_f32,
                                          self.group_size, *params).to(self.compute_dtype)
        if variant == "dequant":
            return cpu_native.int4pack_dequant_gemm(self.native, x, self.packed, self.scales_and_zeros,
                                                    self.group_size)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)

    def decode_stamp(self, rows: int) -> tuple:
        """What `decode_call(rows)` was resolved from: the tensors it binds (by id; the call holds them,
        so an id is not reused while it lives), the switch and the measured name. A caller keeps a
        resolved call while the stamp stays the same."""
        buffers = self._buffers
        return (id(buffers["tiled"]), id(buffers["packed"]), id(buffers["bias"]), self.direct_q8,
                self.measured.get(row_bucket(rows)))

    def decode_call(self, rows: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`forward` for a decode forward of `rows` contiguous `dtype` rows [rows, K], resolved once: the
        native function and its bound arguments, without the module call, the variant choice and the
        wrappers' argument checks per call (a decode step makes 4 such calls a layer, ~10 us of Python
        each against ~60 us of weights for Qwen2.5-1.5B's qkv; BENCHMARKS.md, #32 session 13). The same
        native call as forward's one-call path, so the same bits; None where forward takes another path."""
        if not self.direct_q8 or self.native is None or dtype != torch.bfloat16:
            return None
        rows_per_pass, prefetch, grain = cpu_act_int8.VARIANTS.get(decode_variant(self, rows),
                                                                   cpu_act_int8.VARIANTS[cpu_act_int8.Q8])
        prefetch = cpu_act_int8.PREFETCH_BYTES if prefetch < 0 else prefetch
        grain = grain or cpu_native.INT4_BLOCK_GRAIN
        bias = torch.empty(0, dtype=torch.bfloat16) if self.bias is None else self.bias
        gs, block = self.group_size, self.block
        if self.tiled is not None:
            fn, tiled = self.native.int4_q8_tiled_linear, self.tiled
            return lambda x: fn(x, tiled, bias, gs, block, rows_per_pass, prefetch, grain)
        fn, packed, s, c = self.native.int4_q8_linear, self.packed, self.scales_f32, self.offsets_f32
        return lambda x: fn(x, packed, s, c, bias, gs, block, rows_per_pass, prefetch, grain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.direct_q8 and x.dtype == torch.bfloat16:
            # int8 activations, bfloat16 throughout, no permutation: one native call with the bias, one
            # variant for every row (they all give a row the same bits, so a prefill that carries
            # decoding rows needs no split), the bits of the general path below
            variant = choose_variant(self, x.shape[0])
            if self.tiled is not None:
                y = cpu_act_int8.int4_q8_tiled_linear(self.native, x, self.tiled, self.bias, self.group_size,
                                                      self.block, variant)
            else:
                y = cpu_act_int8.int4_q8_linear(self.native, x, self.packed, self.scales_f32, self.offsets_f32,
                                                self.bias, self.group_size, self.block, variant)
            return y.reshape(*lead, self.out_features)
        if self.padded:
            x = torch.nn.functional.pad(x, (0, 1))
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x = x.to(self.compute_dtype).contiguous()
        y = run_rows(self, x).to(self.act_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class CpuInt4PackKernel(QuantKernel):
    """torch._weight_int4pack_mm_for_cpu: weight stays 4-bit in memory (4x less than bf16)."""

    name = "cpu-int4pack"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        reason = _unsupported_common(spec)
        if reason:
            return False, reason
        if spec.bits > 4:
            return False, f"needs at most 4-bit codes, got {spec.bits}-bit"
        if spec.out_features % 16:
            return False, f"out_features {spec.out_features} not a multiple of 16"
        layout = int4_layout(spec)
        kind = "act-order groups" if spec.act_order else "groups"
        if layout is None:
            # Only specs without row counts get here (weights always bring them).
            if spec.in_features % 32:
                return False, f"in_features {spec.in_features} not a multiple of 32"
            rows = spec.rows_per_group_gcd()
            nominal = math.gcd(spec.group_size, spec.in_features % spec.group_size or spec.group_size)
            if rows != nominal:
                return False, f"{kind} of unequal size (row counts share at most {rows} rows, need a multiple of 32)"
            return False, f"group size {spec.group_size} not in {{32,64,128,256}} or a multiple of 32"
        gs, padded = layout
        extra = padded - spec.in_features
        if extra > MAX_PADDING * spec.in_features:
            return False, (f"{kind} too small or uneven for its 32-256-row blocks: padding each group to whole "
                           f"{gs}-row blocks would add {extra} rows to {spec.in_features} "
                           f"({extra / spec.in_features:.0%}, over the {MAX_PADDING:.0%} allowed)")
        return True, ""

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        spec = weight.spec(act_dtype, "cpu")
        ok, reason = cls.can_implement(spec)
        if not ok:
            raise ValueError(f"{cls.name} cannot run this weight: {reason}")
        gs, padded = int4_layout(spec)
        k = weight.in_features
        g_idx = weight.g_idx.long()
        perm = torch.argsort(g_idx, stable=True)
        if padded != k:
            perm = _padded_order(g_idx, perm, gs, padded)
        sorted_groups = torch.cat([g_idx, g_idx.new_full((1,), -1)])[perm]  # -1: a padding row
        # Each kernel group must lie inside one checkpoint group (padding rows join the group before them).
        sub = sorted_groups.view(padded // gs, gs)
        src = sub[:, 0]  # checkpoint group of each kernel group
        real = sub >= 0
        if not torch.equal(torch.where(real, sub, src[:, None]), src[:, None].expand_as(sub)) or bool((src < 0).any()):
            raise ValueError(f"{cls.name}: groups do not tile into {gs}-row blocks after sorting by g_idx")
        identity = padded == k and torch.equal(perm, torch.arange(k))
        codes = weight.qweight if identity else torch.cat([weight.qweight, weight.qweight.new_zeros(1, weight.out_features)]
                                                          ).index_select(0, perm)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.t().to(torch.int32).contiguous(), 2)
        scales = weight.scales.float().index_select(0, src)  # [Kp/gs, N]
        zeros = weight.zero_points().float().index_select(0, src)
        compute = _compute_dtype(act_dtype)
        sz = torch.stack([scales, (8.0 - zeros) * scales], dim=-1).to(compute).contiguous()
        return Int4PackLinear(packed, sz, gs, None if identity else perm, None if bias is None else bias.to(act_dtype),
                              act_dtype, in_features=k)


def _int8_activation_refusal(spec: LinearSpec, *kind: str) -> str:
    """Why the int8-activation variant of a layer kernel may not run ("" when it may): the
    --cpu-int8-activations policy for this build and weight kind, and bfloat16 compute."""
    module = cpu_native.native()
    cpu_act_int8.announce(module)
    use, why = cpu_act_int8.decision(module, *kind)
    if not use:
        return why
    if _compute_dtype(spec.act_dtype) != torch.bfloat16:
        return "runs bfloat16 compute only (kernels/cpu.py VIA_BF16)"
    return ""


class CpuInt4PackQ8Kernel(CpuInt4PackKernel):
    """The int4 layer with activations rounded to int8 per 32-wide block and integer dot products
    (llama.cpp's Q8_0 scheme; kernels/cpu_act_int8.py): a policy, `--cpu-int8-activations`."""

    name = "cpu-int4pack-q8"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, reason = super().can_implement(spec)
        if not ok:
            return ok, reason
        refusal = _int8_activation_refusal(spec)
        if refusal:
            return False, refusal
        block = cpu_native.int4_block()
        if block is None or spec.out_features % block:
            return False, f"out_features {spec.out_features} not whole {block or 64}-output blocks of torch's int4 layout"
        return True, ""

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        module = super().build(weight, bias, act_dtype)
        module.use_int8_activations()
        return module


def _padded_order(g_idx: torch.Tensor, perm: torch.Tensor, gs: int, padded: int) -> torch.Tensor:
    """Rows sorted by group, each group followed by padding rows (index K) up to a multiple of `gs`."""
    k = g_idx.numel()
    counts = torch.bincount(g_idx, minlength=int(g_idx.max()) + 1).tolist()
    parts, start = [], 0
    for count in counts:
        if count == 0:
            continue
        parts.append(perm[start:start + count])
        pad = -count % gs
        if pad:
            parts.append(perm.new_full((pad,), k))
        start += count
    order = torch.cat(parts)
    assert order.numel() == padded, (order.numel(), padded)
    return order


_TABLE_ANNOUNCED: list[bool] = []  # the table layout's startup line, once a process


class Int8Linear(torch.nn.Module):
    # x: [..., K] -> [..., N]
    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor | None,
                 bias: torch.Tensor | None, act_dtype: torch.dtype, scales_f32: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight)  # int8 [N, K]
        self.register_buffer("scales", scales)  # [N] compute dtype
        # float32 [N], for the native kernels (cpu_native.py): decode rows and prompt-sized inputs
        self.register_buffer("scales_f32", scales.float() if scales_f32 is None else scales_f32)
        self.native = cpu_native.native()
        self.measured: dict[int, str] = {}  # row bucket -> variant, from measurements (kernels/select.py)
        self.register_buffer("offset", offset)  # float32 [N]: s * (m - z), None when zero
        self.register_buffer("bias", bias)
        self.act_dtype = act_dtype
        self.compute_dtype = scales.dtype
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.row_invariant = False  # keep_rows_invariant()
        self.int8_activations = False  # use_int8_activations()
        self.table_layout = False  # use_table_layout(): `weight` in cpu_native.int8_table_pack's layout

    def use_int8_activations(self) -> None:
        """Every row count, prompts and decode alike, takes int8 activations (kernels/cpu_act_int8.py):
        one arithmetic for a row whatever its batch or its prompt's chunking (row-invariant)."""
        self.int8_activations = self.row_invariant = True
        self.preference_scope = cpu_act_int8.SCOPE  # as Int4PackLinear's

    def keep_rows_invariant(self) -> bool:
        """Runs every row count, decode and prompt alike, on the matrix-vector kernel (chunks of
        cpu_native.INT8_GEMV_MAX_ROWS rows, each reading the weights once), so a row's result has the
        same bits whatever shares its batch (with int8 activations it is already). For the int8 head: the greedy token of a sequence must
        not depend on how many others decode beside it, and the head's logits are where near-ties are
        decided (torch's op from 9 rows and the dequantized GEMM from 32 round differently). False,
        and nothing changes, where the kernel cannot run (no native extension, another compute dtype)."""
        if self.int8_activations:
            return True
        self.row_invariant = self._native_ok() and cpu_native.int8_row_invariant_fits(self.in_features)
        if self.row_invariant:
            self.use_table_layout()
        return self.row_invariant

    def use_table_layout(self) -> bool:
        """Rearranges the codes into cpu_native.int8_table_pack's layout where this build reads it faster
        (AVX512-BF16 + VBMI) and the layer can take it: bfloat16 activations and compute, exact
        activations, no code -128, K within the matrix-vector kernel's range. Every variant but torch's
        op keeps its bits (the op, the plain layout's choice at 9-31 rows, gives way to the matrix-vector
        kernel in chunks of 8 rows). True when the layer now has the layout."""
        if self.table_layout:
            return True
        if (self.int8_activations or not self._native_ok() or self.act_dtype != torch.bfloat16
                or not cpu_native.int8_table_enabled(self.native) or self.in_features > cpu_native.INT8_GEMV_MAX_K
                or self.in_features % 16 or int(self.weight.min()) == -128):
            return False
        from text_generation_server.kernels import cpu_kquant  # imported here: it imports this module's peers

        # In the huge-page arena (as cpu_act_int8.tile_for_layer's int4 layout): a one-row call streams the
        # codes once, and on 4 KiB pages each page is a TLB miss and a stop for the hardware prefetchers.
        packed = cpu_native.int8_table_pack(self.weight, module=self.native)
        self.weight = cpu_kquant.in_arena(packed.view(torch.uint8)).view(torch.int8)
        self.table_layout = True
        if not _TABLE_ANNOUNCED:
            _TABLE_ANNOUNCED.append(True)
            logger.info("int8 layers with exact activations: codes in the table layout (AVX512-VBMI byte lookups, "
                        "the same results; {}=off keeps the plain one); decode batches up to {} rows on the "
                        "matrix-vector kernel", cpu_native.TABLE_ENV, cpu_native.INT8_DEQUANT_MIN_ROWS - 1)
        return True

    # The ways to compute (kernels/phase.py): "gemv" the native matrix-vector kernel (at one of the
    # prefetch distances of cpu_native.INT8_GEMV_VARIANTS: the same bits under each name), "op" torch's
    # _weight_int8pack_mm, "dequant" the dequantized bf16 GEMM.
    def _native_ok(self) -> bool:
        return self.native is not None and self.compute_dtype == torch.bfloat16

    def variants(self, rows: int) -> tuple[str, ...]:
        if self.int8_activations:
            return tuple(cpu_act_int8.INT8_VARIANTS)
        if self.row_invariant:
            return tuple(cpu_native.INT8_GEMV_VARIANTS)
        if self.table_layout:
            return cpu_native.int8_table_variants(rows)
        return cpu_native.int8_variants(rows, self.in_features) if self._native_ok() else ("op",)

    def prompt_variant(self) -> str:
        if self.int8_activations:
            # the name measured for prompt-sized inputs (the same bits under each)
            chosen = self.measured.get(cpu_native.INT4_PROMPT_BUCKET, "")
            return chosen if chosen in cpu_act_int8.INT8_VARIANTS else cpu_act_int8.Q8
        if self.row_invariant:
            return self.static_variant(cpu_native.INT8_GEMV_MAX_ROWS)
        return "dequant" if self._native_ok() else "op"

    def static_variant(self, rows: int) -> str:
        if self.int8_activations:
            return cpu_act_int8.Q8
        if self.row_invariant:
            # the prefetch distance measured for the largest decode bucket (the same bits under each name)
            chosen = self.measured.get(cpu_native.INT8_GEMV_MAX_ROWS, "")
            return chosen if chosen in cpu_native.INT8_GEMV_VARIANTS else "gemv"
        if self.table_layout:
            return cpu_native.int8_table_variant(rows)
        return cpu_native.int8_variant(rows, self.in_features) if self._native_ok() else "op"

    def run(self, x: torch.Tensor, variant: str) -> torch.Tensor:
        # x: [M, K] -> [M, N] compute dtype, before the zero-point offset and the bias
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features), dtype=self.compute_dtype)
        if variant in cpu_act_int8.INT8_VARIANTS:
            return cpu_act_int8.int8_q8_gemv(self.native, x, self.weight, self.scales_f32, variant
                                             ).to(self.compute_dtype)
        prefetch = cpu_native.INT8_GEMV_VARIANTS.get(variant)
        if self.table_layout and variant != "dequant":
            if prefetch is None:
                raise ValueError(f"an int8 layer in the table layout has no {variant!r} variant (torch's op "
                                 "reads the plain layout)")
            return cpu_native.int8_table_gemv(self.native, x, self.weight, self.scales_f32, self.compute_dtype,
                                              prefetch)
        if prefetch is not None:
            return cpu_native.int8_gemv(self.native, x, self.weight, self.scales_f32, self.compute_dtype, prefetch)
        if variant == "dequant":
            return cpu_native.int8_dequant_gemm(self.native, x, self.weight, self.scales_f32, self.compute_dtype,
                                                self.table_layout)
        return torch._weight_int8pack_mm(x.to(self.compute_dtype).contiguous(), self.weight, self.scales)

    def decode_stamp(self, rows: int) -> tuple:
        """What `decode_call(rows)` was resolved from (Int4PackLinear.decode_stamp says why)."""
        buffers = self._buffers
        return (id(buffers["weight"]), id(buffers["scales_f32"]), id(buffers["offset"]), id(buffers["bias"]),
                self.int8_activations, self.row_invariant, self.table_layout, self.measured.get(row_bucket(rows)))

    def decode_call(self, rows: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`forward` for a decode forward of `rows` contiguous `dtype` rows, resolved once (as
        Int4PackLinear.decode_call): the matrix-vector kernel's native call (plain or table layout) and the
        same torch ops after it, so the same bits; None for the other variants."""
        if not self._native_ok() or dtype != torch.bfloat16 or self.act_dtype != dtype or rows < 1:
            return None
        prefetch = cpu_native.INT8_GEMV_VARIANTS.get(decode_variant(self, rows))
        if prefetch is None:
            return None
        distance = cpu_native.PREFETCH_BYTES if prefetch < 0 else prefetch
        fn = self.native.int8_table_gemv if self.table_layout else self.native.int8_gemv
        weight, scales, offset, bias = self.weight, self.scales_f32, self.offset, self.bias
        compute, act = self.compute_dtype, self.act_dtype

        def call(x: torch.Tensor) -> torch.Tensor:
            y = fn(x, weight, scales, distance).to(compute)
            if offset is not None:
                y = (y.float() + x.float().sum(dim=1, keepdim=True) * offset).to(act)
            else:
                y = y.to(act)
            return y if bias is None else y + bias

        return call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        y = run_rows(self, x)
        if self.offset is not None:
            y = (y.float() + x.float().sum(dim=1, keepdim=True) * self.offset).to(self.act_dtype)
        else:
            y = y.to(self.act_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class CpuInt8Kernel(QuantKernel):
    """torch._weight_int8pack_mm: one scale per output channel, any code width up to 8 bits."""

    name = "cpu-int8"
    TABLE_LAYOUT = True  # Int8Linear.use_table_layout where it pays (exact activations only)

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        reason = _unsupported_common(spec)
        if reason:
            return False, reason
        if spec.in_features % 16:
            # torch 2.13's bf16 path reads past the row end for other K (inf or a crash).
            return False, f"in_features {spec.in_features} not a multiple of 16"
        if spec.rows_per_group_gcd() != spec.in_features:
            return False, f"needs one group spanning K={spec.in_features} (per-channel), got group size {spec.group_size}"
        return True, ""

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        spec = weight.spec(act_dtype, "cpu")
        ok, reason = cls.can_implement(spec)
        if not ok:
            raise ValueError(f"{cls.name} cannot run this weight: {reason}")
        group = int(weight.g_idx[0])  # the only group in use
        scales = weight.scales[group].float()  # [N]
        zeros = weight.zero_points()[group].float()
        mid = 2 ** (weight.bits - 1)  # q - mid fits int8 for any width up to 8 bits
        q8 = (weight.qweight.t().to(torch.int16) - mid).to(torch.int8).contiguous()  # [N, K]
        offset = scales * (mid - zeros)  # zero for symmetric weights
        compute = _compute_dtype(act_dtype)
        module = Int8Linear(q8, scales.to(compute), None if bool((offset == 0).all()) else offset,
                            None if bias is None else bias.to(act_dtype), act_dtype, scales_f32=scales.contiguous())
        if cls.TABLE_LAYOUT:
            module.use_table_layout()
        return module



class CpuInt8Q8Kernel(CpuInt8Kernel):
    """The per-channel int8 layer (EETQ, the int8 head) with activations rounded to int8 per 32-wide
    block and integer dot products (llama.cpp's Q8_0 x Q8_0; kernels/cpu_act_int8.py): a policy,
    `--cpu-int8-activations`."""

    name = "cpu-int8-q8"
    TABLE_LAYOUT = False  # its integer kernel reads the plain codes

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, reason = super().can_implement(spec)
        if not ok:
            return ok, reason
        refusal = _int8_activation_refusal(spec, "int8")
        if refusal:
            return False, refusal
        if spec.in_features % cpu_act_int8.BLOCK:
            return False, f"in_features {spec.in_features} not a multiple of {cpu_act_int8.BLOCK}"
        return True, ""

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        module = super().build(weight, bias, act_dtype)
        module.use_int8_activations()
        return module
