"""The Gemma text decoder as one pure function: `forward(params, tokens, positions, cache, slots, cfg, ...)`.

A call processes a chunk of C tokens for each of B cache rows (prefill: B=1, C=chunk; decode: B=slots, C=1) and
returns the logits and the updated cache; `forward_batches` runs several such batches (a prompt chunk and a decode
step) in one pass over the weights. Padding is marked by position -1: padded tokens write nothing to the
cache and their outputs are ignored. Valid tokens come first in every row, with consecutive positions.

Math (Gemma 3: transformers `models/gemma3/modeling_gemma3.py`; Gemma 4: docs/gemma4-architecture.md):
  x = embed[tokens] * sqrt(H)
  per layer: x = x + post_attn_norm(attn(input_norm(x)));  x = x + post_ffw_norm(mlp(pre_ffw_norm(x)))
  attn: q = rope(q_norm(x Wq)), k = rope(k_norm(x Wk)), v = x Wv; softmax(q kᵀ · scale + mask) v Wo
  mlp: (gelu_tanh(x Wgate) * x Wup) Wdown
  logits = final_norm(x) @ embedᵀ  (optionally soft-capped)
RoPE uses the half-split ("rotate_half", NeoX) pairing: dim j pairs with j + D/2.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from model_worker.config import LayerSpec, ModelConfig
from model_worker.kv_cache import KVCache
from model_worker.params import LayerParams, Params
from model_worker.quant import Bf16Weight, Int8Weight, bf16_linear, int8_linear, linear, zero_from

# Finite "minus infinity": a fully masked row (a padded query) then gives a uniform softmax instead of NaN.
MASK_VALUE = -1e30


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm over the last axis, `x / sqrt(mean(x²) + eps) * w`, computed in float32, returned in x.dtype.

    `w` is the effective multiplier (see params.py); None means no weight (Gemma 4 v_norm).
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if w is not None:
        y = y * w.astype(jnp.float32)
    return y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, spec: LayerSpec) -> jax.Array:
    """Rotary position embedding, half-split pairing.

    Args:
      x: [B, C, heads, D].
      positions: [B, C] int32 logical positions.
      spec: the layer; `rope_fraction` < 1 rotates only the first `fraction*D/2` pairs (Gemma 4 "proportional"
        RoPE: inv_freq[i] = theta^(-2i/D) for those pairs, 0 for the rest, so they pass through).
    Returns:
      [B, C, heads, D] in x.dtype.
    """
    D = x.shape[-1]
    half = D // 2
    rotated = int(spec.rope_fraction * D) // 2
    i = jnp.arange(half, dtype=jnp.float32)
    inv_freq = jnp.where(i < rotated, spec.rope_theta ** (-2.0 * i / D), 0.0) / spec.rope_scale
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, C, D/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def ring_positions(start: jax.Array, window: int) -> jax.Array:
    """Logical position held at each ring index once positions [0, start) have been written.

    Index i holds the latest position p < start with p % window == i, or a negative number if none.

    Args:
      start: [B] int32, the number of positions already written (the chunk's first position).
    Returns:
      [B, window] int32.
    """
    last = start[:, None] - 1
    i = jnp.arange(window, dtype=jnp.int32)[None, :]
    return last - jnp.mod(last - i, window)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: int | None, scale: float
) -> jax.Array:
    """Grouped-query attention of C queries over T keys with a causal (optionally sliding) mask.

    Args:
      q: [B, C, N, D]; k, v: [B, T, K, D] with N a multiple of K.
      q_pos: [B, C] query positions (-1 = padding); k_pos: [B, T] key positions (negative = empty).
      window: sliding window W (key visible iff q - W < k <= q) or None for plain causal.
      scale: multiplier of q·k.
    Returns:
      [B, C, N*D] in q.dtype.
    """
    B, C, N, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, C, K, N // K, D)
    scores = jnp.einsum("bckgd,btkd->bkgct", qg, k, preferred_element_type=jnp.float32) * scale
    visible = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
    scores = jnp.where(visible[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # Output in the dot's natural order, then transpose the small result: asking the dot for "bckgd" directly
    # made XLA CPU transpose all of V first, much slower at long contexts (figures: docs/performance.md).
    out = jnp.einsum("bkgct,btkd->bkgcd", probs, v).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, C, N * D)


def _rows(x: jax.Array | None, slots: jax.Array | None) -> jax.Array | None:
    """The cache rows of this batch: all rows in order (slots None) or a gather of `slots`."""
    return x if slots is None or x is None else jnp.take(x, slots, axis=0)


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> (int8 [..., D], float32 scale [...]): symmetric, one scale per vector, scale = max|x| / 127."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.maximum(amax, 1e-30) / 127.0
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """Inverse of quantize_kv (identity when scale is None)."""
    if scale is None:
        return q
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def _write_full(cache: jax.Array | None, new: jax.Array, positions: jax.Array, slots: jax.Array | None):
    """Scatter new K or V ([B, C, K, D]) or their scales ([B, C, K]) into a full-length cache at (slot,
    position); padding is dropped. None stays None."""
    if cache is None:
        return None
    B = new.shape[0]
    rows = jnp.arange(B) if slots is None else slots
    where = jnp.where(positions >= 0, positions, cache.shape[1])  # out of range -> dropped
    return cache.at[rows[:, None], where].set(new, mode="drop")


def _update_ring(ring: jax.Array, new: jax.Array, start: jax.Array, n_valid: jax.Array) -> jax.Array:
    """New ring contents after appending the chunk's valid tokens.

    Args:
      ring: [B, W, K, D] current contents (positions < start).
      new: [B, C, K, D] the chunk's K or V (valid tokens first).
      start: [B] position of the chunk's first token; n_valid: [B] number of valid tokens.
    Returns:
      [B, W, K, D]: index i takes the chunk token at the latest position p with p % W == i, if that token is in
      the chunk, else keeps its old value. A gather, so any chunk length C (even > W) is fine.
    """
    W = ring.shape[1]
    held = ring_positions(start + n_valid, W)  # [B, W] positions held after the append
    from_chunk = held >= start[:, None]
    idx = jnp.clip(held - start[:, None], 0, new.shape[1] - 1)
    tail = (1,) * (new.ndim - 2)
    gathered = jnp.take_along_axis(new, idx.reshape(idx.shape + tail), axis=1)
    return jnp.where(from_chunk.reshape(from_chunk.shape + tail), gathered, ring)


def _set_rows(cache: jax.Array | None, rows_value: jax.Array | None, slots: jax.Array | None):
    """Write updated rows back (the whole array when slots is None)."""
    if cache is None:
        return None
    return rows_value if slots is None else cache.at[slots].set(rows_value)


def _attention_block(
    lp: LayerParams,
    spec: LayerSpec,
    i: int,
    hs: list[jax.Array],
    streams: list[_Stream],
    cache: KVCache,
    kv_len: int,
    cfg: ModelConfig,
) -> list[jax.Array]:
    """Self-attention of one layer for every stream; updates `cache` and each stream's `shared` and `deferred`
    in place (they are local to the trace).

    The projections (Wq, Wk, Wv, Wo) run once over the rows of all streams (`_joint`); each stream attends over
    its own cache rows. Full layers, and every layer in decode (C == 1), write their K/V into the cache first and
    read it in place (`_attend_in_place`); sliding layers in a chunk (C > 1) attend over their gathered ring plus
    the chunk and defer the ring write to `_write_rings`, after the last layer.

    Args:
      hs: per stream, the normed hidden states [B, C, H].
    Returns:
      per stream, the attention output after Wo, [B, C, H].
    """
    qs = _joint(lambda h: linear(h, lp.q), hs)
    new = [None] * len(streams)
    if spec.kv_source == i:
        k_raws = _joint(lambda h: linear(h, lp.k), hs)
        v_raws = k_raws if spec.k_eq_v else _joint(lambda h: linear(h, lp.v), hs)
        int8 = cache.k_scale[i] is not None
        new = [_kv_from_raw(lp, spec, k, v, st.positions, int8, cfg) for k, v, st in zip(k_raws, v_raws, streams)]
        for st, kv in zip(streams, new):
            if spec.attention == "sliding" and st.chunk > 1:
                _gather_ring(cache, i, kv, st, hs[0].dtype)
    window = cfg.sliding_window if spec.attention == "sliding" else None
    outs = [None] * len(streams)

    def attention(s: int) -> jax.Array:
        q, st = qs[s], streams[s]
        q = q.reshape(q.shape[:2] + (cfg.num_heads, spec.head_dim))
        q = rope(rms_norm(q, lp.q_norm, cfg.rms_norm_eps), st.positions, spec)
        keys, vals, k_pos, in_place = st.shared[spec.kv_source]
        if in_place:
            return _attend_in_place(q, cache, spec.kv_source, st.slots, st.positions, k_pos, window, cfg.attn_scale,
                                    q.dtype, kv_len)
        return attend(q, keys, vals, st.positions, k_pos, window, cfg.attn_scale)

    # Order within the layer (it matters with several streams): streams over gathered rings attend; then every
    # in-place write, made to wait for those outputs (which consumed this layer's reads of the rings); then every
    # in-place read, of the fully written buffer (each stream reads only its own rows). A write to a buffer while a
    # read of it is still pending makes XLA copy the whole array (on XLA CPU an optimization barrier after the
    # gather does not order it: the barrier is expanded away and the gather fused into its readers). Gemma 4's
    # KV-shared layers read a gathered ring again later; XLA CPU then keeps the gathered rows rather than copying
    # the cache (test_mixed_step checks the compiled program; other backends are unchecked).
    gathered = [s for s, st in enumerate(streams) if _reads_gathered(st, spec.kv_source)]
    for s in gathered:
        outs[s] = attention(s)
    in_place = [s for s in range(len(streams)) if s not in gathered]
    if spec.kv_source == i:
        for s in in_place:
            kv, st = new[s], streams[s]
            for g in gathered:
                kv = tuple(None if a is None else _after_value(a, outs[g]) for a in kv)
            k_pos = _write_in_place(cache, i, spec, kv, st.positions, st.start, st.n_valid, st.slots)
            st.shared[i] = (None, None, k_pos, True)
    for s in in_place:
        outs[s] = attention(s)
    return _joint(lambda o: linear(o, lp.o), outs)


def _reads_gathered(st: _Stream, src: int) -> bool:
    """Whether the stream attends over layer src's gathered ring (not over the cache in place)."""
    return src in st.shared and not st.shared[src][3]


def _gather_ring(cache: KVCache, i: int, kv: tuple, st: _Stream, dtype) -> None:
    """A sliding-layer chunk (C > 1): its rows' rings, gathered before anything writes layer i, plus the chunk's
    own K/V become the keys it attends over (`st.shared[i]`: keys, values [B, R + C, K, D] in `dtype`, their
    positions [B, R + C]); the ring write is deferred to `_write_rings`.

    Args:
      kv: the chunk's (k, v, k_scale, v_scale) from `_kv_from_raw`: [B, C, K, D] (int8 with int8 KV), scales
        [B, C, K] float32 or None.
    """
    ring = [_rows(a, st.slots) for a in (cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i])]
    keys = jnp.concatenate([dequantize_kv(ring[0], ring[2], dtype), dequantize_kv(kv[0], kv[2], dtype)], axis=1)
    vals = jnp.concatenate([dequantize_kv(ring[1], ring[3], dtype), dequantize_kv(kv[1], kv[3], dtype)], axis=1)
    k_pos = jnp.concatenate([ring_positions(st.start, ring[0].shape[1]), st.positions], axis=1)
    st.deferred.append((i, ring, kv))
    st.shared[i] = (keys, vals, k_pos, False)


