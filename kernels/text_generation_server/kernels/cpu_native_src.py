"""C++ source of the native CPU kernels (compiled on first use by cpu_native.py).

A weight-only matrix-vector product for int8 codes and bfloat16 weights that reads each weight byte
once per 8 activation rows (torch's `_weight_int8pack_mm` re-reads the weights for every row), with
a row's bits independent of the rows beside it; dequantizers that turn row blocks of int8 or
torch-int4-packed weights into bfloat16 for prompt-sized matmuls, where torch's weight-only ops run
5-8x slower than dequantizing and calling the bfloat16 GEMM; and (cpu_native_int4_src.py) the int4
kernel that reads torch's packed layout in place. Written with GCC/Clang vector extensions, with
AVX-512/AVX2 intrinsics where a generic form compiles badly: `-march=native` maps a 16-float vector
onto one AVX-512 register, two AVX2 registers or four NEON ones, so one source serves x86-64 and
aarch64.

int8 layout: w [N, K] int8 codes centred on zero, one float32 scale per output row.

Every kernel splits its output over the threads with `tgs::parallel_for` (defined first in SOURCE, so
the sources appended after it can call it too): at::parallel_for's signature, but a persistent pool
whose threads claim chunks of the range, so a thread that another process keeps off its core delays a
call by at most the chunk it claimed (the comment above it says how; BENCHMARKS.md, issue #32
session 8, has the measurements).
"""

from text_generation_server.kernels.cpu_native_int4_src import FUNCTIONS as INT4_FUNCTIONS
from text_generation_server.kernels.cpu_native_int4_src import SOURCE as INT4_SOURCE
from text_generation_server.kernels.cpu_native_q8_src import FUNCTIONS as Q8_FUNCTIONS
from text_generation_server.kernels.cpu_native_q8_src import SOURCE as Q8_SOURCE

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <sched.h>

