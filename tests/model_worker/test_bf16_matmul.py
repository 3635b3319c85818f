"""bfloat16 matmul precision (`quant.Bf16Weight`, `bf16_linear`, `params.with_bf16_matmuls`) against an
independent float64 reference on operands rounded by `ml_dtypes` (the bfloat16 numpy type jax itself uses).

Exactness: bfloat16 has 8 significant bits, so the product of two bfloat16 values (16 bits) is exact in float32,
and y = Σ_k bf16(x_k) · bf16(W_nk) differs from its float64 value only by float32 summation:
|y - y_exact| <= (K + 2) * 2^-24 * (|bf16(x)| @ |bf16(W)|ᵀ) (the same rigorous bound as test_int8). The bound is
small enough to fail when either operand is not rounded (checked below), and it holds for both paths of
`bf16_linear` (one row on CPU: the weight converted to float32 in front of a float32 product; several rows: a
bfloat16 GEMM), so a row's result does not depend on its batch beyond float32 summation order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from families.gemma3.worker import GEMMA3_270M, gemma3_layers
from model_worker.modeling.params import random_flat, to_device, with_bf16_matmuls
from model_worker.numerics.quant import Bf16Weight, Int4Weight, Int8Weight, bf16_linear, linear

pytestmark = pytest.mark.slow  # compiles model programs or reads a reference: outside `make test-fast`


def _bf16(a: np.ndarray) -> np.ndarray:
    """Round to nearest-even bfloat16, back as float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _within_bound(y: np.ndarray, x: np.ndarray, w_nk: np.ndarray) -> tuple[bool, float]:
    """(y meets the float32 summation bound around bf16(x) @ bf16(W)ᵀ, the largest error / bound)."""
    xr, wr = _bf16(x), _bf16(w_nk)
    exact = xr @ wr.T
    bound = (x.shape[-1] + 2) * 2.0**-24 * (np.abs(xr) @ np.abs(wr).T)
    ratio = float(np.max(np.abs(y - exact) / np.maximum(bound, 1e-30)))
    return ratio <= 1.0, ratio


@pytest.mark.parametrize("rows", [1, 2, 16, 64])
@pytest.mark.parametrize("n,k", [(96, 64), (1000, 640)])
def test_bf16_linear_rounds_both_operands_and_sums_in_float32(rows, n, k):
    rng = np.random.default_rng(rows + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w_kn = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    weight = Bf16Weight.of(jnp.asarray(w_kn))
    assert weight.shape == (n, k) and weight.w.dtype == jnp.bfloat16
    y = np.asarray(jax.jit(bf16_linear)(x, weight), np.float64)
    assert y.shape == (rows, n)
    ok, ratio = _within_bound(y, x, w_kn.T)
    assert ok, f"error / bound = {ratio:.2f}"
    # the same rows through `linear` inside a larger batch (always the GEMM path) meet the same bound
    again = jax.jit(linear)(np.concatenate([x, x[::-1]]), weight)
    assert again.dtype == jnp.float32 and _within_bound(np.asarray(again, np.float64)[:rows], x, w_kn.T)[0]


@pytest.mark.parametrize("rows", [1, 4])
def test_bf16_activations_give_the_requested_output_dtype(rows):
    """With bfloat16 activations (`--dtype bfloat16`) the output is bfloat16 unless `out_dtype` asks for float32
    (the LM head's logits), and the float32 output still meets the bound."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 96)) * 0.05).astype(np.float32)
    weight, xb = Bf16Weight.of(jnp.asarray(w)), jnp.asarray(x, jnp.bfloat16)
    assert bf16_linear(xb, weight).dtype == jnp.bfloat16 and bf16_linear(jnp.asarray(x), weight).dtype == jnp.float32
    y = bf16_linear(xb, weight, out_dtype=jnp.float32)
    assert y.dtype == jnp.float32 and _within_bound(np.asarray(y, np.float64), x, w.T)[0]


def test_bf16_weight_of_rejects_what_it_cannot_round():
    with pytest.raises(TypeError, match="2-D dense weight or an Int8Weight"):
        Bf16Weight.of(jnp.ones(8))
    with pytest.raises(TypeError, match="Int4Weight"):
        Bf16Weight.of(Int4Weight(jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1), jnp.bfloat16), None, 8, 8))


def test_the_bound_catches_an_unrounded_operand():
    """Exact float32 operands (no rounding) miss bf16(x) @ bf16(W)ᵀ by far more than the bound: the tests above
    would fail if either rounding were skipped."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 640)).astype(np.float32)
    w = (rng.standard_normal((256, 640)) * 0.05).astype(np.float32)
    for xs, ws in ((x, _bf16(w)), (_bf16(x), w)):
        ok, ratio = _within_bound(np.asarray(xs, np.float64) @ np.asarray(ws, np.float64).T, x, w)
        assert not ok and ratio > 2, ratio


def test_an_int8_weight_becomes_its_exact_values_rounded_to_bf16():
    rng = np.random.default_rng(2)
    q = rng.integers(-128, 128, (48, 64), dtype=np.int8)
    scale = rng.uniform(1e-3, 2e-2, (48, 2)).astype(np.float32)
    offset = rng.uniform(-0.1, 0.1, (48, 2)).astype(np.float32)
    exact = (q.reshape(48, 2, 32) * scale[..., None] + offset[..., None]).reshape(48, 64)
    weight = Bf16Weight.of(Int8Weight(jnp.asarray(q), jnp.asarray(scale), jnp.asarray(offset), 32))
    assert np.array_equal(np.asarray(weight.w, np.float64), _bf16(exact))


def test_with_bf16_matmuls_converts_the_projections_and_adds_a_head_copy():
    cfg = dataclasses.replace(GEMMA3_270M, vocab_size=512, hidden_size=256, num_heads=2, embed_scale=16.0,
                              layers=gemma3_layers(2, 128, 1, 512, 1e6, pattern=2), sliding_window=8)
    params = to_device(cfg, random_flat(cfg), jnp.float32)
    converted = with_bf16_matmuls(params)
    names = ("q", "k", "v", "o", "gate", "up", "down")
    for before, after in zip(params.layers, converted.layers):
        for name in names:
            w, b = getattr(before, name), getattr(after, name)
            assert isinstance(b, Bf16Weight) and b.shape == w.shape[::-1]
            assert np.array_equal(np.asarray(b.w, np.float64), _bf16(np.asarray(w).T))
        assert after.input_norm is before.input_norm and after.q_norm is before.q_norm
    assert converted.embed is params.embed and converted.final_norm is params.final_norm
    assert params.lm_head is None and converted.lm_head.shape == params.embed.shape  # tied head: [V, H]
    assert np.array_equal(np.asarray(converted.lm_head.w, np.float64), _bf16(np.asarray(params.embed)))
    linear_bytes = sum(getattr(lp, n).nbytes for lp in params.layers for n in names)
    assert converted.nbytes() - params.nbytes() == params.embed.nbytes // 2 - linear_bytes // 2  # f32 -> bf16
    int4 = Int4Weight(jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1), jnp.bfloat16), None, 8, 8)
    kept = with_bf16_matmuls(dataclasses.replace(params, layers=[dataclasses.replace(params.layers[0], up=int4)]))
    assert kept.layers[0].up is int4
    again = with_bf16_matmuls(converted)  # idempotent
    assert again.lm_head is converted.lm_head and again.layers[1].q is converted.layers[1].q


