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

The integer sums are exact (|sum| < 2^31 for either format) and each block's are scaled in one
fixed order per row and output (the comment above q4k_rows writes it out), so every code path
gives the same bits: a row's result does not depend on the rows beside it, the number of rows, the
thread split or the instruction set (tests/test_gguf_kquant.py compares the AVX2 build with the
AVX-512 one; the scalar build, compiled with -mno-avx2 -mno-fma, also matched it bit for bit when
this was written).

AVX-512BW builds also read a packed form (kquant_pack, converted at load by cpu_kquant.KQuantLinear;
pack_blocks below says the layout): 16 outputs' blocks interleaved so that dpbusd keeps one output per
lane at every row count, which reads at memory speed at one row where the tiled code on the file's
layout was compute-bound; from GEMM_ROWS rows its tiles are widened into the prompt path's form.
On the file's layout, AVX-512BW code where the build has it (VNNI's dpwssd / dpbusd where it has that too): outputs in
tiles of 16, rows in passes of up to 8, each block's integer sums per output brought into one lane
per output so the float steps serve 16 outputs at once; from GEMM_ROWS rows a tile's blocks are
first decoded into a lane-per-output form that every row reads (prompts). AVX2 code under __AVX2__
(`--cpu-isa avx2`: an output at a time, rows in passes of 8), elsewhere scalar loops of the same
arithmetic (correct, slow: `kquant_native_isa` says which). BENCHMARKS.md "Round 3: tiled K-quant
kernels" has the figures.
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
#include <vector>
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
  float* y;          // [M, ldy] float32, or
  uint16_t* yh;      // [M, ldy] bfloat16 (one of the two is set)
  int64_t M, K, N, row_bytes, nb, prefetch, ldy;
};

// bfloat16 bits of f, rounded to nearest even as torch rounds float32 (a NaN stays a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline void store1(const Args& a, int64_t m, int64_t n, float v) {
  if (a.yh)
    a.yh[m * a.ldy + n] = to_bf16(v);
  else
    a.y[m * a.ldy + n] = v;
}

// Asks for the cache lines `prefetch` bytes past a block (0: none; cpu_kquant.PREFETCH_BYTES says why).
inline void prefetch_block(const Args& a, const uint8_t* blk, int64_t bytes) {
#if defined(__AVX2__)
  if (a.prefetch) {
    const char* p = reinterpret_cast<const char*>(blk) + a.prefetch;
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T0);
  }
#endif
}

#if defined(__AVX512BW__)
// The block at `next` into L1, every line of it (a block is not line-aligned). With several rows
// the tiled code spends long enough on each tile that the hardware prefetcher falls behind, so each
// block asks for the same block of the next tile's row (one tile ahead); at one row it hinders.
inline void prefetch_next(const uint8_t* next, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(next);
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T0);
  _mm_prefetch(p + bytes - 1, _MM_HINT_T0);
}
#endif

// The arithmetic every build computes, per activation row m and output n, in this order (so a row's
// bits depend on nothing but its own values and the weights: not its batch, the thread split, the
// tiling or the instruction set):
//   acc = 0; for each block b in order:
//     Q4_K: acc = fma(d * dy, float(I), acc); acc = fma(-(dmin * dy), float(Mn), acc)
//     Q6_K: acc = fma(d * dy, float(I - 32 * C), acc)
//   y = acc
// I = sum_j sc_j * sum(q * q8) (sub-blocks j), Mn = sum_j m_j * bsum32_j, C = sum_g sc_g * bsum16_g:
// exact integer sums, which each build forms its own way (lanes, tiles) without changing them.

inline int32_t q4k_mins(const uint8_t* mn, const int32_t* bs) {
  int32_t s = 0;
  for (int j = 0; j < 8; ++j) s += int32_t(mn[j]) * (bs[2 * j] + bs[2 * j + 1]);
  return s;
}

inline int32_t q6k_offset(const int8_t* sc, const int32_t* bs) {
  int32_t s = 0;
  for (int g = 0; g < 16; ++g) s += int32_t(sc[g]) * bs[g];
  return s;
}

#if defined(__AVX2__)
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif

// Output n for rows m0 .. m0 + R - 1 (R <= 8), AVX2 or scalar code: one pass over the weight row, each
// block's codes unpacked once for the R rows, its integer sums scaled in the order above.
template <int R>
void q4k_rows(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.w + n * a.row_bytes;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(0x0F);
#endif
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * Q4K_BYTES;
    prefetch_block(a, blk, Q4K_BYTES);
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(blk + 4, sc, mn);
    const uint8_t* qs = blk + 16;
    int32_t isum[R];
#if defined(__AVX2__)
    __m256i vsum[R];
    for (int r = 0; r < R; ++r) vsum[r] = _mm256_setzero_si256();
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
        vsum[r] = _mm256_add_epi32(vsum[r], _mm256_add_epi32(p0, p1));
      }
    }
    for (int r = 0; r < R; ++r) isum[r] = hsum8_epi32(vsum[r]);
#else
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = a.x.q + (m0 + r) * a.K + b * QK;
      isum[r] = 0;
      for (int j = 0; j < 4; ++j) {
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < 32; ++l) {
          s0 += int32_t(qs[32 * j + l] & 0xF) * xq[64 * j + l];
          s1 += int32_t(qs[32 * j + l] >> 4) * xq[64 * j + 32 + l];
        }
        isum[r] += s0 * sc[2 * j] + s1 * sc[2 * j + 1];
      }
    }
#endif
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const float dy = a.x.d[m * a.nb + b];
      const int32_t mins = q4k_mins(mn, a.x.s + m * (a.K / 16) + b * 16);
      acc[r] = std::fma(d * dy, float(isum[r]), acc[r]);
      acc[r] = std::fma(-(dmin * dy), float(mins), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store1(a, m0 + r, n, acc[r]);
}

template <int R>
void q6k_rows(const Args& a, int64_t n, int64_t m0) {
  const uint8_t* row = a.w + n * a.row_bytes;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
#endif
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = row + b * Q6K_BYTES;
    prefetch_block(a, blk, Q6K_BYTES);
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_to_float(blk + 208);
    int32_t isum[R];
#if defined(__AVX2__)
    __m256i vsum[R];
    for (int r = 0; r < R; ++r) vsum[r] = _mm256_setzero_si256();
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
          vsum[r] = _mm256_add_epi32(vsum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[t], x), s));
        }
      }
    }
    for (int r = 0; r < R; ++r) isum[r] = hsum8_epi32(vsum[r]);
#else
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = a.x.q + (m0 + r) * a.K + b * QK;
      isum[r] = 0;
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t)
          for (int l = 0; l < 32; ++l) {
            const uint8_t lo = ql[64 * h + 32 * (t % 2) + l];
            const int32_t q = ((t < 2 ? lo : lo >> 4) & 0xF) | (((qh[32 * h + l] >> (2 * t)) & 3) << 4);
            isum[r] += q * xq[128 * h + 32 * t + l] * sc[8 * h + 2 * t + l / 16];
          }
    }
#endif
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const float dy = a.x.d[m * a.nb + b];
      const int32_t corr = q6k_offset(sc, a.x.s + m * (a.K / 16) + b * 16);
      acc[r] = std::fma(d * dy, float(isum[r] - 32 * corr), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store1(a, m0 + r, n, acc[r]);
}

#if defined(__AVX512BW__)
// AVX-512BW code: outputs in tiles of 16, rows in passes of up to 8. Each output's block is unpacked
// once for the pass (64 bytes of codes per instruction) and multiplied with each row's codes into 16
// int32 lanes; then, per row, the tile's 16 lane vectors are summed into one vector holding an output
// per lane (lane_sums16), where the minimums' term (dpwssd on int16 pairs) and the block's float
// scaling are one instruction for all 16 outputs instead of a dozen per output and row.
constexpr int TILE = 16;

// acc + the int16 pair sums of u8 codes q times s8 codes x (maddubs; |pair| <= 2 * 63 * 128 < 2^15),
// each int16 times its scale s, pairs summed into int32 (VNNI's dpwssd where the build has it).
inline __m512i dot64(__m512i acc, __m512i q, __m512i x, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, x), s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), s));
#endif
}

inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// v: 16 vectors of 16 int32 (64-byte aligned) -> lane i = the sum of vector i's lanes (integers: exact).
inline __m512i lane_sums16(const int32_t* v) {
  __m512i u[8], w[4];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: [A0+A2, B0+B2, A1+A3, B1+B3] of vectors 2k, 2k + 1
    const __m512i A = _mm512_load_si512(v + 32 * k), B = _mm512_load_si512(v + 32 * k + 16);
    u[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(A, B), _mm512_unpackhi_epi32(A, B));
  }
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: that lane's sums of vectors 4k .. 4k + 3
    w[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(u[2 * k], u[2 * k + 1]), _mm512_unpackhi_epi64(u[2 * k], u[2 * k + 1]));
  const __m512i x0 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], 0x88), _mm512_shuffle_i32x4(w[0], w[1], 0xDD));
  const __m512i x1 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[2], w[3], 0x88), _mm512_shuffle_i32x4(w[2], w[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, 0x88), _mm512_shuffle_i32x4(x0, x1, 0xDD));
}

// Lanes `keep` of v to row m, outputs n0 ..: float32, or bfloat16 rounded as to_bf16 rounds.
inline void store16(const Args& a, int64_t m, int64_t n0, __mmask16 keep, __m512 v) {
  if (!a.yh) {
    _mm512_mask_storeu_ps(a.y + m * a.ldy + n0, keep, v);
    return;
  }
  const __m512i u = _mm512_castps_si512(v);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i bits = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(a.yh + m * a.ldy + n0, keep, _mm512_cvtepi32_epi16(bits));
}