// ---- tgs::parallel_for: a thread split that survives a contended core ----------------------------
// at::parallel_for (OpenMP here: a static split of the range over the team and a fork/join barrier)
// makes every call wait for its slowest thread. When another process holds the second core, that
// thread may not run for a scheduler time slice (milliseconds), and a two-thread one-row kernel that
// reads 1.7 MiB in ~0.1 ms took ~8 ms (0.2-1.9 GB/s; BENCHMARKS.md, issue #32 session 7). Here the
// calling thread and a small persistent pool claim chunks of the range from one atomic counter: a
// thread that is not running claims nothing, so the others (the caller at least) take its share,
// and the caller waits only for chunks already claimed. Chunks are output ranges the kernels compute
// whole, so a result's bits never depend on the split or on who ran a chunk (the same guarantee the
// kernels gave at::parallel_for's split). Same signature as at::parallel_for:
//   tgs::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { ... });
// Threads: at::get_num_threads() (torch.set_num_threads / OMP_NUM_THREADS still rule); a range of at
// most `grain`, one thread, or a call from inside a chunk or an OpenMP region runs on the caller's
// thread. A second caller while a job runs (another Python thread) runs its range on its own thread.
// tgs::set_parallel_mode(0) (Python: cpu_native.set_parallel_mode) sends every call to
// at::parallel_for instead (benchmarks compare the two in one process; TGS_CPU_POOL=off).
namespace tgs {

typedef void (*ChunkFn)(void* ctx, int64_t begin, int64_t end);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();  // no header needed: builds without AVX2 include no immintrin.h
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Pool {
 public:
  // Idle workers spin this long for the next job before they sleep: a decode step calls the kernels
  // every few to tens of microseconds, and a sleeping worker takes tens of microseconds to wake.
  std::atomic<int64_t> spin_ns{50000};
  // The caller waits for claimed chunks spinning this long, then sleeps (its core idle, the kernel's
  // load balancer may move a preempted worker there).
  std::atomic<int64_t> wait_spin_ns{20000};
  // Chunks per thread a range is cut into (bounded below by the call's grain).
  std::atomic<int64_t> chunks_per_thread{8};

  // Runs fn(ctx, b, e) over [begin, end) in chunks of `chunk`, with up to `threads` - 1 workers.
  void run(int64_t begin, int64_t end, int64_t chunk, int threads, ChunkFn fn, void* ctx) {
    const int64_t nchunks = (end - begin + chunk - 1) / chunk;
    ensure_workers(threads - 1);
    const uint64_t gen = (counter_.load(std::memory_order_relaxed) >> 32) + 1;
    // Closed first: a worker still holding the last job's fields cannot claim from the new count.
    counter_.store(pack(gen, CLOSED), std::memory_order_seq_cst);
    fn_.store(fn, std::memory_order_release);
    ctx_.store(ctx, std::memory_order_release);
    begin_.store(begin, std::memory_order_release);
    end_.store(end, std::memory_order_release);
    chunk_.store(chunk, std::memory_order_release);
    nchunks_.store(nchunks, std::memory_order_release);
    active_.store(threads - 1, std::memory_order_release);
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    counter_.store(pack(gen, 0), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      work_cv_.notify_all();
    }
    work(gen, fn, ctx, begin, end, chunk, nchunks);
    // Wait for the chunks the workers claimed.
    if (done_.load(std::memory_order_acquire) < nchunks) {
      const int64_t limit = now_ns() + wait_spin_ns.load(std::memory_order_relaxed);
      int spins = 0;
      while (done_.load(std::memory_order_acquire) < nchunks) {
        cpu_relax();
        if (++spins % 64 == 0 && now_ns() > limit) break;
      }
      if (done_.load(std::memory_order_acquire) < nchunks) {
        std::unique_lock<std::mutex> lock(mu_);
        caller_waiting_.store(true, std::memory_order_seq_cst);
        done_cv_.wait(lock, [&] { return done_.load(std::memory_order_seq_cst) >= nchunks; });
        caller_waiting_.store(false, std::memory_order_relaxed);
      }
    }
    if (error_) std::rethrow_exception(error_);
  }

  static Pool& get() {
    static std::once_flag once;
    std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &Pool::after_fork); });
    Pool* p = instance_.load(std::memory_order_acquire);
    if (p == nullptr) {
      std::lock_guard<std::mutex> lock(create_mu());
      p = instance_.load(std::memory_order_relaxed);
      if (p == nullptr) {
        p = new Pool();  // never freed: detached workers wait on it until the process ends
        instance_.store(p, std::memory_order_release);
      }
    }
    return *p;
  }

  std::mutex submit;  // one job at a time

  int workers() const { return int(threads_); }

 private:
  static constexpr uint64_t CLOSED = 0xFFFFFFFFull;
  static uint64_t pack(uint64_t gen, uint64_t index) { return (gen << 32) | index; }
  static uint64_t gen_of(uint64_t v) { return v >> 32; }
  static uint64_t index_of(uint64_t v) { return v & 0xFFFFFFFFull; }

  static std::mutex& create_mu() { static std::mutex m; return m; }
  // A forked child has none of the parent's threads: it starts a new pool (the old one is leaked,
  // its locks perhaps held by threads that do not exist there).
  static void after_fork() { instance_.store(nullptr, std::memory_order_relaxed); }
  static inline std::atomic<Pool*> instance_{nullptr};

  void ensure_workers(int wanted) {
    while (int(threads_) < wanted) {
      const int index = int(threads_);
      // the generation it has seen: the current one, before the caller opens its job
      const uint64_t seen = gen_of(counter_.load(std::memory_order_acquire));
      std::thread([this, index, seen] { worker(index, seen); }).detach();
      threads_ = index + 1;
    }
  }

  // Claims and runs chunks of job `gen` until none is left (or the job is no longer current).
  int64_t work(uint64_t gen, ChunkFn fn, void* ctx, int64_t begin, int64_t end, int64_t chunk, int64_t nchunks) {
    int64_t ran = 0;
    uint64_t v = counter_.load(std::memory_order_acquire);
    for (;;) {
      if (gen_of(v) != gen || int64_t(index_of(v)) >= nchunks) return ran;
      if (!counter_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const int64_t b = begin + int64_t(index_of(v)) * chunk;
      try {
        fn(ctx, b, std::min(end, b + chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      ++ran;
      if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == nchunks
          && caller_waiting_.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lock(mu_);
        done_cv_.notify_all();
      }
      v = counter_.load(std::memory_order_acquire);
    }
  }

  void worker(int index, uint64_t seen) {
    inside() = true;
    for (;;) {
      uint64_t v = counter_.load(std::memory_order_acquire);
      if (gen_of(v) == seen) {
        const int64_t limit = now_ns() + spin_ns.load(std::memory_order_relaxed);
        int spins = 0;
        while (gen_of(v = counter_.load(std::memory_order_acquire)) == seen) {
          cpu_relax();
          if (++spins % 64 == 0 && now_ns() > limit) break;
        }
        if (gen_of(v) == seen) {
          std::unique_lock<std::mutex> lock(mu_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          work_cv_.wait(lock, [&] { return gen_of(counter_.load(std::memory_order_seq_cst)) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
          v = counter_.load(std::memory_order_acquire);
        }
      }
      if (index_of(v) == CLOSED) {  // the caller is still writing the job: wait for it to open
        while (index_of(v = counter_.load(std::memory_order_acquire)) == CLOSED) cpu_relax();
      }
      const uint64_t gen = gen_of(v);
      seen = gen;
      // The fields may belong to a later job if this one ended meanwhile; then the counter's
      // generation has moved on and `work` claims nothing.
      ChunkFn fn = fn_.load(std::memory_order_acquire);
      void* ctx = ctx_.load(std::memory_order_acquire);
      const int64_t begin = begin_.load(std::memory_order_acquire), end = end_.load(std::memory_order_acquire);
      const int64_t chunk = chunk_.load(std::memory_order_acquire), nchunks = nchunks_.load(std::memory_order_acquire);
      if (index >= active_.load(std::memory_order_acquire)) continue;  // fewer threads asked for this job
      work(gen, fn, ctx, begin, end, chunk, nchunks);
    }
  }

 public:
  static bool& inside() { static thread_local bool in = false; return in; }

 private:
  std::atomic<uint64_t> counter_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> begin_{0}, end_{0}, chunk_{1}, nchunks_{0};
  std::atomic<int> active_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_waiting_{false};
  std::exception_ptr error_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::atomic<int> threads_{0};
};

// 1: the pool; 0: at::parallel_for (set_parallel_mode).
inline std::atomic<int>& parallel_mode() { static std::atomic<int> mode{1}; return mode; }

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (parallel_mode().load(std::memory_order_relaxed) == 0) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  grain = std::max<int64_t>(grain, 1);
  const int64_t range = end - begin;
  const int threads = std::min<int64_t>(at::get_num_threads(), (range + grain - 1) / grain);
  if (threads <= 1 || Pool::inside() || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  Pool& pool = Pool::get();
  std::unique_lock<std::mutex> lock(pool.submit, std::try_to_lock);
  if (!lock.owns_lock()) {  // another thread's job runs: this one on its own thread
    f(begin, end);
    return;
  }
  const int64_t per = pool.chunks_per_thread.load(std::memory_order_relaxed);
  const int64_t chunk = std::max<int64_t>(grain, (range + threads * per - 1) / (threads * per));
  Pool::inside() = true;
  struct Reset { ~Reset() { Pool::inside() = false; } } reset;
  pool.run(begin, end, chunk, threads, [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); },
           const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace tgs

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
  // stack). The int4 kernel has its own 8-float form for AVX2 (INT4_AVX2, cpu_native_int4_src.py).
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
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The AVX2 form, in 8-float registers: the generic 16-float vectors below compiled to ~15 GB/s a core
// at one row on AVX2 (hot bfloat16 weights, where torch's oneDNN matrix-vector product reads 23;
// BENCHMARKS.md issue #32 session 10). The same arithmetic lane for lane (16 lanes: k % 16 < 8 in
// `lo`, the rest in `hi`; one FMA per lane and step; the lanes summed 0..15 in order; the same tail),
// so the same bits as the generic form.
inline __m256 avx2_w8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 avx2_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <int M, int NB, typename T>
inline void gemv_rows(const float* x, const T* w, const float* s, float* y, int64_t K, int64_t N, int64_t n,
                      int64_t prefetch, int64_t stride = 1) {
  __m256 lo[M][NB], hi[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) lo[m][b] = hi[m][b] = _mm256_setzero_ps();
  auto step = [&](int64_t kk) {
    __m256 wl[NB], wh[NB];
    for (int b = 0; b < NB; ++b) {
      wl[b] = avx2_w8(w + (n + b * stride) * K + kk);
      wh[b] = avx2_w8(w + (n + b * stride) * K + kk + 8);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 xl = _mm256_loadu_ps(x + m * K + kk), xh = _mm256_loadu_ps(x + m * K + kk + 8);
      for (int b = 0; b < NB; ++b) {
        lo[m][b] = _mm256_fmadd_ps(xl, wl[b], lo[m][b]);
        hi[m][b] = _mm256_fmadd_ps(xh, wh[b], hi[m][b]);
      }
    }
  };
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    if (prefetch)
      for (int b = 0; b < NB; ++b)
        for (int line = 0; line < int(64 * sizeof(T)); line += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(w + (n + b * stride) * K + k) + prefetch + line, 0,
                             PREFETCH_LOCALITY);
    for (int64_t kk = k; kk < k + 64; kk += 16) step(kk);
  }
  for (; k + 16 <= K; k += 16) step(k);
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      alignas(32) float lanes[16];
      _mm256_store_ps(lanes, lo[m][b]);
      _mm256_store_ps(lanes + 8, hi[m][b]);
      float t = 0.f;
      for (int j = 0; j < 16; ++j) t += lanes[j];
      for (int64_t kk = k; kk < K; ++kk) t = __builtin_fmaf(x[m * K + kk], weight_value(w[(n + b * stride) * K + kk]), t);
      y[m * N + n + b * stride] = s ? t * s[n + b * stride] : t;
    }
}
#else
template <int M, int NB, typename T>
inline void gemv_rows(const float* x, const T* w, const float* s, float* y, int64_t K, int64_t N, int64_t n,
                      int64_t prefetch, int64_t stride = 1) {
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
          __builtin_prefetch(reinterpret_cast<const char*>(w + (n + b * stride) * K + k) + prefetch + line, 0,
                             PREFETCH_LOCALITY);
    for (int64_t kk = k; kk < k + 64; kk += 16) {
      vf wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = load_w(w + (n + b * stride) * K + kk);
      for (int m = 0; m < M; ++m) {
        vf xv = load_f(x + m * K + kk);
        for (int b = 0; b < NB; ++b) acc[m][b] = fmadd(xv, wv[b], acc[m][b]);
      }
    }
  }
  for (; k + 16 <= K; k += 16) {
    vf wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = load_w(w + (n + b * stride) * K + k);
    for (int m = 0; m < M; ++m) {
      vf xv = load_f(x + m * K + k);
      for (int b = 0; b < NB; ++b) acc[m][b] = fmadd(xv, wv[b], acc[m][b]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      float t = hsum(acc[m][b]);
      for (int64_t kk = k; kk < K; ++kk) t = __builtin_fmaf(x[m * K + kk], weight_value(w[(n + b * stride) * K + kk]), t);
      y[m * N + n + b * stride] = s ? t * s[n + b * stride] : t;
    }
}
#endif

template <int M, int NB, typename T>
void gemv_impl(const float* x, const T* w, const float* s, float* y, int64_t K, int64_t N, int64_t prefetch) {
  const int64_t blocks = N / NB;
  tgs::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) gemv_rows<M, NB>(x, w, s, y, K, N, i * NB, prefetch);
  });
  for (int64_t n = blocks * NB; n < N; ++n) gemv_rows<M, 1>(x, w, s, y, K, N, n, prefetch);
}

// bfloat16 weights at 1-2 rows: S concurrent weight streams a thread. A chunk of outputs [a, e) is cut
// into S contiguous runs and a tile takes the next output of each run (outputs n, n + len, ...; stride
// `len`), so each thread reads S sequential streams at once instead of one: with one stream a core the
// hardware prefetchers leave a fifth of the read bandwidth unused. Cold Qwen2.5-1.5B shapes, one row,
// 2 threads, the 2-core Ice Lake Xeon VM (no AVX512-BF16), a quiet moment: a plain read of the same
// bytes streamed 20-22 GB/s as one stream a thread and 26-28 as 8 (a C++ prototype); this kernel read
// 20-22 with 2 adjacent outputs a tile, 24-31 with 8 streams (both builds; the head 1.36-1.39x,
// o_proj 1.09-1.13x). Each output's arithmetic is gemv_rows' whatever the tile or its stride, so a
// row's bits are those of the 3-8 row tiles and of any split.
// S: 8 at one row on both builds; at two rows 8 with AVX-512 (16 accumulators of its 32 registers) and
// 4 with AVX2 (16 accumulators: the weights spill to L1, still 1.1x faster than 2 streams). AVX2 at
// one row took 8 over 4 by 1.0-1.1x, two rows 4 over 2 by 1.1-1.16x (interleaved, cold, loaded
// machine; BENCHMARKS.md, issue #32 session 14).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr int BF16_STREAMS_1 = 8, BF16_STREAMS_2 = 4;
#else
constexpr int BF16_STREAMS_1 = 8, BF16_STREAMS_2 = 8;
#endif

template <int M, int S, typename T>
void gemv_impl_streams(const float* x, const T* w, const float* s, float* y, int64_t K, int64_t N, int64_t prefetch) {
  tgs::parallel_for(0, N, 8 * S, [&](int64_t a, int64_t e) {
    const int64_t len = (e - a) / S;
    for (int64_t i = 0; i < len; ++i) gemv_rows<M, S>(x, w, s, y, K, N, a + i, prefetch, len);
    for (int64_t n = a + S * len; n < e; ++n) gemv_rows<M, 1>(x, w, s, y, K, N, n, prefetch);
  });
}

// Row counts 1..8 to their tile shapes (one accumulator per row and output in registers). Every row
// gets the same operations in the same order whatever the tile (explicit FMAs, one horizontal sum
// order), so a row's bits do not depend on how many rows share the call; more than 8 rows run in
// chunks of 8 (each chunk reads the weights once).
template <typename T>
void gemv_chunk(int64_t M, const float* xp, const T* wp, const float* sp, float* yp, int64_t K, int64_t N,
                int64_t pf) {
  if constexpr (std::is_same<T, uint16_t>::value) {  // bfloat16 weights: the streams above
    if (M == 1) return gemv_impl_streams<1, BF16_STREAMS_1>(xp, wp, sp, yp, K, N, pf);
    if (M == 2) return gemv_impl_streams<2, BF16_STREAMS_2>(xp, wp, sp, yp, K, N, pf);
  }
  switch (M) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    // 16 AVX2 registers: two per accumulator (lo, hi), two per weight vector, two for x
    case 1: gemv_impl<1, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 2: gemv_impl<2, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 3: gemv_impl<3, 1>(xp, wp, sp, yp, K, N, pf); break;
    case 4: gemv_impl<4, 1>(xp, wp, sp, yp, K, N, pf); break;
    case 5: gemv_impl<5, 1>(xp, wp, sp, yp, K, N, pf); break;
    case 6: gemv_impl<6, 1>(xp, wp, sp, yp, K, N, pf); break;
    case 7: gemv_impl<7, 1>(xp, wp, sp, yp, K, N, pf); break;
    default: gemv_impl<8, 1>(xp, wp, sp, yp, K, N, pf); break;
#else
    case 1: gemv_impl<1, 2>(xp, wp, sp, yp, K, N, pf); break;  // two independent FMA chains
    case 2: gemv_impl<2, 4>(xp, wp, sp, yp, K, N, pf); break;
    case 3: gemv_impl<3, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 4: gemv_impl<4, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 5: gemv_impl<5, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 6: gemv_impl<6, 2>(xp, wp, sp, yp, K, N, pf); break;
    case 7: gemv_impl<7, 1>(xp, wp, sp, yp, K, N, pf); break;
    default: gemv_impl<8, 1>(xp, wp, sp, yp, K, N, pf); break;
#endif
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
  tgs::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) gemv_rows_bx<M, NB>(x, w, s, y, K, N, i * NB, prefetch);
  });
  for (int64_t n = blocks * NB; n < N; ++n) gemv_rows_bx<M, 1>(x, w, s, y, K, N, n, prefetch);
}

