"""C++ source of the native decode attention over the paged KV cache (built with cpu_native's).

Why: a CPU decode step's attention went through torch's `scaled_dot_product_attention` on a
padded copy of every sequence's blocks. With bfloat16 inputs and one query row, torch 2.13's CPU
flash-attention kernel costs 0.4-0.8 ms a call on the 2-core EPYC VM at 160 cached tokens (float32:
50-90 us), so on Qwen2.5-1.5B (28 layers) attention was a larger part of a single-stream step
than the int4 layers' weights (BENCHMARKS.md, issue #32, fourth round). Here each (sequence, KV
head) pair is one task that reads its keys and values where they lie in the cache blocks (no
gathered copy, no mask), once for all the query heads that share them (grouped-query attention).

Arithmetic, as torch's flash kernel does it for one query row (aten/src/ATen/native/cpu/
FlashAttentionKernel.cpp, read for the order of operations, not copied): scores q.k in float32
(inputs converted exactly), times the scale; a float32 softmax with the row's maximum subtracted;
for 16-bit inputs the probabilities are rounded to the input type before they multiply the values
(their float32 values make the denominator); values accumulated in float32; the output is the
accumulator times 1 / denominator, rounded to the input type at the end. Sums run in a fixed
order per row: a row's result does not depend on the other rows of the batch or the thread count.
Not bit-identical to torch's kernel (its GEMMs sum in another order and its exp is Sleef's; ours is
`exp16` of cpu_native_pointwise_src.py).

Layout: q [B, H, D]; caches [blocks, block_size, KVH, D] (the model's dtype); block_tables
[B, max_blocks] int32/int64; seq_lens [B] int64; a row sees positions [max(0, L - window), L).
"""