def _batch_rows(slots: jax.Array | None, B: int) -> jax.Array:
    """[B] int32 cache row of each batch row."""
    return jnp.arange(B, dtype=jnp.int32) if slots is None else slots


def _kv_from_raw(lp, spec: LayerSpec, k_raw, v_raw, positions, int8: bool, cfg):
    """K and V of a chunk from its projections x Wk and x Wv (k_raw, v_raw [B, C, K*D]; v_raw is k_raw when
    `k_eq_v`): k = rope(k_norm(k_raw)), v = v_raw (RMS-normed without weight when `cfg.v_norm`), each [B, C, K, D];
    with `int8`, quantized as the cache will hold them (the chunk attends to that). Returns (k, v, k_scale,
    v_scale), scales [B, C, K] float32 or None."""
    B, C = k_raw.shape[:2]
    D, K = spec.head_dim, spec.num_kv_heads
    eps = cfg.rms_norm_eps
    k_raw = k_raw.reshape(B, C, K, D)
    k = rope(rms_norm(k_raw, lp.k_norm, eps), positions, spec)
    v = v_raw.reshape(B, C, K, D)
    if cfg.v_norm:
        v = rms_norm(v, None, eps)
    if not int8:
        return k, v, None, None
    (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
    return k, v, ks, vs


def _write_in_place(cache: KVCache, i: int, spec: LayerSpec, new: tuple, positions, start, n_valid, slots):
    """Write a chunk's (k, v, k_scale, v_scale) into layer i's cache rows before any read: full layers at index =
    position; sliding layers (decode only, C == 1) at ring index position % R. Safe for R >= window: position p
    evicts p - R, which the strict window mask (q - W < k) hides anyway. Padding (position -1) writes nothing.

    Returns:
      sliding layers: k_pos [B, R] int32, the position held at each ring index of each batch row (negative =
      empty); full layers: None (index = position; `_attend_in_place` reads up to the row's position).
    """
    T = cache.k[i].shape[1]
    index = jnp.where(positions >= 0, positions % T, -1) if spec.attention == "sliding" else positions
    for name, value in zip(("k", "v", "k_scale", "v_scale"), new):
        getattr(cache, name)[i] = _write_full(getattr(cache, name)[i], value, index, slots)
    return ring_positions(start + n_valid, T) if spec.attention == "sliding" else None


def _attend_in_place(q, cache: KVCache, src: int, slots, q_pos, k_pos, window, scale: float, dtype,
                     kv_len: int) -> jax.Array:
    """Attention of each batch row over its own cache row of layer `src`, read in place (the row's new K/V are
    already written).

    Args:
      q: [B, C, N, D]; q_pos: [B, C] (-1 = padding).
      k_pos: sliding layers: [B, R] positions held by each row's ring (`_write_in_place`; decode only, C == 1);
        full layers: None - index = position, and a row reads keys [0, its last valid position] only
        (`_attend_blocks`), never beyond the static bound kv_len.
      slots: [B] cache rows (None: row b is slot b).
    Returns:
      [B, C, N*D], as `attend`.

    A `lax.map` over the batch rows, each reading dynamic slices of its cache row (contiguous, not copied).
    Gathering the batch's rows instead copies them (on XLA CPU a copy costs several reads), and attending over
    every cache row in place wastes the idle rows; one slice per row was the fastest of the three in both KV
    buckets measured (figures: docs/performance.md).
    """
    rows = _batch_rows(slots, q.shape[0])
    arrays = (cache.k[src], cache.v[src], cache.k_scale[src], cache.v_scale[src])
    if k_pos is None:
        T = arrays[0].shape[1]
        block = min(KEY_BLOCK, T)
        bound = -(-min(kv_len, T) // block)  # blocks within the KV bucket

        def full(args):
            qb, row, qp = args
            return _attend_blocks(qb, arrays, row, qp, block, bound, window, scale, dtype)

        return lax.map(full, (q, rows, q_pos))
    length = k_pos.shape[1]

    def ring(args):
        qb, row, qp, kp = args
        k, v, ks, vs = (None if a is None else lax.dynamic_slice(a, (row,) + (0,) * (a.ndim - 1),
                                                                (1, length) + a.shape[2:]) for a in arrays)
        keys, vals = dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype)
        return attend(qb[None], keys, vals, qp[None], kp[None], window, scale)[0]

    return lax.map(ring, (q, rows, q_pos, k_pos))


# Keys per block of the full-layer loop: 512 is as fast as one slice at 2k keys and skips the unused tail
# (figures: docs/performance.md).
KEY_BLOCK = 512


def _attend_blocks(q, arrays, row, q_pos, block: int, bound: int, window, scale: float, dtype) -> jax.Array:
    """One row's attention over keys [0, last valid q position] of a full-attention cache row, block by block
    with an online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the
    FlashAttention recurrence), for as many blocks as the row needs (a dynamic trip count, at most `bound`).

    Args:
      q: [C, N, D] queries; q_pos: [C] int32 positions (-1 = padding); arrays: the layer's (k, v, k_scale,
        v_scale) cache arrays [S, T, K, D] (scales [S, T, K] or None); row: int32 cache row.
      block: keys per block (<= T); bound: static maximum number of blocks. Block b covers positions
        [b * block, (b + 1) * block); when T is not a multiple of `block`, the last block's slice is moved back
        to end at T and its keys below b * block (already counted) are masked.
    Returns:
      [C, N*D] in q.dtype: softmax(q kᵀ · scale + causal mask) v over the row's keys at positions <= q_pos
      (and > q_pos - window). A padding query (no visible key) gets a finite average, as in `attend`.
    """
    C, N, D = q.shape
    T, K = arrays[0].shape[1:3]
    qg = q.reshape(C, K, N // K, D)
    need = jnp.maximum(jnp.max(q_pos) + 1, 1)
    blocks = jnp.minimum((need + block - 1) // block, bound)

    def body(b, carry):
        m, l, acc = carry  # running max and sum [K, G, C]; unnormalized output [K, G, C, D]
        first = b * block
        start = jnp.minimum(first, T - block)  # the last block of a T that `block` does not divide
        k, v, ks, vs = (None if a is None else lax.dynamic_slice(a, (row, start) + (0,) * (a.ndim - 2),
                                                                (1, block) + a.shape[2:])[0] for a in arrays)
        keys, vals = dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype)  # [block, K, D]
        s = jnp.einsum("ckgd,tkd->kgct", qg, keys, preferred_element_type=jnp.float32) * scale
        k_pos = start + jnp.arange(block, dtype=jnp.int32)
        visible = (k_pos[None, :] >= first) & (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] >= 0)
        if window is not None:
            visible &= q_pos[:, None] - k_pos[None, :] < window
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        fix = jnp.exp(m - m_new)
        pv = jnp.einsum("kgct,tkd->kgcd", p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
        return m_new, l * fix + jnp.sum(p, axis=-1), acc * fix[..., None] + pv

    G = N // K
    init = (jnp.full((K, G, C), MASK_VALUE, jnp.float32), jnp.zeros((K, G, C), jnp.float32),
            jnp.zeros((K, G, C, D), jnp.float32))
    _, l, acc = lax.fori_loop(0, blocks, body, init)
    out = (acc / l[..., None]).astype(q.dtype)  # [K, G, C, D]
    return out.transpose(2, 0, 1, 3).reshape(C, N * D)


def _after_value(x: jax.Array, anchor: jax.Array) -> jax.Array:
    """x itself, made data-dependent on `anchor` (0 derived from it in a way XLA cannot fold: for v = the bits of
    one anchor element, min(v, 0) & max(v, 0) == 0), so ops producing x's consumers wait for the anchor."""
    zero = zero_from(anchor, x.dtype)
    return x | zero if jnp.issubdtype(x.dtype, jnp.integer) else x + zero


def _write_rings(cache: KVCache, deferred: list, anchor, positions, start, n_valid, slots) -> None:
    """Apply the sliding layers' ring updates of a chunk (C > 1; decode writes its rings at once, before the reads,
    in `_write_in_place`) once every layer has read the rings.

    Writing a ring while a later read of the same buffer is still pending (the read is fused into the attention
    that consumes it, or a KV-shared layer reads it later) makes XLA copy the whole cache array instead of updating
    it in place. Making the written values depend on the final hidden state (`anchor`) orders every write after
    every read. Each valid token goes to ring index position % R (R = the ring length) — a scatter of C entries
    per row when C <= R (no collisions); longer chunks rewrite whole rows with `_update_ring`.
    """
    names = ("k", "v", "k_scale", "v_scale")
    C = positions.shape[1]
    for i, ring, chunks in deferred:
        for name, old, chunk in zip(names, ring, chunks):
            arrays = getattr(cache, name)
            if arrays[i] is None:
                continue
            size = arrays[i].shape[1]
            if C <= size:
                ring_idx = jnp.where(positions >= 0, positions % size, -1)
                arrays[i] = _write_full(arrays[i], _after_value(chunk, anchor), ring_idx, slots)
            else:
                rows_value = _update_ring(old, _after_value(chunk, anchor), start, n_valid)
                arrays[i] = _set_rows(arrays[i], rows_value, slots)


def _mlp(lp: LayerParams, x: jax.Array) -> jax.Array:
    """Gated MLP: (gelu_tanh(x Wgate) * x Wup) Wdown."""
    return linear(jax.nn.gelu(linear(x, lp.gate), approximate=True) * linear(x, lp.up), lp.down)


def per_layer_inputs(params: Params, tokens: jax.Array, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gemma 4 per-layer embeddings (PLE), docs/gemma4-architecture.md §3.

    Args:
      tokens: [B, C] ids; x: [B, C, H] the scaled token embeddings.
    Returns:
      [B, C, L, P]: (RMSNorm_P(x W_plmp · H^-0.5) + ple_embed[tokens] · sqrt(P)) · 2^-0.5, layer-major.
    """
    B, C, H = x.shape
    L, P = cfg.num_layers, cfg.ple_dim
    ids = jnp.where(tokens < cfg.ple_vocab, tokens, 0)
    token_part = jnp.take(params.ple_embed, ids, axis=0) * jnp.asarray(P**0.5, x.dtype)
    context = linear(x, params.ple_proj) * jnp.asarray(H**-0.5, x.dtype)
    context = rms_norm(context.reshape(B, C, L, P), params.ple_norm, cfg.rms_norm_eps)
    return (context + token_part.reshape(B, C, L, P)) * jnp.asarray(2**-0.5, x.dtype)


def _ple_block(lp: LayerParams, x: jax.Array, pli: jax.Array, eps: float) -> jax.Array:
    """The per-layer-input residual branch: post_norm(proj(gelu_tanh(gate(x)) * pli))."""
    h = jax.nn.gelu(linear(x, lp.ple_gate), approximate=True) * pli
    return rms_norm(linear(h, lp.ple_proj), lp.ple_post_norm, eps)


def embed_rows(embed: jax.Array | Int8Weight, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Embedding lookup: tokens int32 [...] -> [..., H] in `dtype` (an Int8Weight dequantizes only these rows)."""
    if isinstance(embed, Int8Weight):
        return embed.rows(tokens, dtype)
    return jnp.take(embed, tokens, axis=0).astype(dtype)


def lm_head(x: jax.Array, embed: jax.Array | Int8Weight | Bf16Weight) -> jax.Array:
    """Tied LM head: x [..., H] -> logits float32 [..., V] = x · embedᵀ (Gemma ties the head to the embedding;
    a `Bf16Weight` is its bfloat16 copy, `Params.lm_head`)."""
    if isinstance(embed, Bf16Weight):
        return bf16_linear(x, embed, out_dtype=jnp.float32)
    if isinstance(embed, Int8Weight):
        return int8_linear(x, embed, out_dtype=jnp.float32)
    return jnp.einsum("...h,vh->...v", x, embed, preferred_element_type=jnp.float32)


class Batch(NamedTuple):
    """One batch of a forward pass: C tokens for each of B cache rows (prefill: B=1, C=chunk; decode: C=1).

    Attributes:
      tokens: [B, C] int32 token ids (padding ids are ignored).
      positions: [B, C] int32 logical positions; valid tokens first with consecutive positions, padding = -1.
      slots: [B] int32 cache rows (distinct), or None for "rows 0..B-1 are slots 0..B-1".
      logit_rows: [B] int32 index of the chunk position whose logits to return per row, or None for all.
    """

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array | None = None
    logit_rows: jax.Array | None = None


@dataclasses.dataclass
class _Stream:
    """Trace-time bookkeeping of one Batch inside `forward_batches` (plain Python, not a pytree).

    positions: [B, C] (cut to [B, 1] at the first KV-shared layer when logits of one row each are wanted);
    start, n_valid: [B] int32; shared: kv_source layer -> (keys | None, values | None, k_pos | None, in place);
    deferred: sliding-ring writes for `_write_rings`.
    """

    batch: Batch
    positions: jax.Array
    start: jax.Array
    n_valid: jax.Array
    shared: dict = dataclasses.field(default_factory=dict)
    deferred: list = dataclasses.field(default_factory=list)

    @property
    def slots(self) -> jax.Array | None:
        return self.batch.slots

    @property
    def chunk(self) -> int:
        return self.positions.shape[1]

    @staticmethod
    def of(batch: Batch) -> _Stream:
        """The stream of a Batch: start = its first position ([B] int32, 0 for an all-padding row), n_valid."""
        n_valid = jnp.sum(batch.positions >= 0, axis=1).astype(jnp.int32)
        start = jnp.where(n_valid > 0, batch.positions[:, 0], 0)
        return _Stream(batch, batch.positions, start, n_valid)


def _joint(fn, xs: list[jax.Array]) -> list[jax.Array]:
    """fn applied once to the rows of every stream: xs are [B_s, C_s, H] arrays, fn maps [R, H] -> [R, H'] row by
    row; returns [B_s, C_s, H'] per stream. One stream passes straight through (no concatenation); several
    share one weight read, and their small batches ride on one larger matrix product."""
    if len(xs) == 1:
        return [fn(xs[0])]
    y = fn(jnp.concatenate([x.reshape(-1, x.shape[-1]) for x in xs]))
    out, at = [], 0
    for x in xs:
        n = x.shape[0] * x.shape[1]
        out.append(y[at:at + n].reshape(x.shape[:2] + y.shape[1:]))
        at += n
    return out


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    slots: jax.Array | None,
    cfg: ModelConfig,
    kv_len: int,
    logit_rows: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run the decoder over a chunk of tokens for a batch of cache rows (`forward_batches` with one Batch).

    Args:
      params: weights.
      tokens, positions, slots, logit_rows: as in `Batch`.
      cache: the KV cache (S rows); donated by callers.
      cfg: static model config.
      kv_len: static; full-attention layers read cache positions [0, kv_len). A full-attention layer must have
        kv_len > every valid position.
    Returns:
      logits: [B, V] float32 (or [B, C, V] when logit_rows is None); the updated cache.
    """
    logits, cache = forward_batches(params, (Batch(tokens, positions, slots, logit_rows),), cache, cfg, kv_len)
    return logits[0], cache


def forward_batches(
    params: Params, batches: tuple[Batch, ...], cache: KVCache, cfg: ModelConfig, kv_len: int
) -> tuple[list[jax.Array], KVCache]:
    """Run the decoder over several batches in one pass, e.g. a prompt chunk of one slot and a decode step of
    others (a "mixed" step, as vLLM's chunked prefill and Sarathi-Serve's stall-free batching do).

    The attention projections, the MLP and the LM head run once on the concatenated rows of all batches
    (`_joint`), so B decode rows ride on a C-token chunk's matrix products instead of a second pass over those
    weights; each batch attends over its own cache rows. (Gemma 4's per-layer-input branch, a small part of the
    weights, still runs per batch.) The result equals running the batches one after another, each with
    `forward` (to float32 summation order).

    Args:
      params: weights.
      batches: Batch tuples; the slots of their valid rows must be distinct across all batches (a row whose
        positions are all -1 writes nothing and may name any slot). Either every batch has logit_rows, or none
        has.
      cache: the KV cache (S rows); donated by callers.
      cfg: static model config.
      kv_len: static; full-attention layers read cache positions [0, kv_len); must exceed every valid position.
    Returns:
      per batch, logits [B, V] float32 (or [B, C, V] when logit_rows is None); the updated cache.
    Raises:
      ValueError: some batches have logit_rows and others do not.
    """
    if len({b.logit_rows is None for b in batches}) != 1:
        raise ValueError("forward_batches: either every batch has logit_rows or none has")
    dtype = params.final_norm.dtype  # the activation dtype (the embedding may be stored as Int8Weight)
    eps = cfg.rms_norm_eps
    streams = [_Stream.of(b) for b in batches]
    xs = [embed_rows(params.embed, b.tokens, dtype) * jnp.asarray(cfg.embed_scale, dtype) for b in batches]
    plis = [per_layer_inputs(params, b.tokens, x, cfg) if cfg.ple_dim else None for b, x in zip(batches, xs)]
    cache = KVCache(k=list(cache.k), v=list(cache.v), k_scale=list(cache.k_scale), v_scale=list(cache.v_scale))
    # KV-shared layers write no cache, so only the rows whose logits are wanted need to pass through them
    # (transformers Gemma4TextModel._maybe_slice_kv_shared_inputs): prefill computes them for one token.
    pick_rows = batches[0].logit_rows is not None
    cut = cfg.first_shared_layer if pick_rows else cfg.num_layers
    for i, (lp, spec) in enumerate(zip(params.layers, cfg.layers)):
        if i == cut:
            for s, st in enumerate(streams):
                rows = st.batch.logit_rows
                pick = lambda a: jnp.take_along_axis(a, rows.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)
                xs[s], st.positions = pick(xs[s]), pick(st.positions)
                plis[s] = pick(plis[s]) if plis[s] is not None else None
        hs = [rms_norm(x, lp.input_norm, eps) for x in xs]
        attn = _attention_block(lp, spec, i, hs, streams, cache, kv_len, cfg)
        xs = [x + rms_norm(a, lp.post_attn_norm, eps) for x, a in zip(xs, attn)]
        ffw = _joint(lambda h: _mlp(lp, h), [rms_norm(x, lp.pre_ffw_norm, eps) for x in xs])
        xs = [x + rms_norm(f, lp.post_ffw_norm, eps) for x, f in zip(xs, ffw)]
        if cfg.ple_dim:
            xs = [x + _ple_block(lp, x, pli[:, :, i], eps) for x, pli in zip(xs, plis)]
        if cfg.layer_scalar:
            xs = [x * lp.layer_scalar.astype(x.dtype) for x in xs]
    for st in streams:  # any stream's final state depends on every stream's reads (the shared projections)
        b = st.batch
        _write_rings(cache, st.deferred, xs[0], b.positions, st.start, st.n_valid, b.slots)
    if pick_rows and cut == cfg.num_layers:  # not cut yet: keep each row's logit position, [B, 1, H]
        xs = [jnp.take_along_axis(x, st.batch.logit_rows[:, None, None], axis=1) for x, st in zip(xs, streams)]
    logits = _joint(lambda h: _logits(params, h, cfg), xs)
    return [lg[:, 0] if pick_rows else lg for lg in logits], cache


def _logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm, tied LM head and optional soft cap: x [..., H] -> logits float32 [..., V]."""
    head = params.embed if params.lm_head is None else params.lm_head
    logits = lm_head(rms_norm(x, params.final_norm, cfg.rms_norm_eps), head)
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


@functools.partial(jax.jit, static_argnames=("cfg", "kv_len"), donate_argnames=("cache",))
def forward_jit(params, tokens, positions, cache, slots, cfg, kv_len, logit_rows=None):
    """`forward` under `jax.jit` with the cache donated (for tests and tools; the engine compiles its own grid)."""
    return forward(params, tokens, positions, cache, slots, cfg, kv_len, logit_rows)
