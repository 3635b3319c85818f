// Block-int8 matrix product for CPU decode and prompt steps, called from JAX through XLA's FFI
// (model_worker/numerics/q8.py builds it on first use and holds the pure-JAX twin it must equal bit for bit).
//
//   y[m, n] = fixed_order_sum over blocks b of  float(isum[m, n, b]) * (xs[m, b] * ws[n, b])
//   isum[m, n, b] = sum over i < 32 of xq[m, 32 b + i] * wq[n, 32 b + i]        (int32, exact)
//
// xq: int8 [M, K] activations quantized per block of 32 (values in [-127, 127]), xs: float32 [M, K/32] their
// scales. The weights come in tiles of 16 rows, laid out so that one 64-byte load holds 4 consecutive values of
// each of the 16 rows (q8.py `tile_weight`):
//   wt: int8 [N/16, (K/32) * 512], wt[t, b*512 + i*64 + r*4 + j] = wq[16 t + r, 32 b + 4 i + j]
//   st: float16 [N/16, (K/32) * 16], st[t, b*16 + r] = ws[16 t + r, b] (converted to float32 exactly on use;
//       GGUF's Q8_0 scales are float16 as stored, and 2 bytes per 32 weights instead of 4 is 5% of a step's reads)
// so a dot-product instruction that sums 4 byte products into each of 16 int32 lanes gives 16 rows' block sums
// at once, with no horizontal reduction (the layout of oneDNN's and llama.cpp's repacked int8 GEMMs).
//
// 5-bit weights (GGUF Q5_0's values, w = d * (u - 16) with u in [0, 32); q8.py `tile_weight5`) come in the same
// tiles with 320 bytes per tile and block instead of 512: 256 bytes whose low nibbles hold the low 4 bits of the
// int8 layout's loads 0-3 and whose high nibbles those of loads 4-7, then 8 little-endian 64-bit words, word i
// holding the fifth bit of each byte of load i (bit k <-> byte k). The AVX-512 path expands them in registers
// (a masked add of 16 where the bit is set) and multiplies u with the activations, taking off 16 * sum(x) per
// block; the other paths expand a tile to the int8 layout first. The integer block sums are those of u - 16,
// exactly, so both formats give the same bits for the same values.
//
// Integer block sums are exact, so their order (SIMD lanes, threads, batch size) cannot change a bit; the float
// epilogue runs in one fixed order per output: each block's term, then the tree of `fixed_order.fixed_order_sum`
// (halves added pairwise, an odd element joining the last pair), elementwise over the 16 rows of a tile.
// Compiled with -ffp-contract=off, so no fused multiply-add changes a rounding. Threads: XLA's own intra-op pool
// (xla::ffi::ThreadPool), the calling thread working too.
//
// Paths (attribute `path`): 0 = the best the CPU has, 1 = portable scalar, 2 = AVX2, 3 = AVX-512 VNNI. A path the
// CPU lacks falls back to the next one it has, so every path gives the same bits on any machine.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;                     // weight rows per tile (16 int32 lanes of a 512-bit register)
constexpr int64_t kTileBlock = kTile * kBlock;    // bytes of one tile's block b
constexpr int64_t kRows = 4;                      // activation rows sharing each weight load
constexpr int64_t kTileBlock5 = 320;              // bytes of one tile's block b in the 5-bit format

// The block terms of `mr` (<= kRows) activation rows with one weight tile, then their sums:
//   t[(r * nb + b) * 16 + lane] = float(isum[m0 + r, 16 tile + lane, b]) * (xs[m0 + r, b] * st[tile, 16 b + lane])
//   y[(m0 + r) * N + 16 tile + lane] = the tree of fixed_order.fixed_order_sum over b of those terms.
// `x` and `xs` point at row m0 (row strides K and nb), `wt` and `st` at the tile, `y` at y[m0, 16 tile].
using TileProduct = void (*)(const int8_t* x, const float* xs, const int32_t* xc, int64_t K, int64_t mr,
                             const int8_t* wt, const uint16_t* st, int64_t nb, float* t, float* y, int64_t N);

