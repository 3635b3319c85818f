"""Batched token sampling: every row has its own settings, all of them runtime arrays (no recompilation).

One call, `sample(logits, s, state)`, turns a batch of next-token logits [B, V] into one token per row.
Every row carries its own settings (`SamplingArrays`) and its own penalty history (`PenaltyHistory`); changing a
setting never recompiles, and a row's result never depends on its batch neighbours or its slot.

Processing order (it mirrors vLLM v1's `Sampler.forward`: allowed-token mask, logit bias, penalties, then
greedy / temperature, min-p, top-k, top-p, draw):

  (a) logit bias:  logit[t] += bias[t]  (OpenAI `logit_bias`: at most MAX_LOGIT_BIAS ids, values -100..100).
  (b) penalties, in vLLM's order (`apply_penalties`):
      repetition (CTRL, Keskar et al. 2019, arXiv:1909.05858; transformers
      `RepetitionPenaltyLogitsProcessor`), over tokens of the prompt or already generated:
        logit > 0 -> logit / p,  else logit * p;
      frequency, then presence (OpenAI API reference, "Parameter details" of the chat completions guide), over
      the row's *generated* tokens only:
        logit[t] -= frequency * count[t];  logit[t] -= presence * (count[t] > 0).
  (c) the allowed-token mask (structured output): disallowed tokens -> -inf.
  The result is the row's *processed logits*. The returned `logprobs` / `top_logprobs` are
  log_softmax(processed logits): the distribution the request's bias, penalties and mask define, before
  temperature and the truncation filters (masked tokens have log-probability -inf).
  (d) greedy rows (temperature 0) take argmax(processed logits). Sampled rows divide by the temperature, then
      min-p, top-k and top-p (top-p is taken over the distribution left by min-p and top-k, as in vLLM;
      min-p and top-k commute), then draw by inverse CDF with one uniform number.

The random stream of a row depends only on its 64-bit seed and the index of the token being generated
(`fold_in(fold_in(key(seed_lo), seed_hi), step)`), so a seeded request is reproducible whatever its
neighbours.

Cost. Sampling is exact over the whole vocabulary without a sort (a full sort of 262,144 logits per row is too
slow on CPU; figures: docs/performance.md): top-k reads the k-th value from `lax.top_k` (k <= MAX_TOP_K), top-p
finds its probability threshold by bisection, min-p is a threshold on the logit. Most of that runs on each row's
candidates (`_candidates`: the 64 blocks of 512 values with the largest maxima, then the 64 runs of 16 inside them
with the largest maxima), which decide the thresholds, the top logprobs and, where the kept tokens lie in their
blocks, the draw itself (`_sample_candidates`), with the same bits as the whole row would give (each value comes
from the same operations; where a float sum's order matters, the decision is taken only when every order agrees).
Where min-p and top-k cut every value outside the candidates, top-p's kept set is decided on them too, without
the row's probabilities (`_nucleus_in_candidates`: the reference's exps and sums are known within proven bounds,
and the set is taken only where the bounds cannot change it). A row they cannot decide takes the whole-row path
(`_sample_whole_rows`), under a `lax.cond` on "some row needs it". Every optional piece (the mask, the draw, top
logprobs, the candidates) runs under a `lax.cond` on "some row of the batch uses it" (one cond for the candidates
and the row maximum taken from their blocks' maxima: a second cond over the row, which would let the row sum of
the log-probabilities run beside the candidates, cost temperature-only batches ~12%: docs/performance.md,
"Sixteenth session"); the conds return [B]-sized
results where they can, because XLA CPU copies the [B, V] operands of a cond whose result is [B, V], even a
skipped one; rows that do not use a piece pass through it unchanged (bit for bit). The penalty history is sparse
(`PenaltyHistory`: the distinct tokens a row has seen, with their counts): the bias and the penalties are computed
on the few tokens they change and scattered over the masked row (`process_logits`), not a pass over a dense
[B, V] history.

Empty mask. A row whose mask allows no token (within the vocabulary) is sampled as if it had no mask (its
other settings still apply) and flagged in `SampleOutput.mask_empty`: the token it gets is *not* allowed, so
the caller must end that request (the constraint is unsatisfiable) instead of emitting it. Nothing produces
NaN.

Greedy batches. `sample_greedy` is `sample` for a batch whose rows are all greedy with no bias, penalty or top
logprobs (agents' tool calls and JSON, and most benchmarks): the allowed-token mask, the argmax and the chosen
token's log-probability, nothing else, with the same results. The host picks it per batch (`is_plain_greedy`):
XLA CPU copies the [B, V] operands of every `lax.cond`, even a skipped one, which made the full program cost far
more than the greedy one (mask step under its own cond) (figures: docs/performance.md).

Vocabulary split across devices (tensor parallelism, `model_worker.engine.sharding`): the logits [B, V] arrive split
over V (the penalty history, a few ids a row, whole on every device), and XLA's SPMD partitioner runs every step on
each device's part: the bias's and penalties' gathers and scatters of a few columns, masks and the min-p / top-p thresholds are elementwise work plus all-reduced row sums and maxima
(softmax, log_softmax, the top-p bisection's masses, the inverse-CDF's block sums). `sample` and `sample_greedy`
take the number of parts (`vocab_parts`, static): the greedy argmax is a row maximum, the first block holding it
and the first index in that block (`_argmax`, the same on one device), and the inverse-CDF draw locates its block
from [B, V / block] sums (blocks within a part) before one cumulative sum inside the block (`_inverse_cdf`). The
candidates' blocks lie within a part (their maxima are per-part reductions); how XLA's partitioner moves the
gathers of the blocks taken was not measured (tests/model_worker/test_tensor_parallel.py checks the results only).
What gathers a [B, V] row onto every device: `lax.top_k` over whole rows, which XLA does not partition along the
sorted axis (seen on CPU), in the top-k and top-p filters' fallbacks (rows the candidates cannot decide); a plain
greedy batch (`sample_greedy`) gathers nothing of size V.

Host helpers: `SamplingArrays.defaults(batch, vocab)` (greedy, everything off), `pack_mask` (bool [V] -> the
uint32 words of `SamplingArrays.mask`), `mask_words_from_bytes` (the protocol's `TokenMask.allowed` bytes ->
the same words), `penalty_history_zeros`, `penalty_capacity`, and for the tests' dense form (the oracle's)
`penalty_state_zeros`, `history_from_dense`, `dense_from_history`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model_worker.numerics.fixed_order import fixed_order_sum
from model_worker.serving.sampling_settings import (  # noqa: F401 - re-exported: the programs' names
    MAX_LOGIT_BIAS,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    SamplingArrays,
    mask_words,
    mask_words_from_bytes,
    pack_mask,
)

# Bisection steps for the top-p threshold: the threshold is found to within max_prob / 2**30.
_TOP_P_ITERS = 30
# Candidates (`_candidates`): each row's _CANDIDATES blocks of _ARGMAX_BLOCK values with the largest maxima, then
# among them its _CANDIDATES runs of _CANDIDATE_RUN values with the largest maxima: 1,024 values a row that hold
# its 64 largest, on which the top-k, top-p and top-logprob steps run before they need the whole row.
_CANDIDATES = 64
_CANDIDATE_RUN = 16
# top_k at most this is read from a partial sort of this many candidates (else of MAX_TOP_K).
_SMALL_TOP_K = 64

# The settings' record and limits live with the serving side, which fills them in without JAX; registered here as
# a pytree, for the programs.
jax.tree_util.register_dataclass(SamplingArrays)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyHistory:
    """Per-row token history for the penalties, sparse: the distinct tokens a row has seen and their counts.

    The penalties change only the logits of tokens a row has seen (or biased), so `sample` corrects those few
    columns of the row (`process_logits`) instead of a pass over a dense [B, V] history: the engine holds this
    table, not [S, V] arrays (docs/performance.md, "Sampling").

    Attributes:
      ids: int32 [B, M]; the distinct token ids the row has seen (in its prompt or generated), each once, packed
        at the front in the order first recorded; -1 past them.
      counts: int32 [B, M]; how many times each was generated (frequency and presence penalties; 0: seen in the
        prompt only); 0 past the ids.
    M, the capacity, bounds the distinct tokens a row can hold: the engine gives each slot `penalty_capacity`
    (twice max_model_len, at most the vocabulary): room for its sequence's tokens and those of a sequence it was
    copied from. A token new to a full row is dropped (`record_tokens`): only a chain of prefix copies whose
    sources' histories ran past the shared prefix could fill one (not seen; not refused either).
    """

    ids: jax.Array
    counts: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PenaltyState:
    """Per-row token history as dense [B, V] arrays: the frozen oracle's form (tests/model_worker/), turned into
    the `PenaltyHistory` `sample` reads by `history_from_dense`.

    Attributes:
      counts: int32 [B, V]; how many times each token was generated (frequency and presence penalties).
      seen: bool [B, V]; token occurs in the prompt or was generated (repetition penalty).
    """

    counts: jax.Array
    seen: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    """What `sample` returns for a batch of B rows.

    Attributes:
      tokens: int32 [B]; the chosen token of each row.
      logprobs: float32 [B]; log_softmax(processed logits) at the chosen token.
      top_ids: int32 [B, MAX_TOP_LOGPROBS]; the row's top_logprobs most likely tokens of the processed
        distribution, most likely first (ties in any order); -1 past top_logprobs and for tokens with
        probability 0 (masked).
      top_logprobs: float32 [B, MAX_TOP_LOGPROBS]; their log-probabilities; 0 where top_ids is -1.
      mask_empty: bool [B]; the row's mask allowed no token, so the mask was ignored and `tokens` is NOT
        allowed: the caller must end the request rather than emit it.
    """

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    mask_empty: jax.Array





def penalty_state_zeros(batch: int, vocab: int) -> PenaltyState:
    """Empty dense history for `batch` rows over `vocab` tokens (jax arrays): the oracle's form (`PenaltyState`)."""
    return PenaltyState(counts=jnp.zeros((batch, vocab), jnp.int32), seen=jnp.zeros((batch, vocab), bool))


