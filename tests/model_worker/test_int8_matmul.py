"""The Pallas W8A16 product (model_worker/numerics/int8_matmul.py), in Pallas's interpreter on CPU (on a TPU, in
the device lane, compiled by Mosaic): against a float64 product of the same int8 values within the float32
summation bound, through `int8_linear` where a weight asks for it, and through a whole model's forward.

The bound: the int8 values convert to bfloat16 exactly and a bfloat16 x bfloat16 product is exact in float32, so
y differs from the exact (x . q[n]) * scale[n] only by float32 sums in some order and the one multiply by the
scale: |y - y_exact| <= (K + 2) * 2^-24 * (|x| @ |q|ᵀ) * scale (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., eq. 3.5, with the scale's rounding added).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.modeling.params import at_matmul_mode, random_flat, to_device, with_int8_weights
from model_worker.numerics import int8_matmul as im
from model_worker.numerics.quant import Int8Weight, _takes_kernel, int8_linear, int8_per_channel

ON_TPU = jax.default_backend() == "tpu"


def _weight(rng, n: int, k: int) -> Int8Weight:
    return int8_per_channel(jnp.asarray(rng.standard_normal((n, k)), jnp.float32))


def _bound(x, w: Int8Weight) -> tuple[np.ndarray, np.ndarray]:
    """(the exact product in float64, its float32 summation bound), [M, N] each."""
    x64 = np.asarray(x, np.float64)
    q64, s64 = np.asarray(w.q, np.float64), np.asarray(w.scale, np.float64)[:, 0]
    exact = (x64 @ q64.T) * s64
    k = x64.shape[1]
    return exact, (k + 2) * 2.0**-24 * (np.abs(x64) @ np.abs(q64).T) * s64


@pytest.mark.parametrize("m,n,k,block_n,block_k", [
    (1, 256, 384, 128, 128),  # several tiles both ways: the accumulator across feature tiles
    (3, 640, 1536, 512, 2048),  # n = 5 tiles of 128 (the largest divisor at most 512), one feature tile
    (16, 384, 256, 512, 2048),
    (8, 1536, 2048, 512, 1024),  # E2B's output projection, two feature tiles
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_kernel_is_the_exact_product_within_the_summation_bound(m, n, k, block_n, block_k, dtype):
    rng = np.random.default_rng(m * n + k)
    w = _weight(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    exact, bound = _bound(x, w)
    y = np.asarray(im.int8_matmul(x, w.q, w.scale, out_dtype=jnp.float32, block_n=block_n, block_k=block_k,
                                  interpret=not ON_TPU), np.float64)
    assert y.shape == (m, n)
    assert np.all(np.abs(y - exact) <= bound), float(np.max(np.abs(y - exact) / bound))
    # In x's dtype: that result rounded once (at most half an ulp of the dtype more).
    low = np.asarray(im.int8_matmul(x, w.q, w.scale, block_n=block_n, block_k=block_k, interpret=not ON_TPU))
    assert low.dtype == np.dtype(dtype)
    ulp = 2.0 ** (-8 if dtype == jnp.bfloat16 else -24)
    assert np.all(np.abs(low.astype(np.float64) - exact) <= bound + ulp * np.abs(exact) + 1e-30)


@pytest.mark.parametrize("m,n,k,block_n,block_k", [(1, 256, 384, 128, 128), (8, 1536, 2048, 512, 1024)])
def test_int8_activations_give_the_exact_integer_product_scaled(m, n, k, block_n, block_k):
    """W8A8: the int32 sums are exact, so y is the float64 product of the same integers up to the int32 sum's
    conversion to float32 and the two scale multiplies (three roundings) and the output's."""
    rng = np.random.default_rng(k)
    w = _weight(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)) * np.linspace(0.1, 3.0, m)[:, None], jnp.float32)
    xq, xs = im.quantize_rows(x)
    assert xq.dtype == jnp.int8 and xs.shape == (m, 1)
    assert np.all(np.abs(np.asarray(xq, np.float64) * np.asarray(xs) - np.asarray(x)) <= np.asarray(xs) / 2 + 1e-7)
    exact = (np.asarray(xq, np.float64) @ np.asarray(w.q, np.float64).T) * np.asarray(xs, np.float64) * \
        np.asarray(w.scale, np.float64)[:, 0]
    y = np.asarray(im.int8_matmul(xq, w.q, w.scale, x_scale=xs, out_dtype=jnp.float32, block_n=block_n,
                                  block_k=block_k, interpret=not ON_TPU), np.float64)
    assert np.all(np.abs(y - exact) <= 4 * 2.0**-24 * np.abs(exact) + 1e-30)
    assert im.int8_matmul(xq, w.q, w.scale, x_scale=xs, block_n=block_n, block_k=block_k,
                          interpret=not ON_TPU).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="x_scale"):
        im.int8_matmul(xq, w.q, w.scale, interpret=True)
    with pytest.raises(ValueError, match="x_scale"):
        im.int8_matmul(x, w.q, w.scale, x_scale=xs, interpret=True)


