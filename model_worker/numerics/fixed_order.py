"""Sums in one fixed order, whatever the shape of the array they are part of: the building block of the
batch-invariant norms (`layers.rms_norm`) and of the block-int8 product's epilogue (`q8`, and its CPU kernel,
which repeats this tree in C++)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fixed_order_sum(x: jax.Array) -> jax.Array:
    """Σ over the last axis as a fixed tree of elementwise adds (halves added pairwise; an odd element joins the
    last pair): [..., n] -> [...] float.

    Why not `jnp.sum`: XLA CPU's reduction orders its terms differently for different shapes of the whole array
    (a [4, 1, 640] and a [4, 64, 640] sum of squares differ in the last bit for the same row), which would make a
    row's norm depend on the rows computed with it. Elementwise adds have one order, whatever the shape.
    """
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        y = x[..., :half] + x[..., half:2 * half]
        if n % 2:
            y = jnp.concatenate([y[..., :-1], y[..., -1:] + x[..., 2 * half:]], axis=-1)
        x = y
    return x[..., 0]