def penalty_history_zeros(batch: int, capacity: int) -> PenaltyHistory:
    """Empty history for `batch` rows of `capacity` distinct tokens each (jax arrays: ids -1, counts 0)."""
    return PenaltyHistory(ids=jnp.full((batch, capacity), -1, jnp.int32),
                          counts=jnp.zeros((batch, capacity), jnp.int32))


def penalty_capacity(max_model_len: int, vocab: int) -> int:
    """Distinct tokens a slot's `PenaltyHistory` holds: min(2 * max_model_len, vocab). A slot's history is its
    sequence's tokens (at most max_model_len positions), plus, after a prefix copy (`Engine.copy_slot`), those of
    the sequence it was copied from; no slot holds more distinct tokens than the vocabulary."""
    return min(2 * max_model_len, vocab)


def history_from_dense(state: PenaltyState, capacity: int | None = None) -> PenaltyHistory:
    """Host helper (numpy): the `PenaltyHistory` of a dense history, ids ascending -> [B, capacity] (default: the
    most tokens any row has seen, at least 1). Raises ValueError when a row has seen more than `capacity`, or
    counts a token it has not seen (`record_tokens` never leaves one: a generated token is seen)."""
    seen, counts = np.asarray(state.seen), np.asarray(state.counts)
    if np.any((counts != 0) & ~seen):
        raise ValueError("a token is counted but not seen")
    n = int(seen.sum(axis=1).max(initial=0))
    capacity = max(n, 1) if capacity is None else capacity
    if n > capacity:
        raise ValueError(f"a row has seen {n} tokens, more than the capacity {capacity}")
    ids = np.full((seen.shape[0], capacity), -1, np.int32)
    out = np.zeros((seen.shape[0], capacity), np.int32)
    for b in range(seen.shape[0]):
        at = np.flatnonzero(seen[b])
        ids[b, : len(at)], out[b, : len(at)] = at, counts[b, at]
    return PenaltyHistory(ids=jnp.asarray(ids), counts=jnp.asarray(out))


def dense_from_history(history: PenaltyHistory, vocab: int) -> PenaltyState:
    """Host helper (numpy): the dense `PenaltyState` [B, vocab] of a history (ids outside 0..vocab-1 ignored)."""
    ids, counts = np.asarray(history.ids), np.asarray(history.counts)
    seen, out = np.zeros((ids.shape[0], vocab), bool), np.zeros((ids.shape[0], vocab), np.int32)
    for b in range(ids.shape[0]):
        ok = (ids[b] >= 0) & (ids[b] < vocab)
        seen[b, ids[b, ok]], out[b, ids[b, ok]] = True, counts[b, ok]
    return PenaltyState(counts=jnp.asarray(out), seen=jnp.asarray(seen))


# --- penalty history ----------------------------------------------------------------------------------------


def record_tokens(history: PenaltyHistory, tokens: jax.Array, valid: jax.Array,
                  output: jax.Array) -> PenaltyHistory:
    """Record tokens [B, C] int32 in rows [B] of `history`: each valid one (valid bool [B, C], id >= 0) is seen,
    each valid `output` one (bool [B, C]) also counted (generated) -> the updated history.

    A token new to its row is appended after the row's ids (a token repeated within `tokens` once, at its first
    occurrence), so ids stay distinct and packed; one already there only has its count added to. Tokens past the
    capacity are dropped (see `PenaltyHistory`). Cost: [B, C, C] comparisons, and [B, C, n] ones for the rows'
    n entries, searched `_SEARCH_CHUNK` at a time up to the longest row's end (`_search`), not over all M.
    """
    B, M = history.ids.shape
    C = tokens.shape[1]
    valid = valid & (tokens >= 0)
    at_row, size = _search(history.ids, tokens)
    same = (tokens[:, None, :] == tokens[:, :, None]) & valid[:, None, :]  # [B, c, c']
    first = _first_index(same)  # the first valid occurrence within the chunk (c itself or earlier)
    new = valid & (at_row == M) & (first == jnp.arange(C, dtype=jnp.int32))
    place = size[:, None] + jnp.cumsum(new, axis=1, dtype=jnp.int32) - 1  # where each new token goes
    at = jnp.where(at_row < M, at_row, jnp.take_along_axis(place, jnp.minimum(first, C - 1), axis=1))
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, C))
    ids = history.ids.at[rows, jnp.where(new, place, M)].set(tokens, mode="drop")
    counts = history.counts.at[rows, jnp.where(valid & output, at, M)].add(1, mode="drop")
    return PenaltyHistory(ids=ids, counts=counts)


#: Entries of a row's history compared per step of `_search` (and walked per step of `_entries`).
_SEARCH_CHUNK = 2048