def test_shapes_the_kernel_cannot_tile_are_refused_and_left_to_xla():
    rng = np.random.default_rng(0)
    w = _weight(rng, 200, 256)  # 200 rows: not a multiple of 128
    x = jnp.ones((2, 256), jnp.bfloat16)
    assert not im.fits(2, 200, 256) and not im.fits(im.MAX_ROWS + 1, 256, 256) and im.fits(im.MAX_ROWS, 256, 256)
    with pytest.raises(ValueError, match="do not fit"):
        im.int8_matmul(x, w.q, w.scale, interpret=True)
    with pytest.raises(ValueError, match="do not fit"):
        im.int8_matmul(jnp.ones((im.MAX_ROWS + 1, 128), jnp.bfloat16), w.q[:128, :128], w.scale[:128],
                       interpret=True)
    asked = dataclasses.replace(w, kernel="pallas-interpret")
    assert not _takes_kernel(asked, 2)  # so int8_linear takes XLA's product, which is right too
    x32 = jnp.ones((2, 256), jnp.float32)  # float32: CPU's product dequantizes the weight to x's dtype
    exact, bound = _bound(x32, w)
    y = np.asarray(int8_linear(x32, asked, out_dtype=jnp.float32), np.float64)
    assert np.all(np.abs(y - exact) <= bound)


def test_int8_linear_takes_the_kernel_where_the_weight_asks():
    rng = np.random.default_rng(1)
    w = dataclasses.replace(_weight(rng, 384, 512), kernel="pallas-interpret")
    x = jnp.asarray(rng.standard_normal((2, 3, 512)), jnp.bfloat16)  # leading dims flatten to 6 rows
    assert _takes_kernel(w, 6) and not _takes_kernel(w, im.MAX_ROWS + 1)
    assert not _takes_kernel(dataclasses.replace(w, kernel="xla"), 6)
    y = np.asarray(int8_linear(x, w, out_dtype=jnp.float32), np.float64)
    exact, bound = _bound(x.reshape(6, 512), w)
    assert y.shape == (2, 3, 384)
    assert np.all(np.abs(y.reshape(6, 384) - exact) <= bound)


def _tiny_model():
    """A two-layer Gemma 3 shaped for the kernel's tiles (every projection's sizes multiples of 128)."""
    from families.gemma3.worker import GEMMA3_270M, gemma3_layers

    cfg = dataclasses.replace(GEMMA3_270M, vocab_size=512, hidden_size=256, num_heads=2, embed_scale=16.0,
                              layers=gemma3_layers(2, 128, 1, 512, 1e6, pattern=2), sliding_window=8)
    return cfg, to_device(cfg, random_flat(cfg, seed=3), jnp.bfloat16)


