"""In-place attention over cache rows (`attention.attend_in_place`, `attention._attend_blocks`) against the
one-shot `attention.attend` over gathered keys, and a whole forward pass with many key blocks against one block.

`attend` is the reference here because it is itself pinned to transformers by the numerics tests; the blocked
loop only changes the summation order (an online softmax), so results agree to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.modeling import attention, model
from model_worker.modeling.attention import attend
from model_worker.modeling.kv_cache import KVCache, dequantize_kv, quantize_kv

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`

S, T, K, N, D = 3, 2048, 2, 4, 16
TOL = 2e-5


def _cache(rng, int8: bool, length: int = T):
    k = rng.standard_normal((S, length, K, D), dtype=np.float32)
    v = rng.standard_normal((S, length, K, D), dtype=np.float32)
    if not int8:
        return KVCache(k=[jnp.asarray(k)], v=[jnp.asarray(v)], k_scale=[None], v_scale=[None])
    (kq, ks), (vq, vs) = quantize_kv(jnp.asarray(k)), quantize_kv(jnp.asarray(v))
    return KVCache(k=[kq], v=[vq], k_scale=[ks], v_scale=[vs])


def _reference(q, cache, slots, q_pos, window, scale):
    """One-shot attention over each row's gathered cache row (keys at index = position)."""
    keys = dequantize_kv(jnp.take(cache.k[0], slots, axis=0), _take(cache.k_scale[0], slots), jnp.float32)
    vals = dequantize_kv(jnp.take(cache.v[0], slots, axis=0), _take(cache.v_scale[0], slots), jnp.float32)
    length = keys.shape[1]
    k_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (len(slots), length))
    return attend(q, keys, vals, q_pos, k_pos, window, scale)


def _take(a, slots):
    return None if a is None else jnp.take(a, slots, axis=0)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("window", [None, 700])
def test_blocked_full_layer_attention_equals_one_shot(int8, window):
    """Rows at positions on and around block boundaries (0, 511, 512, 1500 and a 4-token chunk crossing 1024),
    a padding query, and a row whose KV bucket (kv_len) is smaller than the cache: same outputs as `attend`."""
    rng = np.random.default_rng(0)
    cache = _cache(rng, int8)
    scale = 0.25
    slots = jnp.asarray([2, 0, 1], jnp.int32)
    # decode: one query per row
    q = jnp.asarray(rng.standard_normal((3, 1, N, D), dtype=np.float32))
    for positions in ([[0], [511], [512]], [[1500], [-1], [2047]]):
        q_pos = jnp.asarray(positions, jnp.int32)
        got = attention.attend_in_place(q, cache, 0, slots, q_pos, None, window, scale, jnp.float32, T)
        want = _reference(q, cache, slots, q_pos, window, scale)
        valid = np.asarray(q_pos)[:, 0] >= 0
        np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=TOL, rtol=TOL)
        assert np.isfinite(np.asarray(got)).all()
    # a chunk of 4 tokens crossing a block boundary, with a padded tail, in a 1536-position KV bucket
    q = jnp.asarray(rng.standard_normal((1, 6, N, D), dtype=np.float32))
    q_pos = jnp.asarray([[1021, 1022, 1023, 1024, -1, -1]], jnp.int32)
    got = attention.attend_in_place(q, cache, 0, slots[:1], q_pos, None, window, scale, jnp.float32, 1536)
    want = _reference(q, cache, slots[:1], q_pos, window, scale)
    np.testing.assert_allclose(np.asarray(got)[0, :4], np.asarray(want)[0, :4], atol=TOL, rtol=TOL)


