"""The block-int8 product (model_worker/numerics/q8.py): the CPU kernel built on first use equals its pure-JAX twin bit for
bit on every CPU path, a row's result never depends on the rows beside it, both stay within Q8_0's error of the
float product (an independent numpy float64 reference), a machine without a compiler runs the twin, and programs
lowered for TPU/GPU contain no custom call."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.numerics import q8

# Skipped only without a compiler: where one exists, a kernel that fails to build fails these tests.
pytestmark = [pytest.mark.skipif(q8.compiler() is None, reason="no C++ compiler: the kernel cannot be built here"),
              pytest.mark.cpu_backend]  # the CPU kernel: on an accelerator host, on its CPU backend


def test_the_kernel_builds_where_a_compiler_exists():
    """A build failure degrades the server to the twin with a warning; here it must not happen silently."""
    assert q8.kernel_available(), "the kernel did not build (see the q8 kernel warning in the log)"

SHAPES = [(1, 304, 256), (2, 1024, 640), (5, 64, 2048), (16, 16, 32), (9, 4096, 640), (13, 640, 6144), (3, 48, 96)]


def operands(m: int, n: int, k: int, seed: int = 0):
    """Random activations [m, k] quantized by `quantize_blocks`, int8 weights in [-127, 127] and their scales."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32) * rng.uniform(0.1, 10, (m, 1)).astype(np.float32))
    xq, xs = jax.jit(q8.quantize_blocks)(x)
    wq = jnp.asarray(rng.integers(-127, 128, (n, k)).astype(np.int8))
    ws = jnp.asarray(rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float16))  # GGUF Q8_0 scales are float16
    return x, xq, xs, wq, ws


def kernel(path: int):
    """The kernel on path `path`, taking weights in rows (tiled here, in numpy: `tile_weight`)."""
    f = jax.jit(lambda xq, xs, wt, st: q8.q8_matmul_kernel(xq, xs, wt, st, path=path))
    return lambda xq, xs, wq, ws: f(xq, xs, *q8.tile_weight(wq, ws))


def product(xq, xs, wq, ws):
    """`q8_matmul` (what the model calls) on a tiled weight."""
    return jax.jit(q8.q8_matmul)(xq, xs, q8.q8_weight(wq, ws, tile=True))


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_equals_the_twin_on_every_path(m, n, k):
    """Every path (scalar, AVX2, AVX-512 VNNI; one the CPU lacks falls back) gives the twin's bits."""
    _, xq, xs, wq, ws = operands(m, n, k)
    twin = np.asarray(jax.jit(q8.q8_matmul_twin)(xq, xs, wq, ws))
    for name, path in q8.PATHS.items():
        assert np.array_equal(np.asarray(kernel(path)(xq, xs, wq, ws)), twin), name


