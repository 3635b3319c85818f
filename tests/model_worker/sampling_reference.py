"""A frozen copy of `model_worker.modeling.sampling`'s `sample` as it stood at commit ed02180 (before the faster
sampler on candidates): the oracle the exactness tests compare the sampler with, bit for bit (tokens, log-probabilities,
top logprobs, mask_empty). Used only by tests; never change it to follow the sampler: a difference is a change of
the draw, which must be versioned (docs/architecture.md, "Sampling").

Version 2 (2026-12-07): top-p's probabilities are exp(x - max) / a fixed-order sum instead of `jax.nn.softmax`,
whose sum XLA CPU ordered by the batch's shape (a row's seeded draw could depend on its neighbours); the only change.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from model_worker.modeling.sampling import PenaltyState, SampleOutput
from model_worker.numerics.fixed_order import fixed_order_sum
from model_worker.serving.sampling_settings import MAX_TOP_K, MAX_TOP_LOGPROBS, SamplingArrays

_TOP_P_ITERS = 30


def _valid_ids_or_oob(ids: jax.Array, vocab: int) -> jax.Array:
    """Map ids outside 0..vocab-1 to vocab, which scatters with mode="drop" skip (negative ids would wrap)."""
    return jnp.where((ids >= 0) & (ids < vocab), ids, vocab)


# --- (a)-(c): processed logits ------------------------------------------------------------------------------


def _skip(x, *_):
    """The identity branch of a `lax.cond`."""
    return x


def _logit_bias(logits: jax.Array, ids: jax.Array, vals: jax.Array) -> jax.Array:
    """logits[b, ids[b, j]] += vals[b, j] for every entry with a valid id (OpenAI logit_bias)."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    return logits.at[rows, _valid_ids_or_oob(ids, logits.shape[-1])].add(vals, mode="drop")


def _repetition_penalty(logits: jax.Array, penalty: jax.Array, seen: jax.Array) -> jax.Array:
    """CTRL / transformers `RepetitionPenaltyLogitsProcessor` over seen tokens: x > 0 -> x / p, else x * p."""
    p = jnp.where(penalty > 0, penalty, 1.0)[:, None]
    penalized = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(seen, penalized, logits)