// bfloat16 weights at 3-8 rows: wider tiles than the int8 codes' (which spend registers on their
// conversion): 3-6 rows x 4 outputs, 7-8 rows x 3 (up to 24 accumulators, the weight vectors and one
// of x in the 32 registers), fewer loads of x per weight byte. Cold Qwen2.5-1.5B shapes, 2 threads, the
// 2-core EPYC: the down projection (K = 8960) 1.15-1.27x at 4-8 rows, the K = 1536 shapes level to
// 1.05x, the same bits (BENCHMARKS.md, issue #32 session 12).
inline bool gemv_bf16_wide_bx(int64_t rows, const uint16_t* x, const uint16_t* w, float* y, int64_t K, int64_t N,
                              int64_t pf) {
  switch (rows) {
    case 3: gemv_impl_bx<3, 4>(x, w, nullptr, y, K, N, pf); return true;
    case 4: gemv_impl_bx<4, 4>(x, w, nullptr, y, K, N, pf); return true;
    case 5: gemv_impl_bx<5, 4>(x, w, nullptr, y, K, N, pf); return true;
    case 6: gemv_impl_bx<6, 4>(x, w, nullptr, y, K, N, pf); return true;
    case 7: gemv_impl_bx<7, 3>(x, w, nullptr, y, K, N, pf); return true;
    case 8: gemv_impl_bx<8, 3>(x, w, nullptr, y, K, N, pf); return true;
    default: return false;
  }
}
inline bool gemv_bf16_wide_bx(int64_t, const uint16_t*, const int8_t*, float*, int64_t, int64_t, int64_t) {
  return false;  // int8 codes keep their tiles
}

