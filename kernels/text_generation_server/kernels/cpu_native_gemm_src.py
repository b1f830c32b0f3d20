"""C++ source of the bfloat16 GEMM through float32 fused multiply-adds (`bf16_gemm`), part of
cpu_native.SOURCE.

Why: without AVX512-BF16 (an AVX2-only machine, or `serve --cpu-isa avx2`) torch's bfloat16 GEMM is
the path of every bf16 prompt and of decode batches past the matrix-vector kernel's 2 rows, and it
ran 3x slower than llama.cpp's AVX2 build there (BENCHMARKS.md, issue #32 session 8: prefill 0.32x,
c=8 0.34x). The arithmetic here is the one llama.cpp's AVX2 BF16 dot product uses (its ggml_vec_dot_bf16
widens bfloat16 to float32 in registers and multiplies with FMA; read for the method, not copied):
a bfloat16 weight widened to float32 is its bits shifted into the high half (exact), then plain
float32 FMAs. The weights are widened in registers as the tiles read them (a block's 16 rows, one
k-pass at a time): widening a block into a float32 copy first and tiling over that copy ran 10-45%
slower at 3-32 rows (the copy's stores and reloads), and no faster at 128 (BENCHMARKS.md, issue #32
session 11).
On an AVX-512 build passes of 16+ rows run 512-bit tiles instead (bgz_*): a register holds two outputs' 8
k-lanes against the row's x broadcast to both halves, over a per-k-pass buffer of the weights widened once
(widening in registers would take the FMAs' own two ports there): 1.46-1.58x the 256-bit tiles at 128 rows,
1.20-1.28x at 32 on Qwen2.5-1.5B's shapes (issue #32 session 15; BGZ_MIN_ROWS has the bands).

Bits: for output n of row m, lane l (0..7) of a float32 accumulator sums x[m, k] * w[n, k] for
k = l, l + 8, l + 16, ... in increasing k, each step one IEEE fused multiply-add from 0; the 8 lanes
are then added in a fixed tree, the K % 8 tail added by fused multiply-adds in k order, then the
bias (float32), then one rounding to bfloat16 where asked. Nothing in that depends on the rows beside
m, on how many rows the call has (so not on how a prompt is chunked: d05298c), on the tile, the
k-pass length or the thread split, and the AVX2, AVX-512 and generic builds give the same bits.
"""