// A float16 (bits) as float32, exactly (normal, subnormal, zero, inf, nan): the portable path's conversion; the
// vector paths use the CPU's (vcvtph2ps), which gives the same values.
inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man) {  // subnormal: normalize
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400));
    bits = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ff) << 13);
  } else {
    bits = sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The tree of fixed_order.fixed_order_sum over t[0..nb) (16 lanes each): halves added pairwise, an odd element
// joining the last pair. Elementwise per lane, so any vectorization gives the same bits.
inline __attribute__((always_inline)) void tree16(float* t, int64_t nb) {
  for (int64_t n = nb; n > 1;) {
    int64_t half = n / 2;
    for (int64_t i = 0; i < half * kTile; ++i) t[i] = t[i] + t[half * kTile + i];
    if (n % 2)
      for (int64_t lane = 0; lane < kTile; ++lane)
        t[(half - 1) * kTile + lane] = t[(half - 1) * kTile + lane] + t[2 * half * kTile + lane];
    n = half;
  }
}

void product_scalar(const int8_t* x, const float* xs, const int32_t*, int64_t K, int64_t mr, const int8_t* wt,
                    const uint16_t* st, int64_t nb, float* t, float* y, int64_t N) {
  for (int64_t r = 0; r < mr; ++r) {
    float* tr = t + r * nb * kTile;
    for (int64_t b = 0; b < nb; ++b) {
      int32_t acc[kTile] = {0};
      const int8_t* xb = x + r * K + b * kBlock;
      const int8_t* wb = wt + b * kTileBlock;
      for (int64_t i = 0; i < 8; ++i)
        for (int64_t lane = 0; lane < kTile; ++lane)
          for (int64_t j = 0; j < 4; ++j)
            acc[lane] += int32_t(xb[4 * i + j]) * int32_t(wb[i * 64 + lane * 4 + j]);
      float s = xs[r * nb + b];
      for (int64_t lane = 0; lane < kTile; ++lane)
        tr[b * kTile + lane] = float(acc[lane]) * (s * half_to_float(st[b * kTile + lane]));
    }
    tree16(tr, nb);
    std::memcpy(y + r * N, tr, kTile * sizeof(float));
  }
}

#if defined(__x86_64__)
// |x| (unsigned) times w with x's sign: a pair of products fits int16 without saturation since |x|, |w| <= 127.
template <int MR>
__attribute__((target("avx2,f16c"))) void product_avx2_rows(const int8_t* x, const float* xs, int64_t K,
                                                       const int8_t* wt, const uint16_t* st, int64_t nb, float* t,
                                                       float* y, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i lo[MR], hi[MR];
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    const int8_t* wb = wt + b * kTileBlock;
    for (int64_t i = 0; i < 8; ++i) {
      __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64));
      __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + 32));
      for (int r = 0; r < MR; ++r) {
        int32_t four;
        std::memcpy(&four, x + r * K + b * kBlock + 4 * i, 4);
        __m256i xv = _mm256_set1_epi32(four);
        __m256i ax = _mm256_sign_epi8(xv, xv);
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv)), ones));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv)), ones));
      }
    }
    __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(st + b * kTile)));
    __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(st + b * kTile + 8)));
    for (int r = 0; r < MR; ++r) {
      __m256 xsv = _mm256_set1_ps(xs[r * nb + b]);
      float* tb = t + (r * nb + b) * kTile;
      _mm256_storeu_ps(tb, _mm256_mul_ps(_mm256_cvtepi32_ps(lo[r]), _mm256_mul_ps(xsv, s0)));
      _mm256_storeu_ps(tb + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_mul_ps(xsv, s1)));
    }
  }
  for (int r = 0; r < MR; ++r) {
    tree16(t + r * nb * kTile, nb);
    std::memcpy(y + r * N, t + r * nb * kTile, kTile * sizeof(float));
  }
}