// The tiles of the bfloat16-x products at 1-8 rows (gemv_impl_bx, and int8_table_impl on its layout):
// calls f(rows, outputs per tile) with both as std::integral_constant, for the template arguments.
template <typename F>
inline void bx_row_tiles(int64_t rows, F&& f) {
  using std::integral_constant;
  switch (rows) {
    case 1: f(integral_constant<int, 1>{}, integral_constant<int, 4>{}); break;
    case 2: f(integral_constant<int, 2>{}, integral_constant<int, 4>{}); break;
    case 3: f(integral_constant<int, 3>{}, integral_constant<int, 2>{}); break;
    case 4: f(integral_constant<int, 4>{}, integral_constant<int, 2>{}); break;
    case 5: f(integral_constant<int, 5>{}, integral_constant<int, 2>{}); break;
    case 6: f(integral_constant<int, 6>{}, integral_constant<int, 2>{}); break;
    case 7: f(integral_constant<int, 7>{}, integral_constant<int, 2>{}); break;
    default: f(integral_constant<int, 8>{}, integral_constant<int, 2>{}); break;
  }
}

template <typename T>
void gemv_dispatch_bx(int64_t M, const uint16_t* xp, const T* wp, const float* sp, float* yp, int64_t K, int64_t N,
                      int64_t pf) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const uint16_t* x = xp + m0 * K;
    float* y = yp + m0 * N;
    if (sp == nullptr && gemv_bf16_wide_bx(std::min<int64_t>(8, M - m0), x, wp, y, K, N, pf)) continue;
    bx_row_tiles(std::min<int64_t>(8, M - m0), [&](auto rows, auto outputs) {
      gemv_impl_bx<decltype(rows)::value, decltype(outputs)::value>(x, wp, sp, y, K, N, pf);
    });
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