def test_the_path_is_chosen_by_the_environment(monkeypatch):
    """`GEMMA_SERVE_Q8_PATH` reaches the kernel through `q8_matmul`; an unknown name is refused with the choices."""
    _, xq, xs, wq, ws = operands(3, 208, 640)
    twin = np.asarray(jax.jit(q8.q8_matmul_twin)(xq, xs, wq, ws))
    for name in ("scalar", "avx2", "vnni"):
        monkeypatch.setenv("GEMMA_SERVE_Q8_PATH", name)
        assert q8.kernel_path() == q8.PATHS[name]
        assert np.array_equal(np.asarray(product(xq, xs, wq, ws)), twin), name
    monkeypatch.setenv("GEMMA_SERVE_Q8_PATH", "sse9")
    with pytest.raises(ValueError, match="scalar"):
        q8.kernel_path()


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Row r computed alone, among 1-15 other rows, at another index: the same bits, kernel and twin."""
    _, xq, xs, wq, ws = operands(16, 512, 640, seed=3)
    for f in (kernel(0), jax.jit(q8.q8_matmul_twin)):
        alone = np.asarray(f(xq[:1], xs[:1], wq, ws))[0]
        for m in (2, 3, 5, 8, 13, 16):
            order = np.roll(np.arange(m), m // 2)  # row 0 lands at index m - m // 2
            out = np.asarray(f(xq[:m][order], xs[:m][order], wq, ws))
            assert np.array_equal(out[int(np.argmin(order))], alone), m


@pytest.mark.parametrize("m,n,k", SHAPES[:4])
def test_close_to_the_float_product(m, n, k):
    """Against numpy float64 on the dequantized weights: Q8_0 activations cost at most ~1% of the output scale
    (each value rounded to 1/254 of its block's range)."""
    x, xq, xs, wq, ws = operands(m, n, k, seed=7)
    w = np.asarray(wq, np.float64) * np.repeat(np.asarray(ws, np.float64), 32, axis=1)
    ref = np.asarray(x, np.float64) @ w.T
    out = np.asarray(kernel(0)(xq, xs, wq, ws), np.float64)
    assert np.abs(out - ref).max() <= 0.01 * np.abs(ref).max()


def test_quantize_blocks_matches_q8_0():
    """Scale = max|x| / 127 per block of 32, values round(x / scale) in [-127, 127]; an all-zero block is 0."""
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.linspace(-3, 2, 32)
    xq, xs = (np.asarray(a) for a in q8.quantize_blocks(jnp.asarray(x)))
    assert xs[0, 0] == np.float32(3) / np.float32(127) and xs[0, 1] == 0 and xs[1].tolist() == [0, 0]
    assert xq[0, 0] == -127 and np.abs(xq).max() == 127 and not xq[0, 32:].any() and not xq[1].any()
    np.testing.assert_allclose(xq[0, :32] * xs[0, 0], x[0, :32], atol=xs[0, 0] / 2 + 1e-7)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8.quantize_blocks(jnp.zeros((1, 40)))


def test_without_a_compiler_the_twin_serves(monkeypatch, tmp_path, caplog):
    """A failed build (the compiler missing) is one warning and no library; `GEMMA_SERVE_Q8_KERNEL=off` makes
    `q8_matmul` the twin, with the same bits as the kernel."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="model_worker.numerics.q8"):
        assert q8._build(tmp_path) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "twin" in caplog.text
    _, xq, xs, wq, ws = operands(4, 96, 640)
    monkeypatch.setenv("GEMMA_SERVE_Q8_KERNEL", "off")
    q8._kernel_available.cache_clear()
    try:
        assert not q8.kernel_available()
        w = q8.q8_weight(wq, ws, tile=True)
        text = jax.jit(q8.q8_matmul).lower(xq, xs, w).as_text()
        assert "custom_call" not in text
        assert np.array_equal(np.asarray(jax.jit(q8.q8_matmul)(xq, xs, w)), np.asarray(kernel(0)(xq, xs, wq, ws)))
        assert not q8.q8_weight(wq, ws).tiled  # without the kernel, weights stay in rows
    finally:
        monkeypatch.undo()
        q8._kernel_available.cache_clear()
        assert q8.kernel_available()


def test_programs_for_tpu_and_gpu_contain_no_custom_call():
    """Lowered on this CPU for CPU, the product calls the kernel; lowered for TPU or CUDA, only XLA ops."""
    _, xq, xs, wq, ws = operands(2, 64, 256)
    traced = jax.jit(q8.q8_matmul).trace(xq, xs, q8.q8_weight(wq, ws, tile=True))
    assert q8.TARGET in traced.lower(lowering_platforms=("cpu",)).as_text()
    for platform in ("tpu", "cuda"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert "custom_call" not in text and q8.TARGET not in text, platform


def test_tiles_hold_the_rows():
    """`tile_weight` then `untile_weight` gives back the rows; a row count that is not a multiple of 16 is refused;
    `Q8Weight.dense` is q * s."""
    _, _, _, wq, ws = operands(1, 48, 96, seed=5)
    w = q8.q8_weight(wq, ws, tile=True)
    assert w.shape == (48, 96) and w.nbytes == 48 * 96 + 48 * 3 * 2  # float16 scales
    back_q, back_s = (np.asarray(a) for a in w.rows())
    assert np.array_equal(back_q, np.asarray(wq)) and np.array_equal(back_s, np.asarray(ws))
    np.testing.assert_array_equal(np.asarray(w.dense()), np.asarray(wq, np.float32) * np.repeat(np.asarray(ws), 32, 1))
    with pytest.raises(ValueError, match="N % 16"):
        q8.tile_weight(np.zeros((8, 32), np.int8), np.zeros((8, 1), np.float32))
    with pytest.raises(ValueError, match="-127"):  # the AVX2 path cannot negate -128
        q8.q8_weight(np.full((16, 32), -128, np.int8), np.ones((16, 1), np.float32))


def test_a_non_finite_row_stays_in_its_row():
    """An activation row with an inf or NaN scale makes that row's outputs non-finite in the kernel and the twin
    alike, never another row's."""
    _, xq, xs, wq, ws = operands(5, 32, 64, seed=11)
    xs = xs.at[0, 0].set(jnp.inf).at[3, 1].set(jnp.nan)
    twin = np.asarray(jax.jit(q8.q8_matmul_twin)(xq, xs, wq, ws))
    assert (~np.isfinite(twin)).any(axis=1).tolist() == [True, False, False, True, False]
    np.testing.assert_array_equal(np.asarray(kernel(0)(xq, xs, wq, ws)), twin)


def test_q8_from_values_is_q8_0():
    """Weights quantized per block of 32: scale max|w| / 127 stored as float16 (as GGUF's Q8_0), |q| <= 127, error
    at most half a step plus what rounding the scale to float16 moves the largest value (127 s 2^-11); integer
    multiples of a power-of-two step come back exactly. A scale float16 cannot hold is refused, not rounded."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    q, s = q8.q8_from_values(w)
    assert s.dtype == np.float16 and np.abs(q).max() == 127
    assert np.array_equal(s, (np.abs(w.reshape(16, 2, 32)).max(-1) / np.float32(127)).astype(np.float16))
    s32 = s.astype(np.float32)[..., None]
    err = np.abs(q.reshape(16, 2, 32) * s32 - w.reshape(16, 2, 32))
    assert (err <= s32 * (0.5 + 127 * 2.0 ** -11) * (1 + 1e-6)).all()
    with pytest.raises(ValueError, match="float16"):
        q8.q8_weight(q, s.astype(np.float32) * np.float32(1 + 2 ** -20))
    exact = (rng.integers(-127, 128, (4, 32)) * 2.0 ** -7).astype(np.float32)
    exact[:, 0] = 127 * 2.0 ** -7
    q, s = q8.q8_from_values(exact)
    assert np.array_equal(q * s.repeat(32, 1), exact)


def test_q8_linear_keeps_the_leading_axes():
    """`q8_linear` on [2, 3, K] activations equals the product of the flattened rows, in the asked dtype."""
    x, xq, xs, wq, ws = operands(6, 32, 64, seed=9)
    w = q8.q8_weight(wq, ws, tile=True)
    y = jax.jit(q8.q8_linear)(x.reshape(2, 3, 64), w)
    assert y.shape == (2, 3, 32) and y.dtype == jnp.float32
    assert np.array_equal(np.asarray(y).reshape(6, 32), np.asarray(jax.jit(q8.q8_matmul_twin)(xq, xs, wq, ws)))
    with pytest.raises(ValueError, match="features"):
        q8.q8_linear(jnp.zeros((1, 32)), w)


def test_the_twin_in_blocks_of_rows_gives_the_same_bits():
    """The twin takes the weight rows in blocks (bounded temporaries for the LM head): any block size, padded or
    not, gives the bits of the whole product."""
    _, xq, xs, wq, ws = operands(3, 1000, 96, seed=13)
    whole = np.asarray(jax.jit(q8.q8_matmul_twin)(xq, xs, wq, ws))
    for block_bytes in (8 * 3 * 3 * 16, 8 * 3 * 3 * 48, 8 * 3 * 3 * 500):  # 16, 48, 496 rows per block
        out = jax.jit(functools.partial(q8.q8_matmul_twin, block_bytes=block_bytes))(xq, xs, wq, ws)
        assert np.array_equal(np.asarray(out), whole), block_bytes


def operands5(m: int, n: int, k: int, seed: int = 0):
    """`operands` with 5-bit weight integers (GGUF Q5_0's u - 16, in [-16, 15])."""
    x, xq, xs, _, ws = operands(m, n, k, seed)
    wq = jnp.asarray(np.random.default_rng(seed + 100).integers(-16, 16, (n, k)).astype(np.int8))
    return x, xq, xs, wq, ws


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_five_bit_tiles_equal_the_twin_on_every_path(m, n, k):
    """5-bit tiles (expanded in registers on AVX-512 VNNI, to int8 tiles on the other paths) give the twin's bits
    for the same integers, on every path, through `q8_matmul` as the model calls it."""
    _, xq, xs, wq, ws = operands5(m, n, k, seed=m + n)
    twin = np.asarray(jax.jit(q8.q8_matmul_twin)(xq, xs, wq, ws))
    w5 = q8.q8_weight(wq, ws, tile=True, bits=5)
    for name, path in q8.PATHS.items():
        out = jax.jit(functools.partial(q8.q8_matmul_kernel, path=path))(xq, xs, w5.q, w5.scale)
        assert np.array_equal(np.asarray(out), twin), name
    assert np.array_equal(np.asarray(jax.jit(q8.q8_matmul)(xq, xs, w5)), twin)


def test_five_bit_tiles_hold_the_rows_in_five_eighths_of_the_bytes():
    """`tile_weight5`: 20 bytes per 32 integers (10 K per 16 rows) that expand back to the rows, with the extreme
    values -16 and 15 in every position of a block; integers outside [-16, 15] are refused; the twin of a 5-bit
    weight reads it as its rows (and lowered for TPU/GPU holds no custom call)."""
    rng = np.random.default_rng(4)
    wq = rng.integers(-16, 16, (32, 64)).astype(np.int8)
    wq[0], wq[1] = -16, 15
    ws = rng.uniform(1e-3, 1e-2, (32, 2)).astype(np.float16)
    w5 = q8.q8_weight(wq, ws, tile=True, bits=5)
    assert w5.q.dtype == jnp.uint8 and w5.q.shape == (2, 640) and w5.shape == (32, 64) and w5.bits == 5
    assert w5.nbytes == 32 * 64 * 5 // 8 + 32 * 2 * 2
    back_q, back_s = (np.asarray(a) for a in w5.rows())
    assert np.array_equal(back_q, wq) and np.array_equal(back_s, ws)
    with pytest.raises(ValueError, match=r"\[-16, 15\]"):
        q8.tile_weight5(np.full((16, 32), 16, np.int8), np.ones((16, 1), np.float16))
    with pytest.raises(ValueError, match="bits"):
        q8.q8_weight(wq, ws, tile=False, bits=5)
    _, xq, xs, _, _ = operands(2, 32, 64)
    traced = jax.jit(q8.q8_matmul).trace(xq, xs, w5)
    assert q8.TARGET5 in traced.lower(lowering_platforms=("cpu",)).as_text()
    for platform in ("tpu", "cuda"):
        assert "custom_call" not in traced.lower(lowering_platforms=(platform,)).as_text(), platform


def test_five_bit_tiles_are_chosen_where_they_pay():
    """By default a tiled weight whose integers fit [-16, 15] gets 5-bit tiles exactly where the kernel's best path
    expands them in registers (AVX-512 VNNI); any wider integer keeps int8 tiles."""
    _, _, _, wq, ws = operands5(1, 32, 64)
    assert q8.q8_weight(wq, ws).bits == (5 if q8.five_bit_pays() else 8)
    flags = q8._cpu_flags().split()
    assert q8.five_bit_pays() == ("avx512_vnni" in flags and "avx512bw" in flags)
    wide = np.asarray(wq).copy()
    wide[3, 7] = 16
    assert q8.q8_weight(wide, ws).bits == 8