// Block term dst += block term src in each of `mr` rows of `t` (aligned, rows nb terms apart): one level of the tree.
__attribute__((target("avx512f"), always_inline)) inline void add_terms_avx512(float* t, int64_t nb, int mr,
                                                                             int64_t dst, int64_t src) {
  for (int r = 0; r < mr; ++r) {
    float* tr = t + r * nb * kTile;
    __m512 sum = _mm512_add_ps(_mm512_load_ps(tr + dst * kTile), _mm512_load_ps(tr + src * kTile));
    _mm512_store_ps(tr + dst * kTile, sum);
  }
}

// Block b's terms of MR rows from their int32 block sums acc[r], with the tree's first level taken as the terms
// come: term b >= nb/2 is added to term b - nb/2 (stored nb/2 blocks earlier), and with an odd count the last term
// joins the last pair - tree16's first level, in its order.
template <int MR>
__attribute__((target("avx512f"), always_inline)) inline void store_terms_avx512(const __m512i* acc, const float* xs,
                                                                               const uint16_t* st, int64_t b,
                                                                               int64_t nb, float* t) {
  const int64_t half = nb / 2;
  __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st + b * kTile)));
  int64_t to = b < half || nb == 1 ? b : (b < 2 * half ? b - half : half - 1);
  for (int r = 0; r < MR; ++r) {
    __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(_mm512_set1_ps(xs[r * nb + b]), sv));
    float* dst = t + (r * nb + to) * kTile;
    if (b >= half && nb > 1) term = _mm512_add_ps(_mm512_load_ps(dst), term);
    _mm512_store_ps(dst, term);
  }
}

// The tree's remaining levels over the terms `store_terms_avx512` left, row after row within each level (a store
// is read a few rows later, not at once), then each row's sum to y.
template <int MR>
__attribute__((target("avx512f"), always_inline)) inline void sum_terms_avx512(float* t, int64_t nb, float* y,
                                                                             int64_t N) {
  for (int64_t n = nb > 1 ? nb / 2 : 1; n > 1;) {
    int64_t h = n / 2;
    for (int64_t i = 0; i < h; ++i) add_terms_avx512(t, nb, MR, i, h + i);
    if (n % 2) add_terms_avx512(t, nb, MR, h - 1, 2 * h);
    n = h;
  }
  for (int r = 0; r < MR; ++r) std::memcpy(y + r * N, t + r * nb * kTile, kTile * sizeof(float));
}

// vpdpbusd multiplies unsigned bytes by signed ones: each weight byte is made unsigned on load (w ^ 0x80 = w + 128,
// one xor) and multiplied with the signed activations; the 128 * sum(x) that adds to a block sum is taken off
// with `xc` (128 * the block sums of x, made once per call; each accumulator starts at -xc), so the loop has one
// vpdpbusd per row and load. The block terms are stored to `t` (64-byte aligned: a split store or load across two
// cache lines cost ~30% of a 64-row product) and the sum tree's first level is folded into the epilogue.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void product_vnni_rows(const int8_t* x, const float* xs,
                                                                                const int32_t* xc, int64_t K,
                                                                                const int8_t* wt,
                                                                                const uint16_t* st, int64_t nb,
                                                                                float* t, float* y, int64_t N) {
  const __m512i c80 = _mm512_set1_epi8(char(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_set1_epi32(-xc[r * nb + b]);
    const int8_t* wb = wt + b * kTileBlock;
    for (int64_t i = 0; i < 8; ++i) {
      __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(wb + i * 64), c80);
      for (int r = 0; r < MR; ++r) {
        int32_t four;
        std::memcpy(&four, x + r * K + b * kBlock + 4 * i, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], wv, _mm512_set1_epi32(four));
      }
    }
    store_terms_avx512<MR>(acc, xs, st, b, nb, t);
  }
  sum_terms_avx512<MR>(t, nb, y, N);
}

