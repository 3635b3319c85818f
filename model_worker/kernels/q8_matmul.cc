// Block-int8 matrix product for CPU decode and prompt steps, called from JAX through XLA's FFI
// (model_worker/q8.py builds it on first use and holds the pure-JAX twin it must equal bit for bit).
//
//   y[m, n] = fixed_order_sum over blocks b of  float(isum[m, n, b]) * (xs[m, b] * ws[n, b])
//   isum[m, n, b] = sum over i < 32 of xq[m, 32 b + i] * wq[n, 32 b + i]        (int32, exact)
//
// xq: int8 [M, K] activations quantized per block of 32 (values in [-127, 127]), xs: float32 [M, K/32] their
// scales; wq: int8 [N, K] weights (values in [-127, 127], as GGUF Q8_0 blocks are), ws: float32 [N, K/32].
// Integer block sums are exact, so their order (SIMD lanes, threads, batch size) cannot change a bit; the float
// epilogue runs in one fixed order per output: each block's term, then the tree of `layers.fixed_order_sum`
// (halves added pairwise, an odd element joining the last pair). Compiled with -ffp-contract=off, so no fused
// multiply-add changes a rounding. Threads: XLA's own intra-op pool (xla::ffi::ThreadPool); the caller works too.
//
// Paths (attribute `path`): 0 = the best the CPU has, 1 = portable scalar, 2 = AVX2, 3 = AVX-512 VNNI. A path the
// CPU lacks falls back to the next one it has, so every path gives the same bits on any machine.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxBlocks = 1024;  // K <= 32768

using BlockSums = void (*)(const int8_t* x, const int8_t* w, int64_t nb, int32_t* out);

void block_sums_scalar(const int8_t* x, const int8_t* w, int64_t nb, int32_t* out) {
  for (int64_t b = 0; b < nb; ++b) {
    int32_t s = 0;
    for (int64_t i = 0; i < kBlock; ++i) s += int32_t(x[b * kBlock + i]) * int32_t(w[b * kBlock + i]);
    out[b] = s;
  }
}

#if defined(__x86_64__)
// |x| (unsigned) times w with x's sign: pairs of products fit int16 without saturation because |x|, |w| <= 127.
__attribute__((target("avx2"))) void block_sums_avx2(const int8_t* x, const int8_t* w, int64_t nb, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kBlock));
    __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
    __m256i p32 = _mm256_madd_epi16(p16, ones);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p32), _mm256_extracti128_si256(p32, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    out[b] = _mm_cvtsi128_si32(s);
  }
}

// Two blocks per 64-byte register: vpdpbusd (unsigned |x| times signed w with x's sign) into 16 int32 lanes,
// lanes 0-7 holding the first block, 8-15 the second.
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2"))) void block_sums_vnni(const int8_t* x, const int8_t* w,
                                                                                   int64_t nb, int32_t* out) {
  const __m512i zero = _mm512_setzero_si512();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512i xv = _mm512_loadu_si512(x + b * kBlock);
    __m512i wv = _mm512_loadu_si512(w + b * kBlock);
    __mmask64 neg = _mm512_movepi8_mask(xv);
    __m512i ax = _mm512_abs_epi8(xv);
    __m512i sw = _mm512_mask_sub_epi8(wv, neg, zero, wv);
    __m512i acc = _mm512_dpbusd_epi32(zero, ax, sw);
    out[b] = _mm512_mask_reduce_add_epi32(0x00ff, acc);
    out[b + 1] = _mm512_mask_reduce_add_epi32(0xff00, acc);
  }
  if (b < nb) block_sums_avx2(x + b * kBlock, w + b * kBlock, nb - b, out + b);
}
#endif

int cpu_path() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return 3;
  if (__builtin_cpu_supports("avx2")) return 2;
#endif
  return 1;
}

BlockSums pick(int64_t wanted) {
  int best = cpu_path();
  int path = (wanted <= 0 || wanted > best) ? best : int(wanted);
#if defined(__x86_64__)
  if (path == 3) return block_sums_vnni;
  if (path == 2) return block_sums_avx2;
#endif
  return block_sums_scalar;
}

// The tree of layers.fixed_order_sum over t[0..n): halves added pairwise, an odd element joining the last pair.
float fixed_order_sum(float* t, int64_t n) {
  while (n > 1) {
    int64_t half = n / 2;
    for (int64_t i = 0; i < half; ++i) t[i] = t[i] + t[half + i];
    if (n % 2) t[half - 1] = t[half - 1] + t[2 * half];
    n = half;
  }
  return t[0];
}

struct Work {
  const int8_t* xq;
  const float* xs;
  const int8_t* wq;
  const float* ws;
  float* y;
  int64_t M, N, K, nb, rows_per_chunk, chunks;
  BlockSums sums;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run_chunk(int64_t c) {
    int32_t isum[kMaxBlocks];
    float t[kMaxBlocks];
    int64_t n0 = c * rows_per_chunk, n1 = std::min(N, n0 + rows_per_chunk);
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wrow = wq + n * K;
      const float* wsrow = ws + n * nb;
      for (int64_t m = 0; m < M; ++m) {
        sums(xq + m * K, wrow, nb, isum);
        const float* xsrow = xs + m * nb;
        for (int64_t b = 0; b < nb; ++b) t[b] = float(isum[b]) * (xsrow[b] * wsrow[b]);
        y[m * N + n] = fixed_order_sum(t, nb);
      }
    }
  }

  // Claim chunks until none is left; true when this call finished the last one.
  void drain() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      run_chunk(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Q8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq, ffi::Buffer<ffi::F32> xs,
                        ffi::Buffer<ffi::S8> wq, ffi::Buffer<ffi::F32> ws, int64_t path,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto xd = xq.dimensions(), wd = wq.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("q8_matmul: xq and wq must be 2-D");
  int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K || K % kBlock || K / kBlock > kMaxBlocks)
    return ffi::Error::InvalidArgument("q8_matmul: K must match, be a multiple of 32 and at most 32768");
  int64_t nb = K / kBlock;
  if (xs.element_count() != M * nb || ws.element_count() != N * nb || y->element_count() != M * N)
    return ffi::Error::InvalidArgument("q8_matmul: scale or output shapes do not match [M, K/32], [N, K/32], [M, N]");
  auto work = std::make_shared<Work>();
  work->xq = xq.typed_data();
  work->xs = xs.typed_data();
  work->wq = wq.typed_data();
  work->ws = ws.typed_data();
  work->y = y->typed_data();
  work->M = M, work->N = N, work->K = K, work->nb = nb;
  work->sums = pick(path);
  // About 64 KiB of weight rows per chunk: small enough to spread over the pool, large enough to amortize a task.
  work->rows_per_chunk = std::max<int64_t>(1, (int64_t(64) << 10) / std::max<int64_t>(K, 1));
  work->chunks = (N + work->rows_per_chunk - 1) / work->rows_per_chunk;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), work->chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaQ8Matmul, Q8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("path")
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int gemma_q8_cpu_path() { return cpu_path(); }
