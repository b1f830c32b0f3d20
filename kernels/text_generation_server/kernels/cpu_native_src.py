"""C++ source of the native CPU kernels (compiled on first use by cpu_native.py).

An int8 weight-only matrix-vector product that reads each weight byte once for up to eight
activation rows (torch's `_weight_int8pack_mm` re-reads the weights for every row), and
dequantizers that turn row blocks of int8 or torch-int4-packed weights into bfloat16 for
prompt-sized matmuls, where torch's weight-only ops run 5-8x slower than dequantizing and
calling the bfloat16 GEMM. Written with GCC/Clang vector extensions, with AVX-512/AVX2
intrinsics only for byte-to-float conversion: `-march=native` maps a 16-float vector onto one
AVX-512 register, two AVX2 registers or four NEON ones, so one source serves x86-64 and aarch64.

int8 layout: w [N, K] int8 codes centred on zero, one float32 scale per output row.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

typedef float vf __attribute__((vector_size(64)));     // 16 floats
typedef int8_t vi8 __attribute__((vector_size(16)));   // 16 int8
typedef uint8_t vu8 __attribute__((vector_size(16)));  // 16 uint8
typedef int32_t vi32 __attribute__((vector_size(64)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));

inline vf load_f(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
// Byte codes to floats. With AVX-512 or AVX2 one extension and one conversion instruction each
// (GCC 12 splits a generic int8->float vector conversion into 16 scalar ones); elsewhere the
// generic conversion through int32, which compilers vectorise for NEON.
#if defined(__AVX512F__)
inline vf from_m512(__m512 v) { vf r; std::memcpy(&r, &v, sizeof(r)); return r; }
inline vf to_f(vi8 b) { __m128i i; std::memcpy(&i, &b, 16); return from_m512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(i))); }
inline vf to_f(vu8 b) { __m128i i; std::memcpy(&i, &b, 16); return from_m512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(i))); }
#elif defined(__AVX2__)
inline vf from_m256(__m256 lo, __m256 hi) { vf r; std::memcpy(&r, &lo, 32); std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32); return r; }
inline vf to_f(vi8 b) {
  __m128i i; std::memcpy(&i, &b, 16);
  return from_m256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(i)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(i, 8))));
}
inline vf to_f(vu8 b) {
  __m128i i; std::memcpy(&i, &b, 16);
  return from_m256(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(i)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(i, 8))));
}
#else
inline vf to_f(vi8 b) { return __builtin_convertvector(__builtin_convertvector(b, vi32), vf); }
inline vf to_f(vu8 b) { return __builtin_convertvector(__builtin_convertvector(b, vi32), vf); }
#endif
// One float in every lane (GCC 12 lowers `vf{} + v` to 16 scalar stores where the target's vectors
// are narrower than 16 floats).
#if defined(__AVX512F__)
inline vf splat(float v) { return from_m512(_mm512_set1_ps(v)); }
#else
inline vf splat(float v) { return vf{v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }
#endif
inline vf load_i8(const int8_t* p) { vi8 b; std::memcpy(&b, p, sizeof(b)); return to_f(b); }
typedef uint16_t vh16 __attribute__((vector_size(32)));  // 16 bfloat16 bit patterns
// bfloat16 -> float32 is the bits shifted into the high half: exact.
inline vf load_bf16(const uint16_t* p) {
  vh16 h; std::memcpy(&h, p, sizeof(h));
  vu32 u = __builtin_convertvector(h, vu32) << 16;
  vf r; std::memcpy(&r, &u, sizeof(r)); return r;
}
inline vf load_w(const int8_t* p) { return load_i8(p); }
inline float weight_value(int8_t v) { return float(v); }
inline float weight_value(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline vf load_w(const uint16_t* p) { return load_bf16(p); }
inline vu8 load_u8(const uint8_t* p) { vu8 b; std::memcpy(&b, p, sizeof(b)); return b; }
inline float hsum(vf v) {
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += v[j];
  return s;
}
// float -> bfloat16 bits, round to nearest even (finite inputs: dequantized weights are).
inline void store_bf16(uint16_t* dst, vf v) {
  // Vector constants, not scalars: a vector-scalar operation is a broadcast GCC may do lane by lane
  // on targets narrower than the vector (see splat).
  const vu32 one = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  const vu32 half = {0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF,
                     0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF, 0x7FFF};
  vu32 u;
  std::memcpy(&u, &v, sizeof(u));
  u += half + ((u >> 16) & one);
  vu16 h = __builtin_convertvector(u >> 16, vu16);
  std::memcpy(dst, &h, sizeof(h));
}

// Prefetched into L2 (locality 2), not with the non-temporal hint (locality 0): prefetchnta held a
// cold 8960 x 1536 matrix-vector product to 6.6 GB/s on one Sapphire Rapids core, against 12-13
// GB/s with prefetcht1 16 KiB ahead (19-23 GB/s on two cores, about this VM's DRAM stream rate).
// How far ahead is each call's argument (cpu_native.PREFETCH_BYTES, or what this machine measured).
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif

// One fused multiply-add, in a fixed form, whatever the instruction set: a row's bits must not depend
// on the compiler's choice to contract a multiply and an add in one instantiation and not another.
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  __m512 ma, mb, mc; std::memcpy(&ma, &a, 64); std::memcpy(&mb, &b, 64); std::memcpy(&mc, &c, 64);
  __m512 r = _mm512_fmadd_ps(ma, mb, mc); vf out; std::memcpy(&out, &r, 64); return out;
#elif defined(__FMA__)
  // Narrower targets (AVX2): one expression, which GCC contracts to one FMA per half by the same
  // rule in every instantiation (splitting into __m256 halves by hand sent each result through the
  // stack). The int4 kernel is not used on these builds (int4_native_isa).
  return a * b + c;
#else
  vf r;
  for (int j = 0; j < 16; ++j) r[j] = __builtin_fmaf(a[j], b[j], c[j]);
  return r;
#endif
}

// ---- int8: y[m, n] = s[n] * sum_k x[m, k] * w[n, k] -------------------------------------------
// y[m, n] = s[n] * sum_k x[m, k] * w[n, k] for NB output rows from n, w int8 codes or bfloat16
// (then s is null: no scale).
template <int M, int NB, typename T>
inline void gemv_rows(const float* x, const T* w, const float* s, float* y, int64_t K, int64_t N, int64_t n,
                      int64_t prefetch) {
  vf acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = vf{};
  int64_t k = 0;
  // One core alone cannot keep enough reads in flight to stream at memory speed: prefetch the
  // weights `prefetch` bytes ahead, every cache line of the step (past a row's end: the next rows).
  for (; k + 64 <= K; k += 64) {
    if (prefetch)
      for (int b = 0; b < NB; ++b)
        for (int line = 0; line < int(64 * sizeof(T)); line += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(w + (n + b) * K + k) + prefetch + line, 0,
                             PREFETCH_LOCALITY);
    for (int64_t kk = k; kk < k + 64; kk += 16) {
      vf wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = load_w(w + (n + b) * K + kk);
      for (int m = 0; m < M; ++m) {
        vf xv = load_f(x + m * K + kk);
        for (int b = 0; b < NB; ++b) acc[m][b] = fmadd(xv, wv[b], acc[m][b]);
      }
    }
  }
  for (; k + 16 <= K; k += 16) {
    vf wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = load_w(w + (n + b) * K + k);
    for (int m = 0; m < M; ++m) {
      vf xv = load_f(x + m * K + k);
      for (int b = 0; b < NB; ++b) acc[m][b] = fmadd(xv, wv[b], acc[m][b]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      float t = hsum(acc[m][b]);
      for (int64_t kk = k; kk < K; ++kk) t = __builtin_fmaf(x[m * K + kk], weight_value(w[(n + b) * K + kk]), t);
      y[m * N + n + b] = s ? t * s[n + b] : t;
    }
}

template <int M, int NB, typename T>
void gemv_impl(const float* x, const T* w, const float* s, float* y, int64_t K, int64_t N, int64_t prefetch) {
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) gemv_rows<M, NB>(x, w, s, y, K, N, i * NB, prefetch);
  });
  for (int64_t n = blocks * NB; n < N; ++n) gemv_rows<M, 1>(x, w, s, y, K, N, n, prefetch);
}

// Row counts 1..8 to their tile shapes (one accumulator per row and output in registers). Every row
// gets the same operations in the same order whatever the tile (explicit FMAs, one horizontal sum
// order), so a row's bits do not depend on how many rows share the call; more than 8 rows run in
// chunks of 8 (each chunk reads the weights once).
template <typename T>
void gemv_chunk(int64_t M, const float* xp, const T* wp, const float* sp, float* yp, int64_t K, int64_t N,
                int64_t pf) {
  switch (M) {
    case 1: gemv_impl<1, 2>(xp, wp, sp, yp, K, N, pf); break;  // two independent FMA chains
    case 2: gemv_impl<2, 4>(xp, wp, sp, yp, K, N, pf); break;
    case 3: gemv_impl<3, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 4: gemv_impl<4, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 5: gemv_impl<5, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 6: gemv_impl<6, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 7: gemv_impl<7, 1>(xp, wp, sp, yp, K, N, pf); break;
    default: gemv_impl<8, 1>(xp, wp, sp, yp, K, N, pf); break;
  }
}

template <typename T>
void gemv_dispatch(int64_t M, const float* xp, const T* wp, const float* sp, float* yp, int64_t K, int64_t N,
                   int64_t pf) {
  for (int64_t m0 = 0; m0 < M; m0 += 8)
    gemv_chunk<T>(std::min<int64_t>(8, M - m0), xp + m0 * K, wp, sp, yp + m0 * N, K, N, pf);
}

#if defined(__AVX512BF16__)
// x given as bfloat16 (the layers' compute dtype): with AVX512-BF16, vdpbf16ps takes two products
// per lane and instruction, bfloat16 weights as they lie and int8 codes converted exactly (integers
// up to 256 are bfloat16), so a row costs half the multiply instructions of the float path and no
// weight conversion at all for bfloat16 weights. Lanes are 16 pairs of k; per output the same
// instructions in the same order whatever the tile (a row's bits do not depend on its neighbours).
inline __m512i load_w32(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline __m512i load_w32(const int8_t* p) {
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // k .. k + 15 in the low half, k + 16 .. k + 31 above
}

template <int M, int NB, typename T>
inline void gemv_rows_bx(const uint16_t* x, const T* w, const float* s, float* y, int64_t K, int64_t N, int64_t n,
                         int64_t prefetch) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (prefetch && k % 64 == 0)
      for (int b = 0; b < NB; ++b)
        for (int line = 0; line < int(64 * sizeof(T)); line += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(w + (n + b) * K + k) + prefetch + line, 0,
                             PREFETCH_LOCALITY);
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = load_w32(w + (n + b) * K + k);
    for (int m = 0; m < M; ++m) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, (__m512bh)wv[b]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      vf a; std::memcpy(&a, &acc[m][b], 64);
      float t = hsum(a);
      for (int64_t kk = k; kk < K; ++kk) t = __builtin_fmaf(weight_value(x[m * K + kk]), weight_value(w[(n + b) * K + kk]), t);
      y[m * N + n + b] = s ? t * s[n + b] : t;
    }
}

template <int M, int NB, typename T>
void gemv_impl_bx(const uint16_t* x, const T* w, const float* s, float* y, int64_t K, int64_t N, int64_t prefetch) {
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) gemv_rows_bx<M, NB>(x, w, s, y, K, N, i * NB, prefetch);
  });
  for (int64_t n = blocks * NB; n < N; ++n) gemv_rows_bx<M, 1>(x, w, s, y, K, N, n, prefetch);
}

template <typename T>
void gemv_dispatch_bx(int64_t M, const uint16_t* xp, const T* wp, const float* sp, float* yp, int64_t K, int64_t N,
                      int64_t pf) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const uint16_t* x = xp + m0 * K;
    float* y = yp + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: gemv_impl_bx<1, 4>(x, wp, sp, y, K, N, pf); break;
      case 2: gemv_impl_bx<2, 4>(x, wp, sp, y, K, N, pf); break;
      case 3: gemv_impl_bx<3, 2>(x, wp, sp, y, K, N, pf); break;
      case 4: gemv_impl_bx<4, 2>(x, wp, sp, y, K, N, pf); break;
      case 5: gemv_impl_bx<5, 2>(x, wp, sp, y, K, N, pf); break;
      case 6: gemv_impl_bx<6, 2>(x, wp, sp, y, K, N, pf); break;
      case 7: gemv_impl_bx<7, 2>(x, wp, sp, y, K, N, pf); break;
      default: gemv_impl_bx<8, 2>(x, wp, sp, y, K, N, pf); break;
    }
  }
}
#endif

// x float32, or bfloat16 (the dpbf16 path where the CPU has it; elsewhere widened to float32, exactly).
template <typename T>
torch::Tensor gemv_any(torch::Tensor x, const T* wp, const float* sp, int64_t N, int64_t K, int64_t prefetch) {
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16) {
    gemv_dispatch_bx<T>(M, reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), wp, sp,
                        y.data_ptr<float>(), K, N, prefetch);
    return y;
  }
#endif
  auto xf = x.to(torch::kFloat).contiguous();
  gemv_dispatch<T>(M, xf.data_ptr<float>(), wp, sp, y.data_ptr<float>(), K, N, prefetch);
  return y;
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) && x.is_contiguous(),
              "x must be contiguous float32 or bfloat16");
  TORCH_CHECK(x.size(0) >= 1, "x must have at least one row, got ", x.size(0));
}

// ---- int4, torch's CPU layout read in place: y[m, n] = sum_k x[m, k] * ((q[k, n] - 8) * s + z) ---------------

// One step of the int4 products: KSTEP input rows of 16 outputs. With AVX512-BF16, two rows through
// vdpbf16ps: the codes as exact bfloat16 pairs, x's two values as a bfloat16 pair (x is bfloat16 data:
// the layers' compute dtype), twice the products per instruction of a float FMA. Elsewhere one row
// through a float FMA. Either way one fixed instruction per step and output, in k order.
#if defined(__AVX512BF16__)
constexpr int KSTEP = 2;
typedef __m512i wstep;  // 16 outputs x (row k, row k + 1) as bfloat16 pairs
typedef __m512i xstep;  // (x[k], x[k + 1]) as a bfloat16 pair in every lane
// bfloat16 bits of the codes 0..15, indexed by code (the upper 16 entries unused).
alignas(64) static const uint16_t BF16_OF_CODE[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
inline uint32_t bf16_bits(float v) {
  uint32_t u; std::memcpy(&u, &v, 4);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
inline wstep codes_step(vu8 a, vu8 b) {  // 16 codes of row k, then of row k + 1
  __m128i ia, ib; std::memcpy(&ia, &a, 16); std::memcpy(&ib, &b, 16);
  __m512i pair = _mm512_or_si512(_mm512_cvtepu8_epi32(ia), _mm512_slli_epi32(_mm512_cvtepu8_epi32(ib), 16));
  return _mm512_permutexvar_epi16(pair, _mm512_load_si512(BF16_OF_CODE));
}
// x as the kernels read it (prepare_x): at each even k the float slot holds the bits of the bfloat16
// pair (x[k], x[k + 1]), so a step broadcasts one 32-bit word instead of rounding two floats.
inline xstep x_step(const float* row, int64_t k) {
  int32_t bits; std::memcpy(&bits, row + k, 4);
  return _mm512_set1_epi32(bits);
}
inline void prepare_row(const float* src, float* dst, int64_t K) {
  for (int64_t k = 0; k + 1 < K; k += 2) {
    const uint32_t bits = bf16_bits(src[k]) | (bf16_bits(src[k + 1]) << 16);
    std::memcpy(dst + k, &bits, 4);
  }
}
inline vf step_acc(vf t, wstep w, xstep x) {
  __m512 mt; std::memcpy(&mt, &t, 64);
  __m512 r = _mm512_dpbf16_ps(mt, (__m512bh)x, (__m512bh)w);
  vf out; std::memcpy(&out, &r, 64); return out;
}
#else
constexpr int KSTEP = 1;
typedef vf wstep;
typedef vf xstep;
inline wstep codes_step(vu8 a, vu8) { return to_f(a); }
inline xstep x_step(const float* row, int64_t k) { return splat(row[k]); }
inline void prepare_row(const float* src, float* dst, int64_t K) { std::memcpy(dst, src, K * sizeof(float)); }
inline vf step_acc(vf t, wstep w, xstep x) { return fmadd(x, w, t); }
#endif

// The V = B / 16 code vectors of one step at input row k of a B-output block whose rows lie `stride`
// bytes apart: the low nibbles of each 16-byte chunk (outputs 16h..16h+15), then the high ones.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// With AVX512-VBMI, byte permutes build the same vectors in 3 instructions each instead of 6: rows k
// and k + 1 of a block are B contiguous bytes (stride = B / 2), one permute puts each output's byte of
// both rows twice in its lane ([k, k, k + 1, k + 1]), the nibble and a byte-position bit (0x10 on the
// high byte of each bfloat16) make an index into a table of the codes' bfloat16 bytes, a second permute
// looks them up. The result is bit for bit codes_step's.
struct Int4Tables {
  alignas(64) uint8_t dup[3][64];  // [0]: B = 32; [1], [2]: B = 64, outputs 0-15 / 16-31 of each half
  alignas(64) uint8_t bytes[64];   // low bytes of bf16(0..15), then high bytes
  Int4Tables() {
    for (int t = 0; t < 3; ++t) {
      const int stride = t == 0 ? 16 : 32, h = t == 2 ? 1 : 0;
      for (int j = 0; j < 16; ++j) {
        dup[t][4 * j] = dup[t][4 * j + 1] = uint8_t(16 * h + j);
        dup[t][4 * j + 2] = dup[t][4 * j + 3] = uint8_t(stride + 16 * h + j);
      }
    }
    std::memset(bytes, 0, sizeof(bytes));
    for (int c = 0; c < 16; ++c) {
      bytes[c] = uint8_t(BF16_OF_CODE[c] & 0xFF);
      bytes[16 + c] = uint8_t(BF16_OF_CODE[c] >> 8);
    }
  }
};
static const Int4Tables INT4_TABLES;

template <int B>
inline void load_step(const uint8_t* p, int64_t, wstep* w) {
  constexpr int H = B / 32;
  const __m512i raw = B == 64 ? _mm512_loadu_si512(p)
                              : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i high_byte = _mm512_set1_epi32(0x10001000);  // bytes 0x00, 0x10, 0x00, 0x10 of each lane
  const __m512i table = _mm512_load_si512(INT4_TABLES.bytes);
  for (int h = 0; h < H; ++h) {
    const __m512i dup = _mm512_permutexvar_epi8(_mm512_load_si512(INT4_TABLES.dup[B == 64 ? 1 + h : 0]), raw);
    // (a & b) | c: ternary-logic immediate 0xEA
    w[h] = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(dup, nibble, high_byte, 0xEA), table);
    w[H + h] = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(_mm512_srli_epi16(dup, 4), nibble, high_byte, 0xEA),
                                       table);
  }
}
#else
template <int B>
inline void load_step(const uint8_t* p, int64_t stride, wstep* w) {
  constexpr int H = B / 32;
  for (int h = 0; h < H; ++h) {
    vu8 a = load_u8(p + 16 * h), b = KSTEP == 2 ? load_u8(p + stride + 16 * h) : a;
    w[h] = codes_step(vu8(a & (uint8_t)15), vu8(b & (uint8_t)15));
    w[H + h] = codes_step(vu8(a >> 4), vu8(b >> 4));
  }
}
#endif

// y[m, block] += s * t + c * xs for a group g, t the row's group sums of x * q (vector j: outputs 16j..).
template <int B>
inline void add_group(float* y, const vf* t, const float* s, const float* c, float xs, int64_t N, int64_t G,
                      int64_t g, int64_t n0) {
  vf sum = splat(xs);
  for (int j = 0; j < B / 16; ++j) {
    const int64_t col = n0 + 16 * j;
    vf acc = load_f(y + col);
    acc = fmadd(t[j], load_f(s + g * N + col), acc);
    acc = fmadd(sum, load_f(c + g * N + col), acc);
    std::memcpy(y + col, &acc, 64);
  }
}

// R rows (m0..m0+R) of one B-output block nb (B = 64 or 32: torch's layouts, see int4pack_dequant_t),
// the codes unpacked on the fly. Lanes are outputs: per group g each output sums x[m, k] * q[k, n]
// over the group's k in order, one step at a time (q as 0..15), then adds s * that + c * (the row's
// sum of x over the group), c = z - 8 s, into y. Every output of every row gets the same operations
// in the same order whatever R is, whatever M is and however the blocks are split between threads.
template <int B, int R>
inline void int4_block(const float* x, const float* xs, const uint8_t* packed, const float* s, const float* c,
                       float* y, int64_t K, int64_t N, int64_t G, int64_t gs, int64_t nb, int64_t m0,
                       int64_t prefetch) {
  constexpr int V = B / 16;
  const int64_t stride = B / 2;
  const uint8_t* src = packed + nb * K * stride;
  const int64_t n0 = nb * B;
  for (int r = 0; r < R; ++r) std::memset(y + (m0 + r) * N + n0, 0, B * sizeof(float));
  for (int64_t g = 0; g < G; ++g) {
    vf t[R][V];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < V; ++j) t[r][j] = vf{};
    for (int64_t k = g * gs; k < (g + 1) * gs; k += KSTEP) {
      const uint8_t* p = src + k * stride;
      if (prefetch) __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
      wstep w[V];
      load_step<B>(p, stride, w);
      for (int r = 0; r < R; ++r) {
        xstep xv = x_step(x + (m0 + r) * K, k);
        for (int j = 0; j < V; ++j) t[r][j] = step_acc(t[r][j], w[j], xv);
      }
    }
    for (int r = 0; r < R; ++r) add_group<B>(y + (m0 + r) * N, t[r], s, c, xs[(m0 + r) * G + g], N, G, g, n0);
  }
}

template <int B, int R>
void int4_pass(const float* x, const float* xs, const uint8_t* packed, const float* s, const float* c, float* y,
               int64_t M, int64_t K, int64_t N, int64_t G, int64_t gs, int64_t nb, int64_t prefetch) {
  int64_t m = 0;
  for (; m + R <= M; m += R) int4_block<B, R>(x, xs, packed, s, c, y, K, N, G, gs, nb, m, prefetch);
  for (; m < M; ++m) int4_block<B, 1>(x, xs, packed, s, c, y, K, N, G, gs, nb, m, prefetch);
}

// More rows than one pass takes (prompts): block nb's codes are unpacked once per KS input rows into
// `wq` and every row pass reads them there, so the unpacking is not repeated per pass. `T` [M, B]
// carries each row's group sums across the KS-row slices: every output still gets the same
// instructions in the same order as in int4_block (the same bits).
constexpr int64_t KS = 64;

template <int B, int R>
inline void int4_slice_rows(const float* x, const wstep* wq, float* T, int64_t K, int64_t k0, int64_t k1,
                            int64_t m0) {
  constexpr int V = B / 16;
  vf t[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) t[r][j] = load_f(T + (m0 + r) * B + 16 * j);
  for (int64_t k = k0; k < k1; k += KSTEP) {
    const wstep* w = wq + ((k - k0) / KSTEP) * V;
    for (int r = 0; r < R; ++r) {
      xstep xv = x_step(x + (m0 + r) * K, k);
      for (int j = 0; j < V; ++j) t[r][j] = step_acc(t[r][j], w[j], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) std::memcpy(T + (m0 + r) * B + 16 * j, &t[r][j], 64);
}

template <int B, int R>
void int4_block_unpacked(const float* x, const float* xs, const uint8_t* packed, const float* s, const float* c,
                         float* y, int64_t M, int64_t K, int64_t N, int64_t G, int64_t gs, int64_t nb,
                         int64_t prefetch, wstep* wq, float* T) {
  constexpr int V = B / 16;
  const int64_t stride = B / 2;
  const uint8_t* src = packed + nb * K * stride;
  const int64_t n0 = nb * B;
  for (int64_t m = 0; m < M; ++m) std::memset(y + m * N + n0, 0, B * sizeof(float));
  for (int64_t g = 0; g < G; ++g) {
    std::memset(T, 0, M * B * sizeof(float));
    for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += KS) {
      const int64_t k1 = std::min(k0 + KS, (g + 1) * gs);
      for (int64_t k = k0; k < k1; k += KSTEP) {
        const uint8_t* p = src + k * stride;
        if (prefetch) __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
        load_step<B>(p, stride, wq + ((k - k0) / KSTEP) * V);
      }
      int64_t m = 0;
      for (; m + R <= M; m += R) int4_slice_rows<B, R>(x, wq, T, K, k0, k1, m);
      for (; m < M; ++m) int4_slice_rows<B, 1>(x, wq, T, K, k0, k1, m);
    }
    for (int64_t m = 0; m < M; ++m) {
      vf t[V];
      for (int j = 0; j < V; ++j) t[j] = load_f(T + m * B + 16 * j);
      add_group<B>(y + m * N, t, s, c, xs[m * G + g], N, G, g, n0);
    }
  }
}

template <int B, int R>
void int4_rows(const float* x, const float* xs, const uint8_t* pp, const float* sp, const float* cp, float* yp,
               int64_t M, int64_t K, int64_t N, int64_t G, int64_t gs, int64_t b0, int64_t b1, int64_t prefetch) {
  if (M <= R) {  // one pass: unpack on the fly
    for (int64_t nb = b0; nb < b1; ++nb) int4_pass<B, R>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, nb, prefetch);
    return;
  }
  std::vector<wstep> wq((KS / KSTEP) * (B / 16));
  std::vector<float> T(M * B);
  for (int64_t nb = b0; nb < b1; ++nb)
    int4_block_unpacked<B, R>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, nb, prefetch, wq.data(), T.data());
}

template <int B>
void int4_blocks(int64_t rows_per_pass, const float* x, const float* xs, const uint8_t* pp, const float* sp,
                 const float* cp, float* yp, int64_t M, int64_t K, int64_t N, int64_t G, int64_t gs, int64_t prefetch,
                 int64_t block_grain) {
  at::parallel_for(0, N / B, block_grain, [&](int64_t b0, int64_t b1) {
    switch (rows_per_pass) {
      case 1: int4_rows<B, 1>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch); break;
      case 2: int4_rows<B, 2>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch); break;
      case 6: int4_rows<B, 6>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch); break;
      default: int4_rows<B, 4>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch); break;
    }
  });
}

void check_block(int64_t block, int64_t N) {
  TORCH_CHECK(block == 64 || block == 32, "block must be 64 or 32 (torch's AVX-512 or AVX2 layout), got ", block);
  TORCH_CHECK(N % block == 0, "N must be a multiple of ", block, ", got ", N);
}

}  // namespace

// x [M, K] float32 @ W^T for torch's CPU int4 layout (see int4pack_dequant_t), reading the packed
// weights where they lie: each block's bytes come from memory once for all M rows (the later row
// passes find them in cache). s, c float32 [K / gs, N]: W = q * s + c, c = z - 8 s. block: outputs per
// block of the layout (64 or 32); rows_per_pass: rows sharing one pass over a block (1, 2, 4 or 6);
// prefetch: bytes read ahead (0: none); block_grain: blocks per thread task. None of the last three
// changes a single bit of the result.
torch::Tensor int4pack_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor s, torch::Tensor c, int64_t gs,
                          int64_t block, int64_t rows_per_pass, int64_t prefetch, int64_t block_grain) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 2, "packed must be uint8");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  check_block(block, N);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, ", K, "], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(gs > 0 && K % gs == 0 && gs % 2 == 0, "group size ", gs, " must be even and divide K=", K);
  const int64_t G = K / gs, M = x.size(0);
  TORCH_CHECK(s.scalar_type() == torch::kFloat && c.scalar_type() == torch::kFloat && s.is_contiguous() &&
              c.is_contiguous() && s.numel() == G * N && c.numel() == G * N, "s and c must be float32 [K / gs, N]");
  TORCH_CHECK(prefetch >= 0 && block_grain >= 1, "prefetch must be >= 0 and block_grain >= 1");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  // The rows' sums over each group, in k order.
  auto xs_t = torch::empty({M, G}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xs = xs_t.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) acc += xp[m * K + k];
      xs[m * G + g] = acc;
    }
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  auto xk_t = torch::empty_like(x);  // x as the steps read it (prepare_row)
  float* xk = xk_t.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) prepare_row(xp + m * K, xk + m * K, K);
  if (block == 64)
    int4_blocks<64>(rows_per_pass, xk, xs, pp, s.data_ptr<float>(), c.data_ptr<float>(), y.data_ptr<float>(), M, K,
                    N, G, gs, prefetch, block_grain);
  else
    int4_blocks<32>(rows_per_pass, xk, xs, pp, s.data_ptr<float>(), c.data_ptr<float>(), y.data_ptr<float>(), M, K,
                    N, G, gs, prefetch, block_grain);
  return y;
}

// Whether this build runs int4pack_mm at memory speed: with AVX-512 (16-float vectors in one
// register). Built for AVX2 or NEON, GCC 12 turns its 16-float loops into stack traffic (9-14 ms for
// a 1536 x 8960 row against 0.6-0.9 with AVX-512): correct, but slower than torch's op, so the
// layers keep their earlier paths there (cpu_native.int4_native_ok).
int64_t int4_native_isa() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t prefetch) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K);
  TORCH_CHECK(s.scalar_type() == torch::kFloat && s.numel() == N && s.is_contiguous(), "s must be float32 [N]");
  return gemv_any<int8_t>(x, w.data_ptr<int8_t>(), s.data_ptr<float>(), N, K, prefetch);
}

// x [M, K] float32 or bfloat16 (chunks of up to 8 rows) @ w [N, K] bfloat16 ^T -> [M, N] float32: each
// weight byte read once per chunk.
torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor w, int64_t prefetch) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(),
              "w must be contiguous bfloat16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K);
  return gemv_any<uint16_t>(x, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), nullptr, N, K,
                            prefetch);
}

// Rows n0..n1 of the int8 weight as bfloat16 [n1 - n0, K]: w * s.
torch::Tensor int8_dequant(torch::Tensor w, torch::Tensor s, int64_t n0, int64_t n1) {
  const int64_t K = w.size(1);
  TORCH_CHECK(K % 16 == 0 && 0 <= n0 && n0 < n1 && n1 <= w.size(0), "bad rows or K");
  auto out = torch::empty({n1 - n0, K}, w.options().dtype(torch::kBFloat16));
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      const float scale = sp[n];
      const vf scale_v = splat(scale);
      for (int64_t k = 0; k < K; k += 16) store_bf16(op + (n - n0) * K + k, load_i8(wp + n * K + k) * scale_v);
    }
  });
  return out;
}

// torch's CPU int4 layouts (_convert_weight_to_int4pack_for_cpu, read off its output; they depend on
// the CPU capability torch runs at): rows in blocks of B (64 under AVX-512, 32 under AVX2); for block
// nb and input row k, B / 2 bytes at ((nb * K) + k) * B / 2, byte j holding row nb * B + j in its low
// nibble and row nb * B + B / 2 + j in its high one. (Without AVX2 torch interleaves rows 2j, 2j + 1
// in a byte: not read here, cpu_native.int4_block finds out which layout this process has.)
// Out: W^T of row blocks nb0..nb1 as bfloat16 [K, (nb1 - nb0) * B], W = (q - 8) * s + z with
// s, z float32 [K / gs, N].
torch::Tensor int4pack_dequant_t(torch::Tensor packed, torch::Tensor s, torch::Tensor z, int64_t gs, int64_t block,
                                 int64_t nb0, int64_t nb1) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 2, "packed must be uint8");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  check_block(block, N);
  TORCH_CHECK(0 <= nb0 && nb0 < nb1 && nb1 * block <= N, "bad row blocks");
  TORCH_CHECK(gs > 0 && K % gs == 0 && s.numel() == (K / gs) * N && z.numel() == s.numel(), "bad scales");
  const int64_t width = (nb1 - nb0) * block, half = block / 2;
  auto out = torch::empty({K, width}, packed.options().dtype(torch::kBFloat16));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, K, 16, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t g = k / gs;
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        const uint8_t* src = pp + (nb * K + k) * half;
        uint16_t* dst = op + k * width + (nb - nb0) * block;
        for (int64_t h = 0; h < half / 16; ++h) {
          vu8 bytes = load_u8(src + 16 * h);
          const int64_t lo_n = nb * block + 16 * h, hi_n = lo_n + half;
          const vf eight = splat(8.f);
          vf lo = (to_f(vu8(bytes & (uint8_t)15)) - eight) * load_f(sp + g * N + lo_n) + load_f(zp + g * N + lo_n);
          vf hi = (to_f(vu8(bytes >> 4)) - eight) * load_f(sp + g * N + hi_n) + load_f(zp + g * N + hi_n);
          store_bf16(dst + 16 * h, lo);
          store_bf16(dst + half + 16 * h, hi);
        }
      }
    }
  });
  return out;
}
"""

FUNCTIONS = ["int8_gemv", "bf16_gemv", "int8_dequant", "int4pack_dequant_t", "int4pack_mm", "int4_native_isa"]
