"""The error bounds the sampler's exactness arguments rest on, measured on the backend the tests run on (this
host's CPU in `make test`; the chip in the device lane, where the sampler must match the reference's bits as
well): `sampling._exp_error()`, the most a float32 `exp` may err relative to the true value of its argument, is
what lets top-p be decided on a row's candidates (`sampling._nucleus_in_candidates`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model_worker.modeling.sampling import _exp_error


def _relative_error(ours: np.ndarray, x: np.ndarray) -> float:
    exact = np.exp(x.astype(np.float64))
    return float(np.max(np.abs(ours.astype(np.float64) - exact) / exact))


def test_float32_exp_stays_within_the_samplers_bound():
    """Arguments from -87 (exp still normal) to 0, as `exp(z - max)` sees them: a plain elementwise exp and the
    softmax shape the reference compiles (exp of the row minus its maximum, then the row's sum, in one program:
    XLA may fuse it differently) both err by less than this backend's `_exp_error()` (observed on XLA CPU: 1.6
    ulps, its bound allows 32; on a TPU v5e 6.5e-6, its bound 2**-14)."""
    rng = np.random.default_rng(0)
    rows = np.concatenate([np.linspace(-87.0, 0.0, 1 << 20), rng.uniform(-87.0, 0.0, 1 << 20)]).astype(np.float32)
    x = rows.reshape(16, -1)
    x[:, 0] = 0.0  # each row's maximum is 0: exp(x - max) is exp(x)
    plain = np.asarray(jax.jit(jnp.exp)(jnp.asarray(x)))

    @jax.jit
    def softmax_shape(v):
        e = jnp.exp(v - jnp.max(v, axis=-1, keepdims=True))
        return e, jnp.sum(e, axis=-1)

    fused, _ = softmax_shape(jnp.asarray(x))
    worst = max(_relative_error(plain, x), _relative_error(np.asarray(fused), x))
    print(f"{jax.default_backend()}: float32 exp's largest relative error {worst:.3g} ({worst / 2**-24:.1f} ulp at "
          f"most); the bound {_exp_error():.3g}")
    assert worst < _exp_error()
