"""The sampler gives the tokens and log-probabilities of the reference sampler bit for bit (a faster
sampler must not change a seeded draw): `sampling.sample` against `sampling_reference.sample`, the frozen copy of
the sampler as it stood before, over grids of random settings and seeds, several batch sizes and vocabularies
(the real 262,144 included), and logits of several shapes: peaked like a language model's (a small nucleus), flat
(a nucleus of thousands of tokens), quantized (ties everywhere), a single finite logit, bfloat16 values, NaNs.

Every field of `SampleOutput` is compared with `assert_array_equal`: the same bits, not a tolerance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.modeling import sampling as S
from model_worker.numerics.fixed_order import fixed_order_sum
from tests.model_worker import sampling_reference as R

_sample = jax.jit(S.sample)
_old = jax.jit(R.sample)


def _new(logits: jax.Array, s: S.SamplingArrays, state: S.PenaltyState) -> S.SampleOutput:
    """`sampling.sample` on the sparse history of the dense one the reference reads."""
    return _sample(logits, s, S.history_from_dense(state))


def logits_of(kind: str, batch: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, vocab] float32 logits of one shape (module docstring)."""
    x = rng.standard_normal((batch, vocab)).astype(np.float32)
    if kind == "peaked":  # a language model's: a long tail, a few tokens far above it
        x *= 2.0
        for row in x:
            hot = rng.choice(vocab, size=min(40, vocab), replace=False)
            row[hot] = 12.0 + 6.0 * rng.random(len(hot)) ** 3
    elif kind == "flat":
        x *= 3.0
    elif kind == "ties":  # half-unit steps: many equal logits, ties at every threshold
        x = np.round(x * 6.0) / 2.0
    elif kind == "bf16":
        x = np.asarray(jnp.asarray(x * 4.0, jnp.bfloat16).astype(jnp.float32))
    elif kind == "one":  # every logit -inf but one
        x[:] = -np.inf
        x[np.arange(batch), rng.integers(0, vocab, batch)] = 1.5
    elif kind == "nan":  # a broken model: NaN in some rows, one row all NaN
        x[:, rng.integers(0, vocab, 3)] = np.nan
        x[0] = np.nan
    return x.astype(np.float32)


def random_settings(batch: int, vocab: int, rng: np.random.Generator, sampled: float = 0.85) -> S.SamplingArrays:
    """Each row its own random mix of every setting, seed and step."""
    s = S.SamplingArrays.defaults(batch, vocab)
    pick = lambda options: np.asarray(options)[rng.integers(0, len(options), batch)]
    s.temperature[:] = np.where(rng.random(batch) < sampled, pick([0.3, 0.7, 1.0, 1.5, 1e-7, 4.0]), 0.0)
    s.top_p[:] = pick([1.0, 1.0, 0.95, 0.9, 0.5, 1e-6, 0.999, 0.8])
    s.top_k[:] = pick([0, 0, 1, 5, 50, 1024, 3])
    s.min_p[:] = pick([0.0, 0.0, 0.05, 0.5, 1e-4])
    s.seed[:] = rng.integers(0, 2**32, (batch, 2), dtype=np.uint64).astype(np.uint32)
    s.step[:] = rng.integers(0, 10_000, batch)
    s.repetition_penalty[:] = pick([1.0, 1.0, 1.3, 0.8])
    s.frequency_penalty[:] = pick([0.0, 0.0, 0.5, -0.3])
    s.presence_penalty[:] = pick([0.0, 0.0, 0.4, -1.0])
    s.top_logprobs[:] = pick([0, 0, 1, 5, 20])
    for r in np.flatnonzero(rng.random(batch) < 0.3):
        n = rng.integers(1, 6)
        s.bias_ids[r, :n] = rng.integers(0, vocab, n)
        s.bias_ids[r, n - 1] = s.bias_ids[r, 0]  # a duplicate id: the biases add up
        s.bias_vals[r, :n] = rng.choice([100.0, -100.0, 3.5, -2.0, 0.25], n)
    for r in np.flatnonzero(rng.random(batch) < 0.3):
        s.mask_on[r] = True
        s.mask[r] = S.pack_mask(rng.random(vocab) < rng.choice([0.5, 0.01, 0.0]))
    return s


