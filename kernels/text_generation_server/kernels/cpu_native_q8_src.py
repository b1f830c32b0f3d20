"""C++ source of the int4 and int8 kernels with int8 activations (`int4_q8_mm`, `int8_q8_gemv`), and of the
exact int8 kernel over codes rearranged at load (`int8_table_gemv`, its section below), part of
cpu_native_src.SOURCE.

The scheme is llama.cpp's Q8_0 activations (its quantize_row_q8_0 and Q4 x Q8 dot products, read for
the arithmetic, not copied): each activation row is cut into 32-wide blocks, each block scaled by
d = max|x| / 127 and rounded to int8 (q = round-half-even(x * (1 / d))), and the weight codes are
multiplied by those int8 values in integer arithmetic (AVX512-VNNI `vpdpbusd`: four unsigned 4-bit
codes times four signed int8 values per 32-bit lane, per instruction). Our scales stay float32
(llama.cpp stores float16 ones) and the weights stay in torch's packed int4 layout, read in place.

The arithmetic, the same in every build (and in cpu_act_int8.reference, the torch form the tests use):
for output n of row m, per 32-wide block b: i_b = sum_k q[k, n] * xq[m, k] (int32, exact); per group
g: t_g = fma over the group's blocks in order of dx_b * float(i_b), starting from 0; then
y = fma(t_g, s[g, n], y) and y = fma(xs_g, c[g, n], y) in group order, where xs_g = the group's sum
of dx_b * float(sum_k xq[m, k]) and c = z - 8 s (so W = q * s + c). Every step is exact integer
arithmetic or one IEEE fused multiply-add, so the AVX512-VNNI build, the AVX2 one (`vpmaddubsw` +
`vpmaddwd`: products of one 4-bit code and one int8 value never saturate int16) and the generic one
give the same bits, and a row's bits do not depend on the rows beside it, the rows per pass, the
prefetch distance or the thread split.
"""