// Q4_K: a 64-byte load of nibbles holds sub-blocks 2j (low nibbles, bytes 0-31) and 2j + 2 (32-63) and,
// in its high nibbles, 2j + 1 and 2j + 3; 128-bit lanes are regrouped so one register holds two
// consecutive sub-blocks, against 64 contiguous activation codes. `pairs` holds each row's 32-column
// code sums per block as int16 pairs ([M, nb, 4]: dword t = bsum32_2t | bsum32_2t+1 << 16).
// Blocks a tile takes per chunk: each output's row is read a chunk at a time, in order (the hardware
// prefetcher follows that, not 16 rows read a block each, which halved the Q6_K head's speed from
// memory), while the chunk's integer sums wait in isum (32 KiB whatever R).
template <int R>
constexpr int chunk_blocks() { return R == 1 ? 32 : (R == 2 ? 16 : (R <= 4 ? 8 : 4)); }

template <int R>
void q4k_tile512(const Args& a, const int32_t* pairs, int64_t n0, int nt, int64_t m0) {
  constexpr int BC = chunk_blocks<R>();
  alignas(64) int32_t isum[BC][R][TILE][16];
  alignas(64) int32_t mp[BC][TILE][4];  // each output's eight minimums as int16 pairs
  alignas(64) uint16_t dh[BC][TILE], mh[BC][TILE];  // each output's d and dmin (fp16)
  if (nt < TILE) {  // lanes past the tile's outputs: zeros, never stored
    std::memset(isum, 0, sizeof(isum));
    std::memset(mp, 0, sizeof(mp));
    std::memset(dh, 0, sizeof(dh));
    std::memset(mh, 0, sizeof(mh));
  }
  const __mmask16 keep = __mmask16((1u << nt) - 1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i pick[4], idx[4];
  for (int p = 0; p < 4; ++p) {
    alignas(64) int16_t pk[32];  // int16 lane i of scale vector p takes sub-block 2p + i / 16
    alignas(64) int32_t ix[16];  // lane i < 8: dword p of output i of two consecutive 4-output rows of mp
    for (int i = 0; i < 32; ++i) pk[i] = int16_t(2 * p + i / 16);
    for (int i = 0; i < 16; ++i) ix[i] = 4 * (i % 8) + p;
    pick[p] = _mm512_load_si512(pk);
    idx[p] = _mm512_load_si512(ix);
  }
  const uint8_t* tile = a.w + n0 * a.row_bytes;
  for (int64_t b0 = 0; b0 < a.nb; b0 += BC) {
    const int bn = int(std::min<int64_t>(BC, a.nb - b0));
    for (int i = 0; i < nt; ++i) {
      for (int c = 0; c < bn; ++c) {
        const int64_t b = b0 + c;
        const uint8_t* blk = tile + i * a.row_bytes + b * Q4K_BYTES;
        prefetch_block(a, blk, Q4K_BYTES);
        if (R > 1) prefetch_next(blk + TILE * a.row_bytes, Q4K_BYTES);  // one row: the hardware's alone
        std::memcpy(&dh[c][i], blk, 2);
        std::memcpy(&mh[c][i], blk + 2, 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(blk + 4, sc, mn);
        _mm_store_si128(reinterpret_cast<__m128i*>(mp[c][i]), _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))));
        const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
        __m512i q[4], s[4];
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * h);
          const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          q[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);      // sub-blocks 4h, 4h + 1
          q[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // 4h + 2, 4h + 3
        }
        for (int p = 0; p < 4; ++p) s[p] = _mm512_permutexvar_epi16(pick[p], sc16);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.x.q + (m0 + r) * a.K + b * QK;
          __m512i v = _mm512_setzero_si512();
          for (int p = 0; p < 4; ++p) v = dot64(v, q[p], _mm512_loadu_si512(xq + 64 * p), s[p]);
          _mm512_store_si512(isum[c][r][i], v);
        }
      }
    }
    for (int c = 0; c < bn; ++c) {  // the chunk's blocks in order: the float steps' order
      const int64_t b = b0 + c;
      const __m512 dv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh[c])));
      const __m512 dmv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mh[c])));
      __m512i mt[4];  // lane i of mt[t]: output i's minimums 2t, 2t + 1
      const int32_t* flat = &mp[c][0][0];
      const __m512i z0 = _mm512_load_si512(flat), z1 = _mm512_load_si512(flat + 16);
      const __m512i z2 = _mm512_load_si512(flat + 32), z3 = _mm512_load_si512(flat + 48);
      for (int t = 0; t < 4; ++t)
        mt[t] = _mm512_shuffle_i64x2(_mm512_permutex2var_epi32(z0, idx[t], z1),
                                     _mm512_permutex2var_epi32(z2, idx[t], z3), 0x44);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m512i I = lane_sums16(&isum[c][r][0][0]);
        const int32_t* bp = pairs + (m * a.nb + b) * 4;
        __m512i Mn = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t) Mn = dot_pairs(Mn, mt[t], _mm512_set1_epi32(bp[t]));
        const __m512 dy = _mm512_set1_ps(a.x.d[m * a.nb + b]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dy), _mm512_cvtepi32_ps(I), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmv, dy), _mm512_cvtepi32_ps(Mn), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store16(a, m0 + r, n0, keep, acc[r]);
}

// Q6_K: a 64-byte load of low nibbles holds elements 128h + 0..63 (low nibbles) and 128h + 64..127
// (high nibbles), in order; their high bit pairs come from the 32 bytes of qh, shifted per 32. The
// codes' offset of 32 (-32 * C) starts each output's lanes, in integers.
template <int R>
void q6k_tile512(const Args& a, int64_t n0, int nt, int64_t m0) {
  constexpr int BC = chunk_blocks<R>();
  alignas(64) int32_t isum[BC][R][TILE][16];
  alignas(64) uint16_t dh[BC][TILE];
  if (nt < TILE) {
    std::memset(isum, 0, sizeof(isum));
    std::memset(dh, 0, sizeof(dh));
  }
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  __m512i pick[4];  // int16 lane i of scale vector p takes group 4p + i / 8
  for (int p = 0; p < 4; ++p) {
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = int16_t(4 * p + i / 8);
    pick[p] = _mm512_load_si512(idx);
  }
  const uint8_t* tile = a.w + n0 * a.row_bytes;
  for (int64_t b0 = 0; b0 < a.nb; b0 += BC) {
    const int bn = int(std::min<int64_t>(BC, a.nb - b0));
    for (int i = 0; i < nt; ++i) {
      for (int c = 0; c < bn; ++c) {
        const int64_t b = b0 + c;
        const uint8_t* blk = tile + i * a.row_bytes + b * Q6K_BYTES;
        prefetch_block(a, blk, Q6K_BYTES);
        if (R > 1) prefetch_next(blk + TILE * a.row_bytes, Q6K_BYTES);  // one row: the hardware's alone is faster
        std::memcpy(&dh[c][i], blk + 208, 2);
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
          const __m512i bs = _mm512_loadu_si512(a.x.s + m * (a.K / 16) + b * 16);
          __m512i v = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_mullo_epi32(sc32, bs), 5));
          for (int p = 0; p < 4; ++p) v = dot64(v, q[p], _mm512_loadu_si512(xq + 64 * p), s[p]);
          _mm512_store_si512(isum[c][r][i], v);
        }
      }
    }
    for (int c = 0; c < bn; ++c) {  // the chunk's blocks in order: the float steps' order
      const int64_t b = b0 + c;
      const __m512 dv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh[c])));
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m512 dy = _mm512_set1_ps(a.x.d[m * a.nb + b]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dy), _mm512_cvtepi32_ps(lane_sums16(&isum[c][r][0][0])), acc[r]);
      }
    }
  }
  const __mmask16 keep = __mmask16((1u << nt) - 1);
  for (int r = 0; r < R; ++r) store16(a, m0 + r, n0, keep, acc[r]);
}

// Dwords 16p .. 16p + 15 of 16 rows of 256 codes (U[i], 64-byte aligned) into out[16 * c + i] (c the
// dword, i the row): a 16 x 16 transpose in four rounds of shuffles.
inline void transpose_codes(const uint8_t (*U)[QK], int p, int32_t* out) {
  __m512i r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(U[i] + 64 * p);
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + e], 128-bit lane L: dword 4L + e of rows 4k .. 4k + 3
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i v2 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE), v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    _mm512_store_si512(out + 16 * (16 * p + e), _mm512_shuffle_i32x4(v0, v1, 0x88));
    _mm512_store_si512(out + 16 * (16 * p + 4 + e), _mm512_shuffle_i32x4(v0, v1, 0xDD));
    _mm512_store_si512(out + 16 * (16 * p + 8 + e), _mm512_shuffle_i32x4(v2, v3, 0x88));
    _mm512_store_si512(out + 16 * (16 * p + 12 + e), _mm512_shuffle_i32x4(v2, v3, 0xDD));
  }
}

// Prompt-sized inputs (GEMM_ROWS rows or more; Q4_K here, Q6_K below): a tile's 16 weight rows are decoded once per call
// into a lane-per-output form (dword kq of output i's codes at [kq][i]: 4 codes, so VNNI's dpbusd
// multiplies 4 columns of 16 outputs against 4 activation codes broadcast, 64 products an instruction,
// with nothing left to sum across lanes), the sub-block scales, minimum pairs, d and dmin beside
// them; every row of the call then reads that form. The integer sums and the float steps are the
// tiled code's (the same lanes, the same instructions), so a row's bits do not depend on which path
// its batch took (tests/test_gguf_kquant.py checks it across the switch).
constexpr int64_t GEMM_ROWS = 16;
constexpr int64_t Q4_WORDS = 64 * 16 + 8 * 16 + 4 * 16 + 2 * 16;  // int32 words of one decoded block

inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {  // acc + sums of 4 u8 x s8 products per lane
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
#endif
}

