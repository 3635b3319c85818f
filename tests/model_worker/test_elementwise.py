"""`numerics.elementwise`: the model's transcendentals ask XLA for `AccuracyMode.HIGHEST` exactly when traced at
float32 "highest" (or "float32") matmul precision on float32 operands, and compute what the `jnp`/`jax.nn`
functions they replace compute (bit for bit on the CPU, where the accurate version is the same computation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model_worker.numerics import elementwise

HELPERS = {
    "tanh": (elementwise.tanh, jnp.tanh, "stablehlo.tanh"),
    "exp": (elementwise.exp, jnp.exp, "stablehlo.exponential"),
    "gelu_tanh": (elementwise.gelu_tanh, lambda x: jax.nn.gelu(x, approximate=True), "stablehlo.tanh"),
    "sin": (elementwise.sin, jnp.sin, "stablehlo.sine"),
    "cos": (elementwise.cos, jnp.cos, "stablehlo.cosine"),
    "rsqrt": (lambda x: elementwise.rsqrt(jnp.abs(x) + 1), lambda x: jax.lax.rsqrt(jnp.abs(x) + 1), "stablehlo.rsqrt"),
    "softmax": (elementwise.softmax, lambda x: jax.nn.softmax(x, axis=-1), "stablehlo.exponential"),
}


def _ops(fn, x, precision: str, op: str) -> list[str]:
    """The StableHLO lines of `op` in jit(fn)(x) traced under `precision`."""
    with jax.default_matmul_precision(precision):
        text = jax.jit(fn).lower(x).as_text()
    return [line for line in text.splitlines() if f"= {op} " in line]


@pytest.mark.parametrize("name", sorted(HELPERS))
@pytest.mark.parametrize("precision", ["highest", "float32"])
def test_highest_precision_asks_for_highest_accuracy(name, precision):
    fn, _, op = HELPERS[name]
    lines = _ops(fn, jnp.ones((2, 8), jnp.float32), precision, op)
    # JAX 0.10.2 lowers an op with an accuracy next to a dead copy without one (XLA removes it): one will do.
    assert any("result_accuracy" in line and "HIGHEST" in line for line in lines), lines


@pytest.mark.parametrize("name", sorted(HELPERS))
@pytest.mark.parametrize("precision", ["default", "bfloat16"])
def test_other_precisions_keep_the_default_accuracy(name, precision):
    fn, _, op = HELPERS[name]
    lines = _ops(fn, jnp.ones((2, 8), jnp.float32), precision, op)
    assert lines and not any("result_accuracy" in line for line in lines), lines


@pytest.mark.parametrize("name", sorted(HELPERS))
def test_bfloat16_operands_keep_the_default_accuracy(name):
    fn, _, op = HELPERS[name]
    lines = _ops(fn, jnp.ones((2, 8), jnp.bfloat16), "highest", op)
    assert lines and not any("result_accuracy" in line for line in lines), lines


@pytest.mark.cpu_backend
@pytest.mark.parametrize("name", sorted(HELPERS))
def test_same_bits_as_jax_on_cpu(name):
    """On the CPU the helper at "highest" equals the `jnp`/`jax.nn` function bit for bit (the model's float32
    logits before and after the helpers are the same)."""
    fn, ref, _ = HELPERS[name]
    x = jnp.asarray(np.random.default_rng(0).uniform(-12.0, 12.0, (16, 256)).astype(np.float32))
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(jax.jit(fn)(x))
    np.testing.assert_array_equal(ours, np.asarray(jax.jit(ref)(x)))