SOURCE = r"""
namespace {

// ---- int4 codes x int8 activations ---------------------------------------------------------------
constexpr int64_t Q8_BLOCK = 32;

// An activation as float32: float32 as it is, bfloat16 bits widened (exactly).
inline float q8_in(const float* x, int64_t i) { return x[i]; }
inline float q8_in(const uint16_t* x, int64_t i) {
  const uint32_t u = uint32_t(x[i]) << 16;
  float f; std::memcpy(&f, &u, 4); return f;
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 q8_load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 q8_load16(const uint16_t* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
#endif

// One 32-wide block: dst = round-half-even(src * (1 / d)), d = max|src| / 127; returns d, *sum = the codes' sum.
// The AVX-512 form is the scalar one's steps (the max ignores NaN as std::max does, vcvtps2dq rounds half
// to even as nearbyint does in the default mode, int8 codes by truncation as the int8_t cast): the same bits.
template <typename T>
inline float q8_block_quantize(const T* src, int8_t* dst, int32_t* sum) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512 v0 = q8_load16(src), v1 = q8_load16(src + 16);
  __m512 m = _mm512_setzero_ps();
  m = _mm512_max_ps(_mm512_and_ps(v0, sign), m);  // a NaN operand yields the second: m
  m = _mm512_max_ps(_mm512_and_ps(v1, sign), m);
  const float amax = _mm512_reduce_max_ps(m);
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m512 idv = _mm512_set1_ps(id);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(q1));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  return d;
#else
  float amax = 0.f;
  for (int j = 0; j < Q8_BLOCK; ++j) amax = std::max(amax, std::fabs(q8_in(src, j)));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int32_t total = 0;
  for (int j = 0; j < Q8_BLOCK; ++j) {
    const int32_t q = int32_t(std::nearbyint(q8_in(src, j) * id));  // round half to even (default mode)
    dst[j] = int8_t(q);
    total += q;
  }
  *sum = total;
  return d;
#endif
}

// x [M, K] float32 or bfloat16 -> xq int8 [M, K], dx float32 [M, K / 32], xs float32 [M, K / gs] (see the header).
template <typename T>
void q8_quantize(const T* x, int8_t* xq, float* dx, float* xs, int64_t M, int64_t K, int64_t gs) {
  const int64_t nblk = K / Q8_BLOCK, per_group = gs / Q8_BLOCK;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nblk; ++b) {
      int32_t sum;
      const float d = q8_block_quantize(x + m * K + b * Q8_BLOCK, xq + m * K + b * Q8_BLOCK, &sum);
      dx[m * nblk + b] = d;
      if (b % per_group == 0) xs[m * (K / gs) + b / per_group] = 0.f;
      float& acc = xs[m * (K / gs) + b / per_group];
      acc = std::fma(d, float(sum), acc);
    }
  }
}

// Where the int4 x int8 kernels put a row's results: float32 y [M, N], or bfloat16 yh [M, N] rounded
// to nearest even as torch's .to(bfloat16) rounds, then (bias bfloat16 [N], optional) the bias added
// and rounded again, as torch's bfloat16 `y + bias` does: the bits of the torch ops it replaces.
struct Q8Out {
  float* y;
  uint16_t* yh;
  const uint16_t* bias;
  int64_t N;
};
inline uint16_t q8_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void q8_store1(const Q8Out& out, int64_t m, int64_t n, float v) {
  if (out.y) {
    out.y[m * out.N + n] = v;
    return;
  }
  uint16_t h = q8_bf16(v);
  if (out.bias) {
    const uint32_t a = uint32_t(h) << 16, b = uint32_t(out.bias[n]) << 16;
    float fa, fb; std::memcpy(&fa, &a, 4); std::memcpy(&fb, &b, 4);
    h = q8_bf16(fa + fb);
  }
  out.yh[m * out.N + n] = h;
}
inline void q8_store(const Q8Out& out, int64_t m, int64_t n0, const float* v, int count) {
  if (out.y) {
    std::memcpy(out.y + m * out.N + n0, v, count * sizeof(float));
    return;
  }
  for (int i = 0; i < count; ++i) q8_store1(out, m, n0 + i, v[i]);
}

// The products of one 4-input-row step ("quad": input rows k .. k + 3) for the block's outputs, as
// int32 lanes: acc[j] (outputs 16j .. 16j + 15) += sum over the quad of q * xq.
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define Q8_ISA 2
struct Q8Tables {
  alignas(64) uint8_t idx64[2][64];  // B = 64: bytes of outputs 16h + j of rows k..k+3 (from 128 bytes)
  alignas(64) uint8_t idx32[64];     // B = 32: bytes of outputs j of rows k..k+3 (from 64 bytes)
  Q8Tables() {
    for (int j = 0; j < 16; ++j)
      for (int t = 0; t < 4; ++t) {
        idx64[0][4 * j + t] = uint8_t(t * 32 + j);
        idx64[1][4 * j + t] = uint8_t(t * 32 + 16 + j);
        idx32[4 * j + t] = uint8_t(t * 16 + j);
      }
  }
};
static const Q8Tables Q8_TABLES;
typedef __m512i q8acc;
constexpr int Q8_LANES = 16;
inline q8acc q8_zero() { return _mm512_setzero_si512(); }
// The B / 16 code vectors of a quad: each 32-bit lane the four codes of one output, rows k..k+3.
template <int B>
inline void q8_codes(const uint8_t* p, __m512i* w) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  if (B == 64) {
    const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
    for (int h = 0; h < 2; ++h) {
      const __m512i both = _mm512_permutex2var_epi8(a, _mm512_load_si512(Q8_TABLES.idx64[h]), b);
      w[h] = _mm512_and_si512(both, nibble);
      w[2 + h] = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
    }
  } else {
    const __m512i both = _mm512_permutexvar_epi8(_mm512_load_si512(Q8_TABLES.idx32), _mm512_loadu_si512(p));
    w[0] = _mm512_and_si512(both, nibble);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
  }
}
typedef __m512i q8w;
inline q8acc q8_dot(q8acc acc, q8w w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
// t[j] = fma(dx, float(acc[j]), t[j]) for the 16 lanes of vector j, and the group's y update.
inline void q8_block_end(float* t, const q8acc* acc, int V, float dx) {
  const __m512 d = _mm512_set1_ps(dx);
  for (int j = 0; j < V; ++j)
    _mm512_storeu_ps(t + 16 * j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j]), d, _mm512_loadu_ps(t + 16 * j)));
}
inline void q8_group_end(float* yrow, const float* t, const float* s, const float* c, float xs, int64_t n0, int B) {
  const __m512 sum = _mm512_set1_ps(xs);
  for (int j = 0; j < B; j += 16) {
    __m512 acc = _mm512_loadu_ps(yrow + j);
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(t + j), _mm512_loadu_ps(s + n0 + j), acc);
    acc = _mm512_fmadd_ps(sum, _mm512_loadu_ps(c + n0 + j), acc);
    _mm512_storeu_ps(yrow + j, acc);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_ISA 1
typedef __m256i q8acc;  // 8 outputs
typedef __m256i q8w;
constexpr int Q8_LANES = 8;
inline q8acc q8_zero() { return _mm256_setzero_si256(); }
// The B / 8 code vectors of a quad, each 32-bit lane the four codes of one output (rows k..k+3):
// byte and word interleaves of the four rows' 16-byte chunks, then the nibbles.
template <int B>
inline void q8_codes(const uint8_t* p, __m256i* w) {
  constexpr int H = B / 32;  // 16-byte chunks per row
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < H; ++h) {
    __m128i r[4];
    for (int t = 0; t < 4; ++t) r[t] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + t * (B / 2) + 16 * h));
    const __m128i a = _mm_unpacklo_epi8(r[0], r[1]), b = _mm_unpacklo_epi8(r[2], r[3]);
    const __m128i c = _mm_unpackhi_epi8(r[0], r[1]), d = _mm_unpackhi_epi8(r[2], r[3]);
    const __m256i lo = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));  // outputs 0..7
    const __m256i hi = _mm256_set_m128i(_mm_unpackhi_epi16(c, d), _mm_unpacklo_epi16(c, d));  // outputs 8..15
    w[2 * h] = _mm256_and_si256(lo, nibble);
    w[2 * h + 1] = _mm256_and_si256(hi, nibble);
    w[B / 16 + 2 * h] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble);
    w[B / 16 + 2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble);
  }
}
inline q8acc q8_dot(q8acc acc, q8w w, int32_t x4) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(x4));
#else
  const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4));  // |q * x + q * x| <= 3810
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
inline void q8_block_end(float* t, const q8acc* acc, int V, float dx) {
  const __m256 d = _mm256_set1_ps(dx);
  for (int j = 0; j < V; ++j)
    _mm256_storeu_ps(t + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j]), d, _mm256_loadu_ps(t + 8 * j)));
}
inline void q8_group_end(float* yrow, const float* t, const float* s, const float* c, float xs, int64_t n0, int B) {
  const __m256 sum = _mm256_set1_ps(xs);
  for (int j = 0; j < B; j += 8) {
    __m256 acc = _mm256_loadu_ps(yrow + j);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(t + j), _mm256_loadu_ps(s + n0 + j), acc);
    acc = _mm256_fmadd_ps(sum, _mm256_loadu_ps(c + n0 + j), acc);
    _mm256_storeu_ps(yrow + j, acc);
  }
}
#endif

#if defined(Q8_ISA)
// R rows (m0..m0+R) of one B-output block nb, the codes regrouped on the fly, quad by quad in k order;
// each row's B results summed in `yl` (the same float steps as into y), then stored through `out`.
template <int B, int R>
void q8_block(const int8_t* xq, const float* dx, const float* xs, const uint8_t* packed, const float* s,
              const float* c, const Q8Out& out, int64_t K, int64_t N, int64_t gs, int64_t nb, int64_t m0,
              int64_t prefetch) {
  constexpr int V = B / Q8_LANES;
  const int64_t stride = B / 2, nblk = K / Q8_BLOCK, G = K / gs;
  const uint8_t* src = packed + nb * K * stride;
  const int64_t n0 = nb * B;
  alignas(64) float t[R][B];
  alignas(64) float yl[R][B];
  std::memset(yl, 0, sizeof(yl));
  for (int64_t g = 0; g < G; ++g) {
    std::memset(t, 0, sizeof(t));
    for (int64_t b = g * (gs / Q8_BLOCK); b < (g + 1) * (gs / Q8_BLOCK); ++b) {
      q8acc acc[R][V];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) acc[r][j] = q8_zero();
      for (int64_t k = b * Q8_BLOCK; k < (b + 1) * Q8_BLOCK; k += 4) {
        const uint8_t* p = src + k * stride;
        if (prefetch) {
          __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
          if (B == 64) __builtin_prefetch(p + prefetch + 64, 0, PREFETCH_LOCALITY);
        }
        q8w w[V];
        q8_codes<B>(p, w);
        for (int r = 0; r < R; ++r) {
          int32_t x4; std::memcpy(&x4, xq + (m0 + r) * K + k, 4);
          for (int j = 0; j < V; ++j) acc[r][j] = q8_dot(acc[r][j], w[j], x4);
        }
      }
      for (int r = 0; r < R; ++r) q8_block_end(t[r], acc[r], V, dx[(m0 + r) * nblk + b]);
    }
    for (int r = 0; r < R; ++r)
      q8_group_end(yl[r], t[r], s + g * N, c + g * N, xs[(m0 + r) * G + g], n0, B);
  }
  for (int r = 0; r < R; ++r) q8_store(out, m0 + r, n0, yl[r], B);
}

template <int B, int R>
void q8_rows(const int8_t* xq, const float* dx, const float* xs, const uint8_t* pp, const float* sp, const float* cp,
             const Q8Out& yp, int64_t M, int64_t K, int64_t N, int64_t gs, int64_t b0, int64_t b1, int64_t prefetch) {
  for (int64_t nb = b0; nb < b1; ++nb) {
    int64_t m = 0;
    for (; m + R <= M; m += R) q8_block<B, R>(xq, dx, xs, pp, sp, cp, yp, K, N, gs, nb, m, prefetch);
    for (; m < M; ++m) q8_block<B, 1>(xq, dx, xs, pp, sp, cp, yp, K, N, gs, nb, m, prefetch);
  }
}

template <int B>
void q8_blocks(int64_t rows_per_pass, const int8_t* xq, const float* dx, const float* xs, const uint8_t* pp,
               const float* sp, const float* cp, const Q8Out& yp, int64_t M, int64_t K, int64_t N, int64_t gs,
               int64_t prefetch, int64_t block_grain) {
  tgs::parallel_for(0, N / B, block_grain, [&](int64_t b0, int64_t b1) {
    switch (rows_per_pass) {
      case 1: q8_rows<B, 1>(xq, dx, xs, pp, sp, cp, yp, M, K, N, gs, b0, b1, prefetch); break;
      case 4: q8_rows<B, 4>(xq, dx, xs, pp, sp, cp, yp, M, K, N, gs, b0, b1, prefetch); break;
      default: q8_rows<B, 2>(xq, dx, xs, pp, sp, cp, yp, M, K, N, gs, b0, b1, prefetch); break;
    }
  });
}
#endif

// The generic build (aarch64, x86-64 without AVX2): the same steps, one output at a time.
void q8_generic(const int8_t* xq, const float* dx, const float* xs, const uint8_t* pp, const float* sp,
                const float* cp, const Q8Out& yp, int64_t M, int64_t K, int64_t N, int64_t gs, int64_t block) {
  const int64_t half = block / 2, nblk = K / Q8_BLOCK, G = K / gs;
  tgs::parallel_for(0, N, block, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      const int64_t nb = n / block, j = n % block;
      const int shift = j < half ? 0 : 4;
      const uint8_t* col = pp + nb * K * half + (j % half);
      for (int64_t m = 0; m < M; ++m) {
        float y = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float t = 0.f;
          for (int64_t b = g * (gs / Q8_BLOCK); b < (g + 1) * (gs / Q8_BLOCK); ++b) {
            int32_t acc = 0;
            for (int64_t k = b * Q8_BLOCK; k < (b + 1) * Q8_BLOCK; ++k)
              acc += int32_t((col[k * half] >> shift) & 15) * int32_t(xq[m * K + k]);
            t = std::fma(dx[m * nblk + b], float(acc), t);
          }
          y = std::fma(t, sp[g * N + n], y);
          y = std::fma(xs[m * G + g], cp[g * N + n], y);
        }
        q8_store1(yp, m, n, y);
      }
    }
  });
}


// ---- the same product over a layout prepared at load ("tiled", cpu_act_int8.tile) ----------------
// torch's layout puts 4 input rows' bytes of an output 32 (B = 64) or 16 (B = 32) bytes apart, so the
// kernel above spends a byte permute per 64 bytes gathering each output's quad into one 32-bit lane,
// and reads s and c from two more streams whose rows lie 4N bytes apart. Tiled, block nb (outputs
// nb B .. nb B + B - 1) is G contiguous parts, one per group g: gs / 4 quads of 2B bytes (vector h of
// a quad, 64 bytes: lane j holds, for input rows k .. k + 3, torch's byte 16h + j of that row: the low
// nibble output 16h + j, the high one output B / 2 + 16h + j), then s[g, block] and c[g, block] as
// float32: a block streams from one start to one end, and one load, one AND, one shift and one AND make
// a quad's code vectors (the same codes in the same lanes as q8_codes'). The arithmetic is the kernel's
// above, step for step: the same bits (tests/test_cpu_act_int8_tiled.py).
inline int64_t q8t_part_bytes(int64_t gs, int64_t B) { return gs * B / 2 + 8 * B; }
#if Q8_ISA == 2
template <int B>
inline void q8t_codes(const uint8_t* p, __m512i* w) {
  constexpr int H = B / 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < H; ++h) {
    const __m512i v = _mm512_loadu_si512(p + 64 * h);
    w[h] = _mm512_and_si512(v, nibble);
    w[H + h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
}
#elif Q8_ISA == 1
template <int B>
inline void q8t_codes(const uint8_t* p, __m256i* w) {  // lanes 0-7 of vector h, then 8-15: q8_codes' order
  constexpr int H = B / 32;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < H; ++h) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32));
    w[2 * h] = _mm256_and_si256(a, nibble);
    w[2 * h + 1] = _mm256_and_si256(b, nibble);
    w[B / 16 + 2 * h] = _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble);
    w[B / 16 + 2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
  }
}
#endif

#if defined(Q8_ISA)
template <int B, int R>
void q8t_block(const int8_t* xq, const float* dx, const float* xs, const uint8_t* tiled, const Q8Out& out, int64_t K,
               int64_t gs, int64_t nb, int64_t m0, int64_t prefetch) {
  constexpr int V = B / Q8_LANES;
  const int64_t nblk = K / Q8_BLOCK, G = K / gs, part = q8t_part_bytes(gs, B), per_group = gs / Q8_BLOCK;
  const uint8_t* src = tiled + nb * G * part;
  alignas(64) float t[R][B];
  alignas(64) float yl[R][B];
  std::memset(yl, 0, sizeof(yl));
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* base = src + g * part;
    std::memset(t, 0, sizeof(t));
    for (int64_t b = 0; b < per_group; ++b) {
      q8acc acc[R][V];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < V; ++j) acc[r][j] = q8_zero();
      const int64_t k0 = g * gs + b * Q8_BLOCK;
      for (int q = 0; q < Q8_BLOCK / 4; ++q) {
        const uint8_t* p = base + (b * (Q8_BLOCK / 4) + q) * (2 * B);
        if (prefetch) {
          __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
          if (B == 64) __builtin_prefetch(p + prefetch + 64, 0, PREFETCH_LOCALITY);
        }
        q8w w[V];
        q8t_codes<B>(p, w);
        for (int r = 0; r < R; ++r) {
          int32_t x4; std::memcpy(&x4, xq + (m0 + r) * K + k0 + 4 * q, 4);
          for (int j = 0; j < V; ++j) acc[r][j] = q8_dot(acc[r][j], w[j], x4);
        }
      }
      for (int r = 0; r < R; ++r) q8_block_end(t[r], acc[r], V, dx[(m0 + r) * nblk + g * per_group + b]);
    }
    const float* sc = reinterpret_cast<const float*>(base + gs * B / 2);  // s[g, block], then c[g, block]
    for (int r = 0; r < R; ++r) q8_group_end(yl[r], t[r], sc, sc + B, xs[(m0 + r) * G + g], 0, B);
  }
  for (int r = 0; r < R; ++r) q8_store(out, m0 + r, nb * B, yl[r], B);
}

template <int B, int R>
void q8t_rows(const int8_t* xq, const float* dx, const float* xs, const uint8_t* tiled, const Q8Out& out, int64_t M,
              int64_t K, int64_t gs, int64_t b0, int64_t b1, int64_t prefetch) {
  for (int64_t nb = b0; nb < b1; ++nb) {
    int64_t m = 0;
    for (; m + R <= M; m += R) q8t_block<B, R>(xq, dx, xs, tiled, out, K, gs, nb, m, prefetch);
    for (; m < M; ++m) q8t_block<B, 1>(xq, dx, xs, tiled, out, K, gs, nb, m, prefetch);
  }
}

// One quad (4 inputs of each output) of a tiled block at p for R rows into acc, its weights prefetched
// `prefetch` bytes ahead: q8t_block's inner step, shared by both interleaves of q8t_multi.
template <int B, int R>
inline void q8t_quad(const uint8_t* p, int64_t prefetch, const int32_t (*x4)[Q8_BLOCK / 4], int q,
                     q8acc (*acc)[B / Q8_LANES]) {
  constexpr int V = B / Q8_LANES;
  if (prefetch) {
    __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
    if (B == 64) __builtin_prefetch(p + prefetch + 64, 0, PREFETCH_LOCALITY);
  }
  q8w w[V];
  q8t_codes<B>(p, w);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = q8_dot(acc[r][j], w[j], x4[r][q]);
}

// S blocks at once, R rows (m0 .. m0 + R): the blocks nbs[0..S) read as S interleaved sequential streams
// (FINE: one quad of each block in turn; else one 32-input block of each in turn). Each output's
// arithmetic is q8t_block's step for step (the same quads in the same order into the same int32 lanes,
// the same fused multiply-adds into t and yl): the same bits whatever S, FINE or the blocks beside it.
template <int B, int R, int S, bool FINE>
void q8t_multi(const int8_t* xq, const float* dx, const float* xs, const uint8_t* tiled, const Q8Out& out, int64_t K,
               int64_t gs, const int64_t* nbs, int64_t m0, int64_t prefetch) {
  constexpr int V = B / Q8_LANES;
  constexpr int Q = Q8_BLOCK / 4;  // quads per 32-input block
  const int64_t nblk = K / Q8_BLOCK, G = K / gs, part = q8t_part_bytes(gs, B), per_group = gs / Q8_BLOCK;
  const uint8_t* src[S];
  for (int s = 0; s < S; ++s) src[s] = tiled + nbs[s] * G * part;
  alignas(64) float t[S][R][B];
  alignas(64) float yl[S][R][B];
  std::memset(yl, 0, sizeof(yl));
  for (int64_t g = 0; g < G; ++g) {
    std::memset(t, 0, sizeof(t));
    for (int64_t b = 0; b < per_group; ++b) {
      const int64_t k0 = g * gs + b * Q8_BLOCK, off = g * part + b * Q * (2 * B);
      int32_t x4[R][Q];
      for (int r = 0; r < R; ++r) std::memcpy(x4[r], xq + (m0 + r) * K + k0, Q8_BLOCK);
      if constexpr (FINE) {
        q8acc acc[S][R][V];
        for (int s = 0; s < S; ++s)
          for (int r = 0; r < R; ++r)
            for (int j = 0; j < V; ++j) acc[s][r][j] = q8_zero();
        for (int q = 0; q < Q; ++q)
          for (int s = 0; s < S; ++s) q8t_quad<B, R>(src[s] + off + q * (2 * B), prefetch, x4, q, acc[s]);
        for (int s = 0; s < S; ++s)
          for (int r = 0; r < R; ++r) q8_block_end(t[s][r], acc[s][r], V, dx[(m0 + r) * nblk + g * per_group + b]);
      } else {
        for (int s = 0; s < S; ++s) {
          q8acc acc[R][V];
          for (int r = 0; r < R; ++r)
            for (int j = 0; j < V; ++j) acc[r][j] = q8_zero();
          for (int q = 0; q < Q; ++q) q8t_quad<B, R>(src[s] + off + q * (2 * B), prefetch, x4, q, acc);
          for (int r = 0; r < R; ++r) q8_block_end(t[s][r], acc[r], V, dx[(m0 + r) * nblk + g * per_group + b]);
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const float* sc = reinterpret_cast<const float*>(src[s] + g * part + gs * B / 2);  // s[g, block], c[g, block]
      for (int r = 0; r < R; ++r) q8_group_end(yl[s][r], t[s][r], sc, sc + B, xs[(m0 + r) * G + g], 0, B);
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) q8_store(out, m0 + r, nbs[s] * B, yl[s][r], B);
}

// q8t_multi with `count` (1 .. S) streams, count known only at run time (a task's last pass).
template <int B, int R, int S, bool FINE>
void q8t_multi_n(int count, const int8_t* xq, const float* dx, const float* xs, const uint8_t* tiled,
                 const Q8Out& out, int64_t K, int64_t gs, const int64_t* nbs, int64_t prefetch) {
  if (count == S) return q8t_multi<B, R, S, FINE>(xq, dx, xs, tiled, out, K, gs, nbs, 0, prefetch);
  if constexpr (S > 1) q8t_multi_n<B, R, S - 1, FINE>(count, xq, dx, xs, tiled, out, K, gs, nbs, prefetch);
}

// M == R rows (1 or 2), S streams a thread: a task's blocks [b0, b1) are cut into S contiguous runs (lengths
// differing by at most one) and each pass takes the next block of every run, so a thread reads S blocks
// far apart at once instead of one block after another (a block is one sequential stream of K / 2 x B
// + 8 x B x K / gs bytes: 55 KiB at K = 1536, B = 64). The idea and the plain-read ceilings are the
// bfloat16 product's (cpu_native_src.py, gemv_impl_streams; issue #32 session 14). Tasks of at least S
// and at least block_grain blocks (the pool's chunks: more for large layers). Measured: Q8T_STREAMS_1.
template <int B, int R, int S, bool FINE>
void q8t_streams(const int8_t* xq, const float* dx, const float* xs, const uint8_t* tiled, const Q8Out& out,
                 int64_t K, int64_t N, int64_t gs, int64_t prefetch, int64_t block_grain) {
  tgs::parallel_for(0, N / B, std::max<int64_t>(S, block_grain), [&](int64_t b0, int64_t b1) {
    const int64_t n = b1 - b0, len = n / S, extra = n % S;
    int64_t start[S], nbs[S];
    for (int s = 0; s < S; ++s) start[s] = b0 + s * len + std::min<int64_t>(s, extra);
    for (int64_t i = 0; i < len; ++i) {
      for (int s = 0; s < S; ++s) nbs[s] = start[s] + i;
      q8t_multi<B, R, S, FINE>(xq, dx, xs, tiled, out, K, gs, nbs, 0, prefetch);
    }
    if (extra) {  // the first `extra` runs are one block longer
      for (int s = 0; s < extra; ++s) nbs[s] = start[s] + len;
      q8t_multi_n<B, R, S, FINE>(int(extra), xq, dx, xs, tiled, out, K, gs, nbs, prefetch);
    }
  });
}

// Streams a thread, and how they interleave, at one row (one quad of each block in turn) and at two
// (one 32-input block of each in turn: a quad's 2 x S x B / 16 accumulators would not fit the registers).
// Measured on the 2-core Ice Lake VM, busy (load 2.5-4, other jobs outside the bench lock), cold Qwen2.5-1.5B
// int4 shapes in the huge-page arena, 2 threads. A scratch sweep against one block after another (medians of
// 11-21 interleaved rounds): AVX-512 one row, 8 quad-interleaved 1.28-1.50x, 4 1.24-1.36x, 2 1.07-1.18x, 8 or 4
// block-interleaved ~1.15-1.20x; two rows, 8 block-interleaved 1.04-1.30x, 4 1.00-1.25x, 4 quad-interleaved
// 0.98-1.20x. AVX2 (B = 32) the same order: one row 8 quad-interleaved 1.37-1.52x (4: 1.27-1.44x), two rows 8
// block-interleaved 1.28-1.49x (4: 1.21-1.39x). The chosen forms against main (benchmarks/kernels_cpu_ab.py
// --base main --what int4-tiled-ab, 7-11 rounds, 3-4 runs): AVX-512 one row 1.25-1.49x, two rows 1.15-1.30x;
// AVX2 one row 1.33-1.52x, two rows 1.13-1.49x; 4 and 8 rows (unchanged) 0.92-1.00x. The prefetch distance
// (cpu_act_int8.PREFETCH_BYTES) stays 1 KiB: none and 256 bytes 0-10% slower at one row (none 5-15% slower at
// two), 4 KiB 15-30% slower. 3+ rows (compute-bound) keep one block after another. Issue #32, session 15.
constexpr int Q8T_STREAMS_1 = 8, Q8T_STREAMS_2 = 8;

template <int B>
void q8t_blocks(int64_t rows_per_pass, const int8_t* xq, const float* dx, const float* xs, const uint8_t* tiled,
                const Q8Out& out, int64_t M, int64_t K, int64_t N, int64_t gs, int64_t prefetch, int64_t block_grain) {
  if (M == 1) return q8t_streams<B, 1, Q8T_STREAMS_1, true>(xq, dx, xs, tiled, out, K, N, gs, prefetch, block_grain);
  if (M == 2 && rows_per_pass == 2)
    return q8t_streams<B, 2, Q8T_STREAMS_2, false>(xq, dx, xs, tiled, out, K, N, gs, prefetch, block_grain);
  tgs::parallel_for(0, N / B, block_grain, [&](int64_t b0, int64_t b1) {
    switch (rows_per_pass) {
      case 1: q8t_rows<B, 1>(xq, dx, xs, tiled, out, M, K, gs, b0, b1, prefetch); break;
      case 4: q8t_rows<B, 4>(xq, dx, xs, tiled, out, M, K, gs, b0, b1, prefetch); break;
      default: q8t_rows<B, 2>(xq, dx, xs, tiled, out, M, K, gs, b0, b1, prefetch); break;
    }
  });
}
#endif

// The generic build: q8_generic's steps, each code and scale found in the tiled layout.
void q8t_generic(const int8_t* xq, const float* dx, const float* xs, const uint8_t* tiled, const Q8Out& out,
                 int64_t M, int64_t K, int64_t N, int64_t gs, int64_t block) {
  const int64_t half = block / 2, nblk = K / Q8_BLOCK, G = K / gs, part = q8t_part_bytes(gs, block);
  tgs::parallel_for(0, N, block, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; ++n) {
      const int64_t nb = n / block, j = n % block, byte = j % half;
      const int shift = j < half ? 0 : 4;
      const int64_t lane = (byte / 16) * 64 + (byte % 16) * 4;  // vector byte / 16, lane byte % 16
      for (int64_t m = 0; m < M; ++m) {
        float y = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* base = tiled + (nb * G + g) * part;
          float t = 0.f;
          for (int64_t b = 0; b < gs / Q8_BLOCK; ++b) {
            int32_t acc = 0;
            for (int64_t kk = b * Q8_BLOCK; kk < (b + 1) * Q8_BLOCK; ++kk)
              acc += int32_t((base[(kk / 4) * 2 * block + lane + kk % 4] >> shift) & 15) *
                     int32_t(xq[m * K + g * gs + kk]);
            t = std::fma(dx[m * nblk + g * (gs / Q8_BLOCK) + b], float(acc), t);
          }
          float s, c;
          std::memcpy(&s, base + gs * half + 4 * j, 4);
          std::memcpy(&c, base + gs * half + 4 * (block + j), 4);
          y = std::fma(t, s, y);
          y = std::fma(xs[m * G + g], c, y);
        }
        q8_store1(out, m, n, y);
      }
    }
  });
}

// ---- int8 codes x int8 activations: y[m, n] = s[n] * sum_b dx[m, b] * sum_{k in b} w[n, k] * xq[m, k] ---------
// Lanes are 4-input-row groups ("quads"): a 64-input chunk c is 16 lanes, lane l summing quad 16c + l in
// integers (exact), then f[l] = fma(float(that), dx of the lane's 32-wide block, f[l]) chunk by chunk;
// at the end the 16 lanes are added in lane order and multiplied by s[n]. The AVX512-VNNI build makes
// the unsigned operand of vpdpbusd as w + 128 (w xor 0x80) and starts each lane at -128 * its quad's
// sum of xq; the AVX2 build multiplies |w| by xq with w's sign (vpmaddubsw, at most 2 * 128 * 127 per
// pair: no saturation), then vpmaddwd: the same integers, the same float steps, the same bits.
// xq, dl (float32 [M, K / 4]: each quad's block scale) and nc (int32 [M, K / 4]: -128 * each quad's sum).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8Q8_ISA 2
template <int R, int NB>
inline void i8q8_tile(const int8_t* w, const int8_t* xq, const float* dl, const int32_t* nc, const float* s,
                      float* y, int64_t K, int64_t N, int64_t n, int64_t m0, int64_t prefetch,
                      int64_t stride = 1) {
  __m512 f[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) f[r][j] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 bytes = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    const __mmask16 lanes = K - k >= 64 ? __mmask16(0xFFFF) : __mmask16((1u << ((K - k) / 4)) - 1);
    __m512i u[NB];
    for (int j = 0; j < NB; ++j) {
      const int8_t* p = w + (n + j * stride) * K + k;
      if (prefetch) __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
      u[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, p), flip);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const __m512i xv = _mm512_maskz_loadu_epi8(bytes, xq + m * K + k);
      const __m512i cv = _mm512_maskz_loadu_epi32(lanes, nc + m * (K / 4) + k / 4);
      const __m512 dv = _mm512_maskz_loadu_ps(lanes, dl + m * (K / 4) + k / 4);
      for (int j = 0; j < NB; ++j)
        f[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv, u[j], xv)), dv, f[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      alignas(64) float lane[16];
      _mm512_store_ps(lane, f[r][j]);
      float t = 0.f;
      for (int l = 0; l < 16; ++l) t += lane[l];
      y[(m0 + r) * N + n + j * stride] = t * s[n + j * stride];
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define I8Q8_ISA 1
template <int R, int NB>
inline void i8q8_tile(const int8_t* w, const int8_t* xq, const float* dl, const int32_t*, const float* s,
                      float* y, int64_t K, int64_t N, int64_t n, int64_t m0, int64_t prefetch,
                      int64_t stride = 1) {
  __m256 f[R][NB][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) f[r][j][0] = f[r][j][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < K; k += 64) {
    const int halves = K - k >= 64 ? 2 : 1;
    for (int h = 0; h < halves; ++h) {
      __m256i a[NB], sgn[NB];
      for (int j = 0; j < NB; ++j) {
        const int8_t* p = w + (n + j * stride) * K + k + 32 * h;
        if (prefetch && h == 0) __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
        sgn[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        a[j] = _mm256_sign_epi8(sgn[j], sgn[j]);  // |w| (-128 stays 0x80: 128 unsigned)
      }
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + k + 32 * h));
        const __m256 dv = _mm256_loadu_ps(dl + m * (K / 4) + k / 4 + 8 * h);
        for (int j = 0; j < NB; ++j) {
          const __m256i pairs = _mm256_maddubs_epi16(a[j], _mm256_sign_epi8(xv, sgn[j]));
          const __m256i quads = _mm256_madd_epi16(pairs, ones);
          f[r][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quads), dv, f[r][j][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      alignas(32) float lane[16];
      _mm256_store_ps(lane, f[r][j][0]);
      _mm256_store_ps(lane + 8, f[r][j][1]);
      float t = 0.f;
      for (int l = 0; l < 16; ++l) t += lane[l];
      y[(m0 + r) * N + n + j * stride] = t * s[n + j * stride];
    }
}
#endif

#if defined(I8Q8_ISA)
template <int R>
void i8q8_rows(const int8_t* w, const int8_t* xq, const float* dl, const int32_t* nc, const float* s, float* y,
               int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, int64_t prefetch) {
  constexpr int NB = 4;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    int64_t m = 0;
    for (; m + R <= M; m += R) i8q8_tile<R, NB>(w, xq, dl, nc, s, y, K, N, n, m, prefetch);
    for (; m < M; ++m) i8q8_tile<1, NB>(w, xq, dl, nc, s, y, K, N, n, m, prefetch);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) i8q8_tile<1, 1>(w, xq, dl, nc, s, y, K, N, n, m, prefetch);
}

// 1-2 rows (M <= R): S concurrent weight streams a thread. A task's outputs [a, e) are cut into S
// contiguous runs and a tile takes the next output of each run (outputs n, n + len, ...: stride len),
// so a thread reads S rows far apart at once instead of 4 adjacent ones (which the hardware prefetchers
// see as about one stream: 4 rows of 1.5-9 KiB in one or two pages). The idea and the plain-read
// ceilings are the bfloat16 product's (cpu_native_src.py, gemv_impl_streams; issue #32 session 14).
// Each output's arithmetic is i8q8_tile's whatever NB or the stride, so a row's bits are those of the
// adjacent tiles, of more rows and of any split. Measured: see I8Q8_STREAMS_1 below.
template <int R, int S>
void i8q8_streams(const int8_t* w, const int8_t* xq, const float* dl, const int32_t* nc, const float* s, float* y,
                  int64_t M, int64_t K, int64_t N, int64_t prefetch) {
  tgs::parallel_for(0, N, 8 * S, [&](int64_t a, int64_t e) {
    const int64_t len = (e - a) / S;
    for (int64_t i = 0; i < len; ++i) {
      if (M == R) i8q8_tile<R, S>(w, xq, dl, nc, s, y, K, N, a + i, 0, prefetch, len);
      else
        for (int64_t m = 0; m < M; ++m) i8q8_tile<1, S>(w, xq, dl, nc, s, y, K, N, a + i, m, prefetch, len);
    }
    for (int64_t n = a + S * len; n < e; ++n)
      for (int64_t m = 0; m < M; ++m) i8q8_tile<1, 1>(w, xq, dl, nc, s, y, K, N, n, m, prefetch);
  });
}
// S at one row and at two: AVX-512 8 (8-16 accumulators of its 32 registers); AVX2 4 (its tiles hold two
// registers an output and row, and 16 registers in all). Cold Qwen2.5-1.5B shapes, 2 threads, the 2-core
// Ice Lake Xeon VM (shared, a CI run going), benchmarks/kernels_cpu_ab.py --what int8-q8-ab, medians of
// 5 interleaved rounds against the 4 adjacent outputs a tile before: AVX-512 one row 1.00-1.12x (head
// 1.08x), two rows 1.02-1.22x (head 1.22x); AVX2 one row 1.03-1.16x, two rows 1.10-1.32x; 3+ rows keep
// the adjacent tiles (unchanged). AVX-512 with 4 streams: 0.86-1.06x of 8; AVX2 one row with 8: 0.98-1.08x
// of 4 (even, so the fewer registers). Issue #32, session 14.
#if I8Q8_ISA == 2
constexpr int I8Q8_STREAMS_1 = 8, I8Q8_STREAMS_2 = 8;
#else
constexpr int I8Q8_STREAMS_1 = 4, I8Q8_STREAMS_2 = 4;
#endif
#endif

// The generic build: the same lanes and steps, one output at a time.
void i8q8_generic(const int8_t* w, const int8_t* xq, const float* dl, const float* s, float* y, int64_t M, int64_t K,
                  int64_t N) {
  tgs::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float f[16] = {0.f};
        for (int64_t q = 0; q < K / 4; ++q) {
          int32_t acc = 0;
          for (int t = 0; t < 4; ++t) acc += int32_t(w[n * K + 4 * q + t]) * int32_t(xq[m * K + 4 * q + t]);
          f[q % 16] = std::fma(float(acc), dl[m * (K / 4) + q], f[q % 16]);
        }
        float t = 0.f;
        for (int l = 0; l < 16; ++l) t += f[l];
        y[m * N + n] = t * s[n];
      }
  });
}

// x's int8 form for the int8 kernel: xq, dl and nc as above (q8_quantize's rounding, one group = K).
void i8q8_prepare(const float* x, int8_t* xq, float* dl, int32_t* nc, int64_t M, int64_t K) {
  std::vector<float> dx(K / Q8_BLOCK), xs(1);
  for (int64_t m = 0; m < M; ++m) {
    q8_quantize(x + m * K, xq + m * K, dx.data(), xs.data(), 1, K, K);
    for (int64_t q = 0; q < K / 4; ++q) {
      dl[m * (K / 4) + q] = dx[q / 8];
      int32_t sum = 0;
      for (int t = 0; t < 4; ++t) sum += xq[m * K + 4 * q + t];
      nc[m * (K / 4) + q] = -128 * sum;
    }
  }
}

}  // namespace

namespace {
// Checks int4_q8_mm's arguments; returns (N, K, G, M).
std::array<int64_t, 4> q8_check(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& s,
                                const torch::Tensor& c, int64_t gs, int64_t block) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 2, "packed must be uint8");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  check_block(block, N);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16)
              && x.is_contiguous(), "x must be contiguous float32 or bfloat16 [M, ", K, "], got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(gs > 0 && gs % Q8_BLOCK == 0 && K % gs == 0, "group size ", gs, " must be a multiple of 32 dividing K=", K);
  const int64_t G = K / gs;
  TORCH_CHECK(s.scalar_type() == torch::kFloat && c.scalar_type() == torch::kFloat && s.is_contiguous() &&
              c.is_contiguous() && s.numel() == G * N && c.numel() == G * N, "s and c must be float32 [K / gs, N]");
  return {N, K, G, x.size(0)};
}

// x's int8 form in this thread's scratch (reused call to call: a decode step's small layers allocate nothing).
struct Q8Scratch {
  std::vector<int8_t> xq;
  std::vector<float> dx, xs;
};
Q8Scratch& q8_scratch(const torch::Tensor& x, int64_t M, int64_t K, int64_t gs) {
  thread_local Q8Scratch scratch;
  scratch.xq.resize(M * K);
  scratch.dx.resize(M * (K / Q8_BLOCK));
  scratch.xs.resize(M * (K / gs));
  if (x.scalar_type() == torch::kBFloat16)
    q8_quantize(reinterpret_cast<const uint16_t*>(x.data_ptr()), scratch.xq.data(), scratch.dx.data(),
                scratch.xs.data(), M, K, gs);
  else
    q8_quantize(x.data_ptr<float>(), scratch.xq.data(), scratch.dx.data(), scratch.xs.data(), M, K, gs);
  return scratch;
}

void q8_run(const Q8Scratch& q, const torch::Tensor& packed, const torch::Tensor& s, const torch::Tensor& c,
            const Q8Out& out, int64_t M, int64_t K, int64_t N, int64_t gs, int64_t block, int64_t rows_per_pass,
            int64_t prefetch, int64_t block_grain, bool generic) {
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
#if defined(Q8_ISA)
  if (!generic) {
    if (block == 64)
      q8_blocks<64>(rows_per_pass, q.xq.data(), q.dx.data(), q.xs.data(), pp, sp, cp, out, M, K, N, gs, prefetch,
                    block_grain);
    else
      q8_blocks<32>(rows_per_pass, q.xq.data(), q.dx.data(), q.xs.data(), pp, sp, cp, out, M, K, N, gs, prefetch,
                    block_grain);
    return;
  }
#endif
  q8_generic(q.xq.data(), q.dx.data(), q.xs.data(), pp, sp, cp, out, M, K, N, gs, block);
}
}  // namespace

// x [M, K] float32 or bfloat16 @ W^T for torch's CPU int4 layout (see int4pack_dequant_t), x rounded to
// int8 per 32-wide block first (cpu_native_q8_src.py: the arithmetic), float32 [M, N]. s, c float32
// [K / gs, N], W = q * s + c; gs a multiple of 32. block, rows_per_pass (1, 2 or 4), prefetch and
// block_grain as int4pack_mm's: none of the last three changes a bit of the result.
torch::Tensor int4_q8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor s, torch::Tensor c, int64_t gs,
                         int64_t block, int64_t rows_per_pass, int64_t prefetch, int64_t block_grain) {
  const auto [N, K, G, M] = q8_check(x, packed, s, c, gs, block);
  TORCH_CHECK(prefetch >= 0 && block_grain >= 1, "prefetch must be >= 0 and block_grain >= 1");
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0) return y;
  const Q8Scratch& q = q8_scratch(x, M, K, gs);
  q8_run(q, packed, s, c, Q8Out{y.data_ptr<float>(), nullptr, nullptr, N}, M, K, N, gs, block, rows_per_pass,
         prefetch, block_grain, false);
  return y;
}

// What the bfloat16 entry points (torch's layout, the tiled one) check alike; the bias's data or null.
static const uint16_t* q8_bf16_args(const torch::Tensor& x, const torch::Tensor& bias, int64_t N, int64_t prefetch,
                                    int64_t block_grain) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x must be bfloat16");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kBFloat16 && bias.is_contiguous() &&
              bias.numel() == N), "bias must be empty or bfloat16 [", N, "]");
  TORCH_CHECK(prefetch >= 0 && block_grain >= 1, "prefetch must be >= 0 and block_grain >= 1");
  return bias.numel() ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr;
}

// The layer's product in one call (kernels/cpu.py, Int4PackLinear with int8 activations): x [M, K]
// bfloat16 -> bfloat16 [M, N], int4_q8_mm's float32 result rounded as torch's .to(bfloat16) and, when
// bias (bfloat16 [N]) has elements, plus the bias as torch's bfloat16 add: the bits of those ops, without
// the float32 copies of x and y or the separate passes (the fixed cost of a decode step's small layers).
torch::Tensor int4_q8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor s, torch::Tensor c,
                             torch::Tensor bias, int64_t gs, int64_t block, int64_t rows_per_pass, int64_t prefetch,
                             int64_t block_grain) {
  const auto [N, K, G, M] = q8_check(x, packed, s, c, gs, block);
  const uint16_t* bp = q8_bf16_args(x, bias, N, prefetch, block_grain);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const Q8Scratch& q = q8_scratch(x, M, K, gs);
  q8_run(q, packed, s, c, Q8Out{nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()), bp, N}, M, K, N, gs, block,
         rows_per_pass, prefetch, block_grain, false);
  return y;
}

// The same product through the generic loops whatever the build (tests compare the builds' bits).
torch::Tensor int4_q8_mm_generic(torch::Tensor x, torch::Tensor packed, torch::Tensor s, torch::Tensor c, int64_t gs,
                                 int64_t block) {
  const auto [N, K, G, M] = q8_check(x, packed, s, c, gs, block);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0) return y;
  const Q8Scratch& q = q8_scratch(x, M, K, gs);
  q8_run(q, packed, s, c, Q8Out{y.data_ptr<float>(), nullptr, nullptr, N}, M, K, N, gs, block, 1, 0, 1, true);
  return y;
}

namespace {
// Checks the tiled product's arguments; returns (N, K, G, M).
std::array<int64_t, 4> q8t_check(const torch::Tensor& x, const torch::Tensor& tiled, int64_t gs, int64_t block) {
  TORCH_CHECK(block == 64 || block == 32, "block must be 64 or 32, got ", block);
  TORCH_CHECK(gs > 0 && gs % Q8_BLOCK == 0, "group size ", gs, " must be a multiple of 32");
  TORCH_CHECK(tiled.scalar_type() == torch::kByte && tiled.is_contiguous() && tiled.dim() == 3 &&
              tiled.size(2) == q8t_part_bytes(gs, block), "tiled must be contiguous uint8 [N / ", block,
              ", K / ", gs, ", ", q8t_part_bytes(gs, block), "] (cpu_act_int8.tile), got ", tiled.sizes(), " ",
              tiled.scalar_type());
  const int64_t N = tiled.size(0) * block, G = tiled.size(1), K = G * gs;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16)
              && x.is_contiguous(), "x must be contiguous float32 or bfloat16 [M, ", K, "], got ", x.sizes(), " ",
              x.scalar_type());
  return {N, K, G, x.size(0)};
}

void q8t_run(const Q8Scratch& q, const torch::Tensor& tiled, const Q8Out& out, int64_t M, int64_t K, int64_t N,
             int64_t gs, int64_t block, int64_t rows_per_pass, int64_t prefetch, int64_t block_grain, bool generic) {
  const uint8_t* tp = tiled.data_ptr<uint8_t>();
#if defined(Q8_ISA)
  if (!generic) {
    if (block == 64)
      q8t_blocks<64>(rows_per_pass, q.xq.data(), q.dx.data(), q.xs.data(), tp, out, M, K, N, gs, prefetch, block_grain);
    else
      q8t_blocks<32>(rows_per_pass, q.xq.data(), q.dx.data(), q.xs.data(), tp, out, M, K, N, gs, prefetch, block_grain);
    return;
  }
#endif
  q8t_generic(q.xq.data(), q.dx.data(), q.xs.data(), tp, out, M, K, N, gs, block);
}
}  // namespace

// int4_q8_mm over the tiled layout (cpu_act_int8.tile of torch's packed codes, s and c): the same
// arithmetic and bits, float32 [M, N]; generic: the generic loops whatever the build (tests).
torch::Tensor int4_q8_tiled_mm(torch::Tensor x, torch::Tensor tiled, int64_t gs, int64_t block, int64_t rows_per_pass,
                               int64_t prefetch, int64_t block_grain, bool generic) {
  const auto [N, K, G, M] = q8t_check(x, tiled, gs, block);
  TORCH_CHECK(prefetch >= 0 && block_grain >= 1, "prefetch must be >= 0 and block_grain >= 1");
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0) return y;
  const Q8Scratch& q = q8_scratch(x, M, K, gs);
  q8t_run(q, tiled, Q8Out{y.data_ptr<float>(), nullptr, nullptr, N}, M, K, N, gs, block, rows_per_pass, prefetch,
          block_grain, generic);
  return y;
}

// int4_q8_linear over the tiled layout: bfloat16 x [M, K] -> bfloat16 [M, N] (+ bias), the same bits.
torch::Tensor int4_q8_tiled_linear(torch::Tensor x, torch::Tensor tiled, torch::Tensor bias, int64_t gs, int64_t block,
                                   int64_t rows_per_pass, int64_t prefetch, int64_t block_grain) {
  const auto [N, K, G, M] = q8t_check(x, tiled, gs, block);
  const uint16_t* bp = q8_bf16_args(x, bias, N, prefetch, block_grain);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const Q8Scratch& q = q8_scratch(x, M, K, gs);
  q8t_run(q, tiled, Q8Out{nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()), bp, N}, M, K, N, gs, block,
          rows_per_pass, prefetch, block_grain, false);
  return y;
}

// Which integer dot product this build has for int4_q8_mm: 2 AVX512-VNNI (with VBMI byte permutes),
// 1 AVX2 (AVX-VNNI where the CPU has it, else vpmaddubsw + vpmaddwd), 0 the generic loops (correct,
// not fast: cpu_act_int8 keeps exact activations there unless asked).
int64_t int4_q8_isa() {
#if defined(Q8_ISA)
  return Q8_ISA;
#else
  return 0;
#endif
}

// x [M, K] float32 @ (w [N, K] int8 * s [N] float32)^T with x rounded to int8 per 32-wide block (K a
// multiple of 32); rows_per_pass 1, 2 or 4 and prefetch change no bit of the result.
torch::Tensor int8_q8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t prefetch, int64_t rows_per_pass,
                           bool generic) {
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous() && w.dim() == 2, "w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % Q8_BLOCK == 0, "K=", K, " must be a multiple of 32");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, ", K, "]");
  TORCH_CHECK(s.scalar_type() == torch::kFloat && s.is_contiguous() && s.numel() == N, "s must be float32 [N]");
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xq_t = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto dl_t = torch::empty({M, K / 4}, x.options());
  auto nc_t = torch::empty({M, K / 4}, x.options().dtype(torch::kInt));
  const int8_t* wp = w.data_ptr<int8_t>();
  int8_t* xq = xq_t.data_ptr<int8_t>();
  float* dl = dl_t.data_ptr<float>();
  int32_t* nc = nc_t.data_ptr<int32_t>();
  i8q8_prepare(x.data_ptr<float>(), xq, dl, nc, M, K);
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(I8Q8_ISA)
  if (!generic) {
    if (M == 1) {
      i8q8_streams<1, I8Q8_STREAMS_1>(wp, xq, dl, nc, sp, yp, M, K, N, prefetch);
      return y;
    }
    if (M == 2 && rows_per_pass == 2) {
      i8q8_streams<2, I8Q8_STREAMS_2>(wp, xq, dl, nc, sp, yp, M, K, N, prefetch);
      return y;
    }
    tgs::parallel_for(0, N / 4, 16, [&](int64_t b0, int64_t b1) {
      const int64_t n1 = b1 == N / 4 ? N : 4 * b1;  // the last task takes N % 4 too
      switch (rows_per_pass) {
        case 1: i8q8_rows<1>(wp, xq, dl, nc, sp, yp, M, K, N, 4 * b0, n1, prefetch); break;
        case 4: i8q8_rows<4>(wp, xq, dl, nc, sp, yp, M, K, N, 4 * b0, n1, prefetch); break;
        default: i8q8_rows<2>(wp, xq, dl, nc, sp, yp, M, K, N, 4 * b0, n1, prefetch); break;
      }
    });
    if (N < 4) i8q8_rows<1>(wp, xq, dl, nc, sp, yp, M, K, N, 0, N, prefetch);
    return y;
  }
#endif
  i8q8_generic(wp, xq, dl, sp, yp, M, K, N);
  return y;
}

int64_t int8_q8_isa() {
#if defined(I8Q8_ISA)
  return I8Q8_ISA;
#else
  return 0;
#endif
}

namespace {

// ---- int8 codes in the table layout x exact bfloat16 activations (`int8_table_gemv`) ------------------
// int8_gemv's product (bfloat16 x through vdpbf16ps, the same instructions on the same operands in the
// same order, so the same bits), for codes rearranged at load (cpu_native.int8_table_pack) so that their
// conversion to bfloat16 costs 5 instructions per 64 codes instead of 10. Each full 64-code chunk of a
// row is stored sign-magnitude (bit 7 the sign, bits 0-6 |v|; v = -128 has no such byte, so such
// weights keep the plain layout), its bytes ordered so that vpunpcklbw / vpunpckhbw of two byte tables
// give codes 0-31 and 32-63 in order: the stored byte 16 L + o holds code 8 L + o for o < 8, code
// 32 + 8 L + o - 8 for o >= 8 (L the 128-bit lane). Two vpermi2b look up the low and the high byte of
// bfloat16(|v|) (128-entry tables: the index's bit 7, the sign, is ignored), one vpternlogd ORs the sign
// into the high byte, two unpacks interleave them. A row's K % 64 tail stays plain int8, read as
// int8_gemv reads it. Measured: BENCHMARKS.md, issue #32 session 12.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define INT8_TABLE_ISA 1
struct Int8Tables {
  __m512i lo0, lo1, hi0, hi1, sign;
};
inline Int8Tables int8_tables() {
  alignas(64) uint8_t lo[128], hi[128];
  for (int v = 0; v < 128; ++v) {
    const float f = float(v);  // at most 7 significant bits: its bfloat16 is its top half, exactly
    uint32_t u; std::memcpy(&u, &f, 4);
    lo[v] = uint8_t(u >> 16);
    hi[v] = uint8_t(u >> 24);
  }
  return {_mm512_load_si512(lo), _mm512_load_si512(lo + 64), _mm512_load_si512(hi), _mm512_load_si512(hi + 64),
          _mm512_set1_epi8(char(0x80))};
}
inline void int8_table_words(const Int8Tables& t, __m512i b, __m512i& w0, __m512i& w1) {
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, b, t.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, b, t.hi1), b, t.sign, 0xF8);  // a | (b & c)
  w0 = _mm512_unpacklo_epi8(lo, hi);
  w1 = _mm512_unpackhi_epi8(lo, hi);
}

template <int M, int NB>
inline void int8_table_rows(const Int8Tables& t, const uint16_t* x, const int8_t* w, const float* s, float* y,
                            int64_t K, int64_t N, int64_t n, int64_t prefetch) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    __m512i w0[NB], w1[NB];
    for (int b = 0; b < NB; ++b) {
      const int8_t* p = w + (n + b) * K + k;
      if (prefetch) __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
      int8_table_words(t, _mm512_loadu_si512(p), w0[b], w1[b]);
    }
    for (int m = 0; m < M; ++m) {  // int8_gemv's order per accumulator: codes k .. k + 31, then k + 32 .. k + 63
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      const __m512bh x1 = (__m512bh)_mm512_loadu_si512(x + m * K + k + 32);
      for (int b = 0; b < NB; ++b) {
        acc[m][b] = _mm512_dpbf16_ps(acc[m][b], x0, (__m512bh)w0[b]);
        acc[m][b] = _mm512_dpbf16_ps(acc[m][b], x1, (__m512bh)w1[b]);
      }
    }
  }
  if (k + 32 <= K) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = load_w32(w + (n + b) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, (__m512bh)wv[b]);
    }
    k += 32;
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      vf a; std::memcpy(&a, &acc[m][b], 64);
      float r = hsum(a);
      for (int64_t kk = k; kk < K; ++kk) r = __builtin_fmaf(weight_value(x[m * K + kk]), weight_value(w[(n + b) * K + kk]), r);
      y[m * N + n + b] = r * s[n + b];
    }
}

template <int M, int NB>
void int8_table_impl(const uint16_t* x, const int8_t* w, const float* s, float* y, int64_t K, int64_t N,
                     int64_t prefetch) {
  const Int8Tables t = int8_tables();
  const int64_t blocks = N / NB;
  tgs::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) int8_table_rows<M, NB>(t, x, w, s, y, K, N, i * NB, prefetch);
  });
  for (int64_t n = blocks * NB; n < N; ++n) int8_table_rows<M, 1>(t, x, w, s, y, K, N, n, prefetch);
}
#endif

// The plain int8 codes of the table layout (its inverse, for builds and inputs the table kernel does not take).
torch::Tensor int8_table_unpack(const torch::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), full = K / 64 * 64;
  auto out = torch::empty_like(w);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>());
  int8_t* dst = out.data_ptr<int8_t>();
  tgs::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t k = 0; k < full; k += 64)
        for (int p = 0; p < 64; ++p) {
          const int lane = p / 16, o = p % 16;
          const int code = o < 8 ? 8 * lane + o : 32 + 8 * lane + o - 8;
          const uint8_t b = src[n * K + k + p];
          dst[n * K + k + code] = int8_t((b & 0x80) ? -int(b & 0x7F) : int(b & 0x7F));
        }
      for (int64_t k = full; k < K; ++k) dst[n * K + k] = int8_t(src[n * K + k]);
    }
  });
  return out;
}

}  // namespace

// The table layout of plain int8 codes w [N, K] (none -128; cpu_native.int8_table_pack checks) into out
// (int8 [N, K]), at load (torch's index ops took 1.2 s for a 151936 x 1536 head).
void int8_table_pack_into(torch::Tensor w, torch::Tensor out) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  TORCH_CHECK(out.sizes() == w.sizes() && out.scalar_type() == torch::kChar && out.is_contiguous(),
              "out must be contiguous int8 of w's shape");
  const int64_t N = w.size(0), K = w.size(1), full = K / 64 * 64;
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
  int order[64];
  for (int p = 0; p < 64; ++p) order[p] = p % 16 < 8 ? 8 * (p / 16) + p % 16 : 32 + 8 * (p / 16) + p % 16 - 8;
  tgs::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* row = src + n * K;
      uint8_t* to = dst + n * K;
      int64_t k = 0;
#if defined(INT8_TABLE_ISA)
      alignas(64) uint8_t idx[64];
      for (int p = 0; p < 64; ++p) idx[p] = uint8_t(order[p]);
      const __m512i index = _mm512_load_si512(idx), sign = _mm512_set1_epi8(char(0x80));
      for (; k < full; k += 64) {  // byte permute, |v| (no -128 here), the sign ORed back
        const __m512i v = _mm512_permutexvar_epi8(index, _mm512_loadu_si512(row + k));
        _mm512_storeu_si512(to + k, _mm512_ternarylogic_epi32(_mm512_abs_epi8(v), v, sign, 0xF8));
      }
#endif
      for (; k < full; k += 64)
        for (int p = 0; p < 64; ++p) {
          const int v = row[k + order[p]];
          to[k + p] = uint8_t(v < 0 ? 0x80 | -v : v);
        }
      for (k = full; k < K; ++k) to[k] = uint8_t(row[k]);
    }
  });
}

// x [M, K] bfloat16 or float32 (chunks of up to 8 rows) @ (w [N, K] in the table layout * s [N])^T ->
// [M, N] float32: int8_gemv's bits on the plain codes, in every build (the table kernel where it is
// built and x is bfloat16; elsewhere the codes are unpacked and int8_gemv's kernel runs).
torch::Tensor int8_table_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t prefetch) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K);
  TORCH_CHECK(s.scalar_type() == torch::kFloat && s.numel() == N && s.is_contiguous(), "s must be float32 [N]");
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0");
#if defined(INT8_TABLE_ISA)
  if (x.scalar_type() == torch::kBFloat16) {
    const int64_t M = x.size(0);
    auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const int8_t* wp = w.data_ptr<int8_t>();
    const float* sp = s.data_ptr<float>();
    for (int64_t m0 = 0; m0 < M; m0 += 8) {  // int8_gemv's chunks and tiles (bx_row_tiles)
      const uint16_t* xm = xp + m0 * K;
      float* ym = y.data_ptr<float>() + m0 * N;
      bx_row_tiles(std::min<int64_t>(8, M - m0), [&](auto rows, auto outputs) {
        int8_table_impl<decltype(rows)::value, decltype(outputs)::value>(xm, wp, sp, ym, K, N, prefetch);
      });
    }
    return y;
  }
#endif
  const torch::Tensor plain = int8_table_unpack(w);
  return gemv_any<int8_t>(x, plain.data_ptr<int8_t>(), s.data_ptr<float>(), N, K, prefetch);
}

// Rows n0..n1 of a table-layout int8 weight as bfloat16 [n1 - n0, K]: w * s, int8_dequant's bits on the
// plain codes (the table's words are the codes' exact values; the same product and rounding follow).
torch::Tensor int8_table_dequant(torch::Tensor w, torch::Tensor s, int64_t n0, int64_t n1) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t K = w.size(1);
  TORCH_CHECK(K % 16 == 0 && 0 <= n0 && n0 < n1 && n1 <= w.size(0), "bad rows or K");
  TORCH_CHECK(s.scalar_type() == torch::kFloat && s.numel() == w.size(0) && s.is_contiguous(), "s must be float32 [N]");
#if defined(INT8_TABLE_ISA)
  auto out = torch::empty({n1 - n0, K}, w.options().dtype(torch::kBFloat16));
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t full = K / 64 * 64;
  tgs::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    const Int8Tables t = int8_tables();
    for (int64_t n = a; n < b; ++n) {
      const vf scale_v = splat(sp[n]);
      uint16_t* row = op + (n - n0) * K;
      for (int64_t k = 0; k < full; k += 64) {
        __m512i words[2];
        int8_table_words(t, _mm512_loadu_si512(wp + n * K + k), words[0], words[1]);
        for (int q = 0; q < 4; ++q) {  // 16 codes: bfloat16 bits widened to float32 (exact), times the scale
          const __m256i half = q % 2 ? _mm512_extracti64x4_epi64(words[q / 2], 1) : _mm512_castsi512_si256(words[q / 2]);
          const vf v = from_m512(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
          store_bf16(row + k + 16 * q, v * scale_v);
        }
      }
      for (int64_t k = full; k < K; k += 16) store_bf16(row + k, load_i8(wp + n * K + k) * scale_v);
    }
  });
  return out;
#else
  return int8_dequant(int8_table_unpack(w.slice(0, n0, n1).contiguous()), s.slice(0, n0, n1).contiguous(), 0, n1 - n0);
#endif
}

// Whether int8_table_gemv has its table kernel in this build (AVX512-BF16 and AVX512-VBMI): 1, else 0
// (it still gives int8_gemv's bits, through an unpacked copy of the codes: the layout is not worth it).
int64_t int8_table_isa() {
#if defined(INT8_TABLE_ISA)
  return 1;
#else
  return 0;
#endif
}
"""

FUNCTIONS = ["int4_q8_mm", "int4_q8_linear", "int4_q8_mm_generic", "int4_q8_tiled_mm", "int4_q8_tiled_linear", "int4_q8_isa", "int8_q8_gemv", "int8_q8_isa", "int8_table_gemv", "int8_table_dequant", "int8_table_pack_into", "int8_table_isa"]