def _search(ids: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Where each of tokens [B, C] sits in its row of ids [B, M] (packed, distinct) and each row's size ->
    (int32 [B, C]: the index, M where absent; int32 [B]: the entries), `_SEARCH_CHUNK` entries a step while some
    row's last chunk was full: a table of M = V slots (a long context) costs its rows' entries, not M."""
    B, M = ids.shape
    n = min(_SEARCH_CHUNK, M)

    def more(carry):
        j, _, _, full = carry
        return (j * n < M) & full

    def step(carry):
        j, at, size, _ = carry
        start = jnp.minimum(j * n, M - n)  # the last chunk may overlap the one before: ids are packed
        chunk = jax.lax.dynamic_slice_in_dim(ids, start, n, axis=1)
        first = _first_index(chunk[:, None, :] == tokens[:, :, None])
        at = jnp.where((at == M) & (first < n), start + first, at)
        filled = jnp.sum(chunk >= 0, axis=1, dtype=jnp.int32)
        return j + 1, at, jnp.maximum(size, start + filled), jnp.any(filled == n)

    start = (jnp.int32(0), jnp.full(tokens.shape, M, jnp.int32), jnp.zeros(B, jnp.int32), jnp.bool_(True))
    _, at, size, _ = jax.lax.while_loop(more, step, start)
    return at, size


def clear_rows(history: PenaltyHistory, clear: jax.Array) -> PenaltyHistory:
    """`history` [B, M] with the rows where clear [B] bool emptied (ids -1, counts 0): a fresh sequence."""
    return PenaltyHistory(ids=jnp.where(clear[:, None], -1, history.ids),
                          counts=jnp.where(clear[:, None], 0, history.counts))


def record(history: PenaltyHistory, tokens: jax.Array, active: jax.Array) -> PenaltyHistory:
    """Add one generated token per row (seen and counted) where active[b]: tokens int32 [B], active bool [B];
    negative ids are ignored (`record_tokens`)."""
    return record_tokens(history, tokens[:, None], active[:, None], jnp.ones_like(active)[:, None])


def record_prompt(history: PenaltyHistory, token_ids: jax.Array) -> PenaltyHistory:
    """Mark prompt tokens [B, N] int32 as seen (repetition penalty only; not counted as generated); -1 is
    padding. Call once per prompt chunk."""
    return record_tokens(history, token_ids, token_ids >= 0, jnp.zeros(token_ids.shape, bool))


def _valid_ids_or_oob(ids: jax.Array, vocab: int) -> jax.Array:
    """Map ids outside 0..vocab-1 to vocab, which scatters with mode="drop" skip (negative ids would wrap)."""
    return jnp.where((ids >= 0) & (ids < vocab), ids, vocab)


# --- (a)-(c): processed logits ------------------------------------------------------------------------------


def _skip(x, *_):
    """The identity branch of a `lax.cond`."""
    return x


#: Columns of `SamplingArrays.bias_ids` scattered per step of `_correct_biased`'s loop.
_BIAS_CHUNK = 8
#: History entries gathered, corrected and scattered per step of `_correct_history`'s loop.
_HISTORY_CHUNK = 256


def _allowed_at(s: SamplingArrays, ids: jax.Array) -> jax.Array:
    """Whether the rows' masks allow tokens ids [B, n] (in 0..vocab-1) -> bool [B, n]: the bits of `s.mask` that
    `unpack_mask` would give at those ids."""
    words = jnp.take_along_axis(s.mask, jnp.minimum(ids // 32, s.mask.shape[-1] - 1), axis=1)
    return ((words >> (ids % 32).astype(jnp.uint32)) & 1).astype(bool)


def _bias_sums(x: jax.Array, ids: jax.Array, s: SamplingArrays, used: jax.Array) -> jax.Array:
    """x [B, n] (the logits at tokens ids [B, n]) with every logit bias of each token added, one add at a time in
    column order, as the reference's scatter (`logits[b, bias_ids[b, j]] += bias_vals[b, j]`, a loop over the
    updates in row-major order) adds them -> [B, n] float32. `used`: the bias columns to the last one any row
    uses (columns past it hold none)."""
    column = lambda a, j: jax.lax.dynamic_slice_in_dim(a, j, 1, axis=1)
    add = lambda j, acc: jnp.where(ids == column(s.bias_ids, j), acc + column(s.bias_vals, j), acc)
    return jax.lax.fori_loop(0, used, add, x)


def _corrected(x: jax.Array, ids: jax.Array, s: SamplingArrays, used: jax.Array, seen: jax.Array,
               counts: jax.Array, on: jax.Array) -> jax.Array:
    """Steps (a)-(c) on the logits x [B, n] of tokens ids [B, n] (in 0..V-1) with their history (seen bool,
    counts int32 [B, n]) -> their processed values [B, n] float32, as the reference computes them over the whole
    row: the biases added (`_bias_sums`), the penalties (`_penalties`), then -inf where the row's mask is in force
    (`on` [B, 1]) and does not allow the token."""
    v = _penalties(_bias_sums(x, ids, s, used), s, seen, counts)
    return jnp.where(on & ~_allowed_at(s, ids), -jnp.inf, v)


def _penalties(x: jax.Array, s: SamplingArrays, seen: jax.Array, counts: jax.Array) -> jax.Array:
    """Step (b) on values x [B, n] float32 with their tokens' history (seen bool, counts int32 [B, n]) -> [B, n]: the
    repetition penalty, then the frequency and presence penalties, one elementwise pass that leaves unchanged the
    rows not using them (a repetition penalty of 1 divides by 1; frequency and presence penalties of 0 are skipped
    per row)."""
    x = _repetition_penalty(x, s.repetition_penalty, seen)
    freq = (s.frequency_penalty != 0) | (s.presence_penalty != 0)
    return jnp.where(freq[:, None], _frequency_presence(x, s, counts), x)


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
    logits: jax.Array, s: SamplingArrays, state: PenaltyHistory
) -> tuple[jax.Array, jax.Array]:
    """Steps (a)-(c): logit bias, repetition / frequency / presence penalties, allowed-token mask.

    The mask is applied to the whole row (under a `lax.cond` on "some row has one"), then the few columns the
    bias and the penalties change are corrected in that buffer: each token of a row's history or logit bias gets
    the value the reference's order (bias, penalties, mask) gives it, computed from the logits (`_corrected`) and
    scattered over the masked row (`_correct_history`, `_correct_biased`). The other columns are the same
    either way: the penalties change nothing a row has not seen, and a masked -inf stays -inf. No pass over a
    dense [B, V] history, and no [B, V] write besides the one XLA makes for the cond.

    Args:
      logits: [B, V] float32 model output.
      s: per-row settings.
      state: the rows' history [B, M] (`PenaltyHistory`).
    Returns:
      processed logits [B, V] float32 (-inf where masked), and mask_empty bool [B] (see the module docstring).
    """
    x = logits.astype(jnp.float32)
    B, V = x.shape
    flip = _zeros_flipped(s)
    y, empty = jax.lax.cond(jnp.any(s.mask_on) | jnp.any(flip), _mask_and_zeros, _no_mask_or_zeros, x, s, flip)
    on = (s.mask_on & ~empty)[:, None]
    bias_ids = _valid_ids_or_oob(s.bias_ids, V)
    used = jnp.max(jnp.where(bias_ids < V, jnp.arange(bias_ids.shape[-1], dtype=jnp.int32) + 1, 0))
    s = dataclasses.replace(s, bias_ids=bias_ids)
    y, seen, counts = _correct_history(x, y, s, state, used, on)
    return _correct_biased(x, y, s, seen, counts, used, on), empty


def _zeros_flipped(s: SamplingArrays) -> jax.Array:
    """Rows whose penalties turn a logit of -0.0 into +0.0 at every token, seen or not (bool [B]): the frequency
    and presence penalties subtract f * 0 and p * 0 from each unseen token, which turns -0.0 into +0.0 where such
    a product is -0.0 (the sign of f, as XLA CPU computes them: the presence term becomes a select of +0.0). Which
    rows: the penalties' own expression (`_penalties`) on a -0.0 of each row, so the rule is XLA's, not restated
    here (the barrier keeps XLA from folding the probe's zeros). Their other columns get that +0.0 in
    `_mask_and_zeros`, as the reference's pass over the whole row gives."""
    B = s.frequency_penalty.shape[0]
    unseen = lax.optimization_barrier((jnp.full((B, 1), -0.0, jnp.float32), jnp.zeros((B, 1), bool),
                                       jnp.zeros((B, 1), jnp.int32)))  # not folded as constants: as at run time
    probe = _penalties(*unseen[:1], s, *unseen[1:])[:, 0]
    return ~jnp.signbit(probe)


def _mask_and_zeros(x: jax.Array, s: SamplingArrays, flip: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The masked row (`_apply_mask`) with -0.0 made +0.0 in the rows `flip` [B] (`_zeros_flipped`) -> (y [B, V],
    mask_empty [B]): what the penalties and the mask leave at the tokens a row has neither seen nor biased."""
    y, empty = _apply_mask(x, s.mask, s.mask_on)
    return jnp.where(flip[:, None] & (y == 0), 0.0, y), empty


def _no_mask_or_zeros(x: jax.Array, s: SamplingArrays, flip: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The skipped branch of `_mask_and_zeros`: x, no row empty."""
    return _no_mask(x, s.mask, s.mask_on)


def _penalized(s: SamplingArrays) -> jax.Array:
    """Whether some row uses a repetition, frequency or presence penalty (scalar bool)."""
    return jnp.any(((s.repetition_penalty != 1.0) & (s.repetition_penalty > 0))
                   | (s.frequency_penalty != 0) | (s.presence_penalty != 0))


def _correct_history(x: jax.Array, y: jax.Array, s: SamplingArrays, state: PenaltyHistory, used: jax.Array,
                     on: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """y [B, V] (x [B, V] masked) with each token of each row's history set to its processed value
    (`_corrected`), `_HISTORY_CHUNK` entries a step while some row's last chunk was full (to the longest row's
    end, not over all M), no step when no row uses a penalty -> (y, and the history of each logit-bias column's token: seen bool, counts int32 [B, MAX_LOGIT_BIAS],
    found in the same steps). A token the row also biases is left to `_correct_biased`, so every column is
    written once and a history entry needs no bias."""
    B, V = x.shape
    ids, counts = state.ids, state.counts
    pad = -ids.shape[-1] % _HISTORY_CHUNK
    if pad:
        ids, counts = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=-1), jnp.pad(counts, ((0, 0), (0, pad)))
    steps = ids.shape[-1] // _HISTORY_CHUNK
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, _HISTORY_CHUNK))
    chunk = lambda a, j: jax.lax.dynamic_slice_in_dim(a, j * _HISTORY_CHUNK, _HISTORY_CHUNK, axis=1)
    column = lambda a, c: jax.lax.dynamic_slice_in_dim(a, c, 1, axis=1)
    put = lambda a, c, v: jax.lax.dynamic_update_slice_in_dim(a, v, c, axis=1)

    def more(carry):
        j, alive = carry[0], carry[-1]
        return (j < steps) & alive

    def step(carry):
        j, y, seen, found, _ = carry
        t, k = chunk(ids, j), chunk(counts, j)

        def bias_column(c, inner):  # the entries that are bias column c's token, and that token's history
            hit, seen, found = inner
            match = t == column(s.bias_ids, c)
            seen = put(seen, c, column(seen, c) | jnp.any(match, axis=1, keepdims=True))
            found = put(found, c, column(found, c) + jnp.sum(jnp.where(match, k, 0), axis=1, keepdims=True))
            return hit | match, seen, found

        hit, seen, found = jax.lax.fori_loop(0, used, bias_column, (jnp.zeros(t.shape, bool), seen, found))
        at = jnp.clip(t, 0, V - 1)
        v = _corrected(jnp.take_along_axis(x, at, axis=1), at, s, 0, t >= 0, k, on)
        y = y.at[rows, jnp.where((t >= 0) & (t < V) & ~hit, t, V)].set(v, mode="drop")
        return j + 1, y, seen, found, jnp.any(t[:, -1] >= 0)  # a full chunk: the row may go on (ids are packed)

    start = (jnp.int32(0), y, jnp.zeros(s.bias_ids.shape, bool), jnp.zeros(s.bias_ids.shape, jnp.int32),
             _penalized(s))
    return jax.lax.while_loop(more, step, start)[1:4]


