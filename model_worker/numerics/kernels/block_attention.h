// The arguments of one call of the batch-invariant block attention (block_attention.cc, the handler;
// block_attention_simd.cc, the work, compiled once per instruction set). Plain data only: the per-ISA
// translation units share no inline function or template with the rest of the library, so the linker cannot
// give a baseline caller an AVX-512 copy of one.
#pragma once

#include <cstdint>

namespace gemma_attention {

// Key modes: where position p of block b sits in a row of `keys`/`vals`, and whether that entry holds it.
enum Mode : int64_t {
  kFull = 0,   // a full-attention cache row: index = p (held when p < L)
  kRing = 1,   // a sliding-window ring read in place: index = p % R, held when kpos[r, index] == p
  kChunk = 2,  // a prompt chunk's gathered ring + its own keys: index = R + p - start[r] for p >= start[r], else
               // p % R; held when the index is in the row and kpos[r, index] == p
};

struct Args {
  const uint16_t* q;      // [B, C, N, D] bfloat16 bits
  const int32_t* qpos;    // [B, C] (-1 = padding)
  const uint16_t* keys;   // [S, L, K, D] bfloat16 bits
  const uint16_t* vals;   // [S, L, K, D]
  const int32_t* rows;    // [B] row of keys/vals per batch row
  const int32_t* kpos;    // [B, L] positions held (kRing, kChunk)
  const int32_t* start;   // [B] (kChunk)
  const int32_t* first;   // [B] first block visited
  const int32_t* count;   // [B] blocks visited
  float* out;             // [B, C, N, D + 1]: unnormalized output, then the softmax denominator
  int64_t B, C, N, D, S, L, K;
  int64_t mode, block, ring, window;  // window 0: none
  float scale;
  int64_t queries_per_task;  // a task is (row, KV head, up to this many queries, a group of the KV head's
  int64_t head_groups;       // query heads: G / head_groups of them)
  int64_t tasks;
};

}  // namespace gemma_attention
