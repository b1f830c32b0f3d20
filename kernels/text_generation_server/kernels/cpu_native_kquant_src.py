"""C++ source of the native kernels that read GGUF's Q4_K and Q6_K blocks in place (cpu_kquant.py).

Why: decoding K-quant blocks into our canonical forms at load took most of a GGUF start (45 s on
the 1.1 GB Qwen2.5-Coder-1.5B Q4_K_M file) and the canonical forms read more bytes per decode step
than the blocks (Q4_K's scales and minimums as float32 per 32 columns). These kernels take the
stored bytes as they lie (a view of the mmapped file, or a copy of this rank's rows), so nothing is
decoded at load, and a step reads exactly the file's bytes, as llama.cpp does.

The arithmetic is llama.cpp's for these files (ggml's quantize_row_q8_K_ref and the
ggml_vec_dot_q4_K_q8_K / q6_K_q8_K dot products; read from its source, not copied): each 256-wide
block of an activation row is quantized to int8 (Q8_K: iscale = -127 / the value of largest
magnitude, codes round(iscale * x) to nearest even, at most 127, d = 1 / iscale, plus the sums of
every 16 codes), and a weight block's product with it is formed in integers and scaled once:

  Q4_K: w = d * sc_j * q - dmin * m_j  (q 4-bit, sc_j, m_j 6-bit, j the 32-column sub-block)
        dot = d * dy * sum_j sc_j * sum(q * q8) - dmin * dy * sum_j m_j * bsum32_j
  Q6_K: w = d * sc_g * (q - 32)        (q 6-bit, sc_g int8, g the 16-column group)
        dot = d * dy * (sum_g sc_g * sum(q * q8) - 32 * sum_g sc_g * bsum16_g)

The integer sums are exact (|sum| < 2^31 for either format); the float terms are summed per block
in 16 lanes (AVX-512BW) or 8 (AVX2) and the lanes in one fixed order. A row's result does not
depend on the rows beside it, the number of rows or the thread split (each output's sums are one
row's alone).

AVX-512BW code where the build has it (64 bytes of blocks per instruction; about twice the AVX2
code's speed on Q6_K, the same on Q4_K at one thread of the 2-core EPYC), AVX2 code under __AVX2__
(`--cpu-isa avx2`), elsewhere scalar loops of the same integer arithmetic (correct, slow:
`kquant_native_isa` says which).
`kquant_dequant` writes blocks as float32 or bfloat16 with ggml's dequantize_row_q4_K / q6_K
roundings ((d * sc) * q, then minus dmin * m, each rounded: never fused), for dense reads
(embeddings) and the float reference.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace tgs_kquant {

constexpr int64_t QK = 256;
constexpr int64_t Q4K_BYTES = 144;  // d, dmin (fp16), 12 bytes of packed 6-bit scales and minimums, 128 of nibbles
constexpr int64_t Q6K_BYTES = 210;  // 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16)

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K's 12 bytes: eight 6-bit scales and eight 6-bit minimums (ggml's get_scale_min_k4), four
// bytes at a time: scale j < 4 is byte j's low 6 bits, minimum j < 4 byte j + 4's; scale j >= 4 is
// byte j + 4's low nibble under byte j - 4's top 2 bits, minimum j >= 4 byte j + 4's high nibble
// under byte j's top 2 bits.
inline void scale_min_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  uint32_t w[3];
  std::memcpy(w, q, 12);
  const uint32_t low6 = 0x3F3F3F3Fu, nib = 0x0F0F0F0Fu, top2 = 0x03030303u;
  const uint32_t s[2] = {w[0] & low6, (w[2] & nib) | (((w[0] >> 6) & top2) << 4)};
  const uint32_t m[2] = {w[1] & low6, ((w[2] >> 4) & nib) | (((w[1] >> 6) & top2) << 4)};
  std::memcpy(sc, s, 8);
  std::memcpy(mn, m, 8);
}

struct Act {  // activation rows quantized to Q8_K
  const int8_t* q;   // [M, K]
  const float* d;    // [M, K / 256]
  const int32_t* s;  // [M, K / 16]: sums of every 16 codes
};

struct Args {
  Act x;
  const uint8_t* w;  // [N, row_bytes]
  float* y;          // [M, N]
  int64_t M, K, N, row_bytes, nb, prefetch;
};

// Asks for the cache lines `prefetch` bytes past a block (0: none; cpu_kquant.PREFETCH_BYTES says why).
inline void prefetch_block(const Args& a, const uint8_t* blk, int64_t bytes) {
#if defined(__AVX2__)
  if (a.prefetch) {
    const char* p = reinterpret_cast<const char*>(blk) + a.prefetch;
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T0);
  }
#endif
}

#if defined(__AVX2__)
inline float hsum8(__m256 v) {  // lanes summed in one fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Output n for rows m0 .. m0 + R - 1 (R <= 8): one pass over the weight row, shared by the rows.
template <int R>
void q4k_rows(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.w + n * a.row_bytes;
#if defined(__AVX2__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
#else
  float acc[R], mins[R];
  for (int r = 0; r < R; ++r) acc[r] = mins[r] = 0.f;
#endif
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * Q4K_BYTES;
    prefetch_block(a, blk, Q4K_BYTES);
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(blk + 4, sc, mn);
    const uint8_t* qs = blk + 16;
#if defined(__AVX2__)
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      const __m256i s0 = _mm256_set1_epi16(sc[2 * j]), s1 = _mm256_set1_epi16(sc[2 * j + 1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.x.q + (m0 + r) * a.K + b * QK + 64 * j;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s1);
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p0, p1));
      }
    }
#endif
#if defined(__AVX2__)
    // the minimums' term per 32-column sub-block: m_j * (sum of its 32 codes), in integers
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const float dy = a.x.d[m * a.nb + b];
      const int32_t* bs = a.x.s + m * (a.K / 16) + b * 16;
      const __m256i pairs = _mm256_permute4x64_epi64(
          _mm256_hadd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 8))), 0xD8);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * dy), _mm256_cvtepi32_ps(_mm256_mullo_epi32(mins, pairs)), acc[r]);
    }
#else
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const float dy = a.x.d[m * a.nb + b];
      const int32_t* bs = a.x.s + m * (a.K / 16) + b * 16;
      int32_t msum = 0;
      for (int j = 0; j < 8; ++j) msum += int32_t(mn[j]) * (bs[2 * j] + bs[2 * j + 1]);
      mins[r] += dmin * dy * float(msum);
      const int8_t* xq = a.x.q + m * a.K + b * QK;
      int32_t isum = 0;
      for (int j = 0; j < 4; ++j) {
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < 32; ++l) {
          s0 += int32_t(qs[32 * j + l] & 0xF) * xq[64 * j + l];
          s1 += int32_t(qs[32 * j + l] >> 4) * xq[64 * j + 32 + l];
        }
        isum += s0 * sc[2 * j] + s1 * sc[2 * j + 1];
      }
      acc[r] += d * dy * float(isum);
    }
#endif
  }
  for (int r = 0; r < R; ++r) {
#if defined(__AVX2__)
    a.y[(m0 + r) * a.N + n] = hsum8(acc[r]);
#else
    a.y[(m0 + r) * a.N + n] = acc[r] - mins[r];
#endif
  }
}

template <int R>
void q6k_rows(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.w + n * a.row_bytes;
#if defined(__AVX2__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
#else
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#endif
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * Q6K_BYTES;
    prefetch_block(a, blk, Q6K_BYTES);
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_to_float(blk + 208);
#if defined(__AVX2__)
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
      const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
      const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      // element 128h + 32t + l: ql nibble (A for t even, B odd; low for t < 2) | ((qh >> 2t) & 3) << 4
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(A, low), _mm256_slli_epi16(_mm256_and_si256(H, two), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(B, low),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 2), two), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 4), two), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(H, 6), two), 4));
      for (int t = 0; t < 4; ++t) {
        const int g = 8 * h + 2 * t;  // groups g (elements 0-15 of the 32) and g + 1 (16-31)
        const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.x.q + (m0 + r) * a.K + b * QK + 128 * h + 32 * t;
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], x), s));
        }
      }
    }
#endif
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const float dy = a.x.d[m * a.nb + b];
      const int32_t* bs = a.x.s + m * (a.K / 16) + b * 16;
      int32_t corr = 0;
      for (int g = 0; g < 16; ++g) corr += int32_t(sc[g]) * bs[g];
#if defined(__AVX2__)
      // the codes' offset of 32, subtracted in integers (lane 0) before the block's one scaling
      const __m256i total = _mm256_sub_epi32(isum[r], _mm256_setr_epi32(32 * corr, 0, 0, 0, 0, 0, 0, 0));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(total), acc[r]);
#else
      const int8_t* xq = a.x.q + m * a.K + b * QK;
      int32_t isum = 0;
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t)
          for (int l = 0; l < 32; ++l) {
            const uint8_t lo = ql[64 * h + 32 * (t % 2) + l];
            const int32_t q = ((t < 2 ? lo : lo >> 4) & 0xF) | (((qh[32 * h + l] >> (2 * t)) & 3) << 4);
            isum += q * xq[128 * h + 32 * t + l] * sc[8 * h + 2 * t + l / 16];
          }
      acc[r] += d * dy * float(isum - 32 * corr);
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
#if defined(__AVX2__)
    a.y[(m0 + r) * a.N + n] = hsum8(acc[r]);
#else
    a.y[(m0 + r) * a.N + n] = acc[r];
#endif
  }
}

#if defined(__AVX512BW__)
// The same arithmetic 64 bytes at a time (AVX-512BW builds). Q4_K: a 64-byte load of nibbles holds
// sub-blocks 2j (low nibbles, bytes 0-31) and 2j + 2 (32-63) and, in its high nibbles, 2j + 1 and 2j + 3;
// 128-bit lanes are regrouped so one register holds two consecutive sub-blocks, against 64 contiguous
// activation codes. Each sub-block's integer sum is scaled by its 6-bit scale in int16 x int16 -> int32
// (madd), as in the AVX2 code; the block's sum is then scaled once.
template <int R>
void q4k_rows512(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.w + n * a.row_bytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  // int16 lane i of scale vector p takes sub-block 2p + i / 16
  __m512i pick[4];
  for (int p = 0; p < 4; ++p) {
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = int16_t(2 * p + i / 16);
    pick[p] = _mm512_load_si512(idx);
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * Q4K_BYTES;
    prefetch_block(a, blk, Q4K_BYTES);
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(blk + 4, sc, mn);
    const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
    __m512i q[4], s[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * h);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      q[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);      // sub-blocks 4h, 4h + 1
      q[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // 4h + 2, 4h + 3
    }
    for (int p = 0; p < 4; ++p) s[p] = _mm512_permutexvar_epi16(pick[p], sc16);
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xq = a.x.q + m * a.K + b * QK;
      __m512i isum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) {
        const __m512i x = _mm512_loadu_si512(xq + 64 * p);
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(q[p], x), s[p]));
      }
      const float dy = a.x.d[m * a.nb + b];
      const int32_t* bs = a.x.s + m * (a.K / 16) + b * 16;
      const __m256i pairs = _mm256_permute4x64_epi64(
          _mm256_hadd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 8))), 0xD8);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * dy), _mm512_cvtepi32_ps(isum), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(dmin * dy),
                                _mm512_cvtepi32_ps(_mm512_zextsi256_si512(_mm256_mullo_epi32(mins, pairs))), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(acc[r]);
}

// Q6_K: a 64-byte load of low nibbles holds elements 128h + 0..63 (low nibbles) and 128h + 64..127
// (high nibbles), in order; their high bit pairs come from the 32 bytes of qh, shifted per 32.
template <int R>
void q6k_rows512(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.w + n * a.row_bytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  __m512i pick[4];  // int16 lane i of scale vector p takes group 4p + i / 8
  for (int p = 0; p < 4; ++p) {
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = int16_t(4 * p + i / 8);
    pick[p] = _mm512_load_si512(idx);
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * Q6K_BYTES;
    prefetch_block(a, blk, Q6K_BYTES);
    const float d = half_to_float(blk + 208);
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
    const __m512i sc32 = _mm512_cvtepi8_epi32(sc8);
    __m512i q[4], s[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i A = _mm512_loadu_si512(blk + 64 * h);
      const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      const __m512i Hz = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
      q[2 * h] = _mm512_or_si512(_mm512_and_si512(A, low), _mm512_slli_epi16(_mm512_and_si512(Hz, two), 4));
      q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), low),
                                     _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(Hz, 4), two), 4));
    }
    for (int p = 0; p < 4; ++p) s[p] = _mm512_permutexvar_epi16(pick[p], sc16);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xq = a.x.q + m * a.K + b * QK;
      // the codes' offset of 32: 32 * sum_g sc_g * (sum of group g's 16 codes), subtracted in integers
      const __m512i bs = _mm512_loadu_si512(a.x.s + m * (a.K / 16) + b * 16);
      __m512i isum = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_mullo_epi32(sc32, bs), 5));
      for (int p = 0; p < 4; ++p) {
        const __m512i x = _mm512_loadu_si512(xq + 64 * p);
        isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(q[p], x), s[p]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d * a.x.d[m * a.nb + b]), _mm512_cvtepi32_ps(isum), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) a.y[(m0 + r) * a.N + n] = _mm512_reduce_add_ps(acc[r]);
}
#endif

template <bool Q4>
void rows_dispatch(const Args& a, int64_t n, int64_t m0, int64_t r) {
#if defined(__AVX512BW__)
#define TGS_KQ_CASE(R) case R: if (Q4) q4k_rows512<R>(a, n, m0); else q6k_rows512<R>(a, n, m0); break;
#else
#define TGS_KQ_CASE(R) case R: if (Q4) q4k_rows<R>(a, n, m0); else q6k_rows<R>(a, n, m0); break;
#endif
  switch (r) {
    TGS_KQ_CASE(1) TGS_KQ_CASE(2) TGS_KQ_CASE(3) TGS_KQ_CASE(4)
    TGS_KQ_CASE(5) TGS_KQ_CASE(6) TGS_KQ_CASE(7) default: TGS_KQ_CASE(8)
  }
#undef TGS_KQ_CASE
}

template <bool Q4>
void run(const Args& a) {
  // Outputs split among threads; each output's rows go in passes of up to 8 while its weight row
  // is in cache, so the weights come from memory once whatever the number of rows.
  const int64_t grain = std::max<int64_t>(1, 16 / ((a.M + 7) / 8));
  at::parallel_for(0, a.N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m0 = 0; m0 < a.M; m0 += 8) rows_dispatch<Q4>(a, n, m0, std::min<int64_t>(8, a.M - m0));
  });
}

inline int64_t block_bytes(int64_t type) {
  TORCH_CHECK(type == 12 || type == 14, "K-quant type must be 12 (Q4_K) or 14 (Q6_K), got ", type);
  return type == 12 ? Q4K_BYTES : Q6K_BYTES;
}

}  // namespace tgs_kquant

// x float32 [M, K] (K a multiple of 256) -> [codes int8 [M, K], d float32 [M, K / 256], sums of every
// 16 codes int32 [M, K / 16]]: ggml's Q8_K rule (see the module docstring).
std::vector<torch::Tensor> kquant_quantize_q8k(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 256 == 0, "K = ", K, " is not a multiple of 256");
  auto q = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto d = torch::empty({M, K / 256}, x.options());
  auto s = torch::empty({M, K / 16}, x.options().dtype(torch::kInt));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int32_t* sp = s.data_ptr<int32_t>();
  const int64_t nb = K / 256;
  at::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* v = xp + i * 256;
      int8_t* o = qp + i * 256;
      float amax = 0.f, max = 0.f;
      for (int j = 0; j < 256; ++j) {
        const float ax = std::fabs(v[j]);
        if (ax > amax) { amax = ax; max = v[j]; }
      }
      if (amax == 0.f) {
        dp[i] = 0.f;
        std::memset(o, 0, 256);
        for (int g = 0; g < 16; ++g) sp[i * 16 + g] = 0;
        continue;
      }
      const float iscale = -127.f / max;
      for (int j = 0; j < 256; ++j) {
        const int c = int(std::nearbyint(iscale * v[j]));  // to nearest even (the default rounding mode)
        o[j] = int8_t(c < 127 ? c : 127);
      }
      for (int g = 0; g < 16; ++g) {
        int32_t sum = 0;
        for (int l = 0; l < 16; ++l) sum += o[16 * g + l];
        sp[i * 16 + g] = sum;
      }
      dp[i] = 1.f / iscale;
    }
  });
  return {q, d, s};
}

// Q8_K activations (kquant_quantize_q8k's three tensors) @ W^T, W the K-quant blocks w [N, K / 256 *
// block bytes] uint8 of `type` (12: Q4_K, 14: Q6_K): [M, N] float32, any M; weights prefetched
// `prefetch` bytes ahead (0: not at all; the distance changes no bit of the result).
torch::Tensor kquant_mm(torch::Tensor q, torch::Tensor d, torch::Tensor s, torch::Tensor w, int64_t type,
                        int64_t prefetch) {
  const int64_t bytes = tgs_kquant::block_bytes(type);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "codes must be contiguous int8 [M, K]");
  const int64_t M = q.size(0), K = q.size(1), nb = K / 256;
  TORCH_CHECK(K % 256 == 0 && K > 0, "K = ", K, " is not a positive multiple of 256");
  TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == M * nb, "d must be float32 [M, K / 256]");
  TORCH_CHECK(s.scalar_type() == torch::kInt && s.is_contiguous() && s.numel() == M * (K / 16), "sums must be int32 [M, K / 16]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.size(1) == nb * bytes && w.stride(1) == 1,
              "blocks must be uint8 [N, ", nb * bytes, "] with contiguous rows");
  const int64_t N = w.size(0);
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0");
  auto y = torch::empty({M, N}, q.options().dtype(torch::kFloat));
  if (M == 0 || N == 0) return y;
  tgs_kquant::Args a{{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>()}, w.data_ptr<uint8_t>(),
                     y.data_ptr<float>(), M, K, N, w.stride(0), nb, prefetch};
  if (type == 12)
    tgs_kquant::run<true>(a);
  else
    tgs_kquant::run<false>(a);
  return y;
}

// Rows n0 .. n1 of the blocks w as values into out (float32 or bfloat16 [n1 - n0, K], contiguous), with
// ggml's roundings: (d * sc) * q, then - (dmin * m) (Q4_K), or (d * sc) * (q - 32) (Q6_K), each product
// rounded to float32 (never fused), then to bfloat16 to nearest even.
__attribute__((optimize("fp-contract=off")))
void kquant_dequant(torch::Tensor w, int64_t type, int64_t n0, int64_t n1, torch::Tensor out) {
  const int64_t bytes = tgs_kquant::block_bytes(type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.size(1) % bytes == 0 && w.stride(1) == 1,
              "blocks must be uint8 [N, blocks * ", bytes, "] with contiguous rows");
  const int64_t nb = w.size(1) / bytes, K = nb * 256;
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= w.size(0), "bad rows ", n0, "..", n1);
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || out.scalar_type() == torch::kFloat) && out.is_contiguous() && out.numel() == (n1 - n0) * K,
              "out must be contiguous float32 or bfloat16 [", n1 - n0, ", ", K, "]");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t stride = w.stride(0);
  float* op = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* hp = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    float vals[256];
    for (int64_t n = a; n < b; ++n) {
      for (int64_t blk_i = 0; blk_i < nb; ++blk_i) {
        const uint8_t* blk = wp + n * stride + blk_i * bytes;
        if (type == 12) {
          const float d = tgs_kquant::half_to_float(blk), dmin = tgs_kquant::half_to_float(blk + 2);
          uint8_t sc[8], mn[8];
          tgs_kquant::scale_min_k4(blk + 4, sc, mn);
          for (int j = 0; j < 4; ++j) {
            const float d0 = d * sc[2 * j], m0 = dmin * mn[2 * j], d1 = d * sc[2 * j + 1], m1 = dmin * mn[2 * j + 1];
            for (int l = 0; l < 32; ++l) {
              const uint8_t v = blk[16 + 32 * j + l];
              vals[64 * j + l] = d0 * float(v & 0xF) - m0;
              vals[64 * j + 32 + l] = d1 * float(v >> 4) - m1;
            }
          }
        } else {
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
          const float d = tgs_kquant::half_to_float(blk + 208);
          for (int h = 0; h < 2; ++h)
            for (int t = 0; t < 4; ++t)
              for (int l = 0; l < 32; ++l) {
                const uint8_t lo = blk[64 * h + 32 * (t % 2) + l];
                const int q = ((t < 2 ? lo : lo >> 4) & 0xF) | (((blk[128 + 32 * h + l] >> (2 * t)) & 3) << 4);
                vals[128 * h + 32 * t + l] = (d * float(sc[8 * h + 2 * t + l / 16])) * float(q - 32);
              }
        }
        const int64_t at_ = (n - n0) * K + blk_i * 256;
        if (bf16) {
          for (int j = 0; j < 256; ++j) {
            uint32_t u;
            std::memcpy(&u, &vals[j], 4);
            hp[at_ + j] = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
          }
        } else {
          std::memcpy(op + at_, vals, sizeof(vals));
        }
      }
    }
  });
}

// Whether kquant_mm was built with its AVX2 code (else the scalar loops: correct, slow).
int64_t kquant_native_isa() {
#if defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}
"""

FUNCTIONS = ["kquant_quantize_q8k", "kquant_mm", "kquant_dequant", "kquant_native_isa"]


def with_kquant_kernels(source: str, functions: list[str]) -> tuple[str, list[str]]:
    """cpu_native's source and function list with these kernels added (one extension, one build)."""
    return source + SOURCE, [*functions, *FUNCTIONS]
