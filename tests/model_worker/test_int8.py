"""GGUF Q8_0 kept as int8 (`Int8Weight`): bytes decoded against the `gguf` library's own quantizer and
dequantizer, the blocked LM-head matmul against a float64 reference with the rigorous float32 dot error bound
|y - y_exact| <= (K + 2) * 2^-24 * (|x| @ |W|ᵀ), and the model's embedding/LM head against the dense table.

Exactness: a Q8_0 value is d * q with d an f16 (11 significant bits) and |q| <= 127 (7 bits), so the product has
at most 18 significant bits and is exact in float32; hence our dequantized values equal the library's bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from model_worker.config import GEMMA3_270M, gemma3_layers
from model_worker.kv_cache import KVCache
from model_worker.model import forward_jit
from model_worker.params import Params, random_flat, to_device
from model_worker.quant import (
    Int8Weight,
    _dequant_int8,
    int8_from_flat,
    int8_from_q8_0,
    int8_linear,
    int8_to_flat,
)


def q8_0(rng: np.random.Generator, n: int, k: int, scale: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(Q8_0 bytes [n, k/32*34], the library's dequantization float32 [n, k]) of a random matrix."""
    raw = quants.quantize((scale * rng.standard_normal((n, k))).astype(np.float32), GGMLQuantizationType.Q8_0)
    return raw, np.asarray(quants.dequantize(raw, GGMLQuantizationType.Q8_0), np.float32)


def dense_of(w: Int8Weight) -> np.ndarray:
    return np.asarray(_dequant_int8(jnp.asarray(w.q), jnp.asarray(w.scale), w.group_size, jnp.float32))


def test_q8_0_bytes_decode_exactly_as_the_library():
    raw, ref = q8_0(np.random.default_rng(0), 48, 96)
    w = int8_from_q8_0(raw, (48, 96))
    assert w.q.dtype == np.int8 and w.scale.dtype == np.float32 and w.group_size == 32
    assert w.shape == (48, 96) and w.nbytes == 48 * 96 + 48 * 3 * 4
    np.testing.assert_array_equal(dense_of(w), ref)
    with pytest.raises(ValueError, match="does not hold"):
        int8_from_q8_0(raw, (48, 64))


def dot_bound(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x Wᵀ in float64, the float32 summation error bound)."""
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    return exact, (w.shape[1] + 2) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)


@pytest.mark.parametrize("lead", [(1,), (3,), (8,), (2, 5)])
@pytest.mark.parametrize("block_bytes", [1 << 30, 40 * 64 * 4, 24 * 64 * 4])  # one block; 5 blocks; 7 (padded)
def test_int8_linear_matches_float64_within_the_float32_bound(lead, block_bytes):
    rng = np.random.default_rng(1)
    raw, ref = q8_0(rng, 200, 64)
    w = jax.tree.map(jnp.asarray, int8_from_q8_0(raw, (200, 64)))
    x = rng.standard_normal((*lead, 64)).astype(np.float32)
    y = np.asarray(jax.jit(lambda x, w: int8_linear(x, w, block_bytes=block_bytes))(jnp.asarray(x), w))
    exact, bound = dot_bound(x.reshape(-1, 64), ref)
    assert y.shape == (*lead, 200) and y.dtype == np.float32
    assert np.all(np.abs(y.reshape(-1, 200) - exact) <= bound)


def test_int8_linear_rejects_a_wrong_width():
    raw, _ = q8_0(np.random.default_rng(2), 8, 64)
    with pytest.raises(ValueError, match="32 features"):
        int8_linear(jnp.zeros((1, 32)), jax.tree.map(jnp.asarray, int8_from_q8_0(raw, (8, 64))))


def test_rows_are_the_dequantized_rows_and_flat_round_trip():
    raw, ref = q8_0(np.random.default_rng(3), 40, 64)
    w = int8_from_q8_0(raw, (40, 64))
    ids = jnp.array([[0, 39, 7], [7, 7, 1]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(jax.tree.map(jnp.asarray, w).rows(ids, jnp.float32)), ref[np.asarray(ids)])
    flat = int8_to_flat({"embed": w, "final_norm": np.ones(64, np.float32)})
    assert sorted(flat) == ["embed.q8", "embed.q8_scale", "final_norm"]
    back = int8_from_flat(flat)["embed"]
    assert back.group_size == 32 and np.array_equal(back.q, w.q) and np.array_equal(back.scale, w.scale)
    with pytest.raises(ValueError, match="needs both"):
        int8_from_flat({"embed.q8": w.q})
    with pytest.raises(ValueError, match="do not match"):
        int8_from_flat({"embed.q8": w.q, "embed.q8_scale": w.scale[:, :1].repeat(3, axis=1)})


def test_forward_with_int8_embedding_equals_the_dense_table():
    """Embedding lookup and tied LM head through an Int8Weight give the dense table's logits (same values; only
    the LM head's summation order differs)."""
    cfg = dataclasses.replace(GEMMA3_270M, vocab_size=512, hidden_size=64, num_heads=2, embed_scale=8.0,
                              layers=gemma3_layers(2, 32, 1, 128, 1e6, pattern=2), sliding_window=8)
    flat = random_flat(cfg, seed=4)
    raw, ref = q8_0(np.random.default_rng(5), cfg.vocab_size, cfg.hidden_size)
    dense = to_device(cfg, flat | {"embed": ref}, jnp.float32)
    packed = to_device(cfg, int8_to_flat(flat | {"embed": int8_from_q8_0(raw, ref.shape)}), jnp.float32)
    assert isinstance(packed.embed, Int8Weight) and packed.embed.q.dtype == jnp.int8
    assert dense.nbytes() - packed.nbytes() == ref.nbytes - packed.embed.nbytes
    tokens = jnp.array([[1, 5, 300, 511], [2, 9, 0, 0]], jnp.int32)
    positions = jnp.array([[0, 1, 2, 3], [0, 1, -1, -1]], jnp.int32)
    out = [forward_jit(p, tokens, positions, KVCache.zeros(cfg, 2, 16, jnp.float32), None, cfg, 16)[0]
           for p in (dense, packed)]
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(out[0]), rtol=0, atol=1e-4)


def test_embedded_model_keeps_its_q8_0_embedding_as_int8(gemma3):
    cfg, params = gemma3
    assert isinstance(params, Params) and isinstance(params.embed, Int8Weight)
    assert params.embed.shape == (cfg.vocab_size, cfg.hidden_size) and params.embed.q.dtype == jnp.int8
