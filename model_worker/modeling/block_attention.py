"""Batch-invariant attention over position blocks with one fixed arithmetic, for CPU: a kernel called through
`jax.ffi` (`model_worker/numerics/kernels/block_attention.cc`, built with the block-int8 product by `q8`) and its
pure-JAX twin, bit for bit the same.

For each query (position qp) and head, over the position blocks b = first .. first + count - 1 in order, each
holding positions p = b T0 + t (t < T0, T0 a power of two):

    s[t] = (fixed_order_sum_d q[d] k_p[d]) * scale     where p is held and visible (0 <= p <= qp, qp - p < W),
           else MASK_VALUE                              (q, k, v bfloat16: every product is exact in float32)
    m'   = max(m, max_t s[t]);  p[t] = bfloat16(exp(s[t] - m'))
    acc  = acc * exp(m - m') + pairs_sum_t p[t] v_p;  l = l * exp(m - m') + pairs_sum_t p[t];  m = m'

from m = MASK_VALUE, acc = 0, l = 0; the result is (acc, l) and the caller divides. `fixed_order_sum` is the
halves tree of `fixed_order`, `pairs_sum` the tree of adjacent pairs, `exp` is Cephes' expf written as single
float32 operations (`exp_fixed`, 0 below -40). The online softmax is Milakov & Gimelshein's (2018) recurrence; blocks holding no
visible key change nothing once one has (p = 0, a rescale of exactly 1), so a row's result depends only on its
visible keys, whatever chunk, batch or program computes it.

Why not XLA's bfloat16 dots, as on TPU/GPU: on XLA CPU a decode step's attention is ~10 small thunks per key
block and layer (4-6 ms of a ~16 ms step at agent contexts, docs/performance.md); the kernel does a layer in one
call. Its bits cannot come from XLA's dot (whose sums have no order we could repeat), hence the fixed trees, and
the same trees in the twin: XLA may contract a product and an add into one fused multiply-add, so the twin
multiplies every rounded product by a 1.0 the compiler cannot see before adding (as `q8`'s twin does), and
every product of two bfloat16 values is exact anyway.

Key modes (where position p sits in a row of `keys`): `FULL` a full-attention cache row, index p; `RING` a
sliding-window ring read in place, index p % R, held when the ring's positions say so; `CHUNK` a prompt chunk's
gathered ring plus its own keys (index R + p - start for p >= start, else p % R).

The kernel runs where `q8.attention_kernel_available()`; without it (no compiler, `GEMMA_SERVE_Q8_KERNEL=off`) the twin
does, with the same bits. `GEMMA_SERVE_Q8_PATH` forces its instruction set as for the block-int8 product
(`vnni` = AVX-512 here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model_worker.numerics import q8
from model_worker.numerics.fixed_order import fixed_order_sum

FULL, RING, CHUNK = 0, 1, 2
TWIN_QUERIES = 16  # queries per group in the twin: its q . k products are [K, G, 16, T0, D] float32 at most
MASK_VALUE = np.float32(-1e30)

# Cephes' expf (S. Moshier, Cephes Math Library): n = rint(x log2 e), r = x - n ln 2 with ln 2 = C1 + C2 (C1 has
# 9 significant bits, so n C1 is exact), exp(r) by a degree-6 polynomial, times 2^n. Below EXP_LO: 0. A
# probability is then 0 or >= e^-40 ~ 2^-58 (a key that far below the row's best adds < 1e-13 of it even summed
# over 32k keys, below bfloat16 probabilities' own resolution), so no product with a K or V value above ~1e-20
# is subnormal: flush-to-zero settings, which may differ between XLA's threads, cannot change a bit.
EXP_LO = np.float32(-40.0)
LOG2E = np.float32(1.44269504088896341)
C1, C2 = np.float32(0.693359375), np.float32(-2.12194440e-4)
POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                     1.6666665459e-1, 5.0000001201e-1))


def exp_fixed(x: jax.Array, one: jax.Array) -> jax.Array:
    """exp(x) in float32 as the kernel computes it (see EXP_LO, C1, POLY): any shape -> the same shape.

    Args:
      x: float32, any values (below EXP_LO = -40 and NaN give 0).
      one: a float32 1.0 XLA cannot fold (from data): every rounded product is multiplied by it before an add,
        so that a fused multiply-add rounds as the kernel's separate multiply and add do.
    """
    xc = jnp.maximum(x, EXP_LO)
    n = lax.round(xc * LOG2E, lax.RoundingMethod.TO_NEAREST_EVEN)
    r = xc - n * C1  # n * C1 is exact
    r = r - (n * C2) * one
    z = r * r
    y = (POLY[0] * r) * one + POLY[1]
    for c in POLY[2:]:
        y = (y * r) * one + c
    y = ((y * z) * one + r) + np.float32(1.0)
    two_n = lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)
    return jnp.where(x >= EXP_LO, y * two_n, np.float32(0.0))


def pairs_sum(x: jax.Array) -> jax.Array:
    """Σ over the last axis (a power of two long) as the tree of adjacent pairs ((x0 + x1) + (x2 + x3)) + ...:
    [..., n] -> [...]. The kernel's order over the keys of a block, which it sums as they stream in."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"pairs_sum: {n} is not a power of two")
    while x.shape[-1] > 1:
        x = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
        x = x[..., 0] + x[..., 1]
    return x[..., 0]


