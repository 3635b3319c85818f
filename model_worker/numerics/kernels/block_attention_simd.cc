// The work of the batch-invariant block attention (block_attention.cc has the handler and the arithmetic's
// definition), compiled once per instruction set with -DATTN_NS=<namespace> and that set's -m flags. The vector
// code uses GCC/Clang vector extensions of 16 floats: elementwise IEEE operations, which every instruction set
// computes to the same bits (-ffp-contract=off: no fused multiply-add), so the paths differ only in speed.

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "block_attention.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef ATTN_NS
#define ATTN_NS attn_base
#endif

namespace {

using gemma_attention::Args;

constexpr float kMask = -1e30f;
// exp as Cephes' expf (S. Moshier): n = rint(x log2 e), r = x - n ln 2 in two parts, a degree-6 polynomial, times
// 2^n; inputs below kExpLo give 0: probabilities are then 0 or >= e^-40 ~ 2^-58, so no product with a value of
// K or V above ~1e-20 is subnormal, and flush-to-zero modes cannot make threads or paths differ.
constexpr float kExpLo = -40.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: (t + kMagic) - kMagic rounds t to the nearest even integer
constexpr float kC1 = 0.693359375f;    // ln 2 = kC1 + kC2, kC1 with 9 significant bits (n * kC1 is exact)
constexpr float kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16(uint16_t h) { return from_bits(uint32_t(h) << 16); }

// Round to bfloat16, to nearest even (finite inputs), kept as a float.
inline float round_bf16(float x) {
  uint32_t u = to_bits(x);
  u += 0x7fffu + ((u >> 16) & 1u);
  return from_bits(u & 0xffff0000u);
}


inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// exp on 16 lanes (the constants above); block_attention.exp_fixed is its twin.
inline vf exp_vec(vf x) {
  vf lo = splat(kExpLo);
  vf xc = x > lo ? x : lo;
  vf t = xc * kLog2e;
  vf n = (t + kMagic) - kMagic;
  vf r = xc - n * kC1;
  r = r - n * kC2;
  vf z = r * r;
  vf y = r * kP0 + kP1;
  y = y * r + kP2;
  y = y * r + kP3;
  y = y * r + kP4;
  y = y * r + kP5;
  y = y * z + r;
  y = y + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf res = y * (vf)e;
  return x >= lo ? res : splat(0.0f);
}

// a * b + c where a * b is exact (both bfloat16 values): one rounding either way, so the fused form (AVX-512)
// and the separate one give the same bits.
inline vf mul_add_exact(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

// x's lanes picked by `idx` (GCC's __builtin_shuffle, which GCC 11 has and __builtin_shufflevector needs 12 for;
// Clang's equivalent).
inline vf lanes(vf x, vi idx) {
#if defined(__clang__)
  vf r;
  for (int i = 0; i < 16; ++i) r[i] = x[idx[i]];
  return r;
#else
  return __builtin_shuffle(x, idx);
#endif
}

// The scalar exp: lane 0 of the vector one (the same operations, so the scalar and vector paths agree).
inline float exp_fixed(float x) { return exp_vec(splat(x))[0]; }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#endif
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  return (vf)u;
}

// fixed_order.fixed_order_sum of x[0..n) (halves added pairwise, an odd element joining the last pair); x is
// overwritten.
inline float sum_halves(float* x, int64_t n) {
  while (n > 1) {
    int64_t half = n / 2;
    for (int64_t i = 0; i < half; ++i) x[i] = x[i] + x[i + half];
    if (n & 1) x[half - 1] = x[half - 1] + x[2 * half];
    n = half;
  }
  return n ? x[0] : 0.0f;
}

// The scores of QH query heads (qf [QH, D]) with one key (kf [D]) where vis[h], -1e30 elsewhere, into s[h * T0]:
// the halves tree of q . k when D = 16 NV, NV a power of two (the vector levels, then the lanes 8, 4, 2, 1 apart;
// the first level's two products are exact, so it is one multiply and one multiply-add).
template <int NV>
void scores_vec(const float* qf, const float* kf, const bool* vis, int64_t QH, float scale, float* s, int64_t T0) {
  vf k[NV];
  for (int j = 0; j < NV; ++j) k[j] = load(kf + 16 * j);
  for (int64_t h = 0; h < QH; ++h) {
    if (!vis[h]) {
      s[h * T0] = kMask;
      continue;
    }
    const float* q = qf + h * NV * 16;
    vf v[NV];
    if (NV == 1) {
      v[0] = load(q) * k[0];
    } else {
      for (int j = 0; j < NV / 2; ++j) v[j] = mul_add_exact(load(q + 16 * j), k[j], load(q + 16 * (j + NV / 2)) * k[j + NV / 2]);
    }
    for (int n = NV / 2; n > 1; n /= 2)
      for (int j = 0; j < n / 2; ++j) v[j] = v[j] + v[j + n / 2];
    vf x = v[0];
    x = x + lanes(x, vi{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
    x = x + lanes(x, vi{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
    x = x + lanes(x, vi{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
    x = x + lanes(x, vi{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
    s[h * T0] = x[0] * scale;
  }
}

using ScoresFn = void (*)(const float*, const float*, const bool*, int64_t, float, float*, int64_t);

ScoresFn scores_fn(int64_t nv) {
  switch (nv) {
    case 1: return scores_vec<1>;
    case 2: return scores_vec<2>;
    case 4: return scores_vec<4>;
    case 8: return scores_vec<8>;
    case 16: return scores_vec<16>;
    case 32: return scores_vec<32>;
    case 64: return scores_vec<64>;
    default: return nullptr;
  }
}

constexpr int64_t kAhead = 8;  // keys read ahead

// Ask for the cache lines of one K or V row (D bfloat16 values) before they are needed: the rows of a block
// stream from memory, and the work on each is too short for the hardware prefetcher alone to hide the latency.
inline void prefetch_row(const uint16_t* p, int64_t D) {
  for (int64_t i = 0; i < D; i += 32) __builtin_prefetch(p + i);
}

inline void locate(const Args& a, int64_t r, int64_t pos, int64_t* idx, bool* held) {
  if (a.mode == gemma_attention::kFull) {
    *held = pos < a.L;
    *idx = *held ? pos : 0;
    return;
  }
  int64_t i;
  bool ok = true;
  if (a.mode == gemma_attention::kRing) {
    i = pos % a.ring;
  } else {
    int64_t st = a.start[r], cc = a.L - a.ring;
    i = pos >= st ? a.ring + pos - st : pos % a.ring;
    ok = pos < st + cc;
    if (!ok) i = 0;
  }
  *idx = i;
  *held = ok && a.kpos[r * a.L + i] == pos;
}

struct Scratch {
  float* qf;     // [QH, D] queries as float
  float* kf;     // [D] one key as float
  float* prod;   // [D] products (scalar path)
  float* s;      // [QH, T0] scores, then probabilities
  float* acc;    // [QH, D]
  float* m;      // [QH]
  float* l;      // [QH]
  float* fix;    // [QH]
  float* stack;  // [QH, levels, D] the pairwise trees over keys
  float* pv;     // [QH, D]
  int64_t levels;
  float* x;      // [D]
  int64_t* idx;  // [T0]
  bool* held;    // [T0]
  bool* vis;     // [QH]
};

// Σ_t p[t] v[t, :] over t < T0 (a power of two) as the tree of adjacent pairs ((0 + 1) + (2 + 3)) + ..., into pv.
void pv_scalar(const Args& a, const float* p, const uint16_t* vbase, const Scratch& w, float* pv) {
  int64_t D = a.D, T0 = a.block, stride = a.K * D;
  for (int64_t t = 0; t < T0; ++t) {
    const uint16_t* vr = vbase + w.idx[t] * stride;
    for (int64_t d = 0; d < D; ++d) w.x[d] = p[t] * bf16(vr[d]);
    int64_t level = 0;
    for (; (t >> level) & 1; ++level)
      for (int64_t d = 0; d < D; ++d) w.x[d] = w.stack[level * D + d] + w.x[d];
    std::memcpy(w.stack + level * D, w.x, D * sizeof(float));
  }
  int64_t top = 0;
  while ((int64_t(1) << top) < T0) ++top;
  std::memcpy(pv, w.stack + top * D, D * sizeof(float));
}

void pv_vec(const Args& a, const float* p, const uint16_t* vbase, const Scratch& w, float* pv) {
  int64_t D = a.D, T0 = a.block, stride = a.K * D;
  for (int64_t dv = 0; dv < D; dv += 16) {
    vf st[40];
    for (int64_t t = 0; t < T0; ++t) {
      vf x = p[t] * load_bf16(vbase + w.idx[t] * stride + dv);
      int64_t level = 0;
      for (; (t >> level) & 1; ++level) x = st[level] + x;
      st[level] = x;
    }
    int64_t top = 0;
    while ((int64_t(1) << top) < T0) ++top;
    store(pv + dv, st[top]);
  }
}

float sum_pairs(const float* p, int64_t T0) {
  float st[40];
  for (int64_t t = 0; t < T0; ++t) {
    float x = p[t];
    int64_t level = 0;
    for (; (t >> level) & 1; ++level) x = st[level] + x;
    st[level] = x;
  }
  int64_t top = 0;
  while ((int64_t(1) << top) < T0) ++top;
  return st[top];
}

inline vf round_bf16_vec(vf x) {
  vu u = (vu)x;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (vf)(u & 0xffff0000u);
}

// pv_vec for QH query heads at once, 8 keys at a time (T0 a multiple of 8, D of 16): each group of 8 keys is
// summed as its own subtree ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), which the carries of a binary counter then
// join: the same tree. stack: [QH, levels, D]; pv: [QH, D].
void pv_groups(const Args& a, const float* P, int64_t QH, const uint16_t* vbase, const Scratch& w, float* stack,
               int64_t levels, float* pv) {
  int64_t D = a.D, T0 = a.block, stride = a.K * D, groups = T0 / 8;
  for (int64_t i = 0; i < 8 && i < T0; ++i) prefetch_row(vbase + w.idx[i] * stride, D);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t* idx = w.idx + 8 * g;
    if (g + 1 < groups)
      for (int64_t i = 0; i < 8; ++i) prefetch_row(vbase + idx[8 + i] * stride, D);
    for (int64_t dv = 0; dv < D; dv += 16) {
      vf v0 = load_bf16(vbase + idx[0] * stride + dv), v1 = load_bf16(vbase + idx[1] * stride + dv);
      vf v2 = load_bf16(vbase + idx[2] * stride + dv), v3 = load_bf16(vbase + idx[3] * stride + dv);
      vf v4 = load_bf16(vbase + idx[4] * stride + dv), v5 = load_bf16(vbase + idx[5] * stride + dv);
      vf v6 = load_bf16(vbase + idx[6] * stride + dv), v7 = load_bf16(vbase + idx[7] * stride + dv);
      for (int64_t h = 0; h < QH; ++h) {
        const float* p = P + h * T0 + 8 * g;
        vf x = (mul_add_exact(v0, splat(p[0]), v1 * p[1]) + mul_add_exact(v2, splat(p[2]), v3 * p[3])) +
               (mul_add_exact(v4, splat(p[4]), v5 * p[5]) + mul_add_exact(v6, splat(p[6]), v7 * p[7]));
        float* st = stack + h * levels * D + dv;
        int64_t level = 0;
        for (; (g >> level) & 1; ++level) x = load(st + level * D) + x;
        store(st + level * D, x);
      }
    }
  }
  int64_t top = 0;
  while ((int64_t(1) << top) < groups) ++top;
  for (int64_t h = 0; h < QH; ++h) std::memcpy(pv + h * D, stack + (h * levels + top) * D, D * sizeof(float));
}

void run_task(const Args& a, int64_t task, bool vector, const Scratch& w) {
  int64_t qblocks = (a.C + a.queries_per_task - 1) / a.queries_per_task, hg = a.head_groups;
  int64_t r = task / (a.K * qblocks * hg), k = task / (qblocks * hg) % a.K;
  int64_t c0 = task / hg % qblocks * a.queries_per_task;
  int64_t nq = a.C - c0 < a.queries_per_task ? a.C - c0 : a.queries_per_task;
  int64_t G = a.N / a.K, Gh = G / hg, g0 = task % hg * Gh;  // this task's heads: g0 .. g0 + Gh - 1 of KV head k
  int64_t QH = nq * Gh, D = a.D, T0 = a.block;
  int64_t nv = D / 16;
  ScoresFn scores = vector && D % 16 == 0 ? scores_fn(nv) : nullptr;
  bool vec_pv = vector && D % 16 == 0;
  for (int64_t h = 0; h < QH; ++h) {
    int64_t c = c0 + h / Gh, n = k * G + g0 + h % Gh;
    const uint16_t* qr = a.q + ((r * a.C + c) * a.N + n) * D;
    for (int64_t d = 0; d < D; ++d) w.qf[h * D + d] = bf16(qr[d]);
    for (int64_t d = 0; d < D; ++d) w.acc[h * D + d] = 0.0f;
    w.m[h] = kMask;
    w.l[h] = 0.0f;
  }
  int64_t row = a.rows[r];
  const uint16_t* kbase = a.keys + (row * a.L * a.K + k) * D;  // + index * K * D
  const uint16_t* vbase = a.vals + (row * a.L * a.K + k) * D;
  for (int64_t j = 0; j < a.count[r]; ++j) {
    int64_t b = a.first[r] + j;
    for (int64_t t = 0; t < T0; ++t) locate(a, r, b * T0 + t, &w.idx[t], &w.held[t]);
    for (int64_t t = 0; t < T0; ++t) {
      int64_t pos = b * T0 + t;
      bool any = false;
      for (int64_t h = 0; h < QH; ++h) {
        int64_t qp = a.qpos[r * a.C + c0 + h / Gh];
        w.vis[h] = w.held[t] && qp >= 0 && pos <= qp && (a.window == 0 || qp - pos < a.window);
        any = any || w.vis[h];
      }
      if (t + kAhead < T0) prefetch_row(kbase + w.idx[t + kAhead] * a.K * D, D);
      if (any) {
        const uint16_t* kr = kbase + w.idx[t] * a.K * D;
        if (vec_pv) {
          for (int64_t d = 0; d < D; d += 16) store(w.kf + d, load_bf16(kr + d));
        } else {
          for (int64_t d = 0; d < D; ++d) w.kf[d] = bf16(kr[d]);
        }
      }
      if (scores) {
        scores(w.qf, w.kf, w.vis, QH, a.scale, w.s + t, T0);
        continue;
      }
      for (int64_t h = 0; h < QH; ++h) {
        float s = kMask;
        if (w.vis[h]) {
          for (int64_t d = 0; d < D; ++d) w.prod[d] = w.qf[h * D + d] * w.kf[d];
          s = sum_halves(w.prod, D) * a.scale;
        }
        w.s[h * T0 + t] = s;
      }
    }
    bool vec_t = vector && T0 % 16 == 0;
    for (int64_t h = 0; h < QH; ++h) {
      float* s = w.s + h * T0;
      float mx = s[0];
      if (vec_t) {
        vf vm = load(s);
        for (int64_t t = 16; t < T0; t += 16) {
          vf x = load(s + t);
          vm = x > vm ? x : vm;
        }
        for (int i = 0; i < 16; ++i) mx = vm[i] > mx ? vm[i] : mx;
      } else {
        for (int64_t t = 1; t < T0; ++t) mx = s[t] > mx ? s[t] : mx;
      }
      float m_new = w.m[h] > mx ? w.m[h] : mx;
      if (vec_t) {
        for (int64_t t = 0; t < T0; t += 16) store(s + t, round_bf16_vec(exp_vec(load(s + t) - m_new)));
      } else {
        for (int64_t t = 0; t < T0; ++t) s[t] = round_bf16(exp_fixed(s[t] - m_new));
      }
      float fix = exp_fixed(w.m[h] - m_new);
      w.m[h] = m_new;
      w.l[h] = w.l[h] * fix + sum_pairs(s, T0);
      w.fix[h] = fix;
    }
    if (vec_pv && T0 % 8 == 0) {
      pv_groups(a, w.s, QH, vbase, w, w.stack, w.levels, w.pv);
    } else {
      for (int64_t h = 0; h < QH; ++h) {
        if (vec_pv) {
          pv_vec(a, w.s + h * T0, vbase, w, w.pv + h * D);
        } else {
          pv_scalar(a, w.s + h * T0, vbase, w, w.pv + h * D);
        }
      }
    }
    for (int64_t h = 0; h < QH; ++h) {
      float* acc = w.acc + h * D;
      const float* pv = w.pv + h * D;
      for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * w.fix[h] + pv[d];
    }
  }
  for (int64_t h = 0; h < QH; ++h) {
    int64_t c = c0 + h / Gh, n = k * G + g0 + h % Gh;
    float* o = a.out + ((r * a.C + c) * a.N + n) * (D + 1);
    std::memcpy(o, w.acc + h * D, D * sizeof(float));
    o[D] = w.l[h];
  }
}

}  // namespace

namespace ATTN_NS {

// Tasks [task0, task1) of `a` (see block_attention.h); `vector` false: the scalar loops only.
void run(const gemma_attention::Args* a, int64_t task0, int64_t task1, bool vector) {
  int64_t G = a->N / a->K, QH = a->queries_per_task * G, D = a->D, T0 = a->block;
  int64_t levels = 1;
  while ((int64_t(1) << (levels - 1)) < T0) ++levels;
  size_t floats = QH * D + D + D + QH * T0 + QH * D + 3 * QH + QH * levels * D + QH * D + D;
  // int64 indices first (aligned), then the floats, then the flags.
  char* mem = static_cast<char*>(std::calloc(1, T0 * sizeof(int64_t) + floats * sizeof(float) + T0 + QH));
  if (mem == nullptr) std::abort();  // a few KiB to a few hundred: out of memory anyway
  Scratch w;
  w.idx = reinterpret_cast<int64_t*>(mem);
  float* f = reinterpret_cast<float*>(w.idx + T0);
  w.qf = f, f += QH * D;
  w.kf = f, f += D;
  w.prod = f, f += D;
  w.s = f, f += QH * T0;
  w.acc = f, f += QH * D;
  w.m = f, f += QH;
  w.l = f, f += QH;
  w.fix = f, f += QH;
  w.stack = f, f += QH * levels * D;
  w.pv = f, f += QH * D;
  w.x = f, f += D;
  w.levels = levels;
  w.held = reinterpret_cast<bool*>(f);
  w.vis = w.held + T0;
  for (int64_t t = task0; t < task1; ++t) run_task(*a, t, vector, w);
  std::free(mem);
}

}  // namespace ATTN_NS
