"""C++ source of the native group-scale int8 kernels (GGUF Q8_0, Q6_K, Q5_*), built with cpu_native's.

The torch kernel (cpu_group_int8.py) dequantizes every 1 MiB block of output rows with torch's
elementwise ops before its matmul, and that pass, not the weights' bytes, bounds its speed. Here:

- `group_int8_gemv`: 1 to 8 activation rows against the int8 codes and float32 group scales read
  where they lie, once for all rows. Each weight is formed once per pass, w = q * s (or
  fma(q, s, c) with an offset), and every row accumulates x * w in its own 16 lanes over k, then
  sums its lanes in one fixed order: a row's result has the same bits whatever the row count, the
  tile of outputs or the thread split (row-invariant).
- `group_int8_dequant`: rows n0..n1 of W in float32 or bfloat16 into a caller's buffer, with the
  torch kernel's roundings (q * s, then + c, then to bfloat16 to nearest even): the prompt path's
  matmul then sees the torch kernel's weights bit for bit.

AVX-512 code only under __AVX512F__; elsewhere scalar loops of the same arithmetic (correct, slow:
`group_int8_native_isa` says which was built, and the layers keep the torch kernel there).
Layout: codes [N, K] int8 (q - 2^(bits-1)), scales and offsets [N, K / gs] float32 (offsets may be
empty: symmetric codes).
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tgs_group {

struct Args {
  const float* x;   // [M, K]
  const int8_t* q;  // [N, K]
  const float* s;   // [N, G]
  const float* c;   // [N, G] or null
  float* y;         // [M, N]
  int64_t K, N, G, gs, prefetch;
};

#if defined(__AVX512F__)
// NB outputs from n for M rows. Lanes are k mod 16; per output one weight vector per 16 k, shared by
// the rows, each row one FMA into its accumulator: the same instructions for a row whatever M and NB.
template <int M, int NB, bool OFFSET>
inline void tile(const Args& a, int64_t n) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const int8_t* q[NB];
  const float* s[NB];
  const float* c[NB];
  for (int b = 0; b < NB; ++b) {
    q[b] = a.q + (n + b) * a.K;
    s[b] = a.s + (n + b) * a.G;
    c[b] = OFFSET ? a.c + (n + b) * a.G : nullptr;
  }
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 sv[NB], cv[NB];
    for (int b = 0; b < NB; ++b) {
      sv[b] = _mm512_set1_ps(s[b][g]);
      if (OFFSET) cv[b] = _mm512_set1_ps(c[b][g]);
    }
    for (int64_t k = g * a.gs; k < (g + 1) * a.gs; k += 16) {
      if (a.prefetch && (k & 63) == 0)
        for (int b = 0; b < NB; ++b) _mm_prefetch(reinterpret_cast<const char*>(q[b] + k) + a.prefetch, _MM_HINT_T1);
      __m512 w[NB];
      for (int b = 0; b < NB; ++b) {
        __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[b] + k));
        __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        w[b] = OFFSET ? _mm512_fmadd_ps(qf, sv[b], cv[b]) : _mm512_mul_ps(qf, sv[b]);
      }
      for (int m = 0; m < M; ++m) {
        __m512 xv = _mm512_loadu_ps(a.x + m * a.K + k);
        for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xv, w[b], acc[m][b]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) a.y[m * a.N + n + b] = _mm512_reduce_add_ps(acc[m][b]);
}
#else
// The same arithmetic, one lane at a time: w = q * s (or fma(q, s, c)), 16 partial sums per row
// over k mod 16, summed in order at the end.
template <int M, int NB, bool OFFSET>
inline void tile(const Args& a, int64_t n) {
  for (int b = 0; b < NB; ++b) {
    const int8_t* q = a.q + (n + b) * a.K;
    const float* s = a.s + (n + b) * a.G;
    const float* c = a.c ? a.c + (n + b) * a.G : nullptr;
    for (int m = 0; m < M; ++m) {
      float lanes[16] = {};
      for (int64_t k = 0; k < a.K; ++k) {
        const int64_t g = k / a.gs;
        const float w = c ? __builtin_fmaf(float(q[k]), s[g], c[g]) : float(q[k]) * s[g];
        lanes[k % 16] = __builtin_fmaf(a.x[m * a.K + k], w, lanes[k % 16]);
      }
      float t = 0.f;
      for (int j = 0; j < 16; ++j) t += lanes[j];
      a.y[m * a.N + n + b] = t;
    }
  }
}
#endif

template <int M, int NB, bool OFFSET>
void run_tiles(const Args& a) {
  const int64_t tiles = a.N / NB;
  tgs::parallel_for(0, tiles, 16 / NB, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tile<M, NB, OFFSET>(a, t * NB);
  });
  for (int64_t n = tiles * NB; n < a.N; ++n) tile<M, 1, OFFSET>(a, n);
}

template <int M, int NB>
void run(const Args& a) {
  if (a.c)
    run_tiles<M, NB, true>(a);
  else
    run_tiles<M, NB, false>(a);
}

void dispatch(int64_t M, const Args& a) {
  switch (M) {
    case 1: run<1, 4>(a); break;
    case 2: run<2, 4>(a); break;
    case 3: run<3, 4>(a); break;
    case 4: run<4, 4>(a); break;
    case 5: run<5, 2>(a); break;
    case 6: run<6, 2>(a); break;
    case 7: run<7, 2>(a); break;
    default: run<8, 2>(a); break;
  }
}

void check_weights(const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& c) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "codes must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(s.scalar_type() == torch::kFloat && s.is_contiguous() && s.numel() > 0 && s.numel() % N == 0,
              "scales must be contiguous float32 [N, G]");
  const int64_t G = s.numel() / N;
  TORCH_CHECK(K % G == 0 && (K / G) % 16 == 0, "group size K / G = ", K, " / ", G, " must be a multiple of 16");
  TORCH_CHECK(c.numel() == 0 || (c.scalar_type() == torch::kFloat && c.is_contiguous() && c.numel() == N * G),
              "offsets must be empty or contiguous float32 [N, G]");
}

}  // namespace tgs_group

// x [M, K] float32 (1 to 8 rows) @ W^T, W[n, k] = q[n, k] * s[n, g] (+ c[n, g]), g = k / gs: [M, N] float32.
torch::Tensor group_int8_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor c, int64_t prefetch) {
  tgs_group::check_weights(q, s, c);
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0), G = s.numel() / N;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, ", K, "]");
  TORCH_CHECK(M >= 1 && M <= 8, "x must have 1 to 8 rows, got ", M);
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0");
  auto y = torch::empty({M, N}, x.options());
  tgs_group::Args a{x.data_ptr<float>(), q.data_ptr<int8_t>(), s.data_ptr<float>(),
                    c.numel() ? c.data_ptr<float>() : nullptr, y.data_ptr<float>(), K, N, G, K / G, prefetch};
  tgs_group::dispatch(M, a);
  return y;
}

// Rows n0..n1 of W into out (float32 or bfloat16 [n1 - n0, K], contiguous): q * s rounded, then + c
// rounded, as torch's mul and add_ in the torch kernel (explicitly rounded intrinsics: never contracted
// to an FMA); to bfloat16 by round-to-nearest-even, as torch's conversion rounds finite values.
void group_int8_dequant(torch::Tensor q, torch::Tensor s, torch::Tensor c, int64_t n0, int64_t n1, torch::Tensor out) {
  tgs_group::check_weights(q, s, c);
  const int64_t N = q.size(0), K = q.size(1), G = s.numel() / N, gs = K / G;
  TORCH_CHECK(0 <= n0 && n0 < n1 && n1 <= N, "bad rows ", n0, "..", n1);
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || out.scalar_type() == torch::kFloat) && out.is_contiguous() && out.numel() == (n1 - n0) * K,
              "out must be contiguous float32 or bfloat16 [", n1 - n0, ", ", K, "]");
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  const float* cp = c.numel() ? c.data_ptr<float>() : nullptr;
  float* op = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* hp = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  tgs::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      const int8_t* qr = qp + n * K;
      const int64_t row = (n - n0) * K;
#if defined(__AVX512F__)
      const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 sv = _mm512_set1_ps(sp[n * G + g]);
        const __m512 cv = _mm512_set1_ps(cp ? cp[n * G + g] : 0.f);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
          __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k))));
          __m512 w = _mm512_mul_round_ps(qf, sv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          if (cp) w = _mm512_add_round_ps(w, cv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          if (bf16) {
            __m512i u = _mm512_castps_si512(w);
            u = _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(hp + row + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
          } else {
            _mm512_storeu_ps(op + row + k, w);
          }
        }
      }
#else
      for (int64_t k = 0; k < K; ++k) {
        const int64_t g = n * G + k / gs;
        volatile float p = float(qr[k]) * sp[g];  // stored: rounded apart from the add below
        const float w = cp ? p + cp[g] : p;
        if (bf16) {
          uint32_t u;
          std::memcpy(&u, &w, 4);
          hp[row + k] = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        } else {
          op[row + k] = w;
        }
      }
#endif
    }
  });
}

// Whether group_int8_gemv was built with its AVX-512 code (else the scalar loops: correct, slow).
int64_t group_int8_native_isa() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
"""

FUNCTIONS = ["group_int8_gemv", "group_int8_dequant", "group_int8_native_isa"]


def with_group_kernels(source: str, functions: list[str]) -> tuple[str, list[str]]:
    """cpu_native's source and function list with these kernels added (one extension, one build)."""
    return source + SOURCE, [*functions, *FUNCTIONS]
