"""The model's float32 transcendental functions (tanh, exp, the tanh GELU, softmax, RoPE's sin and cos, the
norms' rsqrt), made accurate when the
program is traced at float32 "highest" matmul precision.

Why: a TPU's float32 transcendentals are approximations by default. Measured on a TPU v5e with JAX 0.10.2
(`python scripts/float32_probe.py`, max error over 2^20 inputs): tanh 1364 ulp, exp 64 ulp, log 3964 ulp, expm1
1734 ulp, sin and cos 3 ulp, rsqrt 2.1 ulp (the CPU: 0.6 and 1.7); with `accuracy=jax.lax.AccuracyMode.HIGHEST`
tanh, exp, log and expm1 are within 1-7 ulp. At float32 "highest" precision that error
dominates a tiny Gemma 4's logits (the final soft cap's tanh above all, then the MLP's GELU and the attention
softmax's exp): |Δlogit| 6e-4 to 1e-3 against transformers' float64 instead of the ~1e-5 float32 noise; with
those three accurate, 8.9e-5 at worst, 3.5x the noise (the same code on the host's CPU: 1x). RoPE's sin and cos
and the norms' rsqrt ask for the accurate versions too, though that left the figure unchanged (8.87e-5 both
times): the rest is not in these functions.

So when `jax_default_matmul_precision` is "highest" or "float32" at trace time (the worker sets it for
`--matmul-precision float32` off the CPU; the engine traces under it) and the operand is float32, these
helpers ask XLA for its most accurate version; otherwise they are the plain `jnp` functions (faster, and
bfloat16 runs need no more). On the CPU the accurate version is the same computation: the results are
bit-identical either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ACCURATE_PRECISIONS = ("highest", "float32")


def accurate(x: jax.Array) -> bool:
    """Whether a transcendental of x should be asked for `AccuracyMode.HIGHEST`: x is float32 and the
    matmul precision in force while tracing is "highest"/"float32" (see the module docstring for the figures)."""
    precision = jax.config.jax_default_matmul_precision
    return (jnp.result_type(x) == jnp.float32 and precision is not None
            and str(precision).lower() in _ACCURATE_PRECISIONS)


def _apply(op, x) -> jax.Array:
    """`op(x)` for a `jax.lax` transcendental, with `accuracy=HIGHEST` when `accurate(x)`, else XLA's default."""
    x = jnp.asarray(x)
    return op(x, accuracy=lax.AccuracyMode.HIGHEST if accurate(x) else None)


def tanh(x: jax.Array) -> jax.Array:
    """`jnp.tanh(x)`, accurate at float32 "highest" precision (a TPU v5e's default float32 tanh: up to 1364 ulp,
    HIGHEST: a few ulp; JAX 0.10.2). Used by the logit soft cap and the tanh GELU."""
    return _apply(lax.tanh, x)


def exp(x: jax.Array) -> jax.Array:
    """`jnp.exp(x)`, accurate at float32 "highest" precision (a TPU v5e's default float32 exp: up to 64 ulp,
    HIGHEST: a few ulp; JAX 0.10.2). Used by the attention softmax, plain and online."""
    return _apply(lax.exp, x)


def sin(x: jax.Array) -> jax.Array:
    """`jnp.sin(x)`, accurate at float32 "highest" precision (RoPE's rotation angles)."""
    return _apply(lax.sin, x)


def cos(x: jax.Array) -> jax.Array:
    """`jnp.cos(x)`, accurate at float32 "highest" precision (RoPE's rotation angles)."""
    return _apply(lax.cos, x)


def rsqrt(x: jax.Array) -> jax.Array:
    """`jax.lax.rsqrt(x)`, accurate at float32 "highest" precision (the RMS norms' scale)."""
    return _apply(lax.rsqrt, x)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """The tanh GELU, `jax.nn.gelu(x, approximate=True)`'s formula term for term,
    x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x³))), with `tanh` above (the MLP's activation)."""
    x = jnp.asarray(x)
    sqrt_2_over_pi = np.sqrt(2 / np.pi).astype(x.dtype)
    cdf = 0.5 * (1.0 + tanh(sqrt_2_over_pi * (x + 0.044715 * (x ** 3))))
    return x * cdf


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """`jax.nn.softmax(x, axis)`'s forward computation term for term (exp(x - max) / sum), with `exp` above
    (the attention's probabilities). No custom gradient: the model is never differentiated."""
    x = jnp.asarray(x)
    unnormalized = exp(x - jnp.max(x, axis, initial=-np.inf, keepdims=True))
    return unnormalized / jnp.sum(unnormalized, axis, keepdims=True)