// Outputs n0 .. n0 + nt - 1's blocks into `out` (nb * Q4_WORDS words, 64-byte aligned): per block the
// codes [64][16], scales [8][16], minimum pairs [4][16] (int32) and d, dmin [16] (float32).
void q4k_tile_decode(const Args& a, int64_t n0, int nt, int32_t* out) {
  alignas(64) uint8_t U[TILE][QK];  // the tile's codes for one block, a row per output
  alignas(64) int32_t mp[TILE][4];
  alignas(64) uint16_t dh[TILE], mh[TILE];
  std::memset(U, 0, sizeof(U));
  std::memset(mp, 0, sizeof(mp));
  std::memset(dh, 0, sizeof(dh));
  std::memset(mh, 0, sizeof(mh));
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i idx[4];
  for (int t = 0; t < 4; ++t) {
    alignas(64) int32_t ix[16];
    for (int i = 0; i < 16; ++i) ix[i] = 4 * (i % 8) + t;
    idx[t] = _mm512_load_si512(ix);
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    int32_t* o = out + b * Q4_WORDS;
    int32_t* S = o + 64 * 16;
    std::memset(S, 0, 8 * 16 * sizeof(int32_t));
    for (int i = 0; i < nt; ++i) {
      const uint8_t* blk = a.w + (n0 + i) * a.row_bytes + b * Q4K_BYTES;
      prefetch_next(blk + TILE * a.row_bytes, Q4K_BYTES);
      std::memcpy(&dh[i], blk, 2);
      std::memcpy(&mh[i], blk + 2, 2);
      uint8_t sc[8], mn[8];
      scale_min_k4(blk + 4, sc, mn);
      for (int j = 0; j < 8; ++j) S[16 * j + i] = sc[j];
      _mm_store_si128(reinterpret_cast<__m128i*>(mp[i]), _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn))));
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(blk + 16 + 64 * h);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        _mm512_store_si512(U[i] + 128 * h, _mm512_shuffle_i64x2(lo, hi, 0x44));
        _mm512_store_si512(U[i] + 128 * h + 64, _mm512_shuffle_i64x2(lo, hi, 0xEE));
      }
    }
    for (int p = 0; p < 4; ++p) transpose_codes(U, p, o);
    const int32_t* flat = &mp[0][0];
    const __m512i z0 = _mm512_load_si512(flat), z1 = _mm512_load_si512(flat + 16);
    const __m512i z2 = _mm512_load_si512(flat + 32), z3 = _mm512_load_si512(flat + 48);
    for (int t = 0; t < 4; ++t)
      _mm512_store_si512(o + 64 * 16 + 8 * 16 + 16 * t,
                         _mm512_shuffle_i64x2(_mm512_permutex2var_epi32(z0, idx[t], z1),
                                              _mm512_permutex2var_epi32(z2, idx[t], z3), 0x44));
    float* D = reinterpret_cast<float*>(o + 64 * 16 + 8 * 16 + 4 * 16);
    _mm512_store_ps(D, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh))));
    _mm512_store_ps(D + 16, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(mh))));
  }
}

template <int R>
void q4k_gemm_pass(const Args& a, const int32_t* tile, const int32_t* pairs, int64_t n0, int nt, int64_t m0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const int32_t* o = tile + b * Q4_WORDS;
    __m512i I[R];
    for (int r = 0; r < R; ++r) I[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int kk = 0; kk < 8; ++kk) {
        const int kq = 8 * j + kk;
        const __m512i w = _mm512_load_si512(o + 16 * kq);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, a.x.q + (m0 + r) * a.K + b * QK + 4 * kq, 4);
          s[r] = dpbusd(s[r], w, _mm512_set1_epi32(x4));
        }
      }
      const __m512i sc = _mm512_load_si512(o + 64 * 16 + 16 * j);
      for (int r = 0; r < R; ++r) I[r] = _mm512_add_epi32(I[r], _mm512_mullo_epi32(s[r], sc));
    }
    const int32_t* mp = o + 64 * 16 + 8 * 16;
    const float* D = reinterpret_cast<const float*>(o + 64 * 16 + 8 * 16 + 4 * 16);
    const __m512 dv = _mm512_load_ps(D), dmv = _mm512_load_ps(D + 16);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int32_t* bp = pairs + (m * a.nb + b) * 4;
      __m512i Mn = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) Mn = dot_pairs(Mn, _mm512_load_si512(mp + 16 * t), _mm512_set1_epi32(bp[t]));
      const __m512 dy = _mm512_set1_ps(a.x.d[m * a.nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dy), _mm512_cvtepi32_ps(I[r]), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmv, dy), _mm512_cvtepi32_ps(Mn), acc[r]);
    }
  }
  const __mmask16 keep = __mmask16((1u << nt) - 1);
  for (int r = 0; r < R; ++r) store16(a, m0 + r, n0, keep, acc[r]);
}

// Q6_K the same way: codes (0-63) [64][16], group scales [16][16] (int32), d [16] (float32). A group's
// sum starts at -32 * bsum16_g (the codes' offset), so sc_g * (its sum) is sc_g * sum((q - 32) * q8).
constexpr int64_t Q6_WORDS = 64 * 16 + 16 * 16 + 16;

void q6k_tile_decode(const Args& a, int64_t n0, int nt, int32_t* out) {
  alignas(64) uint8_t U[TILE][QK];
  alignas(64) uint16_t dh[TILE];
  std::memset(U, 0, sizeof(U));
  std::memset(dh, 0, sizeof(dh));
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  for (int64_t b = 0; b < a.nb; ++b) {
    int32_t* o = out + b * Q6_WORDS;
    int32_t* S = o + 64 * 16;
    std::memset(S, 0, 16 * 16 * sizeof(int32_t));
    for (int i = 0; i < nt; ++i) {
      const uint8_t* blk = a.w + (n0 + i) * a.row_bytes + b * Q6K_BYTES;
      prefetch_next(blk + TILE * a.row_bytes, Q6K_BYTES);
      std::memcpy(&dh[i], blk + 208, 2);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      for (int g = 0; g < 16; ++g) S[16 * g + i] = sc[g];
      for (int h = 0; h < 2; ++h) {
        const __m512i A = _mm512_loadu_si512(blk + 64 * h);
        const __m256i H = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m512i Hz = _mm512_inserti64x4(_mm512_castsi256_si512(H), _mm256_srli_epi16(H, 2), 1);
        _mm512_store_si512(U[i] + 128 * h,
                           _mm512_or_si512(_mm512_and_si512(A, low), _mm512_slli_epi16(_mm512_and_si512(Hz, two), 4)));
        _mm512_store_si512(U[i] + 128 * h + 64,
                           _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), low),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(Hz, 4), two), 4)));
      }
    }
    for (int p = 0; p < 4; ++p) transpose_codes(U, p, o);
    _mm512_store_ps(reinterpret_cast<float*>(o + 64 * 16 + 16 * 16),
                    _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(dh))));
  }
}

template <int R>
void q6k_gemm_pass(const Args& a, const int32_t* tile, int64_t n0, int nt, int64_t m0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const int32_t* o = tile + b * Q6_WORDS;
    __m512i I[R];
    for (int r = 0; r < R; ++r) I[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; ++g) {
      __m512i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm512_set1_epi32(-32 * a.x.s[(m0 + r) * (a.K / 16) + b * 16 + g]);
#pragma GCC unroll 4
      for (int kk = 0; kk < 4; ++kk) {
        const int kq = 4 * g + kk;
        const __m512i w = _mm512_load_si512(o + 16 * kq);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, a.x.q + (m0 + r) * a.K + b * QK + 4 * kq, 4);
          s[r] = dpbusd(s[r], w, _mm512_set1_epi32(x4));
        }
      }
      const __m512i sc = _mm512_load_si512(o + 64 * 16 + 16 * g);
      for (int r = 0; r < R; ++r) I[r] = _mm512_add_epi32(I[r], _mm512_mullo_epi32(s[r], sc));
    }
    const __m512 dv = _mm512_load_ps(reinterpret_cast<const float*>(o + 64 * 16 + 16 * 16));
    for (int r = 0; r < R; ++r) {
      const __m512 dy = _mm512_set1_ps(a.x.d[(m0 + r) * a.nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dy), _mm512_cvtepi32_ps(I[r]), acc[r]);
    }
  }
  const __mmask16 keep = __mmask16((1u << nt) - 1);
  for (int r = 0; r < R; ++r) store16(a, m0 + r, n0, keep, acc[r]);
}

template <bool Q4>
void gemm_dispatch(const Args& a, const int32_t* tile, const int32_t* pairs, int64_t n0, int nt, int64_t m0, int64_t r) {
#define TGS_KQ_CASE(R) case R: if (Q4) q4k_gemm_pass<R>(a, tile, pairs, n0, nt, m0); else q6k_gemm_pass<R>(a, tile, n0, nt, m0); break;
  switch (r) {
    TGS_KQ_CASE(1) TGS_KQ_CASE(2) TGS_KQ_CASE(3) TGS_KQ_CASE(4)
    TGS_KQ_CASE(5) TGS_KQ_CASE(6) TGS_KQ_CASE(7) default: TGS_KQ_CASE(8)
  }
#undef TGS_KQ_CASE
}

template <bool Q4>
void tile_dispatch(const Args& a, const int32_t* pairs, int64_t n0, int nt, int64_t m0, int64_t r) {
#define TGS_KQ_CASE(R) case R: if (Q4) q4k_tile512<R>(a, pairs, n0, nt, m0); else q6k_tile512<R>(a, n0, nt, m0); break;
  switch (r) {
    TGS_KQ_CASE(1) TGS_KQ_CASE(2) TGS_KQ_CASE(3) TGS_KQ_CASE(4)
    TGS_KQ_CASE(5) TGS_KQ_CASE(6) TGS_KQ_CASE(7) default: TGS_KQ_CASE(8)
  }
#undef TGS_KQ_CASE
}
#endif

template <bool Q4>
void rows_dispatch(const Args& a, int64_t n, int64_t m0, int64_t r) {
#define TGS_KQ_CASE(R) case R: if (Q4) q4k_rows<R>(a, n, m0); else q6k_rows<R>(a, n, m0); break;
  switch (r) {
    TGS_KQ_CASE(1) TGS_KQ_CASE(2) TGS_KQ_CASE(3) TGS_KQ_CASE(4)
    TGS_KQ_CASE(5) TGS_KQ_CASE(6) TGS_KQ_CASE(7) default: TGS_KQ_CASE(8)
  }
#undef TGS_KQ_CASE
}