def _correct_biased(x: jax.Array, y: jax.Array, s: SamplingArrays, seen: jax.Array, counts: jax.Array,
                    used: jax.Array, on: jax.Array) -> jax.Array:
    """y [B, V] with each token given a logit bias set to its processed value (`_corrected`, with its history
    seen, counts [B, MAX_LOGIT_BIAS] from `_correct_history`), `_BIAS_CHUNK` columns at a time up to the last
    column any row uses (no step when none does).

    Why not the scatter over the row, then the penalties: XLA CPU runs a scatter as a loop over its updates, and
    the B * MAX_LOGIT_BIAS entries (4,800 at 16 rows, most of them empty) took ~4 ms; here only the used columns
    are written. A token given twice gets the same value in each of its entries (`_bias_sums`).
    """
    B, V = x.shape
    pad = -s.bias_ids.shape[-1] % _BIAS_CHUNK
    widen = lambda a, fill: jnp.pad(a, ((0, 0), (0, pad)), constant_values=fill)
    ids = widen(s.bias_ids, V)
    at = jnp.minimum(ids, V - 1)
    vals = _corrected(jnp.take_along_axis(x, at, axis=1), at, s, used, widen(seen, False), widen(counts, 0), on)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, _BIAS_CHUNK))
    column = lambda a, j: jax.lax.dynamic_slice_in_dim(a, j, _BIAS_CHUNK, axis=1)

    def write(c, y):
        return y.at[rows, column(ids, c * _BIAS_CHUNK)].set(column(vals, c * _BIAS_CHUNK), mode="drop")

    return jax.lax.fori_loop(0, (used + _BIAS_CHUNK - 1) // _BIAS_CHUNK, write, y)


# --- (d): temperature, truncation, draw ---------------------------------------------------------------------


def _row_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    """One U(0, 1] number for one row from (64-bit seed as two uint32 words, step).

    Excluding 0 matters: inverse-CDF with u = 0 would pick index 0 even when its probability is 0.
    """
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), step)
    return 1.0 - jax.random.uniform(key, dtype=jnp.float32)


def _top_k_filter(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """Keep logits >= the row's k-th largest (ties at the k-th value are all kept; top_k == 0: unchanged)."""
    kth = _kth_largest(logits, top_k)
    keep = (top_k[:, None] <= 0) | (logits >= kth[:, None])
    return jnp.where(keep, logits, -jnp.inf)


def _kth_largest(x: jax.Array, top_k: jax.Array, k_max: int = MAX_TOP_K) -> jax.Array:
    """The top_k[b]-th largest value of row b of x [B, n] (counted with ties; top_k clipped to 1..k_max and to n)
    -> [B]."""
    k_max = min(k_max, x.shape[-1])
    vals = jax.lax.top_k(x, k_max)[0]
    return jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, k_max - 1)[:, None], axis=1)[:, 0]


def row_probabilities(logits: jax.Array) -> jax.Array:
    """softmax over each row of logits [B, V] -> float32 [B, V], the same bits for a row in every batch shape:
    exp(x - row max) / Σ exp(x - row max), the sum `fixed_order.fixed_order_sum`'s tree.

    Why not `jax.nn.softmax`: XLA CPU fuses its exp, row sum and division into one program whose sum orders a row's
    terms by the batch's shape (262,144 flat logits: 6 of 16 rows' probabilities differed between a batch of 1 and
    of 16, and top-p's bisection threshold in 4), so a seeded top-p row could draw another token beside other
    rows. The exps and the division alone are elementwise (the same in every shape); only the sum needs an order
    of its own. Costs ~5 ms more than XLA's fused softmax at 16 rows of 262,144 (~17 ms against ~12, one run), on
    the whole-row path only (`_top_p_filter`, `_nucleus`)."""
    terms = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    return terms / fixed_order_sum(terms)[..., None]