// The 5-bit vpdpbusd product: weights u in [0, 32) expanded in registers (low nibble, high nibble, then 16 added
// where the fifth bit is set) are already unsigned, so `xc` here holds 16 * (block sums of x), taken off as above.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void product5_vnni_rows(const int8_t* x, const float* xs,
                                                                                 const int32_t* xc, int64_t K,
                                                                                 const int8_t* wt,
                                                                                 const uint16_t* st, int64_t nb,
                                                                                 float* t, float* y, int64_t N) {
  const __m512i c0f = _mm512_set1_epi8(0x0f), c10 = _mm512_set1_epi8(0x10);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_set1_epi32(-xc[r * nb + b]);
    const int8_t* wb = wt + b * kTileBlock5;
    for (int64_t p = 0; p < 4; ++p) {
      uint64_t h0, h1;
      std::memcpy(&h0, wb + 256 + 8 * p, 8);
      std::memcpy(&h1, wb + 256 + 8 * (p + 4), 8);
      __m512i v = _mm512_loadu_si512(wb + p * 64);
      __m512i low = _mm512_and_si512(v, c0f);
      __m512i lo = _mm512_mask_add_epi8(low, _cvtu64_mask64(h0), low, c10);
      __m512i nib = _mm512_and_si512(_mm512_srli_epi16(v, 4), c0f);
      __m512i hi = _mm512_mask_add_epi8(nib, _cvtu64_mask64(h1), nib, c10);
      for (int r = 0; r < MR; ++r) {
        int32_t f0, f1;
        std::memcpy(&f0, x + r * K + b * kBlock + 4 * p, 4);
        std::memcpy(&f1, x + r * K + b * kBlock + 4 * (p + 4), 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(f0));
        acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(f1));
      }
    }
    store_terms_avx512<MR>(acc, xs, st, b, nb, t);
  }
  sum_terms_avx512<MR>(t, nb, y, N);
}

// The row-count instances of each path, indexed by mr - 1.
using RowsProduct = void (*)(const int8_t* x, const float* xs, int64_t K, const int8_t* wt, const uint16_t* st,
                             int64_t nb, float* t, float* y, int64_t N);
using VnniRowsProduct = void (*)(const int8_t* x, const float* xs, const int32_t* xc, int64_t K, const int8_t* wt,
                                 const uint16_t* st, int64_t nb, float* t, float* y, int64_t N);
constexpr RowsProduct kAvx2Rows[kRows] = {product_avx2_rows<1>, product_avx2_rows<2>, product_avx2_rows<3>,
                                          product_avx2_rows<4>};
constexpr VnniRowsProduct kVnniRows[kRows] = {product_vnni_rows<1>, product_vnni_rows<2>, product_vnni_rows<3>,
                                              product_vnni_rows<4>};
constexpr VnniRowsProduct kVnni5Rows[kRows] = {product5_vnni_rows<1>, product5_vnni_rows<2>,
                                               product5_vnni_rows<3>, product5_vnni_rows<4>};

void product_avx2(const int8_t* x, const float* xs, const int32_t*, int64_t K, int64_t mr, const int8_t* wt,
                  const uint16_t* st, int64_t nb, float* t, float* y, int64_t N) {
  kAvx2Rows[mr - 1](x, xs, K, wt, st, nb, t, y, N);
}

void product_vnni(const int8_t* x, const float* xs, const int32_t* xc, int64_t K, int64_t mr, const int8_t* wt,
                  const uint16_t* st, int64_t nb, float* t, float* y, int64_t N) {
  kVnniRows[mr - 1](x, xs, xc, K, wt, st, nb, t, y, N);
}

void product5_vnni(const int8_t* x, const float* xs, const int32_t* xc, int64_t K, int64_t mr, const int8_t* wt,
                   const uint16_t* st, int64_t nb, float* t, float* y, int64_t N) {
  kVnni5Rows[mr - 1](x, xs, xc, K, wt, st, nb, t, y, N);
}
#endif

