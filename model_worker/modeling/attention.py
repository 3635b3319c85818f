"""Attention of the decoder's layers over the KV cache: RoPE, masked grouped-query attention, the in-place
reads of cache rows (row by row, full layers block by block with an online softmax), and `attention_block`, one
layer's self-attention for every batch of a forward pass with the cache writes ordered so that XLA updates the
donated cache in place (docs/architecture.md, "No cache copies").

Shapes: B batch rows, C tokens per row, N query heads, K KV heads, D head dim, T cache positions, R ring length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model_worker.modeling.block_attention import CHUNK, FULL, RING, block_attention
from model_worker.modeling.config import LayerSpec, ModelConfig
from model_worker.modeling.kv_cache import (
    BF16_BITS,
    KVCache,
    after_value,
    dequantize_kv,
    quantize_kv,
    ring_positions,
    to_storage,
    write_in_place,
)
from model_worker.modeling.layers import joint, rms_norm
from model_worker.modeling.params import LayerParams
from model_worker.numerics import elementwise
from model_worker.numerics.decode_attention import decode_attention
from model_worker.numerics.quant import gemm_row_pad, linear

# Finite "minus infinity": a fully masked row (a padded query) then gives a uniform softmax instead of NaN.
MASK_VALUE = -1e30

# Keys per block of the full-layer loop: 512 is as fast as one slice at 2k keys and skips the unused tail
# (figures: docs/performance.md).
KEY_BLOCK = 512


def inv_freq(D: int, spec: LayerSpec) -> np.ndarray:
    """RoPE's [D/2] float32 frequencies, theta^(-2i/D) / rope_scale for the rotated pairs and 0 for the rest,
    computed here in float64 (a constant of the program).

    Why not traced: a backend may evaluate the power in its own float32 arithmetic at run time, through exp and
    log where those are approximations (a TPU v5e's float32 log: up to 3964 ulp, `scripts/float32_probe.py`): up
    to ~1e-3 relative error in a frequency. On the CPU, float64 rounded to float32 is what XLA computed (bit for
    bit at D <= 256; one frequency of 256 differs by an ulp at D = 512, theta 1e6)."""
    half = D // 2
    rotated = int(spec.rope_fraction * D) // 2
    i = np.arange(half)
    freq = (np.float64(spec.rope_theta) ** (-2.0 * i / D)).astype(np.float32)
    return np.where(i < rotated, freq, np.float32(0)) / np.float32(spec.rope_scale)


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
    angles = positions.astype(jnp.float32)[..., None] * inv_freq(D, spec)  # [B, C, D/2]
    cos = elementwise.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = elementwise.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


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
    probs = elementwise.softmax(scores, axis=-1).astype(v.dtype)
    # Output in the dot's natural order, then transpose the small result: asking the dot for "bckgd" directly
    # made XLA CPU transpose all of V first, much slower at long contexts (figures: docs/performance.md).
    out = jnp.einsum("bkgct,btkd->bkgcd", probs, v).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, C, N * D)


@dataclasses.dataclass
class BatchKV:
    """What one batch of a forward pass attends over, while `model.forward_batches` is traced (plain Python, not a
    pytree): where its rows' tokens sit, the keys each KV-source layer offers it, and the ring writes it owes.

    Attributes:
      slots: [B] int32 cache rows, or None (row b is slot b).
      positions: [B, C] int32 positions of the rows still computed (-1 = padding): the batch's own, cut to
        [B, 1] at the first KV-shared layer when one logit row each is wanted.
      start, n_valid: [B] int32, each row's first position (0 for an all-padding row) and number of valid tokens.
      sources: KV-source layer -> (keys | None, values | None, k_pos | None, in place): the gathered keys and
        values [B, R + C, K, D] with their positions (a sliding layer's chunk), or the cache read in place with
        k_pos [B, R] for a sliding ring and None for a full layer.
      deferred: the sliding-ring writes for `kv_cache.write_rings`, after the last layer.
    """

    slots: jax.Array | None
    positions: jax.Array
    start: jax.Array
    n_valid: jax.Array
    sources: dict = dataclasses.field(default_factory=dict)
    deferred: list = dataclasses.field(default_factory=list)

    @property
    def chunk(self) -> int:
        """Tokens per row computed now (C)."""
        return self.positions.shape[1]

    @staticmethod
    def of(positions: jax.Array, slots: jax.Array | None) -> BatchKV:
        """The state of a batch with these positions ([B, C], valid tokens first) and slots, before layer 0."""
        n_valid = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
        start = jnp.where(n_valid > 0, positions[:, 0], 0)
        return BatchKV(slots, positions, start, n_valid)


def attention_block(
    lp: LayerParams,
    spec: LayerSpec,
    i: int,
    hs: list[jax.Array],
    batches: list[BatchKV],
    cache: KVCache,
    kv_len: int,
    cfg: ModelConfig,
) -> list[jax.Array]:
    """Self-attention of layer `i` for every batch of a forward pass; updates `cache` (a trace-local copy of its
    per-layer lists) and each batch's `sources` and `deferred` in place.

    Only the layer's attention is computed here: the caller norms its input and adds the residual.

    The projections (Wq, Wk, Wv, Wo) run once over the rows of all batches (`joint`); each batch attends over
    its own cache rows. Full layers, and every layer in decode (C == 1), write their K/V into the cache first and
    read it in place (`attend_in_place`); sliding layers in a chunk (C > 1) attend over their gathered ring plus
    the chunk and defer the ring write to `kv_cache.write_rings`, after the last layer.

    Args:
      lp, spec, i: the layer's weights, facts and index.
      hs: per batch, the normed hidden states [B, C, H].
      batches: per batch, its `BatchKV` (same order as hs).
      kv_len: static; full layers read cache positions [0, kv_len) at most.
      cfg: static model config.
    Returns:
      per batch, the attention output after Wo, [B, C, H].
    """
    qs = joint(lambda h: linear(h, lp.q), hs)
    new = [None] * len(batches)
    if spec.kv_source == i:
        k_raws = joint(lambda h: linear(h, lp.k), hs)
        v_raws = k_raws if spec.k_eq_v else joint(lambda h: linear(h, lp.v), hs)
        int8 = cache.k_scale[i] is not None
        new = [_kv_from_raw(lp, spec, k, v, st.positions, int8, cfg) for k, v, st in zip(k_raws, v_raws, batches)]
        if not int8 and cache.k[i].dtype != new[0][0].dtype:  # a bfloat16 store (`kv_cache.storage_dtype`)
            store = cache.k[i].dtype
            new = [(to_storage(k, store), to_storage(v, store), None, None) for k, v, _, _ in new]
        for st, kv in zip(batches, new):
            if spec.attention == "sliding" and st.chunk > 1:
                _gather_ring(cache, i, kv, st, hs[0].dtype)
    window = cfg.sliding_window if spec.attention == "sliding" else None
    outs = [None] * len(batches)

    def attention(s: int) -> jax.Array:
        q, st = qs[s], batches[s]
        q = q.reshape(q.shape[:2] + (cfg.num_heads, spec.head_dim))
        q = rope(rms_norm(q, lp.q_norm, cfg), st.positions, spec)
        if cfg.batch_invariant:
            return attend_invariant(q, st, st.sources[spec.kv_source], cache, spec.kv_source, window, cfg.attn_scale,
                                    q.dtype, kv_len)
        keys, vals, k_pos, in_place = st.sources[spec.kv_source]
        if in_place:
            return attend_in_place(q, cache, spec.kv_source, st.slots, st.positions, k_pos, window, cfg.attn_scale,
                                   q.dtype, kv_len, kernel=cfg.attention_kernel)
        return attend(q, keys, vals, st.positions, k_pos, window, cfg.attn_scale)

    # Order within the layer (it matters with several batches): batches over gathered rings attend; then every
    # in-place write, made to wait for those outputs (which consumed this layer's reads of the rings); then every
    # in-place read, of the fully written buffer (each batch reads only its own rows). A write to a buffer while a
    # read of it is still pending makes XLA copy the whole array (on XLA CPU an optimization barrier after the
    # gather does not order it: the barrier is expanded away and the gather fused into its readers). Gemma 4's
    # KV-shared layers read a gathered ring again later; XLA CPU then keeps the gathered rows rather than copying
    # the cache (test_mixed_step checks the compiled program; other backends are unchecked).
    gathered = [s for s, st in enumerate(batches) if _reads_gathered(st, spec.kv_source)]
    for s in gathered:
        outs[s] = attention(s)
    in_place = [s for s in range(len(batches)) if s not in gathered]
    if spec.kv_source == i:
        for s in in_place:
            kv, st = new[s], batches[s]
            for g in gathered:
                kv = tuple(None if a is None else after_value(a, outs[g]) for a in kv)
            k_pos = write_in_place(cache, i, spec, kv, st.positions, st.start, st.n_valid, st.slots)
            st.sources[i] = (None, None, k_pos, True)
    for s in in_place:
        outs[s] = attention(s)
    return joint(lambda o: linear(o, lp.o), outs)


def _reads_gathered(st: BatchKV, src: int) -> bool:
    """Whether the batch attends over layer src's gathered ring (not over the cache in place)."""
    return src in st.sources and not st.sources[src][3]


def _gather_ring(cache: KVCache, i: int, kv: tuple, st: BatchKV, dtype) -> None:
    """A sliding-layer chunk (C > 1): its rows' rings, gathered before anything writes layer i, plus the chunk's
    own K/V become the keys it attends over (`st.sources[i]`: keys, values [B, R + C, K, D] in `dtype`, their
    positions [B, R + C]); the ring write is deferred to `kv_cache.write_rings`.

    Args:
      kv: the chunk's (k, v, k_scale, v_scale) from `_kv_from_raw`: [B, C, K, D] (int8 with int8 KV), scales
        [B, C, K] float32 or None.
    """
    ring = [_rows(a, st.slots) for a in (cache.k[i], cache.v[i], cache.k_scale[i], cache.v_scale[i])]
    keys = jnp.concatenate([dequantize_kv(ring[0], ring[2], dtype), dequantize_kv(kv[0], kv[2], dtype)], axis=1)
    vals = jnp.concatenate([dequantize_kv(ring[1], ring[3], dtype), dequantize_kv(kv[1], kv[3], dtype)], axis=1)
    k_pos = jnp.concatenate([ring_positions(st.start, ring[0].shape[1]), st.positions], axis=1)
    st.deferred.append((i, ring, kv))
    st.sources[i] = (keys, vals, k_pos, False)


def _rows(x: jax.Array | None, slots: jax.Array | None) -> jax.Array | None:
    """The cache rows of this batch: all rows in order (slots None) or a gather of `slots`."""
    return x if slots is None or x is None else jnp.take(x, slots, axis=0)


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
    k_raw = k_raw.reshape(B, C, K, D)
    k = rope(rms_norm(k_raw, lp.k_norm, cfg), positions, spec)
    v = v_raw.reshape(B, C, K, D)
    if cfg.v_norm:
        v = rms_norm(v, None, cfg)
    if not int8:
        return k, v, None, None
    (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
    return k, v, ks, vs


def attend_in_place(q, cache: KVCache, src: int, slots, q_pos, k_pos, window, scale: float, dtype,
                    kv_len: int, kernel: str = "xla") -> jax.Array:
    """Attention of each batch row over its own cache row of layer `src`, read in place (the row's new K/V are
    already written).

    Args:
      q: [B, C, N, D]; q_pos: [B, C] (-1 = padding).
      cache, src: the KV cache and the layer whose arrays are read.
      k_pos: sliding layers: [B, R] positions held by each row's ring (`write_in_place`; decode only, C == 1);
        full layers: None - index = position, and a row reads keys [0, its last valid position] only
        (`_attend_blocks`), never beyond the static bound kv_len.
      slots: [B] cache rows (None: row b is slot b).
      window, scale: as in `attend`; dtype: the activation dtype (int8 K/V are dequantized to it).
      kernel: "auto": "pallas" when B x kv_len reaches `PALLAS_AUTO_KEYS`, else "xla" (the caller keeps "auto"
        to one TPU: `resolve_attention_kernel`). "pallas-full": "pallas" for full layers, "xla" for sliding
        rings (a benchmark's variant, to measure the kernel on the layers whose K/V it streams).
        "pallas": a step of at most `PALLAS_MAX_QUERIES` queries per
        row (a decode step, a verify step's drafts, a short prompt chunk; a sliding ring only at one query per
        row), with K/V not int8, runs
        `numerics.decode_attention` on a TPU (`ModelConfig.attention_kernel`); otherwise, and on other
        backends, the loop below. "pallas-interpret": the same calls of the kernel in Pallas's interpreter on any
        backend (how the CPU tests run whole models through it).
    Returns:
      [B, C, N*D], as `attend`.

    A `lax.map` over the batch rows, each reading dynamic slices of its cache row (contiguous, not copied).
    Gathering the batch's rows instead copies them (on XLA CPU a copy costs several reads), and attending over
    every cache row in place wastes the idle rows; one slice per row was the fastest of the three in both KV
    buckets measured (figures: docs/performance.md).
    """
    rows = _batch_rows(slots, q.shape[0])
    arrays = (cache.k[src], cache.v[src], cache.k_scale[src], cache.v_scale[src])
    if kernel == "auto":
        kernel = "pallas" if q.shape[0] * kv_len >= PALLAS_AUTO_KEYS else "xla"
    elif kernel == "pallas-full":  # the kernel for full layers only: a ring's few keys stay on XLA's loop
        kernel = "pallas" if k_pos is None else "xla"
    fits = (q.shape[1] <= PALLAS_MAX_QUERIES and (k_pos is None or q.shape[1] == 1) and arrays[2] is None
            and _pallas_fits(arrays[0], k_pos))
    if kernel == "pallas" and fits:
        xla = lambda q: attend_in_place(q, cache, src, slots, q_pos, k_pos, window, scale, dtype, kv_len)
        tpu = lambda q: _attend_pallas(q, arrays[0], arrays[1], rows, q_pos, k_pos, window, scale, kv_len)
        return lax.platform_dependent(q, tpu=tpu, default=xla)
    if kernel == "pallas-interpret" and fits:
        return _attend_pallas(q, arrays[0], arrays[1], rows, q_pos, k_pos, window, scale, kv_len, interpret=True)
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


# The Pallas decode kernel's limits: a full layer's key block at least one lane tile long (a cache length whose
# largest power-of-two divisor up to KEY_BLOCK is smaller would mean tiny blocks, thousands of grid steps), and a
# ring, read as one block, at most this many bytes per K or V array (it is double-buffered in VMEM, whose default
# scoped size on a TPU v5e is 16 MiB). Outside them the XLA loop serves.
PALLAS_MIN_BLOCK = 128
PALLAS_RING_BYTES = 2 << 20
#: The most queries per row the kernel takes (unrolled in it): a decode step's one, a verify step's drafted
#: positions, a prompt chunk of at most this many tokens (a short tail chunk); longer chunks keep the XLA loop.
PALLAS_MAX_QUERIES = 16
#: "auto" runs the kernel for a step whose rows x KV bucket reach this many keys and XLA's loop below it: on one
#: TPU v5e, Gemma 4 E2B's whole decode step through the kernel took 1.62x / 1.29x XLA's at 8K x 1 and 8 rows and
#: 1.12x at 2K x 64 (2^17 keys), but 0.74x at 8K x 32 and 0.77x / 0.57x at 2K x 128 / 256 (2^18 keys and past;
#: docs/performance.md, "Eighteenth session on the chip"). Those steps still copied each full layer's whole cache
#: to bit-cast a uint16 store for the kernel (~4.9 ms per E2B step at 8K, "Nineteenth session on the chip"), gone
#: with the bfloat16 store off CPU: the limit is to be measured again without it.
PALLAS_AUTO_KEYS = 1 << 18


def resolve_attention_kernel(kernel: str, backend: str, tensor_parallel: int = 1) -> str:
    """The worker's `ModelConfig.attention_kernel` from its `--attention-kernel` flag.

    "auto" stays "auto" (the kernel for large steps, `PALLAS_AUTO_KEYS`) on one TPU and becomes "xla" on any
    other backend or a mesh, so that a CPU's or GPU's programs are exactly those of "xla" (same traces, same
    executable-cache keys). "xla" and "pallas" pass through (the caller refuses "pallas" with a mesh).

    Raises:
      ValueError: an unknown kernel name.
    """
    if kernel not in ("auto", "xla", "pallas", "pallas-full", "pallas-interpret"):
        raise ValueError(f"unknown attention kernel {kernel!r} (auto, xla, pallas or pallas-full)")
    if kernel == "auto" and (backend != "tpu" or tensor_parallel > 1):
        return "xla"
    return kernel


def _pallas_fits(keys: jax.Array, k_pos) -> bool:
    """Whether `_attend_pallas` takes a layer whose cache array is `keys` [S, L, K, D] (static shapes)."""
    S, L, K, D = keys.shape
    if k_pos is None:
        return _pow2_divisor(L, KEY_BLOCK) >= PALLAS_MIN_BLOCK
    return L * K * D * keys.dtype.itemsize <= PALLAS_RING_BYTES


def _attend_pallas(q, keys, values, rows, q_pos, k_pos, window, scale: float, kv_len: int,
                   interpret: bool = False) -> jax.Array:
    """`attend_in_place` for a decode or verify step (q [B, C, N, D], C <= `PALLAS_MAX_QUERIES`; a ring only with
    C == 1) through the Pallas kernel: [B, C, N*D] in q.dtype. Key blocks: a full layer's as the loop's
    (`KEY_BLOCK` within the KV bucket); a ring in one block (a ring of W + slack positions is small, and its
    positions' block must be a multiple of 128 lanes or the whole ring)."""
    B, C, N, D = q.shape
    L = keys.shape[1]
    keys, values = (dequantize_kv(a, None, q.dtype) for a in (keys, values))  # a bfloat16 store's bits (uint16)
    if k_pos is None:
        block = _pow2_divisor(L, KEY_BLOCK)
        bound = -(-min(kv_len, L) // block)
    else:
        block, bound = L, None
    out = decode_attention(q, keys, values, rows, q_pos, k_pos, scale=scale, window=window, block=block,
                           num_blocks=bound, interpret=interpret)
    return out.reshape(B, C, N * D)


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
        p = elementwise.exp(s - m_new[..., None])
        fix = elementwise.exp(m - m_new)
        pv = jnp.einsum("kgct,tkd->kgcd", p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
        return m_new, l * fix + jnp.sum(p, axis=-1), acc * fix[..., None] + pv

    G = N // K
    init = (jnp.full((K, G, C), MASK_VALUE, jnp.float32), jnp.zeros((K, G, C), jnp.float32),
            jnp.zeros((K, G, C, D), jnp.float32))
    _, l, acc = lax.fori_loop(0, blocks, body, init)
    out = (acc / l[..., None]).astype(q.dtype)  # [K, G, C, D]
    return out.transpose(2, 0, 1, 3).reshape(C, N * D)


# ----- batch-invariant attention (`ModelConfig.batch_invariant`) -----------------------------------------------------
# Every query's attention is the same sequence of operations whatever chunk, batch or program computes it: keys are
# visited in blocks aligned to absolute positions (block b holds positions [b * T0, (b + 1) * T0), in position order
# within the block), in ascending order, with an online softmax; scores and P·V are bfloat16 products with float32
# sums on a row count that is a multiple of `quant.GEMM_ROW_MULTIPLE` (for which XLA CPU's bfloat16 GEMM computes
# each output row independently of the other rows: tests/model_worker/test_batch_invariance.py pins it), and the softmax denominator is one more column of the P·V
# product (a sum of the same rounded probabilities, not a separate reduction). Blocks that hold no visible key
# change nothing bit for bit: before the first visible block they are erased by the rescale exp(-1e30 - m) = 0,
# after it they add exact zeros with a rescale of exactly 1. So the result depends only on the visible keys.


def _block_step(carry, q, keys, vals, k_pos, q_pos, window, scale):
    """One key block of the batch-invariant online softmax.

    Args:
      carry: (m [K, G, C], acc [K, G, C, D + 1]) float32: running max and unnormalized output whose last column
        is the running denominator.
      q: [C, K, G, D] bfloat16; keys, vals: [T0, K, D] float; k_pos: [T0] positions held (a key is visible iff its
        position is in the query's causal window); q_pos: [C].
    """
    m, acc = carry
    s = jnp.einsum("ckgd,tkd->kgct", q, keys.astype(jnp.bfloat16), preferred_element_type=jnp.float32) * scale
    visible = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] >= 0)
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = elementwise.exp(s - m_new[..., None]).astype(jnp.bfloat16)
    ones = jnp.ones(vals.shape[:-1] + (1,), jnp.bfloat16)
    v_ext = jnp.concatenate([vals.astype(jnp.bfloat16), ones], axis=-1)  # [T0, K, D + 1]
    pv = jnp.einsum("kgct,tkd->kgcd", p, v_ext, preferred_element_type=jnp.float32)
    return m_new, acc * elementwise.exp(m - m_new)[..., None] + pv


def attend_position_blocks(q, read_block, q_pos, first: jax.Array, count: jax.Array, block: int, kv_heads: int,
                           window, scale: float, dtype) -> jax.Array:
    """One batch row's batch-invariant attention (see the comment above).

    Args:
      q: [C, N, D] queries; q_pos: [C] int32 positions (-1 = padding).
      read_block: b -> (keys [T0, K, D], values [T0, K, D], k_pos [T0]) for position block b (k_pos: the position
        each entry holds, negative = empty; entries holding other positions are masked by position).
      first, count: int32 scalars, the blocks [first, first + count) visited (any superset of the visible ones).
      block: T0; kv_heads: K.
    Returns:
      [C, N*D] in `dtype`.
    """
    C, N, D = q.shape
    K = kv_heads
    G = N // K
    pad = gemm_row_pad(C)  # C * G GEMM rows, a multiple of GEMM_ROW_MULTIPLE whatever G
    qb = jnp.pad(q.astype(jnp.bfloat16), ((0, pad), (0, 0), (0, 0))).reshape(C + pad, K, G, D)
    qp = jnp.pad(q_pos, (0, pad), constant_values=-1)

    def body(b, carry):
        keys, vals, k_pos = read_block(b)
        # Only the block's own positions: a ring row can hold a later lap's key at the same index.
        k_pos = jnp.where((k_pos >= b * block) & (k_pos < (b + 1) * block), k_pos, -1)
        return _block_step(carry, qb, keys, vals, k_pos, qp, window, scale)

    init = (jnp.full((K, G, C + pad), MASK_VALUE, jnp.float32), jnp.zeros((K, G, C + pad, D + 1), jnp.float32))
    _, acc = lax.fori_loop(first, first + count, body, init)
    out = (acc[..., :D] / acc[..., D:]).astype(dtype)  # [K, G, C, D]
    return out.transpose(2, 0, 1, 3).reshape(C + pad, N * D)[:C]


def attend_rows_position_blocks(q, read_block, q_pos, first: jax.Array, count: jax.Array, block: int,
                                kv_heads: int, window, scale: float, dtype) -> jax.Array:
    """`attend_position_blocks` of every batch row in one loop: step j visits block first[r] + j of each row r, for
    j < max(count). A row's blocks past its own count hold no key it can see (later positions than its queries),
    so they are exact no-ops (see the comment above) and each row's result is the one `attend_position_blocks`
    gives it alone; one loop for the batch instead of one per row saves the loop's fixed cost per block and row
    (most of a decode step's attention time on XLA CPU: docs/performance.md).

    Args:
      q: [B, C, N, D] queries; q_pos: [B, C] int32 positions (-1 = padding).
      read_block: b [B] int32 -> (keys [B, T0, K, D], values [B, T0, K, D], k_pos [B, T0]) of block b[r] of each
        row (k_pos: the position each entry holds, negative = empty).
      first, count: [B] int32, each row's blocks [first, first + count) (any superset of its visible ones).
      block: T0; kv_heads: K.
    Returns:
      [B, C, N*D] in `dtype`.
    """
    B, C, N, D = q.shape
    K = kv_heads
    G = N // K
    pad = gemm_row_pad(C)  # C * G GEMM rows per batch row, a multiple of GEMM_ROW_MULTIPLE whatever G
    qb = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, C + pad, K, G, D)
    qp = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
    step = jax.vmap(lambda carry, q, keys, vals, k_pos, q_pos: _block_step(carry, q, keys, vals, k_pos, q_pos,
                                                                            window, scale))

    def body(j, carry):
        b = first + j
        keys, vals, k_pos = read_block(b)
        lo, hi = (b * block)[:, None], ((b + 1) * block)[:, None]
        k_pos = jnp.where((k_pos >= lo) & (k_pos < hi), k_pos, -1)  # only the block's own positions, as alone
        return step(carry, qb, keys, vals, k_pos, qp)

    init = (jnp.full((B, K, G, C + pad), MASK_VALUE, jnp.float32),
            jnp.zeros((B, K, G, C + pad, D + 1), jnp.float32))
    _, acc = lax.fori_loop(0, jnp.max(count), body, init)
    out = (acc[..., :D] / acc[..., D:]).astype(dtype)  # [B, K, G, C + pad, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, C + pad, N * D)[:, :C]


def _blocks_of(q_pos: jax.Array, block: int, window: int | None, limit: int) -> tuple[jax.Array, jax.Array]:
    """(first, count) of the position blocks that can hold a key visible to queries at q_pos ([C], -1 = padding):
    from the block of the earliest query's window start (0 without a window) to the latest query's block, at most
    `limit` blocks."""
    valid = q_pos >= 0
    hi = jnp.max(jnp.where(valid, q_pos, 0))
    lo = jnp.min(jnp.where(valid, q_pos, hi))
    first = jnp.maximum(lo - window + 1, 0) // block if window is not None else jnp.int32(0)
    count = jnp.minimum(hi // block - first + 1, limit)
    return first.astype(jnp.int32), count.astype(jnp.int32)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    block = cap
    while n % block:
        block //= 2
    return block


def attend_invariant(q, st: BatchKV, source: tuple, cache: KVCache, src: int, window, scale: float, dtype,
                     kv_len: int) -> jax.Array:
    """Batch-invariant attention of a batch's queries: a decode step's rows read in place in one loop over key
    blocks (`attend_rows_position_blocks`), a prompt chunk's row over its gathered ring and keys
    (`attend_position_blocks`); each row's result is the same either way.

    Args:
      q: [B, C, N, D]; st: the batch (positions, start, slots).
      source: the layer's `BatchKV.sources` entry (keys, values, k_pos, in place): keys/values [B, R + C, K, D]
        gathered ring + chunk with k_pos [B, R + C] (a sliding chunk), or the cache read in place: k_pos [B, R]
        for a sliding ring, None for a full layer.
      cache, src: the KV cache and the KV-source layer (in-place reads).
      kv_len: static; full layers read positions [0, kv_len) at most.
    Returns:
      [B, C, N*D] in `dtype`.
    """
    if cache.k[src].dtype == BF16_BITS:  # bfloat16 K/V: on CPU the fixed-arithmetic kernel (or its twin)
        fixed = lambda q: _attend_fixed(q, st, source, cache, src, window, scale, dtype, kv_len)
        xla = lambda q: _attend_xla(q, st, source, cache, src, window, scale, dtype, kv_len)
        return lax.platform_dependent(q, cpu=fixed, default=xla)
    return _attend_xla(q, st, source, cache, src, window, scale, dtype, kv_len)


def _attend_fixed(q, st: BatchKV, source: tuple, cache: KVCache, src: int, window, scale: float, dtype,
                  kv_len: int) -> jax.Array:
    """`attend_invariant` on CPU with bfloat16 K/V: `block_attention` (one kernel call per layer and batch, the
    same position blocks and visibility as `_attend_xla`, its own fixed arithmetic)."""
    keys, vals, k_pos, in_place = source
    B, C, N, D = q.shape
    rows = _batch_rows(st.slots, B)
    qb = lax.bitcast_convert_type(q.astype(jnp.bfloat16), BF16_BITS)
    static = {"scale": scale, "window": window}
    zeros = jnp.zeros((B,), jnp.int32)
    if in_place and k_pos is None:  # a full layer: index = position
        T = cache.k[src].shape[1]
        block = _pow2_divisor(T, KEY_BLOCK)
        first, count = jax.vmap(lambda qp: _blocks_of(qp, block, None, -(-min(kv_len, T) // block)))(st.positions)
        out = block_attention(qb, st.positions, cache.k[src], cache.v[src], rows, None, zeros, first, count,
                              mode=FULL, block=block, **static)
    elif in_place:  # a sliding ring (decode)
        R = k_pos.shape[1]
        block = _pow2_divisor(R, 256)
        first, count = jax.vmap(lambda qp: _blocks_of(qp, block, window, R // block + 1))(st.positions)
        out = block_attention(qb, st.positions, cache.k[src], cache.v[src], rows, k_pos, zeros, first, count,
                              mode=RING, block=block, ring=R, **static)
    else:  # a sliding chunk over its gathered ring + its own keys
        R = cache.k[src].shape[1]
        L = keys.shape[1]
        block = _pow2_divisor(R, 256)
        first, count = jax.vmap(lambda qp: _blocks_of(qp, block, window, L // block + 2))(st.positions)
        as_bits = lambda x: lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
        out = block_attention(qb, st.positions, as_bits(keys), as_bits(vals), jnp.arange(B, dtype=jnp.int32), k_pos,
                              st.start, first, count, mode=CHUNK, block=block, ring=R, **static)
    return (out[..., :D] / out[..., D:]).astype(dtype).reshape(B, C, N * D)


def _attend_xla(q, st: BatchKV, source: tuple, cache: KVCache, src: int, window, scale: float, dtype,
                kv_len: int) -> jax.Array:
    """`attend_invariant` with XLA's bfloat16 dots (TPU/GPU, and int8 K/V)."""
    keys, vals, k_pos, in_place = source
    rows = _batch_rows(st.slots, q.shape[0])
    arrays = (cache.k[src], cache.v[src], cache.k_scale[src], cache.v_scale[src])
    K = arrays[0].shape[2]

    def sliced(row, start, length):
        return tuple(None if a is None else lax.dynamic_slice(a, (row, start) + (0,) * (a.ndim - 2),
                                                              (1, length) + a.shape[2:])[0] for a in arrays)

    if in_place and k_pos is None:  # a full layer: index = position
        T = arrays[0].shape[1]
        block = _pow2_divisor(T, KEY_BLOCK)
        limit = -(-min(kv_len, T) // block)

        def read(row, b):
            k, v, ks, vs = sliced(row, b * block, block)
            return dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype), b * block + jnp.arange(block)

        first, count = jax.vmap(lambda qp: _blocks_of(qp, block, None, limit))(st.positions)
        return attend_rows_position_blocks(q, lambda b: jax.vmap(read)(rows, b), st.positions, first, count, block,
                                           K, window, scale, dtype)
    if in_place:  # a sliding ring (decode)
        R = k_pos.shape[1]
        block = _pow2_divisor(R, 256)  # a position block is then a contiguous run of ring indices

        def read(row, kp, b):
            at = (b * block) % R
            k, v, ks, vs = sliced(row, at, block)
            return dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype), lax.dynamic_slice(kp, (at,), (block,))

        first, count = jax.vmap(lambda qp: _blocks_of(qp, block, window, R // block + 1))(st.positions)
        return attend_rows_position_blocks(q, lambda b: jax.vmap(read)(rows, k_pos, b), st.positions, first, count,
                                           block, K, window, scale, dtype)
    # A sliding chunk over its gathered ring + its own keys (the queries may be fewer than the chunk's keys: KV-shared
    # layers compute only the rows whose logits are wanted).
    R = arrays[0].shape[1]
    C = keys.shape[1] - R
    block = _pow2_divisor(R, 256)  # a position block is then a contiguous run of ring indices

    def chunk(args):
        qb, kb, vb, kp, qp, start = args

        def read(b):
            pos = b * block + jnp.arange(block, dtype=jnp.int32)
            idx = jnp.where(pos >= start, R + pos - start, pos % R)
            ok = pos < start + C
            idx = jnp.where(ok, idx, 0)
            return (jnp.take(kb, idx, axis=0), jnp.take(vb, idx, axis=0), jnp.where(ok, jnp.take(kp, idx), -1))

        first, count = _blocks_of(qp, block, window, (R + C) // block + 2)
        return attend_position_blocks(qb, read, qp, first, count, block, K, window, scale, dtype)

    return lax.map(chunk, (q, keys, vals, k_pos, st.positions, st.start))
