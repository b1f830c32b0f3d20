"""C++ source of the int4 kernel that reads torch's packed CPU layout in place (`int4pack_mm`), part of
cpu_native_src.SOURCE (one extension, one build).

Lanes are outputs: per group each output sums x * q over the group's input rows in k order, then adds
s * that + c * (the row's sum of x over the group), so a row's bits do not depend on the rows beside it,
the rows per pass, the prefetch distance or the thread split. Three formulations of those same steps:
AVX512-BF16 (two input rows per vdpbf16ps, codes turned into bfloat16 by byte permutes where the CPU
has AVX512-VBMI), AVX-512 float FMAs, and AVX2 8-float FMAs (`INT4_AVX2`: torch's 32-output blocks
under ATEN_CPU_CAPABILITY=avx2); each build's bits are its own, and the same for every row count.
"""

SOURCE = r"""
namespace {

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
  tgs::parallel_for(0, N / B, block_grain, [&](int64_t b0, int64_t b1) {
    switch (rows_per_pass) {
      case 1: int4_rows<B, 1>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch); break;
      case 2: int4_rows<B, 2>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch); break;
      case 6: int4_rows<B, 6>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch); break;
      default: int4_rows<B, 4>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch); break;
    }
  });
}


#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define INT4_AVX2 1
// ---- the same product on AVX2 builds, in 8-float registers --------------------------------------
// The 16-float formulation above is what AVX-512 holds in one register; compiled for AVX2, GCC 12
// keeps those vectors in memory (stack traffic: 9-14 ms for a 1536 x 8960 row). Here every vector is
// one __m256, every step one input row (float FMAs: AVX2 has no bfloat16 dot product), and a row's
// result still has the same bits whatever shares the call: per output, FMAs in k order within a
// group, then s * t + c * (the row's group sum of x), as int4_block does.
template <int B>
inline void avx2_codes(const uint8_t* p, __m256* w) {  // input row k's B codes as B / 8 float vectors
  constexpr int H = B / 32;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int h = 0; h < H; ++h) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h));
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    w[2 * h] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));  // outputs 16h .. 16h + 7
    w[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
    w[B / 16 + 2 * h] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));  // outputs B / 2 + 16h ..
    w[B / 16 + 2 * h + 1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
  }
}

template <int B>
inline void avx2_add_group(float* yrow, const __m256* t, const float* s, const float* c, float xs, int64_t N,
                           int64_t g, int64_t n0) {
  const __m256 sum = _mm256_set1_ps(xs);
  for (int j = 0; j < B / 8; ++j) {
    const int64_t col = n0 + 8 * j;
    __m256 acc = _mm256_loadu_ps(yrow + col);
    acc = _mm256_fmadd_ps(t[j], _mm256_loadu_ps(s + g * N + col), acc);
    acc = _mm256_fmadd_ps(sum, _mm256_loadu_ps(c + g * N + col), acc);
    _mm256_storeu_ps(yrow + col, acc);
  }
}

// R rows of block nb, the codes unpacked on the fly (one pass).
template <int B, int R>
void avx2_block(const float* x, const float* xs, const uint8_t* packed, const float* s, const float* c, float* y,
                int64_t K, int64_t N, int64_t G, int64_t gs, int64_t nb, int64_t m0, int64_t prefetch) {
  constexpr int V = B / 8;
  const int64_t stride = B / 2;
  const uint8_t* src = packed + nb * K * stride;
  const int64_t n0 = nb * B;
  for (int r = 0; r < R; ++r) std::memset(y + (m0 + r) * N + n0, 0, B * sizeof(float));
  for (int64_t g = 0; g < G; ++g) {
    __m256 t[R][V];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < V; ++j) t[r][j] = _mm256_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; ++k) {
      const uint8_t* p = src + k * stride;
      if (prefetch) __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
      __m256 w[V];
      avx2_codes<B>(p, w);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + (m0 + r) * K + k);
        for (int j = 0; j < V; ++j) t[r][j] = _mm256_fmadd_ps(xv, w[j], t[r][j]);
      }
    }
    for (int r = 0; r < R; ++r) avx2_add_group<B>(y + (m0 + r) * N, t[r], s, c, xs[(m0 + r) * G + g], N, g, n0);
  }
}

// More rows than a pass: each KS-row slice of the block unpacked once into `wq`, the row passes read it
// there, each row's group sums carried in T between slices (the same instructions per output).
template <int B, int R>
inline void avx2_slice_rows(const float* x, const __m256* wq, float* T, int64_t K, int64_t k0, int64_t k1,
                            int64_t m0) {
  constexpr int V = B / 8;
  __m256 t[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) t[r][j] = _mm256_loadu_ps(T + (m0 + r) * B + 8 * j);
  for (int64_t k = k0; k < k1; ++k) {
    const __m256* w = wq + (k - k0) * V;
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + (m0 + r) * K + k);
      for (int j = 0; j < V; ++j) t[r][j] = _mm256_fmadd_ps(xv, w[j], t[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) _mm256_storeu_ps(T + (m0 + r) * B + 8 * j, t[r][j]);
}

template <int B, int R>
void avx2_block_unpacked(const float* x, const float* xs, const uint8_t* packed, const float* s, const float* c,
                         float* y, int64_t M, int64_t K, int64_t N, int64_t G, int64_t gs, int64_t nb,
                         int64_t prefetch, __m256* wq, float* T) {
  constexpr int V = B / 8;
  const int64_t stride = B / 2;
  const uint8_t* src = packed + nb * K * stride;
  const int64_t n0 = nb * B;
  for (int64_t m = 0; m < M; ++m) std::memset(y + m * N + n0, 0, B * sizeof(float));
  for (int64_t g = 0; g < G; ++g) {
    std::memset(T, 0, M * B * sizeof(float));
    for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += KS) {
      const int64_t k1 = std::min(k0 + KS, (g + 1) * gs);
      for (int64_t k = k0; k < k1; ++k) {
        const uint8_t* p = src + k * stride;
        if (prefetch) __builtin_prefetch(p + prefetch, 0, PREFETCH_LOCALITY);
        avx2_codes<B>(p, wq + (k - k0) * V);
      }
      int64_t m = 0;
      for (; m + R <= M; m += R) avx2_slice_rows<B, R>(x, wq, T, K, k0, k1, m);
      for (; m < M; ++m) avx2_slice_rows<B, 1>(x, wq, T, K, k0, k1, m);
    }
    for (int64_t m = 0; m < M; ++m) {
      __m256 t[V];
      for (int j = 0; j < V; ++j) t[j] = _mm256_loadu_ps(T + m * B + 8 * j);
      avx2_add_group<B>(y + m * N, t, s, c, xs[m * G + g], N, g, n0);
    }
  }
}

template <int B, int R>
void avx2_rows(const float* x, const float* xs, const uint8_t* pp, const float* sp, const float* cp, float* yp,
               int64_t M, int64_t K, int64_t N, int64_t G, int64_t gs, int64_t b0, int64_t b1, int64_t prefetch) {
  if (M <= R) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      int64_t m = 0;
      for (; m + R <= M; m += R) avx2_block<B, R>(x, xs, pp, sp, cp, yp, K, N, G, gs, nb, m, prefetch);
      for (; m < M; ++m) avx2_block<B, 1>(x, xs, pp, sp, cp, yp, K, N, G, gs, nb, m, prefetch);
    }
    return;
  }
  std::vector<__m256> wq(KS * (B / 8));
  std::vector<float> T(M * B);
  for (int64_t nb = b0; nb < b1; ++nb)
    avx2_block_unpacked<B, R>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, nb, prefetch, wq.data(), T.data());
}

// rows_per_pass 1: one row per pass; any other: 2 (sixteen 8-float registers hold no more rows' sums).
template <int B>
void int4_blocks_avx2(int64_t rows_per_pass, const float* x, const float* xs, const uint8_t* pp, const float* sp,
                      const float* cp, float* yp, int64_t M, int64_t K, int64_t N, int64_t G, int64_t gs,
                      int64_t prefetch, int64_t block_grain) {
  tgs::parallel_for(0, N / B, block_grain, [&](int64_t b0, int64_t b1) {
    if (rows_per_pass == 1)
      avx2_rows<B, 1>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch);
    else
      avx2_rows<B, 2>(x, xs, pp, sp, cp, yp, M, K, N, G, gs, b0, b1, prefetch);
  });
}
#endif

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
#if defined(INT4_AVX2)
  if (block == 64)
    int4_blocks_avx2<64>(rows_per_pass, xk, xs, pp, s.data_ptr<float>(), c.data_ptr<float>(), y.data_ptr<float>(), M,
                         K, N, G, gs, prefetch, block_grain);
  else
    int4_blocks_avx2<32>(rows_per_pass, xk, xs, pp, s.data_ptr<float>(), c.data_ptr<float>(), y.data_ptr<float>(), M,
                         K, N, G, gs, prefetch, block_grain);
  return y;
#endif
  if (block == 64)
    int4_blocks<64>(rows_per_pass, xk, xs, pp, s.data_ptr<float>(), c.data_ptr<float>(), y.data_ptr<float>(), M, K,
                    N, G, gs, prefetch, block_grain);
  else
    int4_blocks<32>(rows_per_pass, xk, xs, pp, s.data_ptr<float>(), c.data_ptr<float>(), y.data_ptr<float>(), M, K,
                    N, G, gs, prefetch, block_grain);
  return y;
}

// Whether this build runs int4pack_mm fast: with AVX-512 (16-float vectors in one register) or AVX2
// with FMA (the 8-float formulation, INT4_AVX2). A generic build (aarch64, x86-64 without AVX2) runs
// the 16-float loops, which GCC 12 turns into stack traffic there: correct, but slower than torch's op,
// so its layers keep their earlier paths (cpu_native.int4_native_ok).
int64_t int4_native_isa() {
#if defined(__AVX512F__) || defined(INT4_AVX2)
  return 1;
#else
  return 0;
#endif
}
"""

FUNCTIONS = ["int4pack_mm", "int4_native_isa"]