def random_history(batch: int, vocab: int, rng: np.random.Generator) -> S.PenaltyState:
    """Prompt tokens seen, a few generated tokens counted."""
    seen = rng.random((batch, vocab)) < 0.002
    counts = np.where(rng.random((batch, vocab)) < 0.001, rng.integers(1, 4, (batch, vocab)), 0).astype(np.int32)
    return S.PenaltyState(counts=jnp.asarray(counts), seen=jnp.asarray(seen | (counts > 0)))


def assert_same(new: S.SampleOutput, old: S.SampleOutput, what: str) -> None:
    """Every field equal, bit for bit."""
    for field in dataclasses.fields(S.SampleOutput):
        a, b = np.asarray(getattr(new, field.name)), np.asarray(getattr(old, field.name))
        if a.dtype.kind == "f":
            a, b = a.view(np.uint32), b.view(np.uint32)
        np.testing.assert_array_equal(a, b, f"{what}: {field.name}")


def check(kind: str, batch: int, vocab: int, seed: int, rounds: int, sampled: float = 0.85) -> None:
    """`rounds` batches of random settings over one batch of logits: new == old."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(logits_of(kind, batch, vocab, rng))
    state = random_history(batch, vocab, rng)
    for i in range(rounds):
        s = random_settings(batch, vocab, rng, sampled)
        assert_same(_new(logits, s, state), _old(logits, s, state), f"{kind} B={batch} V={vocab} round {i}")


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "bf16", "one", "nan"])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_small_vocab_equals_reference(kind, batch):
    check(kind, batch, 5000, seed=batch * 7 + len(kind), rounds=12)


@pytest.mark.parametrize("vocab", [13, 512, 4096])
def test_tiny_and_block_vocab_equals_reference(vocab):
    for kind in ("peaked", "ties", "one"):
        check(kind, 8, vocab, seed=vocab, rounds=6)


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties"])
def test_real_vocab_equals_reference(kind):
    for batch in (1, 16):
        check(kind, batch, 262_144, seed=batch + len(kind), rounds=3)


def test_many_seeds_one_distribution():
    """One peaked row, 64 steps of one seed and every filter: each draw as the reference's."""
    rng = np.random.default_rng(1)
    row = logits_of("peaked", 1, 262_144, rng)
    logits = jnp.asarray(np.tile(row, (64, 1)))
    state = S.penalty_state_zeros(64, 262_144)
    for temperature, top_p, top_k, min_p in [(0.7, 0.95, 0, 0.0), (1.0, 0.9, 50, 0.05), (1.5, 1.0, 0, 0.0),
                                              (0.7, 0.95, 40, 0.0), (1.5, 0.999, 1024, 0.0)]:
        s = S.SamplingArrays.defaults(64, 262_144)
        s.temperature[:], s.top_p[:], s.top_k[:], s.min_p[:] = temperature, top_p, top_k, min_p
        s.seed[:], s.step[:] = [5, 6], np.arange(64)
        assert_same(_new(logits, s, state), _old(logits, s, state), f"{temperature} {top_p} {top_k} {min_p}")


def test_edge_settings_equal_reference():
    """top_p 1 and tiny, top_k 1 and the largest, min_p near 1, a temperature near 0, greedy rows among sampled
    ones, rows whose mask allows one token or none."""
    rng = np.random.default_rng(2)
    batch, vocab = 12, 5000
    logits = jnp.asarray(logits_of("peaked", batch, vocab, rng))
    s = S.SamplingArrays.defaults(batch, vocab)
    s.temperature[:] = [0, 1, 1, 1, 1, 1e-7, 0.5, 2, 0, 1, 1, 1]
    s.top_p[:] = [1, 1, 1e-9, 1, 0.5, 1, 0.999999, 0.9, 0.9, 1, 1, 0.95]
    s.top_k[:] = [0, 1, 0, S.MAX_TOP_K, 0, 0, 2, 0, 5, 0, 0, 7]
    s.min_p[:] = [0, 0, 0, 0, 0.999, 0, 0, 0.2, 0, 0, 0, 0.01]
    s.seed[:, 0], s.step[:] = np.arange(batch), 3
    s.mask_on[9:], s.mask[9] = True, S.pack_mask(np.arange(vocab) == 17)
    s.mask[10] = 0
    s.top_logprobs[:] = 20
    state = S.penalty_state_zeros(batch, vocab)
    assert_same(_new(logits, s, state), _old(logits, s, state), "edges")