// ---- float32 weights: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) -----------------------------
// The decode path of a float32 model (serve's CPU default): torch's GEMM spends ~100 us a call on
// the embedded model's 0.25-1.5 MiB matrices at one row, where reading them takes a few. Per output
// one 16-lane accumulator over k in steps of 16 (a fixed FMA), lanes summed pairwise (a tree, not a
// chain: rounding errors grow with log2(16), not 16), then the k % 16 tail, then the bias: the same
// operations whatever the tile, the row count or the thread split, so a row's bits never depend on
// the rows beside it. NB outputs per pass give NB independent FMA chains for one row.
inline float hsum_tree(vf v) {
  float a[8];
  for (int j = 0; j < 8; ++j) a[j] = v[j] + v[j + 8];
  for (int j = 0; j < 4; ++j) a[j] = a[j] + a[j + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
}

template <int M, int NB>
inline void f32_rows(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n,
                     int64_t prefetch) {
  vf acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = vf{};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    if (prefetch)
      for (int b = 0; b < NB; ++b)
        for (int line = 0; line < 256; line += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(w + (n + b) * K + k) + prefetch + line, 0,
                             PREFETCH_LOCALITY);
    for (int64_t kk = k; kk < k + 64; kk += 16) {
      vf wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = load_f(w + (n + b) * K + kk);
      for (int m = 0; m < M; ++m) {
        vf xv = load_f(x + m * K + kk);
        for (int b = 0; b < NB; ++b) acc[m][b] = fmadd(xv, wv[b], acc[m][b]);
      }
    }
  }
  for (; k + 16 <= K; k += 16) {
    vf wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = load_f(w + (n + b) * K + k);
    for (int m = 0; m < M; ++m) {
      vf xv = load_f(x + m * K + k);
      for (int b = 0; b < NB; ++b) acc[m][b] = fmadd(xv, wv[b], acc[m][b]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      float t = hsum_tree(acc[m][b]);
      for (int64_t kk = k; kk < K; ++kk) t = __builtin_fmaf(x[m * K + kk], w[(n + b) * K + kk], t);
      y[m * N + n + b] = bias ? t + bias[n + b] : t;
    }
}

// Output blocks of NB split over the threads, or run on this one when `parallel` is false (a small
// matrix: forking the pool costs more than the second core saves).
template <int M, int NB>
void f32_impl(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t prefetch,
              bool parallel) {
  const int64_t blocks = N / NB;
  auto body = [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) f32_rows<M, NB>(x, w, bias, y, K, N, i * NB, prefetch);
  };
  if (parallel) tgs::parallel_for(0, blocks, 8, body);
  else body(0, blocks);
  for (int64_t n = blocks * NB; n < N; ++n) f32_rows<M, 1>(x, w, bias, y, K, N, n, prefetch);
}

void f32_dispatch(int64_t M, const float* xp, const float* wp, const float* bp, float* yp, int64_t K, int64_t N,
                  int64_t pf, bool parallel) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* x = xp + m0 * K;
    float* y = yp + m0 * N;
    // Tiles by registers: AVX-512 has 32 vectors of 16 floats (up to 16 accumulators here), AVX2
    // two registers a vector out of 16. The tile changes no bit of a row's result.
    switch (std::min<int64_t>(8, M - m0)) {
#if defined(__AVX512F__)
      case 1: f32_impl<1, 4>(x, wp, bp, y, K, N, pf, parallel); break;
      case 2: f32_impl<2, 4>(x, wp, bp, y, K, N, pf, parallel); break;
      case 3: f32_impl<3, 4>(x, wp, bp, y, K, N, pf, parallel); break;
      case 4: f32_impl<4, 4>(x, wp, bp, y, K, N, pf, parallel); break;
      case 5: f32_impl<5, 2>(x, wp, bp, y, K, N, pf, parallel); break;
      case 6: f32_impl<6, 2>(x, wp, bp, y, K, N, pf, parallel); break;
      case 7: f32_impl<7, 2>(x, wp, bp, y, K, N, pf, parallel); break;
      default: f32_impl<8, 2>(x, wp, bp, y, K, N, pf, parallel); break;
#else
      case 1: f32_impl<1, 4>(x, wp, bp, y, K, N, pf, parallel); break;
      case 2: f32_impl<2, 2>(x, wp, bp, y, K, N, pf, parallel); break;
      case 3: f32_impl<3, 2>(x, wp, bp, y, K, N, pf, parallel); break;
      case 4: f32_impl<4, 1>(x, wp, bp, y, K, N, pf, parallel); break;
      case 5: f32_impl<5, 1>(x, wp, bp, y, K, N, pf, parallel); break;
      case 6: f32_impl<6, 1>(x, wp, bp, y, K, N, pf, parallel); break;
      case 7: f32_impl<7, 1>(x, wp, bp, y, K, N, pf, parallel); break;
      default: f32_impl<8, 1>(x, wp, bp, y, K, N, pf, parallel); break;
#endif
    }
  }
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK((x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) && x.is_contiguous(),
              "x must be contiguous float32 or bfloat16");
  TORCH_CHECK(x.size(0) >= 1, "x must have at least one row, got ", x.size(0));
}

