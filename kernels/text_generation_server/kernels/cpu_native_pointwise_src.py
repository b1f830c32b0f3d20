"""C++ source of the fused pointwise ops of a bfloat16 decoder layer on the CPU (built with cpu_native's).

Why: at one decode row a Qwen2.5-1.5B layer ran ~25 small torch ops besides its linears and its
attention (the RMSNorm alone is four: to float32, rms_norm, back, times the weight), each a few
microseconds of dispatch and allocation for 1536 numbers, ~2 ms of a single-stream step on the
2-core EPYC (BENCHMARKS.md, issue #32, fourth round). One call each here, in torch's roundings
(layers/norm.py, layers/rotary.py and layers/mlp.py say which; the tests compare with them):

- `rms_norm_bf16(x, weight, eps, residual)`: Llama's RMSNorm, weight * bf16(x * rsqrt(mean(x^2) +
  eps)) with x in float32 and the product rounded to bfloat16; with a residual, x + residual is
  rounded to bfloat16 first and returned too (the post-attention add). The mean's sum runs in
  16 float32 lanes, then the lanes in a fixed order (torch's own order is its vectorised one: a
  scale one float32 ulp apart, rarely a bfloat16 apart after the product's rounding).
- `rotary_bf16(x, cos, sin)`: one rotation (q or k) in place of torch's four calls:
  bf16(bf16(x * cos) + partner(x) * sin) over the rotate-half layout (`sin` carries the sign, as
  RotaryEmbedding.cos_sin makes it). bfloat16 products are exact in float32, so this is torch's
  `addcmul(x * cos, partner, sin)` bit for bit.
- `silu_mul_bf16(gate_up, n)`: bf16(bf16(silu(g)) * u) over the [g | u] halves of gate_up,
  silu(g) = g / (1 + exp(-g)) in float32 (`exp16` below and torch's Sleef exp differ in the last
  float32 bit or two, rarely a bfloat16 apart after the rounding).

Every row is computed alone (no reduction across rows), one thread per row block.

float32 forms (a float32 model's decode, serve's CPU default; the embedded model's step ran ~60
small torch ops a step around its linears, BENCHMARKS.md session 7), in the float32 path's own
arithmetic:
- `rotary_f32`: addcmul(x * cos, partner, sin): x * cos rounded, then one fused multiply-add of
  partner * sin onto it, as torch's addcmul kernel computes it: torch's bits.
- `silu_mul_f32`: silu(g) * u with silu(g) = g / (1 + exp(-g)) and exp the same SLEEF routine
  torch's vectorised silu calls at AVX-512 and AVX2 (exported by libtorch_cpu): torch's bits
  there; elsewhere `exp16` (a float32 ulp or two apart).
- `rms_norm_f32`: x * rsqrt(mean(x^2) + eps) * weight, with the residual add (x + residual, one
  rounding, returned too). The only one not bit for bit: torch's mean sums in its own cascade
  order, this in 16 lanes then a tree (the scale a float32 ulp apart in about half the rows); the
  exactness tests against transformers judge it (tests/test_cpu_pointwise_f32.py says how far).
- `argmax_f32`: torch.argmax over each row of float32 logits (first maximal index, NaN first), for a
  greedy step's choice (generation/sampling.py `greedy_choice`): the same index, ~10x sooner.
"""

