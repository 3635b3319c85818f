"""Batched token sampling: every row has its own settings, all of them runtime arrays (no recompilation).

Per row: greedy (temperature 0) or temperature sampling restricted by top-k, top-p (nucleus) and min-p. The
random stream of a row depends only on its seed and the index of the token being generated
(`fold_in(key(seed), step)`), never on the batch neighbours or the slot, so a seeded request is reproducible.

Sampling is exact over the whole vocabulary, without a sort (a full sort of 262,144 logits costs ~65 ms per row
on CPU): top-k takes the k-th value from `lax.top_k` (k <= MAX_TOP_K), top-p finds the probability threshold by
bisection, and the token is drawn by inverse-CDF with one uniform number per row. Filters run under `lax.cond`, so
a batch that uses none of them does not pay for them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Largest top_k accepted (lax.top_k needs a static k; validated at the API boundary).
MAX_TOP_K = 1024
# Bisection steps for the top-p threshold: the threshold is found to within max_prob / 2**30.
_TOP_P_ITERS = 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling settings, all shaped [B].

    Attributes:
      temperature: float32; 0 means greedy.
      top_k: int32; 0 disables, otherwise 1..MAX_TOP_K.
      top_p: float32 in (0, 1]; 1 disables.
      min_p: float32 in [0, 1); 0 disables.
      seed: uint32 [B, 2] (low and high words of a 64-bit seed).
      step: int32 index of the token being generated (0 = first generated token).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    step: jax.Array


def _row_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    """One U(0, 1] number for one row from (64-bit seed as two uint32 words, step).

    Excluding 0 matters: inverse-CDF with u = 0 would pick index 0 even when its probability is 0.
    """
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), step)
    return 1.0 - jax.random.uniform(key, dtype=jnp.float32)


def _top_k_filter(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """Keep logits >= the row's k-th largest (all rows with top_k == 0 are unchanged)."""
    vals = jax.lax.top_k(logits, MAX_TOP_K)[0]
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, MAX_TOP_K - 1)[:, None], axis=1)
    keep = (top_k[:, None] <= 0) | (logits >= kth)
    return jnp.where(keep, logits, -jnp.inf)


def _top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p (ties kept together).

    Bisection on the probability threshold t: S(t) = sum of p_i >= t is non-increasing; find the largest t with
    S(t) >= top_p.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    lo = jnp.zeros(logits.shape[0], jnp.float32)
    hi = jnp.max(probs, axis=-1)

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        mass = jnp.sum(jnp.where(probs >= mid[:, None], probs, 0.0), axis=-1)
        ok = mass >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _TOP_P_ITERS, body, (lo, hi))
    keep = (top_p[:, None] >= 1.0) | (probs >= lo[:, None])
    return jnp.where(keep, logits, -jnp.inf)


def _min_p_filter(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Keep tokens with probability >= min_p * (top probability), i.e. logit >= max + log(min_p)."""
    floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    keep = (min_p[:, None] <= 0.0) | (logits >= floor)
    return jnp.where(keep, logits, -jnp.inf)


def _argmax(logits: jax.Array) -> jax.Array:
    """First index of the row maximum (lax.top_k is much faster than argmax on XLA CPU)."""
    return jax.lax.top_k(logits, 1)[1][:, 0].astype(jnp.int32)


def sample(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """Choose one token per row.

    Args:
      logits: [B, V] float32.
      s: per-row settings.
    Returns:
      tokens [B] int32, and logprobs [B] float32: log_softmax(logits) of the chosen token (the model's
      distribution, before temperature and filters).
    """
    greedy = _argmax(logits)
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    sampled_rows = s.temperature > 0
    scaled = jax.lax.cond(
        jnp.any(sampled_rows & (s.top_k > 0)), _top_k_filter, lambda x, _: x, scaled, s.top_k
    )
    scaled = jax.lax.cond(
        jnp.any(sampled_rows & (s.top_p < 1.0)), _top_p_filter, lambda x, _: x, scaled, s.top_p
    )
    scaled = jax.lax.cond(
        jnp.any(sampled_rows & (s.min_p > 0.0)), _min_p_filter, lambda x, _: x, scaled, s.min_p
    )

    def draw(scaled):
        probs = jax.nn.softmax(scaled, axis=-1)
        cdf = jnp.cumsum(probs, axis=-1)
        u = jax.vmap(_row_uniform)(s.seed, s.step)
        idx = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
        return jnp.minimum(idx, logits.shape[-1] - 1)

    drawn = jax.lax.cond(jnp.any(sampled_rows), draw, lambda x: greedy, scaled)
    tokens = jnp.where(sampled_rows, drawn, greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=1)[:, 0]
    return tokens, logprobs