@pytest.mark.slow
def test_a_model_through_the_kernel_gives_the_logits_of_xlas_products():
    """Every projection and the LM head of a bfloat16 model through the kernel (interpreted on CPU): the same
    logits as XLA's products of the same int8 weights, up to the bfloat16 roundings of activations whose float32
    sums differ in order (two layers: a few bfloat16 ulps of the logits' scale)."""
    from model_worker.modeling.kv_cache import KVCache
    from model_worker.modeling.model import forward_jit

    cfg, params = _tiny_model()
    kernel = "pallas" if ON_TPU else "pallas-interpret"
    xla, pallas = with_int8_weights(params, "xla"), with_int8_weights(params, kernel)
    heads = [w for w in jax.tree.leaves(pallas, is_leaf=lambda a: isinstance(a, Int8Weight))
             if isinstance(w, Int8Weight)]
    assert len(heads) == 2 * 7 + 1 and {w.kernel for w in heads} == {kernel}
    tokens = jnp.array([[1, 5, 300, 511], [2, 9, 0, 0]], jnp.int32)
    positions = jnp.array([[0, 1, 2, 3], [0, 1, -1, -1]], jnp.int32)
    out = [np.asarray(forward_jit(p, tokens, positions, KVCache.zeros(cfg, 2, 16, jnp.bfloat16), None, cfg, 16)[0],
                      np.float64) for p in (xla, pallas)]
    scale = np.abs(out[0]).max()
    assert np.abs(out[0]).std() > 1e-3 * scale, "the logits must not be trivially equal"
    assert np.max(np.abs(out[1] - out[0])) <= 2 * 2.0**-8 * scale
    valid = np.asarray(positions) >= 0
    assert (out[1].argmax(-1) == out[0].argmax(-1))[valid].mean() >= 0.8


@pytest.mark.skipif(ON_TPU, reason="checks that a CPU ignores the TPU kernel")
def test_on_cpu_the_pallas_choice_runs_xlas_products_bit_for_bit():
    """`--matmul-kernel pallas` is a TPU choice: a CPU compiles XLA's product for the same weights."""
    rng = np.random.default_rng(2)
    w = _weight(rng, 384, 256)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    asked = dataclasses.replace(w, kernel="pallas")
    assert _takes_kernel(asked, 4)
    np.testing.assert_array_equal(np.asarray(jax.jit(int8_linear)(x, asked)), np.asarray(jax.jit(int8_linear)(x, w)))


def test_the_kernel_choice_is_refused_where_it_does_not_apply():
    cfg, params = _tiny_model()
    with pytest.raises(ValueError, match="int8 weights with bfloat16 activations"):
        at_matmul_mode(cfg, params, "float32", "int8", True, "pallas")
    with pytest.raises(ValueError, match="int8 weights with bfloat16 activations"):
        at_matmul_mode(cfg, params, "bfloat16", "bfloat16", False, "pallas")
    _, converted = at_matmul_mode(cfg, params, "bfloat16", "int8", False, "pallas")
    assert converted.layers[0].q.kernel == "pallas" and converted.lm_head.kernel == "pallas"
    # A model whose weights are int8 already (a GGUF's blocks: groups of 32, offsets) has nothing for the kernel.
    grouped = lambda w: dataclasses.replace(w, kernel="xla", group_size=w.shape[1] // 2,
                                            scale=jnp.repeat(w.scale, 2, axis=1))
    already = dataclasses.replace(converted, layers=[dataclasses.replace(lp, **{
        n: grouped(getattr(lp, n)) for n in ("q", "k", "v", "o", "gate", "up", "down")}) for lp in converted.layers],
        embed=grouped(converted.lm_head), lm_head=None)
    with pytest.raises(ValueError, match="no weight of this model takes the kernel"):
        at_matmul_mode(cfg, already, "bfloat16", "int8", False, "pallas")
    with pytest.raises(ValueError, match="unknown int8 kernel"):
        with_int8_weights(params, "mosaic")