def _locate(pos, mode: int, L: int, ring: int, kp, start):
    """(index in the row, held) of positions `pos` [T0] (the kernel's `locate`)."""
    if mode == FULL:
        held = pos < L
        return jnp.where(held, pos, 0), held
    if mode == RING:
        idx = pos % ring
    else:
        idx = jnp.where(pos >= start, ring + pos - start, pos % ring)
        ok = pos < start + (L - ring)
        idx = jnp.where(ok, idx, 0)
    held = jnp.take(kp, idx) == pos
    return idx, held if mode == RING else held & ok


def block_attention_twin(q, qpos, keys, vals, rows, kpos, start, first, count, *, mode: int, block: int,
                         ring: int = 0, window: int | None = None, scale: float) -> jax.Array:
    """The pure-JAX twin (the module docstring's arithmetic; the same bits as the kernel).

    Args:
      q: uint16 [B, C, N, D], bfloat16 bit patterns; qpos: int32 [B, C] (-1 = padding).
      keys, vals: uint16 [S, L, K, D] bfloat16 bit patterns; rows: int32 [B], the row of each batch row.
      kpos: int32 [B, L], the position each index holds (RING, CHUNK; ignored for FULL).
      start: int32 [B] (CHUNK: the chunk's first position); first, count: int32 [B], the blocks visited.
      mode, block, ring, window, scale: static; FULL/RING/CHUNK, T0 (a power of two), R, W (None: causal only),
        the multiplier of q . k.
    Returns:
      float32 [B, C, N, D + 1]: the unnormalized output and, last, the softmax denominator.
    """
    B, C, N, D = q.shape
    L, K = keys.shape[1], keys.shape[2]
    G = N // K
    scale = np.float32(scale)
    window = window or None  # 0 is no window, as for the kernel
    if block & (block - 1):
        raise ValueError(f"block_attention: block {block} is not a power of two")

    def row_attention(args):
        qb, qp, row, kp, st, f, cnt = args
        C = qb.shape[0]
        qf = lax.bitcast_convert_type(qb, jnp.bfloat16).astype(jnp.float32)  # [C, N, D]
        one = qb[0, 0, 0].astype(jnp.float32) * np.float32(0.0) + np.float32(1.0)  # finite input: exactly 1.0
        qf = qf.reshape(C, K, G, D).transpose(1, 2, 0, 3)  # [K, G, C, D]
        krow = lax.dynamic_index_in_dim(keys, row, keepdims=False)  # [L, K, D]
        vrow = lax.dynamic_index_in_dim(vals, row, keepdims=False)

        def body(j, carry):
            m, l, acc = carry  # [K, G, C], [K, G, C], [K, G, C, D]
            pos = (f + j) * block + jnp.arange(block, dtype=jnp.int32)
            idx, held = _locate(pos, mode, L, ring, kp, st)
            kb = lax.bitcast_convert_type(jnp.take(krow, idx, axis=0), jnp.bfloat16).astype(jnp.float32)
            vb = lax.bitcast_convert_type(jnp.take(vrow, idx, axis=0), jnp.bfloat16).astype(jnp.float32)
            prod = qf[:, :, :, None, :] * kb.transpose(1, 0, 2)[:, None, None, :, :]  # [K, G, C, T0, D]
            s = (fixed_order_sum(prod * one) * scale) * one
            visible = held[None, :] & (qp[:, None] >= 0) & (pos[None, :] <= qp[:, None])
            if window is not None:
                visible &= qp[:, None] - pos[None, :] < window
            s = jnp.where(visible, s, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = exp_fixed(s - m_new[..., None], one).astype(jnp.bfloat16).astype(jnp.float32)
            fix = exp_fixed(m - m_new, one)
            pv = pairs_sum((p[:, :, :, None, :] * vb.transpose(1, 2, 0)[:, None, None, :, :]) * one)  # [K, G, C, D]
            return m_new, (l * fix) * one + pairs_sum(p), (acc * fix[..., None]) * one + pv

        init = (jnp.full((K, G, C), MASK_VALUE), jnp.zeros((K, G, C), jnp.float32),
                jnp.zeros((K, G, C, D), jnp.float32))
        _, l, acc = lax.fori_loop(0, cnt, body, init)
        out = jnp.concatenate([acc, l[..., None]], axis=-1)  # [K, G, C, D + 1]
        return out.transpose(2, 0, 1, 3).reshape(C, N, D + 1)

    kp = kpos if mode != FULL else jnp.zeros((B, 1), jnp.int32)
    per_row = (rows, kp, start, first, count)
    if C > TWIN_QUERIES:  # queries in groups (padding queries added), so [K, G, C, T0, D] products stay small
        n = -(-C // TWIN_QUERIES)
        pad = n * TWIN_QUERIES - C
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B * n, TWIN_QUERIES, N, D)
        qpos = jnp.pad(qpos, ((0, 0), (0, pad)), constant_values=-1).reshape(B * n, TWIN_QUERIES)
        per_row = tuple(jnp.repeat(x, n, axis=0) for x in per_row)
        out = lax.map(row_attention, (q, qpos, *per_row))
        return out.reshape(B, n * TWIN_QUERIES, N, D + 1)[:, :C]
    return lax.map(row_attention, (q, qpos, *per_row))


def block_attention_kernel(q, qpos, keys, vals, rows, kpos, start, first, count, *, mode: int, block: int,
                           ring: int = 0, window: int | None = None, scale: float, path: int = 0) -> jax.Array:
    """The CPU kernel through `jax.ffi.ffi_call` (needs `q8.kernel_available()`); arguments and result as
    `block_attention_twin`, plus `path` (`q8.PATHS`: 0 = the best the CPU has).

    Raises:
      RuntimeError: the kernel is not available (no compiler, a failed build, `GEMMA_SERVE_Q8_KERNEL=off`).
    """
    if not q8.attention_kernel_available():
        raise RuntimeError("block_attention_kernel: the CPU kernel is not available (see the q8 kernel warning)")
    B, C, N, D = q.shape
    if kpos is None or mode == FULL:
        kpos = jnp.zeros((B, 1), jnp.int32)
    call = jax.ffi.ffi_call(q8.TARGET_ATTENTION, jax.ShapeDtypeStruct((B, C, N, D + 1), jnp.float32))
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return call(q, i32(qpos), keys, vals, i32(rows), i32(kpos), i32(start), i32(first), i32(count),
                mode=np.int64(mode), block=np.int64(block), ring=np.int64(ring), window=np.int64(window or 0),
                scale=np.float32(scale), path=np.int64(path))


def block_attention(q, qpos, keys, vals, rows, kpos, start, first, count, **static) -> jax.Array:
    """The kernel where it is available, else the twin (same arguments, same bits; for CPU programs: callers
    choose another attention for TPU/GPU with `lax.platform_dependent`)."""
    if q8.attention_kernel_available():
        return block_attention_kernel(q, qpos, keys, vals, rows, kpos, start, first, count, path=q8.kernel_path(),
                                      **static)
    return block_attention_twin(q, qpos, keys, vals, rows, kpos, start, first, count, **static)