// Each row's 32-column code sums per block as int16 pairs ([M, nb, 4]: dword t = bsum32_2t | bsum32_2t+1
// << 16; |bsum32| <= 32 * 128), the minimums' operand of dpwssd.
inline void q4k_pairs_into(const Args& a, std::vector<int32_t>& pairs) {
  pairs.resize(a.M * a.nb * 4);
  for (int64_t i = 0; i < a.M * a.nb; ++i) {
    const int32_t* bs = a.x.s + i * 16;
    for (int t = 0; t < 4; ++t) {
      const uint32_t lo = uint16_t(int16_t(bs[4 * t] + bs[4 * t + 1]));
      const uint32_t hi = uint16_t(int16_t(bs[4 * t + 2] + bs[4 * t + 3]));
      pairs[i * 4 + t] = int32_t(lo | (hi << 16));
    }
  }
}

inline std::vector<int32_t> q4k_pairs(const Args& a) {
  std::vector<int32_t> pairs;
  q4k_pairs_into(a, pairs);
  return pairs;
}

template <bool Q4>
void run(const Args& a) {
#if defined(__AVX512BW__)
  // Tiles of 16 outputs split among threads; each tile's rows go in passes of up to 8 while its weight
  // rows are in cache, so the weights come from memory once whatever the number of rows.
  std::vector<int32_t> pairs;
  if (Q4) pairs = q4k_pairs(a);
  const int64_t tiles = (a.N + TILE - 1) / TILE;
  if (a.M >= GEMM_ROWS) {
    tgs::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      std::vector<int32_t> buffer(a.nb * (Q4 ? Q4_WORDS : Q6_WORDS) + 16);
      int32_t* tile = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * TILE;
        const int nt = int(std::min<int64_t>(TILE, a.N - n0));
        if (Q4)
          q4k_tile_decode(a, n0, nt, tile);
        else
          q6k_tile_decode(a, n0, nt, tile);
        for (int64_t m0 = 0; m0 < a.M; m0 += 8) gemm_dispatch<Q4>(a, tile, pairs.data(), n0, nt, m0, std::min<int64_t>(8, a.M - m0));
      }
    });
    return;
  }
  tgs::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * TILE;
      const int nt = int(std::min<int64_t>(TILE, a.N - n0));
      for (int64_t m0 = 0; m0 < a.M; m0 += 8) tile_dispatch<Q4>(a, pairs.data(), n0, nt, m0, std::min<int64_t>(8, a.M - m0));
    }
  });
#else
  // Outputs split among threads; each output's rows go in passes of up to 8 while its weight row
  // is in cache, so the weights come from memory once whatever the number of rows.
  const int64_t grain = std::max<int64_t>(1, 16 / ((a.M + 7) / 8));
  tgs::parallel_for(0, a.N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m0 = 0; m0 < a.M; m0 += 8) rows_dispatch<Q4>(a, n, m0, std::min<int64_t>(8, a.M - m0));
  });
#endif
}

inline int64_t block_bytes(int64_t type) {
  TORCH_CHECK(type == 12 || type == 14, "K-quant type must be 12 (Q4_K) or 14 (Q6_K), got ", type);
  return type == 12 ? Q4K_BYTES : Q6K_BYTES;
}

// The packed form (kquant_pack; cpu_kquant.KQuantLinear converts each layer to it at load on AVX-512
// builds): the blocks of 16 consecutive outputs (a tile) interleaved so that a 64-byte load holds the
// same 4 bytes of the 16 outputs' blocks, dword lane i for output i. VNNI's dpbusd then multiplies
// 4 codes of each of the 16 outputs by 4 activation codes broadcast, 64 products an instruction,
// each output's sum staying in its lane: nothing is transposed or summed across lanes at any row
// count, and each block's sub-block scales (unpacked from their 6 bits here, once, at load) are one
// widening load for all 16 outputs. A tile's blocks lie in order, and tiles one after another, so a
// thread's share of a layer is one sequential stream. The tiled code above reads the file's layout
// and gathers the same lanes with transposes; its per-block shuffles, scalar scale unpacking and
// lane sums made it compute-bound at one row (BENCHMARKS.md "One-row quantized decode"). ggml's
// CPU "repack" buffers (ggml-cpu/repack.cpp, block_q4_Kx8) interleave 8 rows for the same reason;
// this form is ours (16 rows, AVX-512 lanes, scales unpacked, the float steps below unchanged).
//
// Q4_K tile-block, 2368 bytes (16 x 148: the 144 stored bytes, the 12 of scales and minimums
// unpacked to 16):
//   codes [32][16][4]: vector v, lane i = output i's nibble bytes 4v .. 4v + 3 (v = 8j + u: low
//                      nibbles columns 64j + 4u + 0..3, sub-block 2j; high nibbles 64j + 32 + 4u + 0..3,
//                      sub-block 2j + 1)
//   scales [8][16] u8, minimum pairs [4][16][2] u8 (m_2t, m_2t+1), d [16] fp16, dmin [16] fp16
// Q6_K tile-block, 3392 bytes (16 x 210, padded to a whole number of cache lines):
//   codes [16][3][16][4]: for h < 2, u < 8, three vectors p = 3 (8h + u) + 0, 1, 2, lane i holding output
//                   i's bytes: A = ql 64h + 4u .. (low nibbles columns 128h + 4u + 0..3, high nibbles
//                   128h + 64 + 4u + 0..3), B = ql 64h + 32 + 4u .. (columns 128h + 32 + 4u + 0..3 and
//                   128h + 96 + 4u + 0..3), H = qh 32h + 4u .. (bit pair t: columns 128h + 32t + 4u + 0..3):
//                   the three a step needs side by side, so one row reads the tile-block in order
//                   (ql and qh apart, read out of order, ran at 9 GB/s from memory against 46 from cache)
//   scales [16][16] s8, d [16] fp16, 32 bytes of zeros
// Outputs past the layer's last (its last tile's lanes nt .. 15) are zeros, never stored. A 64-byte
// header (magic, type, N, blocks a row) comes first.
constexpr int64_t PTILE = 16;
constexpr int64_t Q4P_BYTES = 2368;
constexpr int64_t Q6P_BYTES = 3392;

inline int64_t packed_block_bytes(int64_t type) { return type == 12 ? Q4P_BYTES : Q6P_BYTES; }

// A packed tensor starts with a 64-byte header saying what it holds (a wrong N inside the last tile
// would otherwise pass every size check), then the tiles.
constexpr int64_t PACK_MAGIC = 0x314b504b51534754LL;  // "TGSQKPK1"
constexpr int64_t PACK_HEADER = 64;

inline int64_t packed_bytes(int64_t type, int64_t N, int64_t nb) {
  return PACK_HEADER + (N + PTILE - 1) / PTILE * nb * packed_block_bytes(type);
}

// Blocks w (N rows `stride` bytes apart, nb blocks each, of `type`) into the packed form at out.
void pack_blocks(const uint8_t* w, int64_t stride, int64_t N, int64_t nb, int64_t type, uint8_t* out) {
  const int64_t tiles = (N + PTILE - 1) / PTILE, tb = packed_block_bytes(type);
  tgs::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nt = std::min<int64_t>(PTILE, N - t * PTILE);
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = out + (t * nb + b) * tb;
        std::memset(o, 0, tb);
        for (int64_t i = 0; i < nt; ++i) {
          const uint8_t* blk = w + (t * PTILE + i) * stride + b * (type == 12 ? Q4K_BYTES : Q6K_BYTES);
          if (type == 12) {
            for (int v = 0; v < 32; ++v) std::memcpy(o + 64 * v + 4 * i, blk + 16 + 4 * v, 4);
            uint8_t sc[8], mn[8];
            scale_min_k4(blk + 4, sc, mn);
            for (int j = 0; j < 8; ++j) o[2048 + 16 * j + i] = sc[j];
            for (int p = 0; p < 4; ++p) {
              o[2176 + 32 * p + 2 * i] = mn[2 * p];
              o[2176 + 32 * p + 2 * i + 1] = mn[2 * p + 1];
            }
            std::memcpy(o + 2304 + 2 * i, blk, 2);
            std::memcpy(o + 2336 + 2 * i, blk + 2, 2);
          } else {
            for (int h = 0; h < 2; ++h)
              for (int u = 0; u < 8; ++u) {
                uint8_t* p = o + 64 * 3 * (8 * h + u) + 4 * i;
                std::memcpy(p, blk + 64 * h + 4 * u, 4);
                std::memcpy(p + 64, blk + 64 * h + 32 + 4 * u, 4);
                std::memcpy(p + 128, blk + 128 + 32 * h + 4 * u, 4);
              }
            for (int g = 0; g < 16; ++g) o[3072 + 16 * g + i] = blk[192 + g];
            std::memcpy(o + 3328 + 2 * i, blk + 208, 2);
          }
        }
      }
    }
  });
}

#if defined(__AVX512BW__)
// Lines `prefetch` bytes past p (one tile-block's worth; 0: none).
inline void prefetch_packed(const Args& a, const uint8_t* p, int64_t bytes) {
  if (a.prefetch) {
    const char* q = reinterpret_cast<const char*>(p) + a.prefetch;
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(q + at, _MM_HINT_T0);
  }
}

