"""Decode attention for a ragged batch as one Pallas kernel for TPU: each batch row reads only the key blocks its
own position needs, straight from its cache row (no gather, no padding to the KV bucket), with an online softmax.

What it computes, for each batch row b, each of its queries c (one in a decode step; a verify step's drafted
positions, a few, in a full layer) and query head n (KV head n // G):

    out[b, c, n] = Σ_p softmax_p(q[b, c, n] · k_p · scale) v_p    over the keys p visible to qp = q_pos[b, c]

where a key is visible when 0 <= p <= qp (and qp - p < window for a sliding layer). Two layouts of a cache row:
a full layer's row holds position p at index p (`k_pos` None); a sliding ring holds the positions `k_pos[b]` says
(-1: empty). The online softmax is Milakov & Gimelshein's (2018) recurrence, as in `attention._attend_blocks`,
which is this kernel's reference (and its fallback: the kernel is used where `--attention-kernel pallas` asks
for it, on a TPU).

Why a kernel: XLA's decode attention (`attention.attend_in_place`) loops over the batch rows one after another,
each over its key blocks, so a step at 32 rows runs hundreds of small dependent loops; measured on one TPU v5e
(Gemma 4 E2B bf16, 8K context, `benchmarks/decode_step.py`) the step reached 83% of the copy bandwidth at one
row but 52% at 32 (docs/performance.md, "On a TPU v5e"). Here the grid is (rows, key blocks): the rows run in
parallel and each key block is one DMA of [block, K * D] that Pallas double-buffers. A row's blocks past its
own last position repeat the index of its last one, so Pallas issues no copy for them (the technique of JAX's
`ragged_paged_attention`); their compute is skipped with `pl.when`.

Layout: the cache arrays [S, L, K, D] are viewed as [S, L, K * D] (a reshape of the minor dims), so a block's
last two dimensions are (block, K * D): the TPU's (8, 128) tiling rule holds for any head count, and the KV heads
are lane slices of width D. Runs on CPU in Pallas's interpreter (`interpret=True`), which is how the tests check
it against plain softmax attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK_VALUE = np.float32(-1e30)  # a masked score: exp(MASK_VALUE - m) is 0 once any key is visible
LANES = 128  # the running max and sum are kept replicated across one lane tile


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, rows: jax.Array, q_pos: jax.Array,
                     k_pos: jax.Array | None = None, *, scale: float, window: int | None = None, block: int,
                     num_blocks: int | None = None, interpret: bool = False) -> jax.Array:
    """A few queries per batch row over that row's cache row: a decode step (one query), or a verify step's drafted
    positions (C queries, in order): out in q's shape and dtype.

    Args:
      q: [B, N, D] (one query per row) or [B, C, N, D] queries (N = K * G heads; head n reads KV head n // G),
        float32 or bfloat16. C is unrolled in the kernel: a few queries (a verify step's), not a prompt chunk's.
      keys, values: [S, L, K, D] cache arrays (float32 or bfloat16; not int8).
      rows: int32 [B], the cache row of each batch row.
      q_pos: int32 [B] or [B, C], each query's position (-1: padding, whose output is finite and unused).
      k_pos: None for a full layer (index = position), or int32 [B, L] the position each ring index holds (one
        query per row only: a ring holds the keys of one step).
      scale: the multiplier of q . k; window: a sliding layer's W (None: causal only).
      block: keys per block, dividing L (on a TPU a multiple of 8, 16 for bfloat16; with `k_pos` a multiple of
        128 or L itself, the positions' lane tile).
      num_blocks: blocks visited at most (a full layer's KV bucket: ceil(kv_len / block)); default all of L.
      interpret: run in Pallas's interpreter (CPU tests).
    Returns:
      q's shape: softmax(q kᵀ · scale over each query's visible keys) v.
    Raises:
      ValueError: shapes that do not fit (block not dividing L, N not a multiple of K, q_pos not q's leading
        dims, a ring with several queries per row).
    """
    if q.ndim == 3:
        return decode_attention(q[:, None], keys, values, rows, q_pos.reshape(-1, 1), k_pos, scale=scale,
                                window=window, block=block, num_blocks=num_blocks, interpret=interpret)[:, 0]
    B, C, N, D = q.shape
    S, L, K, Dk = keys.shape
    if Dk != D or N % K or L % block or q_pos.shape != (B, C) or (k_pos is not None and C != 1):
        raise ValueError(f"decode_attention: q {q.shape}, q_pos {q_pos.shape}, keys {keys.shape}, block {block}, "
                         f"ring {k_pos is not None}")
    nb = L // block if num_blocks is None else min(num_blocks, L // block)
    ring = k_pos is not None
    kernel = functools.partial(_kernel, queries=C, heads=K, group=N // K, dim=D, block=block, scale=float(scale),
                               window=window, ring=ring, num_blocks=nb)
    kv_map = functools.partial(_kv_block, queries=C, block=block, window=window, ring=ring)
    flat = lambda a: a.reshape(S, L, K * D)
    in_specs = [pl.BlockSpec((None, C, N, D), lambda b, j, rows, qp: (b, 0, 0, 0)),
                pl.BlockSpec((None, block, K * D), kv_map),
                pl.BlockSpec((None, block, K * D), kv_map)]
    args = [q, flat(keys), flat(values)]
    if ring:
        in_specs.append(pl.BlockSpec((None, 1, block), lambda b, j, rows, qp: (b, 0, j)))
        args.append(k_pos.astype(jnp.int32).reshape(B, 1, L))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, nb), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, C, N, D), lambda b, j, rows, qp: (b, 0, 0, 0)),
        scratch_shapes=[pltpu.VMEM((C * N, LANES), jnp.float32), pltpu.VMEM((C * N, LANES), jnp.float32),
                        pltpu.VMEM((C * N, D), jnp.float32)])
    call = pl.pallas_call(kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct((B, C, N, D), q.dtype),
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
                          interpret=interpret)
    return call(rows.astype(jnp.int32), q_pos.astype(jnp.int32).reshape(B * C), *args)


def _positions(qpos_ref, b, queries: int) -> list:
    """The positions of row b's queries (scalars read from the flattened [B * C] table)."""
    return [qpos_ref[b * queries + c] for c in range(queries)]


def _span(qps: list, block: int, window: int | None):
    """(first, last) key blocks a full-layer row whose queries sit at positions `qps` reads: from the earliest
    query's window start to the latest query's own block (block 0 only for a row of padding)."""
    last = functools.reduce(jnp.maximum, qps)
    if window is None:
        return jnp.int32(0), jnp.maximum(last, 0) // block
    big = jnp.int32(np.iinfo(np.int32).max)
    lo = functools.reduce(jnp.minimum, [jnp.where(p >= 0, p, big) for p in qps])
    lo = jnp.minimum(lo, jnp.maximum(last, 0))
    return jnp.maximum(lo - window + 1, 0) // block, jnp.maximum(last, 0) // block


def _kv_block(b, j, rows_ref, qpos_ref, *, queries: int, block: int, window: int | None, ring: bool):
    """The K/V block grid step (b, j) copies: j clamped to the row's own span (full layers), so the steps
    outside it repeat a block index and Pallas copies nothing for them."""
    if ring:
        return rows_ref[b], j, 0
    first, last = _span(_positions(qpos_ref, b, queries), block, window)
    return rows_ref[b], jnp.clip(j, first, last), 0


def _kernel(rows_ref, qpos_ref, q_ref, k_ref, v_ref, *rest, queries: int, heads: int, group: int, dim: int,
            block: int, scale: float, window: int | None, ring: bool, num_blocks: int):
    """One (row, key block) grid step: fold the block into each of the row's queries' running max, sum and output
    (scratch row c * N + n holds query c's head n)."""
    if ring:
        kpos_ref, o_ref, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, m_ref, l_ref, acc_ref = rest
    b, j = pl.program_id(0), pl.program_id(1)
    qps = _positions(qpos_ref, b, queries)
    n_heads = heads * group

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    if ring:
        kp = kpos_ref[...]  # [1, block]: the positions this block of the ring holds
        held = kp >= 0
        needed = jnp.bool_(True)
    else:
        first, last = _span(qps, block, window)
        kp = j * block + lax.broadcasted_iota(jnp.int32, (1, block), 1)
        held = kp >= 0
        needed = (j >= first) & (j <= last)

    @pl.when(needed)
    def _fold():
        dtype = q_ref.dtype
        # Stated, never read from the process's setting: Mosaic refuses a 16-bit product at HIGHEST ("Bad lhs
        # type"), which tests and float32 workers set process-wide; bfloat16 products (the kernel's only 16-bit
        # dtype: the model's activations are bfloat16 or float32) are exact at DEFAULT.
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
        keys, vals = k_ref[...].astype(dtype), v_ref[...].astype(dtype)  # [block, K * D]
        for c, qp in enumerate(qps):  # static: a verify step's few queries
            visible = held & (kp <= qp)
            if window is not None:
                visible &= qp - kp < window
            for h in range(heads):  # static: the query heads of KV head h are rows [h G, (h + 1) G)
                heads_of = slice(h * group, (h + 1) * group)
                rows = slice(c * n_heads + h * group, c * n_heads + (h + 1) * group)
                kh, vh = keys[:, h * dim:(h + 1) * dim], vals[:, h * dim:(h + 1) * dim]
                s = lax.dot_general(q_ref[c, heads_of, :], kh, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32) * scale  # [G, block]
                s = jnp.where(visible, s, MASK_VALUE)
                m_prev = jnp.max(m_ref[rows, :], axis=1, keepdims=True)  # [G, 1] (the lanes hold one value)
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                p = jnp.exp(s - m_new)
                fix = jnp.exp(m_prev - m_new)
                l_prev = jnp.max(l_ref[rows, :], axis=1, keepdims=True)
                pv = lax.dot_general(p.astype(dtype), vh, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)  # [G, D]
                m_ref[rows, :] = jnp.broadcast_to(m_new, (group, LANES))
                l_ref[rows, :] = jnp.broadcast_to(l_prev * fix + jnp.sum(p, axis=1, keepdims=True), (group, LANES))
                acc_ref[rows, :] = acc_ref[rows, :] * fix + pv

    @pl.when(j == num_blocks - 1)
    def _write():
        for c in range(queries):
            rows = slice(c * n_heads, (c + 1) * n_heads)
            l = jnp.max(l_ref[rows, :], axis=1, keepdims=True)
            o_ref[c] = (acc_ref[rows, :] / l).astype(o_ref.dtype)
