"""Batched sampling (model_worker.modeling.sampling) against a numpy reference of the documented processing order.

Synthetic logits only (fast). The reference follows the module docstring: logit bias, repetition /
frequency / presence penalties, mask -> processed logits; log_softmax of those -> logprobs; temperature,
min-p, top-k, top-p, inverse-CDF draw with the row's uniform number fold_in(fold_in(key(seed_lo), seed_hi),
step).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.modeling import sampling as S

V = 5000  # > MAX_TOP_K, and not a multiple of 32 (the last mask word is partial)
# Log-probabilities against numpy's float64 reference: XLA CPU's exp and log stay within 1e-5 relative; a TPU's are
# hardware approximations, a few ulps looser (a v5e measured 2.5e-5 and 3.8e-5 relative in the device lane).
LP_RTOL = 1e-5 if jax.default_backend() == "cpu" else 1e-4
_sample_jit = jax.jit(S.sample)
_process_jit = jax.jit(S.process_logits)


def _sparse(state):
    """The `PenaltyHistory` `sample` reads, from a dense `PenaltyState` (empty histories of the tests) or as is."""
    return S.history_from_dense(state) if isinstance(state, S.PenaltyState) else state


def _sample(logits, s, state):
    """`sampling.sample`, jitted, on a dense or sparse history."""
    return _sample_jit(logits, s, _sparse(state))


def _process(logits, s, state):
    """`sampling.process_logits`, jitted, on a dense or sparse history."""
    return _process_jit(logits, s, _sparse(state))


# --- numpy reference ----------------------------------------------------------------------------------------


def np_pack(allowed: np.ndarray) -> np.ndarray:
    """Bit-by-bit packing: token 32 * w + b -> bit b of word w."""
    words = np.zeros((len(allowed) + 31) // 32, np.uint64)
    for t in np.flatnonzero(allowed):
        words[t // 32] |= np.uint64(1) << np.uint64(t % 32)
    return words.astype(np.uint32)


def np_unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    """Inverse of np_pack."""
    t = np.arange(vocab)
    return ((words[t // 32] >> (t % 32).astype(np.uint32)) & 1).astype(bool)


def ref_process(logits, s, r, counts, seen):
    """Steps (a)-(c) for row r in float32, as documented (vLLM v1 order)."""
    x = logits[r].astype(np.float32).copy()
    for i, v in zip(s.bias_ids[r], s.bias_vals[r]):
        if 0 <= i < len(x):
            x[i] += v
    p = np.float32(s.repetition_penalty[r])
    if p > 0 and p != 1:
        x = np.where(seen[r], np.where(x > 0, x / p, x * p), x).astype(np.float32)
    x = x - s.frequency_penalty[r] * counts[r].astype(np.float32)
    x = x - s.presence_penalty[r] * (counts[r] > 0).astype(np.float32)
    if s.mask_on[r]:
        allowed = np_unpack(s.mask[r], len(x))
        if allowed.any():
            x = np.where(allowed, x, -np.inf)
    return x.astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log_softmax of a 1-D array that may hold -inf."""
    x = x.astype(np.float64)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def ref_keep(x: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Tokens left by temperature, min-p, top-k, top-p (nucleus: smallest top set with mass >= top_p, ties
    kept)."""
    z = x.astype(np.float64) / temperature
    keep = np.isfinite(z)
    if min_p > 0:
        keep &= z >= z.max() + np.log(min_p)
    if top_k > 0:
        keep &= z >= np.sort(z[keep])[::-1][min(top_k, keep.sum()) - 1]
    if top_p < 1:
        probs = np.where(keep, np.exp(z - z.max()), 0.0)
        probs /= probs.sum()
        order = np.sort(probs[keep])[::-1]
        cut = order[np.searchsorted(np.cumsum(order), top_p * (1 - 1e-7))]
        keep &= probs >= cut
    return keep


def row_uniform(seed, step) -> float:
    """The documented random stream: one U(0, 1] number per (seed, step)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(np.uint32(seed[0])), np.uint32(seed[1])), step)
    return float(1.0 - jax.random.uniform(key, dtype=jnp.float32))