void check_block(int64_t block, int64_t N) {
  TORCH_CHECK(block == 64 || block == 32, "block must be 64 or 32 (torch's AVX-512 or AVX2 layout), got ", block);
  TORCH_CHECK(N % block == 0, "N must be a multiple of ", block, ", got ", N);
}

}  // namespace

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

// x [M, K] float32 (chunks of up to 8 rows, each reading the weights once) @ w [N, K] float32 ^T
// (+ bias [N] float32) -> [M, N] float32. Both threads when the weights take at least
// `parallel_min_bytes`, this one below.
torch::Tensor f32_gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t prefetch,
                       int64_t parallel_min_bytes) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous(), "w must be contiguous float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(0) >= 1, "x must have at least one row, got ", x.size(0));
  TORCH_CHECK(prefetch >= 0, "prefetch must be >= 0");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N && bias->is_contiguous(),
                "bias must be contiguous float32 [", N, "]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({x.size(0), N}, x.options());
  f32_dispatch(x.size(0), x.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), K, N, prefetch,
               N * K * int64_t(sizeof(float)) >= parallel_min_bytes);
  return y;
}

// The split the kernels use (1: tgs::parallel_for's pool, 0: at::parallel_for) and the pool's
// settings (idle workers' spin and the caller's wait spin in microseconds, chunks per thread; a
// negative value keeps the setting); returns the previous mode.
int64_t set_parallel_mode(int64_t mode, int64_t spin_us, int64_t wait_spin_us, int64_t chunks_per_thread) {
  TORCH_CHECK(mode == 0 || mode == 1, "mode must be 0 (at::parallel_for) or 1 (the pool), got ", mode);
  TORCH_CHECK(chunks_per_thread != 0, "chunks_per_thread must be positive (or negative to keep it)");
  tgs::Pool& pool = tgs::Pool::get();
  if (spin_us >= 0) pool.spin_ns.store(spin_us * 1000);
  if (wait_spin_us >= 0) pool.wait_spin_ns.store(wait_spin_us * 1000);
  if (chunks_per_thread > 0) pool.chunks_per_thread.store(chunks_per_thread);
  return tgs::parallel_mode().exchange(int(mode));
}