def test_candidate_path_is_taken_and_equals_whole_rows():
    """The fast path (`_sample_candidates`) is sure of its draw for a language model's logits under top-p, top-k or
    min-p, and then draws what the whole rows do (`_sample_whole_rows`); for flat logits under top-p alone, or
    under no filter, it is not sure (the whole rows decide, as `sample` does)."""
    rng = np.random.default_rng(3)
    batch, vocab = 16, 262_144
    peaked = jnp.asarray(logits_of("peaked", batch, vocab, rng))
    peaked = peaked.at[:, :40].set(20.0 + jnp.arange(40.0) / 10)  # a nucleus of a few tokens in every row
    flat = jnp.asarray(logits_of("flat", batch, vocab, rng))
    fast = jax.jit(lambda x, s: S._sample_candidates(x, s, S._candidates(x)))
    whole = jax.jit(S._sample_whole_rows)
    for top_p, top_k, min_p in [(0.95, 0, 0.0), (1.0, 50, 0.0), (1.0, 0, 0.05), (0.9, 40, 0.02)]:
        s = S.SamplingArrays.defaults(batch, vocab)
        s.temperature[:], s.top_p[:], s.top_k[:], s.min_p[:] = 0.8, top_p, top_k, min_p
        s.seed[:, 0], s.step[:] = np.arange(batch), 7
        tokens, sure = fast(peaked, s)
        assert np.asarray(sure).all(), (top_p, top_k, min_p)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(whole(peaked, s)))
    s = S.SamplingArrays.defaults(batch, vocab)
    s.temperature[:], s.top_p[:] = 1.0, 0.95
    assert not np.asarray(fast(flat, s)[1]).any()
    s.top_p[:] = 1.0
    assert not np.asarray(fast(peaked, s)[1]).any()


def test_nucleus_threshold_has_the_reference_bits():
    """Where the candidates decide top-p (`_nucleus`, sure), the threshold has the bits of the reference's bisection
    over the whole row's probabilities (computed as the reference computes them, filters under conds), and so do
    those probabilities in the blocks returned; a token's draw depends on them only through the kept set, so this
    checks what the draws alone would rarely show."""
    rng = np.random.default_rng(4)
    batch, vocab = 16, 262_144
    x = jnp.asarray(logits_of("peaked", batch, vocab, rng))
    s = random_settings(batch, vocab, rng, sampled=1.0)
    s.top_p[:] = rng.choice([0.5, 0.9, 0.95, 0.99], batch)
    s.top_k[:] = rng.choice([0, 0, 5, 50], batch)  # k-th values the candidates hold
    temperature = jnp.maximum(jnp.asarray(s.temperature), 1e-6)

    @jax.jit
    def reference(x, s):
        scaled = x / temperature[:, None]
        scaled = jax.lax.cond(jnp.any(s.min_p > 0), R._min_p_filter, R._skip, scaled, s.min_p)
        scaled = jax.lax.cond(jnp.any(s.top_k > 0), R._top_k_filter, R._skip, scaled, s.top_k)
        terms = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # as the reference's `_top_p_filter`
        probs = terms / fixed_order_sum(terms)[..., None]
        return S._bisect(probs, s.top_p), probs

    @jax.jit
    def fast(x, s):
        cands = S._candidates(x)
        floor = jnp.max(cands.vals / temperature[:, None], axis=-1) + jnp.log(jnp.maximum(s.min_p, 1e-30))
        kth = S._kth_largest(jnp.where((s.min_p[:, None] <= 0) | (cands.vals / temperature[:, None] >= floor[:, None]),
                                       cands.vals / temperature[:, None], -jnp.inf), s.top_k)
        col = lambda a, z: a.reshape((batch,) + (1,) * (z.ndim - 1))

        def filtered(v):
            z = v / col(temperature, v)
            z = jnp.where((col(s.min_p, z) <= 0) | (z >= col(floor, z)), z, -jnp.inf)
            return jnp.where((col(s.top_k, z) <= 0) | (z >= col(kth, z)), z, -jnp.inf)

        return S._nucleus(x, s.top_p, filtered)

    lo_ref, probs_ref = reference(x, s)
    lo, sure, blocks, probs = fast(x, s)
    sure = np.asarray(sure)
    assert sure.sum() >= batch // 2
    np.testing.assert_array_equal(np.asarray(lo).view(np.uint32)[sure], np.asarray(lo_ref).view(np.uint32)[sure])
    ref_blocks = np.take_along_axis(np.asarray(probs_ref).reshape(batch, -1, 512), np.asarray(blocks)[:, :, None], 1)
    np.testing.assert_array_equal(np.asarray(probs).view(np.uint32), ref_blocks.view(np.uint32))