// Rows m0 .. m0 + R - 1 (R <= 8) against one packed tile (outputs n0 .. n0 + nt - 1): per block, per
// sub-block, each row's int32 lanes gather sum(q * q8) over the sub-block's 8 code vectors, then
// I += sum * scale (exact integers, lane i = output i); the float steps are the tiled code's.
template <int R>
void q4k_packed_pass(const Args& a, const uint8_t* tile, const int32_t* pairs, int64_t n0, int nt, int64_t m0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = a.x.q + (m0 + r) * a.K;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* o = tile + b * Q4P_BYTES;
    prefetch_packed(a, o, Q4P_BYTES);
    __m512i I[R];
    for (int r = 0; r < R; ++r) I[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      if constexpr (R <= 4) {  // both sub-blocks of the 64 columns at once: independent chains
        __m512i s0[R], s1[R];
#if defined(__AVX512VNNI__)
        // The high nibbles multiplied where they lie (v & 0xF0: 16 times the code; dpbusd's int32 lanes
        // hold it, |sum| <= 32 * 240 * 128), the sum divided by 16 once per sub-block: exact, every
        // product a multiple of 16, so the same integers as the shifted codes' for one op less a vector.
        // One row: each sub-block's sum in two chains (even and odd u) so that dpbusd's latency does not
        // bound the loop (exact integer sums: the same bits in any grouping).
        constexpr int C = R == 1 ? 2 : 1;
        __m512i c0[C][R], c1[C][R];
        for (int c = 0; c < C; ++c)
          for (int r = 0; r < R; ++r) c0[c][r] = c1[c][r] = _mm512_setzero_si512();
        const __m512i high = _mm512_set1_epi8(char(0xF0));
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) {
          const __m512i v = _mm512_load_si512(o + 64 * (8 * j + u));
          const __m512i lo = _mm512_and_si512(v, low), hi16 = _mm512_and_si512(v, high);
          for (int r = 0; r < R; ++r) {
            int32_t x0, x1;
            std::memcpy(&x0, xr[r] + b * QK + 64 * j + 4 * u, 4);
            std::memcpy(&x1, xr[r] + b * QK + 64 * j + 32 + 4 * u, 4);
            c0[u % C][r] = dpbusd(c0[u % C][r], lo, _mm512_set1_epi32(x0));
            c1[u % C][r] = dpbusd(c1[u % C][r], hi16, _mm512_set1_epi32(x1));
          }
        }
        for (int r = 0; r < R; ++r) {
          s0[r] = c0[0][r];
          s1[r] = c1[0][r];
          for (int c = 1; c < C; ++c) {
            s0[r] = _mm512_add_epi32(s0[r], c0[c][r]);
            s1[r] = _mm512_add_epi32(s1[r], c1[c][r]);
          }
          s1[r] = _mm512_srai_epi32(s1[r], 4);
        }
#else
        for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) {
          const __m512i v = _mm512_load_si512(o + 64 * (8 * j + u));
          const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            int32_t x0, x1;
            std::memcpy(&x0, xr[r] + b * QK + 64 * j + 4 * u, 4);
            std::memcpy(&x1, xr[r] + b * QK + 64 * j + 32 + 4 * u, 4);
            s0[r] = dpbusd(s0[r], lo, _mm512_set1_epi32(x0));
            s1[r] = dpbusd(s1[r], hi, _mm512_set1_epi32(x1));
          }
        }
#endif
        const __m512i sc0 = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(o + 2048 + 32 * j)));
        const __m512i sc1 = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(o + 2048 + 32 * j + 16)));
        for (int r = 0; r < R; ++r)
          I[r] = _mm512_add_epi32(I[r], _mm512_add_epi32(_mm512_mullo_epi32(s0[r], sc0), _mm512_mullo_epi32(s1[r], sc1)));
      } else {
        for (int half = 0; half < 2; ++half) {
          __m512i s[R];
          for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
          for (int u = 0; u < 8; ++u) {
            const __m512i v = _mm512_load_si512(o + 64 * (8 * j + u));
            const __m512i c = half ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low) : _mm512_and_si512(v, low);
            for (int r = 0; r < R; ++r) {
              int32_t x4;
              std::memcpy(&x4, xr[r] + b * QK + 64 * j + 32 * half + 4 * u, 4);
              s[r] = dpbusd(s[r], c, _mm512_set1_epi32(x4));
            }
          }
          const __m512i sc = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(o + 2048 + 32 * j + 16 * half)));
          for (int r = 0; r < R; ++r) I[r] = _mm512_add_epi32(I[r], _mm512_mullo_epi32(s[r], sc));
        }
      }
    }
    __m512i mt[4];  // lane i of mt[p]: output i's minimums 2p, 2p + 1 as int16
    for (int p = 0; p < 4; ++p)
      mt[p] = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(o + 2176 + 32 * p)));
    const __m512 dv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(o + 2304)));
    const __m512 dmv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(o + 2336)));
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int32_t* bp = pairs + (m * a.nb + b) * 4;
      __m512i Mn = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) Mn = dot_pairs(Mn, mt[p], _mm512_set1_epi32(bp[p]));
      const __m512 dy = _mm512_set1_ps(a.x.d[m * a.nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dy), _mm512_cvtepi32_ps(I[r]), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmv, dy), _mm512_cvtepi32_ps(Mn), acc[r]);
    }
  }
  const __mmask16 keep = __mmask16((1u << nt) - 1);
  for (int r = 0; r < R; ++r) store16(a, m0 + r, n0, keep, acc[r]);
}

// Q6_K: code = low nibble | bit pair << 4 (0..63), each 16-column group's lanes start at -32 * bsum16_g
// (the codes' offset), so sc_g * (its sum) is sc_g * sum((q - 32) * q8), as the tiled code forms it.
template <int R>
void q6k_packed_pass(const Args& a, const uint8_t* tile, int64_t n0, int nt, int64_t m0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i m33 = _mm512_set1_epi8(0x33), mcc = _mm512_set1_epi8(char(0xCC));
  const int8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = a.x.q + (m0 + r) * a.K;
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* o = tile + b * Q6P_BYTES;
    prefetch_packed(a, o, Q6P_BYTES);
    __m512i I[R];
    for (int r = 0; r < R; ++r) I[r] = _mm512_setzero_si512();
    const int32_t* bs[R];
    for (int r = 0; r < R; ++r) bs[r] = a.x.s + (m0 + r) * (a.K / 16) + b * 16;
    // the four codes of step (h, u): bit pairs t = 0..3 over A's, B's, A's and B's nibbles
    auto codes = [&](const uint8_t* p, int t) {
      const __m512i A = _mm512_load_si512(p + 64 * (t & 1)), H = _mm512_load_si512(p + 128);
      const __m512i nib = t < 2 ? _mm512_and_si512(A, low) : _mm512_and_si512(_mm512_srli_epi16(A, 4), low);
      const __m512i top = t == 0 ? _mm512_slli_epi16(H, 4) : t == 1 ? _mm512_slli_epi16(H, 2)
                        : t == 2 ? H : _mm512_srli_epi16(H, 2);
      return _mm512_or_si512(nib, _mm512_and_si512(top, m30));
    };
    // The same four codes of a step at once, in 11 ops where codes() takes 17: the bit pairs masked
    // apart once (H & 0x33: pairs 0 and 2, H & 0xCC: 1 and 3, each with zeros above it), so that after
    // a 16-bit shift each code's bits 4-5 hold its pair and bits 6-7 zeros, and one ternary select per
    // code takes bits 0-3 from the nibbles, 4-7 from the pairs (what a shift carries in from the next
    // byte lands in bits the select does not take).
    auto codes4 = [&](const uint8_t* p, __m512i* c) {
      const __m512i A = _mm512_load_si512(p), B = _mm512_load_si512(p + 64), H = _mm512_load_si512(p + 128);
      const __m512i H02 = _mm512_and_si512(H, m33), H13 = _mm512_and_si512(H, mcc);
      // bitwise low ? nibbles : pairs, written over the nibbles' register (0xE4: the mask last, so the
      // constant is not copied before each select)
      c[0] = _mm512_ternarylogic_epi32(A, _mm512_slli_epi16(H02, 4), low, 0xE4);
      c[1] = _mm512_ternarylogic_epi32(B, _mm512_slli_epi16(H13, 2), low, 0xE4);
      c[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(A, 4), H02, low, 0xE4);
      c[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(B, 4), _mm512_srli_epi16(H13, 2), low, 0xE4);
    };
    for (int h = 0; h < 2; ++h) {
      for (int gh = 0; gh < 2; ++gh) {  // steps u = 4gh .. 4gh + 3: groups 8h + 2t + gh
        if constexpr (R <= 4) {  // the block in order: each step's three vectors once, four groups at a time
          __m512i s[4][R];
          for (int t = 0; t < 4; ++t)
            for (int r = 0; r < R; ++r) s[t][r] = _mm512_set1_epi32(-32 * bs[r][8 * h + 2 * t + gh]);
#pragma GCC unroll 4
          for (int uu = 0; uu < 4; ++uu) {
            const int u = 4 * gh + uu;
            const uint8_t* p = o + 192 * (8 * h + u);
            __m512i cs[4];
            codes4(p, cs);
#pragma GCC unroll 4
            for (int t = 0; t < 4; ++t) {
              const __m512i c = cs[t];
              for (int r = 0; r < R; ++r) {
                int32_t x4;
                std::memcpy(&x4, xr[r] + b * QK + 128 * h + 32 * t + 4 * u, 4);
                s[t][r] = dpbusd(s[t][r], c, _mm512_set1_epi32(x4));
              }
            }
          }
          for (int t = 0; t < 4; ++t) {
            const __m512i sc = _mm512_cvtepi8_epi32(
                _mm_load_si128(reinterpret_cast<const __m128i*>(o + 3072 + 16 * (8 * h + 2 * t + gh))));
            for (int r = 0; r < R; ++r) I[r] = _mm512_add_epi32(I[r], _mm512_mullo_epi32(s[t][r], sc));
          }
        } else {  // a group at a time (registers for 5-8 rows), its four steps' vectors re-read from cache
#pragma GCC unroll 4
          for (int t = 0; t < 4; ++t) {
            const int g = 8 * h + 2 * t + gh;
            __m512i s[R];
            for (int r = 0; r < R; ++r) s[r] = _mm512_set1_epi32(-32 * bs[r][g]);
#pragma GCC unroll 4
            for (int uu = 0; uu < 4; ++uu) {
              const int u = 4 * gh + uu;
              const __m512i c = codes(o + 192 * (8 * h + u), t);
              for (int r = 0; r < R; ++r) {
                int32_t x4;
                std::memcpy(&x4, xr[r] + b * QK + 128 * h + 32 * t + 4 * u, 4);
                s[r] = dpbusd(s[r], c, _mm512_set1_epi32(x4));
              }
            }
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(o + 3072 + 16 * g)));
            for (int r = 0; r < R; ++r) I[r] = _mm512_add_epi32(I[r], _mm512_mullo_epi32(s[r], sc));
          }
        }
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(o + 3328)));
    for (int r = 0; r < R; ++r) {
      const __m512 dy = _mm512_set1_ps(a.x.d[(m0 + r) * a.nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, dy), _mm512_cvtepi32_ps(I[r]), acc[r]);
    }
  }
  const __mmask16 keep = __mmask16((1u << nt) - 1);
  for (int r = 0; r < R; ++r) store16(a, m0 + r, n0, keep, acc[r]);
}

