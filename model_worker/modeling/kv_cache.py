"""The batched KV cache: a pytree with one row per decode slot.

Layout (S = slots, T = max_model_len, W = sliding window, K = KV heads, D = head dim of the layer):
  * a full-attention layer keeps every position: `[S, T, K, D]`, position p stored at index p;
  * a sliding layer keeps a ring of the last R >= W positions: `[S, R, K, D]`, position p stored at index p % R.
    R = W + slack: the slack keeps up to `slack` positions beyond the window, so a new prompt that shares a slot's
    tokens up to a point at most `slack` + 1 positions back can reuse the slot exactly (prefix reuse);
  * a KV-shared layer (Gemma 4) owns nothing (None) and reads its source layer's arrays.

Positions are logical: the ring index and the masks are derived from a token's position in its sequence, never
from where it sits in a padded batch. The cache holds no lengths: the caller passes each row's positions, and the
ring's contents follow from the position of the first token of the chunk (`ring_positions`).
The engine owns the one live instance and donates it to every jitted step.

Below the pytree: int8 storage (`quantize_kv`), and the writes of a forward pass (`write_in_place` before a
layer's reads, `write_rings` after the last layer's), ordered so that XLA updates the donated arrays in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from model_worker.modeling.config import LayerSpec, ModelConfig
from model_worker.numerics.quant import zero_from


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer K and V arrays (None for layers that own no cache).

    Attributes:
      k: per layer, `[S, T, K, D]` (full) or `[S, W, K, D]` (sliding) or None; the compute dtype, or int8.
      v: same shapes as `k`.
      k_scale, v_scale: with int8 storage, float32 `[S, T, K]` / `[S, W, K]`: one scale per stored token and KV
        head (x ≈ q * scale, scale = max|x| / 127 over the head dim); otherwise None per layer.
    """

    k: list[jax.Array | None]
    v: list[jax.Array | None]
    k_scale: list[jax.Array | None]
    v_scale: list[jax.Array | None]

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored as int8 with per-token, per-head scales."""
        return any(s is not None for s in self.k_scale)

    @staticmethod
    def shapes(cfg: ModelConfig, num_slots: int, max_len: int, slack: int = 0) -> list[tuple[int, ...] | None]:
        """Shape of each layer's K (and V) array, None for layers without their own cache."""
        out: list[tuple[int, ...] | None] = []
        for i, spec in enumerate(cfg.layers):
            if spec.kv_source != i:
                out.append(None)
            else:
                length = max_len if spec.attention == "full" else min(cfg.sliding_window + slack, max_len)
                out.append((num_slots, length, spec.num_kv_heads, spec.head_dim))
        return out

    @classmethod
    def zeros(
        cls, cfg: ModelConfig, num_slots: int, max_len: int, dtype: jnp.dtype, int8: bool = False, slack: int = 0,
        bf16_bits: bool = True,
    ) -> KVCache:
        """An all-zero cache for `num_slots` sequences of up to `max_len` positions (stored as `storage_dtype`:
        int8 + scales if `int8`, a bfloat16 store as its bits with `bf16_bits`; sliding rings of window + `slack`
        positions)."""
        shapes = cls.shapes(cfg, num_slots, max_len, slack)
        store = storage_dtype(cfg, dtype, int8, bf16_bits)
        k = [None if s is None else jnp.zeros(s, store) for s in shapes]
        v = [None if s is None else jnp.zeros(s, store) for s in shapes]
        k_scale = [None if s is None or not int8 else jnp.zeros(s[:-1], jnp.float32) for s in shapes]
        v_scale = [None if s is None or not int8 else jnp.zeros(s[:-1], jnp.float32) for s in shapes]
        return cls(k=k, v=v, k_scale=k_scale, v_scale=v_scale)

    def nbytes(self) -> int:
        """Bytes held by the cache arrays."""
        return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(self)))


# ----- storing and writing K/V ----------------------------------------------------------------------------------
def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> (int8 [..., D], float32 scale [...]): symmetric, one scale per vector, scale = max|x| / 127."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.maximum(amax, 1e-30) / 127.0
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """Inverse of quantize_kv; with no scale, the stored K or V as a float array: bfloat16 bit patterns (uint16,
    see `storage_dtype`) as bfloat16, any float store unchanged."""
    if scale is None:
        return lax.bitcast_convert_type(q, jnp.bfloat16) if q.dtype == BF16_BITS else q
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


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


def write_indexed(cache: jax.Array | None, new: jax.Array, index: jax.Array, slots: jax.Array | None):
    """Scatter new K or V ([B, C, K, D]) or their scales ([B, C, K]) into a cache array at (slot, index);
    index -1 (padding) is dropped. None stays None."""
    if cache is None:
        return None
    B = new.shape[0]
    rows = jnp.arange(B) if slots is None else slots
    where = jnp.where(index >= 0, index, cache.shape[1])  # out of range -> dropped
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