def test_rows_on_candidates_and_whole_rows_mixed_equal_reference():
    """One batch whose rows take every way through the draw: top-p decided on the candidates (top-k or min-p cut
    the rest), top-p from the whole row's probabilities (`_nucleus`: top-p alone on flat logits), both in one batch,
    beside greedy rows, top-p 1.0 and tiny, top-k past the vocabulary, a NaN row and a row of -inf but a few
    tokens: the reference's tokens and log-probabilities over the whole vocabulary, for several seeds."""
    rng = np.random.default_rng(11)
    batch, vocab = 16, 262_144
    x = logits_of("peaked", batch, vocab, rng)
    x[8:14] = logits_of("flat", 6, vocab, rng)
    x[14] = np.nan
    x[15] = -np.inf
    x[15, rng.choice(vocab, 5, replace=False)] = [3.0, 3.0, 1.0, -2.0, 7.5]
    logits = jnp.asarray(x)
    state = random_history(batch, vocab, rng)
    s = S.SamplingArrays.defaults(batch, vocab)
    s.temperature[:] = [0.7, 1.0, 0.0, 1.5, 0.7, 1.0, 0.3, 1.0, 1.0, 0.7, 1.0, 0.0, 1.5, 1.0, 1.0, 0.8]
    s.top_p[:] = [0.95, 0.9, 1.0, 0.5, 1e-6, 0.95, 0.999, 1.0, 0.95, 0.9, 0.5, 0.95, 1e-6, 0.95, 0.9, 0.7]
    s.top_k[:] = [50, 0, 0, 5, 0, 300_000, 0, 40, 0, 0, 50, 0, 0, 300_000, 50, 0]
    s.min_p[:] = [0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    s.top_logprobs[:] = rng.choice([0, 5, 20], batch)
    for seed in range(4):
        s.seed[:] = rng.integers(0, 2**32, (batch, 2), dtype=np.uint64).astype(np.uint32)
        s.step[:] = rng.integers(0, 10_000, batch)
        assert_same(_new(logits, s, state), _old(logits, s, state), f"seed round {seed}")


def test_logit_bias_entries_equal_reference():
    """The logit bias computed on its entries and written into the masked row (`_correct_biased`) gives the
    reference's scatter-then-penalties bits: up to every column used, ids out of range, a token given many times
    (its values added in column order), penalties on biased tokens, logits of +-0.0 and tiny values."""
    rng = np.random.default_rng(5)
    process, old = jax.jit(S.process_logits), jax.jit(R.process_logits)
    new = lambda x, s, state: process(x, s, S.history_from_dense(state))
    for vocab in (13, 5000):
        batch = 8
        x = jnp.asarray(rng.standard_normal((batch, vocab)).astype(np.float32) * 3)
        x = x.at[:, :4].set(jnp.array([0.0, -0.0, 1e-30, -1e-30]))
        state = random_history(batch, vocab, rng)
        state = S.PenaltyState(counts=state.counts.at[:, :6].set(jnp.array([0, 0, 1, 0, 2, 7])),
                               seen=state.seen.at[:, :6].set(jnp.array([True, False, True, True, True, True])))
        for trial in range(8):
            s = random_settings(batch, vocab, rng)
            s.bias_ids[:], s.bias_vals[:] = -1, 0.0
            for r in range(batch):
                n = rng.integers(0, S.MAX_LOGIT_BIAS + 1) if trial % 3 == 0 else rng.integers(0, 10)
                cols = rng.choice(S.MAX_LOGIT_BIAS, n, replace=False) if trial % 2 else np.arange(n)
                s.bias_ids[r, cols] = rng.integers(-3, vocab + 3, n) if trial % 4 else rng.integers(0, 6, n)
                s.bias_vals[r, cols] = rng.choice([100.0, -100.0, 3.5, -2.0, 0.25, 1e-7, 1 / 3, 0.0, -0.0], n)
            a, b = new(x, s, state), old(x, s, state)
            for got, want, name in zip(a, b, ("logits", "mask_empty")):
                got, want = np.asarray(got), np.asarray(want)
                if got.dtype.kind == "f":
                    got, want = got.view(np.uint32), want.view(np.uint32)
                np.testing.assert_array_equal(got, want, f"V={vocab} trial {trial}: {name}")


def _kept_by_reference(z: jax.Array, top_p: jax.Array) -> np.ndarray:
    """The reference's top-p kept set of rows of filtered values z."""
    return np.asarray(jax.jit(R._top_p_filter)(z, top_p) > -jnp.inf)


def test_nucleus_in_candidates_keeps_the_reference_set():
    """Where `_nucleus_in_candidates` is sure, {z >= level} is the set the reference's bisection keeps, over rows
    of many shapes (peaked, ties, bfloat16 steps, a few tokens 1 ulp apart, flat after top-k) and top-p values
    at and next to the masses of the rows' largest tokens; where it is not, `sample` takes the whole row. Most rows
    with a usual top-p (0.5-0.99, or tiny) are decided on the candidates; a top-p placed within the float32 `exp`'s
    error of a mass is not decidable there, and that error is per backend (`sampling._exp_error`: 16x wider on a
    TPU, where ~2% of such rows were sure against ~25% on CPU), so the coverage is asserted on the usual values."""
    rng = np.random.default_rng(6)
    fn = jax.jit(S._nucleus_in_candidates)
    sure_usual = usual = 0
    for kind in ("peaked", "ties", "bf16", "ulps", "flat"):
        for _ in range(4):
            batch, n = 64, 1024
            z = logits_of("peaked" if kind in ("ulps", "flat") else kind, batch, n, rng)
            if kind == "ulps":  # the largest values one or two ulps apart
                z[:, :6] = np.nextafter(np.float32(20.0), np.float32(30.0), dtype=np.float32)
                z[:, 1] = np.float32(20.0)
                z[:, 3] = np.nextafter(z[:, 3], np.float32(0), dtype=np.float32)
            k = rng.choice([1, 5, 30, 64, 200], batch)
            kth = -np.sort(-z, axis=1)[np.arange(batch), k - 1]
            z = np.where(z >= kth[:, None], z, -np.inf).astype(np.float32)
            probs = np.asarray(jax.nn.softmax(jnp.asarray(z), axis=-1))
            top = -np.sort(-probs, axis=1)
            mass = np.cumsum(top, axis=1, dtype=np.float32)[np.arange(batch), rng.integers(0, 8, batch)]
            at_mass = rng.random(batch) < 0.5
            top_p = np.where(at_mass, mass * rng.choice([1.0, 1 - 2**-23, 1 + 2**-23, 1 - 2**-12], batch),
                             rng.choice([0.5, 0.9, 0.95, 0.99, 1e-6], batch)).astype(np.float32)
            top_p = np.minimum(top_p, np.float32(0.999999))
            level, sure = fn(jnp.asarray(z), jnp.asarray(top_p))
            sure = np.asarray(sure)
            want = _kept_by_reference(jnp.asarray(z), jnp.asarray(top_p))
            got = z >= np.asarray(level)[:, None]
            np.testing.assert_array_equal(got[sure], want[sure], kind)
            sure_usual, usual = sure_usual + sure[~at_mass].sum(), usual + (~at_mass).sum()
    # Measured: 528 of 640 on CPU, 484 of 640 on a TPU v5e.
    assert sure_usual >= 2 * usual // 3, (sure_usual, usual)


def test_full_settings_decide_top_p_on_candidates():
    """Temperature, top-p, top-k, min-p, penalties, logit bias and top logprobs at once over a language model's
    logits: top-p is decided on the candidates in every row (no whole-row pass), with the reference's tokens and
    log-probabilities; and top-p values right at the mass of the rows' largest tokens give the reference's too."""
    rng = np.random.default_rng(7)
    batch, vocab = 16, 262_144
    logits = jnp.asarray(logits_of("peaked", batch, vocab, rng))
    state = random_history(batch, vocab, rng)
    s = S.SamplingArrays.defaults(batch, vocab)
    s.temperature[:], s.top_p[:], s.top_k[:], s.min_p[:], s.top_logprobs[:] = 0.7, 0.95, 50, 0.05, 5
    s.repetition_penalty[:], s.frequency_penalty[:], s.presence_penalty[:] = 1.1, 0.2, 0.1
    s.bias_ids[:, :3], s.bias_vals[:, :3] = [7, 1000, 2000], [2.0, -100.0, 1.5]
    s.seed[:, 0], s.step[:] = np.arange(batch), 11
    x, _ = jax.jit(S.process_logits)(logits, s, S.history_from_dense(state))

    @jax.jit
    def small(x, s):
        cands = S._candidates(x)
        z = cands.vals / jnp.maximum(s.temperature, 1e-6)[:, None]
        z = R._min_p_filter(z, s.min_p)
        z = jnp.where(z >= S._kth_largest(z, s.top_k)[:, None], z, -jnp.inf)
        return S._nucleus_in_candidates(z, s.top_p)[1]

    assert np.asarray(small(x, s)).all()
    assert_same(_new(logits, s, state), _old(logits, s, state), "full")
    for top_p in (0.3, 0.5, 0.8, 0.99):
        s.top_p[:] = top_p
        for step in range(3):
            s.step[:] = step
            assert_same(_new(logits, s, state), _old(logits, s, state), f"top_p {top_p} step {step}")


def test_zero_maximum_of_either_sign_equals_reference():
    """Rows whose maximum is 0 held as -0.0, +0.0 or both (the row maximum now comes from the candidates' block
    maxima, whose zero may have the other sign than `jnp.max`'s): the same tokens and log-probabilities, with top
    logprobs, greedy and sampled, over the whole vocabulary and a small one."""
    for vocab in (5000, 262_144):
        batch = 6
        x = np.full((batch, vocab), -np.inf, np.float32)
        x[:, 100:110] = -3.0
        x[0, 7], x[1, 7], x[2, [7, 9000 % vocab]], x[3, [9000 % vocab, 7]] = -0.0, 0.0, [-0.0, 0.0], [-0.0, 0.0]
        x[4, 7], x[5, 7] = -0.0, -0.0
        x[5, 200:] = np.where(np.arange(vocab - 200) % 3 == 0, -0.0, -40.0)
        s = S.SamplingArrays.defaults(batch, vocab)
        s.temperature[:] = [0, 0.7, 0, 1.0, 0.5, 1.0]
        s.top_p[:], s.top_logprobs[:], s.top_k[:] = [1, 0.9, 1, 0.5, 1, 0.95], 5, [0, 0, 0, 3, 0, 0]
        s.seed[:, 0], s.step[:] = np.arange(batch), 1
        state = S.penalty_state_zeros(batch, vocab)
        assert_same(_new(jnp.asarray(x), s, state), _old(jnp.asarray(x), s, state), f"V={vocab}")


def test_recorded_histories_equal_reference():
    """Histories built as the engine builds them (`record_tokens`: prompt chunks, then generated tokens, each
    repeated within a chunk and across steps, -1 padding), one row holding every token of the vocabulary (the
    most `penalty_capacity` can ask for) and one empty: the sparse history's draw and log-probabilities equal the
    reference's on the same history, dense, with penalties of either sign, logit biases on seen and unseen tokens,
    masks, and logits of +-0.0."""
    rng = np.random.default_rng(11)
    batch, vocab = 6, 512
    history = S.penalty_history_zeros(batch, vocab)
    for _ in range(3):  # prompt chunks: ids drawn from a few, so they repeat
        history = S.record_prompt(history, jnp.asarray(rng.integers(-1, 40, (batch, 24)), jnp.int32))
    every = np.full((batch, vocab), -1, np.int32)
    every[1] = np.arange(vocab)  # row 1: every token of the vocabulary
    history = S.record_prompt(history, jnp.asarray(every))
    for step in range(20):  # generated tokens, some repeated, some new
        tokens = rng.integers(0, 60, batch).astype(np.int32)
        history = S.record(history, jnp.asarray(tokens), jnp.asarray(np.arange(batch) != 5))  # row 5: nothing
    history = S.clear_rows(history, jnp.asarray(np.arange(batch) == 4))  # row 4: a fresh sequence
    dense = S.dense_from_history(history, vocab)
    ids = np.asarray(history.ids)
    assert (ids[1] >= 0).all() and not (ids[4] >= 0).any()
    for row in ids:  # distinct, packed at the front
        kept = row[row >= 0]
        assert len(set(kept.tolist())) == len(kept) and (row[len(kept):] == -1).all()
    for trial in range(6):
        logits = logits_of(["peaked", "ties", "flat"][trial % 3], batch, vocab, rng)
        logits[:, :6] = [0.0, -0.0, -0.0, 0.0, 1e-30, -1e-30]
        s = random_settings(batch, vocab, rng)
        s.frequency_penalty[:] = rng.choice([0.0, 0.5, -0.3, -0.0], batch)
        s.presence_penalty[:] = rng.choice([0.0, 0.4, -1.0, -0.0], batch)
        s.repetition_penalty[:] = rng.choice([1.0, 1.3, 0.8], batch)
        s.bias_ids[:, :4] = [1, 2, int(ids[0, 0]), vocab - 1]
        s.bias_vals[:, :4] = [0.0, -0.0, 2.5, -1.0]
        x = jnp.asarray(logits)
        assert_same(_sample(x, s, history), _old(x, s, dense), f"trial {trial}")


def test_histories_longer_than_a_search_chunk_equal_reference():
    """Rows of thousands of distinct tokens (past `_SEARCH_CHUNK` and many `_HISTORY_CHUNK`s; one row every
    token of the vocabulary, generated twice over): `record_tokens` keeps the counts a dense history would, chunk
    by chunk, and the draw and log-probabilities equal the reference's on it."""
    rng = np.random.default_rng(12)
    batch, vocab = 3, 8192
    history = S.penalty_history_zeros(batch, vocab)
    counts, seen = np.zeros((batch, vocab), np.int32), np.zeros((batch, vocab), bool)
    for step in range(40):
        tokens = np.full((batch, 512), -1, np.int32)
        tokens[0] = np.arange(512 * (step % 16), 512 * (step % 16 + 1))  # every token, twice
        tokens[1] = rng.integers(0, 3000, 512)  # repeats within and across chunks
        output = np.broadcast_to(np.arange(batch) == 0, (512, batch)).T | (rng.random((batch, 512)) < 0.5)
        history = S.record_tokens(history, jnp.asarray(tokens), jnp.asarray(tokens >= 0), jnp.asarray(output))
        for b in range(batch):
            ok = tokens[b] >= 0
            seen[b, tokens[b, ok]] = True
            np.add.at(counts[b], tokens[b, ok & output[b]], 1)
    dense = S.dense_from_history(history, vocab)
    np.testing.assert_array_equal(np.asarray(dense.seen), seen)
    np.testing.assert_array_equal(np.asarray(dense.counts), counts)
    for trial in range(3):
        s = random_settings(batch, vocab, rng)
        s.repetition_penalty[:], s.frequency_penalty[:], s.presence_penalty[:] = 1.2, [0.3, -0.2, 0.1], 0.4
        x = jnp.asarray(logits_of("peaked", batch, vocab, rng))
        assert_same(_sample(x, s, history), _old(x, s, dense), f"trial {trial}")