template <bool Q4>
void packed_dispatch(const Args& a, const uint8_t* tile, const int32_t* pairs, int64_t n0, int nt, int64_t m0, int64_t r) {
#define TGS_KQ_CASE(R) case R: if (Q4) q4k_packed_pass<R>(a, tile, pairs, n0, nt, m0); else q6k_packed_pass<R>(a, tile, n0, nt, m0); break;
  switch (r) {
    TGS_KQ_CASE(1) TGS_KQ_CASE(2) TGS_KQ_CASE(3) TGS_KQ_CASE(4)
    TGS_KQ_CASE(5) TGS_KQ_CASE(6) TGS_KQ_CASE(7) default: TGS_KQ_CASE(8)
  }
#undef TGS_KQ_CASE
}

// A packed tile into the decoded-tile form the prompt path reads (q4k_gemm_pass / q6k_gemm_pass: codes
// as bytes, dword kq = columns 4kq .. 4kq + 3, scales as int32, d as float32): the packed lanes are
// already per output, so this is nibble masks and widenings, no transposes. From GEMM_ROWS rows the
// codes are then read as they are by every pass of 8 rows instead of unpacked again per pass (Q6_K's
// codes take 4-5 instructions each: 0.82-0.86x of the stored layout's prompt speed when unpacked per pass).
void q4k_packed_decode(const uint8_t* tile, int64_t nb, int32_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = tile + b * Q4P_BYTES;
    int32_t* w = out + b * Q4_WORDS;
    for (int j = 0; j < 4; ++j)
      for (int u = 0; u < 8; ++u) {  // low nibbles: columns 64j + 4u (kq = 16j + u), high: 64j + 32 + 4u
        const __m512i v = _mm512_load_si512(o + 64 * (8 * j + u));
        _mm512_store_si512(w + 16 * (16 * j + u), _mm512_and_si512(v, low));
        _mm512_store_si512(w + 16 * (16 * j + 8 + u), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
    for (int j = 0; j < 8; ++j)
      _mm512_store_si512(w + 64 * 16 + 16 * j, _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(o + 2048 + 16 * j))));
    for (int p = 0; p < 4; ++p)
      _mm512_store_si512(w + 64 * 16 + 8 * 16 + 16 * p,
                         _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(o + 2176 + 32 * p))));
    float* D = reinterpret_cast<float*>(w + 64 * 16 + 8 * 16 + 4 * 16);
    _mm512_store_ps(D, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(o + 2304))));
    _mm512_store_ps(D + 16, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(o + 2336))));
  }
}

void q6k_packed_decode(const uint8_t* tile, int64_t nb, int32_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = tile + b * Q6P_BYTES;
    int32_t* w = out + b * Q6_WORDS;
    for (int h = 0; h < 2; ++h)
      for (int u = 0; u < 8; ++u) {  // bit pair t: columns 128h + 32t + 4u (kq = 32h + 8t + u)
        const uint8_t* p = o + 192 * (8 * h + u);
        const __m512i A = _mm512_load_si512(p), B = _mm512_load_si512(p + 64), H = _mm512_load_si512(p + 128);
        const __m512i c[4] = {
            _mm512_or_si512(_mm512_and_si512(A, low), _mm512_and_si512(_mm512_slli_epi16(H, 4), m30)),
            _mm512_or_si512(_mm512_and_si512(B, low), _mm512_and_si512(_mm512_slli_epi16(H, 2), m30)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), low), _mm512_and_si512(H, m30)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(B, 4), low), _mm512_and_si512(_mm512_srli_epi16(H, 2), m30))};
        for (int t = 0; t < 4; ++t) _mm512_store_si512(w + 16 * (32 * h + 8 * t + u), c[t]);
      }
    for (int g = 0; g < 16; ++g)
      _mm512_store_si512(w + 64 * 16 + 16 * g, _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(o + 3072 + 16 * g))));
    _mm512_store_ps(reinterpret_cast<float*>(w + 64 * 16 + 16 * 16),
                    _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(o + 3328))));
  }
}

// parts[i].w: a packed weight of type types[i] (12: Q4_K, 14: Q6_K; a fused layer may mix them: Q4_K_M
// files keep attn_v in Q6_K beside Q4_K q and k), parts[i].y / yh already at its first output column (a
// fused layer's parts side by side in one output). The parts' tiles are numbered one after another and
// split among threads in one parallel region (one range: a fused qkv is one dispatch, not one per part or
// per type, and a small part's tiles are shared out with the others' instead of waking the pool alone);
// each tile's rows go in passes of up to 8 while the tile is in cache, so the weights come from memory
// once whatever the number of rows. A tile's bits depend only on its own part and rows.
void run_packed(const std::vector<Args>& parts, const std::vector<int64_t>& types) {
  const Args& a0 = parts[0];
  bool any_q4 = false;
  for (const int64_t t : types) any_q4 = any_q4 || t == 12;
  // The caller's scratch, read by the workers inside this call through `pp` (a thread_local named in the
  // lambda would be each worker's own, empty one).
  thread_local std::vector<int32_t> pairs;
  if (any_q4) q4k_pairs_into(a0, pairs);
  const int32_t* pp = pairs.data();
  std::vector<int64_t> first(parts.size() + 1, 0);  // the parts' first tile numbers
  for (size_t i = 0; i < parts.size(); ++i) first[i + 1] = first[i] + (parts[i].N + PTILE - 1) / PTILE;
  const bool gemm = a0.M >= GEMM_ROWS;
  tgs::parallel_for(0, first.back(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<int32_t> buffer(gemm ? a0.nb * std::max(Q4_WORDS, Q6_WORDS) + 16 : 0);
    int32_t* words = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
    size_t i = 0;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first[i + 1]) ++i;
      const Args& a = parts[i];
      const bool q4 = types[i] == 12;
      const int64_t n0 = (t - first[i]) * PTILE;
      const int nt = int(std::min<int64_t>(PTILE, a.N - n0));
      const uint8_t* tile = a.w + (t - first[i]) * a.nb * (q4 ? Q4P_BYTES : Q6P_BYTES);
      if (gemm) {
        if (q4)
          q4k_packed_decode(tile, a.nb, words);
        else
          q6k_packed_decode(tile, a.nb, words);
        for (int64_t m0 = 0; m0 < a.M; m0 += 8) {
          const int64_t r = std::min<int64_t>(8, a.M - m0);
          if (q4)
            gemm_dispatch<true>(a, words, pp, n0, nt, m0, r);
          else
            gemm_dispatch<false>(a, words, nullptr, n0, nt, m0, r);
        }
      } else {
        for (int64_t m0 = 0; m0 < a.M; m0 += 8) {
          const int64_t r = std::min<int64_t>(8, a.M - m0);
          if (q4)
            packed_dispatch<true>(a, tile, pp, n0, nt, m0, r);
          else
            packed_dispatch<false>(a, tile, nullptr, n0, nt, m0, r);
        }
      }
    }
  });
}
#endif

}  // namespace tgs_kquant

namespace tgs_kquant {
// One 256-wide block of activations (float32 values) to Q8_K: ggml's rule (see the module docstring):
// the value of largest magnitude (the first such) sets iscale = -127 / it, codes round(iscale * v) to
// nearest even, at most 127; the sums of every 16 codes; d = 1 / iscale (0 for an all-zero block).
inline void q8k_block(const float* v, int8_t* o, float* d, int32_t* sums) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // The same steps 16 values at a time: the maximum of |v| (a NaN lane yields the running maximum, as
  // `ax > amax` skips a NaN), the first value of that magnitude found by a scalar scan, vcvtps2dq's
  // rounding to nearest even (nearbyint's in the default mode), exact integer sums: the scalar bits.
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 mx = _mm512_setzero_ps();
  for (int j = 0; j < 256; j += 16) mx = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(v + j), abs_mask), mx);
  const float amax = _mm512_reduce_max_ps(mx);
  if (!(amax > 0.f)) {
    *d = 0.f;
    std::memset(o, 0, 256);
    for (int g = 0; g < 16; ++g) sums[g] = 0;
    return;
  }
  float max = 0.f;
  for (int j = 0; j < 256; ++j)
    if (std::fabs(v[j]) == amax) { max = v[j]; break; }
  const float iscale = -127.f / max;
  const __m512 is = _mm512_set1_ps(iscale);
  const __m512i top = _mm512_set1_epi32(127);
  for (int g = 0; g < 16; ++g) {
    const __m512i c = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(is, _mm512_loadu_ps(v + 16 * g))), top);
    const __m128i c8 = _mm512_cvtepi32_epi8(c);  // int8_t(c): truncation
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16 * g), c8);
    sums[g] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(c8));  // the stored codes' sum
  }
  *d = 1.f / iscale;
#else
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < 256; ++j) {
    const float ax = std::fabs(v[j]);
    if (ax > amax) { amax = ax; max = v[j]; }
  }
  if (amax == 0.f) {
    *d = 0.f;
    std::memset(o, 0, 256);
    for (int g = 0; g < 16; ++g) sums[g] = 0;
    return;
  }
  const float iscale = -127.f / max;
  for (int j = 0; j < 256; ++j) {
    const int c = int(std::nearbyint(iscale * v[j]));  // to nearest even (the default rounding mode)
    o[j] = int8_t(c < 127 ? c : 127);
  }
  for (int g = 0; g < 16; ++g) {
    int32_t sum = 0;
    for (int l = 0; l < 16; ++l) sum += o[16 * g + l];
    sums[g] = sum;
  }
  *d = 1.f / iscale;
