"""The fp8 KV cache's arithmetic: how a key or value becomes a byte and back.

A cached number is fp8(x / scale), rounded to nearest (even) and saturated at the format's
largest finite value (e4m3fn: 448, e5m2: 57344), and reads back as fp8 * scale. The scale is
per layer, or per KV head where the checkpoint calibrated one per head ([kv_heads] float32;
a latent cache has one "head"). Saturating rather than overflowing matches vLLM and TGI: one
outlier key must not become inf (e5m2) or NaN (e4m3fn has no inf) and poison every softmax that
reads it.

`KVScales` holds one layer's two scales; every attention path calls `quantize` on write and
`dequantize` on read through it, so the torch path, the Triton kernels (which fold the same
scales into their scores and outputs) and the tests agree on one definition.

The Triton kernels read the cache as bytes (`as_bytes`) and widen them to float16 with integer
operations (`FP8_FORMATS` names the codes): an e5m2 byte is the high byte of the float16 of the
same value; an e4m3fn byte, moved into a float16's sign, exponent and mantissa fields, reads as
its value / 256 (subnormals included), so the kernels multiply the 256 back into the scale. This
needs no hardware fp8 conversion (sm80 has none for e4m3) and runs in Triton's interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Names as TGI's --kv-cache-dtype spells them -> torch dtypes.
FP8_KV_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# The kernels' FP8 constexpr: 0 for a 16/32-bit cache.
FP8_FORMATS: dict[torch.dtype, int] = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# What the kernels' float16 reading of a byte must be multiplied by (module docstring).
FP8_WIDEN_FACTOR: dict[torch.dtype, float] = {torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 1.0}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_FORMATS


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [..., heads, dim] -> fp8(x / scale) saturated; scale [heads] float32 (None: 1.0)."""
    limit = fp8_max(dtype)
    if scale is None:
        return x.clamp(-limit, limit).to(dtype)
    return (x.float() / scale[:, None]).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp8 x [..., heads, dim] -> x * scale in `dtype` (None: 1.0, a plain conversion)."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale[:, None]).to(dtype)


def check_kernel_scales(name: str, cache_dtype: torch.dtype, kv_scales: "KVScales | None", kv_heads: int,
                        device: torch.device) -> None:
    """A kernel launch's rule: an fp8 cache, and only one, comes with its layer's scales, one per KV
    head, contiguous on the cache's device; raises ValueError naming the launcher."""
    if not is_fp8(cache_dtype):
        if kv_scales is not None:
            raise ValueError(f"{name}: kv_scales given for a {cache_dtype} cache (they are for fp8 caches)")
        return
    if kv_scales is None or kv_scales.dtype != cache_dtype:
        raise ValueError(f"{name}: a {cache_dtype} cache needs kv_scales of that dtype, got "
                         f"{None if kv_scales is None else kv_scales.dtype}")
    for which, t in (("key", kv_scales.key), ("value", kv_scales.value)):
        if t.shape != (kv_heads,) or t.device != device or not t.is_contiguous():
            raise ValueError(f"{name}: kv_scales.{which} must be contiguous float32 [{kv_heads}] on {device}, got "
                             f"{list(t.shape)} on {t.device}")


def kernel_cache_args(key_cache: torch.Tensor, value_cache: torch.Tensor, kv_scales: "KVScales | None",
                      dummy: torch.Tensor) -> tuple:
    """(key cache, value cache, key scales, value scales, FP8 code) as the kernels take them: an
    fp8 cache as bytes, a 16/32-bit cache as it is (its scale pointers unused: `dummy`)."""
    if kv_scales is None:
        return key_cache, value_cache, dummy, dummy, 0
    return as_bytes(key_cache), as_bytes(value_cache), kv_scales.key, kv_scales.value, FP8_FORMATS[kv_scales.dtype]


def widen(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """fp8 x in `dtype`, divided by the factor also returned, for callers that fold it into their
    scales. On CPU e4m3fn -> float32 goes through the float16 reading (module docstring) by integer
    operations, about twice as fast as torch's conversion (benchmarks/kv_cache_fp8.py); exact."""
    if x.device.type == "cpu" and x.dtype == torch.float8_e4m3fn and dtype == torch.float32:
        b = x.view(torch.uint8).to(torch.int16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).view(torch.float16).float(), FP8_WIDEN_FACTOR[x.dtype]
    return x.to(dtype), 1.0


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The same storage seen as uint8 (what the Triton kernels load); strides are unchanged."""
    return cache.view(torch.uint8)


@dataclass(frozen=True)
class KVScales:
    """One layer's fp8 cache: its dtype and its key and value scales, [kv_heads] float32 on the
    cache's device (a latent cache: [1], `value` unused). `unit`: every scale is exactly 1.0,
    known at load, so the torch path skips the multiply (no device sync to find out)."""

    dtype: torch.dtype
    key: torch.Tensor
    value: torch.Tensor
    unit: bool = False

    def __post_init__(self) -> None:
        if not is_fp8(self.dtype):
            raise ValueError(f"KVScales is for fp8 caches, got {self.dtype}")
        for name, t in (("key", self.key), ("value", self.value)):
            if t.dim() != 1 or t.dtype != torch.float32:
                raise ValueError(f"KVScales.{name} must be a 1-D float32 tensor (one per KV head), got "
                                 f"{t.dtype} {list(t.shape)}")

    @classmethod
    def ones(cls, dtype: torch.dtype, heads: int, device: torch.device) -> "KVScales":
        one = torch.ones(heads, dtype=torch.float32, device=device)
        return cls(dtype, one, one, unit=True)

    def _scale(self, which: str) -> torch.Tensor | None:
        return None if self.unit else (self.key if which == "key" else self.value)

    def quantize(self, x: torch.Tensor, which: str) -> torch.Tensor:
        return quantize(x, self._scale(which), self.dtype)

    def dequantize(self, x: torch.Tensor, which: str, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(x, self._scale(which), dtype)

    def roundtrip(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """What reading x back from the cache gives, in x's dtype: attention over tokens this
        forward just stored sees the same numbers as attention over them later (a prompt gets
        the same bits computed whole, in chunks, or after a cached prefix)."""
        return self.dequantize(self.quantize(x, which), which, x.dtype)
