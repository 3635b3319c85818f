"""Weights that stay quantized on the device, and the one `linear` every projection goes through.

compressed-tensors `pack-quantized` W4A16 (formats.md §1): a Linear weight W [N_out, K_in] is stored as int32
words packing 8 signed 4-bit values along the input axis (value k of a row lives in word k // 8, bits
4*(k % 8)..4*(k % 8)+3, stored as q + 8), with one scale (and, when asymmetric, one zero point) per group of G
input columns: W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]. The packed words are what stays resident;
`linear` unpacks and scales them inside the jitted step, so no dequantized copy of a weight outlives its matmul.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int4Weight:
    """A group-quantized int4 Linear weight in compressed-tensors layout.

    Attributes:
      packed: int32 [N, ceil(K/8)], 8 nibbles per word, natural (sequential) column order, nibble = q + 8.
      scale: [N, K/G] float (the compute dtype).
      zero: int8 [N, K/G] signed zero point in [-8, 7], or None when symmetric.
      in_features: K (static).
      group_size: G (static).
    """

    packed: jax.Array
    scale: jax.Array
    zero: jax.Array | None
    in_features: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def out_features(self) -> int:
        """N."""
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        """Resident bytes (packed words, scales and zero points)."""
        return int(sum(x.nbytes for x in (self.packed, self.scale, self.zero) if x is not None))


def unpack_int4(packed: jax.Array, in_features: int) -> jax.Array:
    """int32 [N, ceil(K/8)] -> int8 [N, K] signed values q in [-8, 7], columns in natural order.

    Nibble j of word w is column 8w + j: stacking the 8 shifted planes on a new last axis and flattening keeps that
    order (concatenating the planes instead would give the plane-major order [0, 8, 16, ..., 1, 9, ...], the
    silent-corruption bug of formats.md §1.5).
    """
    shifts = jnp.arange(8, dtype=jnp.int32) * 4
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [N, K/8, 8]
    q = nibbles.reshape(packed.shape[0], -1)[:, :in_features]
    return (q - 8).astype(jnp.int8)


def dequantize(w: Int4Weight, dtype: jnp.dtype) -> jax.Array:
    """Int4Weight -> dense [N, K] in `dtype` (inside a jitted function this is a temporary)."""
    q = unpack_int4(w.packed, w.in_features).astype(jnp.float32)
    groups = q.reshape(q.shape[0], -1, w.group_size)
    if w.zero is not None:
        groups = groups - w.zero.astype(jnp.float32)[:, :, None]
    dense = groups * w.scale.astype(jnp.float32)[:, :, None]
    return dense.reshape(q.shape).astype(dtype)


def linear(x: jax.Array, w: jax.Array | Int4Weight) -> jax.Array:
    """y = x W for a dense weight stored [in, out], or x Wᵀ for an Int4Weight stored [out, in] (HF layout).

    Args:
      x: [..., K] activations.
      w: dense [K, N] array, or Int4Weight with in_features K.
    Returns:
      [..., N] in x.dtype.
    """
    if isinstance(w, Int4Weight):
        return jnp.einsum("...k,nk->...n", x, dequantize(w, x.dtype))
    return x @ w