def ref_token(x: np.ndarray, s, r) -> int:
    """Greedy argmax, or the inverse-CDF draw over the kept tokens with the row's uniform number."""
    if s.temperature[r] <= 0:
        return int(np.argmax(x))
    keep = ref_keep(x, s.temperature[r], s.top_k[r], s.top_p[r], s.min_p[r])
    z = x.astype(np.float64) / s.temperature[r]
    probs = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, row_uniform(s.seed[r], s.step[r]) * cdf[-1], side="left"))


# --- helpers ------------------------------------------------------------------------------------------------


def rows(tree, idx):
    """Rows `idx` (a list) of every leaf."""
    return jax.tree.map(lambda a: np.asarray(a)[np.asarray(idx)], tree)


def np_tree(tree):
    """Every leaf as numpy."""
    return jax.tree.map(np.asarray, tree)


def random_logits(batch: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    """Normal logits [batch, vocab] float32 times `scale`."""
    return (np.random.default_rng(seed).standard_normal((batch, vocab)) * scale).astype(np.float32)


def history(batch: int, vocab: int, logits: np.ndarray) -> S.PenaltyHistory:
    """A penalty history: a prompt, then a few generated tokens (some of them the rows' most likely)."""
    rng = np.random.default_rng(7)
    state = S.penalty_history_zeros(batch, 64)
    prompt = rng.integers(0, vocab, (batch, 40)).astype(np.int32)
    prompt[:, -5:] = np.argsort(-logits, axis=1)[:, 5:10]
    prompt[:, :3] = -1  # padding
    state = S.record_prompt(state, jnp.asarray(prompt))
    top = np.argsort(-logits, axis=1)[:, :4]
    for step in range(12):
        tokens = np.where(step % 3 == 0, top[:, step % 4], rng.integers(0, vocab, batch)).astype(np.int32)
        state = S.record(state, jnp.asarray(tokens), jnp.ones(batch, bool))
    return state


def mixed_settings(vocab: int = V) -> S.SamplingArrays:
    """Eight rows, each with a different mix of features."""
    s = S.SamplingArrays.defaults(8, vocab)
    rng = np.random.default_rng(3)
    s.seed[:] = rng.integers(0, 2**32, (8, 2), dtype=np.uint64).astype(np.uint32)
    s.step[:] = rng.integers(0, 1000, 8)
    # row 0: plain greedy.
    # row 1: greedy + logit bias + repetition penalty + 5 top logprobs.
    s.bias_ids[1, :4] = [10, 20, 30, 10]
    s.bias_vals[1, :4] = [5.0, -100.0, 2.5, 1.0]
    s.repetition_penalty[1] = 1.5
    s.top_logprobs[1] = 5
    # row 2: temperature + top-k.
    s.temperature[2], s.top_k[2] = 0.9, 40
    # row 3: temperature + top-p + frequency / presence penalties.
    s.temperature[3], s.top_p[3] = 1.2, 0.8
    s.frequency_penalty[3], s.presence_penalty[3] = 0.7, -0.4
    # row 4: temperature + min-p + mask + 20 top logprobs.
    s.temperature[4], s.min_p[4] = 0.7, 0.1
    s.mask_on[4], s.mask[4] = True, S.pack_mask(rng.random(vocab) < 0.3)
    s.top_logprobs[4] = 20
    # row 5: everything at once.
    s.temperature[5], s.top_k[5], s.top_p[5], s.min_p[5] = 1.0, 100, 0.9, 0.02
    s.repetition_penalty[5], s.frequency_penalty[5], s.presence_penalty[5] = 0.8, 0.3, 0.5
    s.bias_ids[5, :2], s.bias_vals[5, :2] = [1, vocab - 1], [3.0, 4.0]
    s.mask_on[5], s.mask[5] = True, S.pack_mask(rng.random(vocab) < 0.5)
    s.top_logprobs[5] = 3
    # row 6: greedy with a mask that allows nothing.
    s.mask_on[6], s.mask[6] = True, 0
    # row 7: plain temperature sampling.
    s.temperature[7] = 1.0
    return s


@pytest.fixture(scope="module")
def mixed():
    """(logits, settings, state, output) of the mixed batch."""
    logits = random_logits(8)
    s = mixed_settings()
    state = history(8, V, logits)
    return logits, s, state, np_tree(_sample(jnp.asarray(logits), s, state))


# --- host helpers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, V])
def test_pack_mask_layout(vocab):
    allowed = np.random.default_rng(vocab).random(vocab) < 0.4
    words = S.pack_mask(allowed)
    assert words.dtype == np.uint32 and words.shape == ((vocab + 31) // 32,)
    np.testing.assert_array_equal(words, np_pack(allowed))
    np.testing.assert_array_equal(np.asarray(S.unpack_mask(jnp.asarray(words), vocab)), allowed)
    proto_bytes = np.packbits(allowed, bitorder="little").tobytes()  # TokenMask.allowed layout
    np.testing.assert_array_equal(S.mask_words_from_bytes(proto_bytes, vocab), words)


def test_pack_mask_batched_and_bytes_errors():
    allowed = np.random.default_rng(0).random((3, 100)) < 0.5
    np.testing.assert_array_equal(S.pack_mask(allowed), np.stack([np_pack(a) for a in allowed]))
    np.testing.assert_array_equal(S.mask_words_from_bytes(b"\x05", 100), [5, 0, 0, 0])
    with pytest.raises(ValueError):
        S.mask_words_from_bytes(bytes(14), 100)


def test_defaults_shapes_and_dtypes():
    s = S.SamplingArrays.defaults(3, V)
    assert s.seed.shape == (3, 2) and s.seed.dtype == np.uint32
    assert s.bias_ids.shape == s.bias_vals.shape == (3, S.MAX_LOGIT_BIAS)
    assert s.mask.shape == (3, (V + 31) // 32) and s.mask.dtype == np.uint32
    assert s.mask_on.dtype == bool and not s.mask_on.any()
    for leaf in jax.tree.leaves(s):
        assert leaf.shape[0] == 3
    state = S.penalty_state_zeros(3, V)
    assert state.counts.shape == state.seen.shape == (3, V) and state.counts.dtype == jnp.int32


# --- penalty history ----------------------------------------------------------------------------------------


def test_record_updates_active_rows_only():
    state = S.penalty_history_zeros(3, 4)
    state = S.record(state, jnp.array([1, 2, 3], jnp.int32), jnp.array([True, False, True]))
    state = S.record(state, jnp.array([1, 2, -1], jnp.int32), jnp.array([True, True, True]))
    dense = S.dense_from_history(state, 10)
    counts, seen = np.asarray(dense.counts), np.asarray(dense.seen)
    expected = np.zeros((3, 10), np.int32)
    expected[0, 1], expected[1, 2], expected[2, 3] = 2, 1, 1
    np.testing.assert_array_equal(counts, expected)
    np.testing.assert_array_equal(seen, expected > 0)


def test_record_prompt_marks_seen_without_counting():
    prompt = jnp.array([[4, 4, 9, -1], [-1, -1, -1, 0]], jnp.int32)
    state = S.record_prompt(S.penalty_history_zeros(2, 4), prompt)
    assert not np.asarray(state.counts).any()
    np.testing.assert_array_equal(np.asarray(state.ids), [[4, 9, -1, -1], [0, -1, -1, -1]])  # distinct, packed


def test_record_tokens_repeats_capacity_and_clear():
    """Repeated tokens (within one call and across calls) keep one entry each with their counts summed; prompt
    tokens are seen but not counted; a token past the capacity is dropped; cleared rows start empty."""
    state = S.penalty_history_zeros(2, 3)
    tokens = jnp.array([[5, 7, 5, 5, -1], [1, 1, 2, 3, 4]], jnp.int32)
    output = jnp.array([[True, False, True, False, True], [True, True, True, True, True]])
    state = S.record_tokens(state, tokens, tokens >= 0, output)
    np.testing.assert_array_equal(np.asarray(state.ids), [[5, 7, -1], [1, 2, 3]])
    np.testing.assert_array_equal(np.asarray(state.counts), [[2, 0, 0], [2, 1, 1]])  # token 4: past capacity
    state = S.record(state, jnp.array([7, 2], jnp.int32), jnp.array([True, True]))
    np.testing.assert_array_equal(np.asarray(state.counts), [[2, 1, 0], [2, 2, 1]])
    state = S.clear_rows(state, jnp.array([True, False]))
    np.testing.assert_array_equal(np.asarray(state.ids), [[-1, -1, -1], [1, 2, 3]])
    np.testing.assert_array_equal(np.asarray(state.counts), [[0, 0, 0], [2, 2, 1]])


# --- processed logits ---------------------------------------------------------------------------------------


def test_penalties_hand_checked():
    logits = jnp.array([[2.0, -2.0, 1.0, 0.5, 0.0]], jnp.float32)
    s = S.SamplingArrays.defaults(1, 5)
    s.repetition_penalty[0], s.frequency_penalty[0], s.presence_penalty[0] = 2.0, 0.5, 0.25
    state = S.record_prompt(S.penalty_history_zeros(1, 5), jnp.array([[0, 1]], jnp.int32))
    for _ in range(3):
        state = S.record(state, jnp.array([2], jnp.int32), jnp.ones(1, bool))
    x, empty = _process(logits, s, state)
    # token 0: 2 / 2; token 1: -2 * 2; token 2: 1 / 2 (seen when generated) - 0.5 * 3 - 0.25; others as is.
    np.testing.assert_allclose(np.asarray(x[0]), [1.0, -4.0, 0.5 - 1.5 - 0.25, 0.5, 0.0], rtol=1e-6)
    assert not bool(empty[0])


def test_processed_logits_match_reference(mixed):
    logits, s, state, _ = mixed
    x, empty = np_tree(_process(jnp.asarray(logits), s, state))
    dense = S.dense_from_history(state, logits.shape[-1])
    counts, seen = np.asarray(dense.counts), np.asarray(dense.seen)
    for r in range(8):
        np.testing.assert_allclose(x[r], ref_process(logits, s, r, counts, seen), rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(empty, np.arange(8) == 6)


# --- the whole sampler --------------------------------------------------------------------------------------


def test_mixed_batch_matches_reference(mixed):
    logits, s, state, out = mixed
    dense = S.dense_from_history(state, logits.shape[-1])
    counts, seen = np.asarray(dense.counts), np.asarray(dense.seen)
    for r in range(8):
        x = ref_process(logits, s, r, counts, seen)
        lp = log_softmax(x)
        assert out.tokens[r] == ref_token(x, s, r), r
        np.testing.assert_allclose(out.logprobs[r], lp[out.tokens[r]], rtol=LP_RTOL, atol=1e-5)
        n = s.top_logprobs[r]
        np.testing.assert_allclose(out.top_logprobs[r, :n], np.sort(lp)[::-1][:n], rtol=LP_RTOL, atol=1e-5)
        np.testing.assert_allclose(lp[out.top_ids[r, :n]], out.top_logprobs[r, :n], rtol=LP_RTOL, atol=1e-5)
        assert (out.top_ids[r, n:] == -1).all() and (out.top_logprobs[r, n:] == 0).all()
    assert np.isfinite(out.logprobs).all()


def test_row_does_not_depend_on_its_neighbours(mixed):
    logits, s, state, out = mixed
    alone = [np_tree(_sample(jnp.asarray(logits[[r]]), rows(s, [r]), rows(state, [r]))) for r in range(8)]
    perm = [5, 2, 7, 0, 6, 1, 4, 3]
    shuffled = np_tree(_sample(jnp.asarray(logits[perm]), rows(s, perm), rows(state, perm)))
    for field in dataclasses.fields(S.SampleOutput):
        batch = getattr(out, field.name)
        one_by_one = np.concatenate([getattr(a, field.name) for a in alone])
        np.testing.assert_array_equal(one_by_one, batch, field.name)
        np.testing.assert_array_equal(getattr(shuffled, field.name), batch[perm], field.name)


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = random_logits(6, seed=1)
    greedy = S.SamplingArrays.defaults(6, V)
    out = np_tree(_sample(jnp.asarray(logits), greedy, S.penalty_state_zeros(6, V)))
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, axis=1))
    expected = [log_softmax(row)[t] for row, t in zip(logits, out.tokens)]
    np.testing.assert_allclose(out.logprobs, expected, rtol=LP_RTOL)
    k1 = S.SamplingArrays.defaults(6, V)
    k1.temperature[:], k1.top_k[:], k1.seed[:, 0], k1.step[:] = 1.5, 1, np.arange(6), np.arange(6) * 11
    k1_tokens = _sample(jnp.asarray(logits), k1, S.penalty_state_zeros(6, V)).tokens
    np.testing.assert_array_equal(k1_tokens, out.tokens)


def test_argmax_is_the_first_index_of_the_maximum_over_blocks():
    """`_argmax` searches blocks of the row (a vocabulary that is a multiple of the block): numpy's argmax (the
    first index of the maximum) with the maximum in the first, a middle and the last block, ties within a block
    and across blocks, all-equal rows, -inf entries; a NaN row gets an index in range."""
    L = S._ARGMAX_BLOCK
    vocab = 8 * L
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((10, vocab)).astype(np.float32)
    rows[0, 3] = rows[1, 5 * L + 7] = rows[2, vocab - 1] = 9.0  # the maximum in the first, a middle, the last block
    rows[3, [2 * L + 9, 2 * L + 4]] = 9.0  # a tie within a block
    rows[4, [6 * L + 1, 3 * L + 100, 7 * L]] = 9.0  # a tie across blocks
    rows[5] = 1.0  # every entry equal
    rows[6, : 4 * L] = -np.inf  # the first half -inf, the maximum after it
    rows[7, L - 1], rows[7, L] = 9.0, 9.0  # at the edge of two blocks
    out = np.asarray(jax.jit(S._argmax)(jnp.asarray(rows)))
    np.testing.assert_array_equal(out, np.argmax(rows, axis=1))
    rows[8, 17] = np.nan
    assert 0 <= int(jax.jit(S._argmax)(jnp.asarray(rows[8:9]))[0]) < vocab


def test_settings_are_runtime_arrays():
    f = jax.jit(lambda *args: S.sample(*args))  # a fresh function: its own compilation cache
    logits, state = jnp.asarray(random_logits(2, seed=2)), S.penalty_history_zeros(2, 16)
    f(logits, S.SamplingArrays.defaults(2, V), state)
    f(logits, mixed_settings_rows(2), state)
    assert f._cache_size() == 1


def mixed_settings_rows(batch):
    """Rows 4.. of the mixed settings (mask, min-p, penalties, bias, top logprobs all in use)."""
    return rows(mixed_settings(), list(range(4, 4 + batch)))


def test_seeded_sampling_reproducible_and_position_independent():
    logits = np.tile(random_logits(1, seed=4), (6, 1))
    s = S.SamplingArrays.defaults(6, V)
    s.temperature[:] = 1.0
    s.seed[:] = [[1, 2], [3, 4], [1, 2], [5, 6], [1, 2], [1, 2]]
    s.step[:] = [0, 0, 0, 0, 1, 2]
    state = S.penalty_state_zeros(6, V)
    a = np.asarray(_sample(jnp.asarray(logits), s, state).tokens)
    b = np.asarray(_sample(jnp.asarray(logits), s, state).tokens)
    np.testing.assert_array_equal(a, b)
    assert a[0] == a[2]  # same (seed, step) in another position, other neighbours
    rev = list(range(5, -1, -1))
    np.testing.assert_array_equal(_sample(jnp.asarray(logits[rev]), rows(s, rev), state).tokens, a[rev])
    many = S.SamplingArrays.defaults(64, V)
    many.temperature[:], many.seed[:] = 1.0, [1, 2]
    many.step[:] = np.arange(64)
    tokens = _sample(jnp.asarray(np.tile(logits[:1], (64, 1))), many, S.penalty_state_zeros(64, V)).tokens
    assert len(set(np.asarray(tokens).tolist())) > 10  # the step moves the stream
    assert tokens[0] == a[0] and tokens[1] == a[4] and tokens[2] == a[5]


def draws(logits_row: np.ndarray, n: int, **settings) -> np.ndarray:
    """n tokens from one distribution: n rows with the same settings and seed, steps 0..n-1."""
    vocab = len(logits_row)
    s = S.SamplingArrays.defaults(n, vocab)
    for name, value in settings.items():
        getattr(s, name)[:] = value
    s.seed[:], s.step[:] = [12345, 678], np.arange(n)
    logits = jnp.asarray(np.tile(logits_row.astype(np.float32), (n, 1)))
    return np.asarray(_sample(logits, s, S.penalty_state_zeros(n, vocab)).tokens)


def test_temperature_frequencies_match_softmax():
    logits = np.array([1.0, 0.0, -0.5, 2.0, 0.3, -1.0], np.float32)
    n, t = 20000, 0.7
    counts = np.bincount(draws(logits, n, temperature=t), minlength=len(logits))
    p = np.exp(log_softmax(logits / t))
    chi2 = np.sum((counts - n * p) ** 2 / (n * p))
    assert chi2 < 30, (chi2, counts, n * p)  # 5 degrees of freedom: p-value ~ 1e-5


def test_draws_over_blocks_match_softmax_and_never_take_a_zero_probability_token():
    """The inverse-CDF draw locates a block of the row, then a token in it (a vocabulary of whole blocks): the
    frequencies of the tokens holding the mass match softmax, spread over blocks with empty blocks between them,
    and a token of probability 0 (-inf: a mask, a filter) is never drawn, also where the mass sits in the last
    block or in one token at a block's edge."""
    L = S._ARGMAX_BLOCK
    vocab = 8 * L
    logits = np.full(vocab, -np.inf, np.float32)
    hot = [0, L - 1, 3 * L + 17, 3 * L + 18, 8 * L - 1]  # first and edge tokens, two neighbours, the very last
    logits[hot] = [1.0, 0.0, -0.5, 2.0, 0.3]
    n = 20000
    counts = np.bincount(draws(logits, n, temperature=0.7), minlength=vocab)
    assert set(np.flatnonzero(counts)) <= set(hot)
    p = np.exp(log_softmax(logits[hot] / 0.7))
    chi2 = np.sum((counts[hot] - n * p) ** 2 / (n * p))
    assert chi2 < 30, (chi2, counts[hot], n * p)  # 4 degrees of freedom: p-value ~ 1e-5
    for token in (vocab - 1, L, 5 * L - 1):  # all the mass in one token
        one = np.full(vocab, -np.inf, np.float32)
        one[token] = 0.0
        assert set(draws(one, 200, temperature=1.0).tolist()) == {token}
    wide = random_logits(1, vocab, seed=3)[0]  # mass everywhere, some tokens masked out by -inf
    wide[::7] = -np.inf
    assert not np.isin(draws(wide, 2000, temperature=1.5), np.arange(0, vocab, 7)).any()


def test_top_p_keeps_exactly_the_nucleus():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    for top_p, nucleus in [(0.35, {0}), (0.65, {0, 1}), (0.8, {0, 1, 2}), (0.9, {0, 1, 2, 3})]:
        assert set(draws(logits, 3000, temperature=1.0, top_p=top_p).tolist()) == nucleus, top_p


def test_min_p_keeps_tokens_above_the_floor():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    for min_p, kept in [(0.9, {0}), (0.5, {0, 1}), (0.3, {0, 1, 2}), (0.2, {0, 1, 2, 3})]:
        assert set(draws(logits, 3000, temperature=1.0, min_p=min_p).tolist()) == kept, min_p


def test_top_p_applies_to_what_min_p_left():
    """vLLM order: min-p leaves {0.4, 0.3, 0.15} -> 0.47, 0.35, 0.18, whose 0.8-nucleus is {0, 1}.

    (Top-p first would keep {0, 1, 2}: 0.4 + 0.3 < 0.8.)
    """
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    assert set(draws(logits, 3000, temperature=1.0, min_p=0.3, top_p=0.8).tolist()) == {0, 1}


def test_sampled_tokens_are_always_allowed():
    rng = np.random.default_rng(9)
    n = 400
    allowed = rng.random(V) < 0.05
    s = S.SamplingArrays.defaults(n, V)
    s.temperature[:] = np.where(np.arange(n) % 4 == 0, 0.0, 1.5)
    s.top_p[::3], s.min_p[::5] = 0.95, 0.01
    s.mask_on[:], s.mask[:] = True, S.pack_mask(allowed)
    s.top_logprobs[:] = 20
    s.seed[:, 0], s.step[:] = 99, np.arange(n)
    out = np_tree(_sample(jnp.asarray(random_logits(n, seed=5)), s, S.penalty_state_zeros(n, V)))
    assert allowed[out.tokens].all()
    assert np.isfinite(out.logprobs).all() and not out.mask_empty.any()
    assert allowed[out.top_ids].all() and np.isfinite(out.top_logprobs).all()
    assert len(set(out.tokens.tolist())) > 50


def test_mask_with_few_allowed_tokens_pads_top_logprobs():
    s = S.SamplingArrays.defaults(1, V)
    s.mask_on[0], s.mask[0] = True, S.pack_mask(np.isin(np.arange(V), [7, 4999]))
    s.top_logprobs[0], s.temperature[0] = 20, 1.0
    out = np_tree(_sample(jnp.asarray(random_logits(1, seed=6)), s, S.penalty_state_zeros(1, V)))
    assert out.tokens[0] in (7, 4999)
    assert sorted(out.top_ids[0, :2].tolist()) == [7, 4999] and (out.top_ids[0, 2:] == -1).all()
    np.testing.assert_allclose(np.logaddexp(*out.top_logprobs[0, :2]), 0.0, atol=1e-6)
    assert (out.top_logprobs[0, 2:] == 0).all()


def test_empty_mask_falls_back_to_unmasked_and_is_flagged():
    logits = jnp.asarray(random_logits(2, seed=8))
    s = S.SamplingArrays.defaults(2, V)
    s.temperature[1] = 1.0
    free = np_tree(_sample(logits, s, S.penalty_state_zeros(2, V)))
    s.mask_on[:] = True
    s.mask[:] = 0
    s.mask[:, -1] = np.uint32(0xFFFFFFFF) << np.uint32(V % 32)  # only bits past the vocabulary: still empty
    out = np_tree(_sample(logits, s, S.penalty_state_zeros(2, V)))
    assert out.mask_empty.all()
    np.testing.assert_array_equal(out.tokens, free.tokens)
    np.testing.assert_array_equal(out.logprobs, free.logprobs)


def test_logit_bias_forces_and_forbids():
    logits = random_logits(4, seed=10)
    best = np.argmax(logits, axis=1)
    worst = np.argmin(logits, axis=1)
    s = S.SamplingArrays.defaults(4, V)
    s.temperature[2:] = 1.0
    s.seed[:, 0] = np.arange(4)
    s.bias_ids[:, 0], s.bias_vals[:, 0] = worst, 100.0
    out = np_tree(_sample(jnp.asarray(logits), s, S.penalty_state_zeros(4, V)))
    np.testing.assert_array_equal(out.tokens, worst)
    s = S.SamplingArrays.defaults(200, V)
    s.temperature[100:], s.step[:] = 0.5, np.arange(200)
    s.bias_ids[:, 0], s.bias_vals[:, 0] = best[0], -100.0
    out = np_tree(_sample(jnp.asarray(np.tile(logits[:1], (200, 1))), s, S.penalty_state_zeros(200, V)))
    assert (out.tokens != best[0]).all()
    assert (out.tokens[:100] == np.argsort(-logits[0])[1]).all()


def test_top_logprobs_sorted_and_equal_to_log_softmax():
    logits = random_logits(3, seed=11)
    s = S.SamplingArrays.defaults(3, V)
    s.top_logprobs[:] = [20, 0, 7]
    out = np_tree(_sample(jnp.asarray(logits), s, S.penalty_state_zeros(3, V)))
    for r, n in enumerate([20, 0, 7]):
        lp = log_softmax(logits[r])
        assert (np.diff(out.top_logprobs[r, :n]) <= 0).all()
        np.testing.assert_allclose(out.top_logprobs[r, :n], np.sort(lp)[::-1][:n], rtol=LP_RTOL, atol=1e-5)
        np.testing.assert_array_equal(np.sort(out.top_ids[r, :n]), np.sort(np.argsort(-lp)[:n]))
        assert (out.top_ids[r, n:] == -1).all()
    assert out.top_ids[0, 0] == out.tokens[0] and out.top_logprobs[0, 0] == out.logprobs[0]
    off = np_tree(_sample(jnp.asarray(logits), S.SamplingArrays.defaults(3, V), S.penalty_state_zeros(3, V)))
    assert (off.top_ids == -1).all() and (off.top_logprobs == 0).all()


def test_plain_greedy_check():
    s = S.SamplingArrays.defaults(3, V)
    assert S.is_plain_greedy(s, 3)
    s.mask_on[1] = True  # masks are allowed
    assert S.is_plain_greedy(s, 3)
    for field, value in [("temperature", 0.5), ("repetition_penalty", 1.1), ("frequency_penalty", 0.1),
                         ("presence_penalty", -0.1), ("top_logprobs", 2)]:
        t = S.SamplingArrays.defaults(3, V)
        getattr(t, field)[2] = value
        assert not S.is_plain_greedy(t, 3) and S.is_plain_greedy(t, 2), field
    t = S.SamplingArrays.defaults(3, V)
    t.bias_ids[0, 0] = 7
    assert not S.is_plain_greedy(t, 1)
    t = S.SamplingArrays.defaults(3, V)
    t.repetition_penalty[0] = 0.0  # read as 1 (off)
    assert S.is_plain_greedy(t, 3)


def test_greedy_sampler_equals_the_full_one():
    """For plain greedy rows, `sample_greedy` returns `sample`'s outputs bit for bit: unconstrained rows, a mask,
    an empty mask (flagged, mask ignored), with and without any mask in the batch."""
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.standard_normal((4, V)).astype(np.float32) * 3)
    state = S.penalty_history_zeros(4, 16)
    for masked in (False, True):
        s = S.SamplingArrays.defaults(4, V)
        if masked:
            allowed = rng.random((4, V)) < 0.01
            allowed[2] = False
            s.mask[:] = np.stack([np_pack(row) for row in allowed])
            s.mask_on[1:3] = True
        full = jax.jit(S.sample)(logits, s, state)
        fast = jax.jit(S.sample_greedy)(logits, s)
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs", "mask_empty"):
            np.testing.assert_array_equal(np.asarray(getattr(fast, name)), np.asarray(getattr(full, name)), name)
        assert np.asarray(fast.mask_empty).tolist() == [False, False, masked, False]


def test_every_sampling_setting_reaches_its_row():
    """`loop.sampling_rows` copies each of a sequence's settings into its own row: a non-default value of every
    `SamplingSpec` field lands in row 1 and row 0 keeps the defaults (a setting added to both dataclasses needs
    no copying code, and one missing from SamplingArrays fails here)."""
    from model_worker.serving.loop import ROW_SETTINGS, sampling_rows
    from model_worker.serving.sequence import SamplingSpec, Sequence

    spec = SamplingSpec(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=(7 << 32) + 9, presence_penalty=0.5,
                        frequency_penalty=-0.5, repetition_penalty=1.3, bias_ids=(3,), bias_vals=(2.0,),
                        top_logprobs=4)
    assert {f.name for f in dataclasses.fields(SamplingSpec)} == set(ROW_SETTINGS) | {"seed", "bias_ids",
                                                                                       "bias_vals"}
    rows = sampling_rows([Sequence("a", [1, 2], SamplingSpec(), 4, (), None),
                          Sequence("b", [1, 2], spec, 4, (), None)], vocab=64)
    defaults = S.SamplingArrays.defaults(1, 64)
    for name in ROW_SETTINGS:
        assert getattr(rows, name)[1] == pytest.approx(getattr(spec, name)), name
        assert getattr(rows, name)[0] == getattr(defaults, name)[0], name
    assert rows.seed[1].tolist() == [9, 7] and rows.bias_ids[1, 0] == 3 and rows.bias_vals[1, 0] == 2.0


def test_a_top_p_rows_probabilities_threshold_and_draw_do_not_depend_on_its_batch():
    """Top-p's whole-row path over 262,144 flat logits (a nucleus far wider than the candidates): each row's
    probabilities (`row_probabilities`), bisection threshold and seeded draw alone are its bits in a batch of 16.
    XLA CPU's fused `jax.nn.softmax` summed a row in an order that depended on the batch's shape (6 of these 16
    rows' probabilities and 4 thresholds differed between a batch of 1 and of 16)."""
    vocab, batch = 262_144, 16
    x = jnp.asarray(random_logits(batch, vocab, seed=7))
    top_p = jnp.full((batch,), 0.95, jnp.float32)
    probs = jax.jit(S.row_probabilities)
    threshold = jax.jit(lambda x, t: S._bisect(S.row_probabilities(x), t))
    together, lo = np.asarray(probs(x)), np.asarray(threshold(x, top_p))
    assert np.allclose(together.sum(-1), 1.0, atol=1e-5)
    for r in range(batch):
        np.testing.assert_array_equal(np.asarray(probs(x[r:r + 1]))[0], together[r], f"row {r}")
        assert np.asarray(threshold(x[r:r + 1], top_p[r:r + 1]))[0] == lo[r], f"row {r}"
    s = S.SamplingArrays.defaults(batch, vocab)
    s.temperature[:], s.top_p[:], s.seed[:, 0], s.step[:] = 1.0, 0.95, np.arange(batch) + 3, 5
    state = S.penalty_state_zeros(batch, vocab)
    out = np_tree(_sample(x, s, state))
    for r in (0, 5, 11):
        alone = np_tree(_sample(x[r:r + 1], rows(s, [r]), rows(state, [r])))
        assert (alone.tokens[0], alone.logprobs[0]) == (out.tokens[r], out.logprobs[r]), f"row {r}"