def test_gemma4_projections_convert_and_the_forward_stays_close(tmp_path):
    """A tiny Gemma 4 (KV-shared layers without k/v, PLE gate and projection): every projection it has becomes a
    Bf16Weight, absent ones stay None, and its logits stay within bfloat16 rounding of the float32 forward."""
    from model_worker.checkpoints.hf_loader import load_checkpoint
    from model_worker.modeling.kv_cache import KVCache
    from model_worker.modeling.model import forward_jit
    from tests.gemma4_tiny import SHARED, write_checkpoint

    write_checkpoint(SHARED, tmp_path)
    cfg, flat = load_checkpoint(tmp_path, jnp.float32)
    params = to_device(cfg, flat, jnp.float32)
    converted = with_bf16_matmuls(params)
    for before, after in zip(params.layers, converted.layers):
        for name in ("q", "k", "v", "o", "gate", "up", "down", "ple_gate", "ple_proj"):
            w = getattr(before, name)
            assert (getattr(after, name) is None) if w is None else isinstance(getattr(after, name), Bf16Weight)
    assert any(lp.k is None for lp in params.layers) and params.layers[0].ple_gate is not None
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 12)).astype(np.int32)
    positions = np.arange(12, dtype=np.int32)[None]
    run = lambda p: np.asarray(forward_jit(p, tokens, positions, KVCache.zeros(cfg, 1, 16, jnp.float32), None,
                                           cfg=cfg, kv_len=16)[0])
    ref, ours = run(params), run(converted)
    assert ours.dtype == np.float32
    # Mean |Δlogit| relative to the mean |logit|: measured 0.024 for this random model (bfloat16 activations and
    # weights throughout, `--dtype bfloat16`, give 0.046 on it); a wrong weight or orientation gives O(1).
    rel = np.abs(ours - ref).mean() / np.abs(ref).mean()
    assert 0 < rel < 2**-4, rel


def test_the_flags_reach_the_worker_and_resolve_to_the_default_mode():
    """`gemma-serve up --matmul-precision ... --[no-]batch-invariant` passes both flags to the worker process, whose
    parser takes them; the default (auto, not given) resolves to int8 products for a GGUF model with float32
    activations on one device (the CPU default), to batch-invariant bfloat16 for a checkpoint or a split over
    devices, to nothing to choose with bfloat16 activations, and an impossible combination is refused."""
    from gemma_serve.cli import build_parser
    from gemma_serve.launcher import service_commands
    from model_worker.modeling.params import matmul_mode

    parser = build_parser()

    def worker_args(*flags):
        worker = service_commands(parser.parse_args(["up", *flags]))["worker"]
        args = parser.parse_args(worker[worker.index("worker"):])
        assert args.command == "worker"
        return args.matmul_precision, args.batch_invariant

    assert worker_args() == ("auto", None)
    assert worker_args("--matmul-precision", "bfloat16", "--no-batch-invariant") == ("bfloat16", False)
    assert worker_args("--matmul-precision", "float32") == ("float32", None)
    assert worker_args("--batch-invariant") == ("auto", True)
    assert matmul_mode("auto", None, "float32") == ("int8", True)
    assert matmul_mode("auto", None, "float32", gguf=False) == ("bfloat16", True)
    assert matmul_mode("auto", None, "float32", tensor_parallel=2) == ("bfloat16", True)
    assert matmul_mode("bfloat16", False, "float32") == ("bfloat16", False)
    assert matmul_mode("float32", None, "float32") == ("float32", False)
    assert matmul_mode("auto", None, "bfloat16") == ("bfloat16", False)
    for bad in (("float32", True, "float32"), ("auto", True, "bfloat16")):
        with pytest.raises(ValueError, match="--batch-invariant needs"):
            matmul_mode(*bad)
    with pytest.raises(ValueError, match="unknown matmul precision"):
        matmul_mode("float16", None, "float32")