SOURCE = r"""
namespace {

// ---- bfloat16 weights x float32 rows through float32 FMAs ----------------------------------------
constexpr int64_t BG_NB = 16;   // outputs per block: a thread's unit of work
constexpr int64_t BG_KC = 256;  // k per pass: the rows' x and the block's weights of a pass stay in L1
constexpr int64_t BG_MC = 128;  // rows per pass over the weights (a prompt's rows: the lane sums stay in L2)
// Tiles: R rows x C outputs, R * C accumulators + C widened weights + the row's x in AVX2's 16 registers.
// Rows go in groups of 6 (6 x 2 tiles), the last groups split so none has 1 or 2 rows (7 = 4 + 3,
// 8 = 4 + 4), with C by R (bg_cols). AVX2 build, 2 threads, Qwen2.5-1.5B's shapes (BENCHMARKS.md, issue #32
// session 11): 8 rows 4 x 3 96-110 GFLOP/s against 6 x 2 + 2 x 2 71-88 pre-widened. 3 rows take 3 x 3:
// 3 x 4 needs 17 registers once x is held in one (bg_tile), and spilled to 0.54x 3 x 3 (one core, hot;
// issue #32 session 12).
constexpr int BG_R = 6;
inline int bg_cols(int r) { return r >= 5 ? 2 : r >= 3 ? 3 : 4; }
#if defined(__AVX2__) && defined(__FMA__)
typedef __m256 bg_v;
inline bg_v bg_zero() { return _mm256_setzero_ps(); }
inline bg_v bg_load(const float* p) { return _mm256_loadu_ps(p); }
inline void bg_store(float* p, bg_v v) { _mm256_storeu_ps(p, v); }
inline bg_v bg_fma(bg_v a, bg_v b, bg_v c) { return _mm256_fmadd_ps(a, b, c); }
inline bg_v bg_widen8(const uint16_t* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
typedef float bg_v __attribute__((vector_size(32)));
inline bg_v bg_zero() { bg_v v; std::memset(&v, 0, sizeof(v)); return v; }
inline bg_v bg_load(const float* p) { bg_v v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void bg_store(float* p, bg_v v) { std::memcpy(p, &v, sizeof(v)); }
inline bg_v bg_fma(bg_v a, bg_v b, bg_v c) {
  bg_v r;
  for (int i = 0; i < 8; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}
inline bg_v bg_widen8(const uint16_t* src) {
  uint32_t u[8];
  for (int i = 0; i < 8; ++i) u[i] = uint32_t(src[i]) << 16;
  bg_v v; std::memcpy(&v, u, sizeof(v)); return v;
}
#endif
inline float bg_widen1(uint16_t v) { const uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t bg_round(float f) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// R rows x C outputs over one k-pass: acc (lane sums, [row][output][8], row stride BG_NB * 8) continued.
// w: the first output's bfloat16 row at the pass's k (outputs K apart), widened here; pw: where the same
// C rows' reads will be later (bg_block), prefetched alongside (nullptr: none).
template <int R, int C>
void bg_tile(const float* x, int64_t K, const uint16_t* w, int64_t kc, float* acc, const uint16_t* pw) {
  bg_v a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = bg_load(acc + (r * BG_NB + c) * 8);
  for (int64_t k = 0; k < kc; k += 8) {
    if (pw && k % 32 == 0)
      for (int c = 0; c < C; ++c) __builtin_prefetch(pw + c * K + k, 0, PREFETCH_LOCALITY);
    bg_v wv[C];
    for (int c = 0; c < C; ++c) wv[c] = bg_widen8(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      bg_v xv = bg_load(x + r * K + k);
#if defined(__AVX2__) && defined(__FMA__)
      // x loaded once into a register for the C FMAs. Left to itself the compiler folds the load into each
      // FMA (C loads of the same x); on Zen 4 that held the tile to about half of FMA peak: 6 x 2 62 against
      // 100 GFLOP/s, 4 x 3 60 against 92, one core, hot in L1 (issue #32 session 12). The empty asm only
      // pins xv to a register; the FMAs and their order (the bits) are the same.
      if (R * C + C + 1 <= 16) asm("" : "+v"(xv));
#endif
      for (int c = 0; c < C; ++c) a[r][c] = bg_fma(xv, wv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) bg_store(acc + (r * BG_NB + c) * 8, a[r][c]);
}

typedef void (*BgTile)(const float*, int64_t, const uint16_t*, int64_t, float*, const uint16_t*);
template <int R>
BgTile bg_tile_for(int c) {
  switch (c) {
    case 1: return bg_tile<R, 1>;
    case 2: return bg_tile<R, 2>;
    case 3: return bg_tile<R, 3>;
    default: return bg_tile<R, 4>;
  }
}
inline BgTile bg_tile_for(int r, int c) {
  switch (r) {
    case 1: return bg_tile_for<1>(c);
    case 2: return bg_tile_for<2>(c);
    case 3: return bg_tile_for<3>(c);
    case 4: return bg_tile_for<4>(c);
    case 5: return bg_tile_for<5>(c);
    default: return bg_tile_for<6>(c);
  }
}

// Rows in the next tile group from m0 of M: 6, except that the last 7 or 8 go as 4 + 3 or 4 + 4.
inline int bg_rows(int64_t m0, int64_t M) {
  const int64_t left = M - m0;
  if (left == 7 || left == 8) return 4;
  return int(std::min<int64_t>(BG_R, left));
}

// The block's lane sums (acc) to its outputs: the 8-lane tree, the K % 8 tail by FMAs in k order, the bias,
// one rounding where asked.
void bg_finish(const float* x, const uint16_t* w, const float* bias, float* y, uint16_t* yh, int64_t M, int64_t K,
               int64_t N, int64_t n0, int64_t nb, const float* acc) {
  const int64_t K8 = K - K % 8;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nb; ++j) {
      const float* l = acc + (m * BG_NB + j) * 8;
      float t = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
      for (int64_t k = K8; k < K; ++k) t = std::fma(x[m * K + k], bg_widen1(w[(n0 + j) * K + k]), t);
      if (bias) t += bias[n0 + j];
      if (yh) yh[m * N + n0 + j] = bg_round(t);
      else y[m * N + n0 + j] = t;
    }
}

// Outputs n0 .. n0 + nb (nb <= BG_NB) of all M rows. acc: M * BG_NB * 8 floats. k-pass by k-pass, each
// row group's tiles over the block's outputs.
void bg_block(const float* x, const uint16_t* w, const float* bias, float* y, uint16_t* yh, int64_t M, int64_t K,
              int64_t N, int64_t n0, int64_t nb, float* acc, int64_t prefetch) {
  const int64_t K8 = K - K % 8;
  std::fill(acc, acc + M * BG_NB * 8, 0.f);
  for (int64_t k0 = 0; k0 < K8; k0 += BG_KC) {
    const int64_t kc = std::min(BG_KC, K8 - k0);
    for (int64_t m0 = 0; m0 < M;) {
      const int r = bg_rows(m0, M), cols = bg_cols(r);
      for (int64_t j0 = 0; j0 < nb; j0 += cols) {
        const int c = int(std::min<int64_t>(cols, nb - j0));
        // Prefetch `prefetch` bytes ahead in the order the weights are read: a block's BG_NB rows k-pass
        // by k-pass, then the next block's. So k + prefetch / 2 / BG_NB of these rows, past K in the blocks
        // after this one (the first row group's tiles only). It was `prefetch` bytes ahead in memory, which
        // lands in rows this block reads at the same time where K is short, and stays in the row (the
        // block's first 16 KiB of each row not prefetched) where K = 8960: 1.09-1.25x at 3-8 rows on
        // Qwen2.5-1.5B's K = 1536 shapes, 1.30-1.72x on the down projection, level at 64-128 rows (AVX2 build,
        // 2 threads, cold; issue #32 session 12). The distance measured best of 4 (1, 2, 4, 8 KiB a row).
        const uint16_t* pw = nullptr;
        if (prefetch && m0 == 0) {
          const int64_t t = k0 + prefetch / 2 / BG_NB, row = n0 + j0 + BG_NB * (t / K);
          if (row + c <= N) pw = w + row * K + t % K;
        }
        bg_tile_for(r, c)(x + m0 * K + k0, K, w + (n0 + j0) * K + k0, kc, acc + (m0 * BG_NB + j0) * 8, pw);
      }
      m0 += r;
    }
  }
  bg_finish(x, w, bias, y, yh, M, K, N, n0, nb, acc);
}

#if defined(__AVX512F__)
// ---- AVX-512: two outputs per register ----------------------------------------------------------------
// The 256-bit tiles above run on an AVX-512 build too, at half its FMA width. Here one 512-bit register
// holds the same 8 k-lanes of two outputs of one row: [output n lanes 0..7 | output n + 1 lanes 0..7],
// multiplied by that row's x[k .. k + 7] broadcast to both halves. Each lane still sums its own
// k = l, l + 8, ... in increasing k by FMAs from the same lane sums (acc's layout is the 256-bit
// tiles': output n's 8 lanes, then n + 1's), so the bits are the header's.
// The weights are widened once per k-pass into a float32 buffer of output pairs (bgz_widen), shared by
// every row group of the pass: in registers each pair would cost three shuffle/shift instructions per
// 16 lanes, and on AVX-512 those compete with the FMAs for the same two ports (0 and 5), where the
// AVX2 tiles' widening ran beside them on a third.

// k per pass of the 512-bit tiles: the pair buffer is BGZ_KC * BG_NB floats (32 KiB) in L1 beside a 6-row
// group's x (12 KiB). Twice BG_KC halves the accumulators' loads and stores per FMA; in a one-file copy of
// these tiles (2 threads, 128 rows, the Ice Lake VM, noisy: swings of 10-20%) 512 ran 1.08-1.16x 256 on
// 17920 x 1536 and 1536 x 8960; 768 and 1024 were no better than 512.
constexpr int64_t BGZ_KC = 512;

// Outputs 2p, 2p + 1 (p < (nb + 1) / 2) of the block's nb rows w (K apart), k0 .. k0 + kc, widened into buf:
// [k / 8][pair][16] floats (a missing second output of an odd nb: zeros). pw: the same rows' reads later
// (bg_block's distance), prefetched alongside (nullptr: none).
void bgz_widen(const uint16_t* w, int64_t K, int64_t nb, int64_t kc, float* buf, const uint16_t* pw) {
  const int64_t pairs = (nb + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* a = w + 2 * p * K;
    const bool two = 2 * p + 1 < nb;
    for (int64_t k = 0; k < kc; k += 8) {
      if (pw && k % 32 == 0) {
        __builtin_prefetch(pw + 2 * p * K + k, 0, PREFETCH_LOCALITY);
        if (two) __builtin_prefetch(pw + (2 * p + 1) * K + k, 0, PREFETCH_LOCALITY);
      }
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + k));
      const __m128i hi = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + K + k)) : _mm_setzero_si128();
      const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
      _mm512_storeu_ps(buf + ((k / 8) * (BG_NB / 2) + p) * 16,
                       _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
  }
}

// R rows x P output pairs over one k-pass: acc continued as in bg_tile; wb: the pass's widened buffer at
// the first pair. R * P accumulators + P pairs + x: up to 31 of the 32 registers.
template <int R, int P>
void bgz_tile(const float* x, int64_t K, const float* wb, int64_t kc, float* acc) {
  __m512 a[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) a[r][p] = _mm512_loadu_ps(acc + (r * BG_NB + 2 * p) * 8);
  for (int64_t k = 0; k < kc; k += 8) {
    __m512 wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_ps(wb + (k / 8) * (BG_NB / 2) * 16 + p * 16);
    for (int r = 0; r < R; ++r) {
      // x[k .. k + 7] in both halves: vbroadcastf64x4 (AVX512F), one load, no shuffle
      const __m512 xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(x + r * K + k))));
      for (int p = 0; p < P; ++p) a[r][p] = _mm512_fmadd_ps(xv, wv[p], a[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(acc + (r * BG_NB + 2 * p) * 8, a[r][p]);
}

typedef void (*BgzTile)(const float*, int64_t, const float*, int64_t, float*);
template <int R>
BgzTile bgz_tile_for(int p) {
  switch (p) {
    case 1: return bgz_tile<R, 1>;
    case 2: return bgz_tile<R, 2>;
    case 3: return bgz_tile<R, 3>;
    case 4: return bgz_tile<R, 4>;
    default: return bgz_tile<R, 8>;
  }
}
inline BgzTile bgz_tile_for(int r, int p) {
  switch (r) {
    case 1: return bgz_tile_for<1>(p);
    case 2: return bgz_tile_for<2>(p);
    case 3: return bgz_tile_for<3>(p);
    case 4: return bgz_tile_for<4>(p);
    case 5: return bgz_tile_for<5>(p);
    default: return bgz_tile_for<6>(p);
  }
}
// Rows of a pass (bg_gemm's M, up to BG_MC) from which the 512-bit tiles run; fewer take the 256-bit ones.
// Cold Qwen2.5-1.5B shapes, 2 threads, the Ice Lake VM (AVX-512 without BF16), base/new time against the
// 256-bit tiles (issue #32 session 15, kernels_cpu_ab.py --what bf16-gemm): 3 rows 0.69-0.77x (each k-pass's
// widening into the buffer is then a large share, and at 3-8 rows the product streams the weights at
// DRAM rate either way), 8 rows 0.85-1.19x, 10 rows 0.80-1.03x, 12 rows 0.99-1.10x, 16 rows 0.98-1.12x,
// 24 rows 1.10-1.39x, 32 rows 1.14-1.40x, 128 rows 1.32-2.24x (the head 1.39x). With BGZ_KC = 512, a quieter
// run: 3-8 rows 0.94-1.04x (the same 256-bit code both sides: the noise), 16 rows 1.01-1.08x, 32 rows
// 1.20-1.28x, 128 rows 1.46-1.49x (150-190 GFLOP/s), the head 1.58x.
constexpr int64_t BGZ_MIN_ROWS = 16;

// Pairs per tile by its rows: 6 x 4 (24 accumulators, 4 pairs, x) for full groups; 1-2 rows take the
// block's 8 pairs at once.
inline int bgz_pairs(int r) { return r <= 2 ? 8 : 4; }

// bg_block's work (the same lane sums, tail, bias and rounding) on the 512-bit tiles. buf: BGZ_KC * BG_NB floats.
void bgz_block(const float* x, const uint16_t* w, const float* bias, float* y, uint16_t* yh, int64_t M, int64_t K,
               int64_t N, int64_t n0, int64_t nb, float* acc, float* buf, int64_t prefetch) {
  const int64_t K8 = K - K % 8, pairs = (nb + 1) / 2;
  std::fill(acc, acc + M * BG_NB * 8, 0.f);
  for (int64_t k0 = 0; k0 < K8; k0 += BGZ_KC) {
    const int64_t kc = std::min(BGZ_KC, K8 - k0);
    const uint16_t* pw = nullptr;  // bg_block's distance, in the order the weights are read
    if (prefetch) {
      const int64_t t = k0 + prefetch / 2 / BG_NB, row = n0 + BG_NB * (t / K);
      if (row + nb <= N) pw = w + row * K + t % K;
    }
    bgz_widen(w + n0 * K + k0, K, nb, kc, buf, pw);
    for (int64_t m0 = 0; m0 < M;) {
      const int r = bg_rows(m0, M), per = bgz_pairs(r);
      for (int64_t p0 = 0; p0 < pairs; p0 += per) {
        const int p = int(std::min<int64_t>(per, pairs - p0));
        bgz_tile_for(r, p)(x + m0 * K + k0, K, buf + p0 * 16, kc, acc + (m0 * BG_NB + 2 * p0) * 8);
      }
      m0 += r;
    }
  }
  bg_finish(x, w, bias, y, yh, M, K, N, n0, nb, acc);
}
#endif

void bg_gemm(const float* x, const uint16_t* w, const float* bias, float* y, uint16_t* yh, int64_t M, int64_t K,
             int64_t N, int64_t prefetch) {
  const int64_t blocks = (N + BG_NB - 1) / BG_NB;
  tgs::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * BG_NB * 8);
#if defined(__AVX512F__)
    if (M >= BGZ_MIN_ROWS) {
      std::vector<float> buf(BGZ_KC * BG_NB);
      for (int64_t b = b0; b < b1; ++b)
        bgz_block(x, w, bias, y, yh, M, K, N, b * BG_NB, std::min(BG_NB, N - b * BG_NB), acc.data(), buf.data(),
                  prefetch);
      return;
    }
#endif
    for (int64_t b = b0; b < b1; ++b)
      bg_block(x, w, bias, y, yh, M, K, N, b * BG_NB, std::min(BG_NB, N - b * BG_NB), acc.data(), prefetch);
  });
}

}  // namespace

// x [M, K] float32 or bfloat16 @ w [N, K] bfloat16 ^T (+ bias [N] float32, or an empty tensor) -> [M, N]
// float32 (weights prefetched `prefetch` bytes ahead in the order they are read: bg_block), or bfloat16 when out_bf16 (the float32 sum plus bias
// rounded once). See the header for the bits.
torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor bias, bool out_bf16, int64_t prefetch) {
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(),
              "w must be contiguous bfloat16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "x must be float32 or bfloat16 [M, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const float* bp = nullptr;
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.numel() == N && bias.is_contiguous(),
                "bias must be contiguous float32 [", N, "] or empty");
    bp = bias.data_ptr<float>();
  }
  auto xf = x.to(torch::kFloat).contiguous();
  const int64_t M = xf.size(0);
  auto y = torch::empty({M, N}, xf.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat));
  if (M == 0 || N == 0) return y;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const float* xp = xf.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += BG_MC) {
    const int64_t rows = std::min(BG_MC, M - m0);
    if (out_bf16)
      bg_gemm(xp + m0 * K, wp, bp, nullptr, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) + m0 * N, rows,
              K, N, prefetch);
    else
      bg_gemm(xp + m0 * K, wp, bp, y.data_ptr<float>() + m0 * N, nullptr, rows, K, N, prefetch);
  }
  return y;
}

// 1 where this build has AVX512-BF16: torch's bfloat16 GEMM (oneDNN) multiplies bfloat16 pairs in one
// instruction there and outran bf16_gemm 2-4x (BENCHMARKS.md, issue #32 session 9), so dense layers keep it.
int64_t bf16_gemm_has_bf16_dot() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}
"""

FUNCTIONS = ["bf16_gemm", "bf16_gemm_has_bf16_dot"]


def with_gemm_kernels(source: str, functions: list[str]) -> tuple[str, list[str]]:
    """cpu_native's source and function list with the bfloat16 GEMM added (one extension, one build)."""
    return source + SOURCE, [*functions, *FUNCTIONS]