// One tile of 5-bit weights (nb blocks of 320 bytes) -> the int8 layout (nb blocks of 512 bytes, values u - 16):
// how the scalar and AVX2 paths read them.
void expand5(const int8_t* w5, int64_t nb, int8_t* w8) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(w5 + b * kTileBlock5);
    int8_t* dst = w8 + b * kTileBlock;
    for (int64_t i = 0; i < 8; ++i) {
      uint64_t high;
      std::memcpy(&high, src + 256 + 8 * i, 8);
      for (int64_t lane = 0; lane < 64; ++lane) {
        int u = (src[(i % 4) * 64 + lane] >> (4 * (i / 4))) & 0x0f;
        u |= int((high >> lane) & 1) << 4;
        dst[i * 64 + lane] = int8_t(u - 16);
      }
    }
  }
}

TileProduct product_vnni_entry() {
#if defined(__x86_64__)
  return product_vnni;
#else
  return nullptr;
#endif
}

// The 5-bit product of a path whose int8 product is `product` (nullptr: expand the tile, then `product`).
TileProduct product5_of(TileProduct product) {
#if defined(__x86_64__)
  if (product == product_vnni) return product5_vnni;
#endif
  return nullptr;
}

int cpu_path() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return 3;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return 2;
#endif
  return 1;
}

TileProduct pick(int64_t wanted) {
  int best = cpu_path();
  int path = (wanted <= 0 || wanted > best) ? best : int(wanted);
#if defined(__x86_64__)
  if (path == 3) return product_vnni;
  if (path == 2) return product_avx2;
#endif
  return product_scalar;
}