SOURCE = r"""
namespace tgs_decode {

inline float bf16_bits_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even, NaN kept a NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T> inline float elem(const T* p, int64_t i);
template <> inline float elem<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float elem<uint16_t>(const uint16_t* p, int64_t i) { return bf16_bits_to_float(p[i]); }
template <typename T> inline vf load16(const T* p);
template <> inline vf load16<float>(const float* p) { return load_f(p); }
template <> inline vf load16<uint16_t>(const uint16_t* p) { return load_bf16(p); }

// The 16 lanes summed in one fixed order: the upper half onto the lower (i + 8 onto i), then i + 4
// onto i, then (t0 + t2) + (t1 + t3). Written as whole-vector adds of the halves, which are the same
// lane-wise additions as the scalar form of that order, so the bits are that order's on every build.
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
inline float lanes_sum(vf v) {
  vf8 lo, hi;
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
  const vf8 s8 = lo + hi;
  vf4 a, b;
  std::memcpy(&a, &s8, 16);
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + 16, 16);
  const vf4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Register blocks: GB query heads of one KV head at a time, and (for the values) DB 16-float
// vectors of the head dimension, so the accumulators stay in registers and each key or value
// vector is widened from the cache once for all GB heads. Every (head, lane) still sums its
// terms in the same order as one head at a time would (keys: the head dimension's 16-wide chunks
// in order, then `lanes_sum`; values: positions in order), so the blocking changes no bit.
#if defined(__AVX512F__)
constexpr int DB_MAX = 4;  // 4 x 4 accumulators + 4 value vectors of 32 zmm registers
#elif defined(__AVX2__)
constexpr int DB_MAX = 1;  // a vf is two of AVX2's 16 ymm: 4 x 1 accumulators + a value vector + a weight
#else
constexpr int DB_MAX = 2;  // a vf is four of NEON's 32 registers
#endif
constexpr int GB_MAX = 4;

template <typename T, int GB>
inline void scores_block(const float* qf, const T* k, int64_t D, int64_t D16, float* s) {
  vf a[GB];
  for (int g = 0; g < GB; ++g) a[g] = splat(0.f);
  for (int64_t d = 0; d < D16; d += 16) {
    const vf kv = load16(k + d);
    for (int g = 0; g < GB; ++g) a[g] += load_f(qf + g * D + d) * kv;
  }
  for (int g = 0; g < GB; ++g) {
    float r = lanes_sum(a[g]);
    for (int64_t d = D16; d < D; ++d) r += qf[g * D + d] * elem(k, d);
    s[g] = r;
  }
}

template <typename T, int GB, int DB>
inline void values_block(const float* p, int64_t n, const T* vc, const int64_t* table, int64_t start, int64_t bs,
                         int64_t KVH, int64_t kvh, int64_t D, int64_t d0, float* acc) {
  vf a[GB][DB];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < DB; ++j) a[g][j] = splat(0.f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = start + i;
    const T* v = vc + ((table[t / bs] * bs + t % bs) * KVH + kvh) * D + d0;
    vf x[DB];
    for (int j = 0; j < DB; ++j) x[j] = load16(v + 16 * j);
    for (int g = 0; g < GB; ++g) {
      const vf w = splat(p[g * n + i]);
      for (int j = 0; j < DB; ++j) a[g][j] = a[g][j] + w * x[j];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < DB; ++j) std::memcpy(acc + g * D + d0 + 16 * j, &a[g][j], sizeof(vf));
}

template <typename T, int GB>
inline void values_heads(const float* p, int64_t n, const T* vc, const int64_t* table, int64_t start, int64_t bs,
                         int64_t KVH, int64_t kvh, int64_t D, int64_t D16, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 16 * DB_MAX <= D16; d0 += 16 * DB_MAX)
    values_block<T, GB, DB_MAX>(p, n, vc, table, start, bs, KVH, kvh, D, d0, acc);
  for (; d0 < D16; d0 += 16) values_block<T, GB, 1>(p, n, vc, table, start, bs, KVH, kvh, D, d0, acc);
  for (int64_t d = D16; d < D; ++d) {  // the tail lanes: scalar, positions in order
    for (int g = 0; g < GB; ++g) {
      float r = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = start + i;
        r += p[g * n + i] * elem(vc + ((table[t / bs] * bs + t % bs) * KVH + kvh) * D, d);
      }
      acc[g * D + d] = r;
    }
  }
}

template <typename T>
void decode_task(const T* q, const T* kc, const T* vc, T* out, const int64_t* table, int64_t L, int64_t window,
                 int64_t bs, int64_t KVH, int64_t H, int64_t D, int64_t kvh, float scale, bool round_probs,
                 std::vector<float>& qf, std::vector<float>& p, std::vector<float>& acc) {
  const int64_t G = H / KVH;
  const int64_t start = window > 0 ? std::max<int64_t>(0, L - window) : 0;
  const int64_t n = L - start;
  const int64_t D16 = D - D % 16;
  qf.resize(G * D);
  acc.resize(G * D);
  p.resize(G * std::max<int64_t>(n, 1));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = elem(q + (kvh * G + g) * D, d);
  if (n <= 0) {  // a row that sees no key: zeros, as the eager softmax form gives
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[(kvh * G + g) * D + d] = T(0);
    return;
  }
  // Scores: each key row widened once for the query heads of its KV head, GB heads at a time.
  float s[GB_MAX];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = start + i;
    const T* k = kc + ((table[t / bs] * bs + t % bs) * KVH + kvh) * D;
    for (int64_t g0 = 0; g0 < G; g0 += GB_MAX) {
      const int64_t gb = std::min<int64_t>(GB_MAX, G - g0);
      const float* qg = qf.data() + g0 * D;
      switch (gb) {
        case 4: scores_block<T, 4>(qg, k, D, D16, s); break;
        case 3: scores_block<T, 3>(qg, k, D, D16, s); break;
        case 2: scores_block<T, 2>(qg, k, D, D16, s); break;
        default: scores_block<T, 1>(qg, k, D, D16, s); break;
      }
      for (int64_t g = 0; g < gb; ++g) p[(g0 + g) * n + i] = s[g] * scale;
    }
  }
  std::vector<float> inv(G);
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p.data() + g * n;
    float m = pg[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, pg[i]);
    float sum = 0.f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {  // exp16: cpu_native_pointwise_src.py
      const vf e = tgs_pointwise::exp16(load_f(pg + i) - splat(m));
      std::memcpy(pg + i, &e, sizeof(e));
    }
    for (; i < n; ++i) pg[i] = tgs_pointwise::exp1(pg[i] - m);
    for (i = 0; i < n; ++i) {
      sum += pg[i];
      if (round_probs) pg[i] = bf16_bits_to_float(float_to_bf16_bits(pg[i]));
    }
    inv[g] = 1.f / sum;
  }
  // Values: each value vector widened once for GB heads, accumulated in registers over the positions.
  for (int64_t g0 = 0; g0 < G; g0 += GB_MAX) {
    const int64_t gb = std::min<int64_t>(GB_MAX, G - g0);
    const float* pg = p.data() + g0 * n;
    float* ag = acc.data() + g0 * D;
    switch (gb) {
      case 4: values_heads<T, 4>(pg, n, vc, table, start, bs, KVH, kvh, D, D16, ag); break;
      case 3: values_heads<T, 3>(pg, n, vc, table, start, bs, KVH, kvh, D, D16, ag); break;
      case 2: values_heads<T, 2>(pg, n, vc, table, start, bs, KVH, kvh, D, D16, ag); break;
      default: values_heads<T, 1>(pg, n, vc, table, start, bs, KVH, kvh, D, D16, ag); break;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    T* o = out + (kvh * G + g) * D;
    for (int64_t d = 0; d < D; ++d) {
      const float y = acc[g * D + d] * inv[g];
      if constexpr (std::is_same<T, float>::value) o[d] = y; else o[d] = float_to_bf16_bits(y);
    }
  }
}

}  // namespace tgs_decode

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [B, H, D], got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16,
              "q must be float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes()
              && value_cache.is_contiguous(), "caches must be contiguous [blocks, block_size, KVH, D] of one shape");
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type() && value_cache.scalar_type() == q.scalar_type(),
              "caches must have q's dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = key_cache.size(1), KVH = key_cache.size(2), blocks = key_cache.size(0);
  TORCH_CHECK(key_cache.size(3) == D, "cache head_dim ", key_cache.size(3), " != q's ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads ", H, " must be a multiple of the cache's KV heads ", KVH);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B, "block_tables must be [B, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == B && seq_lens.scalar_type() == torch::kLong,
              "seq_lens must be int64 [B]");
  auto table = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t width = table.size(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= width * bs, "row ", b, ": length ", lp[b], " past its ", width, " blocks");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(0 <= tp[b * width + j] && tp[b * width + j] < blocks, "row ", b, ": block id out of range");
  }
  auto out = torch::empty_like(q);
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
  tgs::parallel_for(0, B * KVH, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf, p, acc;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      if (bf16) {
        const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) + b * H * D;
        tgs_decode::decode_task<uint16_t>(
            qp, reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>()),
            reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + b * H * D, tp + b * width, lp[b], window,
            bs, KVH, H, D, kvh, float(scale), true, qf, p, acc);
      } else {
        tgs_decode::decode_task<float>(q.data_ptr<float>() + b * H * D, key_cache.data_ptr<float>(),
                                       value_cache.data_ptr<float>(), out.data_ptr<float>() + b * H * D,
                                       tp + b * width, lp[b], window, bs, KVH, H, D, kvh, float(scale), false, qf,
                                       p, acc);
      }
    }
  });
  return out;
}

// One decode step's attention block after the q/k/v projection, bfloat16, in one call: q and k rotated
// (rotate-half, `sin` signed: tgs_pointwise::rotate_head_bf16, rotary_bf16's own rotation), k and v
// written to their cache slots, then paged_decode_attention's arithmetic over the cache. The same bits
// as those calls one after another (layers/self_attention.py's eager path), minus ~8 torch calls and
// their tensors a layer.
torch::Tensor decode_attention_bf16(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor key_cache,
                                    torch::Tensor value_cache, torch::Tensor slots, torch::Tensor block_tables,
                                    torch::Tensor seq_lens, int64_t H, int64_t KVH, double scale, int64_t window) {
  auto sl = tgs_pointwise::checked_decode_inputs(qkv, cos, sin, key_cache, value_cache, slots, H, KVH,
                                                 torch::kBFloat16, "bfloat16");
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t T = qkv.size(0), D = key_cache.size(3);
  auto q = torch::empty({T, H, D}, qkv.options());
  using tgs_pointwise::rotate_head_bf16;
  uint16_t* kc = reinterpret_cast<uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  uint16_t* vc = reinterpret_cast<uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  const uint16_t* base = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>());
  uint16_t* qp = reinterpret_cast<uint16_t*>(q.data_ptr<at::BFloat16>());
  for (int64_t t = 0; t < T; ++t) {  // T x (H + 2 KVH) heads of D numbers: too little to split
    const uint16_t* row = base + t * qkv.stride(0);
    const uint16_t* c = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>()) + t * cos.stride(0);
    const uint16_t* s = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>()) + t * sin.stride(0);
    for (int64_t h = 0; h < H; ++h) rotate_head_bf16(row + h * D, c, s, qp + (t * H + h) * D, D);
    for (int64_t h = 0; h < KVH; ++h) {
      rotate_head_bf16(row + (H + h) * D, c, s, kc + (sp[t] * KVH + h) * D, D);
      std::memcpy(vc + (sp[t] * KVH + h) * D, row + (H + KVH + h) * D, D * sizeof(uint16_t));
    }
  }
  return paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, window).view({T, H * D});
}
"""

FUNCTIONS = ["paged_decode_attention", "decode_attention_bf16"]


def with_decode_kernels(source: str, functions: list[str]) -> tuple[str, list[str]]:
    """cpu_native's source and function list with the decode attention added (one extension, one build)."""
    return source + SOURCE, [*functions, *FUNCTIONS]