def _top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep the smallest set of most likely tokens whose probability sums to >= top_p (ties kept together).

    Bisection on the probability threshold t: S(t) = sum of p_i >= t is non-increasing; find the largest t
    with S(t) >= top_p (`_bisect`: `_TOP_P_ITERS` steps, each a sum over the whole row), over the probabilities
    of `row_probabilities` (a row's bits in every batch shape).
    """
    probs = row_probabilities(logits)
    keep = (top_p[:, None] >= 1.0) | (probs >= _bisect(probs, top_p)[:, None])
    return jnp.where(keep, logits, -jnp.inf)


def _bisect(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """The top-p threshold by bisection over whole rows of probabilities [B, V] -> lo [B] (`_top_p_filter`)."""
    lo = jnp.zeros(probs.shape[0], jnp.float32)
    hi = jnp.max(probs, axis=-1)

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        mass = jnp.sum(jnp.where(probs >= mid[:, None], probs, 0.0), axis=-1)
        ok = mass >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, _TOP_P_ITERS, body, (lo, hi))[0]


def _nucleus_threshold(probs: jax.Array, top_p: jax.Array, cands: Candidates) -> tuple[jax.Array, jax.Array]:
    """`_bisect`'s steps on each row's candidate probabilities (`_candidates`) -> (lo [B], sure bool [B]).

    Every step's midpoint is computed as `_bisect` computes it, so equal decisions give equal bits. A step asks
    whether the mass of {p >= mid} reaches top_p. Its set is known exactly when mid is above every probability
    outside the candidates; its mass is a float sum whose order is XLA's (unknown), but every order of n
    non-negative terms lies within (n - 1) * 2**-24 (relative) of the exact sum, and so does the candidates' sum
    here: a decision is certain when the two cannot fall on different sides of top_p. Where the set reaches
    outside the candidates, only "yes" can be certain (a larger set has a larger float sum: rounding is
    monotone). `sure` is False for a row with any step left uncertain.
    """
    top, _, outside, _, _ = cands
    lo = jnp.zeros(probs.shape[0], jnp.float32)
    hi = jnp.max(top, axis=-1)  # the row maximum, as `_bisect`'s

    def body(_, carry):
        lo, hi, sure = carry
        mid = (lo + hi) / 2
        inside = top >= mid[:, None]
        mass = jnp.sum(jnp.where(inside, top, 0.0), axis=-1)
        slack = 2.5 * (jnp.sum(inside, axis=-1) + 1).astype(jnp.float32) * 2.0**-24
        ok = mass * (1 - slack) >= top_p
        no = (mid > outside) & (mass * (1 + slack) < top_p)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid), sure & (ok | no)

    lo, _, sure = jax.lax.fori_loop(0, _TOP_P_ITERS, body, (lo, hi, jnp.ones(probs.shape[0], bool)))
    return lo, sure


class Candidates(NamedTuple):
    """A row's candidates (`_candidates`), [B, ...] each.

    Attributes:
      vals: [B, C] the values, in the row's order; they hold the row's _CANDIDATES largest (ties: lower indices).
      ids: int32 [B, C] their token ids.
      outside: [B] the largest value of the row outside them (-inf if none).
      blocks: int32 [B, m] the blocks of `_ARGMAX_BLOCK` values holding them, ascending (all n where n <= m).
      blocks_outside: [B] the largest value outside those blocks (-inf if none).
    """

    vals: jax.Array
    ids: jax.Array
    outside: jax.Array
    blocks: jax.Array
    blocks_outside: jax.Array


def _candidates(x: jax.Array, parts: int = 1, maxima: jax.Array | None = None) -> Candidates:
    """Each row's candidates (`Candidates`): two levels of `_top_blocks`, the _CANDIDATES blocks of
    `_ARGMAX_BLOCK` values with the largest maxima, then the _CANDIDATES runs of `_CANDIDATE_RUN` values with the
    largest maxima inside them (C = 1,024 values a row). A whole row is one block where V is not a whole number of
    blocks (per device part), and the candidates are the whole row where it is small. `maxima`: the blocks' maxima
    [B, V / block] where the caller has them (`_candidates_and_max`).
    """
    B, V = x.shape
    L = _block(V, parts)
    vals, blocks, outside = _top_blocks(x, L, _CANDIDATES, maxima)  # blocks: [B, m] ids of the blocks taken
    ids = (blocks[:, :, None] * L + jnp.arange(L, dtype=jnp.int32)).reshape(B, -1)
    inner = outside
    if L % _CANDIDATE_RUN == 0 and L > _CANDIDATE_RUN:
        vals, runs, inner = _top_blocks(vals, _CANDIDATE_RUN, _CANDIDATES)
        ids = jnp.take_along_axis(ids.reshape(B, -1, _CANDIDATE_RUN), runs[:, :, None], axis=1).reshape(B, -1)
    return Candidates(vals, ids, jnp.maximum(outside, inner), blocks, outside)


def _no_candidates(x: jax.Array, parts: int = 1) -> Candidates:
    """The skipped branch of `_candidates` (a batch that samples nothing and asks for no top logprobs): zeros of
    its shapes."""
    shapes = jax.eval_shape(functools.partial(_candidates, parts=parts), x)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _candidates_and_max(x: jax.Array, parts: int = 1) -> tuple[Candidates, jax.Array]:
    """`_candidates` of x [B, V] and the row maximum [B, 1], taken from the candidates' block maxima: one pass over
    the row fewer than a max of its own (`_normalizer` takes it). A max is exact in any order; where it differs
    from `jnp.max`'s, a zero of the other sign, nothing computed from it does (x - best, and the log-probabilities
    of a row whose maximum is held as both +0.0 and -0.0, which sums more than one term). The barrier keeps XLA from
    folding the max of the maxima back into a max over the whole row."""
    B, V = x.shape
    L = _block(V, parts)
    maxima = jnp.max(x.reshape(B, V // L, L), axis=-1)
    best = jnp.max(lax.optimization_barrier(maxima), axis=-1, keepdims=True)
    return _candidates(x, parts, maxima), best


def _no_candidates_and_max(x: jax.Array, parts: int = 1) -> tuple[Candidates, jax.Array]:
    """The skipped branch of `_candidates_and_max`: `_no_candidates` and the row maximum [B, 1]."""
    return _no_candidates(x, parts), jnp.max(x, axis=-1, keepdims=True)


def _block(V: int, parts: int = 1) -> int:
    """Values per block of a row of V (`_argmax`, `_inverse_cdf`, `_candidates`): `_ARGMAX_BLOCK` where the row
    (per device part) is a whole number of them, else the whole row."""
    return _ARGMAX_BLOCK if V % (_ARGMAX_BLOCK * parts) == 0 else V


def _top_blocks(x: jax.Array, width: int, count: int,
                maxima: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The `count` blocks of `width` values of each row of x [B, n] with the largest maxima, in the row's order ->
    (values [B, count * width], the blocks' indices [B, count] int32, the largest value outside them [B]); all of
    x (every block, and -inf) where it has no more than `count` blocks. `maxima`: the blocks' maxima [B, n / width]
    if the caller has them.

    Why it serves: the j largest values of a row (j <= count) lie in the j blocks with the largest maxima, and
    keeping the row's order keeps `lax.top_k`'s order among equal values (the lower index first): with ties
    between block maxima `lax.top_k` takes the lower blocks, which hold the lower indices of a tied value. The
    blocks' maxima are one fast reduction.
    """
    B, n = x.shape
    if n // width <= count:
        blocks = jnp.broadcast_to(jnp.arange(n // width, dtype=jnp.int32), (B, n // width))
        return x, blocks, jnp.full((B,), -jnp.inf, x.dtype)
    if maxima is None:
        maxima = jnp.max(x.reshape(B, n // width, width), axis=-1)
    at = jax.lax.top_k(maxima, count)[1]  # (no slice of top_k's result: XLA CPU then sorts the whole row instead)
    rows = jnp.broadcast_to(jnp.arange(B, dtype=at.dtype)[:, None], (B, count))
    # a scatter of the B * count blocks taken: XLA CPU's loop over them took ~5 us at 16 rows, where comparing every
    # block with every one taken wrote a [B, count, n / width] mask (~0.2 ms for the runs' level)
    taken = jnp.zeros((B, n // width), bool).at[rows, at].set(True, unique_indices=True)
    outside = jnp.max(jnp.where(taken, -jnp.inf, maxima), axis=-1)
    at = jnp.sort(at, axis=-1)
    vals = jnp.take_along_axis(x.reshape(B, n // width, width), at[:, :, None], axis=1).reshape(B, count * width)
    return vals, at.astype(jnp.int32), outside


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
    B, V = scaled.shape
    L = _ARGMAX_BLOCK if V % (_ARGMAX_BLOCK * parts) == 0 else V
    blocks = scaled.reshape(B, V // L, L)
    best = jnp.max(blocks, axis=(1, 2))[:, None]  # of the blocks: XLA CPU then writes scaled out once, not twice
    return _draw_in_blocks(blocks, best, None, V // L, s)


def _draw_in_blocks(blocks: jax.Array, best: jax.Array, at: jax.Array | None, n: int, s: SamplingArrays) -> jax.Array:
    """`_inverse_cdf` on a row's blocks: blocks [B, m, L] of scaled logits, best [B, 1] the row maximum; either
    all n blocks of the row (`at` None) or the blocks `at` [B, m] (ascending) of n, every other block holding
    probability 0 (its sum is then 0 exactly, as the whole row's would be) -> token ids [B]."""
    u = jax.vmap(_row_uniform)(s.seed, s.step)
    B, m, L = blocks.shape
    sums = jnp.sum(jnp.exp(blocks - best[:, :, None]), axis=-1)  # [B, m]: unnormalized, u scales the total
    if at is not None:
        # each sum copied to its block's place (a scatter of B * m entries, not a [B, m, n] select and max)
        rows = jnp.broadcast_to(jnp.arange(B, dtype=at.dtype)[:, None], (B, m))
        sums = jnp.zeros((B, n), sums.dtype).at[rows, at].set(sums, indices_are_sorted=True, unique_indices=True)
    cdf = jnp.cumsum(sums, axis=-1)
    target = u * cdf[:, -1]
    b = _first_or_last(cdf >= target[:, None], sums > 0)
    before = jnp.where(b[:, None] > 0, jnp.take_along_axis(cdf, jnp.maximum(b - 1, 0)[:, None], axis=1), 0.0)
    j = b if at is None else _first_index(at == b[:, None])  # the block's place among those given
    block = jnp.exp(jnp.take_along_axis(blocks, jnp.minimum(j, m - 1)[:, None, None], axis=1)[:, 0] - best)
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


def _draw(x: jax.Array, s: SamplingArrays, cands: Candidates, parts: int = 1) -> jax.Array:
    """Step (d): the greedy rows' argmax and the sampled rows' draw (`_sample_rows`) -> int32 [B].

    Each half runs under a `lax.cond` on "some row needs it" whose result is [B] (XLA CPU copies a cond's [B, V]
    operands only when its result has that size; a skipped one then costs nothing, docs/performance.md,
    "Sampling"). `cands`: x's `_candidates`; `parts`: the vocabulary's split across devices (module docstring).
    """
    sampled = s.temperature > 0
    none = lambda x, *_: jnp.zeros(x.shape[0], jnp.int32)
    greedy = jax.lax.cond(jnp.any(~sampled), functools.partial(_argmax, parts=parts), none, x)
    drawn = jax.lax.cond(jnp.any(sampled), functools.partial(_sample_rows, parts=parts), none, x, s, cands)
    return jnp.where(sampled, drawn, greedy)


def _sample_rows(x: jax.Array, s: SamplingArrays, cands: Candidates, parts: int = 1) -> jax.Array:
    """The sampled rows' tokens (temperature > 0; other rows' values are unused): `_sample_candidates`, and
    `_sample_whole_rows` under a `lax.cond` ([B] result) when some sampled row's draw is not certain to be the
    whole row's; straight away the latter when some sampled row uses no filter (pure temperature: its draw
    reads the whole row)."""

    def nothing_sure(x, s, cands):
        return jnp.zeros(x.shape[0], jnp.int32), jnp.zeros(x.shape[0], bool)

    fast = functools.partial(_sample_candidates, parts=parts)
    tokens, sure = jax.lax.cond(_filtered_only(s), fast, nothing_sure, x, s, cands)
    whole = lambda x, s, tokens: _sample_whole_rows(x, s, parts)
    return jax.lax.cond(jnp.all(sure | (s.temperature <= 0)), lambda x, s, tokens: tokens, whole, x, s, tokens)


def _filtered_only(s: SamplingArrays) -> jax.Array:
    """Every sampled row uses min-p, top-k or top-p (scalar bool): the batch's draw may run on candidates."""
    filtered = (s.min_p > 0.0) | (s.top_k > 0) | (s.top_p < 1.0)
    return jnp.all((s.temperature <= 0) | filtered)


def _sample_whole_rows(x: jax.Array, s: SamplingArrays, parts: int = 1) -> jax.Array:
    """The sampled rows' tokens over whole rows: temperature, then (`_filter_whole_rows`, under a `lax.cond` on
    "some sampled row uses a filter") min-p, top-k, top-p, then the inverse-CDF draw."""
    sampled = s.temperature > 0
    filters = jnp.any(sampled & ((s.min_p > 0.0) | (s.top_k > 0) | (s.top_p < 1.0)))
    scaled = lambda x, s: _inverse_cdf(x / jnp.maximum(s.temperature, 1e-6)[:, None], s, parts)
    return jax.lax.cond(filters, functools.partial(_filter_whole_rows, parts=parts), scaled, x, s)


def _filter_whole_rows(x: jax.Array, s: SamplingArrays, parts: int = 1) -> jax.Array:
    """`_sample_whole_rows` with filters: each runs only when some sampled row uses it."""
    sampled = s.temperature > 0
    scaled = x / jnp.maximum(s.temperature, 1e-6)[:, None]
    scaled = jax.lax.cond(jnp.any(sampled & (s.min_p > 0.0)), _min_p_filter, _skip, scaled, s.min_p)
    scaled = jax.lax.cond(jnp.any(sampled & (s.top_k > 0)), _top_k_filter, _skip, scaled, s.top_k)
    scaled = jax.lax.cond(jnp.any(sampled & (s.top_p < 1.0)), _top_p_filter, _skip, scaled, s.top_p)
    return _inverse_cdf(scaled, s, parts)


def _sample_candidates(x: jax.Array, s: SamplingArrays, cands: Candidates,
                       parts: int = 1) -> tuple[jax.Array, jax.Array]:
    """`_sample_whole_rows` for rows whose truncated distribution lies in a few blocks of the row -> (tokens [B],
    sure bool [B]: the token is the whole row's).

    The filters' thresholds come from x's candidates: min-p's floor from the row maximum (which they hold), top-k's
    k-th value where it is >= every value outside them (`_top_k_filter`), top-p's kept set from the candidates
    alone where min-p and top-k cut everything outside them (`_nucleus_in_candidates`), else from the whole row's
    probabilities and their candidates (`_nucleus`, under a `lax.cond` on "some row needs it"). Where the tokens
    kept lie in the candidates' blocks (top-k or min-p cut everything outside them; top-p's kept set lies in the
    blocks its candidates came from), the inverse-CDF draw runs on those blocks alone (`_draw_in_blocks`): every
    other block's sum is 0, as over the whole row. Each value is computed by the same operations as over the whole
    row, so the same bits.
    """
    B, V = x.shape
    L = _block(V, parts)
    sampled = s.temperature > 0
    col = lambda a, z: a.reshape((B,) + (1,) * (z.ndim - 1))  # a per-row value against z [B, ...]
    temperature = jnp.maximum(s.temperature, 1e-6)
    scale = lambda v: v / col(temperature, v)
    floor = jnp.max(scale(cands.vals), axis=-1) + jnp.log(jnp.maximum(s.min_p, 1e-30))
    min_p = lambda z: jnp.where((col(s.min_p, z) <= 0.0) | (z >= col(floor, z)), z, -jnp.inf)  # `_min_p_filter`
    vals, outside = min_p(scale(cands.vals)), min_p(scale(cands.outside))
    kth = jax.lax.cond(jnp.all(s.top_k <= _SMALL_TOP_K), functools.partial(_kth_largest, k_max=_SMALL_TOP_K),
                       _kth_largest, vals, s.top_k)
    kth_sure = (s.top_k <= 0) | ((s.top_k <= vals.shape[-1]) & (kth >= outside))
    top_k = lambda z: jnp.where((col(s.top_k, z) <= 0) | (z >= col(kth, z)), z, -jnp.inf)  # `_top_k_filter`
    filtered = lambda v: top_k(min_p(scale(v)))  # min-p, top-k of x's values v [B, ...]
    rows = sampled & (s.top_p < 1.0)
    contained = kth_sure & (top_k(outside) == -jnp.inf)  # min-p and top-k cut every value outside the candidates
    clean = ~jnp.any(jnp.isnan(cands.vals), axis=-1) & ~jnp.isnan(cands.outside)
    level, level_sure = _nucleus_in_candidates(filtered(cands.vals), s.top_p)
    small = rows & contained & clean & level_sure  # top-p decided on the candidates alone
    whole = rows & ~small  # top-p needs the whole row's probabilities (`_nucleus`)

    def kept_in(x, blocks, top_p_kept):  # the kept values of the blocks [B, m] of x: filtered, then top-p's set
        kept = filtered(jnp.take_along_axis(x.reshape(B, V // L, L), blocks[:, :, None], axis=1))
        kept = jnp.where(top_p_kept, kept, -jnp.inf)  # `_top_p_filter` over the whole row
        return jnp.where(~small[:, None, None] | (kept >= level[:, None, None]), kept, -jnp.inf)  # the same set

    # Both branches return the kept values themselves, [B, m, L]: a branch returning the probabilities instead
    # wrote zeros of that size when skipped, and the filter's select read them.
    def nucleus(x, top_p):  # some row's top-p needs the whole row's probabilities
        lo, sure, p_blocks, probs = _nucleus(x, top_p, filtered, parts)
        blocks = jnp.where(whole[:, None], p_blocks, cands.blocks)
        return kept_in(x, blocks, ~whole[:, None, None] | (probs >= lo[:, None, None])), blocks, sure

    def no_nucleus(x, top_p):
        return kept_in(x, cands.blocks, True), cands.blocks, jnp.zeros(B, bool)

    kept, blocks, nucleus_sure = jax.lax.cond(jnp.any(whole), nucleus, no_nucleus, x,
                                              jnp.where(whole, s.top_p, 1.0))
    kept = lax.optimization_barrier(kept)  # the block sums read it written out, as over the whole row
    best = jnp.max(kept.reshape(B, -1), axis=-1, keepdims=True)
    tokens = _draw_in_blocks(kept, best, blocks, V // L, s)
    inside = jnp.where(whole, nucleus_sure, contained)
    return tokens, kth_sure & inside


#: Levels of `_nucleus_in_candidates`: a nucleus of at most this many of the largest filtered values.
_NUCLEUS_LEVELS = 64
#: `_nucleus_in_candidates`' bound on the relative error of an `exp` (the reference's or ours) against the true
#: value of its float32 argument, per backend (`_exp_error`): on CPU 2**-18, 32 float32 ulps, ~20 times what XLA
#: CPU's float32 exp was seen to err (1.6 ulps at most over 4M arguments in 0..-87, both in the softmax's YNNPACK
#: fusion and in a small loop fusion); elsewhere 2**-14, ~9 times what a TPU v5e's float32 exp was seen to err
#: (6.5e-6 over the same arguments, in the device lane: its exp is coarser than 32 ulps).
_EXP_ERROR = {"cpu": 2.0**-18}
_EXP_ERROR_ELSEWHERE = 2.0**-14


#: Environment variable naming the platform programs are traced for when it is not JAX's default backend: the
#: worker's compile process runs on the CPU backend and compiles for the TPU (`engine.compile_process`).
TRACE_PLATFORM_ENV = "GEMMA_SERVE_TRACE_PLATFORM"


def _exp_error(backend: str | None = None) -> float:
    """The `exp` error bound of `backend` (default: the platform the programs are traced for, `TRACE_PLATFORM_ENV`
    where set, else JAX's default backend).

    Chosen at trace time, not by `lax.platform_dependent`: a program traced for one backend and run on another (not
    something the worker does: its compile process names its target) would at worst carry CPU's bound to a TPU, or
    the looser bound to a CPU, where it only sends more rows to the whole-row path. The bound off CPU was measured
    on a TPU v5e, not on a GPU."""
    platform = backend or os.environ.get(TRACE_PLATFORM_ENV) or jax.default_backend()
    return _EXP_ERROR.get(platform, _EXP_ERROR_ELSEWHERE)


def _nucleus_in_candidates(z: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-p's kept set from the candidates alone, for rows whose filtered values (min-p, top-k) are -inf
    everywhere outside them: z [B, C] those filtered candidate values -> (level [B]: `_top_p_filter` keeps exactly
    the tokens with z >= level, sure bool [B]).

    Why without the whole row: such a row's probabilities p = exp(z - max) / S, S their sum, are nonzero only at
    the candidates, so their sum and every value is known here to within a bound of the reference's bits: the
    reference computes exp and the sum with its own code and order (XLA CPU hands both to YNNPACK), we compute them
    with ours; each exp errs by at most `_exp_error()` and a float sum of n non-negative terms by (n - 1) * 2**-24
    (relative; any order). The reference's bisection (`_bisect`) asks whether the mass of {p >= mid} reaches
    top_p. Take K, the smallest set {z >= z_k} of the largest values whose mass surely reaches top_p: if every
    smaller such set surely stays below top_p, then a step is "yes" exactly when mid <= q (q the least p in K),
    so the bisection ends with lo in [q - w, q], w its final width (at most p_max * 2**-22: 30 halvings, and a
    midpoint's rounding of at most p_max * 2**-24 each); where every p outside K is surely below q - w, the kept
    set {p >= lo} is K: the tokens with z >= z_k, whatever the bits of lo. Every rounding in that chain is
    bounded, so a row is `sure` only where the bounds cannot change the set; otherwise the whole row decides
    (`_nucleus`). The reference's lo itself is not computed: the draw depends on the kept set only.
    """
    B, C = z.shape
    n = _NUCLEUS_LEVELS + 1
    top = jax.lax.top_k(z, min(n, C))[0]  # (no slice of top_k's result: XLA CPU then sorts the whole row instead)
    if C < n:  # the candidates are the whole row: nothing beyond them
        top = jnp.pad(top, ((0, 0), (0, n - C)), constant_values=-jnp.inf)
    best = jnp.max(z, axis=-1, keepdims=True)
    finite = z > -jnp.inf
    count = jnp.sum(finite, axis=-1).astype(jnp.float32)  # the sum's nonzero terms
    total = jnp.sum(jnp.where(finite, jnp.exp(z - best), 0.0), axis=-1, keepdims=True)
    p = jnp.where(top > -jnp.inf, jnp.exp(top - best), 0.0) / total  # [B, n], the largest first
    u = 2.0**-24
    # p (the reference's bits) lies within p * (1 +- err): both exps, both sums of `count` terms, three roundings
    err = 2.0 * (4 * _exp_error() + 2 * (count + 1) * u + 4 * u)[:, None]
    tiny = 2.0**-120  # exps that underflow: absolute
    in_level = top[:, None, :] >= top[:, :, None]  # [B, k, j]: value j lies in level k's set {z >= top[k]}
    size = jnp.sum(in_level, axis=-1).astype(jnp.float32)
    gamma = 2.0 * (size + 1) * u  # the reference's float sum of the set (any order)
    mass_lo = jnp.sum(jnp.where(in_level, p[:, None, :], 0.0), axis=-1) * (1 - err) * (1 - gamma) - size * tiny
    mass_hi = jnp.sum(jnp.where(in_level, p[:, None, :], 0.0), axis=-1) * (1 + err) * (1 + gamma) + size * tiny
    q_lo = p * (1 - err) - tiny  # least p in level k's set
    below = jnp.max(jnp.where(top[:, None, :] < top[:, :, None], top[:, None, :], -jnp.inf), axis=-1)
    r_hi = jnp.where(below > -jnp.inf, jnp.exp(below - best), 0.0) / total * (1 + err) + tiny  # largest p outside
    first = top == best  # level k is the top one: every smaller set is empty, mass 0
    smaller_hi = jnp.where(first, 0.0, mass_hi - q_lo * (1 - gamma))  # a proper subset of the set: without q
    width = jnp.max(p, axis=-1, keepdims=True) * (1 + err) * 2.0**-22
    last = jnp.min(top, axis=-1, keepdims=True)  # values past the levels are <= it: a set must end above it
    whole = (top > last) & (top > -jnp.inf)
    k = _first_index((mass_lo >= top_p[:, None]) & whole)  # past the levels' end: not sure
    pick = lambda a: jnp.take_along_axis(a, jnp.minimum(k, n - 1)[:, None], axis=1)[:, 0]
    sure = ((k < n) & (top_p > 0) & jnp.isfinite(best[:, 0]) & (pick(smaller_hi) < top_p)
            & (pick(q_lo) - pick(r_hi) > width[:, 0]))
    return pick(top), sure


def _nucleus(x: jax.Array, top_p: jax.Array, filtered, parts: int = 1):
    """Top-p for `_sample_candidates`: the probabilities of the rows after min-p and top-k (`filtered`), as
    `_top_p_filter` computes them, and the threshold of their candidates (`_nucleus_threshold`) -> (lo [B], sure
    [B]: lo is the whole row's and every kept token lies in the blocks returned, the blocks [B, m] (ascending),
    the probabilities in them [B, m, block])."""
    B, V = x.shape
    L = _block(V, parts)
    probs = row_probabilities(filtered(x))
    cands = _candidates(probs, parts)
    lo, sure = _nucleus_threshold(probs, top_p, cands)
    p_blocks = jnp.take_along_axis(probs.reshape(B, V // L, L), cands.blocks[:, :, None], axis=1)
    return lo, sure & (lo > cands.blocks_outside), cands.blocks, p_blocks


# --- log-probabilities --------------------------------------------------------------------------------------


def _top_logprobs(x: jax.Array, n: jax.Array, norm: tuple[jax.Array, jax.Array],
                  cands: Candidates) -> tuple[jax.Array, jax.Array]:
    """The n[b] most likely tokens of log_softmax(x) per row: (ids, logprobs), [B, MAX_TOP_LOGPROBS] each (the
    largest logits, their log-probabilities from `_log_probs` with the chosen token's `norm`).

    `lax.top_k` runs on the row's candidates (`_candidates`), which hold its 20 largest values and give
    `lax.top_k` over the whole row's ids and order (a partial sort of 262,144 values
    took ~6 ms at 16 rows on XLA CPU; docs/performance.md, "Sampling"). Entries past n[b], and tokens with
    probability 0, are (-1, 0.0).
    """
    cand, tokens = cands.vals, cands.ids
    vals, at = jax.lax.top_k(cand, min(MAX_TOP_LOGPROBS, cand.shape[-1]))
    ids = jnp.take_along_axis(tokens, at, axis=1)
    vals = _log_probs(vals, norm)
    pad = ((0, 0), (0, MAX_TOP_LOGPROBS - vals.shape[-1]))  # only for a vocabulary smaller than 20 (tests)
    vals, ids = jnp.pad(vals, pad, constant_values=-jnp.inf), jnp.pad(ids, pad, constant_values=-1)
    keep = (jnp.arange(MAX_TOP_LOGPROBS)[None, :] < n[:, None]) & jnp.isfinite(vals)
    return jnp.where(keep, ids, -1).astype(jnp.int32), jnp.where(keep, vals, 0.0)


def _no_top_logprobs(x: jax.Array, n: jax.Array, *_) -> tuple[jax.Array, jax.Array]:
    """The skipped branch of `_top_logprobs`: every entry (-1, 0.0)."""
    shape = (x.shape[0], MAX_TOP_LOGPROBS)
    return jnp.full(shape, -1, jnp.int32), jnp.zeros(shape, jnp.float32)


def _log_probs(values: jax.Array, norm: tuple[jax.Array, jax.Array]) -> jax.Array:
    """log_softmax(x) at some of each row's logits: values [B, n] taken from x, norm = `_normalizer(x)` -> float32
    [B, n], as `jax.nn.log_softmax` computes it ((value - row max) - log(sum(exp(x - row max)))) without writing
    the [B, V] result: XLA CPU fused that and a gather of its row into a program that took 19 ms at 16 rows, against
    4 ms for the row sums alone (docs/performance.md, "Sampling"). The chosen token and the top logprobs both use
    one `norm`, so a chosen token that is also a top alternative has bit-identical log-probabilities (and the row
    is summed once)."""
    best, log_total = norm
    return (values - best) - log_total


def _normalizer(x: jax.Array, best: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(row max [B, 1], log(sum(exp(x - row max))) [B, 1]) of x [B, V]: what `_log_probs` subtracts. `best`: the
    row max [B, 1] where the caller has it (`_candidates_and_max`).

    The row sum: XLA CPU's sums a row alike in every batch shape (tests/model_worker/test_sampling.py); a TPU's
    ordered its terms by the batch's shape (a row's log-probability moved by one ulp with its neighbours, seen on
    a v5e), so off CPU it is `fixed_order.fixed_order_sum`, one order for every shape."""
    if best is None:
        best = jnp.max(x, axis=-1, keepdims=True)
    terms = jnp.exp(x - best)
    total = lax.platform_dependent(terms, cpu=lambda t: jnp.sum(t, axis=-1),
                                   default=lambda t: fixed_order_sum(t))[..., None]
    return best, jnp.log(total)


def _chosen_logprobs(x: jax.Array, tokens: jax.Array, norm: tuple[jax.Array, jax.Array]) -> jax.Array:
    """log_softmax(x)[b, tokens[b]] -> float32 [B] (`_log_probs`), so `sample` and `sample_greedy` agree bit for
    bit."""
    return _log_probs(jnp.take_along_axis(x, tokens[:, None], axis=1), norm)[:, 0]


def is_plain_greedy(s: SamplingArrays, rows: int) -> bool:
    """Host check (numpy settings): the first `rows` rows are greedy and use no logit bias, no penalty and no top
    logprobs, so `sample_greedy` gives what `sample` gives. Masks are allowed."""
    r = slice(0, rows)
    rep = np.asarray(s.repetition_penalty[r])
    return bool(
        np.all(np.asarray(s.temperature[r]) == 0)
        and np.all((rep == 1.0) | (rep <= 0))
        and np.all(np.asarray(s.frequency_penalty[r]) == 0)
        and np.all(np.asarray(s.presence_penalty[r]) == 0)
        and np.all(np.asarray(s.bias_ids[r]) < 0)
        and np.all(np.asarray(s.top_logprobs[r]) == 0)
    )


def sample_greedy(logits: jax.Array, s: SamplingArrays, vocab_parts: int = 1) -> SampleOutput:
    """`sample` for rows that pass `is_plain_greedy`: mask, argmax, log-probability (no penalty state needed).

    Args:
      logits: [B, V] float32; s: per-row settings (only mask and mask_on are read).
      vocab_parts: static; the vocabulary's split across devices (module docstring), 1 on one device.
    Returns:
      SampleOutput equal to `sample`'s for such rows: the same token, the log-probability from the same
      log_softmax expression, no top logprobs (-1, 0.0), mask_empty as `_apply_mask` reports it.
    """
    x, mask_empty = jax.lax.cond(jnp.any(s.mask_on), _apply_mask, _no_mask, logits.astype(jnp.float32), s.mask,
                                 s.mask_on)
    tokens = _argmax(x, vocab_parts)
    logprobs = _chosen_logprobs(x, tokens, _normalizer(x))
    top_ids, top_lps = _no_top_logprobs(x, s.top_logprobs)
    return SampleOutput(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps,
                        mask_empty=mask_empty)


def sample(logits: jax.Array, s: SamplingArrays, state: PenaltyHistory, vocab_parts: int = 1) -> SampleOutput:
    """Choose one token per row (processing order in the module docstring).

    Args:
      logits: [B, V] float32 model output.
      s: per-row settings.
      state: [B, M] token history of the rows (`penalty_history_zeros`, `record_prompt`, `record`); only read
        when some row uses a penalty or a logit bias. `sample` does not update it: call `record` with the
        returned tokens.
      vocab_parts: static; the vocabulary's split across devices (module docstring), 1 on one device.
    Returns:
      SampleOutput; logprobs and top logprobs are log_softmax(processed logits), before temperature and
      the filters.
    """
    x, mask_empty = process_logits(logits, s, state)
    uses = (jnp.any(s.temperature > 0) & _filtered_only(s)) | jnp.any(s.top_logprobs > 0)
    cands, best = jax.lax.cond(uses,
                               functools.partial(_candidates_and_max, parts=vocab_parts),
                               functools.partial(_no_candidates_and_max, parts=vocab_parts), x)
    tokens = _draw(x, s, cands, vocab_parts)
    norm = _normalizer(x, best)
    logprobs = _chosen_logprobs(x, tokens, norm)
    top_ids, top_lps = jax.lax.cond(jnp.any(s.top_logprobs > 0), _top_logprobs, _no_top_logprobs, x,
                                    s.top_logprobs, norm, cands)
    return SampleOutput(
        tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps, mask_empty=mask_empty
    )