struct Work {
  const int8_t* xq;
  const float* xs;
  const int8_t* wt;
  const uint16_t* st;
  float* y;
  int64_t M, N, K, nb, tiles_per_chunk, chunks;
  int64_t tile_bytes;     // one tile's weight bytes: nb * 512 (int8) or nb * 320 (5-bit)
  bool five_bit;
  TileProduct product;    // the path's int8 product
  TileProduct product5;   // its 5-bit product (nullptr: 5-bit tiles are expanded to int8 first)
  std::vector<int32_t> xc;  // the vpdpbusd paths' 128 (int8) or 16 (5-bit) * (block sums of x), [M, K/32]
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Weight tiles outer, activation rows inner: a tile (16 K bytes, 10 K in 5 bits) stays in cache while every
  // row uses it (a 5-bit tile is expanded again for each group of kRows rows: at 64 rows a prompt chunk's products
  // took the same time as from int8 tiles).
  void run_chunk(int64_t c, float* t, int8_t* expanded) {
    int64_t t0 = c * tiles_per_chunk, t1 = std::min(N / kTile, t0 + tiles_per_chunk);
    TileProduct f = five_bit && product5 ? product5 : product;
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int8_t* w = wt + tile * tile_bytes;
      if (five_bit && !product5) {
        expand5(w, nb, expanded);
        w = expanded;
      }
      const uint16_t* s = st + tile * nb * kTile;
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        f(xq + m0 * K, xs + m0 * nb, xc.empty() ? nullptr : xc.data() + m0 * nb, K, std::min(kRows, M - m0), w, s,
          nb, t, y + m0 * N + tile * kTile, N);
    }
  }

  // Claim chunks until none is left.
  void drain() {
    // 64-byte aligned (block terms are whole 512-bit registers); kRows * nb * kTile floats is a multiple of 64 bytes.
    std::unique_ptr<float, decltype(&std::free)> t(
        static_cast<float*>(std::aligned_alloc(64, kRows * nb * kTile * sizeof(float))), &std::free);
    std::unique_ptr<int8_t, decltype(&std::free)> expanded(
        five_bit && !product5 ? static_cast<int8_t*>(std::aligned_alloc(64, nb * kTileBlock)) : nullptr, &std::free);
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      run_chunk(c, t.get(), expanded.get());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The product of `wt`'s tiles, int8 (`five_bit` false: [N/16, 16 K]) or 5-bit ([N/16, 10 K]).
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq, ffi::Buffer<ffi::F32> xs, const int8_t* wt,
                      ffi::Span<const int64_t> wd, bool five_bit, ffi::Buffer<ffi::F16> st, int64_t path,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = xq.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("q8/q5_matmul: xq and wt must be 2-D");
  int64_t M = xd[0], K = xd[1], N = wd[0] * kTile;
  if (K % kBlock || wd[1] != K * (five_bit ? kTileBlock5 : kTileBlock) / kBlock)
    return ffi::Error::InvalidArgument(five_bit ? "q5_matmul: K must be a multiple of 32 and wt [N/16, 10 K]"
                                                : "q8_matmul: K must be a multiple of 32 and wt [N/16, 16 K]");
  int64_t nb = K / kBlock;
  if (xs.element_count() != M * nb || st.element_count() != N * nb || y->element_count() != M * N)
    return ffi::Error::InvalidArgument("q8/q5_matmul: scale or output shapes do not match [M, K/32], [N/16, K/2], [M, N]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (nb == 0) {  // K = 0: empty sums
    std::fill(y->typed_data(), y->typed_data() + M * N, 0.0f);
    return ffi::Error::Success();
  }
  auto work = std::make_shared<Work>();
  work->xq = xq.typed_data();
  work->xs = xs.typed_data();
  work->wt = wt;
  work->st = reinterpret_cast<const uint16_t*>(st.typed_data());
  work->y = y->typed_data();
  work->M = M, work->N = N, work->K = K, work->nb = nb;
  work->five_bit = five_bit;
  work->tile_bytes = nb * (five_bit ? kTileBlock5 : kTileBlock);
  work->product = pick(path);
  work->product5 = product5_of(work->product);
  if (work->product == product_vnni_entry()) {
    int32_t offset = five_bit ? 16 : 128;
    work->xc.resize(M * nb);
    for (int64_t i = 0; i < M * nb; ++i) {
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) sum += work->xq[i * kBlock + j];
      work->xc[i] = offset * sum;
    }
  }
  // About 64 KiB of weights per chunk (fewer tiles when many rows use each): spreads over the pool, amortizes a task.
  int64_t per_tile = work->tile_bytes * std::max<int64_t>(1, (M + kRows - 1) / kRows);
  work->tiles_per_chunk = std::max<int64_t>(1, (int64_t(64) << 10) / per_tile);
  work->chunks = (N / kTile + work->tiles_per_chunk - 1) / work->tiles_per_chunk;
  // One task fewer than the pool has threads: the calling thread works too (on 2 cores, the step was ~7% faster
  // at B=1 than with a helper per pool thread, which queued one helper behind the others).
  int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads() - 1, work->chunks - 1));
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error Q8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq, ffi::Buffer<ffi::F32> xs,
                        ffi::Buffer<ffi::S8> wt, ffi::Buffer<ffi::F16> st, int64_t path,
                        ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl(pool, xq, xs, wt.typed_data(), wt.dimensions(), false, st, path, y);
}

ffi::Error Q5MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq, ffi::Buffer<ffi::F32> xs,
                        ffi::Buffer<ffi::U8> wt, ffi::Buffer<ffi::F16> st, int64_t path,
                        ffi::ResultBuffer<ffi::F32> y) {
  return MatmulImpl(pool, xq, xs, reinterpret_cast<const int8_t*>(wt.typed_data()), wt.dimensions(), true, st, path,
                    y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaQ5Matmul, Q5MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Attr<int64_t>("path")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmaQ8Matmul, Q8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Attr<int64_t>("path")
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int gemma_q8_cpu_path() { return cpu_path(); }