def _frequency_presence(logits: jax.Array, s: SamplingArrays, counts: jax.Array) -> jax.Array:
    """OpenAI: x[t] -= frequency * count[t], then x[t] -= presence * (count[t] > 0), over generated tokens."""
    logits = logits - s.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - s.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def unpack_mask(mask: jax.Array, vocab: int) -> jax.Array:
    """uint32 [..., ceil(V / 32)] packed words -> bool [..., V] (token 32 * w + b = bit b of word w)."""
    bits = (mask[..., :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(mask.shape[:-1] + (-1,))[..., :vocab].astype(bool)


def _apply_mask(logits: jax.Array, mask: jax.Array, mask_on: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Disallowed tokens -> -inf on rows with mask_on. Returns (logits, mask_empty [B]).

    A row whose mask allows nothing keeps its logits unchanged and is reported in mask_empty.
    """
    allowed = unpack_mask(mask, logits.shape[-1])
    empty = mask_on & ~jnp.any(allowed, axis=-1)
    on = (mask_on & ~empty)[:, None]
    return jnp.where(on & ~allowed, -jnp.inf, logits), empty


def _no_mask(logits, mask, mask_on):
    """The skipped branch of `_apply_mask`."""
    return logits, jnp.zeros(mask_on.shape, bool)


def process_logits(
    logits: jax.Array, s: SamplingArrays, state: PenaltyState
) -> tuple[jax.Array, jax.Array]:
    """Steps (a)-(c): logit bias, repetition / frequency / presence penalties, allowed-token mask.

    Args:
      logits: [B, V] float32 model output.
      s: per-row settings.
      state: [B, V] token history (read only when some row uses a penalty).
    Returns:
      processed logits [B, V] float32 (-inf where masked), and mask_empty bool [B] (see the module docstring).
    """
    uses = _uses(s)
    x = logits.astype(jnp.float32)
    return jax.lax.cond(jnp.any(jnp.stack(uses)), _process, _unprocessed, x, s, state, uses)


def _uses(s: SamplingArrays) -> tuple[jax.Array, ...]:
    """Whether some row uses: logit bias, repetition penalty, frequency / presence penalty, mask (scalars)."""
    return (
        jnp.any(s.bias_ids >= 0),
        jnp.any((s.repetition_penalty != 1.0) & (s.repetition_penalty > 0)),
        jnp.any((s.frequency_penalty != 0) | (s.presence_penalty != 0)),
        jnp.any(s.mask_on),
    )


def _process(x: jax.Array, s: SamplingArrays, state: PenaltyState, uses) -> tuple[jax.Array, jax.Array]:
    """Steps (a)-(c), each under its own `lax.cond`. Returns (processed logits, mask_empty)."""
    bias, rep, freq, mask = uses
    x = jax.lax.cond(bias, _logit_bias, _skip, x, s.bias_ids, s.bias_vals)
    x = jax.lax.cond(rep, _repetition_penalty, _skip, x, s.repetition_penalty, state.seen)
    x = jax.lax.cond(freq, _frequency_presence, _skip, x, s, state.counts)
    return jax.lax.cond(mask, _apply_mask, _no_mask, x, s.mask, s.mask_on)


def _unprocessed(x: jax.Array, s: SamplingArrays, state: PenaltyState, uses) -> tuple[jax.Array, jax.Array]:
    """The branch of `process_logits` when no row uses (a)-(c): a single pass-through."""
    return x, jnp.zeros(x.shape[0], bool)


# --- (d): temperature, truncation, draw ---------------------------------------------------------------------


def _row_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    """One U(0, 1] number for one row from (64-bit seed as two uint32 words, step).

    Excluding 0 matters: inverse-CDF with u = 0 would pick index 0 even when its probability is 0.
    """
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), step)
    return 1.0 - jax.random.uniform(key, dtype=jnp.float32)


def _top_k_filter(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """Keep logits >= the row's k-th largest (ties at the k-th value are all kept; top_k == 0: unchanged)."""
    k_max = min(MAX_TOP_K, logits.shape[-1])
    vals = jax.lax.top_k(logits, k_max)[0]
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, k_max - 1)[:, None], axis=1)
    keep = (top_k[:, None] <= 0) | (logits >= kth)
    return jnp.where(keep, logits, -jnp.inf)


def _top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p (ties kept together).

    Bisection on the probability threshold t: S(t) = sum of p_i >= t is non-increasing; find the largest t
    with S(t) >= top_p.
    """
    # Version 2 of the draw: the probabilities normalized by a fixed-order sum (XLA CPU's fused softmax summed a row
    # in an order that depended on the batch's shape, so a seeded top-p row's threshold moved with its neighbours).
    terms = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = terms / fixed_order_sum(terms)[..., None]
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


#: Values per block of `_argmax`'s search for the first index holding the row maximum.
_ARGMAX_BLOCK = 512


def _argmax(logits: jax.Array, parts: int = 1) -> jax.Array:
    """First index of the row maximum: the row maximum, then the first block of `_ARGMAX_BLOCK` values holding it,
    then the least index within that block holding it (three plain reductions and one [B, block] gather), because
    XLA CPU's argmax (a variadic reduce) and `lax.top_k(x, 1)` (a partial sort) are slow on a [B, 262144] row, and
    so was one `min` over the whole row of "index where the value is the maximum" at 16 rows (17 ms: the blocks
    take 1.2 ms; figures: docs/performance.md, "Sampling"). With the vocabulary split across devices (`parts` > 1)
    XLA splits the reductions by part where a top-k would gather the rows. The index is top_k's for every row of
    numbers, ties included, except that a maximum of zero held as both -0.0 and +0.0 gives the first of them
    (top_k's total order ranks +0.0 higher); a row holding a NaN gets some index in range (which one depends on
    how the backend's max treats NaN): NaN logits are a broken model. `parts` only keeps blocks within a part."""
    B, V = logits.shape
    best = jnp.max(logits, axis=-1, keepdims=True)
    # blocks within a device's part (a vocabulary of whole blocks; tests' small ones: one block)
    L = _ARGMAX_BLOCK if V % (_ARGMAX_BLOCK * parts) == 0 else V
    blocks = logits.reshape(B, V // L, L)
    first = _first_index(jnp.any(blocks == best[:, :, None], axis=-1))  # of [B, V / L]
    first = jnp.minimum(first, V // L - 1)  # a NaN row matches nothing: stay in range
    block = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]  # [B, L]
    return jnp.minimum(first * L + _first_index(block == best), V - 1)


def _inverse_cdf(scaled: jax.Array, s: SamplingArrays, parts: int = 1) -> jax.Array:
    """Draw one token per row from softmax(scaled) with the row's uniform number u (inverse CDF): the first token
    whose cumulative probability reaches u * total, found in two levels instead of a cumulative sum over the whole
    row (XLA CPU's took 10 ms at 16 rows of 262,144; docs/performance.md, "Sampling"): the sums of blocks of
    `_ARGMAX_BLOCK` tokens and their cumulative sum locate the block, one cumulative sum inside it the token. The
    token always has a positive probability: a block or token that only rounding would pick is skipped for the
    last one holding probability. The weights are exp(scaled - row max), unnormalized (u scales their total).
    `parts` (the vocabulary's split across devices) only needs the blocks to lie within a part; the
    [B, V / block] sums are what crosses devices."""
    u = jax.vmap(_row_uniform)(s.seed, s.step)
    B, V = scaled.shape
    L = _ARGMAX_BLOCK if V % (_ARGMAX_BLOCK * parts) == 0 else V
    n = V // L
    best = jnp.max(scaled, axis=-1, keepdims=True)
    blocks = scaled.reshape(B, n, L)
    sums = jnp.sum(jnp.exp(blocks - best[:, :, None]), axis=-1)  # [B, n]: unnormalized, u scales the total
    cdf = jnp.cumsum(sums, axis=-1)
    target = u * cdf[:, -1]
    b = _first_or_last(cdf >= target[:, None], sums > 0)
    before = jnp.where(b[:, None] > 0, jnp.take_along_axis(cdf, jnp.maximum(b - 1, 0)[:, None], axis=1), 0.0)
    block = jnp.exp(jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0] - best)  # [B, L]
    lane = _first_or_last(before + jnp.cumsum(block, axis=-1) >= target[:, None], block > 0)
    return b * L + lane


def _first_index(flags: jax.Array) -> jax.Array:
    """Per row of [B, n] flags: the first index that is set, n if none -> int32 [B]."""
    n = flags.shape[-1]
    return jnp.min(jnp.where(flags, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _first_or_last(reached: jax.Array, held: jax.Array) -> jax.Array:
    """Per row of [B, n] flags: the first index where `reached` and `held` hold, else the last where `held` does
    (0 if none) -> int32 [B]."""
    n = reached.shape[-1]
    first = _first_index(reached & held)
    last = jnp.max(jnp.where(held, jnp.arange(n, dtype=jnp.int32), 0), axis=-1)
    return jnp.where(first < n, first, last)


def _draw(x: jax.Array, s: SamplingArrays, greedy: jax.Array, parts: int = 1) -> jax.Array:
    """Step (d) for the sampled rows (temperature > 0): temperature, min-p, top-k, top-p, inverse-CDF draw.

    Rows with temperature 0 get `greedy`. Each filter runs only when some sampled row uses it. `parts`: the
    vocabulary's split across devices (module docstring).
    """
    sampled = s.temperature > 0
    scaled = x / jnp.maximum(s.temperature, 1e-6)[:, None]
    scaled = jax.lax.cond(jnp.any(sampled & (s.min_p > 0.0)), _min_p_filter, _skip, scaled, s.min_p)
    scaled = jax.lax.cond(jnp.any(sampled & (s.top_k > 0)), _top_k_filter, _skip, scaled, s.top_k)
    scaled = jax.lax.cond(jnp.any(sampled & (s.top_p < 1.0)), _top_p_filter, _skip, scaled, s.top_p)
    draw = functools.partial(_inverse_cdf, parts=parts)
    drawn = jax.lax.cond(jnp.any(sampled), draw, lambda *_: greedy, scaled, s)
    return jnp.where(sampled, drawn, greedy)


# --- log-probabilities --------------------------------------------------------------------------------------


def _top_logprobs(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The n[b] most likely tokens of log_softmax(x) per row: (ids, logprobs), [B, MAX_TOP_LOGPROBS] each (the
    largest logits, their log-probabilities from `_log_probs`, as the chosen token's).

    Entries past n[b], and tokens with probability 0, are (-1, 0.0).
    """
    vals, ids = jax.lax.top_k(x, min(MAX_TOP_LOGPROBS, x.shape[-1]))
    vals = _log_probs(x, vals)
    pad = ((0, 0), (0, MAX_TOP_LOGPROBS - vals.shape[-1]))  # only for a vocabulary smaller than 20 (tests)
    vals, ids = jnp.pad(vals, pad, constant_values=-jnp.inf), jnp.pad(ids, pad, constant_values=-1)
    keep = (jnp.arange(MAX_TOP_LOGPROBS)[None, :] < n[:, None]) & jnp.isfinite(vals)
    return jnp.where(keep, ids, -1).astype(jnp.int32), jnp.where(keep, vals, 0.0)


def _no_top_logprobs(x: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The skipped branch of `_top_logprobs`: every entry (-1, 0.0)."""
    shape = (x.shape[0], MAX_TOP_LOGPROBS)
    return jnp.full(shape, -1, jnp.int32), jnp.zeros(shape, jnp.float32)


def _log_probs(x: jax.Array, values: jax.Array) -> jax.Array:
    """log_softmax(x) at some of each row's logits: x [B, V], values [B, n] taken from x -> float32 [B, n], as
    `jax.nn.log_softmax` computes it ((value - row max) - log(sum(exp(x - row max)))) without writing the [B, V]
    result: XLA CPU fused that and a gather of its row into a program that took 19 ms at 16 rows, against 4 ms for
    the row sums alone (docs/performance.md, "Sampling"). The chosen token and the top logprobs both use it, so a
    chosen token that is also a top alternative has bit-identical log-probabilities.

    The row sum: XLA CPU's sums a row alike in every batch shape (tests/model_worker/test_sampling.py); a TPU's
    ordered its terms by the batch's shape (a row's log-probability moved by one ulp with its neighbours, seen on
    a v5e), so off CPU it is `fixed_order.fixed_order_sum`, one order for every shape."""
    best = jnp.max(x, axis=-1, keepdims=True)
    terms = jnp.exp(x - best)
    total = lax.platform_dependent(terms, cpu=lambda t: jnp.sum(t, axis=-1),
                                   default=lambda t: fixed_order_sum(t))[..., None]
    return (values - best) - jnp.log(total)


def _chosen_logprobs(x: jax.Array, tokens: jax.Array) -> jax.Array:
    """log_softmax(x)[b, tokens[b]] -> float32 [B] (`_log_probs`), so `sample` and `sample_greedy` agree bit for
    bit."""
    return _log_probs(x, jnp.take_along_axis(x, tokens[:, None], axis=1))[:, 0]


def sample(logits: jax.Array, s: SamplingArrays, state: PenaltyState, vocab_parts: int = 1) -> SampleOutput:
    """Choose one token per row (processing order in the module docstring).

    Args:
      logits: [B, V] float32 model output.
      s: per-row settings.
      state: [B, V] token history of the rows (`penalty_state_zeros`, `record_prompt`, `record`); only read
        when some row uses a penalty. `sample` does not update it: call `record` with the returned tokens.
      vocab_parts: static; the vocabulary's split across devices (module docstring), 1 on one device.
    Returns:
      SampleOutput; logprobs and top logprobs are log_softmax(processed logits), before temperature and
      the filters.
    """
    x, mask_empty = process_logits(logits, s, state)
    tokens = _draw(x, s, _argmax(x, vocab_parts), vocab_parts)
    logprobs = _chosen_logprobs(x, tokens)
    top_ids, top_lps = jax.lax.cond(
        jnp.any(s.top_logprobs > 0), _top_logprobs, _no_top_logprobs, x, s.top_logprobs
    )
    return SampleOutput(
        tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps, mask_empty=mask_empty
    )