// Runs out[i] = i over [0, n) in tgs::parallel_for chunks of at least `grain` (the tests: every
// index once, whatever the threads and chunks), and records which thread (0: the caller) ran each;
// index `fail_at` raises (an error in any thread reaches the caller).
torch::Tensor parallel_probe(int64_t n, int64_t grain, int64_t spin_iterations, int64_t fail_at) {
  auto out = torch::full({n, 2}, -1, torch::kLong);
  int64_t* op = out.data_ptr<int64_t>();
  const auto caller = std::this_thread::get_id();
  tgs::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    volatile int64_t sink = 0;
    for (int64_t i = b; i < e; ++i) {
      TORCH_CHECK(i != fail_at, "parallel_probe: index ", i, " fails as asked");
      for (int64_t j = 0; j < spin_iterations; ++j) sink = sink + j;
      op[2 * i] = op[2 * i] == -1 ? i : -2;  // -2: an index run twice
      op[2 * i + 1] = std::this_thread::get_id() == caller ? 0 : 1;
    }
  });
  return out;
}

// Rows n0..n1 of the int8 weight as bfloat16 [n1 - n0, K]: w * s.
torch::Tensor int8_dequant(torch::Tensor w, torch::Tensor s, int64_t n0, int64_t n1) {
  const int64_t K = w.size(1);
  TORCH_CHECK(K % 16 == 0 && 0 <= n0 && n0 < n1 && n1 <= w.size(0), "bad rows or K");
  auto out = torch::empty({n1 - n0, K}, w.options().dtype(torch::kBFloat16));
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  tgs::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
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
  tgs::parallel_for(0, K, 16, [&](int64_t k0, int64_t k1) {
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
""" + INT4_SOURCE + Q8_SOURCE

FUNCTIONS = ["set_parallel_mode", "parallel_probe", "int8_gemv", "bf16_gemv", "f32_gemv", "int8_dequant", "int4pack_dequant_t", *INT4_FUNCTIONS, *Q8_FUNCTIONS]