SOURCE = r"""
namespace tgs_pointwise {

inline float bf(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf(float f) {  // round to nearest even, NaN kept a NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// One head's rotate-half rotation in bfloat16: bf16(bf16(x * cos) + partner(x) * sin), `sin` signed.
// rotary_bf16 and the fused decode step (cpu_native_decode_src.py) both call it, so their bits agree.
inline void rotate_head_bf16(const uint16_t* xp, const uint16_t* cp, const uint16_t* sp, uint16_t* op, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t p = d < half ? d + half : d - half;
    const float xc = bf(to_bf(bf(xp[d]) * bf(cp[d])));
    op[d] = to_bf(xc + bf(xp[p]) * bf(sp[d]));
  }
}

// exp over 16 float32 lanes: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in two parts, p Cephes'
// degree-7 polynomial for expf (about 1 float32 ulp; the constants are the published ones). Past
// [-87.3, 88.37] the result is 0 or inf (denormal results are flushed to 0: no bfloat16 softmax
// weight or silu here tells them apart).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// AVX2: the same operations on 8-float halves by intrinsics. GCC 12 lowered the generic form's
// lane selects (the range clamps, `?:` on 16-float vectors) to scalar compares and moves, one lane at
// a time: silu * up took 54 us a call on the AVX2 build against 12 at AVX-512 (Qwen2.5-1.5B's 8960
// features; BENCHMARKS.md, issue #32 session 11). The multiply-adds are fused where the AVX-512
// build's contraction fuses them (x * log2(e) + magic, the two r - n * c steps, the polynomial's
// p * r + c, and (p * r) * r + r), so both builds give the same bits (tests/test_cpu_isa.py).
inline __m256 exp8_avx2(__m256 x0) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
  const __m256 above = _mm256_cmp_ps(x0, hi, _CMP_GT_OQ), below = _mm256_cmp_ps(x0, lo, _CMP_LT_OQ);
  __m256 x = _mm256_blendv_ps(x0, hi, above);
  x = _mm256_blendv_ps(x, lo, _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  p = _mm256_blendv_ps(p, _mm256_set1_ps(__builtin_inff()), above);
  return _mm256_blendv_ps(p, _mm256_setzero_ps(), below);
}
inline vf exp16(vf x0) {
  __m256 lo, hi;
  std::memcpy(&lo, &x0, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x0) + 32, 32);
  lo = exp8_avx2(lo);
  hi = exp8_avx2(hi);
  vf r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
#else
inline vf exp16(vf x0) {
  const vf hi = splat(88.3762626647949f), lo = splat(-87.3365447504f);
  vf x = x0 > hi ? hi : x0;
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * splat(1.44269504088896341f) + magic) - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500E-4f);
  p = p * r + splat(1.3981999507E-3f);
  p = p * r + splat(8.3334519073E-3f);
  p = p * r + splat(4.1665795894E-2f);
  p = p * r + splat(1.6666665459E-1f);
  p = p * r + splat(5.0000001201E-1f);
  p = p * r * r + r + splat(1.f);
  vi32 e = (__builtin_convertvector(n, vi32) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  p = p * scale;
  p = x0 > hi ? splat(__builtin_inff()) : p;  // past float32's range: inf and 0, as expf gives
  return x0 < lo ? splat(0.f) : p;
}
#endif

// 16 floats rounded to bfloat16 as to_bf rounds each (nearest even, a NaN kept a quiet NaN): their bits
// in the low halves of the lanes, or (bf16_round) the rounded values as floats. Exact integer steps,
// so the same bits as to_bf lane by lane on every build; a loop over them is a few instructions a
// vector where to_bf's branch kept the compiler to one value at a time.
inline vu32 usplat(uint32_t v) { return vu32{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: to_bf's bits for 8 floats, in each 32-bit lane, by intrinsics: GCC 12 lowers a compare or `?:`
// of 16-lane vectors lane by lane (scalar compares and moves) where the target's vectors are narrower.
// A signed compare (AVX2 has no unsigned one) of the non-negative masked bits: the same answer.
inline __m256i bf_round_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
#endif
inline vu32 to_bf_bits(vf v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m256 halves[2];
  std::memcpy(halves, &v, 64);
  const __m256i bits[2] = {bf_round_avx2(halves[0]), bf_round_avx2(halves[1])};
  vu32 out;
  std::memcpy(&out, bits, 64);
  return out;
#else
  vu32 u;
  std::memcpy(&u, &v, sizeof(u));
  const vu32 rounded = (u + usplat(0x7FFFu) + ((u >> 16) & usplat(1u))) >> 16;
  const vu32 quiet = (u >> 16) | usplat(0x40u);
  return (u & usplat(0x7FFFFFFFu)) > usplat(0x7F800000u) ? quiet : rounded;
#endif
}
inline vf bf16_round(vf v) {
  const vu32 b = to_bf_bits(v) << 16;
  vf r;
  std::memcpy(&r, &b, sizeof(r));
  return r;
}
inline void store_bf_bits(uint16_t* dst, vu32 b) {
  const vu16 h = __builtin_convertvector(b, vu16);
  std::memcpy(dst, &h, sizeof(h));
}

inline float exp1(float x) {  // the same arithmetic for one value (tails)
  float lanes[16];
  for (int i = 0; i < 16; ++i) lanes[i] = x;
  vf v;
  std::memcpy(&v, lanes, sizeof(v));
  v = exp16(v);
  std::memcpy(lanes, &v, sizeof(v));
  return lanes[0];
}

inline const uint16_t* cbits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
inline uint16_t* bits(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kBFloat16 && t.stride(1) == 1,
              name, " must be bfloat16 [rows, features] with unit feature stride, got ", t.sizes(), " ",
              t.scalar_type());
}

}  // namespace tgs_pointwise

std::vector<torch::Tensor> rms_norm_bf16(torch::Tensor x, torch::Tensor weight, double eps,
                                         c10::optional<torch::Tensor> residual) {
  using namespace tgs_pointwise;
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == torch::kBFloat16
              && weight.is_contiguous(), "weight must be contiguous bfloat16 [", n, "]");
  const bool add = residual.has_value();
  torch::Tensor res;
  if (add) {
    res = *residual;
    check_rows(res, "residual");
    TORCH_CHECK(res.sizes() == x.sizes(), "residual ", res.sizes(), " must match x ", x.sizes());
  }
  auto normed = torch::empty({rows, n}, x.options());
  auto summed = add ? torch::empty({rows, n}, x.options()) : torch::Tensor();
  const uint16_t* wp = cbits(weight);
  tgs::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> h(n);
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xp = cbits(x) + r * x.stride(0);
      if (add) {
        const uint16_t* rp = cbits(res) + r * res.stride(0);
        uint16_t* sp = bits(summed) + r * n;
        for (int64_t i = 0; i < n; ++i) {
          sp[i] = to_bf(bf(xp[i]) + bf(rp[i]));
          h[i] = bf(sp[i]);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) h[i] = bf(xp[i]);
      }
      float lanes[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) lanes[j] += h[i + j] * h[i + j];
      for (int64_t j = 0; i + j < n; ++j) lanes[j] += h[i + j] * h[i + j];
      for (int j = 0; j < 8; ++j) lanes[j] += lanes[j + 8];
      for (int j = 0; j < 4; ++j) lanes[j] += lanes[j + 4];
      const float sum = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
      const float scale = 1.f / std::sqrt(sum / float(n) + float(eps));
      uint16_t* op = bits(normed) + r * n;
      for (int64_t k = 0; k < n; ++k) op[k] = to_bf(bf(wp[k]) * bf(to_bf(h[k] * scale)));
    }
  });
  if (add) return {normed, summed};
  return {normed};
}

torch::Tensor rotary_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  using namespace tgs_pointwise;
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kBFloat16, "x must be bfloat16 [tokens, heads, head_dim]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && x.stride(2) == 1 && x.stride(1) == D, "x must have contiguous heads of an even head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == T && cos.size(2) == D
              && cos.scalar_type() == torch::kBFloat16 && sin.scalar_type() == torch::kBFloat16
              && cos.stride(2) == 1 && sin.stride(2) == 1, "cos and sin must be bfloat16 [tokens, 1, head_dim]");
  (void)half;
  auto o = torch::empty({T, H, D}, x.options());
  tgs::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* cp = cbits(cos) + t * cos.stride(0);
      const uint16_t* sp = cbits(sin) + t * sin.stride(0);
      for (int64_t h = 0; h < H; ++h)
        rotate_head_bf16(cbits(x) + t * x.stride(0) + h * D, cp, sp, bits(o) + (t * H + h) * D, D);
    }
  });
  return o;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
namespace tgs_pointwise {
// AVX2: silu * up for 8 values in 8-float registers, the 16-lane loop's operations lane for lane
// (exp8_avx2 is exp16's arithmetic; bf_round_avx2 to_bf_bits' rounding and NaN test), so the same bits.
// The 16-lane form went through the stack between its two halves on every call of exp16 and the
// rounding (GCC 12 moves a 64-byte vector to and from two ymm registers by 64-bit pieces). Returns
// the 8 bfloat16 results in the low 128 bits.
inline __m256 bf8_avx2(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256i silu_mul_avx2(const uint16_t* g, const uint16_t* u) {
  const __m256 x = bf8_avx2(g);
  const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8_avx2(_mm256_xor_ps(x, _mm256_set1_ps(-0.f)))));
  const __m256 sr = _mm256_castsi256_ps(_mm256_slli_epi32(bf_round_avx2(s), 16));
  const __m256i b = bf_round_avx2(_mm256_mul_ps(sr, bf8_avx2(u)));
  // 8 x 32-bit lanes (each < 2^16) to 8 x 16 bits in order: pack within 128-bit halves, then gather them
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
}
}  // namespace tgs_pointwise
#endif

torch::Tensor silu_mul_bf16(torch::Tensor gate_up, int64_t n) {
  using namespace tgs_pointwise;
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) == 2 * n, "gate_up must be [rows, 2 * ", n, "], got ", gate_up.sizes());
  const int64_t rows = gate_up.size(0);
  auto out = torch::empty({rows, n}, gate_up.options());
  tgs::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* g = cbits(gate_up) + r * gate_up.stride(0);
      const uint16_t* u = g + n;
      uint16_t* o = bits(out) + r * n;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
      for (; i + 8 <= n; i += 8) {  // the same arithmetic in 8-lane registers (silu_avx2)
        const __m128i h = _mm256_castsi256_si128(silu_mul_avx2(g + i, u + i));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), h);
      }
#endif
      for (; i + 16 <= n; i += 16) {  // bf16(bf16(s) * u), to_bf's rounding 16 lanes at a time
        const vf x = load_bf16(g + i);
        const vf s = x / (splat(1.f) + exp16(-x));
        store_bf_bits(o + i, to_bf_bits(bf16_round(s) * load_bf16(u + i)));
      }
      for (; i < n; ++i) {
        const float x = bf(g[i]);
        const float s = bf(to_bf(x / (1.f + exp1(-x))));
        o[i] = to_bf(s * bf(u[i]));
      }
    }
  });
  return out;
}

// ---- float32 ---------------------------------------------------------------------------------------
#if defined(__AVX512F__) || defined(__AVX2__)
#include <sleef.h>
#endif

namespace tgs_pointwise {

// torch's vectorised exp for float32 at this build's instruction set (SLEEF, from libtorch_cpu).
inline vf exp16_torch(vf x) {
#if defined(__AVX512F__)
  __m512 v; std::memcpy(&v, &x, 64);
  v = Sleef_expf16_u10(v);
  vf r; std::memcpy(&r, &v, 64); return r;
#elif defined(__AVX2__)
  __m256 lo, hi; std::memcpy(&lo, &x, 32); std::memcpy(&hi, reinterpret_cast<const char*>(&x) + 32, 32);
  lo = Sleef_expf8_u10(lo); hi = Sleef_expf8_u10(hi);
  vf r; std::memcpy(&r, &lo, 32); std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32); return r;
#else
  return exp16(x);
#endif
}

void check_rows_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat && t.stride(1) == 1,
              name, " must be float32 [rows, features] with unit feature stride, got ", t.sizes(), " ",
              t.scalar_type());
}

}  // namespace tgs_pointwise

std::vector<torch::Tensor> rms_norm_f32(torch::Tensor x, torch::Tensor weight, double eps,
                                        c10::optional<torch::Tensor> residual) {
  using namespace tgs_pointwise;
  check_rows_f32(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == torch::kFloat
              && weight.is_contiguous(), "weight must be contiguous float32 [", n, "]");
  const bool add = residual.has_value();
  torch::Tensor res;
  if (add) {
    res = *residual;
    check_rows_f32(res, "residual");
    TORCH_CHECK(res.sizes() == x.sizes(), "residual ", res.sizes(), " must match x ", x.sizes());
  }
  auto normed = torch::empty({rows, n}, x.options());
  auto summed = add ? torch::empty({rows, n}, x.options()) : torch::Tensor();
  const float* wp = weight.data_ptr<float>();
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* h = x.data_ptr<float>() + r * x.stride(0);
      if (add) {
        const float* rp = res.data_ptr<float>() + r * res.stride(0);
        float* sp = summed.data_ptr<float>() + r * n;
        for (int64_t i = 0; i < n; ++i) sp[i] = h[i] + rp[i];
        h = sp;
      }
      float lanes[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) lanes[j] += h[i + j] * h[i + j];
      for (int64_t j = 0; i + j < n; ++j) lanes[j] += h[i + j] * h[i + j];
      for (int j = 0; j < 8; ++j) lanes[j] += lanes[j + 8];
      for (int j = 0; j < 4; ++j) lanes[j] += lanes[j + 4];
      const float sum = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
      const float scale = 1.f / std::sqrt(sum / float(n) + float(eps));
      float* op = normed.data_ptr<float>() + r * n;
      for (int64_t k = 0; k < n; ++k) op[k] = (h[k] * scale) * wp[k];
    }
  };
  if (rows > 1) tgs::parallel_for(0, rows, 16, body);  // one row: no fork of the pool
  else body(0, rows);
  if (add) return {normed, summed};
  return {normed};
}

namespace tgs_pointwise {
// The inputs of a fused decode step (rotary_store_f32 here, decode_attention_bf16 in
// cpu_native_decode_src.py) checked by name: qkv [T, (H + 2 KVH) * D] with contiguous rows, the caches
// [blocks, block_size, KVH, D] contiguous, cos and sin [T, 1, D], every slot inside the cache; all of
// `dtype`. Returns the slots, contiguous.
inline torch::Tensor checked_decode_inputs(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                           const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                                           const torch::Tensor& slots, int64_t H, int64_t KVH,
                                           torch::ScalarType dtype, const char* name) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == dtype && qkv.stride(1) == 1,
              "qkv must be ", name, " [tokens, (H + 2 KVH) * D] with contiguous rows, got ", qkv.sizes());
  TORCH_CHECK(H > 0 && KVH > 0 && H % KVH == 0, "query heads ", H, " must be a multiple of the KV heads ", KVH);
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes()
              && value_cache.is_contiguous() && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "caches must be contiguous ", name, " [blocks, block_size, KVH, D] of one shape");
  const int64_t T = qkv.size(0), D = key_cache.size(3);
  TORCH_CHECK(key_cache.size(2) == KVH, "the cache holds ", key_cache.size(2), " KV heads, not ", KVH);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && D % 2 == 0, "qkv has ", qkv.size(1), " columns, expected (",
              H, " + 2 x ", KVH, ") x ", D, " (an even head_dim)");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == T && cos.size(2) == D
              && cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.stride(2) == 1 && sin.stride(2) == 1,
              "cos and sin must be ", name, " [tokens, 1, head_dim]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == torch::kLong,
              "slots must be int64 [tokens]");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t capacity = key_cache.size(0) * key_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= sp[t] && sp[t] < capacity, "row ", t, ": slot ", sp[t], " outside the cache's ", capacity);
  return sl;
}

// Rows t0..t1 of the float32 rotation as torch rounds it: x * cos rounded, then addcmul's one fused
// multiply-add of partner * sin onto it (measured against torch 2.x on AVX-512; no other FMA
// contraction in this function, whatever -march allows).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotary_f32_rows(const float* xb, const float* cb, const float* sb, float* ob, int64_t t0, int64_t t1,
                     int64_t H, int64_t D, int64_t xs, int64_t cs, int64_t ss) {
  const int64_t half = D / 2;
  for (int64_t t = t0; t < t1; ++t) {
    const float* cp = cb + t * cs;
    const float* sp = sb + t * ss;
    for (int64_t h = 0; h < H; ++h) {
      const float* xp = xb + t * xs + h * D;
      float* op = ob + (t * H + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const int64_t p = d < half ? d + half : d - half;
        const float xc = xp[d] * cp[d];
        op[d] = __builtin_fmaf(xp[p], sp[d], xc);
      }
    }
  }
}
#pragma GCC pop_options
}  // namespace tgs_pointwise

torch::Tensor rotary_f32(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat, "x must be float32 [tokens, heads, head_dim]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && x.stride(2) == 1 && x.stride(1) == D, "x must have contiguous heads of an even head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == T && cos.size(2) == D
              && cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat
              && cos.stride(2) == 1 && sin.stride(2) == 1, "cos and sin must be float32 [tokens, 1, head_dim]");
  auto o = torch::empty({T, H, D}, x.options());
  const float* xb = x.data_ptr<float>();
  const float* cb = cos.data_ptr<float>();
  const float* sb = sin.data_ptr<float>();
  float* ob = o.data_ptr<float>();
  auto body = [&](int64_t t0, int64_t t1) {
    tgs_pointwise::rotary_f32_rows(xb, cb, sb, ob, t0, t1, H, D, x.stride(0), cos.stride(0), sin.stride(0));
  };
  if (T > 1) tgs::parallel_for(0, T, 16, body);
  else body(0, T);
  return o;
}

// A float32 decode step's rotary and K/V store in one call: q and k of qkv [T, (H + 2 KVH) * D] rotated
// by rotary_f32_rows (rotary_f32's own arithmetic), k and v written to their cache slots; returns q
// [T, H, D]. The same bits as rotary_f32 twice and the two index_copy_ calls it replaces.
torch::Tensor rotary_store_f32(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor key_cache,
                               torch::Tensor value_cache, torch::Tensor slots, int64_t H, int64_t KVH) {
  auto sl = tgs_pointwise::checked_decode_inputs(qkv, cos, sin, key_cache, value_cache, slots, H, KVH,
                                                 torch::kFloat, "float32");
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t T = qkv.size(0), D = key_cache.size(3);
  auto q = torch::empty({T, H, D}, qkv.options());
  const float* base = qkv.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {  // a few heads a row: too little to split
    const float* row = base + t * qkv.stride(0);
    const float* c = cos.data_ptr<float>() + t * cos.stride(0);
    const float* s = sin.data_ptr<float>() + t * sin.stride(0);
    tgs_pointwise::rotary_f32_rows(row, c, s, q.data_ptr<float>() + t * H * D, 0, 1, H, D, 0, 0, 0);
    tgs_pointwise::rotary_f32_rows(row + H * D, c, s, kc + sp[t] * KVH * D, 0, 1, KVH, D, 0, 0, 0);
    std::memcpy(vc + sp[t] * KVH * D, row + (H + KVH) * D, KVH * D * sizeof(float));
  }
  return q;
}

// Each row's argmax as torch.argmax gives it: the first index of the largest value (-0 equal to +0), or
// of the first NaN where the row has one. A greedy step's choice over a 151936-word vocabulary took
// torch's reduction ~130 us on the 2-core EPYC; this reads the row about 1.5 times, 16 lanes at a time.
torch::Tensor argmax_f32(torch::Tensor x) {
  using namespace tgs_pointwise;
  check_rows_f32(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "argmax over an empty row");
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const float* base = x.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {  // one row a step at c=1: too little to split
    const float* p = base + r * x.stride(0);
    const int64_t n16 = n - n % 16;
    float m = -__builtin_inff();
    bool nan = false;
    if (n16 > 0) {
      vf acc = splat(-__builtin_inff());
      vi32 nans = __builtin_convertvector(splat(0.f), vi32);
      for (int64_t i = 0; i < n16; i += 16) {
        const vf v = load_f(p + i);
        acc = v > acc ? v : acc;  // a NaN never enters (its comparisons are false)
        nans |= v != v;
      }
      for (int j = 0; j < 16; ++j) {
        nan = nan || nans[j] != 0;
        m = acc[j] > m ? acc[j] : m;
      }
    }
    for (int64_t i = n16; i < n; ++i) {
      nan = nan || p[i] != p[i];
      m = p[i] > m ? p[i] : m;
    }
    int64_t found = 0;
    if (nan) {
      while (p[found] == p[found]) ++found;
    } else {
      int64_t i = 0;
      for (; i < n16; i += 16) {  // the first chunk holding the maximum, then its first lane
        const vi32 hit = load_f(p + i) == splat(m);
        bool any = false;
        for (int j = 0; j < 16; ++j) any = any || hit[j] != 0;
        if (any) break;
      }
      while (p[i] != m) ++i;
      found = i;
    }
    op[r] = found;
  }
  return out;
}

torch::Tensor silu_mul_f32(torch::Tensor gate_up, int64_t n) {
  using namespace tgs_pointwise;
  check_rows_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) == 2 * n, "gate_up must be [rows, 2 * ", n, "], got ", gate_up.sizes());
  const int64_t rows = gate_up.size(0);
  auto out = torch::empty({rows, n}, gate_up.options());
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
      const float* u = g + n;
      float* o = out.data_ptr<float>() + r * n;
      // torch's vectorised loop takes two of its vectors at a time (32 floats at AVX-512, 16 at AVX2)
      // and the rest one by one, with std::exp.
#if defined(__AVX512F__)
      const int64_t vectors = n / 32 * 32;
#else
      const int64_t vectors = n / 16 * 16;
#endif
      int64_t i = 0;
      for (; i < vectors; i += 16) {
        const vf xv = load_f(g + i);
        const vf s = xv / (splat(1.f) + exp16_torch(-xv));
        const vf y = s * load_f(u + i);
        std::memcpy(o + i, &y, sizeof(y));
      }
      for (; i < n; ++i) {
        const float s = g[i] / (1.f + std::exp(-g[i]));
        o[i] = s * u[i];
      }
    }
  };
  if (rows > 1) tgs::parallel_for(0, rows, 4, body);
  else body(0, rows);
  return out;
}
"""

FUNCTIONS = ["rms_norm_bf16", "rotary_bf16", "silu_mul_bf16", "rms_norm_f32", "rotary_f32", "silu_mul_f32",
             "rotary_store_f32", "argmax_f32"]


def with_pointwise_kernels(source: str, functions: list[str]) -> tuple[str, list[str]]:
    """cpu_native's source and function list with these ops added (one extension, one build)."""
    return source + SOURCE, [*functions, *FUNCTIONS]