def after_value(x: jax.Array, anchor: jax.Array) -> jax.Array:
    """x itself, made data-dependent on `anchor` (0 derived from it in a way XLA cannot fold: for v = the bits of
    one anchor element, min(v, 0) & max(v, 0) == 0), so ops producing x's consumers wait for the anchor: a cache
    write made to wait for every read of the same buffer is done in place instead of on a copy."""
    zero = zero_from(anchor, x.dtype)
    return x | zero if jnp.issubdtype(x.dtype, jnp.integer) else x + zero


def write_in_place(cache: KVCache, i: int, spec: LayerSpec, new: tuple, positions, start, n_valid, slots):
    """Write a chunk's (k, v, k_scale, v_scale) into layer i's cache rows before any read: full layers at index =
    position; sliding layers (decode only, C == 1) at ring index position % R. Safe for R >= window: position p
    evicts p - R, which the strict window mask (q - W < k) hides anyway. Padding (position -1) writes nothing.

    Args:
      cache: updated in place (its per-layer lists; a trace-local copy in `model.forward_batches`).
      new: [B, C, K, D] k and v (int8 with int8 KV), [B, C, K] float32 scales or None.
      positions: [B, C] int32; start, n_valid: [B] int32 (first position, valid tokens); slots: [B] or None.
    Returns:
      sliding layers: k_pos [B, R] int32, the position held at each ring index of each batch row (negative =
      empty); full layers: None (index = position; `attention.attend_in_place` reads up to the row's position).
    """
    T = cache.k[i].shape[1]
    index = jnp.where(positions >= 0, positions % T, -1) if spec.attention == "sliding" else positions
    for name, value in zip(("k", "v", "k_scale", "v_scale"), new):
        getattr(cache, name)[i] = write_indexed(getattr(cache, name)[i], value, index, slots)
    return ring_positions(start + n_valid, T) if spec.attention == "sliding" else None


def write_rings(cache: KVCache, deferred: list, anchor, positions, start, n_valid, slots) -> None:
    """Apply the sliding layers' ring updates of a chunk (C > 1; decode writes its rings at once, before the reads,
    in `write_in_place`) once every layer has read the rings.

    Writing a ring while a later read of the same buffer is still pending (the read is fused into the attention
    that consumes it, or a KV-shared layer reads it later) makes XLA copy the whole cache array instead of updating
    it in place. Making the written values depend on the final hidden state (`anchor`) orders every write after
    every read. Each valid token goes to ring index position % R (R = the ring length) — a scatter of C entries
    per row when C <= R (no collisions); longer chunks rewrite whole rows with `_update_ring`.

    Args:
      cache: updated in place (its per-layer lists).
      deferred: (layer, the rows' old ring arrays (k, v, k_scale, v_scale), the chunk's (k, v, k_scale, v_scale))
        per sliding layer, from `attention.attention_block`.
      positions: [B, C] int32 the batch's positions (-1 = padding); start, n_valid: [B]; slots: [B] or None.
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
                arrays[i] = write_indexed(arrays[i], after_value(chunk, anchor), ring_idx, slots)
            else:
                rows_value = _update_ring(old, after_value(chunk, anchor), start, n_valid)
                arrays[i] = _set_rows(arrays[i], rows_value, slots)


BF16_BITS = jnp.uint16
"""The store of bfloat16 K/V: their bit patterns. XLA CPU has no in-place bfloat16 scatter: it converts the whole
cache array to float32 and back to write one token, thousands of times the cost of the same uint16 write
(figures: docs/performance.md, "bfloat16 K/V writes on XLA CPU"), so bfloat16 K/V are written and kept as uint16
and bit-cast back on every read (free)."""


def storage_dtype(cfg: ModelConfig, dtype, int8: bool, bf16_bits: bool = True):
    """The dtype K and V are stored in: int8 with `int8`; bfloat16 when `cfg.batch_invariant` (its attention reads
    them only as bfloat16, so storing them rounded gives the same results at half the bytes and without a
    conversion per read) or when the activations are bfloat16; else the activation dtype. A bfloat16 store is
    `BF16_BITS` (its bit patterns) with `bf16_bits`, which XLA CPU needs (see `BF16_BITS`), and bfloat16 itself
    without: off CPU (`Engine` passes the platform's choice) an accelerator writes bfloat16 in place natively, and
    a uint16 store would make XLA copy a whole cache array per layer and step into the Pallas attention kernel
    to bit-cast it (the bit cast is not a free view at a custom call's operand: docs/performance.md, "Nineteenth
    session on the chip"). The stored values are the same bits either way."""
    if int8:
        return jnp.int8
    if cfg.batch_invariant or jnp.dtype(dtype) == jnp.bfloat16:
        return BF16_BITS if bf16_bits else jnp.dtype(jnp.bfloat16)
    return jnp.dtype(dtype)


def to_storage(x: jax.Array, store) -> jax.Array:
    """K or V ([..., D] float) in the cache's dtype `store` (`storage_dtype`; not int8, which `quantize_kv`
    writes): rounded to bfloat16 and bit-cast for `BF16_BITS`, else cast."""
    if jnp.dtype(store) == BF16_BITS:
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    return x.astype(store)