def test_cache_length_not_a_multiple_of_the_block():
    """T = 2000 with 512-key blocks: the last block's slice is moved back to end at T and its already-counted keys
    are masked, so rows near the end (and in the middle) still match `attend`."""
    rng = np.random.default_rng(3)
    cache = _cache(rng, False, 2000)
    slots = jnp.asarray([0, 1, 2], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 1, N, D), dtype=np.float32))
    q_pos = jnp.asarray([[1999], [1600], [1490]], jnp.int32)
    got = attention.attend_in_place(q, cache, 0, slots, q_pos, None, None, 0.25, jnp.float32, 2000)
    want = _reference(q, cache, slots, q_pos, None, 0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


def test_blocked_loop_reads_only_the_blocks_a_row_needs():
    """Keys past a row's position are never read: poisoning them with NaN leaves the output finite and equal."""
    rng = np.random.default_rng(1)
    cache = _cache(rng, False)
    q = jnp.asarray(rng.standard_normal((1, 1, N, D), dtype=np.float32))
    q_pos = jnp.asarray([[700]], jnp.int32)
    slots = jnp.asarray([1], jnp.int32)
    want = attention.attend_in_place(q, cache, 0, slots, q_pos, None, None, 0.25, jnp.float32, T)
    poisoned = KVCache(k=[cache.k[0].at[1, 1024:].set(jnp.nan)], v=[cache.v[0].at[1, 1024:].set(jnp.nan)],
                       k_scale=[None], v_scale=[None])
    got = attention.attend_in_place(q, poisoned, 0, slots, q_pos, None, None, 0.25, jnp.float32, T)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    poisoned = KVCache(k=[cache.k[0].at[1, 512:].set(jnp.nan)], v=[cache.v[0]], k_scale=[None], v_scale=[None])
    got = attention.attend_in_place(q, poisoned, 0, slots, q_pos, None, None, 0.25, jnp.float32, T)
    assert np.isnan(np.asarray(got)).any()  # the block holding position 700 is read (the check can fail)


def test_forward_with_many_key_blocks_equals_one_block(monkeypatch, tmp_path):
    """The tiny Gemma 4 model (full and sliding layers, shared KV) prefilled in chunks and decoded: blocks of 16
    keys give the same logits as one block of the whole cache."""
    from model_worker.checkpoints.hf_loader import load_checkpoint
    from model_worker.modeling.params import to_device
    from tests.gemma4_tiny import SHARED, write_checkpoint

    write_checkpoint(SHARED, tmp_path)
    cfg, flat = load_checkpoint(tmp_path, jnp.float32)
    params = to_device(cfg, flat, jnp.float32)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 512, 45).tolist()

    def run(block):
        monkeypatch.setattr(attention, "KEY_BLOCK", block)
        # jitted after the patch, so the trace reads this block size (eager dispatch took ~25 s)
        forward = jax.jit(functools.partial(model.forward, cfg=cfg, kv_len=128))
        cache = KVCache.zeros(cfg, 2, 128, jnp.float32, slack=4)
        out = []
        for start in range(0, 48, 16):  # prefill in 16-token chunks (the last one padded)
            ids = prompt[start:start + 16]
            toks = np.zeros((1, 16), np.int32)
            toks[0, :len(ids)] = ids
            pos = np.full((1, 16), -1, np.int32)
            pos[0, :len(ids)] = np.arange(start, start + len(ids))
            logits, cache = forward(params, jnp.asarray(toks), jnp.asarray(pos), cache, jnp.asarray([1]),
                                    logit_rows=jnp.asarray([len(ids) - 1]))
        out.append(np.asarray(logits))
        token = int(np.argmax(out[-1][0]))
        for p in range(45, 60):  # decode
            logits, cache = forward(params, jnp.asarray([[token], [0]]), jnp.asarray([[p], [-1]]), cache,
                                    jnp.asarray([1, 0]), logit_rows=jnp.asarray([0, 0]))
            out.append(np.asarray(logits)[:1])
            token = int(np.argmax(out[-1][0]))
        return np.concatenate(out)

    many, one = run(16), run(512)
    np.testing.assert_allclose(many, one, atol=2e-4, rtol=0)