#endif
}

// x [M, K] (float32, bfloat16 or float16 at xp, element size esize) to Q8_K codes, d and sums.
void q8k_quantize(const uint8_t* xp, c10::ScalarType dtype, int64_t esize, int64_t M, int64_t K, int8_t* qp, float* dp,
                  int32_t* sp) {
  const int64_t nb = K / 256;
  tgs::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      alignas(64) float vals[256];  // the block as float32 (exactly: bfloat16 and float16 widen without rounding)
      const uint8_t* raw = xp + i * 256 * esize;
      if (dtype == torch::kFloat) {
        std::memcpy(vals, raw, sizeof(vals));
      } else if (dtype == torch::kBFloat16) {
#if defined(__AVX512F__)
        for (int j = 0; j < 256; j += 16)
          _mm512_store_ps(vals + j, _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw + 2 * j))), 16)));
#else
        for (int j = 0; j < 256; ++j) {
          uint16_t h;
          std::memcpy(&h, raw + 2 * j, 2);
          const uint32_t u = uint32_t(h) << 16;
          std::memcpy(&vals[j], &u, 4);
        }
#endif
      } else {
        for (int j = 0; j < 256; ++j) vals[j] = half_to_float(raw + 2 * j);
      }
      q8k_block(vals, qp + i * 256, dp + i, sp + i * 16);
    }
  });
}
}  // namespace tgs_kquant

// x float32, bfloat16 or float16 [M, K] (K a multiple of 256) -> [codes int8 [M, K], d float32 [M, K / 256], sums of every
// 16 codes int32 [M, K / 16]]: ggml's Q8_K rule (see the module docstring).
std::vector<torch::Tensor> kquant_quantize_q8k(torch::Tensor x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf),
              "x must be contiguous float32, bfloat16 or float16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 256 == 0, "K = ", K, " is not a multiple of 256");
  auto q = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto d = torch::empty({M, K / 256}, x.options().dtype(torch::kFloat));
  auto s = torch::empty({M, K / 16}, x.options().dtype(torch::kInt));
  tgs_kquant::q8k_quantize(reinterpret_cast<const uint8_t*>(x.data_ptr()), dtype, x.element_size(), M, K,
                           q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>());
  return {q, d, s};
}

namespace tgs_kquant {
// The blocks w's product with the Q8_K rows `act` into columns col0 .. of y (float32) or yh (bfloat16).
void mm_into(const Act& act, int64_t M, int64_t K, const torch::Tensor& w, int64_t type, int64_t prefetch, float* y,
             uint16_t* yh, int64_t ldy, int64_t col0) {
  const int64_t bytes = block_bytes(type), nb = K / 256;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.size(1) == nb * bytes && w.stride(1) == 1,
              "blocks must be uint8 [N, ", nb * bytes, "] with contiguous rows");
  TORCH_CHECK(w.stride(0) >= 0 && w.stride(0) < (int64_t(1) << 26), "block rows ", w.stride(0), " bytes apart: too far for the kernel's 32-bit offsets");
  const int64_t N = w.size(0);
  if (M == 0 || N == 0) return;
  Args a{act, w.data_ptr<uint8_t>(), y ? y + col0 : nullptr, yh ? yh + col0 : nullptr, M, K, N, w.stride(0), nb,
         prefetch, ldy};
  if (type == 12)
    run<true>(a);
  else
    run<false>(a);
}

void check_packed(const torch::Tensor& pack, int64_t N, int64_t type, int64_t K);

// The same product with w in the packed form (kquant_pack of an [N, K] weight): the bits mm_into gives.
// Parts side by side: packs[i] ([ns[i], K] of types[i], prefetched prefetches[i] bytes ahead) into
// columns from col0 on, all in one parallel region.
void mm_packed_into(const Act& act, int64_t M, int64_t K, const std::vector<torch::Tensor>& packs,
                    const std::vector<int64_t>& ns, const std::vector<int64_t>& types,
                    const std::vector<int64_t>& prefetches, float* y, uint16_t* yh, int64_t ldy, int64_t col0) {
  std::vector<Args> parts;
  std::vector<int64_t> kept;  // the types of the parts with outputs
  int64_t col = col0;
  for (size_t i = 0; i < packs.size(); ++i) {
    block_bytes(types[i]);
    check_packed(packs[i], ns[i], types[i], K);
    TORCH_CHECK(prefetches[i] >= 0, "prefetch must be >= 0, got ", prefetches[i]);
    if (ns[i]) {
      parts.push_back(Args{act, packs[i].data_ptr<uint8_t>() + PACK_HEADER, y ? y + col : nullptr, yh ? yh + col : nullptr,
                           M, K, ns[i], 0, K / 256, prefetches[i], ldy});
      kept.push_back(types[i]);
    }
    col += ns[i];
  }
#if defined(__AVX512BW__)
  if (M == 0 || parts.empty()) return;
  run_packed(parts, kept);
#else
  (void)ldy;
  TORCH_CHECK(false, "the packed K-quant form needs a build with AVX-512BW (kquant_packed_isa() is 0)");
#endif
}

// pack holds the packed form of an [N, K] weight of `type`, or a clear error says what it holds.
void check_packed(const torch::Tensor& pack, int64_t N, int64_t type, int64_t K) {
  const int64_t nb = K / 256;
  TORCH_CHECK(N >= 0 && pack.scalar_type() == torch::kByte && pack.is_contiguous() &&
              pack.numel() == packed_bytes(type, N, nb),
              "packed blocks must be contiguous uint8 of ", packed_bytes(type, N, nb), " bytes for N = ", N, ", K = ", K,
              ", got ", pack.scalar_type(), " of ", pack.numel());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(pack.data_ptr()) % 64 == 0, "packed blocks must start on a 64-byte boundary");
  int64_t head[4];
  std::memcpy(head, pack.data_ptr<uint8_t>(), sizeof(head));
  TORCH_CHECK(head[0] == PACK_MAGIC && head[1] == type && head[2] == N && head[3] == nb,
              "packed blocks hold type ", head[1], ", N = ", head[2], ", ", head[3], " super-blocks a row (magic ",
              head[0] == PACK_MAGIC ? "ok" : "wrong", "), not type ", type, ", N = ", N, ", K = ", K);
}
}  // namespace tgs_kquant

// kquant_mm's product written into columns col0 .. col0 + N of out (float32, or bfloat16 rounded to
// nearest even as torch rounds): a fused layer's parts side by side, in the model's dtype, no copies.
void kquant_mm_into(torch::Tensor q, torch::Tensor d, torch::Tensor s, torch::Tensor w, int64_t type,
                    int64_t prefetch, torch::Tensor out, int64_t col0) {
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
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || out.scalar_type() == torch::kFloat) && out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 &&
              col0 >= 0 && col0 + N <= out.size(1),
              "out must be float32 or bfloat16 [", M, ", >= ", col0 + N, "] with contiguous rows");
  if (M == 0 || N == 0) return;
  tgs_kquant::mm_into({q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>()}, M, K, w, type, prefetch,
                      bf16 ? nullptr : out.data_ptr<float>(),
                      bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr, out.stride(0), col0);
}

// The layer's whole product in one call (cpu_kquant.KQuantLinear): x float32 or bfloat16 [..., K] quantized to
// Q8_K into this thread's scratch, each part of the fused layer (K-quant blocks stacked along N, each of
// its types entry: one type for all parts, or one per part, 12: Q4_K, 14: Q6_K, so a Q4_K_M file's q, k
// and Q6_K v are one call) written side by side into one [..., N] output of x's dtype, then, where bias
// (x's dtype, [N]) has elements, the bias added as torch adds it in that dtype (bfloat16: the rounded
// product plus the bias, rounded again). The bits of quantize_q8k + kquant_mm_into per part + `y + bias`,
// without the tensors and torch ops between them (their fixed cost at one decode row). prefetch: bytes
// ahead, one for all parts or one per part. packed_n empty: the parts are blocks as stored; else part i
// is kquant_pack's form of a [packed_n[i], K] weight (all parts' tiles in one parallel region). x comes
// last so that a layer binds the rest once (functools.partial) and its forward is that call alone.
torch::Tensor kquant_linear(const std::vector<torch::Tensor>& parts, std::vector<int64_t> types, const torch::Tensor& bias,
                            std::vector<int64_t> prefetch, const std::vector<int64_t>& packed_n, torch::Tensor x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() >= 1 && (dtype == torch::kFloat || dtype == torch::kBFloat16),
              "x must be float32 or bfloat16 [..., K], got ", dtype, " ", x.sizes());
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % 256 == 0 && K > 0, "K = ", K, " is not a positive multiple of 256");
  std::vector<int64_t> shape = x.sizes().vec();  // [..., N] once N is known
  x = x.dim() == 2 ? x.contiguous() : x.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  TORCH_CHECK(!parts.empty(), "a K-quant layer needs at least one part");
  const size_t count = parts.size();
  TORCH_CHECK(packed_n.empty() || packed_n.size() == count, "packed_n must be empty (blocks as stored) or give ",
              "each packed part's N (", count, " parts), got ", packed_n.size());
  TORCH_CHECK(types.size() == 1 || types.size() == count, "types must hold one K-quant type for all parts or one per part (",
              count, " parts), got ", types.size());
  TORCH_CHECK(prefetch.size() == 1 || prefetch.size() == count, "prefetch must hold one distance for all parts or one per ",
              "part (", count, " parts), got ", prefetch.size());
  if (types.size() != count) types.assign(count, types[0]);
  if (prefetch.size() != count) prefetch.assign(count, prefetch[0]);
  for (size_t i = 0; i < count; ++i) {
    tgs_kquant::block_bytes(types[i]);
    TORCH_CHECK(prefetch[i] >= 0, "prefetch must be >= 0, got ", prefetch[i]);
  }
  int64_t N = 0;
  for (size_t i = 0; i < count; ++i) N += packed_n.empty() ? parts[i].size(0) : packed_n[i];
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == dtype && bias.is_contiguous() && bias.numel() == N),
              "bias must be empty or ", dtype, " [", N, "]");
  shape.back() = N;
  // at::empty: the output of an op that records no autograd history (a fifth less fixed cost than torch::empty's)
  auto y = at::empty(shape, x.options());
  if (M == 0) return y;
  thread_local std::vector<int8_t> qs;
  thread_local std::vector<float> ds;
  thread_local std::vector<int32_t> ss;
  qs.resize(M * K);
  ds.resize(M * (K / 256));
  ss.resize(M * (K / 16));
  tgs_kquant::q8k_quantize(reinterpret_cast<const uint8_t*>(x.data_ptr()), dtype, x.element_size(), M, K, qs.data(),
                           ds.data(), ss.data());
  const bool bf16 = dtype == torch::kBFloat16;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  uint16_t* yh = bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr;
  if (packed_n.empty()) {
    int64_t col = 0;
    for (size_t i = 0; i < count; ++i) {
      tgs_kquant::mm_into({qs.data(), ds.data(), ss.data()}, M, K, parts[i], types[i], prefetch[i], yf, yh, N, col);
      col += parts[i].size(0);
    }
  } else {
    tgs_kquant::mm_packed_into({qs.data(), ds.data(), ss.data()}, M, K, parts, packed_n, types, prefetch, yf, yh, N, 0);
  }
  if (bias.numel()) {
    if (dtype == torch::kBFloat16) {
      uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
      const uint16_t* bp = reinterpret_cast<const uint16_t*>(bias.data_ptr());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          const uint32_t a = uint32_t(yp[m * N + n]) << 16, b = uint32_t(bp[n]) << 16;
          float fa, fb; std::memcpy(&fa, &a, 4); std::memcpy(&fb, &b, 4);
          yp[m * N + n] = tgs_kquant::to_bf16(fa + fb);
        }
    } else {
      float* yp = y.data_ptr<float>();
      const float* bp = bias.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) yp[m * N + n] += bp[n];
    }
  }
  return y;
}

