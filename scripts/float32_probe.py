"""How accurate this JAX backend's float32 arithmetic is, against numpy's float64: elementwise functions (in
units in the last place of the float32 answer) and a matrix product at each matmul precision (relative error).

Why: numerics tests bound our float32 logits by transformers' float32 error on the CPU; an accelerator's float32
transcendentals may be less accurate than the CPU's, and this says by how much, one number per operation.

    python scripts/float32_probe.py            # the default backend (the chip on a TPU host)
    JAX_PLATFORMS=cpu python scripts/float32_probe.py

Prints one line per operation: the backend, max and mean |error| in float32 ulps over 2^20 inputs
(the spacing at 1e-3 where the answer is smaller).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

OPS = {  # name: (jax function, numpy float64 function, input range)
    "tanh": (jnp.tanh, np.tanh, (-8.0, 8.0)),
    "tanh_small": (jnp.tanh, np.tanh, (-0.5, 0.5)),
    "exp": (jnp.exp, np.exp, (-20.0, 10.0)),
    "expm1": (jnp.expm1, np.expm1, (-1.0, 1.0)),
    "log": (jnp.log, np.log, (1e-3, 1e3)),
    "rsqrt": (jax.lax.rsqrt, lambda x: 1 / np.sqrt(x), (1e-3, 1e3)),
    "reciprocal": (lambda x: 1 / x, lambda x: 1 / x, (1e-3, 1e3)),
    "tanh@highest": (lambda x: jax.lax.tanh(x, accuracy=jax.lax.AccuracyMode.HIGHEST), np.tanh, (-8.0, 8.0)),
    "exp@highest": (lambda x: jax.lax.exp(x, accuracy=jax.lax.AccuracyMode.HIGHEST), np.exp, (-20.0, 10.0)),
    "log@highest": (lambda x: jax.lax.log(x, accuracy=jax.lax.AccuracyMode.HIGHEST), np.log, (1e-3, 1e3)),
    "expm1@highest": (lambda x: jax.lax.expm1(x, accuracy=jax.lax.AccuracyMode.HIGHEST), np.expm1, (-1.0, 1.0)),
    "sin": (jnp.sin, np.sin, (-100.0, 100.0)),
    "cos": (jnp.cos, np.cos, (-100.0, 100.0)),
    "gelu_tanh": (lambda x: jax.nn.gelu(x, approximate=True),
                  lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))), (-6.0, 6.0)),
}


def ulps(ours: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|ours - exact| in units of the float32 spacing at the exact answer (at 1e-3 where |exact| is smaller: near a
    zero of the function, an absolute error the size of its neighbours' rounding is not a failure)."""
    spacing = np.spacing(np.maximum(np.abs(exact), 1e-3).astype(np.float32)).astype(np.float64)
    return np.abs(ours.astype(np.float64) - exact) / spacing


def main() -> None:
    rng = np.random.default_rng(0)
    backend = jax.default_backend()
    for name, (fn, ref, (lo, hi)) in OPS.items():
        x = rng.uniform(lo, hi, 1 << 20).astype(np.float32)
        err = ulps(np.asarray(jax.jit(fn)(x)), ref(x.astype(np.float64)))
        print(f"{backend} {name:<12} max {err.max():9.1f} ulp  mean {err.mean():7.3f} ulp")
    a = rng.standard_normal((256, 1024)).astype(np.float32)
    b = rng.standard_normal((1024, 256)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    for precision in ("default", "high", "highest"):
        with jax.default_matmul_precision(precision):
            ours = np.asarray(jax.jit(jnp.matmul)(a, b))
        rel = np.abs(ours - exact).max() / np.abs(exact).max()
        print(f"{backend} matmul {precision:<8} max relative error {rel:.2e}")
    x = rng.standard_normal(1 << 20).astype(np.float32)
    total = float(jax.jit(jnp.sum)(x))
    print(f"{backend} sum of 2^20   relative error {abs(total - x.astype(np.float64).sum()) / np.abs(x).sum():.2e}")


if __name__ == "__main__":
    main()
