// Batch-invariant attention over position blocks for CPU, called from JAX through XLA's FFI
// (model_worker/modeling/block_attention.py holds the pure-JAX twin it must equal bit for bit, and the wiring).
//
// For batch row r, query c (position qp = qpos[r, c]) and head n (KV head k = n / (N / K)), over the blocks
// b = first[r] .. first[r] + count[r] - 1 in order, each holding positions p = b T0 + t, t < T0:
//   s[t]  = (fixed_order_sum_d q[d] k_p[d]) * scale     if p is held and visible (0 <= p <= qp, qp - p < window),
//           else -1e30                                   (q, k_p bfloat16: every product is exact in float32)
//   m'    = max(m, max_t s[t])
//   p[t]  = bfloat16(exp(s[t] - m'))                     (exp: Cephes' expf in plain float32 operations, 0 below -40)
//   acc   = acc * exp(m - m') + pairs_t p[t] v_p          (pairs: the tree of adjacent pairs over t, per d)
//   l     = l * exp(m - m') + pairs_t p[t]
//   m     = m'
// starting from m = -1e30, acc = 0, l = 0; out[r, c, n] = (acc[0..D), l). The caller divides.
//
// fixed_order_sum: fixed_order.py's tree (halves added pairwise). Every operation is a single IEEE float32
// operation (-ffp-contract=off), so the result does not depend on the batch, on the other queries or on the
// threads: batch invariance by construction, as for the block-int8 products. Blocks holding no visible key
// change nothing once one has (p = 0, a rescale of 1), so visiting more blocks than a query needs is exact.
//
// Threads: XLA's intra-op pool, the calling thread working too; a task is one (row, KV head, up to 4 queries).
// Paths (attribute `path`, as the block-int8 product's): 0 = the best the CPU has, 1 = scalar loops, 2 = AVX2,
// 3 = AVX-512; the vector code is one source compiled per instruction set (block_attention_simd.cc), the same
// elementwise operations, so every path gives the same bits.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "block_attention.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using gemma_attention::Args;

namespace attn_base {
void run(const Args* a, int64_t task0, int64_t task1, bool vector);
}
#if defined(__x86_64__)
namespace attn_avx2 {
void run(const Args* a, int64_t task0, int64_t task1, bool vector);
}
namespace attn_avx512 {
void run(const Args* a, int64_t task0, int64_t task1, bool vector);
}
#endif

namespace {

using RunFn = void (*)(const Args*, int64_t, int64_t, bool);

int attention_cpu_path() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 3;
  if (__builtin_cpu_supports("avx2")) return 2;
#endif
  return 0;  // the baseline vector code (SSE2 on x86-64)
}

struct Work {
  Args args;
  RunFn run;
  bool vector;
  int64_t chunk;  // tasks claimed at once
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void drain() {
    for (int64_t t0; (t0 = next.fetch_add(chunk)) < args.tasks;) {
      int64_t t1 = std::min(args.tasks, t0 + chunk);
      run(&args, t0, t1, vector);
      done.fetch_add(t1 - t0, std::memory_order_release);
    }
  }
};

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U16> q, ffi::Buffer<ffi::S32> qpos,
                         ffi::Buffer<ffi::U16> keys, ffi::Buffer<ffi::U16> vals, ffi::Buffer<ffi::S32> rows,
                         ffi::Buffer<ffi::S32> kpos, ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> first,
                         ffi::Buffer<ffi::S32> count, int64_t mode, int64_t block, int64_t ring, int64_t window,
                         float scale, int64_t path, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = keys.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vals.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("block_attention: q, keys and vals must be 4-D");
  int64_t B = qd[0], C = qd[1], N = qd[2], D = qd[3], S = kd[0], L = kd[1], K = kd[2];
  if (kd[3] != D || vals.element_count() != keys.element_count() || K == 0 || N % K)
    return ffi::Error::InvalidArgument("block_attention: keys/vals must be [S, L, K, D] with N a multiple of K");
  if (block <= 0 || (block & (block - 1)) || mode < 0 || mode > 2 || window < 0)
    return ffi::Error::InvalidArgument("block_attention: block must be a power of two, mode 0-2, window >= 0");
  if (qpos.element_count() != B * C || rows.element_count() != B || start.element_count() != B ||
      first.element_count() != B || count.element_count() != B || out->element_count() != B * C * N * (D + 1))
    return ffi::Error::InvalidArgument("block_attention: qpos [B, C], rows/start/first/count [B], out [B, C, N, D+1]");
  if (mode != gemma_attention::kFull &&
      (ring <= 0 || ring > L || (mode == gemma_attention::kRing && ring != L) || kpos.element_count() != B * L))
    return ffi::Error::InvalidArgument("block_attention: ring/chunk modes need 0 < ring <= L and kpos [B, L]");
  for (int64_t r = 0; r < B; ++r) {
    if (rows.typed_data()[r] < 0 || rows.typed_data()[r] >= S || first.typed_data()[r] < 0 ||
        count.typed_data()[r] < 0)
      return ffi::Error::InvalidArgument("block_attention: a row outside [0, S), or a negative first/count");
  }
  if (B * C * N == 0) return ffi::Error::Success();
  auto work = std::make_shared<Work>();
  Args& a = work->args;
  a = Args{q.typed_data(), qpos.typed_data(), keys.typed_data(), vals.typed_data(), rows.typed_data(),
           kpos.typed_data(), start.typed_data(), first.typed_data(), count.typed_data(), out->typed_data(),
           B, C, N, D, S, L, K, mode, block, ring, window, scale, 4, 1, 0};
  a.queries_per_task = std::min<int64_t>(C, 4);
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t tasks = B * K * ((C + a.queries_per_task - 1) / a.queries_per_task);
  // Fewer tasks than threads (a decode step of one row): split each KV head's query heads between threads too;
  // each reads the same keys (from the cache the other brought in), halving the arithmetic per thread.
  for (int64_t G = N / K; tasks * a.head_groups < threads && G % (2 * a.head_groups) == 0;) a.head_groups *= 2;
  a.tasks = tasks * a.head_groups;
  int best = attention_cpu_path();
  int chosen = (path <= 0 || path > 3) ? best : int(path);
  if (chosen > 1 && chosen > best) chosen = best;  // a path the CPU lacks: the best it has
  work->vector = chosen != 1;
  work->run = attn_base::run;
#if defined(__x86_64__)
  if (chosen == 3) work->run = attn_avx512::run;
  if (chosen == 2) work->run = attn_avx2::run;
#endif
  work->chunk = std::max<int64_t>(1, a.tasks / (4 * threads));
  int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads() - 1, a.tasks / work->chunk - 1));
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < a.tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaBlockAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("ring")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("path")
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int gemma_attention_cpu_path() { return attention_cpu_path(); }