// kquant_mm_into with w in the packed form (kquant_pack of an [n, K] weight): the same bits.
void kquant_mm_packed_into(torch::Tensor q, torch::Tensor d, torch::Tensor s, torch::Tensor pack, int64_t n,
                           int64_t type, int64_t prefetch, torch::Tensor out, int64_t col0) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "codes must be contiguous int8 [M, K]");
  const int64_t M = q.size(0), K = q.size(1), nb = K / 256;
  TORCH_CHECK(K % 256 == 0 && K > 0, "K = ", K, " is not a positive multiple of 256");
  TORCH_CHECK(d.scalar_type() == torch::kFloat && d.is_contiguous() && d.numel() == M * nb, "d must be float32 [M, K / 256]");
  TORCH_CHECK(s.scalar_type() == torch::kInt && s.is_contiguous() && s.numel() == M * (K / 16), "sums must be int32 [M, K / 16]");
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0");
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || out.scalar_type() == torch::kFloat) && out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 &&
              col0 >= 0 && col0 + n <= out.size(1),
              "out must be float32 or bfloat16 [", M, ", >= ", col0 + n, "] with contiguous rows");
  tgs_kquant::mm_packed_into({q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>()}, M, K, {pack}, {n}, {type},
                             {prefetch}, bf16 ? nullptr : out.data_ptr<float>(),
                             bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr, out.stride(0), col0);
}

// The bytes of the packed form of an [N, K] weight of `type` (header included): the size of the buffer
// kquant_pack_into fills.
int64_t kquant_packed_bytes(int64_t type, int64_t N, int64_t K) {
  tgs_kquant::block_bytes(type);
  TORCH_CHECK(N >= 0 && K > 0 && K % 256 == 0, "N = ", N, ", K = ", K, ": N must be >= 0 and K a positive multiple of 256");
  return tgs_kquant::packed_bytes(type, N, K / 256);
}

// The blocks w (uint8 [N, K / 256 * block bytes] of `type`, rows may be strided) in the packed form
// (tgs_kquant::pack_blocks says the layout), written into out: contiguous uint8 of kquant_packed_bytes,
// 64-byte aligned (a view of a larger buffer will do: cpu_kquant's arena of huge pages). kquant_mm_packed_into
// and kquant_linear read it.
void kquant_pack_into(torch::Tensor w, int64_t type, torch::Tensor out) {
  const int64_t bytes = tgs_kquant::block_bytes(type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.size(1) % bytes == 0 && w.size(1) > 0 &&
              w.stride(1) == 1 && w.stride(0) >= 0,
              "blocks must be uint8 [N, blocks * ", bytes, "] with contiguous rows, got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), nb = w.size(1) / bytes;
  TORCH_CHECK(out.scalar_type() == torch::kByte && out.is_contiguous() && out.numel() == tgs_kquant::packed_bytes(type, N, nb),
              "the packed buffer must be contiguous uint8 of ", tgs_kquant::packed_bytes(type, N, nb), " bytes, got ",
              out.scalar_type(), " of ", out.numel());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0, "the packed buffer must start on a 64-byte boundary");
  const int64_t head[8] = {tgs_kquant::PACK_MAGIC, type, N, nb, 0, 0, 0, 0};
  std::memcpy(out.data_ptr<uint8_t>(), head, sizeof(head));
  if (N) tgs_kquant::pack_blocks(w.data_ptr<uint8_t>(), w.stride(0), N, nb, type, out.data_ptr<uint8_t>() + tgs_kquant::PACK_HEADER);
}

// kquant_pack_into a new tensor (64-byte aligned, from torch's allocator).
torch::Tensor kquant_pack(torch::Tensor w, int64_t type) {
  const int64_t bytes = tgs_kquant::block_bytes(type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.size(1) % bytes == 0 && w.size(1) > 0,
              "blocks must be uint8 [N, blocks * ", bytes, "] with contiguous rows, got ", w.scalar_type(), " ", w.sizes());
  auto out = torch::empty({tgs_kquant::packed_bytes(type, w.size(0), w.size(1) / bytes)}, w.options());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0, "the allocator gave a packed buffer off a 64-byte boundary");
  kquant_pack_into(w, type, out);
  return out;
}

// Whether the packed form's kernel is built (AVX-512BW); elsewhere the blocks are read as stored.
int64_t kquant_packed_isa() {
#if defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}

// Q8_K activations (kquant_quantize_q8k's three tensors) @ W^T, W the K-quant blocks w [N, K / 256 *
// block bytes] uint8 of `type` (12: Q4_K, 14: Q6_K): [M, N] float32, any M; weights prefetched
// `prefetch` bytes ahead (0: not at all; the distance changes no bit of the result).
torch::Tensor kquant_mm(torch::Tensor q, torch::Tensor d, torch::Tensor s, torch::Tensor w, int64_t type,
                        int64_t prefetch) {
  auto y = torch::empty({q.size(0), w.size(0)}, q.options().dtype(torch::kFloat));
  kquant_mm_into(q, d, s, w, type, prefetch, y, 0);
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
  tgs::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    float vals[256];
    for (int64_t n = a; n < b; ++n) {
      for (int64_t blk_i = 0; blk_i < nb; ++blk_i) {
        const uint8_t* blk = wp + n * stride + blk_i * bytes;
#if defined(__AVX512BW__)
        // the same products, 16 at a time (mul then sub, each rounded: this function is never fused)
        if (type == 12) {
          const float d = tgs_kquant::half_to_float(blk), dmin = tgs_kquant::half_to_float(blk + 2);
          uint8_t sc[8], mn[8];
          tgs_kquant::scale_min_k4(blk + 4, sc, mn);
          for (int j = 0; j < 8; ++j) {  // sub-block j: nibbles (low for even j) of bytes 32 * (j / 2) ..
            const __m512 dj = _mm512_set1_ps(d * sc[j]), mj = _mm512_set1_ps(dmin * mn[j]);
            for (int h = 0; h < 2; ++h) {
              const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 32 * (j / 2) + 16 * h));
              const __m128i c = (j % 2) ? _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F))
                                        : _mm_and_si128(v, _mm_set1_epi8(0x0F));
              const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c));
              _mm512_storeu_ps(vals + 32 * j + 16 * h, _mm512_sub_ps(_mm512_mul_ps(dj, q), mj));
            }
          }
        } else {
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
          const float d = tgs_kquant::half_to_float(blk + 208);
          for (int h = 0; h < 2; ++h)
            for (int t = 0; t < 4; ++t)
              for (int half = 0; half < 2; ++half) {  // 16 elements 128h + 32t + 16half .., one group
                const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 64 * h + 32 * (t % 2) + 16 * half));
                const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 128 + 32 * h + 16 * half));
                const __m128i nib = t < 2 ? _mm_and_si128(lo, _mm_set1_epi8(0x0F))
                                          : _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_set1_epi8(0x0F));
                const __m128i top = _mm_and_si128(_mm_srl_epi16(hb, _mm_cvtsi32_si128(2 * t)), _mm_set1_epi8(0x03));
                const __m128i q = _mm_sub_epi8(_mm_or_si128(nib, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32));
                const __m512 ds = _mm512_set1_ps(d * float(sc[8 * h + 2 * t + half]));
                _mm512_storeu_ps(vals + 128 * h + 32 * t + 16 * half, _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
              }
        }
#else
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
#endif
        const int64_t at_ = (n - n0) * K + blk_i * 256;
        if (bf16) {
          for (int j = 0; j < 256; ++j) hp[at_ + j] = tgs_kquant::to_bf16(vals[j]);
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

FUNCTIONS = ["kquant_quantize_q8k", "kquant_mm", "kquant_mm_into", "kquant_linear", "kquant_dequant", "kquant_native_isa",
             "kquant_pack", "kquant_pack_into", "kquant_packed_bytes", "kquant_mm_packed_into", "kquant_packed_isa"]


def with_kquant_kernels(source: str, functions: list[str]) -> tuple[str, list[str]]:
    """cpu_native's source and function list with these kernels added (one extension, one build)."""
    return source + SOURCE, [*functions, *FUNCTIONS]
